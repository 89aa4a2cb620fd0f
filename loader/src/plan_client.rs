//! Fetching rank plans from a tessera server (`tessera load --server URL`): the job's layout or
//! explicit requests are POSTed to `/v1/plans` (every rank may send the same body: the server
//! computes the plan once and answers all of them with the same id), then each rank GETs its own
//! plan as Arrow IPC from `/v1/plans/{plan}/ranks/{rank}`.
//!
//! Errors say what failed: a server that cannot be reached (after retries with backoff, since
//! at job start the server may still be coming up), or the server's own `{"error", "detail"}`
//! answer with its status (a 4xx is the caller's to fix and is not retried). Retries follow
//! tessera's one [`RetryPolicy`] ([`PlanClientOptions::retry`]); only errors that are not
//! [`PlanClientError::is_permanent`] are retried.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use backon::Retryable;
use serde::Deserialize;
use tessera_planner::{ExplicitRequests, Layout, PlanSummary, RankPlan};
use thiserror::Error;

use tessera_storage::{RetryPolicy, install_tls_provider};

/// The media type of Arrow IPC rank plans.
pub const ARROW_STREAM: &str = "application/vnd.apache.arrow.stream";

/// What to plan for: a layout or explicit per-rank requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PlanTarget {
    /// A target layout.
    Layout(Layout),
    /// Explicit per-rank requests.
    Requests(ExplicitRequests),
}

/// Options of a [`PlanClient`].
#[derive(Clone, Debug)]
pub struct PlanClientOptions {
    /// Bearer token of the server (`TESSERA_TOKEN`).
    pub token: Option<String>,
    /// Read shared pieces once and exchange them (the server's default).
    pub dedup: bool,
    /// Limit of one request. A cold plan of a 405B layout over thousands of ranks takes tens of
    /// seconds in the server, so the default is generous: 300 s.
    pub timeout: Duration,
    /// Limit of connecting: 10 s.
    pub connect_timeout: Duration,
    /// How transient failures (unreachable server, 502, 503, 504) are retried: 5 attempts, 500 ms
    /// before the first retry, doubled for each next one with jitter. The four retries then wait
    /// 7.5 s (up to twice that with jitter), long enough for a server pod to restart behind its
    /// service. Only `max_attempts`, `first_backoff` and `max_backoff` apply: a plan request's
    /// limits are [`timeout`](Self::timeout) and [`connect_timeout`](Self::connect_timeout),
    /// since a cold plan takes far longer than a storage read.
    pub retry: RetryPolicy,
}

impl Default for PlanClientOptions {
    fn default() -> Self {
        Self {
            token: None,
            dedup: true,
            timeout: Duration::from_secs(300),
            connect_timeout: Duration::from_secs(10),
            retry: RetryPolicy {
                max_attempts: 5,
                first_backoff: Duration::from_millis(500),
                ..RetryPolicy::default()
            },
        }
    }
}

/// The server's answer to a plan request.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct CreatedPlan {
    /// Plan id.
    pub plan: String,
    /// The checkpoint planned against (`latest` resolved to its step).
    pub checkpoint: String,
    /// Number of ranks.
    pub world: u32,
    /// Totals of the plan.
    pub summary: PlanSummary,
    /// Identity of the checkpoint the server planned against (absent from servers that predate
    /// identities); every rank plan carries it too.
    #[serde(default)]
    pub checkpoint_identity: Option<String>,
}

/// Errors of talking to a plan server.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PlanClientError {
    /// A server URL that is not `http(s)://host[:port][/prefix]`.
    #[error("invalid plan server URL {url:?}: {detail}")]
    InvalidUrl {
        /// The URL given.
        url: String,
        /// What is wrong.
        detail: String,
    },
    /// No answer: connection refused, DNS failure, timeout (after the retries).
    #[error("cannot reach the plan server at {url} ({attempts} attempts): {detail}")]
    Unreachable {
        /// The URL requested.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        detail: String,
    },
    /// The server answered with an error status.
    #[error("the plan server refused {what}: {status} {kind}: {detail}")]
    Server {
        /// What was asked (`POST /v1/plans`).
        what: String,
        /// HTTP status.
        status: u16,
        /// The server's error kind (`invalid_layout`, `unknown_checkpoint`, ...).
        kind: String,
        /// The server's message.
        detail: String,
    },
    /// An answer that does not parse as what was asked for.
    #[error("unexpected answer from the plan server for {what}: {detail}")]
    Protocol {
        /// What was asked.
        what: String,
        /// What is wrong.
        detail: String,
    },
}

