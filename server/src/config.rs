//! What a server is configured with. Every limit has a default that suits one server in front of
//! one training cluster; the comments say why a limit is where it is.

use std::path::PathBuf;
use std::time::Duration;

use tessera_storage::StorageOptions;

/// Configuration of [`AppState::new`](crate::AppState::new).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The catalog root: a local directory or an object-store URL (`file://`, `s3://`, `gs://`,
    /// `az://`, `http(s)://`). Runs are its directories, checkpoints the directories in a run.
    pub root: String,
    /// Cloud store configuration on top of (or instead of) the process environment.
    pub storage: StorageOptions,
    /// Bearer token every `/v1` route requires (`TESSERA_TOKEN`); `None` leaves them open.
    pub token: Option<String>,
    /// Largest request body accepted (413 above). A layout is a few KiB; explicit requests for
    /// thousands of ranks with many tensors each can reach megabytes, so the default is 16 MiB.
    pub body_limit: usize,
    /// Bytes of checkpoint metadata kept in memory (estimated from the rows held). A 405B
    /// checkpoint saved by 8192 ranks holds ~10^6 boxes, about 200 MiB; the default keeps a few.
    pub meta_cache_bytes: u64,
    /// Bytes of computed plans kept in memory (estimated from pieces, destinations and groups).
    /// An evicted plan is recomputed from its request, which is kept in a smaller cache
    /// (an eighth of this) so that plan ids handed out stay valid.
    pub plan_cache_bytes: u64,
    /// How long a catalog listing and a run's `latest` pointer are reused before storage is
    /// listed again: a new save appears within this time.
    pub catalog_ttl: Duration,
    /// How long opened checkpoint metadata is reused before it is read and checked again
    /// (committed checkpoints never change, but they can be deleted and saved again).
    pub meta_ttl: Duration,
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
            body_limit: 16 * 1024 * 1024,
            meta_cache_bytes: 1024 * 1024 * 1024,
            plan_cache_bytes: 2 * 1024 * 1024 * 1024,
            catalog_ttl: Duration::from_secs(5),
            meta_ttl: Duration::from_secs(600),
            web_ui: None,
            cors_origins: Vec::new(),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}
