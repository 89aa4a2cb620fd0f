//! Checkpoint identity and the server's view of storage, over real sockets on 127.0.0.1: a
//! checkpoint deleted and saved again at the same place is followed by the catalog and the plans
//! (no stale metadata, no plan of the old save), a plan made for another checkpoint is refused by
//! the loader and by `tessera load --server`, failed opens are not re-read per request, and bad
//! checkpoints, bad `latest` pointers, symlink loops and bad explicit requests get clear answers.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path as FsPath;

use serde_json::{Value, json};
use tessera_loader::LoaderError;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, load_rank};
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_planner::{Layout, RankPlan};
use tessera_server::ServerConfig;
use tessera_storage as storage;

mod server_support;

use server_support::{RunningServer, load_and_check, megatron};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");
const ID: &str = "gpt/step-000100";

/// The layout checkpoint A is saved with.
fn layout_a() -> Layout {
    megatron(2, 2, 2, true)
}

/// The layout checkpoint B (same model, other files and offsets) is saved with.
fn layout_b() -> Layout {
    megatron(1, 1, 2, false)
}

/// Writes gpt-tiny with optimizer states saved with `layout` at directory `dir`.
async fn write_tiny(dir: &FsPath, layout: &Layout) {
    server_support::write_tiny(dir.to_str().unwrap(), layout, &Default::default()).await;
}

fn plan_body(layout: &Layout) -> Value {
    json!({"checkpoint": ID, "layout": layout})
}

async fn rank_plans(server: &RunningServer, plan: &str, world: u64) -> Vec<RankPlan> {
    let mut plans = Vec::new();
    for rank in 0..world {
        let (status, json) = server.get(&format!("/v1/plans/{plan}/ranks/{rank}")).await;
        assert_eq!(status, 200, "{json}");
        plans.push(serde_json::from_value(json).unwrap());
    }
    plans
}

