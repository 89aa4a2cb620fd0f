//! Synthetic checkpoints written to storage: a model's tensors saved as a layout would save them,
//! with values from the formula (crate docs), so any later load can be checked without the source.
//! Replicated boxes are written once, balanced over their holders (the planner's
//! `assign_writers`).

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use object_store::ObjectStore;
use object_store::path::Path;
use tessera_metadata::formats::native::{
    DataFileWriter, Manifest, NativeWriter, WriteOptions, WrittenFile,
};
use tessera_metadata::{MetadataError, TensorMeta, flat_range_of_box};
use tessera_planner::{Layout, assign_writers};

use crate::dist_optimizer::{WriteEntry, dist_optimizer_writes};
use crate::{Model, SynthError, box_bytes, tensors};

/// One data file written, for progress reports.
#[derive(Clone, Debug)]
pub struct FileWritten {
    /// The writing rank.
    pub rank: usize,
    /// The file's path relative to the checkpoint.
    pub path: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// Files written so far, this one included.
    pub done: usize,
    /// Files in all.
    pub total: usize,
    /// Since the write started.
    pub elapsed: Duration,
}

/// Called after each data file is written.
pub type ProgressFn = Arc<dyn Fn(&FileWritten) + Send + Sync>;

/// Options of [`synthesize`].
#[derive(Clone)]
pub struct SynthOptions {
    /// The model.
    pub model: Model,
    /// Include optimizer states (master, exp_avg, exp_avg_sq).
    pub optimizer: bool,
    /// Write metadata only (for models too large to materialize).
    pub metadata_only: bool,
    /// Save the optimizer states the way Megatron-Core's distributed optimizer does: each
    /// data-parallel rank (over the mesh dim named here, usually `"dp"`) writes flat ranges of
    /// the TP-local boxes, its contiguous part of their flattening laid end to end (see
    /// `dist_optimizer.rs`). The save layout must replicate the optimizer states over that dim.
    /// `None`: every tensor is saved as the layout's boxes.
    pub dist_optimizer: Option<String>,
    /// Training step recorded in the manifest.
    pub step: Option<u64>,
    /// Called after each data file is written (never with `metadata_only`, which writes none).
    pub progress: Option<ProgressFn>,
}

impl std::fmt::Debug for SynthOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SynthOptions")
            .field("model", &self.model)
            .field("optimizer", &self.optimizer)
            .field("metadata_only", &self.metadata_only)
            .field("dist_optimizer", &self.dist_optimizer)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

/// Writes a synthetic checkpoint of `options.model` saved with `layout` at `prefix` of `store`;
/// messages name it `display` (the location as the user gave it).
pub async fn synthesize(
    store: Arc<dyn ObjectStore>,
    prefix: &Path,
    display: &str,
    layout: &Layout,
    options: &SynthOptions,
) -> Result<Manifest, SynthError> {
    let tensors = tensors(&options.model.config(), options.optimizer);
    let holdings = layout.resolve(&tensors)?;
    let writes: Vec<Vec<WriteEntry>> = match &options.dist_optimizer {
        Some(dim) => dist_optimizer_writes(&tensors, layout, &holdings, dim)?,
        None => assign_writers(&tensors, &holdings)?
            .into_iter()
            .map(|items| items.into_iter().map(WriteEntry::Box).collect())
            .collect(),
    };
    let at = |what: &str| format!("{what} checkpoint {display}");
    let writer = NativeWriter::create(
        store,
        prefix.clone(),
        tensors.clone(),
        WriteOptions {
            step: options.step,
            source_layout: serde_json::to_value(layout).ok(),
            metadata_only: options.metadata_only,
            ..WriteOptions::default()
        },
    )
    .await
    .map_err(SynthError::writing(at("starting")))?;
    let started = Instant::now();
    let world = writes.len();
    let mut jobs = Vec::with_capacity(world);
    for (rank, items) in writes.into_iter().enumerate() {
        let file = writer
            .data_file(&format!("rank-{rank:05}"))
            .map_err(SynthError::writing(at("starting a data file of")))?;
        jobs.push(write_rank(
            file,
            tensors.clone(),
            items,
            options.metadata_only,
        ));
    }
    // Two files at a time: box generation is CPU-bound and the machine has few cores.
    let mut files: Vec<(usize, WrittenFile)> = Vec::with_capacity(world);
    let mut stream = futures::stream::iter(
        jobs.into_iter()
            .enumerate()
            .map(|(rank, job)| async move { (rank, job.await) }),
    )
    .buffer_unordered(2);
    while let Some((rank, written)) = stream.next().await {
        let written =
            written.map_err(|e| e.in_context(format!("writing rank {rank}'s data file")))?;
        // A metadata-only save writes no data files (only their sizes go into the metadata):
        // reporting each as written would be thousands of lines about files that do not exist.
        if let Some(progress) = options.progress.as_ref().filter(|_| !options.metadata_only) {
            progress(&FileWritten {
                rank,
                path: written.path().to_string(),
                bytes: written.size(),
                done: files.len() + 1,
                total: world,
                elapsed: started.elapsed(),
            });
        }
        files.push((rank, written));
    }
    files.sort_by_key(|(rank, _)| *rank);
    let manifest = writer
        .commit(files.into_iter().map(|(_, f)| f).collect())
        .await
        .map_err(SynthError::writing(at("committing")))?;
    Ok(manifest)
}

async fn write_rank(
    mut file: DataFileWriter,
    tensors: Vec<TensorMeta>,
    items: Vec<WriteEntry>,
    metadata_only: bool,
) -> Result<WrittenFile, SynthError> {
    let wrap = |e: MetadataError| SynthError::Write {
        context: "writing a box".to_string(),
        inner: Box::new(e),
    };
    for item in items {
        match item {
            WriteEntry::Box(item) => {
                if metadata_only {
                    file.write_box_metadata_only(item.tensor, item.region)
                        .map_err(wrap)?;
                    continue;
                }
                let tensor = tensors[item.tensor as usize].clone();
                let region = item.region.clone();
                let bytes = tokio::task::spawn_blocking(move || box_bytes(&tensor, &region))
                    .await
                    .map_err(|e| SynthError::Task {
                        detail: e.to_string(),
                    })??;
                file.write_box(item.tensor, item.region, &bytes)
                    .await
                    .map_err(wrap)?;
            }
            WriteEntry::Flat {
                tensor: t,
                parent,
                start,
                end,
            } => {
                if metadata_only {
                    file.write_flat_metadata_only(t, parent, start, end)
                        .map_err(wrap)?;
                    continue;
                }
                let tensor = tensors[t as usize].clone();
                let range_parent = parent.clone();
                // The range's elements in flat order are those of the boxes that tile it, one
                // after the other: generate only them, not the whole TP-local box.
                let bytes = tokio::task::spawn_blocking(move || {
                    let mut out = Vec::new();
                    for (_, tile) in flat_range_of_box(&range_parent, start, end) {
                        out.extend(box_bytes(&tensor, &tile)?);
                    }
                    Ok::<_, SynthError>(out)
                })
                .await
                .map_err(|e| SynthError::Task {
                    detail: e.to_string(),
                })??;
                file.write_flat(t, parent, start, end, &bytes)
                    .await
                    .map_err(wrap)?;
            }
        }
    }
    file.finish().await.map_err(wrap)
}
