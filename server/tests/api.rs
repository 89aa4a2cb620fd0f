//! Every route and every error status of the API, through `tower::ServiceExt::oneshot` (no
//! socket), on a catalog written with the real native writer.

#![allow(clippy::unwrap_used)]

mod support;

use std::sync::Arc;

use axum::Router;
use axum::body::Body;
use axum::http::{Method, Request, StatusCode, header};
use object_store::ObjectStore;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use serde_json::{Value, json};
use tempfile::TempDir;
use tessera_metadata::formats::native::open_checkpoint;
use tessera_planner::{ExplicitRequests, PlanOptions, PlanSummary, RankPlan, plan};
use tessera_server::{ARROW_STREAM, AppState, ServerConfig, app};
use tessera_storage::testing::{FaultConfig, FaultyStore};
use tessera_synth as synth;

use support::*;

struct Fixture {
    dir: TempDir,
    state: AppState,
    app: Router,
}

impl Fixture {
    fn root(&self) -> std::path::PathBuf {
        self.dir.path().join("catalog")
    }
}

async fn fixture() -> Fixture {
    fixture_with(|_| {}).await
}

async fn fixture_with(configure: impl FnOnce(&mut ServerConfig)) -> Fixture {
    let dir = TempDir::new().unwrap();
    let root = dir.path().join("catalog");
    std::fs::create_dir_all(&root).unwrap();
    write_catalog(&root).await;
    let mut config = ServerConfig::new(root.to_str().unwrap());
    configure(&mut config);
    let state = AppState::new(config).unwrap();
    let app = app(state.clone());
    Fixture { dir, state, app }
}

/// The metadata of a fixture checkpoint, read directly.
async fn local_meta(f: &Fixture, id: &str) -> Arc<tessera_metadata::CheckpointMeta> {
    let store = LocalFileSystem::new_with_prefix(f.root()).unwrap();
    Arc::new(open_checkpoint(&store, &Path::from(id)).await.unwrap().meta)
}

#[tokio::test]
async fn health_and_readiness() {
    let f = fixture().await;
    let live = get(&f.app, "/healthz").await;
    assert_eq!(live.status, StatusCode::OK);
    assert_eq!(live.json(), json!({"status": "ok"}));
    let ready = get(&f.app, "/readyz").await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.json(), json!({"status": "ready"}));
}

#[tokio::test]
async fn readiness_is_503_when_the_root_is_gone() {
    let f = fixture().await;
    std::fs::remove_dir_all(f.root()).unwrap();
    get(&f.app, "/readyz").await.assert_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "storage_unavailable",
        "catalog root",
    );
    assert_eq!(get(&f.app, "/healthz").await.status, StatusCode::OK);
}

