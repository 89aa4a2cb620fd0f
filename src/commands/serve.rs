//! `tessera serve`: the catalog and plan service over a storage root, until Ctrl-C or SIGTERM.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use tessera_server::{
    AppState, DEFAULT_BODY_LIMIT, DEFAULT_BODY_TIMEOUT, DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS, DEFAULT_META_CACHE_BYTES, DEFAULT_PLAN_CACHE_BYTES,
    DEFAULT_PLAN_CONCURRENCY, DEFAULT_PLAN_MEMORY_BYTES, DEFAULT_PLAN_QUEUE, ServerConfig,
    init_logging, serve, shutdown_signal,
};

/// The environment variable holding the token when `--token` is not given.
pub use tessera_server::TOKEN_ENV;

/// Bytes in a KiB and a MiB: the units of the cache and body flags.
const KIB: u64 = 1024;
const MIB: u64 = 1024 * 1024;

/// The server's default metadata cache, in MiB (the flag's default).
pub const DEFAULT_METADATA_CACHE_MIB: u64 = DEFAULT_META_CACHE_BYTES / MIB;
/// The server's default plan cache, in MiB (the flag's default).
pub const DEFAULT_PLAN_CACHE_MIB: u64 = DEFAULT_PLAN_CACHE_BYTES / MIB;
/// The server's default body limit, in KiB (the flag's default).
pub const DEFAULT_BODY_LIMIT_KIB: usize = DEFAULT_BODY_LIMIT / KIB as usize;

/// The server's default bound on one plan computation, in MiB (the flag's default).
pub const DEFAULT_PLAN_MEMORY_MIB: u64 = DEFAULT_PLAN_MEMORY_BYTES / MIB;
/// The server's default header timeout, in seconds (the flag's default).
pub const DEFAULT_HEADER_TIMEOUT_SECS: u64 = DEFAULT_HEADER_TIMEOUT.as_secs();
/// The server's default body timeout, in seconds (the flag's default).
pub const DEFAULT_BODY_TIMEOUT_SECS: u64 = DEFAULT_BODY_TIMEOUT.as_secs();

/// Arguments of `tessera serve`.
#[derive(Clone, Debug)]
pub struct ServeArgs {
    /// Catalog root: a local directory or an object-store URL.
    pub root: String,
    /// Address to listen on ([`tessera_server::DEFAULT_ADDR`]; port 0 picks a free one).
    pub addr: String,
    /// Bearer token for `/v1` (else `TESSERA_TOKEN`, else none).
    pub token: Option<String>,
    /// Static web UI directory served at `/`.
    pub web_ui: Option<PathBuf>,
    /// Registry directory of live publications listed next to the checkpoints.
    pub registry: Option<PathBuf>,
    /// CORS origins (none: CORS off).
    pub cors_origins: Vec<String>,
    /// Metadata cache size in MiB.
    pub metadata_cache_mib: u64,
    /// Plan cache size in MiB.
    pub plan_cache_mib: u64,
    /// Largest request body in KiB.
    pub body_limit_kib: usize,
    /// Most memory one plan computation may take (by its estimate), in MiB.
    pub plan_memory_mib: u64,
    /// Plan computations running at once.
    pub plan_concurrency: usize,
    /// Plan computations waiting beyond those running.
    pub plan_queue: usize,
    /// Seconds a connection may take to send a request head (and stay idle).
    pub header_timeout_secs: u64,
    /// Seconds a request may take to send its whole body.
    pub body_timeout_secs: u64,
    /// Connections served at once.
    pub max_connections: usize,
}

impl ServeArgs {
    /// The server's defaults for the catalog at `root`, listening on `addr`.
    pub fn new(root: impl Into<String>, addr: impl Into<String>) -> Self {
        Self {
            root: root.into(),
            addr: addr.into(),
            token: None,
            web_ui: None,
            registry: None,
            cors_origins: Vec::new(),
            metadata_cache_mib: DEFAULT_METADATA_CACHE_MIB,
            plan_cache_mib: DEFAULT_PLAN_CACHE_MIB,
            body_limit_kib: DEFAULT_BODY_LIMIT_KIB,
            plan_memory_mib: DEFAULT_PLAN_MEMORY_MIB,
            plan_concurrency: DEFAULT_PLAN_CONCURRENCY,
            plan_queue: DEFAULT_PLAN_QUEUE,
            header_timeout_secs: DEFAULT_HEADER_TIMEOUT_SECS,
            body_timeout_secs: DEFAULT_BODY_TIMEOUT_SECS,
            max_connections: DEFAULT_MAX_CONNECTIONS,
        }
    }
}

