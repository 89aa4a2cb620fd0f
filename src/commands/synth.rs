//! `tessera synth`: write a synthetic checkpoint saved with a layout.

use anyhow::Result;
use tessera_metadata::formats::native::DataPresence;

use crate::human;
use tessera_storage as storage;
use tessera_synth::{SynthOptions, synthesize};

/// Writes the checkpoint and returns the report printed at the end.
pub async fn run(out: &str, layout_path: &str, options: &SynthOptions) -> Result<String> {
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
    let data = match manifest.data {
        DataPresence::Present => "with data",
        DataPresence::Absent => "metadata only",
    };
    Ok(format!(
        "wrote {} ({}, {data}): {} tensors, {} saved boxes, {} files, {} of tensors, metadata {}",
        out,
        options.model,
        manifest.tensors,
        manifest.chunks,
        manifest.files.len(),
        human::bytes(manifest.tensor_bytes),
        human::bytes(manifest.metadata.size),
    ))
}
