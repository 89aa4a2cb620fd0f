//! The preview routes of a plan (`/v1/plans/{plan}/ranks`, `/v1/plans/{plan}/ranks/{rank}/overview`),
//! the checkpoint summary's composition and objects, and the web UI's icon, through `oneshot`
//! on a catalog written with the real native writer.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeMap;

use axum::http::{StatusCode, header};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use tessera_metadata::formats::native::open_checkpoint;
use tessera_planner::presets::{MegatronGpt, fsdp, megatron_gpt};
use tessera_planner::{Layout, PlanOptions, RankPlan, plan};
use tessera_server::{AppState, ServerConfig, app};
use tessera_synth::Model;

use support::*;

struct Fixture {
    _dir: tempfile::TempDir,
    root: std::path::PathBuf,
    app: axum::Router,
}

async fn fixture() -> Fixture {
    let dir = tempfile::TempDir::new().unwrap();
    let root = dir.path().join("catalog");
    std::fs::create_dir_all(&root).unwrap();
    write_catalog(&root).await;
    let state = AppState::new(ServerConfig::new(root.to_str().unwrap())).unwrap();
    Fixture {
        app: app(state),
        root,
        _dir: dir,
    }
}

fn tp2_pp2_dp2() -> Layout {
    megatron_gpt(MegatronGpt {
        tp: 2,
        pp: 2,
        dp: 2,
        num_layers: Model::GptTiny.config().num_layers,
        zero1: false,
    })
    .unwrap()
}

async fn create(f: &Fixture, checkpoint: &str, layout: &Layout) -> String {
    let answer = post_json(&f.app, "/v1/plans", plan_body(checkpoint, layout)).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    answer.json()["plan"].as_str().unwrap().to_string()
}

/// Every rank's totals from `/ranks` equal what its own full rank plan says, for layouts with
/// DP replicas (exchange rings), TP splits and pipeline stages, and for FSDP.
#[tokio::test]
async fn rank_totals_equal_every_rank_plan() {
    let f = fixture().await;
    let store = LocalFileSystem::new_with_prefix(&f.root).unwrap();
    let meta = std::sync::Arc::new(
        open_checkpoint(&store, &Path::from("gpt/step-000100"))
            .await
            .unwrap()
            .meta,
    );
    for layout in [tp2_pp2_dp2(), target_layout(), fsdp(3).unwrap()] {
        let id = create(&f, "gpt/step-000100", &layout).await;
        let answer = get(&f.app, &format!("/v1/plans/{id}/ranks")).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        let json = answer.json();
        let world: u32 = layout.mesh.iter().map(|d| d.size).product();
        assert_eq!(json["plan"], id.as_str());
        assert_eq!(json["world"], world);
        let mesh: Vec<(String, u64)> = json["mesh"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| {
                (
                    d["name"].as_str().unwrap().to_string(),
                    d["size"].as_u64().unwrap(),
                )
            })
            .collect();
        let want_mesh: Vec<(String, u64)> = layout
            .mesh
            .iter()
            .map(|d| (d.name.clone(), u64::from(d.size)))
            .collect();
        assert_eq!(mesh, want_mesh);
        let column = |name: &str| -> Vec<u64> {
            json["ranks"][name]
                .as_array()
                .unwrap_or_else(|| panic!("no column {name}"))
                .iter()
                .map(|v| v.as_u64().unwrap())
                .collect()
        };
        let requests = layout.resolve(meta.tensors()).unwrap();
        let local = plan(&meta, &requests, &PlanOptions::default()).unwrap();
        let mut any_rounds = false;
        for rank in 0..world {
            let rp: RankPlan = local.rank_plan(rank).unwrap();
            let r = rank as usize;
            let what = format!("rank {rank} of {layout:?}");
            assert_eq!(column("bytes_needed")[r], rp.summary.bytes_needed, "{what}");
            assert_eq!(column("bytes_read")[r], rp.summary.bytes_read, "{what}");
            assert_eq!(column("bytes_sent")[r], rp.summary.bytes_sent, "{what}");
            assert_eq!(
                column("bytes_received")[r],
                rp.summary.bytes_received,
                "{what}"
            );
            assert_eq!(column("pieces")[r], rp.pieces.len() as u64, "{what}");
            let read = rp.pieces.iter().filter(|p| p.read.is_some()).count() as u64;
            assert_eq!(column("pieces_read")[r], read, "{what}");
            assert_eq!(column("groups")[r], rp.exchanges.len() as u64, "{what}");
            let rounds: u64 = rp.exchanges.iter().map(|e| e.rounds.len() as u64).sum();
            assert_eq!(column("rounds")[r], rounds, "{what}");
            any_rounds |= rounds > 0;
        }
        assert_eq!(
            column("bytes_read").iter().sum::<u64>(),
            local.summary().bytes_read
        );
        if layout.mesh.iter().any(|d| d.name == "dp") && world > 1 {
            assert!(any_rounds, "DP replicas exchange in {layout:?}");
        }
    }
}

