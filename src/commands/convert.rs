//! `tessera convert`: re-save a checkpoint (native, PyTorch DCP or safetensors) in another layout
//! (native format, manifest last, replicas balanced over writers), or export it as consolidated
//! HF-style safetensors shards.

use std::collections::BTreeMap;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use object_store::{ObjectStoreExt, PutPayload};
use serde_json::json;
use tessera_loader::load::{Checkpoint, LoadOptions, LoadedRank, load_rank};
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::InProcTransport;
use tessera_loader::transport::TransportOptions;
use tessera_metadata::formats::native::{NativeWriter, WriteOptions};
use tessera_metadata::formats::safetensors::{self, TensorView};
use tessera_planner::{Layout, PlanOptions, Target, assign_writers};
use tessera_storage::RetryPolicy;

use crate::human;

/// Loads every rank of `layout` in this process, reading with `retry`.
async fn load_all(
    checkpoint: &Checkpoint,
    layout: &Layout,
    retry: &RetryPolicy,
) -> Result<Vec<LoadedRank>> {
    let options = LoadOptions {
        read: ReadOptions {
            retry: retry.clone(),
            ..ReadOptions::default()
        },
        progress: None,
    };
    let requests = layout.resolve(checkpoint.meta.tensors())?;
    let plan = checkpoint.plan(&requests, &PlanOptions::default())?;
    let transports = InProcTransport::mesh(plan.world_size(), TransportOptions::default());
    let mut tasks = Vec::new();
    for (rank, transport) in transports.into_iter().enumerate() {
        let rank_plan = plan.rank_plan(rank as u32)?;
        let checkpoint = checkpoint.clone();
        let options = options.clone();
        tasks.push(tokio::spawn(async move {
            load_rank(&checkpoint, rank_plan, &transport, &options).await
        }));
    }
    let mut loaded = Vec::with_capacity(tasks.len());
    for (rank, task) in tasks.into_iter().enumerate() {
        loaded.push(
            task.await
                .with_context(|| format!("rank {rank} task"))?
                .with_context(|| format!("loading rank {rank}"))?,
        );
    }
    Ok(loaded)
}

/// `tessera convert CKPT --layout L --out DIR`: the checkpoint saved as layout L would save it.
/// Both checkpoints' stores get `retry`'s timeouts.
pub async fn to_layout(
    source: &str,
    layout_path: &str,
    out: &str,
    retry: &RetryPolicy,
) -> Result<String> {
    let checkpoint = open(source, retry).await?;
    let layout = super::read_layout(layout_path)?;
    let loaded = load_all(&checkpoint, &layout, retry).await?;
    let tensors = checkpoint.meta.tensors().to_vec();
    let holdings = layout.resolve(&tensors)?;
    let writes = assign_writers(&tensors, &holdings)?;
    let target = tessera_storage::create_with(out, &super::storage_options(retry))?;
    let writer = NativeWriter::create(
        Arc::clone(&target.store),
        target.prefix.clone(),
        tensors.clone(),
        WriteOptions {
            step: checkpoint.step,
            source_layout: Some(serde_json::to_value(&layout)?),
            ..WriteOptions::default()
        },
    )
    .await
    .with_context(|| format!("starting checkpoint {out}"))?;
    let mut files = Vec::with_capacity(writes.len());
    for (rank, items) in writes.iter().enumerate() {
        let mut file = writer.data_file(&format!("rank-{rank:05}"))?;
        let rank_loaded = &loaded[rank];
        for item in items {
            let Some(d) = rank_loaded.plan.destinations.iter().position(|d| {
                rank_loaded.plan.tensors[d.tensor as usize].fqn == tensors[item.tensor as usize].fqn
                    && d.target == Target::Box(item.region.clone())
            }) else {
                bail!(
                    "rank {rank} was assigned {} {} but did not load it",
                    tensors[item.tensor as usize].fqn,
                    item.region
                );
            };
            file.write_box(item.tensor, item.region.clone(), &rank_loaded.buffers[d])
                .await?;
        }
        if rank == 0 {
            // Non-tensor objects ride along in rank 0's file.
            for object in checkpoint.meta.objects() {
                let path = object_path(&checkpoint, object.file)?;
                let bytes = checkpoint
                    .location
                    .store
                    .get_range(&path, object.offset..object.offset + object.length)
                    .await
                    .with_context(|| format!("reading object {}", object.key))?;
                file.write_object(&object.key, &bytes).await?;
            }
        }
        files.push(file.finish().await?);
        abort_if_fault_injected(files.len());
    }
    let manifest = writer
        .commit(files)
        .await
        .with_context(|| format!("committing {out}"))?;
    Ok(format!(
        "converted {source} to {out}: {} tensors, {} saved boxes in {} files, {}\n",
        manifest.tensors,
        manifest.chunks,
        manifest.files.len(),
        human::bytes(manifest.tensor_bytes)
    ))
}

