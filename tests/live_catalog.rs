//! Live publications listed next to the checkpoints: `tessera serve --registry` (a real server
//! on 127.0.0.1: `/v1/live`, `/v1/live/{name}`, the catalog's `live` section, the OpenAPI
//! document) and `tessera live list|show` (the binary, text and JSON), over a registry written
//! by the publish path itself (`tessera_ops::publish`: each rank's part, rank 0's commit).
#![allow(clippy::unwrap_used, missing_docs)]

mod server_support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use server_support::RunningServer;
use tessera_ops::publish::{
    Part, PartBytes, PartMemory, await_and_commit, write_part, write_part_file,
};
use tessera_ops::save::{HeldBox, Holdings};
use tessera_server::ServerConfig;

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

fn step_dir(registry: &Path, name: &str, step: u64) -> PathBuf {
    registry.join(name).join(format!("step-{step:06}"))
}

/// Publisher rank `rank` of a `world`-rank job puts its part of `step` of `name` into the
/// registry, as `tessera.publish` does: its rows of `w` (and of `b` on rank 0) laid out as its
/// data file.
async fn publish(registry: &Path, name: &str, step: u64, rank: u32, world: u32) -> Part {
    let rows = 4u64;
    let mut boxes = vec![HeldBox {
        fqn: "layers.0.w".to_string(),
        dtype: "f32".to_string(),
        shape: vec![u64::from(world) * rows, 8],
        offsets: vec![u64::from(rank) * rows, 0],
        lengths: vec![rows, 8],
    }];
    let mut data: Vec<Vec<u8>> = vec![
        (0..rows * 8)
            .flat_map(|i| (i as f32 + step as f32).to_le_bytes())
            .collect(),
    ];
    if rank == 0 {
        boxes.push(HeldBox {
            fqn: "layers.0.b".to_string(),
            dtype: "f32".to_string(),
            shape: vec![8],
            offsets: vec![0],
            lengths: vec![8],
        });
        data.push((0..8u32).flat_map(|i| (i as f32).to_le_bytes()).collect());
    }
    let slices: Vec<&[u8]> = data.iter().map(Vec::as_slice).collect();
    let (_, file) = write_part_file(rank, &boxes, &slices, &[], PartMemory::Heap)
        .await
        .unwrap();
    let part = Part {
        rank,
        world,
        step,
        url: format!("http://127.0.0.1:{}", 40000 + rank),
        path: format!("{name}/step-{step:06}/data/publisher-rank-{rank}.bin"),
        holdings: Holdings {
            boxes,
            objects: Vec::new(),
        },
        file,
        shared: None,
    };
    write_part(&step_dir(registry, name, step), &part).unwrap();
    part
}

/// Every rank of `world` publishes `step` and rank 0 commits it.
async fn publish_complete(registry: &Path, name: &str, step: u64, world: u32) {
    for rank in 0..world {
        publish(registry, name, step, rank, world).await;
    }
    await_and_commit(
        &step_dir(registry, name, step),
        world,
        step,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
}

/// `policy` (2 publisher ranks): step 100 retired, 200 complete, 300 waiting for rank 1, 400
/// with rank 1's part malformed; `critic` (1 rank): step 7 complete.
async fn registry() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path();
    publish_complete(root, "policy", 100, 2).await;
    publish_complete(root, "policy", 200, 2).await;
    // Retiring removes the manifest (python/tessera/_live.py `_retire`).
    std::fs::remove_file(step_dir(root, "policy", 100).join("manifest.json")).unwrap();
    publish(root, "policy", 300, 0, 2).await;
    publish(root, "policy", 400, 0, 2).await;
    std::fs::write(
        step_dir(root, "policy", 400).join("parts/rank-1.json"),
        b"{\"rank\": 1, \"world\": 2, \"step\": 400, \"url\"",
    )
    .unwrap();
    publish_complete(root, "critic", 7, 1).await;
    dir
}

