//! The server end to end over real sockets on 127.0.0.1: ranks fetch their plans through the
//! loader's plan client and load every byte; plan client errors; a burst of plan requests over
//! HTTP; `tessera serve` as a process until SIGTERM; a catalog root on S3.
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::SocketAddr;
use std::time::Duration;

use futures::StreamExt;
use object_store::ObjectStoreExt;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::plan_client::{
    PlanClient, PlanClientError, PlanClientOptions, PlanTarget, fetch_rank_plan,
};
use tessera_planner::{ExplicitRequests, Layout};
use tessera_server::ServerConfig;
use tessera_storage as storage;
use tessera_storage::testing::S3TestServer;
use tessera_storage::{RetryPolicy, StorageOptions};

mod server_support;

use server_support::{RunningServer, load_and_check, megatron, write_tiny};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// A plain HTTP/1.1 GET over a blocking socket: status and body.
fn http_get(addr: SocketAddr, path: &str, token: Option<&str>) -> (u16, String) {
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{auth}Connection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = response
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    (status, body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_fetch_their_plans_from_the_server_and_load_every_byte() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    let ckpt = root.join("gpt/step-000100");
    write_tiny(
        ckpt.to_str().unwrap(),
        &megatron(2, 2, 2, true),
        &StorageOptions::default(),
    )
    .await;
    let server = RunningServer::start(ServerConfig::new(root.to_str().unwrap())).await;
    let client = PlanClient::new(&server.url(), PlanClientOptions::default()).unwrap();
    let checkpoint = Checkpoint::open(storage::open(ckpt.to_str().unwrap()).unwrap())
        .await
        .unwrap();

    // A layout: Megatron tp4 pp1 dp2 with a distributed optimizer (8 ranks).
    let target = PlanTarget::Layout(megatron(4, 1, 2, true));
    let created = client.create_plan("gpt/latest", &target).await.unwrap();
    assert_eq!(created.checkpoint, "gpt/step-000100");
    assert_eq!(created.world, 8);
    let mut plans = Vec::new();
    for rank in 0..created.world {
        plans.push(client.rank_plan(&created.plan, rank).await.unwrap());
    }
    let one = fetch_rank_plan(&server.url(), "gpt/step-000100", &target, 3, None)
        .await
        .unwrap();
    assert_eq!(one, plans[3]);
    let read = load_and_check(&checkpoint, plans).await;
    assert_eq!(read, created.summary.bytes_read, "every piece read once");

    // Explicit requests (flat ranges, as ZeRO buffers ask).
    let requests: ExplicitRequests = serde_json::from_value(serde_json::json!({"ranks": [
        [{"fqn": "optim.state.model.final_norm.weight.exp_avg", "flat": [3, 50]}],
        [{"fqn": "model.lm_head.weight", "offsets": [10, 0], "lengths": [500, 64]},
         {"fqn": "optim.state.model.final_norm.weight.exp_avg", "flat": [0, 64]}],
    ]}))
    .unwrap();
    let target = PlanTarget::Requests(requests);
    let created = client
        .create_plan("gpt/step-000100", &target)
        .await
        .unwrap();
    let mut plans = Vec::new();
    for rank in 0..created.world {
        plans.push(client.rank_plan(&created.plan, rank).await.unwrap());
    }
    load_and_check(&checkpoint, plans).await;
    assert_eq!(server.state.metrics().plan_computations, 2);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_client_errors_say_what_went_wrong() {
    // Nothing listens: unreachable, after the configured retries.
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let quick = PlanClientOptions {
        retry: RetryPolicy {
            max_attempts: 3,
            first_backoff: Duration::from_millis(10),
            ..RetryPolicy::default()
        },
        ..PlanClientOptions::default()
    };
    let client = PlanClient::new(&format!("http://127.0.0.1:{port}"), quick.clone()).unwrap();
    let target = PlanTarget::Layout(megatron(1, 1, 2, false));
    let err = client
        .create_plan("gpt/step-000100", &target)
        .await
        .unwrap_err();
    assert!(
        matches!(err, PlanClientError::Unreachable { attempts: 3, .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains(&format!(
            "cannot reach the plan server at http://127.0.0.1:{port}"
        )),
        "{err}"
    );

    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    write_tiny(
        root.join("gpt/step-000100").to_str().unwrap(),
        &megatron(2, 2, 2, true),
        &StorageOptions::default(),
    )
    .await;
    let mut config = ServerConfig::new(root.to_str().unwrap());
    config.token = Some("t0ken".to_string());
    let server = RunningServer::start(config).await;

    // No token, or a wrong one: 401 with the server's detail, not retried.
    for token in [None, Some("wrong")] {
        let client = PlanClient::new(
            &server.url(),
            PlanClientOptions {
                token: token.map(str::to_string),
                ..quick.clone()
            },
        )
        .unwrap();
        let err = client
            .create_plan("gpt/step-000100", &target)
            .await
            .unwrap_err();
        assert_eq!(err.status(), Some(401), "{err}");
        assert!(err.is_permanent());
        assert!(err.to_string().contains("Authorization: Bearer"), "{err}");
    }
    let authed = PlanClientOptions {
        token: Some("t0ken".to_string()),
        ..quick
    };
    let client = PlanClient::new(&server.url(), authed).unwrap();
    // The planner's reason comes through.
    let bad = Layout::from_json(
        r#"{"mesh": [{"name": "dp", "size": 2}], "rules": [{"match": "model.*", "placements": ["shard(0)"]}]}"#,
    )
    .unwrap();
    let err = client
        .create_plan("gpt/step-000100", &PlanTarget::Layout(bad))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, PlanClientError::Server { status: 422, kind, .. } if kind == "invalid_layout"),
        "{err}"
    );
    assert!(err.to_string().contains("matches no rule"), "{err}");
    let err = client
        .create_plan("gpt/step-000999", &target)
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(404));
    assert!(
        err.to_string().contains("no checkpoint gpt/step-000999"),
        "{err}"
    );
    let err = client.create_plan("../etc", &target).await.unwrap_err();
    assert_eq!(err.status(), Some(400));
    let created = client
        .create_plan("gpt/step-000100", &target)
        .await
        .unwrap();
    let err = client.rank_plan(&created.plan, 2).await.unwrap_err();
    assert_eq!(err.status(), Some(404));
    assert!(err.to_string().contains("no rank 2"), "{err}");
    let err = fetch_rank_plan(&server.url(), "gpt/step-000100", &target, 5, Some("t0ken"))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("rank 5 is out of range"), "{err}");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_plan_requests_over_http_computes_the_plan_once() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    write_tiny(
        root.join("gpt/step-000100").to_str().unwrap(),
        &megatron(2, 2, 2, true),
        &StorageOptions::default(),
    )
    .await;
    let server = RunningServer::start(ServerConfig::new(root.to_str().unwrap())).await;
    let client = PlanClient::new(&server.url(), PlanClientOptions::default()).unwrap();
    let target = PlanTarget::Layout(megatron(2, 2, 8, true));
    // 2048 requests, 256 connections at a time (a job's ranks, bounded for a 2-core machine).
    let ids: Vec<String> = futures::stream::iter(0..2048)
        .map(|_| {
            let (client, target) = (client.clone(), target.clone());
            async move {
                client
                    .create_plan("gpt/step-000100", &target)
                    .await
                    .unwrap()
                    .plan
            }
        })
        .buffer_unordered(256)
        .collect()
        .await;
    assert!(ids.iter().all(|id| *id == ids[0]));
    let addr = server.addr;
    let (status, metrics) = tokio::task::spawn_blocking(move || http_get(addr, "/metrics", None))
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(
        metrics.contains("\ntessera_plan_computations_total 1\n"),
        "{metrics}"
    );
    assert!(metrics.contains(
        "tessera_http_requests_total{route=\"/v1/plans\",method=\"POST\",status=\"200\"} 2048"
    ));
    server.stop().await;
}

