//! Synthetic checkpoints: a model's tensors saved as a layout would save them, with values from
//! the documented formula of `tessera_metadata::synth`, so any later load can be checked without
//! the source. Replicated boxes are written once, balanced over their holders.

use std::time::Instant;

use anyhow::{Context, Result};
use futures::StreamExt;
use tessera_metadata::native::{Manifest, NativeWriter, WriteOptions, WrittenFile};
use tessera_metadata::synth::{self, Model};
use tessera_planner::{Layout, WriteItem, assign_writers};

use crate::human;
use tessera_storage::Location;

/// Options of [`synthesize`].
#[derive(Clone, Debug)]
pub struct SynthOptions {
    /// The model.
    pub model: Model,
    /// Include optimizer states (master, exp_avg, exp_avg_sq).
    pub optimizer: bool,
    /// Write metadata only (for models too large to materialize).
    pub metadata_only: bool,
    /// Training step recorded in the manifest.
    pub step: Option<u64>,
    /// Print progress to stderr.
    pub progress: bool,
}

/// Writes a synthetic checkpoint of `options.model` saved with `layout` at `out`.
pub async fn synthesize(
    out: &Location,
    layout: &Layout,
    options: &SynthOptions,
) -> Result<Manifest> {
    let tensors = synth::tensors(&options.model.config(), options.optimizer);
    let holdings = layout
        .resolve(&tensors)
        .context("resolving the save layout against the model")?;
    let writes = assign_writers(&tensors, &holdings)?;
    let writer = NativeWriter::create(
        out.store.clone(),
        out.prefix.clone(),
        tensors.clone(),
        WriteOptions {
            step: options.step,
            source_layout: Some(serde_json::to_value(layout)?),
            metadata_only: options.metadata_only,
            ..WriteOptions::default()
        },
    )
    .await
    .with_context(|| format!("starting checkpoint {}", out.display))?;
    let started = Instant::now();
    let world = writes.len();
    let mut jobs = Vec::with_capacity(world);
    for (rank, items) in writes.into_iter().enumerate() {
        let file = writer.data_file(&format!("rank-{rank:05}"))?;
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
        let written = written.with_context(|| format!("writing rank {rank}'s data file"))?;
        if options.progress {
            eprintln!(
                "  rank {rank:>5}: {} in {} ({}/{world} files, {:.1}s)",
                written.path(),
                human::bytes(written.size()),
                files.len() + 1,
                started.elapsed().as_secs_f64()
            );
        }
        files.push((rank, written));
    }
    files.sort_by_key(|(rank, _)| *rank);
    let manifest = writer
        .commit(files.into_iter().map(|(_, f)| f).collect())
        .await
        .with_context(|| format!("committing checkpoint {}", out.display))?;
    Ok(manifest)
}

async fn write_rank(
    mut file: tessera_metadata::native::DataFileWriter,
    tensors: Vec<tessera_metadata::TensorMeta>,
    items: Vec<WriteItem>,
    metadata_only: bool,
) -> Result<WrittenFile> {
    for item in items {
        if metadata_only {
            file.write_box_metadata_only(item.tensor, item.region)?;
            continue;
        }
        let tensor = tensors[item.tensor as usize].clone();
        let region = item.region.clone();
        let bytes = tokio::task::spawn_blocking(move || synth::box_bytes(&tensor, &region))
            .await
            .context("generating box values")??;
        file.write_box(item.tensor, item.region, &bytes).await?;
    }
    Ok(file.finish().await?)
}
