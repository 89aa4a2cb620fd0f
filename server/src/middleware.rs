//! Middleware of every route: the bearer token of `/v1` and `/metrics`, request metrics labelled
//! by route template, one deadline for a whole request body, and the JSON answers of requests no
//! handler takes (unknown route, wrong method, panics).

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::BoxError;
use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper::body::{Frame, SizeHint};
use sha2::{Digest, Sha256};
use tokio::time::Sleep;

use crate::{ApiError, AppState};

/// Requires `Authorization: Bearer <token>` on `/v1` and `/metrics` when the server has a token.
/// `/metrics` tells who uses the server (routes, plan and cache traffic), so it is guarded like
/// the API; `/healthz` and `/readyz` stay open because Kubernetes probes send no credentials.
pub(crate) async fn require_token(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let Some(expected) = &state.inner.token_digest else {
        return next.run(request).await;
    };
    if !needs_token(request.uri().path()) {
        return next.run(request).await;
    }
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            let (scheme, token) = v.split_once(' ')?;
            scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
        });
    match presented {
        Some(token) if constant_time_eq(&Sha256::digest(token.as_bytes()).into(), expected) => {
            next.run(request).await
        }
        _ => ApiError::Unauthorized.into_response(),
    }
}

/// Whether a route needs the token (when the server has one): the API and the metrics.
fn needs_token(path: &str) -> bool {
    path == "/v1" || path.starts_with("/v1/") || path == "/metrics"
}

/// Compares two digests without an early exit, so the time taken says nothing about where they
/// differ.
fn constant_time_eq(a: &[u8; 32], b: &[u8; 32]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y));
    std::hint::black_box(diff) == 0
}

/// Gives the request body one deadline, [`ServerConfig::body_timeout`] from now (its head is in):
/// reading it past the deadline fails with [`BodyTimedOut`], which the handler answers 408
/// `body_timeout`.
///
/// [`ServerConfig::body_timeout`]: crate::ServerConfig::body_timeout
pub(crate) async fn body_deadline(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let timeout = state.config().body_timeout;
    next.run(request.map(|body| Body::new(DeadlineBody::new(body, timeout))))
        .await
}

/// Reading a request body took longer than the body timeout allows the whole body.
#[derive(Debug)]
pub(crate) struct BodyTimedOut;

impl std::fmt::Display for BodyTimedOut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the request body did not arrive within the body timeout")
    }
}

impl std::error::Error for BodyTimedOut {}

/// A request body that must end by one deadline. tower-http's body timeout restarts its timer on
/// every frame, so a client trickling a byte a second never hits it and holds its connection and
/// request task for as long as it likes; here the clock runs once, for the whole body.
struct DeadlineBody {
    inner: Body,
    deadline: Pin<Box<Sleep>>,
}

impl DeadlineBody {
    fn new(inner: Body, timeout: Duration) -> Self {
        Self {
            inner,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl HttpBody for DeadlineBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        // The deadline first: a client that keeps bytes coming must still finish in time.
        if this.deadline.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Err(Box::new(BodyTimedOut))));
        }
        Pin::new(&mut this.inner).poll_frame(cx).map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// Counts the request and its latency under its route template.
pub(crate) async fn record_metrics(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Response {
    let started = Instant::now();
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |m| m.as_str().to_string());
    let method = request.method().as_str().to_string();
    let response = next.run(request).await;
    state.inner.metrics.request(
        &route,
        &method,
        response.status().as_u16(),
        started.elapsed(),
    );
    response
}

/// The answer for paths no route matches.
pub(crate) async fn not_found(request: Request<Body>) -> ApiError {
    ApiError::NotFound {
        path: crate::id::truncate(request.uri().path()),
    }
}

/// The answer for a method a route does not take.
pub(crate) async fn method_not_allowed() -> ApiError {
    ApiError::MethodNotAllowed
}

/// A handler panicked: log it, answer 500 without the panic text.
pub(crate) fn panic_response(panic: Box<dyn Any + Send + 'static>) -> Response {
    let message = panic
        .downcast_ref::<String>()
        .map(String::as_str)
        .or_else(|| panic.downcast_ref::<&str>().copied())
        .unwrap_or("(no message)");
    ApiError::Internal {
        detail: format!("handler panicked: {message}"),
    }
    .into_response()
}
