//! The catalog of a storage root: runs are its directories, checkpoints the directories of a run.
//! A checkpoint directory with a manifest is committed; a `step-<N>` directory without one is an
//! incomplete save, listed as such and never served as loadable; other directories are ignored.
//! Listings and `latest` pointers are reused for [`ServerConfig::catalog_ttl`]; opened
//! metadata lives in a cache bounded by bytes, so that the thousands of ranks of one job never
//! make the server read a checkpoint's metadata more than once.
//!
//! [`ServerConfig::catalog_ttl`]: crate::ServerConfig::catalog_ttl

use std::sync::Arc;

use futures::{StreamExt, TryStreamExt};
use moka::future::Cache;
use moka::policy::EvictionPolicy;
use object_store::ObjectStore;
use object_store::path::Path;
use serde::{Deserialize, Serialize};
use tessera_metadata::formats::native::{
    Created, DataPresence, LATEST_FILE, Manifest, ManifestBlob, ManifestFile, read_latest,
    read_manifest, step_from_dir_name,
};
use tessera_metadata::{
    CheckpointMeta, Format, MetadataError, OpenOptions, OpenedCheckpoint as Opened, TensorMeta,
    open_any,
};
use utoipa::ToSchema;

use crate::error::unshare;
use crate::id::{LATEST, is_valid_segment, truncate};
use crate::metrics::{CacheKind, Metrics};
use crate::{ApiError, CheckpointId, ServerConfig};

/// Runs listed at once, and checkpoint manifests read at once per run: enough to hide object
/// store latency (~20 ms a request) in catalogs of hundreds of checkpoints, few enough not to
/// look like a flood to the store.
const LIST_CONCURRENCY: usize = 8;
const MANIFEST_CONCURRENCY: usize = 16;

/// Whether a checkpoint can be loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointStatus {
    /// The manifest is there: loadable.
    Committed,
    /// A `step-<N>` directory without a manifest: a save that did not finish.
    Incomplete,
    /// A manifest that cannot be read (see `error`).
    Invalid,
}

/// One checkpoint of the catalog.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CheckpointEntry {
    /// `<run>/<name>`.
    pub id: String,
    /// Run (directory under the root).
    pub run: String,
    /// Checkpoint directory name.
    pub name: String,
    /// Training step: the manifest's, else the one in a `step-<N>` name.
    pub step: Option<u64>,
    /// Committed, incomplete or invalid.
    pub status: CheckpointStatus,
    /// Whether it is committed (loadable).
    pub committed: bool,
    /// Whether the run's `latest` pointer names it.
    pub latest: bool,
    /// Checkpoint format (`tessera` for the native format); absent when not committed.
    pub format: Option<String>,
    /// Commit time, RFC 3339 (or Unix seconds as a decimal string, when recorded so).
    pub created: Option<String>,
    /// `present`, or `absent` for a metadata-only checkpoint.
    pub data: Option<String>,
    /// Bytes stored: data files (when present) plus the metadata files.
    pub bytes: Option<u64>,
    /// Bytes of all tensors, each element counted once.
    pub tensor_bytes: Option<u64>,
    /// Number of tensors.
    pub tensors: Option<u64>,
    /// Why an invalid checkpoint cannot be read.
    pub error: Option<String>,
}

/// One run of the catalog.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RunEntry {
    /// Run name.
    pub run: String,
    /// Id of the checkpoint its `latest` pointer names.
    pub latest: Option<String>,
    /// Checkpoints listed (any status).
    pub checkpoints: u64,
}

/// `GET /v1/checkpoints`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CatalogResponse {
    /// Runs, by name.
    pub runs: Vec<RunEntry>,
    /// Checkpoints, by run then step.
    pub checkpoints: Vec<CheckpointEntry>,
}

/// `GET /v1/checkpoints/{run}/{step}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CheckpointSummary {
    /// The catalog entry (for `<run>/latest`, the checkpoint it resolves to).
    #[serde(flatten)]
    pub entry: CheckpointEntry,
    /// Number of saved boxes.
    pub chunks: Option<u64>,
    /// Number of non-tensor objects.
    pub objects: Option<u64>,
    /// Number of data files.
    pub files: Option<u64>,
    /// Checksum block size in bytes.
    pub block_size: Option<u64>,
    /// The layout the checkpoint was saved with (layout JSON), when recorded.
    #[schema(value_type = Option<Object>)]
    pub source_layout: Option<serde_json::Value>,
}

