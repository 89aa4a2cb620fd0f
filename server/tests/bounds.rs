//! The server's resource bounds: plan computations refused by their memory estimate before
//! they start, the plan cache weighing what a plan really holds, and connections bounded in
//! number and in how long they may take to send a request head (real sockets on loopback).

#![allow(clippy::unwrap_used)]

mod support;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use serde_json::json;
use tempfile::TempDir;
use tessera_metadata::formats::native::open_checkpoint;
use tessera_planner::presets::fsdp;
use tessera_planner::{PlanOptions, plan};
use tessera_server::{AppState, ServerConfig, app};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use support::*;

async fn catalog() -> TempDir {
    let dir = TempDir::new().unwrap();
    write_catalog(dir.path()).await;
    dir
}

fn config(dir: &TempDir) -> ServerConfig {
    ServerConfig::new(dir.path().to_str().unwrap())
}

/// A 2^20-rank mesh is inside the server's rank cap, but its plan would hold about a hundred
/// million (rank, tensor) requests: it is refused from the estimate, with the estimate, before
/// any per-rank table is built (before the fix the server tried, and died allocating).
#[tokio::test]
async fn a_mesh_whose_plan_would_not_fit_is_refused_with_the_estimate() {
    let dir = catalog().await;
    let app = app(AppState::new(config(&dir)).unwrap());
    let body = json!({
        "checkpoint": "gpt/step-000200",
        "layout": {"mesh": [{"name": "dp", "size": 1 << 20}], "rules": [{"match": "*", "placements": ["replicate"]}]},
    })
    .to_string();
    let started = Instant::now();
    let answer = post_json(&app, "/v1/plans", body).await;
    let elapsed = started.elapsed();
    eprintln!(
        "1048576-rank plan refused in {:.3} s",
        elapsed.as_secs_f64()
    );
    answer.assert_error(
        StatusCode::UNPROCESSABLE_ENTITY,
        "plan_too_large",
        "1048576 ranks",
    );
    let detail = answer.json()["detail"].as_str().unwrap().to_string();
    assert!(detail.contains("requests"), "{detail}");
    assert!(
        detail.contains(&format!(
            "bound of {} bytes",
            tessera_server::DEFAULT_PLAN_MEMORY_BYTES
        )),
        "{detail}"
    );
}

/// The bound is the configuration's: a small plan passes the default and is refused under a
/// bound below its estimate.
#[tokio::test]
async fn the_memory_bound_is_configurable() {
    let dir = catalog().await;
    let body = plan_body("gpt/step-000200", &fsdp(4).unwrap());
    let open = app(AppState::new(config(&dir)).unwrap());
    assert_eq!(
        post_json(&open, "/v1/plans", body.clone()).await.status,
        StatusCode::OK
    );
    let mut tight = config(&dir);
    tight.plan_memory_bytes = 64 * 1024;
    let tight = app(AppState::new(tight).unwrap());
    post_json(&tight, "/v1/plans", body).await.assert_error(
        StatusCode::UNPROCESSABLE_ENTITY,
        "plan_too_large",
        "bound of 65536 bytes",
    );
}

/// What the plan cache counts is what the cached plan holds: the planner's count of the plan's
/// tables plus the entry, not a guess from its totals.
#[tokio::test]
async fn the_plan_cache_weighs_what_a_plan_holds() {
    let dir = catalog().await;
    let app = app(AppState::new(config(&dir)).unwrap());
    let layout = fsdp(64).unwrap();
    let answer = post_json(&app, "/v1/plans", plan_body("gpt/step-000200", &layout)).await;
    assert_eq!(answer.status, StatusCode::OK);
    let store = LocalFileSystem::new_with_prefix(dir.path()).unwrap();
    let meta = Arc::new(
        open_checkpoint(&store, &Path::from("gpt/step-000200"))
            .await
            .unwrap()
            .meta,
    );
    let requests = layout.resolve(meta.tensors()).unwrap();
    let held = plan(&meta, &requests, &PlanOptions::default())
        .unwrap()
        .heap_bytes();
    let text = get(&app, "/metrics").await.text();
    let weighed = metric(&text, "tessera_cache_bytes{cache=\"plan\"}").unwrap() as u64;
    assert!(
        weighed >= held && weighed <= held + 1024,
        "the plan cache counts {weighed} bytes for a plan holding {held}"
    );
}

/// A server on loopback with small connection bounds; stops when the sender is dropped.
async fn start(
    dir: &TempDir,
    header_timeout: Duration,
    max_connections: usize,
) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let mut config = config(dir);
    config.header_timeout = header_timeout;
    config.max_connections = max_connections;
    start_with(config).await
}

async fn start_with(config: ServerConfig) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let state = AppState::new(config).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(tessera_server::serve(listener, state, async move {
        let _ = stopped.await;
    }));
    (addr, stop)
}