/// Fault injection for tests: `TESSERA_FAULT_ABORT_AFTER_FILES=N` kills the process (abort, like
/// a SIGKILL: no cleanup, no unwinding) once N data files are written, to show that an interrupted
/// save never becomes visible as a checkpoint.
fn abort_if_fault_injected(files_written: usize) {
    let Ok(limit) = std::env::var("TESSERA_FAULT_ABORT_AFTER_FILES") else {
        return;
    };
    if limit
        .trim()
        .parse::<usize>()
        .is_ok_and(|n| files_written >= n)
    {
        eprintln!(
            "TESSERA_FAULT_ABORT_AFTER_FILES={limit}: aborting after {files_written} data files"
        );
        std::process::abort();
    }
}

fn object_path(checkpoint: &Checkpoint, file: u32) -> Result<object_store::path::Path> {
    let relative = &checkpoint.meta.files()[file as usize].path;
    let mut path = checkpoint.location.prefix.clone();
    for part in relative.split('/') {
        path = path.join(part);
    }
    Ok(path)
}

/// `tessera convert CKPT --format safetensors --out DIR`: consolidated full tensors in shards of
/// at most `max_shard_bytes`, plus `model.safetensors.index.json` (written last).
pub async fn to_safetensors(
    source: &str,
    out: &str,
    max_shard_bytes: u64,
    retry: &RetryPolicy,
) -> Result<String> {
    let checkpoint = open(source, retry).await?;
    let everything =
        Layout::from_json(r#"{"mesh": [], "rules": [{"match": "*", "placements": []}]}"#)?;
    let loaded = load_all(&checkpoint, &everything, retry).await?;
    let rank = &loaded[0];
    let plan = &rank.plan;
    // Group tensors (in checkpoint order) into shards.
    let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
    let mut size = 0u64;
    for (d, buffer) in rank.buffers.iter().enumerate() {
        if size > 0 && size + buffer.len() as u64 > max_shard_bytes {
            shards.push(Vec::new());
            size = 0;
        }
        size += buffer.len() as u64;
        if let Some(shard) = shards.last_mut() {
            shard.push(d);
        }
    }
    let target = tessera_storage::create_with(out, &super::storage_options(retry))?;
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (k, shard) in shards.iter().enumerate() {
        let name = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        let shapes: Vec<Vec<u64>> = shard
            .iter()
            .map(|&d| plan.destinations[d].target.buffer_shape())
            .collect();
        let views: Vec<TensorView<'_>> = shard
            .iter()
            .zip(&shapes)
            .map(|(&d, shape)| TensorView {
                name: &plan.tensors[plan.destinations[d].tensor as usize].fqn,
                dtype: plan.tensors[plan.destinations[d].tensor as usize].dtype,
                shape,
                data: &rank.buffers[d],
            })
            .collect();
        for v in &views {
            weight_map.insert(v.name.to_string(), name.clone());
            total += v.data.len() as u64;
        }
        let mut metadata = BTreeMap::new();
        metadata.insert("format".to_string(), "pt".to_string());
        let bytes = safetensors::serialize(&views, Some(&metadata))?;
        target
            .store
            .put(
                &target.prefix.clone().join(name.as_str()),
                PutPayload::from(bytes),
            )
            .await
            .with_context(|| format!("writing {out}/{name}"))?;
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    target
        .store
        .put(
            &target.prefix.clone().join("model.safetensors.index.json"),
            PutPayload::from(serde_json::to_vec_pretty(&index)?),
        )
        .await
        .with_context(|| format!("writing {out}/model.safetensors.index.json"))?;
    Ok(format!(
        "exported {source} to {out}: {} tensors, {} in {n} safetensors shard(s) + model.safetensors.index.json\n",
        weight_map.len(),
        human::bytes(total)
    ))
}

/// Opens the source in any format (native, PyTorch DCP, safetensors). Foreign formats are read
/// without verification: they record no checksums a partial read could be checked against.
async fn open(source: &str, retry: &RetryPolicy) -> Result<Checkpoint> {
    let checkpoint = super::open_for_load(source, retry).await?;
    if !checkpoint.has_data {
        bail!("{source}: a metadata-only checkpoint has no data to convert");
    }
    Ok(checkpoint)
}