/// A tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TensorEntry {
    /// Fully-qualified name.
    pub fqn: String,
    /// Element type (`bf16`, `f32`, ...).
    pub dtype: String,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Bytes of the whole tensor.
    pub bytes: u64,
    /// Saved boxes.
    pub boxes: u64,
}

/// `GET /v1/checkpoints/{run}/{step}/tensors`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TensorPage {
    /// Checkpoint id.
    pub checkpoint: String,
    /// Tensors matching the filter.
    pub total: u64,
    /// Index of the first tensor returned.
    pub offset: u64,
    /// Most tensors returned.
    pub limit: u64,
    /// This page, in checkpoint order.
    pub tensors: Vec<TensorEntry>,
}

/// A saved box of a tensor and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SavedBox {
    /// Box start in global coordinates.
    pub offsets: Vec<u64>,
    /// Box extent.
    pub lengths: Vec<u64>,
    /// Data file, relative to the checkpoint.
    pub file: String,
    /// First byte in the file.
    pub byte_offset: u64,
    /// Bytes (`byte_offset..byte_offset + byte_length`).
    pub byte_length: u64,
    /// Element strides; absent for row-major.
    pub strides: Option<Vec<u64>>,
    /// crc32c of the box's bytes, when recorded.
    pub crc32c: Option<u32>,
}

/// `GET /v1/checkpoints/{run}/{step}/tensors/{fqn}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TensorDetail {
    /// Checkpoint id.
    pub checkpoint: String,
    /// The tensor.
    #[serde(flatten)]
    pub tensor: TensorEntry,
    /// Its saved boxes.
    pub saved: Vec<SavedBox>,
}

/// A committed checkpoint read from storage: manifest and validated metadata.
#[derive(Debug)]
pub(crate) struct OpenedCheckpoint {
    pub id: CheckpointId,
    pub manifest: Manifest,
    pub meta: Arc<CheckpointMeta>,
    weight: u32,
}

/// The catalog of one root, with its caches.
pub(crate) struct Catalog {
    store: Arc<dyn ObjectStore>,
    root: Path,
    metrics: Arc<Metrics>,
    listing: Cache<(), Arc<CatalogResponse>>,
    latest: Cache<String, Option<String>>,
    meta: Cache<CheckpointId, Arc<OpenedCheckpoint>>,
}