/// `GET path` on a new connection: the whole answer, or `None` if the server closed the
/// connection without one.
async fn fetch(addr: SocketAddr, path: &str) -> Option<String> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    stream
        .write_all(
            format!("GET {path} HTTP/1.1\r\nhost: t\r\nconnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await.ok()?;
    Some(String::from_utf8_lossy(&answer).to_string()).filter(|text| !text.is_empty())
}

/// `GET /healthz` on a new connection: the status line, or `None` if the server closed it.
async fn healthz(addr: SocketAddr) -> Option<String> {
    fetch(addr, "/healthz")
        .await?
        .lines()
        .next()
        .map(str::to_string)
}

/// Waits until the server closes `stream` (EOF or reset), at most `limit`; the time it took.
async fn closed_within(stream: &mut TcpStream, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(
            limit.saturating_sub(started.elapsed()),
            stream.read(&mut buf),
        )
        .await
        {
            Err(_) => return None,
            Ok(Ok(0) | Err(_)) => return Some(started.elapsed()),
            // A 408 or similar before the close is fine; keep reading until it closes.
            Ok(Ok(_)) => {}
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_and_idle_connections_are_bounded_and_healthz_still_answers() {
    let dir = catalog().await;
    let header_timeout = Duration::from_secs(2);
    let cap = 8;
    let (addr, _stop) = start(&dir, header_timeout, cap).await;
    // cap - 2 clients that send part of a request head and stall, and one that sends nothing.
    let mut slow = Vec::new();
    for _ in 0..cap - 2 {
        let mut stream = TcpStream::connect(addr).await.unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nhost: t\r\n")
            .await
            .unwrap();
        slow.push(stream);
    }
    slow.push(TcpStream::connect(addr).await.unwrap());
    // The last slot still answers.
    assert_eq!(healthz(addr).await.as_deref(), Some("HTTP/1.1 200 OK"));
    // A keep-alive client that got its answer and stays idle takes the last slot...
    let mut idle = TcpStream::connect(addr).await.unwrap();
    idle.write_all(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = idle.read(&mut buf).await.unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 200 OK"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    // ...and one more connection is still answered: it takes the place of the connection idle
    // longest (the first stalled head), which is closed at once.
    assert_eq!(healthz(addr).await.as_deref(), Some("HTTP/1.1 200 OK"));
    let mut oldest = slow.remove(0);
    assert!(
        closed_within(&mut oldest, header_timeout / 2)
            .await
            .is_some(),
        "the connection idle longest was not closed to make room"
    );
    // The other stalled and idle ones are closed after the header timeout (with a generous margin).
    let margin = header_timeout + Duration::from_secs(8);
    for (i, stream) in slow
        .iter_mut()
        .chain(std::iter::once(&mut idle))
        .enumerate()
    {
        assert!(
            closed_within(stream, margin).await.is_some(),
            "connection {i} still open {margin:?} after it stalled"
        );
    }
    // Slots free again.
    assert_eq!(healthz(addr).await.as_deref(), Some("HTTP/1.1 200 OK"));
}

/// Clients holding every connection slot idle (they connect and send nothing, and would connect
/// again as they are closed) do not keep others out: a new connection takes the place of the
/// one idle longest, so `/healthz` answers at once. Before the fix it was closed on arrival for
/// as long as the idle ones lasted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_at_the_limit_make_room_for_a_new_one() {
    let dir = catalog().await;
    let cap = 8;
    // A header timeout far beyond the test: only making room can let the new client in.
    let (addr, _stop) = start(&dir, Duration::from_secs(60), cap).await;
    let mut idle = Vec::new();
    for _ in 0..cap {
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    for round in 0..3 {
        let started = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(2), healthz(addr)).await;
        assert_eq!(
            answer.ok().flatten().as_deref(),
            Some("HTTP/1.1 200 OK"),
            "round {round}: /healthz not answered within 2 s with {cap} idle connections held"
        );
        eprintln!(
            "round {round}: /healthz answered in {:.3} s",
            started.elapsed().as_secs_f64()
        );
        // The idle client reconnects, as an attacker would.
        idle.push(TcpStream::connect(addr).await.unwrap());
    }
    // The first idle connection was the one closed, and only as many as were needed.
    assert!(
        closed_within(&mut idle[0], Duration::from_secs(1))
            .await
            .is_some(),
        "the connection idle longest is still open"
    );
    assert!(
        closed_within(&mut idle[cap + 2], Duration::from_millis(200))
            .await
            .is_none(),
        "the newest idle connection was closed"
    );
    let metrics = fetch(addr, "/metrics").await.unwrap();
    let closed = metric(&metrics, "tessera_connections_closed_idle_total").unwrap();
    assert!(closed >= 3.0, "{closed} idle connections closed\n{metrics}");
}

/// Sends `POST /v1/plans` with `Expect: 100-continue` and a body of `length` bytes, of which it
/// sends `sent`, after the server's `100 Continue`: from then on the request is in the handler,
/// reading its body.
async fn request_in_flight(addr: SocketAddr, length: usize, sent: &[u8]) -> TcpStream {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!(
                "POST /v1/plans HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\nexpect: 100-continue\r\ncontent-length: {length}\r\n\r\n"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(2), stream.read(&mut buf))
        .await
        .expect("no 100 Continue within 2 s")
        .unwrap();
    assert!(
        buf[..n].starts_with(b"HTTP/1.1 100 Continue"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    stream.write_all(sent).await.unwrap();
    stream
}

/// At the limit with a request in flight on every connection there is nothing idle to close: a
/// new connection is closed at once (and counted), and the requests in flight go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn at_the_limit_with_every_connection_busy_a_new_one_is_refused() {
    let dir = catalog().await;
    let cap = 8;
    let (addr, _stop) = start(&dir, Duration::from_secs(60), cap).await;
    let body = br#"{"checkpoint": 1}"#;
    let mut busy = Vec::new();
    for _ in 0..cap {
        busy.push(request_in_flight(addr, body.len(), &body[..4]).await);
    }
    let mut extra = TcpStream::connect(addr).await.unwrap();
    let _ = extra
        .write_all(b"GET /healthz HTTP/1.1\r\nhost: t\r\n\r\n")
        .await;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(1), extra.read_to_end(&mut answer)).await;
    assert!(
        matches!(read, Ok(Ok(0) | Err(_))),
        "a connection past the limit of {cap} busy ones was kept open or answered: {read:?} {}",
        String::from_utf8_lossy(&answer)
    );
    // Every request in flight is still served: finishing one body gets its answer.
    for stream in &mut busy {
        assert!(
            closed_within(stream, Duration::from_millis(50))
                .await
                .is_none(),
            "a connection with a request in flight was closed"
        );
    }
    let first = &mut busy[0];
    first.write_all(&body[4..]).await.unwrap();
    let mut buf = [0u8; 1024];
    let n = tokio::time::timeout(Duration::from_secs(2), first.read(&mut buf))
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&buf[..n]);
    assert!(text.starts_with("HTTP/1.1 400"), "{text}");
    // Its connection is idle now: the next client takes its place and sees the refusal counted.
    let metrics = fetch(addr, "/metrics").await.unwrap();
    assert_eq!(
        metric(&metrics, "tessera_connections_refused_total"),
        Some(1.0),
        "{metrics}"
    );
}

/// A client that sends a request head promising a body and then stalls is answered 408
/// `body_timeout` once the body timeout passes, instead of holding its connection and request
/// task for as long as it likes (the header timeout no longer runs once the head is in).
#[tokio::test]
async fn a_stalled_request_body_is_answered_408_after_the_body_timeout() {
    let dir = catalog().await;
    let mut config = config(&dir);
    config.body_timeout = Duration::from_secs(1);
    let (addr, _stop) = start_with(config).await;
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            b"POST /v1/plans HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"checkpoint\": ",
        )
        .await
        .unwrap();
    let started = Instant::now();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = [0u8; 1024];
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    answer.extend_from_slice(&buf[..n]);
                    if answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.ends_with(b"}") {
                        break;
                    }
                }
            }
        }
    })
    .await;
    assert!(read.is_ok(), "no answer 20 s after the body stalled");
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"body_timeout\""), "{text}");
    assert!(text.contains("within 1 s"), "{text}");
    eprintln!(
        "stalled body answered 408 after {:.2} s",
        started.elapsed().as_secs_f64()
    );
}

