//! `tessera convert`: re-save a checkpoint (native, PyTorch DCP or safetensors) in another layout
//! (native format, manifest last, replicas balanced over writers), or export it as consolidated
//! HF-style safetensors shards.
//!
//! Both take the output's write claim (`tessera_ops::claim`) before writing anything and drop it
//! after the commit or the failure, so a second writer into the same `--out` fails at once naming
//! the first. A convert that fails removes what it created on local disk ([`Leftovers`]). What a
//! killed convert leaves and how to resume is in `docs/writers.md`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use futures::TryStreamExt;
use object_store::{ObjectStoreExt, PutPayload};
use serde::Serialize;
use serde_json::json;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, LoadedRank, load_rank};
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::InProcTransport;
use tessera_loader::transport::TransportOptions;
use tessera_metadata::formats::native::{NativeWriter, WriteOptions};
use tessera_metadata::formats::safetensors::{self, INDEX_FILE, TensorView};
use tessera_ops::claim::{Claim, ClaimOptions};
use tessera_planner::{Layout, PlanOptions, Target, assign_writers};
use tessera_storage::{Location, RetryPolicy};

use super::select::{Selection, TensorFilter};
use crate::human;

/// Loads every rank of `layout` in this process: the tensors `selection` takes, or all of them.
async fn load_all(
    checkpoint: &Checkpoint,
    layout: &Layout,
    retry: &RetryPolicy,
    selection: Option<&Selection>,
) -> Result<Vec<LoadedRank>> {
    let options = LoadOptions {
        read: ReadOptions {
            retry: retry.clone(),
            ..ReadOptions::default()
        },
        progress: None,
        ..LoadOptions::default()
    };
    let mut requests = layout.resolve(checkpoint.meta.tensors())?;
    if let Some(selection) = selection {
        selection.retain(&mut requests);
    }
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

/// Options of both conversions.
#[derive(Clone, Debug, Default)]
pub struct ConvertOptions {
    /// Remove a stale write claim on `--out` (its writer is dead) and write anyway.
    pub break_claim: bool,
    /// Timeouts and attempts of both checkpoints' stores.
    pub retry: RetryPolicy,
    /// Convert only the tensors and plain values this takes (`--include`, `--exclude`).
    pub filter: TensorFilter,
}

/// What a conversion wrote: printed as a line of text, or with `--json` as one JSON document
/// (these field names).
#[derive(Clone, Debug, Serialize)]
pub struct ConvertReport {
    /// The source checkpoint as given.
    pub source: String,
    /// The output location as given.
    pub out: String,
    /// `native` or `safetensors`.
    pub format: &'static str,
    /// Tensors written.
    pub tensors: u64,
    /// Saved boxes written (native; for safetensors one per tensor).
    pub boxes: u64,
    /// Data files written (native data files, or safetensors shards).
    pub files: u64,
    /// Bytes of tensor data written.
    pub tensor_bytes: u64,
    /// What was done besides (a broken claim, stale uploads removed).
    pub notes: Vec<String>,
}

impl ConvertReport {
    /// The report as text: the notes, then one line.
    pub fn text(&self) -> String {
        let mut out: String = self.notes.iter().map(|n| format!("{n}\n")).collect();
        match self.format {
            "safetensors" => out.push_str(&format!(
                "exported {} to {}: {} tensors, {} in {} safetensors shard(s) + model.safetensors.index.json\n",
                self.source,
                self.out,
                self.tensors,
                human::bytes(self.tensor_bytes),
                self.files
            )),
            _ => out.push_str(&format!(
                "converted {} to {}: {} tensors, {} saved boxes in {} files, {}\n",
                self.source,
                self.out,
                self.tensors,
                self.boxes,
                self.files,
                human::bytes(self.tensor_bytes)
            )),
        }
        out
    }
}

/// Runs `write` holding the write claim on `out`, and drops the claim afterwards whatever the
/// outcome. A process that dies inside `write` leaves the claim (see the module docs); one whose
/// convert fails removes what it created on local disk first ([`Leftovers`]).
async fn claimed<F, Fut>(out: &str, options: &ConvertOptions, write: F) -> Result<ConvertReport>
where
    F: FnOnce(Location) -> Fut,
    Fut: std::future::Future<Output = Result<ConvertReport>>,
{
    let mut leftovers = Leftovers::before_writing(out);
    let outcome = claimed_by(out, options, write, &mut leftovers).await;
    if outcome.is_err() {
        leftovers.remove_directories();
    }
    outcome
}

async fn claimed_by<F, Fut>(
    out: &str,
    options: &ConvertOptions,
    write: F,
    leftovers: &mut Leftovers,
) -> Result<ConvertReport>
where
    F: FnOnce(Location) -> Fut,
    Fut: std::future::Future<Output = Result<ConvertReport>>,
{
    // Opened as tessera.save opens its output (tessera_ops::save): the same retries of transient
    // write failures (claim, one-request files, metadata, manifest, `latest`).
    let (target, _) =
        tessera_ops::save::open_for_writing(out, &super::storage_options(&options.retry), None)?;
    let claim = Claim::take(
        &target,
        "tessera convert",
        &ClaimOptions {
            break_existing: options.break_claim,
            ..ClaimOptions::default()
        },
    )
    .await
    .with_context(|| format!("claiming {out} for writing"))?;
    let mut notes = Vec::new();
    if let Some(holder) = &claim.broke {
        notes.push(format!("broke the write claim of {holder}"));
    }
    for staged in &claim.removed_staged {
        notes.push(format!(
            "removed {staged}: an unfinished upload of an interrupted writer"
        ));
    }
    leftovers.claimed();
    let outcome = write(target).await;
    if outcome.is_err() {
        // Under the claim: no other writer has files here that this one could take for its own.
        leftovers.remove_files();
    }
    let released = claim
        .release()
        .await
        .with_context(|| format!("removing the write claim of {out}"));
    let mut report = outcome?;
    released?;
    notes.append(&mut report.notes);
    report.notes = notes;
    Ok(report)
}

/// `tessera convert CKPT --layout L --out DIR`: the checkpoint saved as layout L would save it.
pub async fn to_layout(
    source: &str,
    layout_path: &str,
    out: &str,
    options: &ConvertOptions,
) -> Result<ConvertReport> {
    let layout = super::read_layout(layout_path)?;
    claimed(out, options, |target| {
        to_layout_claimed(source, layout, out, target, options)
    })
    .await
}

async fn to_layout_claimed(
    source: &str,
    layout: Layout,
    out: &str,
    target: Location,
    options: &ConvertOptions,
) -> Result<ConvertReport> {
    let checkpoint = open(source, out, &options.retry).await?;
    let all = checkpoint.meta.tensors();
    // Plain values are taken or left by the same patterns as tensors; a filter may leave only
    // plain values (a native checkpoint may hold no tensor).
    let selection = if options.filter.is_everything() {
        None
    } else {
        Some(
            options
                .filter
                .select(all, checkpoint.meta.objects(), source)?,
        )
    };
    let loaded = load_all(&checkpoint, &layout, &options.retry, selection.as_ref()).await?;
    // The layout resolves against every tensor (its stages see every layer); the output then
    // holds only the tensors the filter takes, renumbered in checkpoint order.
    let mut holdings = layout.resolve(all)?;
    let (tensors, holdings) = if let Some(selection) = &selection {
        let mut renumbered = Vec::with_capacity(all.len());
        let mut tensors = Vec::new();
        for (tensor, taken) in all.iter().zip(&selection.tensors) {
            renumbered.push(taken.then(|| tensors.len() as u32));
            if *taken {
                tensors.push(tensor.clone());
            }
        }
        for rank in &mut holdings.ranks {
            rank.retain_mut(|r| match renumbered[r.tensor as usize] {
                Some(t) => {
                    r.tensor = t;
                    true
                }
                None => false,
            });
        }
        (tensors, holdings)
    } else {
        (all.to_vec(), holdings)
    };
    let writes = assign_writers(&tensors, &holdings)?;
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
            for (o, object) in checkpoint.meta.objects().iter().enumerate() {
                if selection
                    .as_ref()
                    .is_some_and(|s| !s.objects.get(o).copied().unwrap_or(false))
                {
                    continue;
                }
                let path = checkpoint.file_path(object.file)?;
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
    Ok(ConvertReport {
        source: source.to_string(),
        out: out.to_string(),
        format: "native",
        tensors: manifest.tensors,
        boxes: manifest.chunks,
        files: manifest.files.len() as u64,
        tensor_bytes: manifest.tensor_bytes,
        notes: Vec::new(),
    })
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

/// Suffix of a shard being written: not `.safetensors`, so no reader takes it for a shard.
const PARTIAL: &str = ".partial";

/// `tessera convert CKPT --format safetensors --out DIR`: consolidated full tensors in shards of
/// at most `max_shard_bytes`, plus `model.safetensors.index.json`, visible only once complete.
///
/// On local disk every shard is written under a temporary name (`<shard>.partial`), then all are
/// renamed into place and the index is written last: a kill while writing leaves no shard a
/// reader sees, a kill while renaming leaves an incomplete `-of-N` set that readers refuse by
/// name. On object stores a rename is a copy, so shards go to their final names and the index,
/// written last, is the commit point.
pub async fn to_safetensors(
    source: &str,
    out: &str,
    max_shard_bytes: u64,
    options: &ConvertOptions,
) -> Result<ConvertReport> {
    claimed(out, options, |target| {
        to_safetensors_claimed(source, out, max_shard_bytes, target, options)
    })
    .await
}

async fn to_safetensors_claimed(
    source: &str,
    out: &str,
    max_shard_bytes: u64,
    target: Location,
    options: &ConvertOptions,
) -> Result<ConvertReport> {
    let local = tessera_storage::local_directory(out).is_some();
    let store = target.store.as_ref();
    if store
        .head(&target.prefix.clone().join(INDEX_FILE))
        .await
        .is_ok()
    {
        bail!(
            "{out} already holds an exported checkpoint ({INDEX_FILE}); export into a new directory"
        );
    }
    // Shards an interrupted export left under temporary names: this export owns the claim.
    let stale: Vec<object_store::path::Path> = store
        .list(Some(&target.prefix))
        .map_ok(|o| o.location)
        .try_filter(|p| std::future::ready(p.as_ref().ends_with(PARTIAL)))
        .try_collect()
        .await
        .with_context(|| format!("listing {out}"))?;
    for path in stale {
        store
            .delete(&path)
            .await
            .with_context(|| format!("removing the stale {path}"))?;
    }
    let checkpoint = open(source, out, &options.retry).await?;
    let everything =
        Layout::from_json(r#"{"mesh": [], "rules": [{"match": "*", "placements": []}]}"#)?;
    // safetensors holds tensors only: a pattern may name plain values (they are left out
    // anyway), but the export needs a tensor.
    let selection = if options.filter.is_everything() {
        None
    } else {
        let meta = &checkpoint.meta;
        let selection = options
            .filter
            .select(meta.tensors(), meta.objects(), source)?;
        if !selection.tensors.contains(&true) {
            bail!(
                "no tensor of {source} is left by {}, and a safetensors export holds only tensors",
                options.filter.describe().join(" ")
            );
        }
        Some(selection)
    };
    let loaded = load_all(&checkpoint, &everything, &options.retry, selection.as_ref()).await?;
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
    let n = shards.len();
    let mut weight_map = BTreeMap::new();
    let mut written = Vec::with_capacity(n);
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
        let staged = if local {
            format!("{name}{PARTIAL}")
        } else {
            name.clone()
        };
        target
            .store
            .put(
                &target.prefix.clone().join(staged.as_str()),
                PutPayload::from(bytes),
            )
            .await
            .with_context(|| format!("writing {out}/{staged}"))?;
        written.push((staged, name));
        abort_if_fault_injected(written.len());
    }
    for (staged, name) in &written {
        if staged != name {
            let (from, to) = (
                target.prefix.clone().join(staged.as_str()),
                target.prefix.clone().join(name.as_str()),
            );
            target
                .store
                .rename(&from, &to)
                .await
                .with_context(|| format!("renaming {out}/{staged} to {name}"))?;
        }
    }
    let index = json!({"metadata": {"total_size": total}, "weight_map": weight_map});
    target
        .store
        .put(
            &target.prefix.clone().join(INDEX_FILE),
            PutPayload::from(serde_json::to_vec_pretty(&index)?),
        )
        .await
        .with_context(|| format!("writing {out}/model.safetensors.index.json"))?;
    Ok(ConvertReport {
        source: source.to_string(),
        out: out.to_string(),
        format: "safetensors",
        tensors: weight_map.len() as u64,
        boxes: weight_map.len() as u64,
        files: n as u64,
        tensor_bytes: total,
        notes: Vec::new(),
    })
}

/// Opens the source in any format (native, PyTorch DCP, safetensors) and verifies all of it as
/// `tessera verify` does before anything is written: a conversion re-checksums what it reads, so
/// corruption it let through would come out the other side as a checkpoint that verifies
/// ("laundered"). The loader checks native block checksums (and whole boxes) as it reads, but
/// DCP's zip CRC-32 covers whole storages that a conversion reads in pieces, and native box crcs
/// cover boxes a new layout splits; one streaming pass over the source checks both, at the cost
/// of reading the source twice.
async fn open(source: &str, out: &str, retry: &RetryPolicy) -> Result<Checkpoint> {
    // A metadata-only source is refused there: it has no data to load.
    let checkpoint = super::open_for_load(source, retry, None).await?;
    super::verify::check(source, super::verify::Strays::Ignore, retry)
        .await
        .with_context(|| {
            format!("verifying {source} before converting it (nothing was written to {out})")
        })?;
    Ok(checkpoint)
}

/// What a convert created on local disk, removed again when it fails: a failed convert leaves
/// nothing it created behind (it used to leave its empty `--out`, or a half-written one). A
/// directory that existed before the command is never removed, nor any file the command did not
/// write. On object stores a failed native convert leaves its data files (no manifest: not a
/// checkpoint) as a killed one does (`docs/writers.md`).
#[derive(Debug, Default)]
struct Leftovers {
    /// `--out` on local disk (`None`: an object store).
    out: Option<PathBuf>,
    /// The outermost of `--out` and its parents that did not exist before the command.
    created: Option<PathBuf>,
    /// Files and directories under `--out` once the claim was taken (the claim among them);
    /// `None` until then.
    claimed_with: Option<BTreeSet<PathBuf>>,
}

impl Leftovers {
    /// Notes what exists before anything is written to `out`.
    fn before_writing(out: &str) -> Leftovers {
        let Some(dir) = tessera_storage::local_directory(out) else {
            return Leftovers::default();
        };
        let mut created = None;
        let mut at = Some(dir.as_path());
        while let Some(path) = at {
            // symlink_metadata: a dangling link exists (it is someone's), it is not created here.
            if path.symlink_metadata().is_ok() {
                break;
            }
            created = Some(path.to_path_buf());
            at = path.parent();
        }
        Leftovers {
            out: Some(dir),
            created,
            claimed_with: None,
        }
    }

    /// Notes what `--out` holds once this command holds its claim: everything else found there
    /// after a failure is this command's.
    fn claimed(&mut self) {
        if let Some(out) = &self.out {
            let mut entries = BTreeSet::new();
            walk(out, &mut entries);
            self.claimed_with = Some(entries);
        }
    }

    /// Removes the files this command wrote under `--out` (staging files of uploads included),
    /// and the directories it made there once empty. Only after [`Leftovers::claimed`] and while
    /// the claim is held.
    fn remove_files(&self) {
        let (Some(out), Some(before)) = (&self.out, &self.claimed_with) else {
            return;
        };
        let mut now = BTreeSet::new();
        walk(out, &mut now);
        // Deepest first, so a directory is empty by the time it is removed.
        let made: Vec<&PathBuf> = now.difference(before).collect();
        for path in made.into_iter().rev() {
            let removed = match path.symlink_metadata() {
                Ok(meta) if meta.is_dir() => std::fs::remove_dir(path),
                Ok(_) => std::fs::remove_file(path),
                Err(_) => continue,
            };
            if let Err(e) = removed {
                eprintln!(
                    "warning: the convert failed, and removing {} it wrote failed too: {e}",
                    path.display()
                );
            }
        }
    }

    /// Removes `--out` and the parents this command created, each only if empty (another writer
    /// that made or filled one since keeps it).
    fn remove_directories(&self) {
        let (Some(out), Some(created)) = (&self.out, &self.created) else {
            return;
        };
        let mut at = Some(out.as_path());
        while let Some(path) = at {
            if std::fs::remove_dir(path).is_err() || path == created {
                break;
            }
            at = path.parent();
        }
    }
}

/// Every file and directory under `dir` (not `dir` itself; links not followed), into `found`.
/// What cannot be read is left out: it is then kept, never removed.
fn walk(dir: &Path, found: &mut BTreeSet<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        found.insert(path.clone());
        if is_dir {
            walk(&path, found);
        }
    }
}
