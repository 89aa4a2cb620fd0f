//! The metadata cache: committed checkpoints opened from storage (any format), bounded by their
//! estimated bytes, so that the thousands of ranks of one job never make the server read a
//! checkpoint's metadata more than once.
//!
//! A checkpoint can be deleted and saved again at the same place, so a cached entry is never
//! answered blind: every use first reads the checkpoint's cheap stamp ([`probe`]: one `head` of
//! its manifest or DCP `.metadata`, a listing for what has neither) and re-reads the metadata when
//! the stamp moved. Failed opens are remembered too (a corrupt or oversized checkpoint is not
//! parsed again on every request), under the same stamp, so that fixing the checkpoint clears
//! them at once.

use std::sync::Arc;

use futures::StreamExt;
use moka::future::Cache;
use moka::policy::EvictionPolicy;
use object_store::path::Path;
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt};
use sha2::{Digest, Sha256};
use tessera_metadata::formats::{bytecheckpoint, dcp, native};
use tessera_metadata::{CheckpointMeta, MetadataError, OpenOptions, open_any};

use super::facts::CheckpointFacts;
use crate::metrics::{CacheKind, Metrics};
use crate::{ApiError, CheckpointId, ServerConfig};

/// Failed opens remembered at most: each is an id and an error message.
const MAX_FAILURES: u64 = 10_000;

/// A committed checkpoint read from storage: its facts and validated metadata.
#[derive(Debug)]
pub(crate) struct OpenedCheckpoint {
    pub id: CheckpointId,
    pub facts: CheckpointFacts,
    pub meta: Arc<CheckpointMeta>,
    /// The [`probe`] stamp read before the metadata was: when it moves, this entry is stale.
    stamp: String,
    weight: u32,
}

/// An open that failed, and the stamp of what it failed on.
#[derive(Debug)]
struct Failure {
    stamp: String,
    error: ApiError,
}

/// Opened checkpoints by id (never `latest`: callers resolve it first).
pub(crate) struct MetaCache {
    store: Arc<dyn ObjectStore>,
    metrics: Arc<Metrics>,
    cache: Cache<CheckpointId, Arc<OpenedCheckpoint>>,
    failures: Cache<CheckpointId, Arc<Failure>>,
}

impl MetaCache {
    pub(crate) fn new(
        store: Arc<dyn ObjectStore>,
        config: &ServerConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            store,
            metrics,
            // LRU: the checkpoint a job plans against now matters more than one read often
            // last week (TinyLFU admission could refuse the new one and read it again per request).
            cache: Cache::builder()
                .max_capacity(config.meta_cache_bytes)
                .weigher(|_, v: &Arc<OpenedCheckpoint>| v.weight)
                .time_to_live(config.meta_ttl)
                .eviction_policy(EvictionPolicy::lru())
                .build(),
            failures: Cache::builder()
                .max_capacity(MAX_FAILURES)
                .time_to_live(config.failure_ttl)
                .build(),
        }
    }

    /// Entries and estimated bytes (after pending evictions).
    pub(crate) async fn usage(&self) -> (u64, u64) {
        self.cache.run_pending_tasks().await;
        (self.cache.entry_count(), self.cache.weighted_size())
    }

    pub(crate) fn invalidate_all(&self) {
        self.cache.invalidate_all();
        self.failures.invalidate_all();
    }

    /// Opens the committed checkpoint `id` stored under `prefix`, from the cache when its stamp
    /// has not moved since it was read. A directory without a manifest is
    /// [`ApiError::IncompleteCheckpoint`]; nothing stored there at all is
    /// [`ApiError::UnknownCheckpoint`]. `changed` is called when a cached entry (or failure)
    /// turns out stale: the checkpoint was saved again, deleted or fixed since.
    pub(crate) async fn open(
        &self,
        id: &CheckpointId,
        prefix: &Path,
        changed: impl Fn(),
    ) -> Result<Arc<OpenedCheckpoint>, ApiError> {
        // Read before the metadata: a save that lands in between leaves an older stamp on the
        // entry, and the next request reads it again.
        let stamp = probe(self.store.as_ref(), prefix).await?;
        if let Some(entry) = self.cache.get(id).await {
            if entry.stamp == stamp {
                self.metrics.cache(CacheKind::Metadata, true);
                return Ok(entry);
            }
            tracing::info!(%id, "checkpoint changed on storage since it was read: reading it again");
            self.cache.invalidate(id).await;
            changed();
        }
        if let Some(failure) = self.failures.get(id).await {
            if failure.stamp == stamp {
                self.metrics.cache(CacheKind::Metadata, true);
                return Err(failure.error.clone());
            }
            self.failures.invalidate(id).await;
            changed();
        }
        let result = self
            .cache
            .entry(id.clone())
            .or_try_insert_with(self.read(id, prefix, stamp.clone()))
            .await;
        let error = match result {
            Ok(entry) => {
                self.metrics.cache(CacheKind::Metadata, !entry.is_fresh());
                return Ok(entry.into_value());
            }
            // Nothing stored there is an unknown checkpoint whatever the opener made of it.
            Err(_) if !self.exists(prefix).await? => {
                ApiError::UnknownCheckpoint { id: id.to_string() }
            }
            Err(error) => ApiError::from_metadata(&id.to_string(), &error),
        };
        // A storage outage may pass by the next request; what the checkpoint holds will not
        // until its stamp moves (or the failure's time to live ends).
        if !matches!(
            error,
            ApiError::StorageUnavailable { .. } | ApiError::Internal { .. }
        ) {
            let failure = Arc::new(Failure {
                stamp,
                error: error.clone(),
            });
            self.failures.insert(id.clone(), failure).await;
        }
        Err(error)
    }

    /// Reads checkpoint `id` from storage: native, PyTorch DCP or safetensors, whatever the
    /// directory holds.
    async fn read(
        &self,
        id: &CheckpointId,
        prefix: &Path,
        stamp: String,
    ) -> Result<Arc<OpenedCheckpoint>, MetadataError> {
        self.metrics.metadata_load();
        let options = OpenOptions {
            block_checksums: false,
            ..OpenOptions::default()
        };
        // The foreign-format opener's future is not provably `Send` (rustc's higher-ranked
        // lifetime limits with borrowed streams), so it runs to completion on a blocking thread
        // driving this runtime.
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
        let facts = CheckpointFacts::from_opened(&opened, id.step());
        let meta = Arc::new(opened.meta);
        Ok(Arc::new(OpenedCheckpoint {
            id: id.clone(),
            weight: weight(&meta, &facts),
            facts,
            meta,
            stamp,
        }))
    }

    /// Whether anything is stored under `prefix`.
    async fn exists(&self, prefix: &Path) -> Result<bool, ApiError> {
        match self.store.list(Some(prefix)).next().await {
            None => Ok(false),
            Some(Ok(_)) => Ok(true),
            Some(Err(e)) => Err(ApiError::storage(format!("listing {prefix}"), &e)),
        }
    }
}