#[tokio::test]
async fn explicit_request_plans_have_totals_without_a_mesh() {
    let f = fixture().await;
    let body = r#"{"checkpoint": "gpt/step-000200", "requests": {"ranks": [[{"fqn": "model.final_norm.weight", "offsets": [0], "lengths": [8]}], [{"fqn": "model.final_norm.weight", "offsets": [0], "lengths": [8]}]]}}"#;
    let answer = post_json(&f.app, "/v1/plans", body).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    let id = answer.json()["plan"].as_str().unwrap().to_string();
    let json = get(&f.app, &format!("/v1/plans/{id}/ranks")).await.json();
    assert!(json["mesh"].is_null(), "{json}");
    assert_eq!(json["world"], 2);
    // Both need the same 8 elements: one reads them, the other receives them.
    let read: Vec<u64> = serde_json::from_value(json["ranks"]["bytes_read"].clone()).unwrap();
    let received: Vec<u64> =
        serde_json::from_value(json["ranks"]["bytes_received"].clone()).unwrap();
    assert_eq!(read.iter().sum::<u64>(), received.iter().sum::<u64>());
    assert!(read.iter().sum::<u64>() > 0);
}

/// A rank's overview: its reads summed by file equal its rank plan's reads, and its rings name
/// the partner of every round.
#[tokio::test]
async fn rank_overview_sums_reads_by_file_and_names_ring_partners() {
    let f = fixture().await;
    let id = create(&f, "gpt/step-000100", &tp2_pp2_dp2()).await;
    for rank in 0..8u32 {
        let full = get(&f.app, &format!("/v1/plans/{id}/ranks/{rank}")).await;
        let rp = RankPlan::from_json(&full.text()).unwrap();
        let answer = get(&f.app, &format!("/v1/plans/{id}/ranks/{rank}/overview")).await;
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        assert_eq!(answer.headers[header::CONTENT_TYPE], "application/json");
        let o = answer.json();
        assert_eq!(o["rank"], rank);
        assert_eq!(o["world"], 8);
        assert_eq!(o["bytes_read"], rp.summary.bytes_read);
        assert_eq!(o["bytes_sent"], rp.summary.bytes_sent);
        assert_eq!(o["pieces"], rp.pieces.len() as u64);
        let mut want: BTreeMap<String, (u64, u64)> = BTreeMap::new();
        for p in &rp.pieces {
            if let Some(read) = &p.read {
                let e = want
                    .entry(rp.files[read.file as usize].clone())
                    .or_default();
                e.0 += 1;
                e.1 += read.runs.total_bytes();
            }
        }
        let got: BTreeMap<String, (u64, u64)> = o["reads"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["file"].as_str().unwrap().to_string(),
                    (r["pieces"].as_u64().unwrap(), r["bytes"].as_u64().unwrap()),
                )
            })
            .collect();
        assert_eq!(got, want, "rank {rank}");
        // tp2 pp2 dp2: each rank shares its TP shard with its one DP replica (rank ± 2), and
        // the replicated tensors with its whole stage; round k sends k places on in the ring.
        let exchanges = o["exchanges"].as_array().unwrap();
        let partner = if (rank / 2) % 2 == 0 {
            rank + 2
        } else {
            rank - 2
        };
        let pair = serde_json::json!([rank.min(partner), rank.max(partner)]);
        assert!(
            exchanges.iter().any(|e| e["members"] == pair),
            "rank {rank}: {exchanges:?}"
        );
        for e in exchanges {
            let members: Vec<u64> = serde_json::from_value(e["members"].clone()).unwrap();
            let m = members.len() as u64;
            let position = e["position"].as_u64().unwrap();
            assert_eq!(members[position as usize], u64::from(rank));
            for round in e["rounds"].as_array().unwrap() {
                let k = round["round"].as_u64().unwrap();
                assert_eq!(round["send_to"], members[((position + k) % m) as usize]);
                assert_eq!(
                    round["recv_from"],
                    members[((position + m - k) % m) as usize]
                );
            }
        }
    }
    get(&f.app, &format!("/v1/plans/{id}/ranks/8/overview"))
        .await
        .assert_error(StatusCode::NOT_FOUND, "unknown_rank", "8");
    get(&f.app, &format!("/v1/plans/{id}/ranks/x/overview"))
        .await
        .assert_error(StatusCode::BAD_REQUEST, "bad_id", "\"x\" is not a number");
    get(&f.app, "/v1/plans/0123456789abcdef0123456789abcdef/ranks")
        .await
        .assert_error(StatusCode::NOT_FOUND, "unknown_plan", "0123456789abcdef");
}

