//! Job start: thousands of ranks ask for a plan that does not exist yet, all at once. The plan
//! must be computed exactly once (checked through `/metrics`) and every request answered.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode, header};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use tempfile::TempDir;
use tessera_metadata::formats::native::open_checkpoint;
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_planner::{PlanOptions, RankPlan, plan};
use tessera_server::{ARROW_STREAM, AppState, ServerConfig, app};
use tessera_synth::Model;
use tokio::sync::Barrier;

use support::*;

/// Concurrent requests of each burst.
const BURST: usize = 2048;

/// Whether request `i` of the rank burst asks for Arrow: every other round over the ranks.
fn arrow(i: usize, world: usize) -> bool {
    (i / world) % 2 == 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_on_a_new_plan_computes_it_once() {
    let dir = TempDir::new().unwrap();
    write_checkpoint(
        dir.path(),
        "gpt",
        "step-000100",
        Model::GptTiny,
        true,
        &saved_layout(),
        true,
    )
    .await;
    let state = AppState::new(ServerConfig::new(dir.path().to_str().unwrap())).unwrap();
    let app = app(state.clone());
    // 32 ranks: Megatron tp2 pp2 dp8 with a distributed optimizer.
    let layout = megatron_gpt(MegatronGpt {
        tp: 2,
        pp: 2,
        dp: 8,
        num_layers: 4,
        zero1: true,
    })
    .unwrap();
    let world = layout.world_size() as usize;
    let body = plan_body("gpt/step-000100", &layout);

    // 1. Cold: 2048 POSTs of the same body, released together; nothing is cached yet.
    let barrier = Arc::new(Barrier::new(BURST));
    let mut tasks = Vec::with_capacity(BURST);
    for _ in 0..BURST {
        let (app, body, barrier) = (app.clone(), body.clone(), Arc::clone(&barrier));
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            post_json(&app, "/v1/plans", body).await
        }));
    }
    let mut ids = HashMap::new();
    for task in tasks {
        let answer = task.await.unwrap();
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        *ids.entry(answer.json()["plan"].as_str().unwrap().to_string())
            .or_insert(0) += 1;
    }
    assert_eq!(ids.len(), 1, "one plan id for one request: {ids:?}");
    let id = ids.into_keys().next().unwrap();
    let metrics = get(&app, "/metrics").await.text();
    assert_eq!(
        metric(&metrics, "tessera_plan_computations_total"),
        Some(1.0)
    );
    assert_eq!(metric(&metrics, "tessera_metadata_loads_total"), Some(1.0));
    assert_eq!(
        metric(&metrics, "tessera_cache_misses_total{cache=\"plan\"}"),
        Some(1.0)
    );
    assert_eq!(
        metric(&metrics, "tessera_cache_hits_total{cache=\"plan\"}"),
        Some((BURST - 1) as f64)
    );
    assert_eq!(
        metric(
            &metrics,
            "tessera_http_requests_total{route=\"/v1/plans\",method=\"POST\",status=\"200\"}"
        ),
        Some(BURST as f64)
    );

    // 2. Cold again, the other way in: the computed plan is gone (its request is kept), and
    //    2048 ranks GET their plans at once, half JSON and half Arrow.
    state.evict_plans();
    let barrier = Arc::new(Barrier::new(BURST));
    let mut tasks = Vec::with_capacity(BURST);
    for i in 0..BURST {
        let (app, barrier) = (app.clone(), Arc::clone(&barrier));
        let uri = format!("/v1/plans/{id}/ranks/{}", i % world);
        tasks.push(tokio::spawn(async move {
            let mut request = Request::get(uri);
            if arrow(i, world) {
                request = request.header(header::ACCEPT, ARROW_STREAM);
            }
            barrier.wait().await;
            send(&app, request.body(Body::empty()).unwrap()).await
        }));
    }
    let mut bodies: Vec<HashMap<bool, Vec<u8>>> = vec![HashMap::new(); world];
    for (i, task) in tasks.into_iter().enumerate() {
        let answer = task.await.unwrap();
        assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
        let seen = bodies[i % world]
            .entry(arrow(i, world))
            .or_insert(answer.body.clone());
        assert_eq!(
            *seen,
            answer.body,
            "rank {} answered differently",
            i % world
        );
    }
    assert_eq!(
        state.metrics().plan_computations,
        2,
        "one more for the evicted plan"
    );

    // Every rank's answer is the plan computed locally.
    let store = LocalFileSystem::new_with_prefix(dir.path()).unwrap();
    let meta = Arc::new(
        open_checkpoint(&store, &Path::from("gpt/step-000100"))
            .await
            .unwrap()
            .meta,
    );
    let local = plan(
        &meta,
        &layout.resolve(meta.tensors()).unwrap(),
        &PlanOptions::default(),
    )
    .unwrap();
    for (rank, by_format) in bodies.iter().enumerate() {
        let want = local.rank_plan(rank as u32).unwrap();
        let json = std::str::from_utf8(&by_format[&false]).unwrap();
        assert_eq!(RankPlan::from_json(json).unwrap(), want);
        assert_eq!(RankPlan::from_arrow_ipc(&by_format[&true]).unwrap(), want);
    }
    let metrics = get(&app, "/metrics").await.text();
    assert_eq!(
        metric(&metrics, "tessera_plan_computations_total"),
        Some(2.0)
    );
    assert_eq!(metric(&metrics, "tessera_metadata_loads_total"), Some(1.0));
}