#[cfg(unix)]
#[test]
fn tessera_serve_runs_until_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(write_tiny(
        root.join("gpt/step-000100").to_str().unwrap(),
        &megatron(2, 2, 2, true),
        &StorageOptions::default(),
    ));
    let (mut child, addr) = start_tessera_serve(&root, "from-env", std::process::Stdio::piped());
    assert_eq!(http_get(addr, "/healthz", None).0, 200);
    assert_eq!(http_get(addr, "/v1/checkpoints", None).0, 401);
    let (status, body) = http_get(addr, "/v1/checkpoints", Some("from-env"));
    assert_eq!(status, 200);
    let catalog: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(catalog["checkpoints"][0]["id"], "gpt/step-000100");
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("tessera serve did not stop within 15 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "exit {status}: {stderr}");
}

#[test]
fn tessera_serve_refuses_a_bad_root() {
    let dir = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(BIN)
        .args([
            "serve",
            "--root",
            dir.path().join("missing/catalog").to_str().unwrap(),
            "--addr",
            "127.0.0.1:0",
        ])
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("does not exist"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_root_on_s3() {
    let buckets = tempfile::tempdir().unwrap();
    let s3 = S3TestServer::start(buckets.path());
    s3.create_bucket("ckpts");
    let options = s3.options();
    write_tiny(
        "s3://ckpts/catalog/gpt/step-000100",
        &megatron(2, 2, 2, true),
        &options,
    )
    .await;
    // An interrupted save next to it.
    let partial = storage::create_with("s3://ckpts/catalog/gpt/step-000200", &options).unwrap();
    partial
        .store
        .put(
            &partial.prefix.clone().join("data").join("rank-00000.bin"),
            vec![0u8; 10].into(),
        )
        .await
        .unwrap();
    let mut config = ServerConfig::new("s3://ckpts/catalog");
    config.storage = options.clone();
    let server = RunningServer::start(config).await;
    let addr = server.addr;
    let (status, body) =
        tokio::task::spawn_blocking(move || http_get(addr, "/v1/checkpoints", None))
            .await
            .unwrap();
    assert_eq!(status, 200, "{body}");
    let catalog: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(catalog["runs"][0]["latest"], "gpt/step-000100");
    assert_eq!(catalog["checkpoints"][0]["status"], "committed");
    assert_eq!(catalog["checkpoints"][1]["id"], "gpt/step-000200");
    assert_eq!(catalog["checkpoints"][1]["status"], "incomplete");

    let client = PlanClient::new(&server.url(), PlanClientOptions::default()).unwrap();
    let created = client
        .create_plan("gpt/latest", &PlanTarget::Layout(megatron(1, 2, 2, false)))
        .await
        .unwrap();
    let mut plans = Vec::new();
    for rank in 0..created.world {
        plans.push(client.rank_plan(&created.plan, rank).await.unwrap());
    }
    let checkpoint = Checkpoint::open(
        storage::open_with("s3://ckpts/catalog/gpt/step-000100", &options).unwrap(),
    )
    .await
    .unwrap();
    load_and_check(&checkpoint, plans).await;
    server.stop().await;
}

#[test]
fn tessera_load_fetches_its_plan_from_tessera_serve() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    let ckpt = root.join("gpt/step-000100");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(write_tiny(
        ckpt.to_str().unwrap(),
        &megatron(2, 2, 2, true),
        &StorageOptions::default(),
    ));
    let (mut child, addr) = start_tessera_serve(&root, "secret", std::process::Stdio::null());
    let layout = dir.path().join("layout.json");
    std::fs::write(&layout, megatron(2, 1, 2, false).to_json()).unwrap();
    let server = format!("http://{addr}");
    let load = |transport: &str, token: &str| {
        std::process::Command::new(BIN)
            .args([
                "load",
                ckpt.to_str().unwrap(),
                "--layout",
                layout.to_str().unwrap(),
            ])
            .args(["--server", &server, "--transport", transport, "--check"])
            .env("TESSERA_TOKEN", token)
            .output()
            .unwrap()
    };
    for transport in ["inproc", "tcp"] {
        let out = load(transport, "secret");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{transport}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("every byte matches the synthetic formula"),
            "{stdout}"
        );
        assert!(stdout.contains("read amplification 1.00"), "{stdout}");
    }
    // One plan computation served every rank of both loads.
    let (_, metrics) = http_get(addr, "/metrics", Some("secret"));
    assert!(
        metrics
            .lines()
            .any(|l| l == "tessera_plan_computations_total 1"),
        "{metrics}"
    );
    // A wrong token is the server's 401, named.
    let out = load("inproc", "wrong");
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("planning gpt/step-000100 on http://"),
        "{stderr}"
    );
    assert!(stderr.contains("401"), "{stderr}");
    let _ = child.kill();
    let _ = child.wait();
}

/// Starts `tessera serve` on an ephemeral loopback port with `token` in its environment and
/// returns the process and the address it printed.
fn start_tessera_serve(
    root: &std::path::Path,
    token: &str,
    stderr: std::process::Stdio,
) -> (std::process::Child, SocketAddr) {
    let mut child = std::process::Command::new(BIN)
        .args([
            "serve",
            "--root",
            root.to_str().unwrap(),
            "--addr",
            "127.0.0.1:0",
        ])
        .env("TESSERA_TOKEN", token)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::piped())
        .stderr(stderr)
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let addr: SocketAddr = line
        .strip_prefix("listening on http://")
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .parse()
        .unwrap();
    (child, addr)
}
