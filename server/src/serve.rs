//! Running the service: accepting connections up to a limit, serving each with a bound on how
//! long a request head may take, until a shutdown signal; then draining requests in flight for a
//! bounded time. Also the log setup of the `tessera serve` process.
//!
//! The accept loop is hyper's own rather than `axum::serve`, which has neither a header timeout
//! nor a connection limit: without them a few hundred clients that connect and send nothing hold
//! every file descriptor, and `/healthz` stops answering.
//!
//! A limit alone is not enough either: clients that hold idle connections (never sending a byte,
//! or at rest between keep-alive requests) and open them again as they are closed would keep
//! every slot. So at the limit a new connection takes the place of the connection idle longest,
//! one with no request in flight, which is closed; only when every connection is serving a
//! request is the new one refused. An idle connection is also closed after the header timeout.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::{Pin, pin};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes, HttpBody};
use hyper::body::{Frame, Incoming, SizeHint};
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::{Notify, watch};
use tokio::task::{self, JoinSet};
use tower::ServiceExt;

use crate::{AppState, ServerError, app};

/// Pause after a failed accept (out of file descriptors, say) before trying again, so the loop
/// does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `state`'s API on `listener` until `shutdown` completes, then stops accepting and lets
/// requests in flight finish for at most [`ServerConfig::shutdown_grace`].
///
/// At most [`ServerConfig::max_connections`] connections are served at once. One more takes the
/// place of the connection that has been idle longest (no request in flight: between requests,
/// or not yet through a whole request head), which is closed; only when every connection has a
/// request in flight is the new one closed as soon as it is accepted. A connection that does not
/// send a whole request head within [`ServerConfig::header_timeout`] (from its start, or from the
/// previous answer) is closed.
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
    let metrics = Arc::clone(&state.inner.metrics);
    let router = app(state);
    let (stop_tx, stop_rx) = watch::channel(false);
    let mut connections: JoinSet<()> = JoinSet::new();
    // The connections counted against the limit, by the id of the task serving each. One closed
    // to make room leaves at once, though its task may take a moment to end.
    let mut live: HashMap<task::Id, Arc<Connection>> = HashMap::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            () = &mut shutdown => break,
            // Reap finished connections so that only live ones count.
            Some(ended) = connections.join_next_with_id(), if !connections.is_empty() => {
                live.remove(&ended.map_or_else(|e| e.id(), |(id, ())| id));
                continue;
            }
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(ACCEPT_BACKOFF).await;
                    continue;
                }
            },
        };
        if live.len() >= max_connections {
            match idle_longest(&live).and_then(|id| live.remove(&id)) {
                Some(idle) => {
                    tracing::debug!(%peer, max_connections, "connection limit reached: closing the connection idle longest");
                    metrics.connection_closed_idle();
                    idle.close.notify_one();
                }
                None => {
                    // Every connection is serving a request. Closing at once frees the
                    // descriptor and tells the client to retry, instead of leaving it in the
                    // backlog for as long as those requests last.
                    tracing::warn!(%peer, max_connections, "connection limit reached with a request in flight on every connection: closing a new connection");
                    metrics.connection_refused();
                    drop(stream);
                    continue;
                }
            }
        }
        // Rank plans are small answers a job waits on: no Nagle delay.
        let _ = stream.set_nodelay(true);
        let connection = Arc::new(Connection::new());
        let served = serve_connection(
            stream,
            peer,
            router.clone(),
            header_timeout,
            stop_rx.clone(),
            Arc::clone(&connection),
        );
        let handle = connections.spawn(served);
        live.insert(handle.id(), connection);
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

/// Serves one connection until it ends, shutdown asks it to finish (after its request in
/// flight), or the accept loop closes it to make room.
async fn serve_connection(
    stream: tokio::net::TcpStream,
    peer: std::net::SocketAddr,
    router: axum::Router,
    header_timeout: Duration,
    mut stop: watch::Receiver<bool>,
    tracked: Arc<Connection>,
) {
    let requests = Arc::clone(&tracked);
    let service = hyper::service::service_fn(move |request: hyper::Request<Incoming>| {
        let in_flight = InFlight::begin(&requests);
        let answer = router.clone().oneshot(request);
        async move {
            let response = answer.await?;
            Ok::<_, Infallible>(response.map(|body| InFlightBody {
                body,
                _in_flight: in_flight,
            }))
        }
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
        () = tracked.close.notified() => {
            if tracked.idle_since().is_some() {
                // Nothing in flight (the connection is not being polled, so no request can
                // begin meanwhile): dropping it closes the socket.
                tracing::debug!(%peer, "closed an idle connection to make room for a new one");
                return;
            }
            // A request began after the accept loop chose this connection: answer it, then close.
            connection.as_mut().graceful_shutdown();
            connection.await
        }
    };
    if let Err(e) = served {
        tracing::debug!(%peer, error = %e, "connection ended with an error");
    }
}

/// The live connection with no request in flight that has been idle longest, if any.
fn idle_longest(live: &HashMap<task::Id, Arc<Connection>>) -> Option<task::Id> {
    live.iter()
        .filter_map(|(id, connection)| Some((connection.idle_since()?, *id)))
        .min_by_key(|(since, _)| *since)
        .map(|(_, id)| id)
}

/// What the accept loop knows of a connection: whether it is serving a request, and how to
/// close it.
struct Connection {
    activity: Mutex<Activity>,
    /// Notified when the accept loop closes the connection to make room for a new one.
    close: Notify,
}

struct Activity {
    /// Requests being answered, their response bodies included (HTTP/1 answers one at a time;
    /// a count rather than a flag so that nothing depends on that).
    in_flight: u32,
    /// When the connection last became idle: when it was accepted, or its last answer was sent.
    idle_since: Instant,
}

impl Connection {
    fn new() -> Self {
        Self {
            activity: Mutex::new(Activity {
                in_flight: 0,
                idle_since: Instant::now(),
            }),
            close: Notify::new(),
        }
    }

    fn activity(&self) -> std::sync::MutexGuard<'_, Activity> {
        // The lock guards two plain fields that every holder leaves consistent.
        self.activity.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Since when the connection has had no request in flight; `None` while it has one.
    fn idle_since(&self) -> Option<Instant> {
        let activity = self.activity();
        (activity.in_flight == 0).then_some(activity.idle_since)
    }
}

/// A request in flight on a connection, from the moment its head is in until its answer has been
/// sent (or abandoned).
struct InFlight(Arc<Connection>);

impl InFlight {
    fn begin(connection: &Arc<Connection>) -> Self {
        connection.activity().in_flight += 1;
        Self(Arc::clone(connection))
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut activity = self.0.activity();
        activity.in_flight = activity.in_flight.saturating_sub(1);
        if activity.in_flight == 0 {
            activity.idle_since = Instant::now();
        }
    }
}

/// A response body that keeps its request in flight until hyper has sent it and drops it, so
/// that a connection still streaming a large answer (an Arrow rank plan) is never taken for idle.
struct InFlightBody {
    body: Body,
    /// Held, not read: dropped with the body.
    _in_flight: InFlight,
}

impl HttpBody for InFlightBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
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