impl Catalog {
    pub(crate) fn new(
        store: Arc<dyn ObjectStore>,
        root: Path,
        config: &ServerConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            store,
            root,
            metrics,
            listing: Cache::builder()
                .max_capacity(1)
                .time_to_live(config.catalog_ttl)
                .build(),
            latest: Cache::builder()
                .max_capacity(100_000)
                .time_to_live(config.catalog_ttl)
                .build(),
            // LRU: the checkpoint a job plans against now matters more than one read often
            // last week (TinyLFU admission could refuse the new one and read it again per request).
            meta: Cache::builder()
                .max_capacity(config.meta_cache_bytes)
                .weigher(|_, v: &Arc<OpenedCheckpoint>| v.weight)
                .time_to_live(config.meta_ttl)
                .eviction_policy(EvictionPolicy::lru())
                .build(),
        }
    }

    pub(crate) fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    pub(crate) fn root(&self) -> &Path {
        &self.root
    }

    /// Entries and estimated bytes of the metadata cache (after pending evictions).
    pub(crate) async fn meta_usage(&self) -> (u64, u64) {
        self.meta.run_pending_tasks().await;
        (self.meta.entry_count(), self.meta.weighted_size())
    }

    pub(crate) fn invalidate_all(&self) {
        self.listing.invalidate_all();
        self.latest.invalidate_all();
        self.meta.invalidate_all();
    }

    /// The whole catalog.
    pub(crate) async fn list(&self) -> Result<Arc<CatalogResponse>, ApiError> {
        let entry = self
            .listing
            .entry(())
            .or_try_insert_with(async { scan(self.store.as_ref(), &self.root).await.map(Arc::new) })
            .await
            .map_err(unshare)?;
        self.metrics.cache(CacheKind::Catalog, !entry.is_fresh());
        Ok(entry.into_value())
    }

    /// The step directory `run/latest` names, or the id itself when it is not `latest`.
    pub(crate) async fn resolve(&self, id: &CheckpointId) -> Result<CheckpointId, ApiError> {
        if !id.is_latest() {
            return Ok(id.clone());
        }
        match self.latest_of(id.run()).await? {
            Some(step) => id
                .with_step(&step)
                .map_err(|e| ApiError::InvalidCheckpoint {
                    id: id.to_string(),
                    reason: format!("the run's latest pointer is not a checkpoint name: {e}"),
                }),
            None => Err(ApiError::UnknownCheckpoint { id: id.to_string() }),
        }
    }

    /// The step directory name in `run/latest` (cached for the catalog TTL).
    async fn latest_of(&self, run: &str) -> Result<Option<String>, ApiError> {
        let prefix = CheckpointId::from_parts(run, LATEST)?.run_prefix(&self.root);
        let entry = self
            .latest
            .entry(run.to_string())
            .or_try_insert_with(async {
                read_latest(self.store.as_ref(), &prefix)
                    .await
                    .map_err(|e| ApiError::from_metadata(&format!("{run}/{LATEST}"), &e))
            })
            .await
            .map_err(unshare)?;
        self.metrics.cache(CacheKind::Latest, !entry.is_fresh());
        Ok(entry.into_value())
    }

    /// Opens the committed checkpoint `id` (resolving `latest`), from the cache when it can.
    /// A directory without a manifest is [`ApiError::IncompleteCheckpoint`]; no directory at
    /// all is [`ApiError::UnknownCheckpoint`].
    pub(crate) async fn open(&self, id: &CheckpointId) -> Result<Arc<OpenedCheckpoint>, ApiError> {
        let id = self.resolve(id).await?;
        let prefix = id.prefix(&self.root);
        let result = self
            .meta
            .entry(id.clone())
            .or_try_insert_with(async {
                self.metrics.metadata_load();
                // Native, PyTorch DCP or safetensors: whatever the directory holds.
                let options = OpenOptions {
                    block_checksums: false,
                    ..OpenOptions::default()
                };
                // The foreign-format opener's future is not provably `Send` (rustc's
                // higher-ranked lifetime limits with borrowed streams), so it runs to completion
                // on a blocking thread driving this runtime.
                let store = Arc::clone(&self.store);
                let owned_prefix = prefix.clone();
                let handle = tokio::runtime::Handle::current();
                let opened = tokio::task::spawn_blocking(move || {
                    handle.block_on(open_any(store.as_ref(), &owned_prefix, &options))
                })
                .await
                .map_err(|e| MetadataError::Invalid {
                    what: format!("opening {prefix}: {e}"),
                })??;
                let manifest = match opened.manifest() {
                    Some(manifest) => manifest.clone(),
                    None => foreign_manifest(&opened),
                };
                let meta = Arc::new(opened.meta);
                Ok::<_, MetadataError>(Arc::new(OpenedCheckpoint {
                    id: id.clone(),
                    weight: weight(&meta, &manifest),
                    manifest,
                    meta,
                }))
            })
            .await;
        match result {
            Ok(entry) => {
                self.metrics.cache(CacheKind::Metadata, !entry.is_fresh());
                Ok(entry.into_value())
            }
            // Nothing stored there is an unknown checkpoint whatever the opener made of it.
            Err(_) if !self.exists(&prefix).await? => {
                Err(ApiError::UnknownCheckpoint { id: id.to_string() })
            }
            Err(error) => Err(ApiError::from_metadata(&id.to_string(), &error)),
        }
    }

    /// Whether anything is stored under `prefix`.
    async fn exists(&self, prefix: &Path) -> Result<bool, ApiError> {
        match self.store.list(Some(prefix)).next().await {
            None => Ok(false),
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) => Err(ApiError::storage(format!("listing {prefix}"), &e)),
        }
    }

    /// The summary of checkpoint `id`: committed (from its metadata) or incomplete.
    pub(crate) async fn summary(&self, id: &CheckpointId) -> Result<CheckpointSummary, ApiError> {
        let resolved = self.resolve(id).await?;
        let latest = self.latest_of(resolved.run()).await.ok().flatten();
        let is_latest = latest.as_deref() == Some(resolved.step());
        match self.open(&resolved).await {
            Ok(opened) => {
                let manifest = &opened.manifest;
                Ok(CheckpointSummary {
                    entry: committed_entry(&resolved, manifest, is_latest),
                    chunks: Some(manifest.chunks),
                    objects: Some(manifest.objects),
                    files: Some(manifest.files.len() as u64),
                    block_size: Some(manifest.block_size),
                    source_layout: manifest.source_layout.clone(),
                })
            }
            Err(ApiError::IncompleteCheckpoint { .. }) => Ok(CheckpointSummary {
                entry: incomplete_entry(&resolved, is_latest),
                chunks: None,
                objects: None,
                files: None,
                block_size: None,
                source_layout: None,
            }),
            Err(e) => Err(e),
        }
    }
}