/// The cheap stamp of the checkpoint at `prefix`: what changes whenever it is saved again,
/// deleted or fixed, read without reading the checkpoint. A native checkpoint's is its
/// manifest's (written last, so a new save always writes a new one), a DCP checkpoint's its
/// `.metadata`'s (written last too), each with one `head`: the entity tag, or modification time
/// and size where the store gives none. Anything else (safetensors, per-rank DCP metadata, an
/// incomplete save, nothing at all) is stamped by one listing of the directory: every object's
/// name, size, time and tag, plus the `.metadata` of a ByteCheckpoint save's `model/` and
/// `optimizer/` (a `head` each).
pub(crate) async fn probe(store: &dyn ObjectStore, prefix: &Path) -> Result<String, ApiError> {
    for name in [native::MANIFEST_FILE, dcp::METADATA_FILE] {
        let path = prefix.clone().join(name);
        match store.head(&path).await {
            Ok(meta) => return Ok(format!("{name} {}", object_stamp(&meta))),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(ApiError::storage(format!("reading {path}"), &e)),
        }
    }
    let listing = match store.list_with_delimiter(Some(prefix)).await {
        Ok(listing) => listing,
        Err(object_store::Error::NotFound { .. }) => return Ok("absent".to_string()),
        Err(e) => return Err(ApiError::storage(format!("listing {prefix}"), &e)),
    };
    if listing.objects.is_empty() && listing.common_prefixes.is_empty() {
        // A single-file checkpoint (a `.safetensors` file), or nothing.
        return match store.head(prefix).await {
            Ok(meta) => Ok(format!("file {}", object_stamp(&meta))),
            Err(object_store::Error::NotFound { .. }) => Ok("absent".to_string()),
            Err(e) => Err(ApiError::storage(format!("reading {prefix}"), &e)),
        };
    }
    let mut hasher = Sha256::new();
    let mut objects = listing.objects;
    objects.sort_by(|a, b| a.location.cmp(&b.location));
    for object in &objects {
        hasher.update(format!("{}\t{}\n", object.location, object_stamp(object)).as_bytes());
    }
    let mut dirs = listing.common_prefixes;
    dirs.sort();
    for dir in &dirs {
        hasher.update(format!("{dir}/\n").as_bytes());
        // A ByteCheckpoint save keeps its `.metadata` files (written last) one level down, in
        // its component directories: a new save changes them, not the root's listing.
        if dir
            .filename()
            .is_some_and(|name| bytecheckpoint::TENSOR_COMPONENTS.contains(&name))
        {
            let path = dir.clone().join(dcp::METADATA_FILE);
            match store.head(&path).await {
                Ok(meta) => hasher.update(format!("{path}\t{}\n", object_stamp(&meta)).as_bytes()),
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(ApiError::storage(format!("reading {path}"), &e)),
            }
        }
    }
    let digest = hasher.finalize();
    Ok(format!(
        "listing {}",
        digest[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect::<String>()
    ))
}

/// One object's stamp: its entity tag (which every store changes when the object is written
/// again) and size, or its modification time and size where there is no tag.
fn object_stamp(meta: &ObjectMeta) -> String {
    match &meta.e_tag {
        Some(tag) => format!("etag {tag} size {}", meta.size),
        None => format!(
            "modified {} size {}",
            meta.last_modified.to_rfc3339(),
            meta.size
        ),
    }
}

/// Estimated bytes held by an opened checkpoint: the rows of its metadata and its source
/// layout. Only a weight for the cache's bound, so it counts heap payloads and typical struct
/// sizes, not allocator slack.
fn weight(meta: &CheckpointMeta, facts: &CheckpointFacts) -> u32 {
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
    let layout = facts
        .source_layout
        .as_ref()
        .map_or(0, |l| 4 * l.to_string().len() as u64);
    u32::try_from(1024 + tensors + chunks + objects + files + layout).unwrap_or(u32::MAX)
}
