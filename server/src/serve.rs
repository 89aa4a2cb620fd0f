//! Running the service: accepting connections up to a limit, serving each with a bound on how
//! long a request head may take, until a shutdown signal; then draining requests in flight for a
//! bounded time. Also the log setup of the `tessera serve` process.
//!
//! The accept loop is hyper's own rather than `axum::serve`, which has neither a header timeout
//! nor a connection limit: without them a few hundred clients that connect and send nothing hold
//! every file descriptor, and `/healthz` stops answering.

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinSet;
use tower::ServiceExt;

use crate::{AppState, ServerError, app};

/// Pause after a failed accept (out of file descriptors, say) before trying again, so the loop
/// does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `state`'s API on `listener` until `shutdown` completes, then stops accepting and lets
/// requests in flight finish for at most [`ServerConfig::shutdown_grace`]. At most
/// [`ServerConfig::max_connections`] connections are served at once (one more is closed as soon
/// as it is accepted), and a connection that does not send a whole request head within
/// [`ServerConfig::header_timeout`] (from its start, or from the previous answer) is closed.
///
/// [`ServerConfig::shutdown_grace`]: crate::ServerConfig::shutdown_grace
/// [`ServerConfig::max_connections`]: crate::ServerConfig::max_connections
/// [`ServerConfig::header_timeout`]: crate::ServerConfig::header_timeout
pub async fn serve(
    listener: TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let config = state.config();
    let grace = config.shutdown_grace;
    let header_timeout = config.header_timeout;
    let max_connections = config.max_connections;
    let metrics = std::sync::Arc::clone(&state.inner.metrics);
    let router = app(state);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections: JoinSet<()> = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            // Reap finished connections so the set holds only live ones.
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        if connections.len() >= max_connections {
            // Closing at once frees the descriptor and tells the client to retry, instead of
            // leaving it in the backlog for as long as the other connections last.
            tracing::warn!(%peer, max_connections, "connection limit reached: closing a new connection");
            metrics.connection_refused();
            drop(stream);
            continue;
        }
        // Rank plans are small answers a job waits on: no Nagle delay.
        let _ = stream.set_nodelay(true);
        let router = router.clone();
        let mut stop = stop_rx.clone();
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
                router.clone().oneshot(request)
            });
            let connection = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(TokioIo::new(stream), service);
            let mut connection = pin!(connection);
            let served = tokio::select! {
                served = connection.as_mut() => served,
                _ = stop.changed() => {
                    // Finish the request in flight, then close.
                    connection.as_mut().graceful_shutdown();
                    connection.await
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "connection ended with an error");
            }
        });
    }
    tracing::info!("shutting down: no new connections, finishing requests in flight");
    let _ = stop_tx.send(true);
    let drained = tokio::time::timeout(grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            ?grace,
            "requests still in flight after the grace period; cut off"
        );
        connections.abort_all();
    }
    Ok(())
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