/// Estimated bytes held by an opened checkpoint: the rows of its metadata and manifest. Only a
/// weight for the cache's bound, so it counts heap payloads and typical struct sizes, not
/// allocator slack.
fn weight(meta: &CheckpointMeta, manifest: &Manifest) -> u32 {
    let tensors: u64 = meta
        .tensors()
        .iter()
        .map(|t| 64 + t.fqn.len() as u64 + 8 * t.shape.len() as u64)
        .sum();
    let chunks: u64 = meta
        .chunks()
        .iter()
        .map(|c| 120 + c.bytes.strides.as_ref().map_or(0, |s| 8 * s.len() as u64))
        .sum();
    let objects: u64 = meta.objects().iter().map(|o| 64 + o.key.len() as u64).sum();
    let files: u64 = meta
        .files()
        .iter()
        .map(|f| 48 + 2 * f.path.len() as u64)
        .sum();
    let layout = manifest
        .source_layout
        .as_ref()
        .map_or(0, |l| 4 * l.to_string().len() as u64);
    u32::try_from(1024 + tensors + chunks + objects + files + layout).unwrap_or(u32::MAX)
}

fn created_text(created: &Created) -> String {
    match created {
        Created::Rfc3339(text) => text.clone(),
        Created::UnixSeconds(secs) => secs.to_string(),
    }
}

fn committed_entry(id: &CheckpointId, manifest: &Manifest, latest: bool) -> CheckpointEntry {
    let present = manifest.data == DataPresence::Present;
    let metadata_bytes = manifest.metadata.size + manifest.checksums.as_ref().map_or(0, |c| c.size);
    let data_bytes: u64 = if present {
        manifest.files.iter().map(|f| f.size).sum()
    } else {
        0
    };
    CheckpointEntry {
        id: id.to_string(),
        run: id.run().to_string(),
        name: id.step().to_string(),
        step: manifest.step.or_else(|| step_from_dir_name(id.step())),
        status: CheckpointStatus::Committed,
        committed: true,
        latest,
        format: Some(manifest.format.clone()),
        created: Some(created_text(&manifest.created)),
        data: Some(if present { "present" } else { "absent" }.to_string()),
        bytes: Some(data_bytes + metadata_bytes),
        tensor_bytes: Some(manifest.tensor_bytes),
        tensors: Some(manifest.tensors),
        error: None,
    }
}

/// A manifest-shaped description of a checkpoint in a foreign format (DCP, safetensors), so
/// the catalog and plan ids treat every format alike. Its `metadata.crc32c` is a version stamp:
/// crc32c over the data files' paths and sizes and the chunk count, which changes when the
/// checkpoint is rewritten.
fn foreign_manifest(opened: &Opened) -> Manifest {
    let meta = &opened.meta;
    let mut stamp =
        crc32c::crc32c(format!("{:?}:{}", opened.format, meta.chunks().len()).as_bytes());
    let files: Vec<ManifestFile> = meta
        .files()
        .iter()
        .map(|f| {
            let size = f.size.unwrap_or(0);
            stamp = crc32c::crc32c_append(stamp, format!("{}:{size};", f.path).as_bytes());
            ManifestFile {
                path: f.path.clone(),
                size,
            }
        })
        .collect();
    Manifest {
        format: format_name(opened.format).to_string(),
        format_version: 0,
        step: opened.step,
        created: Created::UnixSeconds(0),
        source_layout: None,
        data: DataPresence::Present,
        block_size: 0,
        files,
        metadata: ManifestBlob {
            path: String::new(),
            size: 0,
            crc32c: stamp,
        },
        checksums: None,
        tensors: meta.tensors().len() as u64,
        chunks: meta.chunks().len() as u64,
        objects: meta.objects().len() as u64,
        tensor_bytes: meta.tensor_bytes(),
    }
}

