//! `tessera serve`: the catalog and plan service over a storage root, until Ctrl-C or SIGTERM.

use std::io::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use tessera_server::{AppState, ServerConfig, init_logging, serve, shutdown_signal};

/// The environment variable holding the token when `--token` is not given.
pub const TOKEN_ENV: &str = "TESSERA_TOKEN";

/// Arguments of `tessera serve`.
#[derive(Clone, Debug)]
pub struct ServeArgs {
    /// Catalog root: a local directory or an object-store URL.
    pub root: String,
    /// Address to listen on (`127.0.0.1:8080`; port 0 picks a free one).
    pub addr: String,
    /// Bearer token for `/v1` (else `TESSERA_TOKEN`, else none).
    pub token: Option<String>,
    /// Static web UI directory served at `/`.
    pub web_ui: Option<PathBuf>,
    /// CORS origins (none: CORS off).
    pub cors_origins: Vec<String>,
    /// Metadata cache size in MiB.
    pub metadata_cache_mib: u64,
    /// Plan cache size in MiB.
    pub plan_cache_mib: u64,
    /// Largest request body in KiB.
    pub body_limit_kib: usize,
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
    config.cors_origins = args.cors_origins.clone();
    config.meta_cache_bytes = args.metadata_cache_mib.saturating_mul(1024 * 1024);
    config.plan_cache_bytes = args.plan_cache_mib.saturating_mul(1024 * 1024);
    config.body_limit = args.body_limit_kib.saturating_mul(1024);
    let has_token = config.token.is_some();
    let state =
        AppState::new(config).with_context(|| format!("opening the catalog {}", args.root))?;
    let listener = tokio::net::TcpListener::bind(&args.addr)
        .await
        .with_context(|| format!("listening on {}", args.addr))?;
    let addr = listener.local_addr().context("reading the bound address")?;
    if !has_token && !addr.ip().is_loopback() {
        eprintln!(
            "warning: serving on {addr} without a token: anyone who reaches this port can read \
             the catalog (set --token or {TOKEN_ENV})"
        );
    }
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "listening on http://{addr} (catalog {})", args.root)?;
        out.flush()?;
    }
    serve(listener, state, shutdown_signal()).await?;
    Ok(())
}
