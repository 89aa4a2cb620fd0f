//! What a server is configured with. Every limit has a default that suits one server in front of
//! one training cluster; the comments say why a limit is where it is. The `DEFAULT_*` constants
//! are the one place those defaults are written: [`ServerConfig::new`] and the flags of
//! `tessera serve` both take them from here (the Helm chart's values repeat them, pointing here).

use std::path::PathBuf;
use std::time::Duration;

use tessera_storage::StorageOptions;

/// The address `tessera serve` listens on unless told otherwise: loopback, so that a server
/// started without a token is not reachable from other machines by accident.
pub const DEFAULT_ADDR: &str = "127.0.0.1:8080";

/// The environment variable `tessera serve` reads the token from when no `--token` is given.
pub const TOKEN_ENV: &str = "TESSERA_TOKEN";

/// Default [`ServerConfig::body_limit`]: a layout is a few KiB; explicit requests for thousands
/// of ranks with many tensors each can reach megabytes.
pub const DEFAULT_BODY_LIMIT: usize = 16 * 1024 * 1024;

/// Default [`ServerConfig::meta_cache_bytes`]: a 405B checkpoint saved by 8192 ranks holds ~10^6
/// boxes, about 200 MiB, so this keeps a few.
pub const DEFAULT_META_CACHE_BYTES: u64 = 1024 * 1024 * 1024;

/// Default [`ServerConfig::plan_cache_bytes`].
pub const DEFAULT_PLAN_CACHE_BYTES: u64 = 2 * 1024 * 1024 * 1024;

/// Default [`ServerConfig::catalog_ttl`]: a new save shows in the catalog within seconds.
pub const DEFAULT_CATALOG_TTL: Duration = Duration::from_secs(5);

/// Default [`ServerConfig::meta_ttl`].
pub const DEFAULT_META_TTL: Duration = Duration::from_secs(600);

/// Default [`ServerConfig::failure_ttl`]: long enough that a burst of requests for a corrupt
/// checkpoint parses it once, short enough that a fix the stamp cannot see (a data file put back
/// under an unchanged manifest) shows within a minute.
pub const DEFAULT_FAILURE_TTL: Duration = Duration::from_secs(30);

/// Default [`ServerConfig::shutdown_grace`].
pub const DEFAULT_SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// Configuration of [`AppState::new`](crate::AppState::new).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The catalog root: a local directory or an object-store URL (`file://`, `s3://`, `gs://`,
    /// `az://`, `http(s)://`). Runs are its directories, checkpoints the directories in a run.
    pub root: String,
    /// Cloud store configuration on top of (or instead of) the process environment.
    pub storage: StorageOptions,
    /// Bearer token every `/v1` route requires (`tessera serve` reads [`TOKEN_ENV`]); `None`
    /// leaves them open.
    pub token: Option<String>,
    /// Largest request body accepted (413 above); default [`DEFAULT_BODY_LIMIT`].
    pub body_limit: usize,
    /// Bytes of checkpoint metadata kept in memory (estimated from the rows held); default
    /// [`DEFAULT_META_CACHE_BYTES`].
    pub meta_cache_bytes: u64,
    /// Bytes of computed plans kept in memory (estimated from pieces, destinations and groups).
    /// An evicted plan is recomputed from its request, which is kept in a smaller cache
    /// (an eighth of this) so that plan ids handed out stay valid. Default
    /// [`DEFAULT_PLAN_CACHE_BYTES`].
    pub plan_cache_bytes: u64,
    /// How long a catalog listing and a run's `latest` pointer are reused before storage is
    /// listed again: a new save appears within this time.
    pub catalog_ttl: Duration,
    /// How long opened checkpoint metadata is kept. Every use checks the checkpoint's stamp
    /// first (one `head` of its manifest), so a checkpoint deleted and saved again at the same
    /// place is read again at once; this only bounds how long an unused entry holds memory.
    pub meta_ttl: Duration,
    /// How long a failed open (a corrupt, oversized or incomplete checkpoint) is answered from
    /// memory instead of read again. Keyed by the checkpoint's stamp, so a new save or a fix of
    /// the manifest clears it at once; this bounds what the stamp cannot see.
    pub failure_ttl: Duration,
    /// Directory of the static web UI served at `/`; `None` serves a small built-in index page.
    pub web_ui: Option<PathBuf>,
    /// Origins allowed by CORS (`*` for any). Empty (the default): no CORS headers at all, so
    /// browsers only reach the API from the server's own origin (the web UI).
    pub cors_origins: Vec<String>,
    /// How long shutdown waits for requests in flight before cutting them off.
    pub shutdown_grace: Duration,
}

impl ServerConfig {
    /// The defaults for the catalog at `root`.
    pub fn new(root: impl Into<String>) -> Self {
        Self {
            root: root.into(),
            storage: StorageOptions::default(),
            token: None,
            body_limit: DEFAULT_BODY_LIMIT,
            meta_cache_bytes: DEFAULT_META_CACHE_BYTES,
            plan_cache_bytes: DEFAULT_PLAN_CACHE_BYTES,
            catalog_ttl: DEFAULT_CATALOG_TTL,
            meta_ttl: DEFAULT_META_TTL,
            failure_ttl: DEFAULT_FAILURE_TTL,
            web_ui: None,
            cors_origins: Vec::new(),
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
        }
    }
}