fn format_name(format: Format) -> &'static str {
    match format {
        Format::Native => "tessera",
        Format::Dcp => "dcp",
        Format::Safetensors => "safetensors",
    }
}

/// The catalog row of a directory without manifest.json that holds a foreign-format checkpoint:
/// a DCP save (its `.metadata` or per-rank `__<r>.metadata`, written last) or safetensors files.
/// Only a listing is read; tensor counts come with the first open.
async fn foreign_entry(
    store: &dyn ObjectStore,
    dir: &Path,
    id: &CheckpointId,
    latest: bool,
) -> Result<Option<CheckpointEntry>, ApiError> {
    let listing = store
        .list_with_delimiter(Some(dir))
        .await
        .map_err(|e| ApiError::storage(format!("listing {dir}"), &e))?;
    let names: Vec<&str> = listing
        .objects
        .iter()
        .filter_map(|o| o.location.filename())
        .collect();
    let format = if names
        .iter()
        .any(|n| *n == ".metadata" || (n.starts_with("__") && n.ends_with(".metadata")))
    {
        "dcp"
    } else if names
        .iter()
        .any(|n| n.ends_with(".safetensors") || *n == "model.safetensors.index.json")
        || listing
            .common_prefixes
            .iter()
            .any(|p| p.filename() == Some("sharded"))
    {
        "safetensors"
    } else {
        return Ok(None);
    };
    let created = listing
        .objects
        .iter()
        .map(|o| o.last_modified)
        .max()
        .map(|t| t.to_rfc3339());
    Ok(Some(CheckpointEntry {
        status: CheckpointStatus::Committed,
        committed: true,
        format: Some(format.to_string()),
        created,
        data: Some("present".to_string()),
        bytes: Some(listing.objects.iter().map(|o| o.size).sum()),
        ..incomplete_entry(id, latest)
    }))
}

fn incomplete_entry(id: &CheckpointId, latest: bool) -> CheckpointEntry {
    CheckpointEntry {
        id: id.to_string(),
        run: id.run().to_string(),
        name: id.step().to_string(),
        step: step_from_dir_name(id.step()),
        status: CheckpointStatus::Incomplete,
        committed: false,
        latest,
        format: None,
        created: None,
        data: None,
        bytes: None,
        tensor_bytes: None,
        tensors: None,
        error: None,
    }
}

/// Lists the root: runs, then each run's checkpoint directories and `latest` pointer.
async fn scan(store: &dyn ObjectStore, root: &Path) -> Result<CatalogResponse, ApiError> {
    let top = store
        .list_with_delimiter(Some(root))
        .await
        .map_err(|e| ApiError::storage(format!("listing {root}"), &e))?;
    let runs: Vec<(String, Path)> = top
        .common_prefixes
        .into_iter()
        .filter_map(|prefix| {
            let name = prefix.filename()?.to_string();
            is_valid_segment(&name).then_some((name, prefix))
        })
        .collect();
    let mut scanned: Vec<(RunEntry, Vec<CheckpointEntry>)> = futures::stream::iter(runs)
        .map(|(run, prefix)| scan_run(store, run, prefix))
        .buffer_unordered(LIST_CONCURRENCY)
        .try_collect()
        .await?;
    scanned.sort_by(|a, b| a.0.run.cmp(&b.0.run));
    let mut response = CatalogResponse {
        runs: Vec::with_capacity(scanned.len()),
        checkpoints: Vec::new(),
    };
    for (run, checkpoints) in scanned {
        response.runs.push(run);
        response.checkpoints.extend(checkpoints);
    }
    Ok(response)
}