#[tokio::test]
async fn catalog_lists_runs_committed_incomplete_and_latest() {
    let f = fixture().await;
    let answer = get(&f.app, "/v1/checkpoints").await;
    assert_eq!(answer.status, StatusCode::OK);
    let json = answer.json();
    let ids: Vec<&str> = json["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    // Sorted by run then step; `notes` (no manifest, not step-<N>) and `.trash` are left out.
    assert_eq!(
        ids,
        [
            "eval/step-000005",
            "gpt/step-000100",
            "gpt/step-000200",
            "gpt/step-000300"
        ]
    );
    let by_id = |id: &str| {
        json["checkpoints"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["id"] == id)
            .unwrap()
            .clone()
    };
    let c100 = by_id("gpt/step-000100");
    assert_eq!(c100["status"], "committed");
    assert_eq!(c100["committed"], true);
    assert_eq!(c100["latest"], false);
    assert_eq!(c100["format"], "native");
    assert_eq!(c100["writer"], "tessera (version 1)");
    assert_eq!(c100["step"], 100);
    assert_eq!(c100["data"], "present");
    assert!(c100["bytes"].as_u64().unwrap() > c100["tensor_bytes"].as_u64().unwrap());
    assert!(c100["tensors"].as_u64().unwrap() > 10);
    assert!(c100["created"].as_str().unwrap().ends_with('Z'));
    let c200 = by_id("gpt/step-000200");
    assert_eq!(c200["latest"], true);
    let c300 = by_id("gpt/step-000300");
    assert_eq!(c300["status"], "incomplete");
    assert_eq!(c300["committed"], false);
    assert_eq!(c300["step"], 300);
    assert_eq!(c300["tensors"], Value::Null);
    assert_eq!(
        json["runs"],
        json!([
            {"run": "eval", "latest": "eval/step-000005", "checkpoints": 1},
            {"run": "gpt", "latest": "gpt/step-000200", "checkpoints": 3},
        ])
    );
}

#[tokio::test]
async fn checkpoint_summary_has_counts_and_the_source_layout() {
    let f = fixture().await;
    let answer = get(&f.app, "/v1/checkpoints/gpt/step-000100").await;
    assert_eq!(answer.status, StatusCode::OK);
    let json = answer.json();
    let meta = local_meta(&f, "gpt/step-000100").await;
    assert_eq!(json["id"], "gpt/step-000100");
    assert_eq!(json["tensors"], meta.tensors().len() as u64);
    assert_eq!(json["chunks"], meta.chunks().len() as u64);
    assert_eq!(json["files"], 8);
    assert_eq!(json["tensor_bytes"], meta.tensor_bytes());
    assert_eq!(
        json["source_layout"],
        serde_json::to_value(saved_layout()).unwrap()
    );
}

#[tokio::test]
async fn latest_resolves_to_the_newest_committed_step() {
    let f = fixture().await;
    let json = get(&f.app, "/v1/checkpoints/gpt/latest").await.json();
    assert_eq!(json["id"], "gpt/step-000200");
    assert_eq!(json["latest"], true);
    let tensors = get(&f.app, "/v1/checkpoints/gpt/latest/tensors?limit=0").await;
    assert_eq!(tensors.json()["checkpoint"], "gpt/step-000200");
    let plan = post_json(
        &f.app,
        "/v1/plans",
        plan_body("gpt/latest", &target_layout()),
    )
    .await;
    assert_eq!(plan.json()["checkpoint"], "gpt/step-000200");
    get(&f.app, "/v1/checkpoints/nosuchrun/latest")
        .await
        .assert_error(
            StatusCode::NOT_FOUND,
            "unknown_checkpoint",
            "nosuchrun/latest",
        );
}

#[tokio::test]
async fn incomplete_checkpoints_are_shown_but_never_loadable() {
    let f = fixture().await;
    let summary = get(&f.app, "/v1/checkpoints/gpt/step-000300").await;
    assert_eq!(summary.status, StatusCode::OK);
    assert_eq!(summary.json()["status"], "incomplete");
    assert_eq!(summary.json()["source_layout"], Value::Null);
    for uri in [
        "/v1/checkpoints/gpt/step-000300/tensors",
        "/v1/checkpoints/gpt/step-000300/tensors/model.final_norm.weight",
    ] {
        get(&f.app, uri).await.assert_error(
            StatusCode::CONFLICT,
            "incomplete_checkpoint",
            "gpt/step-000300 is incomplete",
        );
    }
    post_json(
        &f.app,
        "/v1/plans",
        plan_body("gpt/step-000300", &target_layout()),
    )
    .await
    .assert_error(StatusCode::CONFLICT, "incomplete_checkpoint", "no manifest");
}

#[tokio::test]
async fn unknown_checkpoints_are_404() {
    let f = fixture().await;
    for uri in [
        "/v1/checkpoints/gpt/step-000999",
        "/v1/checkpoints/nope/step-000100/tensors",
        "/v1/checkpoints/gpt/notes2/tensors/x",
    ] {
        get(&f.app, uri).await.assert_error(
            StatusCode::NOT_FOUND,
            "unknown_checkpoint",
            "no checkpoint",
        );
    }
    post_json(
        &f.app,
        "/v1/plans",
        plan_body("gpt/step-000999", &target_layout()),
    )
    .await
    .assert_error(
        StatusCode::NOT_FOUND,
        "unknown_checkpoint",
        "gpt/step-000999",
    );
}

#[tokio::test]
async fn tensors_are_filtered_and_paged() {
    let f = fixture().await;
    let meta = local_meta(&f, "gpt/step-000100").await;
    let base = "/v1/checkpoints/gpt/step-000100/tensors";
    let all = get(&f.app, &format!("{base}?limit=10000")).await.json();
    assert_eq!(all["total"], meta.tensors().len() as u64);
    let names: Vec<String> = all["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["fqn"].as_str().unwrap().to_string())
        .collect();
    let expected: Vec<String> = meta.tensors().iter().map(|t| t.fqn.clone()).collect();
    assert_eq!(names, expected);
    let first = &all["tensors"][0];
    let t0 = &meta.tensors()[0];
    assert_eq!(first["dtype"], t0.dtype.to_string());
    assert_eq!(first["shape"], json!(t0.shape));
    assert_eq!(first["bytes"], t0.nbytes());
    assert_eq!(first["boxes"], meta.chunks_of(0).len() as u64);

    // Paging: pages of 7 put together are the whole table.
    let mut paged = Vec::new();
    let mut offset = 0;
    loop {
        let page = get(&f.app, &format!("{base}?offset={offset}&limit=7"))
            .await
            .json();
        let tensors = page["tensors"].as_array().unwrap().clone();
        if tensors.is_empty() {
            break;
        }
        assert!(tensors.len() <= 7);
        paged.extend(
            tensors
                .iter()
                .map(|t| t["fqn"].as_str().unwrap().to_string()),
        );
        offset += 7;
    }
    assert_eq!(paged, expected);

    // Substring and glob filters.
    let qkv = get(&f.app, &format!("{base}?filter=attn.qkv.weight"))
        .await
        .json();
    let want = expected
        .iter()
        .filter(|n| n.contains("attn.qkv.weight"))
        .count();
    assert_eq!(qkv["total"], want as u64);
    assert!(want >= 4);
    let glob = get(
        &f.app,
        &format!("{base}?filter=model.layers.*.mlp.fc%3F.weight"),
    )
    .await
    .json();
    assert_eq!(glob["total"], 8, "4 layers x fc1, fc2: {glob}");

    for query in ["limit=10001", "limit=abc", "offset=-1"] {
        get(&f.app, &format!("{base}?{query}")).await.assert_error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            "",
        );
    }
}

#[tokio::test]
async fn tensor_detail_gives_boxes_files_and_byte_ranges() {
    let f = fixture().await;
    let meta = local_meta(&f, "gpt/step-000100").await;
    let fqn = "model.layers.1.attn.qkv.weight";
    let answer = get(
        &f.app,
        &format!("/v1/checkpoints/gpt/step-000100/tensors/{fqn}"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK);
    let json = answer.json();
    let index = meta.tensor_index(fqn).unwrap();
    let tensor = &meta.tensors()[index as usize];
    assert_eq!(json["fqn"], fqn);
    assert_eq!(json["checkpoint"], "gpt/step-000100");
    let saved = json["saved"].as_array().unwrap();
    assert_eq!(saved.len(), meta.chunks_of(index).len());
    assert!(saved.len() >= 2, "tp2 splits qkv");
    // Every box's bytes are where the answer says: read them and check the synthetic values.
    for b in saved {
        let offsets: Vec<u64> = serde_json::from_value(b["offsets"].clone()).unwrap();
        let lengths: Vec<u64> = serde_json::from_value(b["lengths"].clone()).unwrap();
        let file = f
            .root()
            .join("gpt/step-000100")
            .join(b["file"].as_str().unwrap());
        let data = std::fs::read(file).unwrap();
        let start = b["byte_offset"].as_u64().unwrap() as usize;
        let end = start + b["byte_length"].as_u64().unwrap() as usize;
        let region = tessera_metadata::TensorBox::new(offsets, lengths);
        synth::check_box(tensor, &region, &data[start..end]).unwrap();
        assert!(b["crc32c"].is_u64());
    }
    get(
        &f.app,
        "/v1/checkpoints/gpt/step-000100/tensors/model.nope.weight",
    )
    .await
    .assert_error(StatusCode::NOT_FOUND, "unknown_tensor", "model.nope.weight");
    // An FQN with an encoded slash is looked up as it is, never used as a path.
    get(
        &f.app,
        "/v1/checkpoints/gpt/step-000100/tensors/..%2F..%2Fmanifest.json",
    )
    .await
    .assert_error(
        StatusCode::NOT_FOUND,
        "unknown_tensor",
        "../../manifest.json",
    );
}

#[tokio::test]
async fn plans_match_local_planning_in_json_and_arrow() {
    let f = fixture().await;
    let layout = target_layout();
    let answer = post_json(&f.app, "/v1/plans", plan_body("gpt/step-000100", &layout)).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    let created = answer.json();
    let id = created["plan"].as_str().unwrap().to_string();
    assert_eq!(id.len(), 32);
    assert_eq!(created["world"], 4);
    assert_eq!(created["checkpoint"], "gpt/step-000100");
    assert_eq!(
        created["rank_url"],
        format!("/v1/plans/{id}/ranks/{{rank}}")
    );

    let meta = local_meta(&f, "gpt/step-000100").await;
    let requests = layout.resolve(meta.tensors()).unwrap();
    let local = plan(&meta, &requests, &PlanOptions::default()).unwrap();
    let summary: PlanSummary = serde_json::from_value(created["summary"].clone()).unwrap();
    assert_eq!(&summary, local.summary());
    assert!(summary.bytes_exchanged > 0, "DP replicas exchange");

    for rank in 0..4 {
        let uri = format!("/v1/plans/{id}/ranks/{rank}");
        let json = get(&f.app, &uri).await;
        assert_eq!(json.status, StatusCode::OK);
        assert_eq!(json.headers[header::CONTENT_TYPE], "application/json");
        let from_json = RankPlan::from_json(&json.text()).unwrap();
        let arrow = send(
            &f.app,
            Request::get(&uri)
                .header(header::ACCEPT, ARROW_STREAM)
                .body(Body::empty())
                .unwrap(),
        )
        .await;
        assert_eq!(arrow.status, StatusCode::OK);
        assert_eq!(arrow.headers[header::CONTENT_TYPE], ARROW_STREAM);
        let from_arrow = RankPlan::from_arrow_ipc(&arrow.body).unwrap();
        let want = local.rank_plan(rank).unwrap();
        assert_eq!(from_json, want);
        assert_eq!(from_arrow, want);
    }
    let again = get(&f.app, &format!("/v1/plans/{id}")).await;
    assert_eq!(again.status, StatusCode::OK);
    assert_eq!(again.json(), created);
}

#[tokio::test]
async fn plan_ids_are_stable_and_follow_options_and_checkpoint() {
    let f = fixture().await;
    let layout = target_layout();
    let compact = post_json(&f.app, "/v1/plans", plan_body("gpt/step-000100", &layout))
        .await
        .json();
    // Same layout, pretty-printed with another key order and the default spelled out.
    let pretty = serde_json::to_string_pretty(&json!({
        "options": {"dedup": true},
        "layout": serde_json::to_value(&layout).unwrap(),
        "checkpoint": "gpt/step-000100",
    }))
    .unwrap();
    let again = post_json(&f.app, "/v1/plans", pretty).await.json();
    assert_eq!(compact["plan"], again["plan"]);
    let no_dedup = post_json(
        &f.app,
        "/v1/plans",
        json!({"checkpoint": "gpt/step-000100", "layout": layout, "options": {"dedup": false}})
            .to_string(),
    )
    .await
    .json();
    assert_ne!(compact["plan"], no_dedup["plan"]);
    assert_eq!(no_dedup["summary"]["bytes_exchanged"], 0);
    let other = post_json(&f.app, "/v1/plans", plan_body("gpt/step-000200", &layout))
        .await
        .json();
    assert_ne!(compact["plan"], other["plan"]);
    assert_eq!(f.state.metrics().plan_computations, 3);
}

#[tokio::test]
async fn explicit_requests_are_planned() {
    let f = fixture().await;
    let requests = json!({"ranks": [
        [{"fqn": "model.final_norm.weight", "flat": [0, 40]}],
        [{"fqn": "model.lm_head.weight", "offsets": [10, 0], "lengths": [5, 64]},
         {"fqn": "model.final_norm.weight", "flat": [20, 64]}],
    ]});
    let answer = post_json(
        &f.app,
        "/v1/plans",
        json!({"checkpoint": "eval/step-000005", "requests": requests}).to_string(),
    )
    .await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    let created = answer.json();
    assert_eq!(created["world"], 2);
    let id = created["plan"].as_str().unwrap();
    let meta = local_meta(&f, "eval/step-000005").await;
    let explicit: ExplicitRequests = serde_json::from_value(requests).unwrap();
    let local = plan(
        &meta,
        &explicit.resolve(meta.tensors()).unwrap(),
        &PlanOptions::default(),
    )
    .unwrap();
    for rank in 0..2 {
        let answer = get(&f.app, &format!("/v1/plans/{id}/ranks/{rank}")).await;
        assert_eq!(
            RankPlan::from_json(&answer.text()).unwrap(),
            local.rank_plan(rank).unwrap()
        );
    }
}

#[tokio::test]
async fn invalid_layouts_and_requests_are_422_with_the_planner_reason() {
    let f = fixture().await;
    let cases = [
        (
            json!({"mesh": "dp2", "rules": []}),
            "invalid_layout",
            "invalid layout JSON",
        ),
        (
            json!({"mesh": [{"name": "dp", "size": 0}], "rules": [{"match": "*", "placements": ["replicate"]}]}),
            "invalid_layout",
            "size 0",
        ),
        (
            json!({"mesh": [{"name": "dp", "size": 2}], "rules": [{"match": "*", "placements": ["shard(x)"]}]}),
            "invalid_layout",
            "unknown placement",
        ),
        (
            json!({"mesh": [{"name": "dp", "size": 2}], "rules": [{"match": "model.*", "placements": ["shard(0)"]}]}),
            "invalid_layout",
            "matches no rule",
        ),
        (
            json!({"mesh": [{"name": "dp", "size": 2}], "rules": [{"match": "*", "placements": ["shard(5)"]}]}),
            "invalid_layout",
            "cannot take placement shard(5)",
        ),
    ];
    for (layout, kind, reason) in cases {
        post_json(
            &f.app,
            "/v1/plans",
            json!({"checkpoint": "gpt/step-000100", "layout": layout}).to_string(),
        )
        .await
        .assert_error(StatusCode::UNPROCESSABLE_ENTITY, kind, reason);
    }
    let requests = [
        (
            json!({"ranks": [[{"fqn": "model.nope", "flat": [0, 1]}]]}),
            "not in the checkpoint",
        ),
        (
            json!({"ranks": [[{"fqn": "model.final_norm.weight", "flat": [0, 100000]}]]}),
            "outside",
        ),
        (json!({"ranks": []}), "no ranks"),
        (json!({"ranks": [[{"fqn": 3}]]}), "invalid requests JSON"),
    ];
    for (requests, reason) in requests {
        post_json(
            &f.app,
            "/v1/plans",
            json!({"checkpoint": "gpt/step-000100", "requests": requests}).to_string(),
        )
        .await
        .assert_error(StatusCode::UNPROCESSABLE_ENTITY, "invalid_requests", reason);
    }
    let snapshot = f.state.metrics();
    assert_eq!(snapshot.plan_failures, 4, "{snapshot:?}");
}

#[tokio::test]
async fn malformed_plan_bodies_are_400() {
    let f = fixture().await;
    let layout = serde_json::to_value(target_layout()).unwrap();
    let cases = [
        ("{not json".to_string(), "not a plan request"),
        (json!({"layout": layout}).to_string(), "checkpoint"),
        (
            json!({"checkpoint": "gpt/step-000100"}).to_string(),
            "exactly one",
        ),
        (
            json!({"checkpoint": "gpt/step-000100", "layout": layout, "requests": {"ranks": []}})
                .to_string(),
            "exactly one",
        ),
        (
            json!({"checkpoint": "gpt/step-000100", "layout": layout, "extra": 1}).to_string(),
            "unknown field",
        ),
        (
            json!({"checkpoint": "gpt/step-000100", "layout": layout, "options": {"dedup": "yes"}})
                .to_string(),
            "dedup",
        ),
    ];
    for (body, needle) in cases {
        post_json(&f.app, "/v1/plans", body).await.assert_error(
            StatusCode::BAD_REQUEST,
            "bad_request",
            needle,
        );
    }
}

#[tokio::test]
async fn plan_ids_and_ranks_are_checked() {
    let f = fixture().await;
    let id = post_json(
        &f.app,
        "/v1/plans",
        plan_body("gpt/step-000100", &target_layout()),
    )
    .await
    .json()["plan"]
        .as_str()
        .unwrap()
        .to_string();
    get(&f.app, &format!("/v1/plans/{id}/ranks/4"))
        .await
        .assert_error(StatusCode::NOT_FOUND, "unknown_rank", "no rank 4");
    for rank in ["x", "-1", "4294967296", "1.0"] {
        get(&f.app, &format!("/v1/plans/{id}/ranks/{rank}"))
            .await
            .assert_error(StatusCode::BAD_REQUEST, "bad_id", "not a number");
    }
    let unknown = "0123456789abcdef0123456789abcdef";
    get(&f.app, &format!("/v1/plans/{unknown}/ranks/0"))
        .await
        .assert_error(
            StatusCode::NOT_FOUND,
            "unknown_plan",
            "POST /v1/plans again",
        );
    get(&f.app, &format!("/v1/plans/{unknown}"))
        .await
        .assert_error(StatusCode::NOT_FOUND, "unknown_plan", unknown);
    for bad in ["xyz", "%2e%2e", &id.to_uppercase()] {
        get(&f.app, &format!("/v1/plans/{bad}/ranks/0"))
            .await
            .assert_error(StatusCode::BAD_REQUEST, "bad_id", "32 lowercase hex");
    }
}

#[tokio::test]
async fn evicted_plans_are_recomputed_from_their_request() {
    let f = fixture().await;
    let created = post_json(
        &f.app,
        "/v1/plans",
        plan_body("gpt/step-000100", &target_layout()),
    )
    .await
    .json();
    let id = created["plan"].as_str().unwrap();
    let first = get(&f.app, &format!("/v1/plans/{id}/ranks/1")).await.text();
    f.state.evict_plans();
    let second = get(&f.app, &format!("/v1/plans/{id}/ranks/1")).await;
    assert_eq!(second.status, StatusCode::OK);
    assert_eq!(second.text(), first);
    assert_eq!(f.state.metrics().plan_computations, 2);
    get(&f.app, &format!("/v1/plans/{id}/ranks/2")).await;
    assert_eq!(f.state.metrics().plan_computations, 2);
    // Forgetting everything (a restart) makes the id unknown.
    f.state.clear_caches();
    get(&f.app, &format!("/v1/plans/{id}/ranks/1"))
        .await
        .assert_error(StatusCode::NOT_FOUND, "unknown_plan", id);
}

#[tokio::test]
async fn oversized_bodies_are_413() {
    let f = fixture_with(|c| c.body_limit = 1024).await;
    let big = json!({"checkpoint": "gpt/step-000100", "layout": {"mesh": [], "rules": [], "pad": "x".repeat(2000)}});
    post_json(&f.app, "/v1/plans", big.to_string())
        .await
        .assert_error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "1024 bytes",
        );
    // A streamed body without a length is cut at the limit as well.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..3).map(|_| Ok(vec![b' '; 800])).collect();
    let stream = Body::from_stream(futures::stream::iter(chunks));
    post_json(&f.app, "/v1/plans", stream).await.assert_error(
        StatusCode::PAYLOAD_TOO_LARGE,
        "body_too_large",
        "limit",
    );
    // Under the limit is fine.
    let ok = post_json(
        &f.app,
        "/v1/plans",
        json!({"checkpoint": "eval/step-000005", "layout": tessera_planner::presets::fsdp(2).unwrap()})
            .to_string(),
    )
    .await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.text());
}

