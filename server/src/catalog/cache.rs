//! The metadata cache: committed checkpoints opened from storage (any format), bounded by their
//! estimated bytes, so that the thousands of ranks of one job never make the server read a
//! checkpoint's metadata more than once.

use std::sync::Arc;

use futures::StreamExt;
use moka::future::Cache;
use moka::policy::EvictionPolicy;
use object_store::ObjectStore;
use object_store::path::Path;
use tessera_metadata::{CheckpointMeta, MetadataError, OpenOptions, open_any};

use super::facts::CheckpointFacts;
use crate::metrics::{CacheKind, Metrics};
use crate::{ApiError, CheckpointId, ServerConfig};

/// A committed checkpoint read from storage: its facts and validated metadata.
#[derive(Debug)]
pub(crate) struct OpenedCheckpoint {
    pub id: CheckpointId,
    pub facts: CheckpointFacts,
    pub meta: Arc<CheckpointMeta>,
    weight: u32,
}

/// Opened checkpoints by id (never `latest`: callers resolve it first).
pub(crate) struct MetaCache {
    store: Arc<dyn ObjectStore>,
    metrics: Arc<Metrics>,
    cache: Cache<CheckpointId, Arc<OpenedCheckpoint>>,
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
        }
    }

    /// Entries and estimated bytes (after pending evictions).
    pub(crate) async fn usage(&self) -> (u64, u64) {
        self.cache.run_pending_tasks().await;
        (self.cache.entry_count(), self.cache.weighted_size())
    }

    pub(crate) fn invalidate_all(&self) {
        self.cache.invalidate_all();
    }

    /// Opens the committed checkpoint `id` stored under `prefix`, from the cache when it can. A
    /// directory without a manifest is [`ApiError::IncompleteCheckpoint`]; nothing stored there
    /// at all is [`ApiError::UnknownCheckpoint`].
    pub(crate) async fn open(
        &self,
        id: &CheckpointId,
        prefix: &Path,
    ) -> Result<Arc<OpenedCheckpoint>, ApiError> {
        let result = self
            .cache
            .entry(id.clone())
            .or_try_insert_with(self.read(id, prefix))
            .await;
        match result {
            Ok(entry) => {
                self.metrics.cache(CacheKind::Metadata, !entry.is_fresh());
                Ok(entry.into_value())
            }
            // Nothing stored there is an unknown checkpoint whatever the opener made of it.
            Err(_) if !self.exists(prefix).await? => {
                Err(ApiError::UnknownCheckpoint { id: id.to_string() })
            }
            Err(error) => Err(ApiError::from_metadata(&id.to_string(), &error)),
        }
    }

    /// Reads checkpoint `id` from storage: native, PyTorch DCP or safetensors, whatever the
    /// directory holds.
    async fn read(
        &self,
        id: &CheckpointId,
        prefix: &Path,
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
