//! Running the service: serving a listener until a shutdown signal, draining requests in flight
//! for a bounded time, and the log setup of the `tessera serve` process.

use std::future::Future;

use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::{AppState, ServerError, app};

/// Serves `state`'s API on `listener` until `shutdown` completes, then stops accepting and lets
/// requests in flight finish for at most [`ServerConfig::shutdown_grace`].
///
/// [`ServerConfig::shutdown_grace`]: crate::ServerConfig::shutdown_grace
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let grace = state.config().shutdown_grace;
    let (stopping_tx, stopping_rx) = oneshot::channel::<()>();
    let server = axum::serve(listener, app(state)).with_graceful_shutdown(async move {
        shutdown.await;
        tracing::info!("shutting down: no new connections, finishing requests in flight");
        let _ = stopping_tx.send(());
    });
    let deadline = async move {
        // Resolves only once shutdown began (a dropped sender means the server ended first).
        if stopping_rx.await.is_ok() {
            tokio::time::sleep(grace).await;
        } else {
            std::future::pending::<()>().await;
        }
    };
    tokio::select! {
        served = server => served.map_err(ServerError::Io),
        () = deadline => {
            tracing::warn!(?grace, "requests still in flight after the grace period; cut off");
            Ok(())
        }
    }
}

/// Completes on Ctrl-C (SIGINT) or, on Unix, SIGTERM (what Kubernetes sends).
pub async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::warn!(error = %e, "cannot listen for Ctrl-C");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {}
        () = term => {}
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default: `info`). Each request's lines carry its
/// `x-request-id`. Calling it twice keeps the first setup.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