#[tokio::test]
async fn the_token_guards_every_v1_route() {
    let f = fixture_with(|c| c.token = Some("s3cret-token".to_string())).await;
    let with = |uri: &str, auth: Option<&str>| {
        let mut request = Request::get(uri);
        if let Some(auth) = auth {
            request = request.header(header::AUTHORIZATION, auth);
        }
        request.body(Body::empty()).unwrap()
    };
    for uri in [
        "/v1/checkpoints",
        "/v1/checkpoints/gpt/step-000100",
        "/v1/checkpoints/gpt/step-000100/tensors",
        "/v1/plans/0123456789abcdef0123456789abcdef/ranks/0",
        "/v1/nothing-here",
    ] {
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("Bearer s3cret-token-and-more"),
            Some("Basic czNjcmV0LXRva2Vu"),
            Some("s3cret-token"),
        ] {
            let answer = send(&f.app, with(uri, auth)).await;
            answer.assert_error(StatusCode::UNAUTHORIZED, "unauthorized", "Bearer");
            assert!(
                answer.headers[header::WWW_AUTHENTICATE]
                    .to_str()
                    .unwrap()
                    .starts_with("Bearer")
            );
        }
    }
    let ok = send(&f.app, with("/v1/checkpoints", Some("Bearer s3cret-token"))).await;
    assert_eq!(ok.status, StatusCode::OK);
    let lower = send(&f.app, with("/v1/checkpoints", Some("bearer s3cret-token"))).await;
    assert_eq!(lower.status, StatusCode::OK);
    let post = send(
        &f.app,
        Request::post("/v1/plans")
            .body(Body::from(plan_body("gpt/step-000100", &target_layout())))
            .unwrap(),
    )
    .await;
    post.assert_error(StatusCode::UNAUTHORIZED, "unauthorized", "token");
    assert_eq!(f.state.metrics().plan_computations, 0);
    // Probes, the API description and the UI stay open (Kubernetes probes send no token).
    for uri in ["/healthz", "/readyz", "/openapi.json", "/"] {
        assert_eq!(get(&f.app, uri).await.status, StatusCode::OK, "{uri}");
    }
}