fn listed<'a>(catalog: &'a Value, id: &str) -> Option<&'a Value> {
    catalog["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_saved_again_at_the_same_place_is_followed_by_catalog_and_plans() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    let ckpt = root.join(ID);
    write_tiny(&ckpt, &layout_a()).await;
    // The default metadata TTL (minutes): only revalidation can notice the new save.
    let server = RunningServer::start(ServerConfig::new(root.to_str().unwrap())).await;
    let target = megatron(2, 1, 1, false);

    let (status, summary_a) = server.get(&format!("/v1/checkpoints/{ID}")).await;
    assert_eq!(status, 200, "{summary_a}");
    let identity_a = summary_a["identity"].as_str().unwrap().to_string();
    assert!(identity_a.starts_with("native:"), "{identity_a}");
    let (status, created_a) = server.post_plan(&plan_body(&target)).await;
    assert_eq!(status, 200, "{created_a}");
    assert_eq!(created_a["checkpoint_identity"], identity_a.as_str());
    let plan_a = created_a["plan"].as_str().unwrap().to_string();
    let old_rank0 = rank_plans(&server, &plan_a, 1).await.remove(0);
    assert_eq!(
        old_rank0.checkpoint_identity.as_deref(),
        Some(identity_a.as_str())
    );
    let (_, catalog) = server.get("/v1/checkpoints").await;
    assert_eq!(
        listed(&catalog, ID).unwrap()["identity"],
        identity_a.as_str()
    );

    // Delete A, save B (other layout: other files and offsets) at the same place.
    std::fs::remove_dir_all(&ckpt).unwrap();
    write_tiny(&ckpt, &layout_b()).await;
    let checkpoint_b = Checkpoint::open(storage::open(ckpt.to_str().unwrap()).unwrap())
        .await
        .unwrap();
    let identity_b = checkpoint_b.meta.identity().unwrap().to_string();
    assert_ne!(identity_a, identity_b);

    let (status, summary_b) = server.get(&format!("/v1/checkpoints/{ID}")).await;
    assert_eq!(status, 200, "{summary_b}");
    assert_eq!(summary_b["identity"], identity_b.as_str());
    assert_eq!(summary_b["files"], 2, "B's files, not A's 8: {summary_b}");
    let (_, catalog) = server.get("/v1/checkpoints").await;
    assert_eq!(
        listed(&catalog, ID).unwrap()["identity"],
        identity_b.as_str(),
        "the listing follows too"
    );
    // The old plan is not served for the new save, by id or per rank.
    for path in [
        format!("/v1/plans/{plan_a}"),
        format!("/v1/plans/{plan_a}/ranks/0"),
    ] {
        let (status, json) = server.get(&path).await;
        assert_eq!(status, 404, "{path}: {json}");
        assert_eq!(json["error"], "unknown_plan");
        assert!(
            json["detail"].as_str().unwrap().contains("saved again"),
            "{json}"
        );
    }
    // A plan of A executed against B is refused, naming both identities.
    let transport = InProcTransport::mesh(2, TransportOptions::default()).remove(0);
    let error = load_rank(
        &checkpoint_b,
        old_rank0,
        &transport,
        &LoadOptions::default(),
    )
    .await
    .unwrap_err();
    assert!(
        matches!(error, LoaderError::PlanForOtherCheckpoint { .. }),
        "{error}"
    );
    let message = error.to_string();
    for needle in [
        ckpt.to_str().unwrap(),
        identity_a.as_str(),
        identity_b.as_str(),
        "another version",
    ] {
        assert!(message.contains(needle), "{needle:?} not in {message}");
    }
    // The same request now plans B, under another plan id, and loads B's bytes.
    let (status, created_b) = server.post_plan(&plan_body(&target)).await;
    assert_eq!(status, 200, "{created_b}");
    assert_eq!(created_b["checkpoint_identity"], identity_b.as_str());
    assert_ne!(created_b["plan"], plan_a.as_str());
    let plans = rank_plans(&server, created_b["plan"].as_str().unwrap(), 2).await;
    load_and_check(&checkpoint_b, plans).await;

    // Deleted: not summarized, not planned, not listed.
    std::fs::remove_dir_all(&ckpt).unwrap();
    let (status, json) = server.get(&format!("/v1/checkpoints/{ID}")).await;
    assert_eq!(
        (status, json["error"].as_str()),
        (404, Some("unknown_checkpoint"))
    );
    let (status, _) = server.post_plan(&plan_body(&target)).await;
    assert_eq!(status, 404);
    let (_, catalog) = server.get("/v1/checkpoints").await;
    assert!(listed(&catalog, ID).is_none(), "{catalog}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_server_refuses_the_plan_of_another_checkpoint_under_the_same_id() {
    let dir = tempfile::tempdir().unwrap();
    // The server's catalog holds A under gpt/step-000100; the job loads B, naming the same id.
    let root = dir.path().join("catalog");
    write_tiny(&root.join(ID), &layout_a()).await;
    let local_b = dir.path().join("elsewhere").join(ID);
    write_tiny(&local_b, &layout_b()).await;
    let server = RunningServer::start(ServerConfig::new(root.to_str().unwrap())).await;
    let layout_file = dir.path().join("target.json");
    std::fs::write(
        &layout_file,
        serde_json::to_vec(&megatron(2, 1, 1, false)).unwrap(),
    )
    .unwrap();
    let output = tokio::process::Command::new(BIN)
        .arg("load")
        .arg(&local_b)
        .arg("--layout")
        .arg(&layout_file)
        .args(["--server", &server.url(), "--checkpoint-id", ID, "--quiet"])
        .env_remove("TESSERA_TOKEN")
        .output()
        .await
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the load succeeded: {stderr}");
    let (_, summary_a) = server.get(&format!("/v1/checkpoints/{ID}")).await;
    let identity_a = summary_a["identity"].as_str().unwrap();
    let identity_b = tessera_ops::open::open(local_b.to_str().unwrap())
        .await
        .unwrap()
        .meta
        .identity()
        .unwrap()
        .to_string();
    for needle in [
        "the server's plan is for another version of checkpoint",
        local_b.to_str().unwrap(),
        identity_a,
        identity_b.as_str(),
    ] {
        assert!(stderr.contains(needle), "{needle:?} not in {stderr}");
    }

    // The same load without a server (or against the right checkpoint) works.
    let output = tokio::process::Command::new(BIN)
        .arg("load")
        .arg(&local_b)
        .arg("--layout")
        .arg(&layout_file)
        .args(["--quiet", "--check"])
        .output()
        .await
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

/// A plan server that lies about the same checkpoint: its identity is right (it passes the
/// identity check) but a rank plan reads another data file of the checkpoint. The loader checks
/// every piece against the metadata it opened and refuses, naming the rank and the piece, before
/// reading anything (the campaign's `load --server` exited 0 with wrong bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plan_reading_another_file_of_the_same_checkpoint_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    let ckpt = root.join(ID);
    write_tiny(&ckpt, &layout_a()).await;
    let server = RunningServer::start(ServerConfig::new(root.to_str().unwrap())).await;
    let (status, created) = server
        .post_plan(&plan_body(&megatron(2, 1, 1, false)))
        .await;
    assert_eq!(status, 200, "{created}");
    let plans = rank_plans(&server, created["plan"].as_str().unwrap(), 2).await;
    let checkpoint = Checkpoint::open(storage::open(ckpt.to_str().unwrap()).unwrap())
        .await
        .unwrap();
    // Honest plans load the right bytes.
    load_and_check(&checkpoint, plans.clone()).await;

    let mut lying = plans;
    let rank0 = &mut lying[0];
    // Rank 0 reads part of every data file: two of its file names swapped.
    assert!(rank0.files.len() >= 2, "{:?}", rank0.files);
    rank0.files.swap(0, 1);
    let (other, swapped) = (rank0.files[0].clone(), rank0.files[1].clone());
    let mut transports = InProcTransport::mesh(2, TransportOptions::default());
    let error = load_rank(
        &checkpoint,
        lying.remove(0),
        &transports.remove(0),
        &LoadOptions::default(),
    )
    .await
    .unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(
            error,
            LoaderError::Plan(tessera_planner::PlanError::DisagreesWithCheckpoint { rank: 0, .. })
        ),
        "{message}"
    );
    for needle in [
        "rank 0: the plan disagrees with the checkpoint's own metadata: piece ",
        other.as_str(),
        "no saved box of the tensor holds it",
        "nothing was read",
    ] {
        assert!(
            message.contains(needle),
            "{needle:?} not in {message} (swapped {swapped})"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_checkpoint_is_409_read_once_and_fixing_it_clears_the_failure() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    let ckpt = root.join(ID);
    write_tiny(&ckpt, &layout_a()).await;
    // Corrupt metadata.arrow in place (same size): its crc32c no longer matches the manifest's.
    let metadata = ckpt.join("metadata.arrow");
    let mut bytes = std::fs::read(&metadata).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    std::fs::write(&metadata, &bytes).unwrap();
    let server = RunningServer::start(ServerConfig::new(root.to_str().unwrap())).await;

    for path in [
        format!("/v1/checkpoints/{ID}"),
        format!("/v1/checkpoints/{ID}/tensors"),
    ] {
        let (status, json) = server.get(&path).await;
        assert_eq!(status, 409, "{path}: {json}");
        assert_eq!(json["error"], "invalid_checkpoint");
        let detail = json["detail"].as_str().unwrap();
        assert!(
            detail.contains(ID) && detail.contains("metadata.arrow"),
            "{detail}"
        );
    }
    let (status, json) = server
        .post_plan(&plan_body(&megatron(2, 1, 1, false)))
        .await;
    assert_eq!(
        (status, json["error"].as_str()),
        (409, Some("invalid_checkpoint"))
    );
    assert_eq!(
        server.state.metrics().metadata_loads,
        1,
        "three requests, one read of the corrupt checkpoint"
    );

    // Saved again (fixed): the failure is forgotten at once.
    std::fs::remove_dir_all(&ckpt).unwrap();
    write_tiny(&ckpt, &layout_a()).await;
    let (status, json) = server.get(&format!("/v1/checkpoints/{ID}")).await;
    assert_eq!(status, 200, "{json}");
    assert_eq!(json["status"], "committed");
    assert_eq!(server.state.metrics().metadata_loads, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_latest_pointer_is_409_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    write_tiny(&root.join(ID), &layout_a()).await;
    let server = RunningServer::start(ServerConfig::new(root.to_str().unwrap())).await;
    std::fs::write(root.join("gpt/latest"), "../../etc").unwrap();
    let (status, json) = server.get("/v1/checkpoints/gpt/latest").await;
    assert_eq!(status, 409, "{json}");
    assert_eq!(json["error"], "invalid_checkpoint");
    assert!(
        json["detail"].as_str().unwrap().contains("latest pointer"),
        "{json}"
    );

    let other = dir.path().join("other");
    write_tiny(&other.join(ID), &layout_a()).await;
    std::fs::write(other.join("gpt/latest"), [0xff, 0xfe, 0x00]).unwrap();
    let server = RunningServer::start(ServerConfig::new(other.to_str().unwrap())).await;
    let (status, json) = server.get("/v1/checkpoints/gpt/latest/tensors").await;
    assert_eq!(status, 409, "{json}");
    assert_eq!(json["error"], "invalid_checkpoint");
    assert!(
        json["detail"].as_str().unwrap().contains("gpt/latest"),
        "{json}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlink_loops_in_the_catalog_are_skipped_and_reported() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    write_tiny(&root.join(ID), &layout_a()).await;
    // A link to its own directory and a link to itself (which make the store's listing of the
    // root fail), and a link up from inside a run (listed as a directory that holds no
    // checkpoint, so it does not show).
    std::os::unix::fs::symlink(".", root.join("loop")).unwrap();
    std::os::unix::fs::symlink(root.join("self"), root.join("self")).unwrap();
    std::os::unix::fs::symlink("..", root.join("gpt/up")).unwrap();
    let server = RunningServer::start(ServerConfig::new(root.to_str().unwrap())).await;
    let (status, catalog) = server.get("/v1/checkpoints").await;
    assert_eq!(status, 200, "{catalog}");
    assert_eq!(listed(&catalog, ID).unwrap()["status"], "committed");
    let problems: Vec<&str> = catalog["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["path"].as_str().unwrap())
        .collect();
    assert_eq!(problems, ["loop", "self"], "{catalog}");
    assert_eq!(
        catalog["checkpoints"].as_array().unwrap().len(),
        1,
        "{catalog}"
    );
    let errors = catalog["problems"].to_string();
    assert!(errors.contains("symlink loop"), "{errors}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explicit_requests_get_the_rank_cap_and_refuse_a_box_with_a_flat_range() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    write_tiny(&root.join(ID), &layout_a()).await;
    let server = RunningServer::start(ServerConfig::new(root.to_str().unwrap())).await;

    let both = json!({"checkpoint": ID, "requests": {"ranks": [
        [{"fqn": "model.lm_head.weight", "offsets": [0, 0], "lengths": [4, 64]}],
        [{"fqn": "model.lm_head.weight", "offsets": [0, 0], "lengths": [4, 64], "flat": [0, 10]}],
    ]}});
    let (status, json) = server.post_plan(&both).await;
    assert_eq!(status, 422, "{json}");
    assert_eq!(json["error"], "invalid_requests");
    let detail = json["detail"].as_str().unwrap();
    assert!(
        detail.contains("ranks[1][0]")
            && detail.contains("\"flat\"")
            && detail.contains("model.lm_head.weight"),
        "{detail}"
    );

    // One rank more than a layout may have, as empty rank lists (3 MiB: under the body limit).
    let ranks = (1u64 << 20) + 1;
    let body = format!(
        "{{\"checkpoint\": \"{ID}\", \"requests\": {{\"ranks\": [{}[]]}}}}",
        "[],".repeat(ranks as usize - 1)
    );
    let (status, json) = server.request("POST", "/v1/plans", Some(&body)).await;
    assert_eq!(status, 422, "{json}");
    assert_eq!(json["error"], "invalid_requests");
    assert!(
        json["detail"]
            .as_str()
            .unwrap()
            .contains(&format!("{ranks} ranks")),
        "{json}"
    );
    assert_eq!(server.state.metrics().plan_computations, 0);
}