async fn scan_run(
    store: &dyn ObjectStore,
    run: String,
    prefix: Path,
) -> Result<(RunEntry, Vec<CheckpointEntry>), ApiError> {
    let listing = store
        .list_with_delimiter(Some(&prefix))
        .await
        .map_err(|e| ApiError::storage(format!("listing {prefix}"), &e))?;
    let has_pointer = listing
        .objects
        .iter()
        .any(|o| o.location.filename() == Some(LATEST_FILE));
    let latest = if has_pointer {
        match read_latest(store, &prefix).await {
            Ok(Some(step)) if is_valid_segment(&step) => Some(step),
            Ok(_) => None,
            Err(MetadataError::Store {
                action,
                path,
                source,
            }) => {
                return Err(ApiError::storage(format!("{action} {path}"), &source));
            }
            Err(e) => {
                tracing::warn!(%run, error = %e, "unreadable latest pointer");
                None
            }
        }
    } else {
        None
    };
    let dirs: Vec<(String, Path)> = listing
        .common_prefixes
        .into_iter()
        .filter_map(|p| {
            let name = p.filename()?.to_string();
            is_valid_segment(&name).then_some((name, p))
        })
        .collect();
    let run_ref = &run;
    let latest_ref = &latest;
    let mut checkpoints: Vec<CheckpointEntry> = futures::stream::iter(dirs)
        .map(|(name, dir)| async move {
            let id = CheckpointId::from_parts(run_ref, &name)?;
            let is_latest = latest_ref.as_deref() == Some(name.as_str());
            match read_manifest(store, &dir).await {
                Ok(manifest) => Ok(Some(committed_entry(&id, &manifest, is_latest))),
                Err(MetadataError::MissingManifest { .. }) => {
                    match foreign_entry(store, &dir, &id, is_latest).await? {
                        Some(entry) => Ok(Some(entry)),
                        None => Ok(step_from_dir_name(&name)
                            .is_some()
                            .then(|| incomplete_entry(&id, is_latest))),
                    }
                }
                Err(MetadataError::Store {
                    action,
                    path,
                    source,
                }) => Err(ApiError::storage(format!("{action} {path}"), &source)),
                Err(e) => Ok(Some(CheckpointEntry {
                    status: CheckpointStatus::Invalid,
                    error: Some(truncate(&e.to_string())),
                    ..incomplete_entry(&id, is_latest)
                })),
            }
        })
        .buffer_unordered(MANIFEST_CONCURRENCY)
        .try_filter_map(|entry| async move { Ok(entry) })
        .try_collect()
        .await?;
    checkpoints.sort_by(|a, b| {
        (a.step.unwrap_or(u64::MAX), &a.name).cmp(&(b.step.unwrap_or(u64::MAX), &b.name))
    });
    let run_entry = RunEntry {
        latest: latest.map(|step| format!("{run}/{step}")),
        checkpoints: checkpoints.len() as u64,
        run,
    };
    Ok((run_entry, checkpoints))
}

/// A tensor's catalog row.
pub(crate) fn tensor_entry(meta: &CheckpointMeta, index: u32) -> TensorEntry {
    let tensor: &TensorMeta = &meta.tensors()[index as usize];
    TensorEntry {
        fqn: tensor.fqn.clone(),
        dtype: tensor.dtype.to_string(),
        shape: tensor.shape.clone(),
        bytes: tensor.nbytes(),
        boxes: meta.chunks_of(index).len() as u64,
    }
}

/// A tensor's saved boxes with their files and byte ranges.
pub(crate) fn saved_boxes(meta: &CheckpointMeta, index: u32) -> Vec<SavedBox> {
    meta.chunks_of(index)
        .iter()
        .map(|chunk| SavedBox {
            offsets: chunk.region.offsets.to_vec(),
            lengths: chunk.region.lengths.to_vec(),
            file: meta
                .files()
                .get(chunk.bytes.file as usize)
                .map(|f| f.path.clone())
                .unwrap_or_default(),
            byte_offset: chunk.bytes.offset,
            byte_length: chunk.bytes.length,
            strides: chunk.bytes.strides.clone(),
            crc32c: chunk.crc32c,
        })
        .collect()
}