/// With a token, `/metrics` needs it too: its series say who uses the server and how (before the
/// fix it answered anyone).
#[tokio::test]
async fn metrics_need_the_token_when_the_server_has_one() {
    let f = fixture_with(|c| c.token = Some("s3cret-token".to_string())).await;
    let metrics = |auth: Option<&str>| {
        let mut request = Request::get("/metrics");
        if let Some(auth) = auth {
            request = request.header(header::AUTHORIZATION, auth);
        }
        request.body(Body::empty()).unwrap()
    };
    for auth in [None, Some("Bearer wrong")] {
        let answer = send(&f.app, metrics(auth)).await;
        answer.assert_error(StatusCode::UNAUTHORIZED, "unauthorized", "Bearer");
        assert!(!answer.text().contains("tessera_"), "{}", answer.text());
    }
    let ok = send(&f.app, metrics(Some("Bearer s3cret-token"))).await;
    assert_eq!(ok.status, StatusCode::OK, "{}", ok.text());
    assert!(ok.text().contains("tessera_http_requests"), "{}", ok.text());
    // Without a token configured it stays open.
    let open = fixture().await;
    assert_eq!(get(&open.app, "/metrics").await.status, StatusCode::OK);
}

#[tokio::test]
async fn path_traversal_is_refused() {
    let f = fixture().await;
    // Decoded by the router before the handler sees them, then refused as ids.
    let bad_ids = [
        "/v1/checkpoints/%2e%2e/gpt",
        "/v1/checkpoints/gpt/%2e%2e",
        "/v1/checkpoints/gpt/%2E%2E/tensors",
        "/v1/checkpoints/..%2f..%2fetc/passwd",
        "/v1/checkpoints/gpt/step-000100%2f..%2f..",
        "/v1/checkpoints/gpt%5c..%5c../x",
        "/v1/checkpoints/%2fetc/passwd",
        "/v1/checkpoints/gpt/..",
        "/v1/checkpoints/gpt/.",
        "/v1/checkpoints/gpt/%252e%252e",
        "/v1/checkpoints/C:/windows",
        "/v1/checkpoints/gpt/step-000100%00",
        "/v1/checkpoints/gpt/.hidden/tensors",
        "/v1/checkpoints/gpt/step%20100",
        "/v1/checkpoints/gpt/%ff%fe",
    ];
    for uri in bad_ids {
        get(&f.app, uri)
            .await
            .assert_error(StatusCode::BAD_REQUEST, "bad_id", "");
    }
    // Shapes no route has.
    for uri in [
        "/v1/checkpoints/../../etc/passwd",
        "/v1/checkpoints/gpt/step-000100/../../../x",
        "/v1/checkpoints//step-000100",
    ] {
        let answer = get(&f.app, uri).await;
        assert!(
            answer.status == StatusCode::NOT_FOUND || answer.status == StatusCode::BAD_REQUEST,
            "{uri}: {}",
            answer.status
        );
        assert!(answer.json()["error"].is_string());
    }
    let bad_bodies = [
        "../gpt/step-000100",
        "/etc/passwd",
        "gpt/../../x",
        "gpt/step-000100/..",
        "file:///etc/passwd",
        "s3://bucket/key",
        "gpt\\step-000100",
        "gpt//step-000100",
        "",
        "gpt/%2e%2e",
        "gpt/step-000100/",
        "./gpt/step-000100",
    ];
    for checkpoint in bad_bodies {
        post_json(
            &f.app,
            "/v1/plans",
            json!({"checkpoint": checkpoint, "layout": target_layout()}).to_string(),
        )
        .await
        .assert_error(StatusCode::BAD_REQUEST, "bad_id", "");
    }
    assert_eq!(
        f.state.metrics().metadata_loads,
        0,
        "nothing reached storage"
    );
}