/// The bytes a committed step's publishers serve, as its manifest lists them.
fn manifest_bytes(registry: &Path, name: &str, step: u64) -> u64 {
    let manifest: Value = serde_json::from_slice(
        &std::fs::read(step_dir(registry, name, step).join("manifest.json")).unwrap(),
    )
    .unwrap();
    manifest["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["size"].as_u64().unwrap())
        .sum()
}

fn config(root: &Path, registry: Option<&Path>) -> ServerConfig {
    let mut config = ServerConfig::new(root.to_str().unwrap());
    config.registry = registry.map(Path::to_path_buf);
    config
}

fn step(publication: &Value, n: u64) -> &Value {
    publication["steps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["step"] == n)
        .unwrap_or_else(|| panic!("no step {n} in {publication:#}"))
}

#[tokio::test]
async fn the_server_lists_live_publications_and_their_steps() {
    let registry = registry().await;
    let root = tempfile::tempdir().unwrap();
    let server = RunningServer::start(config(root.path(), Some(registry.path()))).await;

    let (status, body) = server.get("/v1/live").await;
    assert_eq!(status, 200, "{body:#}");
    assert_eq!(body["registry"], registry.path().display().to_string());
    let names: Vec<&str> = body["publications"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["critic", "policy"]);
    let policy = &body["publications"][1];
    assert_eq!(policy["newest_complete"], 200);
    assert_eq!(policy["newest"], 400);
    assert_eq!(policy["steps_total"], 4);
    assert_eq!(policy["world"], 2);
    assert_eq!(
        policy["bytes"],
        manifest_bytes(registry.path(), "policy", 200)
    );
    assert_eq!(policy["tensors"], 2);
    let ranks: Vec<u64> = policy["publishers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["rank"].as_u64().unwrap())
        .collect();
    assert_eq!(ranks, vec![0, 1]);
    assert_eq!(policy["publishers"][1]["url"], "http://127.0.0.1:40001");

    // One publication, bounded to its newest steps.
    let (status, policy) = server.get("/v1/live/policy?steps=2").await;
    assert_eq!(status, 200, "{policy:#}");
    let listed: Vec<u64> = policy["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["step"].as_u64().unwrap())
        .collect();
    assert_eq!(listed, vec![400, 300]);
    assert_eq!(policy["steps_truncated"], true);
    assert_eq!(policy["newest_complete"], 200);

    let (status, policy) = server.get("/v1/live/policy").await;
    assert_eq!(status, 200);
    assert_eq!(policy["steps_truncated"], false);
    let complete = step(&policy, 200);
    assert_eq!(complete["state"], "complete");
    assert_eq!(
        complete["bytes"],
        manifest_bytes(registry.path(), "policy", 200)
    );
    assert!(complete["committed"].as_str().unwrap().ends_with('Z'));
    let waiting = step(&policy, 300);
    assert_eq!(waiting["state"], "incomplete");
    assert_eq!(waiting["missing_ranks"], serde_json::json!([1]));
    assert_eq!(waiting["ranks"], serde_json::json!([0]));
    assert!(
        waiting["detail"]
            .as_str()
            .unwrap()
            .contains("publisher ranks [1] of 2 have not published it"),
        "{waiting:#}"
    );
    let malformed = step(&policy, 400);
    assert_eq!(malformed["state"], "incomplete");
    assert_eq!(malformed["missing_ranks"], serde_json::json!([1]));
    let problem = malformed["problems"][0].as_str().unwrap();
    let bad = step_dir(registry.path(), "policy", 400).join("parts/rank-1.json");
    assert!(
        problem.starts_with(&format!("{}: not a part", bad.display())),
        "{problem}"
    );
    let retired = step(&policy, 100);
    assert_eq!(retired["state"], "retired");

    // Errors: the route's shapes, naming what is wrong.
    let (status, body) = server.get("/v1/live/reward").await;
    assert_eq!(status, 404, "{body:#}");
    assert_eq!(body["error"], "unknown_publication");
    assert_eq!(
        body["detail"],
        format!(
            "no live publication reward in registry {}",
            registry.path().display()
        )
    );
    let (status, body) = server.get("/v1/live/..%2Fetc").await;
    assert_eq!(status, 400, "{body:#}");
    assert_eq!(body["error"], "bad_id");
    assert!(
        body["detail"].as_str().unwrap().contains("\"../etc\""),
        "{body:#}"
    );
    let (status, body) = server.get("/v1/live/policy?steps=5000").await;
    assert_eq!(status, 400, "{body:#}");
    assert!(body["detail"].as_str().unwrap().contains("steps 5000"));
    let (status, body) = server.get("/v1/live?steps=many").await;
    assert_eq!(status, 400, "{body:#}");
    assert_eq!(body["error"], "bad_request");

    // The catalog lists them next to the checkpoints, in brief.
    let (status, catalog) = server.get("/v1/checkpoints").await;
    assert_eq!(status, 200, "{catalog:#}");
    assert_eq!(catalog["checkpoints"], serde_json::json!([]));
    let live = &catalog["live"];
    assert_eq!(live["publications"][1]["name"], "policy");
    assert_eq!(live["publications"][1]["newest_complete"], 200);
    assert_eq!(live["publications"][1]["world"], 2);
    assert_eq!(live["publications"][1]["steps"], serde_json::json!([]));
    assert_eq!(live["publications"][0]["newest_complete"], 7);

    // A step committed now shows at once (nothing cached).
    publish(registry.path(), "policy", 300, 1, 2).await;
    await_and_commit(
        &step_dir(registry.path(), "policy", 300),
        2,
        300,
        Duration::from_secs(30),
    )
    .await
    .unwrap();
    let (_, policy) = server.get("/v1/live/policy").await;
    assert_eq!(policy["newest_complete"], 300);
    assert_eq!(step(&policy, 300)["state"], "complete");
    server.stop().await;
}

#[tokio::test]
async fn without_a_registry_or_with_it_gone_the_live_routes_say_so() {
    let root = tempfile::tempdir().unwrap();
    let server = RunningServer::start(config(root.path(), None)).await;
    for path in ["/v1/live", "/v1/live/policy"] {
        let (status, body) = server.get(path).await;
        assert_eq!(status, 404, "{path}: {body:#}");
        assert_eq!(body["error"], "no_registry");
        assert!(
            body["detail"].as_str().unwrap().contains("--registry"),
            "{body:#}"
        );
    }
    let (status, catalog) = server.get("/v1/checkpoints").await;
    assert_eq!(status, 200);
    assert_eq!(catalog["live"], Value::Null);

    // The routes are in the OpenAPI document with their parameters and answers.
    let (status, api) = server.get("/openapi.json").await;
    assert_eq!(status, 200);
    let list = &api["paths"]["/v1/live"]["get"];
    assert_eq!(list["parameters"][0]["name"], "steps");
    let one = &api["paths"]["/v1/live/{name}"]["get"];
    assert!(one["responses"]["404"].is_object(), "{one:#}");
    assert!(api["components"]["schemas"]["LiveStep"].is_object());
    server.stop().await;

    // A registry that goes away while served: the live routes answer 503, and the catalog
    // still lists the checkpoints, its live section saying what failed.
    let registry = root.path().join("registry");
    std::fs::create_dir(&registry).unwrap();
    let server = RunningServer::start(config(root.path(), Some(&registry))).await;
    let (status, live) = server.get("/v1/live").await;
    assert_eq!(status, 200, "{live:#}");
    assert_eq!(live["publications"], serde_json::json!([]));
    std::fs::remove_dir(&registry).unwrap();
    let (status, body) = server.get("/v1/live").await;
    assert_eq!(status, 503, "{body:#}");
    assert_eq!(body["error"], "storage_unavailable");
    assert!(
        body["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("listing the registry {}", registry.display())),
        "{body:#}"
    );
    let (status, catalog) = server.get("/v1/checkpoints").await;
    assert_eq!(status, 200, "{catalog:#}");
    assert!(
        catalog["live"]["problems"][0]
            .as_str()
            .unwrap()
            .contains("listing the registry"),
        "{catalog:#}"
    );
    server.stop().await;

    // A registry that is not there is refused at start, naming it.
    let gone = root.path().join("no-registry");
    let err = tessera_server::AppState::new(config(root.path(), Some(&gone))).unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("the registry {}", gone.display())),
        "{err}"
    );
}

fn tessera(args: &[&str]) -> std::process::Output {
    Command::new(BIN).args(args).output().unwrap()
}

#[tokio::test]
async fn the_cli_lists_and_shows_publications_in_text_and_json() {
    let registry = registry().await;
    let dir = registry.path().to_str().unwrap();

    let out = tessera(&["live", "list", "--registry", dir]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.starts_with(&format!("registry {dir}: 2 live publications\n")),
        "{text}"
    );
    let policy_line = text
        .lines()
        .find(|l| l.starts_with("policy"))
        .unwrap_or_else(|| panic!("{text}"));
    let cells: Vec<&str> = policy_line.split_whitespace().collect();
    // name, newest complete, steps, ranks, bytes (value and unit), tensors.
    assert_eq!(&cells[..4], &["policy", "200", "4", "2"], "{policy_line}");
    assert_eq!(cells.last(), Some(&"2"), "{policy_line}");

    let out = tessera(&["live", "list", "--registry", dir, "--json"]);
    assert!(out.status.success(), "{out:?}");
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    let policy = &json["publications"][1];
    assert_eq!(policy["name"], "policy");
    assert_eq!(policy["newest_complete"], 200);
    assert_eq!(
        policy["bytes"],
        manifest_bytes(registry.path(), "policy", 200)
    );
    assert_eq!(step(policy, 300)["missing_ranks"], serde_json::json!([1]));

    let out = tessera(&["live", "show", "policy", "--registry", dir]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(
        text.contains("newest complete step 200 (live://policy): 2 publisher ranks"),
        "{text}"
    );
    assert!(
        text.contains("http://127.0.0.1:40001/policy/step-000200/data/publisher-rank-1.bin"),
        "{text}"
    );
    let bad = step_dir(registry.path(), "policy", 400).join("parts/rank-1.json");
    assert!(
        text.contains(&format!("problem: {}: not a part", bad.display())),
        "{text}"
    );
    assert!(text.contains("missing ranks: 1"), "{text}");
    let states: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("  step "))
        .map(|l| l.split_whitespace().nth(2).unwrap())
        .collect();
    assert_eq!(
        states,
        vec!["incomplete", "incomplete", "complete", "retired"],
        "{text}"
    );

    let out = tessera(&[
        "live",
        "show",
        "policy",
        "--registry",
        dir,
        "--steps",
        "1",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["steps"].as_array().unwrap().len(), 1);
    assert_eq!(json["steps"][0]["step"], 400);
    assert_eq!(json["steps_truncated"], true);
    assert_eq!(json["newest_complete"], 200);

    // An unknown name: exit code 3 (not found) and the error naming it, in text and JSON.
    let out = tessera(&["live", "show", "reward", "--registry", dir]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains(&format!("no live publication reward in registry {dir}")),
        "{stderr}"
    );
    let out = tessera(&["live", "show", "reward", "--registry", dir, "--json"]);
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["error"]["kind"], "not_found");
    assert!(
        json["error"]["message"]
            .as_str()
            .unwrap()
            .contains("no live publication reward"),
        "{json:#}"
    );
    let gone = registry.path().join("nowhere");
    let out = tessera(&["live", "list", "--registry", gone.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8(out.stderr).unwrap();
    assert!(
        stderr.contains(&format!("registry {}: no such directory", gone.display())),
        "{stderr}"
    );
}

/// `tessera load live://NAME[@STEP] --registry DIR`: the newest complete step (or the one
/// named) resolved in the registry and loaded from its publishers' servers in another layout;
/// the bytes are the publishers' own. A step never published, an incomplete one and a missing
/// `--registry` are refused, naming what is wrong.
#[test]
fn the_cli_loads_a_live_publication_by_name_and_step() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = tempfile::tempdir().unwrap();
    let root = registry.path();
    let server = tessera_storage::RangeServer::start("127.0.0.1").unwrap();
    // Steps 1 and 2 of a 2-rank publication, each rank's rows served from memory as
    // `tessera.publish` serves them; step 3 waits for rank 1.
    runtime.block_on(async {
        served_steps(root, &server, "served", &[1, 2]).await;
        served(root, &server, ("served", 3, 0), PartMemory::Heap).await;
    });
    let work = tempfile::tempdir().unwrap();
    let requests = rows_requests(work.path());
    let load = |url: &str, dump: &Path| {
        Command::new(BIN)
            .args(["load", url, "--registry", root.to_str().unwrap()])
            .args(["--requests", requests.to_str().unwrap(), "--quiet"])
            .args(["--dump", dump.to_str().unwrap()])
            .output()
            .unwrap()
    };
    for (url, step) in [("live://served", 2u64), ("live://served@1", 1)] {
        let dump = work.path().join(format!("dump-{step}"));
        let out = load(url, &dump);
        assert!(
            out.status.success(),
            "{url}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(dumped_rows(&dump), rows_at(step), "{url}");
    }
    let refused = |args: &[&str], want: &str| {
        let out = Command::new(BIN).args(args).output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
    };
    let registry_flag = ["--registry", root.to_str().unwrap()];
    let requests_flag = ["--requests", requests.to_str().unwrap()];
    refused(
        &[
            &["load", "live://served@9"][..],
            &registry_flag,
            &requests_flag,
        ]
        .concat(),
        "step 9 of live publication served was never published",
    );
    refused(
        &[
            &["load", "live://served@3"][..],
            &registry_flag,
            &requests_flag,
        ]
        .concat(),
        "step 3 of live publication served is not complete: publisher ranks [1] of 2 have not published it",
    );
    refused(
        &[
            &["load", "live://served@x"][..],
            &registry_flag,
            &requests_flag,
        ]
        .concat(),
        "live://served@x: the step after '@' must be a number (live://NAME@STEP)",
    );
    refused(
        &[&["load", "live://served"][..], &requests_flag].concat(),
        "live://served: a live publication is found in a registry: give --registry DIR",
    );
}

/// `tessera load live://` holds a lease on the step it reads for the whole load (the publisher
/// keeps a leased step past `keep`), removed when the load ends; a registry that cannot hold one
/// is said on stderr and the load goes on.
#[test]
fn the_cli_holds_a_lease_on_the_step_it_loads() {
    use tessera_ops::publish::lease::{LEASES_DIR, lease_files, step_leased, unix_seconds};
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = tempfile::tempdir().unwrap();
    let root = registry.path();
    let server = tessera_storage::RangeServer::start("127.0.0.1").unwrap();
    runtime.block_on(served_steps(root, &server, "leased", &[1, 2]));
    let work = tempfile::tempdir().unwrap();
    let requests = rows_requests(work.path());
    let load = |url: &str| {
        Command::new(BIN)
            .args(["load", url, "--registry", root.to_str().unwrap()])
            .args(["--requests", requests.to_str().unwrap()])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
    };
    // Rank 1's file of step 1 is held at the server: the load waits there, mid-read.
    let step1 = step_dir(root, "leased", 1);
    let held = "leased/step-000001/data/publisher-rank-1.bin";
    server.hold(held);
    let child = load("live://leased@1");
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while server.held_requests() == 0 {
        assert!(std::time::Instant::now() < deadline, "the load never read");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        step_leased(&step1, unix_seconds()),
        "no running lease while the load reads"
    );
    assert_eq!(lease_files(&step1), 1);
    assert_eq!(lease_files(&step_dir(root, "leased", 2)), 0);
    server.release(held);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let leases = step1.join(LEASES_DIR);
    assert!(
        stderr.contains(&format!(", leased by {}", leases.display())),
        "{stderr}"
    );
    assert!(
        leases.is_dir(),
        "the lease was taken in {}",
        leases.display()
    );
    assert_eq!(lease_files(&step1), 0, "the lease outlived the load");

    // A step whose leases folder cannot be made: said, and loaded anyway.
    let step2 = step_dir(root, "leased", 2);
    std::fs::write(step2.join(LEASES_DIR), b"not a folder").unwrap();
    let out = load("live://leased@2").wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains(&format!("warning: no lease on {}", step2.display()))
            && stderr.contains("the publisher may retire the step while this load reads it"),
        "{stderr}"
    );
}

/// A live load on the publishers' host reads their data files straight out of their shared
/// memory, and the text report says how much of the data read came from there (it was only in
/// `--json` and `--report-json`); the bytes are the publishers' own.
#[test]
fn the_cli_report_says_what_was_read_from_the_publishers_shared_memory() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let registry = tempfile::tempdir().unwrap();
    let root = registry.path();
    let server = tessera_storage::RangeServer::start("127.0.0.1").unwrap();
    // This process is both publishers; the CLI's process opens their memory through /proc.
    let laid_out: Vec<PartBytes> = runtime.block_on(async {
        let mut laid_out = Vec::new();
        for rank in 0..2 {
            let memory = PartMemory::Shared {
                tag: "tessera-test-live-cli".to_string(),
            };
            laid_out.push(served(root, &server, ("shared", 5, rank), memory).await);
        }
        await_and_commit(&step_dir(root, "shared", 5), 2, 5, Duration::from_secs(30))
            .await
            .unwrap();
        laid_out
    });
    assert!(
        laid_out.iter().all(|b| b.shared().is_some()),
        "this kernel offers no shared memory (memfd) for the publishers' data files"
    );
    let work = tempfile::tempdir().unwrap();
    let requests = rows_requests(work.path());
    let dump = work.path().join("dump");
    let out = Command::new(BIN)
        .args([
            "load",
            "live://shared",
            "--registry",
            root.to_str().unwrap(),
        ])
        .args(["--requests", requests.to_str().unwrap()])
        .args(["--dump", dump.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // 8 rows of 4 f32 columns, half from each publisher, all from their shared memory.
    assert!(
        stdout.contains(
            "\npublisher memory     128 B of the data read, from the publishers' shared memory on \
             this host (0 B over HTTP)\n"
        ),
        "{stdout}"
    );
    assert_eq!(dumped_rows(&dump), rows_at(5));
    drop(laid_out);
}

/// Publishes `steps` of `name` by both publisher ranks ([`served`], on the heap) and commits
/// each, as rank 0 does.
async fn served_steps(
    registry: &Path,
    server: &tessera_storage::RangeServer,
    name: &str,
    steps: &[u64],
) {
    for &step in steps {
        for rank in 0..2 {
            served(registry, server, (name, step, rank), PartMemory::Heap).await;
        }
        await_and_commit(
            &step_dir(registry, name, step),
            2,
            step,
            Duration::from_secs(30),
        )
        .await
        .unwrap();
    }
}

/// A `--requests` file in `dir`: one consumer rank wanting columns 0..4 of every row of the
/// publications' `layers.0.w` ([`rows_at`]).
fn rows_requests(dir: &Path) -> PathBuf {
    let requests = dir.join("requests.json");
    std::fs::write(
        &requests,
        r#"{"ranks": [[{"fqn": "layers.0.w", "offsets": [0, 0], "lengths": [8, 4]}]]}"#,
    )
    .unwrap();
    requests
}

/// What [`rows_requests`] asks for at `step`: global row r is row r % 4 of publisher rank r / 4,
/// whose element (i, c) is i*8 + c plus the step.
fn rows_at(step: u64) -> Vec<u8> {
    (0..8u64)
        .flat_map(|r| (0..4u64).map(move |c| ((r % 4) * 8 + c) as f32 + step as f32))
        .flat_map(f32::to_le_bytes)
        .collect()
}

/// The bytes of `layers.0.w` [8, 4] in rank 0's `--dump` under `dump`.
fn dumped_rows(dump: &Path) -> Vec<u8> {
    let file = std::fs::read(dump.join("rank-0.safetensors")).unwrap();
    let header = tessera_metadata::formats::safetensors::parse(&file, "rank-0").unwrap();
    let entry = &header.tensors[0];
    assert_eq!(entry.name, "layers.0.w");
    assert_eq!(entry.shape, vec![8, 4]);
    let (a, b) = entry.data_offsets;
    file[(header.data_start + a) as usize..(header.data_start + b) as usize].to_vec()
}

/// Publisher rank `rank` of 2 publishes `step` of `name` as `tessera.publish` does: its part in
/// the registry and its data file served from memory by `server`, laid out in `memory` (shared
/// memory: consumers on this host read it there, through the handle its part names). The data
/// file as laid out is returned: shared memory lives while it does.
async fn served(
    registry: &Path,
    server: &tessera_storage::RangeServer,
    (name, step, rank): (&str, u64, u32),
    memory: PartMemory,
) -> PartBytes {
    let rows = 4u64;
    let boxes = vec![HeldBox {
        fqn: "layers.0.w".to_string(),
        dtype: "f32".to_string(),
        shape: vec![2 * rows, 8],
        offsets: vec![u64::from(rank) * rows, 0],
        lengths: vec![rows, 8],
    }];
    let data: Vec<u8> = (0..rows * 8)
        .flat_map(|i| (i as f32 + step as f32).to_le_bytes())
        .collect();
    let (bytes, file) = write_part_file(rank, &boxes, &[&data], &[], memory)
        .await
        .unwrap();
    let path = format!("{name}/step-{step:06}/{}", file.path());
    server.serve(&path, bytes.bytes());
    let shared = bytes.shared().map(|f| f.handle().clone());
    let part = Part {
        rank,
        world: 2,
        step,
        url: server.url(),
        path,
        holdings: Holdings {
            boxes,
            objects: Vec::new(),
        },
        file,
        shared,
    };
    write_part(&step_dir(registry, name, step), &part).unwrap();
    bytes
}
