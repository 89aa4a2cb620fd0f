//! The catalog of a storage root: runs are its directories, checkpoints the directories of a run
//! ([`scan`]), each described by its format-neutral [`facts`]. Listings and `latest` pointers are
//! reused for [`ServerConfig::catalog_ttl`]; opened metadata lives in a cache bounded by bytes
//! ([`cache`]). The API types are in [`wire`].
//!
//! [`ServerConfig::catalog_ttl`]: crate::ServerConfig::catalog_ttl

mod cache;
mod facts;
mod scan;
mod wire;

use std::path::PathBuf;
use std::sync::Arc;

use moka::future::Cache;
use object_store::ObjectStore;
use object_store::path::Path;
use tessera_metadata::formats::native::read_latest;

pub use wire::{
    CatalogProblem, CatalogResponse, CheckpointEntry, CheckpointStatus, CheckpointSummary,
    Composition, MAX_OBJECTS_LISTED, ObjectEntry, RunEntry, SavedBox, TensorDetail, TensorEntry,
    TensorPage, TensorTotals,
};

pub(crate) use cache::OpenedCheckpoint;

use crate::error::unshare;
use crate::id::LATEST;
use crate::metrics::{CacheKind, Metrics};
use crate::{ApiError, CheckpointId, ServerConfig};
use cache::MetaCache;

/// The catalog of one root, with its caches.
pub(crate) struct Catalog {
    store: Arc<dyn ObjectStore>,
    root: Path,
    /// The root as a local directory, when the store is the local file system at it.
    local_root: Option<PathBuf>,
    metrics: Arc<Metrics>,
    listing: Cache<(), Arc<CatalogResponse>>,
    latest: Cache<String, Option<String>>,
    meta: MetaCache,
}

impl Catalog {
    pub(crate) fn new(
        store: Arc<dyn ObjectStore>,
        root: Path,
        local_root: Option<PathBuf>,
        config: &ServerConfig,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            meta: MetaCache::new(Arc::clone(&store), config, Arc::clone(&metrics)),
            store,
            root,
            local_root,
            metrics,
            listing: Cache::builder()
                .max_capacity(1)
                .time_to_live(config.catalog_ttl)
                .build(),
            latest: Cache::builder()
                .max_capacity(100_000)
                .time_to_live(config.catalog_ttl)
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
        self.meta.usage().await
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
            .or_try_insert_with(async {
                scan::scan(self.store.as_ref(), &self.root, self.local_root.as_deref())
                    .await
                    .map(Arc::new)
            })
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
        // A checkpoint found changed (saved again, deleted, fixed) is stale in the listing too.
        self.meta
            .open(&id, &prefix, || self.listing.invalidate_all())
            .await
    }

    /// The modification time (RFC 3339) of the newest file directly in checkpoint `id`'s
    /// directory, as the catalog listing takes it for formats without a recorded commit time;
    /// none when it cannot be listed (the summary is still answered).
    async fn newest_file_time(&self, id: &CheckpointId) -> Option<String> {
        let listing = self
            .store
            .list_with_delimiter(Some(&id.prefix(&self.root)))
            .await
            .ok()?;
        listing
            .objects
            .iter()
            .map(|o| o.last_modified)
            .max()
            .map(|t| t.to_rfc3339())
    }

    /// The summary of checkpoint `id`: committed (from its facts) or incomplete.
    pub(crate) async fn summary(&self, id: &CheckpointId) -> Result<CheckpointSummary, ApiError> {
        let resolved = self.resolve(id).await?;
        let latest = self.latest_of(resolved.run()).await.ok().flatten();
        let is_latest = latest.as_deref() == Some(resolved.step());
        match self.open(&resolved).await {
            Ok(opened) => {
                let mut summary = opened.facts.summary(&resolved, is_latest);
                summary.composition = Some(Composition::of(&opened.meta));
                summary.object_list = Some(ObjectEntry::list(&opened.meta));
                if summary.entry.created.is_none() {
                    // Formats that record no commit time get the catalog row's: the newest file
                    // directly in the directory (one listing), so a summary and its row agree.
                    summary.entry.created = self.newest_file_time(&resolved).await;
                }
                Ok(summary)
            }
            Err(ApiError::IncompleteCheckpoint { .. }) => Ok(CheckpointSummary::incomplete(
                CheckpointEntry::incomplete(&resolved, is_latest),
            )),
            Err(e) => Err(e),
        }
    }
}