impl PlanClientError {
    /// Whether retrying cannot help (everything but an unreachable or overloaded server).
    pub fn is_permanent(&self) -> bool {
        match self {
            PlanClientError::Unreachable { .. } => false,
            PlanClientError::Server { status, .. } => !is_transient_status(*status),
            _ => true,
        }
    }

    /// The HTTP status of a [`PlanClientError::Server`] error.
    pub fn status(&self) -> Option<u16> {
        match self {
            PlanClientError::Server { status, .. } => Some(*status),
            _ => None,
        }
    }
}

fn is_transient_status(status: u16) -> bool {
    matches!(status, 502..=504)
}

/// A client of one plan server.
#[derive(Clone, Debug)]
pub struct PlanClient {
    base: String,
    client: reqwest::Client,
    options: PlanClientOptions,
}

impl PlanClient {
    /// A client of the server at `server_url` (`http://host:port`, optionally with a path prefix
    /// when the server sits behind a proxy). Does no IO.
    pub fn new(server_url: &str, options: PlanClientOptions) -> Result<Self, PlanClientError> {
        let invalid = |detail: String| PlanClientError::InvalidUrl {
            url: server_url.to_string(),
            detail,
        };
        let url = reqwest::Url::parse(server_url).map_err(|e| invalid(e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(invalid("use http:// or https://".to_string()));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(invalid("no host".to_string()));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(invalid("no query or fragment, please".to_string()));
        }
        // The client is built with rustls but no bundled provider.
        install_tls_provider();
        let client = reqwest::Client::builder()
            .timeout(options.timeout)
            .connect_timeout(options.connect_timeout)
            .build()
            .map_err(|e| invalid(error_chain(&e)))?;
        Ok(Self {
            base: url.as_str().trim_end_matches('/').to_string(),
            client,
            options,
        })
    }

    /// `POST /v1/plans` for `checkpoint` (`<run>/<step>` or `<run>/latest`) and `target`.
    pub async fn create_plan(
        &self,
        checkpoint: &str,
        target: &PlanTarget,
    ) -> Result<CreatedPlan, PlanClientError> {
        let mut body = serde_json::json!({
            "checkpoint": checkpoint,
            "options": {"dedup": self.options.dedup},
        });
        let (key, value) = match target {
            PlanTarget::Layout(layout) => ("layout", serde_json::to_value(layout)),
            PlanTarget::Requests(requests) => ("requests", serde_json::to_value(requests)),
        };
        let what = "POST /v1/plans".to_string();
        body[key] = value.map_err(|e| PlanClientError::Protocol {
            what: what.clone(),
            detail: format!("cannot encode the {key}: {e}"),
        })?;
        let body = body.to_string().into_bytes();
        let url = format!("{}/v1/plans", self.base);
        let bytes = self
            .send(&what, &url, || {
                self.client
                    .post(&url)
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body.clone())
            })
            .await?;
        serde_json::from_slice(&bytes).map_err(|e| PlanClientError::Protocol {
            what,
            detail: format!("not a plan answer: {e}"),
        })
    }

    /// `GET /v1/plans/{plan}/ranks/{rank}` as Arrow IPC, checked to be that rank's plan.
    pub async fn rank_plan(&self, plan: &str, rank: u32) -> Result<RankPlan, PlanClientError> {
        let what = format!("GET /v1/plans/{plan}/ranks/{rank}");
        if plan.is_empty() || !plan.bytes().all(|b| b.is_ascii_alphanumeric()) {
            return Err(PlanClientError::Protocol {
                what,
                detail: format!("plan id {plan:?} is not alphanumeric"),
            });
        }
        let url = format!("{}/v1/plans/{plan}/ranks/{rank}", self.base);
        let bytes = self
            .send(&what, &url, || {
                self.client
                    .get(&url)
                    .header(reqwest::header::ACCEPT, ARROW_STREAM)
            })
            .await?;
        let decoded = RankPlan::from_arrow_ipc(&bytes).map_err(|e| PlanClientError::Protocol {
            what: what.clone(),
            detail: e.to_string(),
        })?;
        if decoded.rank != rank {
            return Err(PlanClientError::Protocol {
                what,
                detail: format!("got the plan of rank {}", decoded.rank),
            });
        }
        Ok(decoded)
    }

