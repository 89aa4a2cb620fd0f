//! The state every handler shares: the catalog root's store, the caches and the metrics.

use std::path::PathBuf;
use std::sync::Arc;

use object_store::ObjectStore;
use object_store::path::Path;
use sha2::{Digest, Sha256};
use tessera_storage as storage;

use crate::catalog::Catalog;
use crate::metrics::Metrics;
use crate::plans::Plans;
use crate::{MetricsSnapshot, ServerConfig, ServerError};

/// Shared state of a server; cheap to clone.
#[derive(Clone)]
pub struct AppState {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub config: ServerConfig,
    /// SHA-256 of the token: comparing digests in constant time hides the token's length too.
    pub token_digest: Option<[u8; 32]>,
    /// The root as a local directory, when it is one (readiness checks it exists).
    pub local_root: Option<PathBuf>,
    pub catalog: Catalog,
    pub plans: Plans,
    pub metrics: Arc<Metrics>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("root", &self.inner.config.root)
            .field("token", &self.inner.token_digest.map(|_| "<set>"))
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// Opens the catalog root of `config` (no IO yet for cloud stores: an unreachable store shows
    /// in `/readyz` and as 503 answers).
    pub fn new(config: ServerConfig) -> Result<Self, ServerError> {
        let location = storage::open_with(&config.root, &config.storage)?;
        let local_root = local_dir(&config.root);
        Self::build(config, location.store, location.prefix, local_root)
    }

    /// A state over an already-built store and root prefix (a wrapper store with metrics or
    /// fault injection, an in-memory store in tests). `config.root` is only shown in messages.
    pub fn with_store(
        config: ServerConfig,
        store: Arc<dyn ObjectStore>,
        root: Path,
    ) -> Result<Self, ServerError> {
        Self::build(config, store, root, None)
    }

    fn build(
        config: ServerConfig,
        store: Arc<dyn ObjectStore>,
        root: Path,
        local_root: Option<PathBuf>,
    ) -> Result<Self, ServerError> {
        if config.body_limit == 0 {
            return Err(ServerError::Config {
                detail: "body_limit must be at least 1 byte".to_string(),
            });
        }
        for (value, what) in [
            (config.plan_concurrency, "plan_concurrency"),
            (config.max_connections, "max_connections"),
        ] {
            if value == 0 {
                return Err(ServerError::Config {
                    detail: format!("{what} must be at least 1"),
                });
            }
        }
        for (what, value) in [
            ("header_timeout", config.header_timeout),
            ("body_timeout", config.body_timeout),
        ] {
            if value.is_zero() {
                return Err(ServerError::Config {
                    detail: format!("{what} must be longer than zero"),
                });
            }
        }
        if let Some(registry) = &config.registry {
            // A mistyped registry would list nothing as if nothing were published.
            match std::fs::metadata(registry) {
                Ok(meta) if meta.is_dir() => {}
                Ok(_) => {
                    return Err(ServerError::Config {
                        detail: format!("the registry {} is not a directory", registry.display()),
                    });
                }
                Err(e) => {
                    return Err(ServerError::Config {
                        detail: format!(
                            "the registry {}: {e} (the directory publishers are given as registry=)",
                            registry.display()
                        ),
                    });
                }
            }
        }
        let token_digest = match config.token.as_deref() {
            None => None,
            Some("") => {
                return Err(ServerError::Config {
                    detail: "the token is empty; unset it to run without one".to_string(),
                });
            }
            Some(token) => Some(Sha256::digest(token.as_bytes()).into()),
        };
        let metrics = Arc::new(Metrics::new());
        let catalog = Catalog::new(
            store,
            root,
            local_root.clone(),
            &config,
            Arc::clone(&metrics),
        );
        let plans = Plans::new(&config, Arc::clone(&metrics));
        Ok(Self {
            inner: Arc::new(Inner {
                config,
                token_digest,
                local_root,
                catalog,
                plans,
                metrics,
            }),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    /// Counters (requests, plan computations, cache hits and misses) for tests and benchmarks.
    pub fn metrics(&self) -> MetricsSnapshot {
        self.inner.metrics.snapshot()
    }

    /// Drops every cached listing, metadata and plan (plan ids handed out become unknown): the
    /// cold path again, for benchmarks.
    pub fn clear_caches(&self) {
        self.inner.catalog.invalidate_all();
        self.inner.plans.invalidate_all();
    }

    /// Drops the computed plans but keeps their requests, so the next rank that asks recomputes
    /// its plan (the path a plan evicted for space takes).
    pub fn evict_plans(&self) {
        self.inner.plans.evict_computed();
    }
}

/// The local directory a root names, when it is local (no scheme, or `file://`).
fn local_dir(root: &str) -> Option<PathBuf> {
    tessera_storage::local_path(root).map(PathBuf::from)
}