#[tokio::test]
async fn storage_outages_are_503_without_store_detail() {
    let dir = TempDir::new().unwrap();
    write_catalog(dir.path()).await;
    let inner: Arc<dyn ObjectStore> =
        Arc::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap());
    let faulty = Arc::new(FaultyStore::new(inner, FaultConfig::outage()));
    let state =
        AppState::with_store(ServerConfig::new("memory"), faulty.clone(), Path::from("")).unwrap();
    let app = app(state);
    for uri in [
        "/v1/checkpoints",
        "/v1/checkpoints/gpt/step-000100",
        "/v1/checkpoints/gpt/step-000100/tensors",
        "/v1/checkpoints/gpt/latest",
    ] {
        let answer = get(&app, uri).await;
        answer.assert_error(
            StatusCode::SERVICE_UNAVAILABLE,
            "storage_unavailable",
            "while",
        );
        assert!(
            !answer.text().to_lowercase().contains("injected"),
            "the store's own error is logged, not sent: {}",
            answer.text()
        );
    }
    post_json(
        &app,
        "/v1/plans",
        plan_body("gpt/step-000100", &target_layout()),
    )
    .await
    .assert_error(StatusCode::SERVICE_UNAVAILABLE, "storage_unavailable", "");
    // The store comes back: answers come back (errors are not cached).
    faulty.set_outage(false);
    assert_eq!(
        get(&app, "/v1/checkpoints/gpt/step-000100").await.status,
        StatusCode::OK
    );
}