/// Runs the server until a shutdown signal. Prints `listening on http://ADDR` on stdout once the
/// port is bound (scripts and tests wait for that line); logs go to stderr (`RUST_LOG`).
pub async fn run(args: &ServeArgs) -> Result<()> {
    init_logging();
    let token = match &args.token {
        Some(token) => Some(token.clone()),
        None => std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty()),
    };
    let mut config = ServerConfig::new(&args.root);
    config.token = token;
    config.web_ui = args.web_ui.clone();
    config.registry = args.registry.clone();
    config.cors_origins = args.cors_origins.clone();
    config.meta_cache_bytes = args.metadata_cache_mib.saturating_mul(MIB);
    config.plan_cache_bytes = args.plan_cache_mib.saturating_mul(MIB);
    config.body_limit = args.body_limit_kib.saturating_mul(KIB as usize);
    config.plan_memory_bytes = args.plan_memory_mib.saturating_mul(MIB);
    config.plan_concurrency = args.plan_concurrency;
    config.plan_queue = args.plan_queue;
    config.header_timeout = std::time::Duration::from_secs(args.header_timeout_secs);
    config.body_timeout = std::time::Duration::from_secs(args.body_timeout_secs);
    config.max_connections = args.max_connections;
    let has_token = config.token.is_some();
    if let Some(registry) = &args.registry
        && !registry.is_dir()
    {
        bail!(
            "the registry {} is not a directory: --registry takes the directory publishers were \
             given as registry= (tessera.publish)",
            registry.display()
        );
    }
    check_local_root(&args.root)?;
    let state =
        AppState::new(config).with_context(|| format!("opening the catalog {}", args.root))?;
    let listener = match tokio::net::TcpListener::bind(&args.addr).await {
        Ok(listener) => listener,
        Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => bail!(
            "listening on {}: the address is taken (another server on that port?); pick \
             another with --addr, e.g. --addr 127.0.0.1:0 for any free port",
            args.addr
        ),
        Err(e) => return Err(e).with_context(|| format!("listening on {}", args.addr)),
    };
    let addr = listener.local_addr().context("reading the bound address")?;
    if !has_token && !addr.ip().is_loopback() {
        eprintln!(
            "warning: serving on {addr} without a token: anyone who reaches this port can read \
             the catalog (set --token or {TOKEN_ENV})"
        );
    }
    {
        let mut out = std::io::stdout().lock();
        match &args.registry {
            Some(registry) => writeln!(
                out,
                "listening on http://{addr} (catalog {}, live registry {})",
                args.root,
                registry.display()
            )?,
            None => writeln!(out, "listening on http://{addr} (catalog {})", args.root)?,
        }
        out.flush()?;
    }
    serve(listener, state, shutdown_signal()).await?;
    Ok(())
}

/// A local catalog root that is missing or not a directory is a mistyped `--root`: serving it
/// would show an empty catalog as if all were well. An empty one is served (saves may come
/// later) with a warning. Object-store roots are not checked: an empty prefix is a new catalog.
fn check_local_root(root: &str) -> Result<()> {
    let Some(path) = tessera_storage::local_path(root) else {
        return Ok(());
    };
    match std::fs::read_dir(path) {
        Ok(mut entries) => {
            if entries.next().is_none() {
                eprintln!(
                    "warning: the catalog root {root} is empty: checkpoints show up as \
                     <run>/<step> directories are saved under it"
                );
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bail!(
            "the catalog root {root} does not exist: --root takes a directory (or URL) holding \
             <run>/<step> checkpoint directories"
        ),
        Err(e) if std::path::Path::new(path).is_file() => bail!(
            "the catalog root {root} is a file, not a directory ({e}): --root takes a directory \
             holding <run>/<step> checkpoint directories"
        ),
        Err(e) => Err(e).with_context(|| format!("reading the catalog root {root}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The Helm chart repeats the server's defaults in its values; this keeps them in step.
    #[test]
    fn helm_values_repeat_the_server_defaults() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/helm/tessera/values.yaml");
        let values = std::fs::read_to_string(path).expect("reading the chart's values");
        let value = |key: &str| {
            values.lines().find_map(|line| {
                line.trim()
                    .strip_prefix(key)?
                    .strip_prefix(':')?
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
        };
        assert_eq!(value("metadataCacheMiB"), Some(DEFAULT_METADATA_CACHE_MIB));
        assert_eq!(value("planCacheMiB"), Some(DEFAULT_PLAN_CACHE_MIB));
        assert_eq!(value("bodyLimitKiB"), Some(DEFAULT_BODY_LIMIT_KIB as u64));
        assert_eq!(value("planMemoryMiB"), Some(DEFAULT_PLAN_MEMORY_MIB));
        assert_eq!(
            value("planConcurrency"),
            Some(DEFAULT_PLAN_CONCURRENCY as u64)
        );
        assert_eq!(value("planQueue"), Some(DEFAULT_PLAN_QUEUE as u64));
        assert_eq!(
            value("headerTimeoutSeconds"),
            Some(DEFAULT_HEADER_TIMEOUT_SECS)
        );
        assert_eq!(value("bodyTimeoutSeconds"), Some(DEFAULT_BODY_TIMEOUT_SECS));
        assert_eq!(
            value("maxConnections"),
            Some(DEFAULT_MAX_CONNECTIONS as u64)
        );
    }
}