    /// Sends a request (rebuilt for each attempt), retrying transient failures; returns the
    /// body of a 2xx answer.
    async fn send(
        &self,
        what: &str,
        url: &str,
        request: impl Fn() -> reqwest::RequestBuilder,
    ) -> Result<bytes::Bytes, PlanClientError> {
        let attempts = &AtomicU32::new(0);
        let request = &request;
        let attempt = move || async move {
            let attempt = attempts.fetch_add(1, Ordering::Relaxed) + 1;
            let mut builder = request();
            if let Some(token) = &self.options.token {
                builder = builder.bearer_auth(token);
            }
            match builder.send().await {
                Ok(response) => {
                    let status = response.status();
                    match response.bytes().await {
                        Ok(body) if status.is_success() => Ok(body),
                        Ok(body) => Err(server_error(what, status.as_u16(), &body)),
                        Err(e) => Err(PlanClientError::Unreachable {
                            url: url.to_string(),
                            attempts: attempt,
                            detail: format!("reading the answer: {}", error_chain(&e)),
                        }),
                    }
                }
                Err(e) => Err(PlanClientError::Unreachable {
                    url: url.to_string(),
                    attempts: attempt,
                    detail: error_chain(&e),
                }),
            }
        };
        attempt
            .retry(self.options.retry.backoff())
            .when(|e| !e.is_permanent())
            .await
    }
}

/// The server's `{"error", "detail"}` answer (or the start of whatever else it sent).
fn server_error(what: &str, status: u16, body: &[u8]) -> PlanClientError {
    #[derive(Deserialize)]
    struct ErrorBody {
        error: String,
        detail: String,
    }
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => PlanClientError::Server {
            what: what.to_string(),
            status,
            kind: e.error,
            detail: e.detail,
        },
        Err(_) => {
            let text = String::from_utf8_lossy(body);
            let text: String = text.chars().take(200).collect();
            PlanClientError::Server {
                what: what.to_string(),
                status,
                kind: "http".to_string(),
                detail: if text.trim().is_empty() {
                    "(no body)".to_string()
                } else {
                    text
                },
            }
        }
    }
}

/// An error with its sources: reqwest's own message alone says little ("error sending request").
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let next = e.to_string();
        if !text.contains(&next) {
            text.push_str(": ");
            text.push_str(&next);
        }
        source = e.source();
    }
    text
}

/// The id a tessera server gives the checkpoint at `location`: its last two path components,
/// `<run>/<step>` (the server lists `<run>/<step>` directories of its root). `None` when the
/// location has fewer than two, or when the next-to-last is a URL scheme.
pub fn server_checkpoint_id(location: &str) -> Option<String> {
    let parts: Vec<&str> = location.trim_end_matches('/').rsplit('/').take(2).collect();
    match parts.as_slice() {
        [step, run] if !step.is_empty() && !run.is_empty() && !run.contains(':') => {
            Some(format!("{run}/{step}"))
        }
        _ => None,
    }
}

/// Plans `target` against `checkpoint_id` on the server at `server_url` and fetches rank
/// `rank`'s plan: what one rank of a job does at start.
pub async fn fetch_rank_plan(
    server_url: &str,
    checkpoint_id: &str,
    target: &PlanTarget,
    rank: u32,
    token: Option<&str>,
) -> Result<RankPlan, PlanClientError> {
    let client = PlanClient::new(
        server_url,
        PlanClientOptions {
            token: token.map(str::to_string),
            ..PlanClientOptions::default()
        },
    )?;
    let created = client.create_plan(checkpoint_id, target).await?;
    if rank >= created.world {
        return Err(PlanClientError::Protocol {
            what: "POST /v1/plans".to_string(),
            detail: format!(
                "rank {rank} is out of range: the plan has {} ranks",
                created.world
            ),
        });
    }
    client.rank_plan(&created.plan, rank).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_checked() {
        for bad in [
            "",
            "localhost:8080",
            "ftp://host",
            "http://",
            "http://h/?q=1",
        ] {
            assert!(
                matches!(
                    PlanClient::new(bad, PlanClientOptions::default()),
                    Err(PlanClientError::InvalidUrl { .. })
                ),
                "{bad}"
            );
        }
        let client = PlanClient::new(
            "http://127.0.0.1:8080/tessera/",
            PlanClientOptions::default(),
        );
        assert!(matches!(client, Ok(c) if c.base == "http://127.0.0.1:8080/tessera"));
    }

    #[test]
    fn server_errors_carry_the_servers_detail() {
        let e = server_error(
            "POST /v1/plans",
            422,
            br#"{"error": "invalid_layout", "detail": "invalid layout: mesh dimension \"dp\" has size 0"}"#,
        );
        assert!(e.is_permanent());
        assert_eq!(e.status(), Some(422));
        assert!(
            e.to_string()
                .contains("422 invalid_layout: invalid layout: mesh dimension")
        );
        let e = server_error("GET /x", 503, b"upstream down");
        assert!(!e.is_permanent());
        assert!(e.to_string().contains("upstream down"));
    }
}