/// The summary splits tensors into model and optimizer state and lists the non-tensor objects.
#[tokio::test]
async fn summaries_split_model_and_optimizer_and_list_objects() {
    let f = fixture().await;
    let store = LocalFileSystem::new_with_prefix(&f.root).unwrap();
    for (id, optimizer) in [("gpt/step-000100", true), ("gpt/step-000200", false)] {
        let meta = open_checkpoint(&store, &Path::from(id)).await.unwrap().meta;
        let json = get(&f.app, &format!("/v1/checkpoints/{id}")).await.json();
        let c = &json["composition"];
        let (mut model, mut optim) = ((0u64, 0u64, 0u64), (0u64, 0u64, 0u64));
        for t in meta.tensors() {
            let part = if t.fqn.starts_with("optim.") {
                &mut optim
            } else {
                &mut model
            };
            part.0 += 1;
            part.1 += t.shape.iter().product::<u64>();
            part.2 += t.nbytes();
        }
        assert_eq!(c["model"]["tensors"], model.0, "{id}");
        assert_eq!(c["model"]["elements"], model.1, "{id}");
        assert_eq!(c["model"]["bytes"], model.2, "{id}");
        assert_eq!(c["optimizer"]["tensors"], optim.0, "{id}");
        assert_eq!(c["optimizer"]["bytes"], optim.2, "{id}");
        assert_eq!(optim.0 > 0, optimizer, "{id}");
        assert_eq!(model.2 + optim.2, meta.tensor_bytes());
        let objects = json["object_list"].as_array().unwrap();
        assert_eq!(objects.len() as u64, json["objects"].as_u64().unwrap());
        let mut want: Vec<(String, u64)> = meta
            .objects()
            .iter()
            .map(|o| (o.key.clone(), o.length))
            .collect();
        want.sort();
        let got: Vec<(String, u64)> = objects
            .iter()
            .map(|o| {
                (
                    o["key"].as_str().unwrap().to_string(),
                    o["bytes"].as_u64().unwrap(),
                )
            })
            .collect();
        assert_eq!(got, want);
    }
    // An incomplete checkpoint has neither.
    let json = get(&f.app, "/v1/checkpoints/gpt/step-000300").await.json();
    assert!(
        json["composition"].is_null() && json["object_list"].is_null(),
        "{json}"
    );
}

#[tokio::test]
async fn the_built_in_ui_has_an_icon() {
    let f = fixture().await;
    let index = get(&f.app, "/").await;
    assert!(
        index
            .text()
            .contains(r#"<link rel="icon" href="/favicon.svg""#)
    );
    for uri in ["/favicon.svg", "/favicon.ico"] {
        let icon = get(&f.app, uri).await;
        assert_eq!(icon.status, StatusCode::OK, "{uri}");
        assert_eq!(icon.headers[header::CONTENT_TYPE], "image/svg+xml");
        assert!(icon.text().starts_with("<svg"), "{uri}");
    }
}

/// A DCP checkpoint records no commit time: its summary gives the catalog row's (the newest
/// file's), so the two agree; and it lists DCP's non-tensor objects.
#[tokio::test]
async fn foreign_summaries_have_the_catalog_rows_time_and_objects() {
    let fixtures = std::env::var_os("TESSERA_DCP_FIXTURES").map_or_else(
        || std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/dcp"),
        std::path::PathBuf::from,
    );
    let source = fixtures.join("e_w2_fsdp2_adamw");
    assert!(source.is_dir(), "no DCP fixture at {}", source.display());
    let dir = tempfile::TempDir::new().unwrap();
    let target = dir.path().join("dcp/step-000050");
    std::fs::create_dir_all(&target).unwrap();
    for entry in std::fs::read_dir(&source).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), target.join(entry.file_name())).unwrap();
    }
    let state = AppState::new(ServerConfig::new(dir.path().to_str().unwrap())).unwrap();
    let app = app(state);
    let listing = get(&app, "/v1/checkpoints").await.json();
    let row = &listing["checkpoints"][0];
    assert_eq!(row["id"], "dcp/step-000050");
    assert!(row["created"].is_string(), "{row}");
    let summary = get(&app, "/v1/checkpoints/dcp/step-000050").await.json();
    assert_eq!(summary["format"], "dcp");
    assert_eq!(summary["created"], row["created"]);
    let objects = summary["object_list"].as_array().unwrap();
    assert_eq!(objects.len() as u64, summary["objects"].as_u64().unwrap());
    assert!(
        objects
            .iter()
            .any(|o| o["key"] == "optim.param_groups.0.lr" && o["bytes"].as_u64().unwrap() > 0),
        "{objects:?}"
    );
    assert!(
        summary["composition"]["optimizer"]["tensors"]
            .as_u64()
            .unwrap()
            > 0
    );
}
