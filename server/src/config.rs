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

/// Default [`ServerConfig::plan_memory_bytes`]: planning takes about 260 bytes per (rank, tensor)
/// request, so a 405B model on 8192 ranks (about 2.3 million requests) plans in about 600 MiB
/// and fits; a typo'd mesh (2^20 ranks over hundreds of tensors is tens of GB) is refused before
/// it starts. Two computations at this bound plus both caches stay near the chart's 4 GiB limit.
pub const DEFAULT_PLAN_MEMORY_BYTES: u64 = 1024 * 1024 * 1024;

/// Default [`ServerConfig::plan_concurrency`]: the planner already spreads one plan over up to 8
/// threads, so two at once keep the cores busy while bounding planning memory to twice
/// [`DEFAULT_PLAN_MEMORY_BYTES`].
pub const DEFAULT_PLAN_CONCURRENCY: usize = 2;

/// Default [`ServerConfig::plan_queue`]: different plans waiting for a computation slot. Ranks
/// asking for the same plan wait on one computation and take one place.
pub const DEFAULT_PLAN_QUEUE: usize = 16;

/// Default [`ServerConfig::header_timeout`]: a client that has not sent a whole request head
/// within this time (a slow or stalled client, or an idle keep-alive connection) is
/// disconnected, so it cannot hold a connection slot for long.
pub const DEFAULT_HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Default [`ServerConfig::body_timeout`]: the body limit (16 MiB) arrives in well under a second
/// on any cluster network; a client still sending after this long is stalled, and is answered
/// 408 instead of holding a connection and a request task.
pub const DEFAULT_BODY_TIMEOUT: Duration = Duration::from_secs(30);

/// Default [`ServerConfig::max_connections`]: well below the usual 1024 open-file limit, so
/// accepting never fails for lack of descriptors and the store and cache files keep theirs.
pub const DEFAULT_MAX_CONNECTIONS: usize = 512;

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
    /// Bearer token every `/v1` route and `/metrics` require (`tessera serve` reads
    /// [`TOKEN_ENV`]); the probes `/healthz` and `/readyz` never do. `None` leaves them open.
    pub token: Option<String>,
    /// Largest request body accepted (413 above); default [`DEFAULT_BODY_LIMIT`].
    pub body_limit: usize,
    /// Bytes of checkpoint metadata kept in memory (estimated from the rows held); default
    /// [`DEFAULT_META_CACHE_BYTES`].
    pub meta_cache_bytes: u64,
    /// Bytes of computed plans kept in memory (each weighed at the heap bytes it holds).
    /// An evicted plan is recomputed from its request, which is kept in a smaller cache
    /// (an eighth of this) so that plan ids handed out stay valid. Default
    /// [`DEFAULT_PLAN_CACHE_BYTES`].
    pub plan_cache_bytes: u64,
    /// Most bytes one plan computation may take, by the planner's estimate made before it starts
    /// (`tessera_planner::PlanEstimate`): a request over it is refused with 422
    /// `plan_too_large` and the estimate. Default [`DEFAULT_PLAN_MEMORY_BYTES`].
    pub plan_memory_bytes: u64,
    /// Plan computations running at once; default [`DEFAULT_PLAN_CONCURRENCY`].
    pub plan_concurrency: usize,
    /// Plan computations waiting for a slot beyond those running; one more is refused with 503
    /// `busy` and `Retry-After`. Default [`DEFAULT_PLAN_QUEUE`].
    pub plan_queue: usize,
    /// Longest wait for a request head, from the connection's start or the end of the previous
    /// answer (so also how long an idle keep-alive connection is kept); default
    /// [`DEFAULT_HEADER_TIMEOUT`].
    pub header_timeout: Duration,
    /// Longest time to receive a request's whole body, counted once from the end of its head
    /// (bytes trickling in do not restart it); past it the request is answered 408
    /// `body_timeout`. Default [`DEFAULT_BODY_TIMEOUT`].
    pub body_timeout: Duration,
    /// Connections served at once. One more takes the place of the connection idle longest (no
    /// request in flight), which is closed; only when every connection has a request in flight
    /// is the new one accepted and closed at once (its client sees the connection reset and can
    /// retry). Default [`DEFAULT_MAX_CONNECTIONS`].
    pub max_connections: usize,
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
    /// The registry directory of live publications (`tessera.publish(..., registry=DIR)`) that
    /// `/v1/live` and the catalog's `live` section list; `None` lists none (those routes answer
    /// 404 `no_registry`). A local directory: publishers write it on a file system they share.
    pub registry: Option<PathBuf>,
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
            plan_memory_bytes: DEFAULT_PLAN_MEMORY_BYTES,
            plan_concurrency: DEFAULT_PLAN_CONCURRENCY,
            plan_queue: DEFAULT_PLAN_QUEUE,
            header_timeout: DEFAULT_HEADER_TIMEOUT,
            body_timeout: DEFAULT_BODY_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            catalog_ttl: DEFAULT_CATALOG_TTL,
            meta_ttl: DEFAULT_META_TTL,
            failure_ttl: DEFAULT_FAILURE_TTL,
            registry: None,
            web_ui: None,
            cors_origins: Vec::new(),
            shutdown_grace: DEFAULT_SHUTDOWN_GRACE,
        }
    }
}