/// A client that keeps a body coming one byte at a time is cut when the body timeout has passed
/// since its head, not left to trickle for as long as it likes (before the fix the timer
/// restarted with every byte, so a byte a second was never cut).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_request_body_is_cut_at_the_body_timeout() {
    let dir = catalog().await;
    let body_timeout = Duration::from_secs(1);
    let mut config = config(&dir);
    config.body_timeout = body_timeout;
    let (addr, _stop) = start_with(config).await;
    let stream = TcpStream::connect(addr).await.unwrap();
    let (mut reader, mut writer) = stream.into_split();
    writer
        .write_all(
            b"POST /v1/plans HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n",
        )
        .await
        .unwrap();
    let head_sent = Instant::now();
    // 100 bytes at one per 200 ms would take 20 s; the server must not wait for them.
    let trickle = tokio::spawn(async move {
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(200)).await;
            if writer.write_all(b" ").await.is_err() {
                break;
            }
        }
    });
    let limit = body_timeout + Duration::from_millis(1500);
    let mut answer = Vec::new();
    let read = tokio::time::timeout(limit, async {
        let mut buf = [0u8; 1024];
        loop {
            match reader.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    answer.extend_from_slice(&buf[..n]);
                    if answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.ends_with(b"}") {
                        break;
                    }
                }
            }
        }
    })
    .await;
    let elapsed = head_sent.elapsed();
    trickle.abort();
    assert!(
        read.is_ok(),
        "a body trickled at a byte per 200 ms was still being read {limit:?} after its head (body timeout {body_timeout:?})"
    );
    let text = String::from_utf8_lossy(&answer);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("\"body_timeout\""), "{text}");
    assert!(
        elapsed >= body_timeout,
        "cut after {elapsed:?}, before the body timeout of {body_timeout:?}"
    );
}
