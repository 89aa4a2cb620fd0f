//! `tessera synth`: write a synthetic checkpoint saved with a layout.

use anyhow::Result;
use serde::Serialize;
use tessera_metadata::formats::native::DataPresence;

use crate::human;
use tessera_storage as storage;
use tessera_synth::{SynthOptions, synthesize};

/// What `synth` wrote: printed as a line of text, or with `--json` as one JSON document (these
/// field names).
#[derive(Clone, Debug, Serialize)]
pub struct SynthReport {
    /// The checkpoint directory as given.
    pub out: String,
    /// The synthetic model.
    pub model: String,
    /// Whether data files were written (false with `--metadata-only`).
    pub data: bool,
    /// Tensors.
    pub tensors: u64,
    /// Saved boxes.
    pub boxes: u64,
    /// Files written (data files with data; metadata files only without).
    pub files: u64,
    /// Bytes of all tensors.
    pub tensor_bytes: u64,
    /// Bytes of the metadata file.
    pub metadata_bytes: u64,
}

impl SynthReport {
    /// The report as one line of text.
    pub fn text(&self) -> String {
        format!(
            "wrote {} ({}, {}): {} tensors, {} saved boxes, {} files, {} of tensors, metadata {}",
            self.out,
            self.model,
            if self.data {
                "with data"
            } else {
                "metadata only"
            },
            self.tensors,
            self.boxes,
            self.files,
            human::bytes(self.tensor_bytes),
            human::bytes(self.metadata_bytes),
        )
    }
}

/// Writes the checkpoint and returns the report printed at the end.
pub async fn run(out: &str, layout_path: &str, options: &SynthOptions) -> Result<SynthReport> {
    let layout = super::read_layout(layout_path)?;
    let location = storage::create(out)?;
    let manifest = synthesize(
        location.store.clone(),
        &location.prefix,
        &location.display,
        &layout,
        options,
    )
    .await?;
    Ok(SynthReport {
        out: out.to_string(),
        model: options.model.to_string(),
        data: manifest.data == DataPresence::Present,
        tensors: manifest.tensors,
        boxes: manifest.chunks,
        files: manifest.files.len() as u64,
        tensor_bytes: manifest.tensor_bytes,
        metadata_bytes: manifest.metadata.size,
    })
}