#[tokio::test]
async fn unknown_routes_and_methods_answer_json() {
    let f = fixture().await;
    get(&f.app, "/nope")
        .await
        .assert_error(StatusCode::NOT_FOUND, "not_found", "/nope");
    for (method, uri) in [
        (Method::DELETE, "/v1/plans"),
        (Method::PUT, "/healthz"),
        (Method::POST, "/v1/checkpoints"),
        (Method::DELETE, "/v1/checkpoints/gpt/step-000100"),
    ] {
        send(
            &f.app,
            Request::builder()
                .method(method)
                .uri(uri)
                .body(Body::empty())
                .unwrap(),
        )
        .await
        .assert_error(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "");
    }
}

#[tokio::test]
async fn request_ids_are_set_and_propagated() {
    let f = fixture().await;
    let answer = get(&f.app, "/healthz").await;
    let id = answer.headers["x-request-id"].to_str().unwrap();
    assert_eq!(id.len(), 36, "a UUID: {id}");
    let given = send(
        &f.app,
        Request::get("/v1/checkpoints/gpt/step-000999")
            .header("x-request-id", "job-42-rank-7")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(given.headers["x-request-id"], "job-42-rank-7");
}

#[tokio::test]
async fn metrics_count_requests_caches_and_plan_computations() {
    let f = fixture().await;
    let body = plan_body("gpt/step-000100", &target_layout());
    let id = post_json(&f.app, "/v1/plans", body.clone()).await.json()["plan"]
        .as_str()
        .unwrap()
        .to_string();
    post_json(&f.app, "/v1/plans", body).await;
    get(&f.app, &format!("/v1/plans/{id}/ranks/0")).await;
    get(&f.app, &format!("/v1/plans/{id}/ranks/9")).await;
    get(&f.app, "/v1/checkpoints/gpt/step-000100/tensors").await;
    let answer = get(&f.app, "/metrics").await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        answer.headers[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4")
    );
    let text = answer.text();
    let m = |series: &str| {
        metric(&text, series).unwrap_or_else(|| panic!("no series {series} in\n{text}"))
    };
    assert_eq!(m("tessera_plan_computations_total"), 1.0);
    assert_eq!(m("tessera_metadata_loads_total"), 1.0);
    assert_eq!(m("tessera_cache_misses_total{cache=\"plan\"}"), 1.0);
    assert_eq!(m("tessera_cache_hits_total{cache=\"plan\"}"), 3.0);
    assert_eq!(m("tessera_cache_misses_total{cache=\"metadata\"}"), 1.0);
    // The second POST, the tensors page and both rank GETs: a cached plan is answered only
    // after its checkpoint's stamp is checked (the metadata served from the cache).
    assert_eq!(m("tessera_cache_hits_total{cache=\"metadata\"}"), 4.0);
    assert_eq!(
        m("tessera_http_requests_total{route=\"/v1/plans\",method=\"POST\",status=\"200\"}"),
        2.0
    );
    assert_eq!(
        m(
            "tessera_http_requests_total{route=\"/v1/plans/{plan}/ranks/{rank}\",method=\"GET\",status=\"404\"}"
        ),
        1.0
    );
    assert_eq!(
        m(
            "tessera_http_request_duration_seconds_count{route=\"/v1/plans/{plan}/ranks/{rank}\",method=\"GET\",status=\"200\"}"
        ),
        1.0
    );
    assert_eq!(
        m(
            "tessera_http_request_duration_seconds_bucket{le=\"+Inf\",route=\"/v1/plans\",method=\"POST\",status=\"200\"}"
        ),
        2.0
    );
    assert_eq!(m("tessera_plan_compute_seconds_count"), 1.0);
    assert_eq!(m("tessera_cache_entries{cache=\"plan\"}"), 1.0);
    assert!(m("tessera_cache_bytes{cache=\"metadata\"}") > 1000.0);
    assert!(
        text.ends_with("# EOF\n"),
        "an OpenMetrics exposition ends with # EOF"
    );
    // Raw paths never become labels.
    assert!(!text.contains(&id));
    // A scraper that asks for OpenMetrics (Prometheus does) gets the body typed as such.
    let scraped = send(
        &f.app,
        Request::get("/metrics")
            .header(
                header::ACCEPT,
                "application/openmetrics-text;version=1.0.0;q=0.6,text/plain;version=0.0.4;q=0.5",
            )
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert!(
        scraped.headers[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("application/openmetrics-text; version=1.0.0")
    );
}

#[tokio::test]
async fn the_openapi_document_lists_every_route() {
    let f = fixture().await;
    let answer = get(&f.app, "/openapi.json").await;
    assert_eq!(answer.status, StatusCode::OK);
    let doc = answer.json();
    assert_eq!(
        doc,
        serde_json::to_value(tessera_server::openapi()).unwrap()
    );
    assert!(doc["openapi"].as_str().unwrap().starts_with("3."));
    let paths = doc["paths"].as_object().unwrap();
    let mut listed: Vec<(String, String)> = paths
        .iter()
        .flat_map(|(path, item)| {
            item.as_object()
                .unwrap()
                .keys()
                .map(move |method| (method.clone(), path.clone()))
        })
        .collect();
    listed.sort();
    let mut expected: Vec<(String, String)> = [
        ("get", "/healthz"),
        ("get", "/readyz"),
        ("get", "/metrics"),
        ("get", "/openapi.json"),
        ("get", "/v1/checkpoints"),
        ("get", "/v1/checkpoints/{run}/{step}"),
        ("get", "/v1/checkpoints/{run}/{step}/tensors"),
        ("get", "/v1/checkpoints/{run}/{step}/tensors/{fqn}"),
        ("post", "/v1/plans"),
        ("get", "/v1/plans/{plan}"),
        ("get", "/v1/plans/{plan}/ranks/{rank}"),
        ("get", "/v1/plans/{plan}/ranks"),
        ("get", "/v1/plans/{plan}/ranks/{rank}/overview"),
        ("get", "/v1/live"),
        ("get", "/v1/live/{name}"),
    ]
    .iter()
    .map(|(m, p)| (m.to_string(), p.to_string()))
    .collect();
    expected.sort();
    assert_eq!(listed, expected);
    for (path, item) in paths {
        let secured = path.starts_with("/v1") || path == "/metrics";
        for op in item.as_object().unwrap().values() {
            assert_eq!(op["security"].is_array(), secured, "{path}");
        }
    }
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for name in [
        "CatalogResponse",
        "CheckpointSummary",
        "TensorPage",
        "TensorDetail",
        "PlanRequest",
        "PlanCreated",
        "RankSummaries",
        "RankOverview",
        "Composition",
        "ErrorBody",
        "LiveListing",
        "LivePublication",
        "LiveStep",
    ] {
        assert!(schemas.contains_key(name), "no schema {name}");
    }
    assert!(doc["components"]["securitySchemes"]["bearer"].is_object());
    let rank = &paths["/v1/plans/{plan}/ranks/{rank}"]["get"]["responses"]["200"]["content"];
    assert!(rank[ARROW_STREAM].is_object() && rank["application/json"].is_object());
    // Every documented GET route answers something other than 404/405 (with example ids).
    for (method, path) in &listed {
        if method != "get" {
            continue;
        }
        let uri = path
            .replace("{run}", "gpt")
            .replace("{step}", "step-000100")
            .replace("{fqn}", "model.final_norm.weight")
            .replace("{plan}", "0123456789abcdef0123456789abcdef")
            .replace("{rank}", "0")
            .replace("{name}", "policy");
        let answer = get(&f.app, &uri).await;
        let status = answer.status;
        // This fixture has no registry: the live routes answer their own 404, `no_registry`.
        let no_registry = uri.starts_with("/v1/live") && answer.json()["error"] == "no_registry";
        assert!(
            status != StatusCode::METHOD_NOT_ALLOWED
                && (status != StatusCode::NOT_FOUND || uri.starts_with("/v1/plans") || no_registry),
            "{uri}: {status}"
        );
    }
}

#[tokio::test]
async fn cors_is_off_by_default_and_on_when_configured() {
    let f = fixture().await;
    let request = || {
        Request::get("/v1/checkpoints")
            .header(header::ORIGIN, "https://ui.example")
            .body(Body::empty())
            .unwrap()
    };
    let answer = send(&f.app, request()).await;
    assert_eq!(answer.status, StatusCode::OK);
    assert!(
        !answer
            .headers
            .contains_key(header::ACCESS_CONTROL_ALLOW_ORIGIN)
    );
    let on = fixture_with(|c| c.cors_origins = vec!["https://ui.example".to_string()]).await;
    let answer = send(&on.app, request()).await;
    assert_eq!(
        answer.headers[header::ACCESS_CONTROL_ALLOW_ORIGIN],
        "https://ui.example"
    );
    let preflight = send(
        &on.app,
        Request::builder()
            .method(Method::OPTIONS)
            .uri("/v1/plans")
            .header(header::ORIGIN, "https://ui.example")
            .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert_eq!(preflight.status, StatusCode::OK);
    let other = send(
        &on.app,
        Request::get("/v1/checkpoints")
            .header(header::ORIGIN, "https://evil.example")
            .body(Body::empty())
            .unwrap(),
    )
    .await;
    assert!(
        !other
            .headers
            .contains_key(header::ACCESS_CONTROL_ALLOW_ORIGIN)
    );
}

#[tokio::test]
async fn the_index_page_and_a_static_web_ui() {
    let f = fixture().await;
    let index = get(&f.app, "/").await;
    assert_eq!(index.status, StatusCode::OK);
    assert!(index.text().contains("/v1/checkpoints"));

    let ui = TempDir::new().unwrap();
    std::fs::create_dir_all(ui.path().join("site")).unwrap();
    std::fs::write(
        ui.path().join("site/index.html"),
        "<h1>catalog browser</h1>",
    )
    .unwrap();
    std::fs::write(ui.path().join("site/app.js"), "console.log(1)").unwrap();
    std::fs::write(ui.path().join("secret.txt"), "outside the UI").unwrap();
    let site = ui.path().join("site");
    let with_ui = fixture_with(|c| c.web_ui = Some(site)).await;
    let page = get(&with_ui.app, "/").await;
    assert_eq!(page.status, StatusCode::OK);
    assert_eq!(page.text(), "<h1>catalog browser</h1>");
    let script = get(&with_ui.app, "/app.js").await;
    assert_eq!(script.text(), "console.log(1)");
    assert!(
        script.headers[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .contains("javascript")
    );
    for uri in ["/../secret.txt", "/%2e%2e/secret.txt", "/..%2fsecret.txt"] {
        let answer = get(&with_ui.app, uri).await;
        assert_ne!(answer.status, StatusCode::OK, "{uri}");
        assert!(!answer.text().contains("outside the UI"));
    }
    get(&with_ui.app, "/missing.js").await.assert_error(
        StatusCode::NOT_FOUND,
        "not_found",
        "/missing.js",
    );
    // The API is still the API.
    assert_eq!(
        get(&with_ui.app, "/v1/checkpoints").await.status,
        StatusCode::OK
    );
}
