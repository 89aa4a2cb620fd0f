//! Plan server benchmark (a bench binary: `cargo bench --bench server`).
//!
//! A catalog holding Llama 3 405B (metadata only, with optimizer states) saved by
//! `megatron-gpt --tp 8 --pp 16 --dp 64 --num-layers 126 --zero1` is served on 127.0.0.1; a plan
//! for `--tp 8 --pp 8 --dp 32 --zero1` (2048 ranks) is requested cold (metadata load + planning)
//! and warm, then rank plans are fetched as a job start would: latency p50/p99 one at a time, and
//! requests/s with 64 concurrent clients, in JSON and Arrow IPC. All traffic stays on loopback and
//! is bounded. `TESSERA_BENCH_MODEL=llama3-8b` runs a smaller case.
#![allow(missing_docs, clippy::unwrap_used)]

#[path = "support/model.rs"]
mod model;

use std::time::{Duration, Instant};

use futures::StreamExt;
use tessera_loader::plan_client::{PlanClient, PlanClientOptions, PlanTarget};
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_server::{AppState, ServerConfig, serve};
use tessera_synth::{SynthOptions, synthesize};

use model::bench_model;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let model = bench_model("llama3-405b");
    let layers = model.config().num_layers;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("catalog");
    let ckpt = root.join("llama/step-000001").display().to_string();
    let location = tessera_storage::create(&ckpt).unwrap();
    let saved = megatron_gpt(MegatronGpt {
        tp: 8,
        pp: 16,
        dp: 64,
        num_layers: layers,
        zero1: true,
    })
    .unwrap();
    runtime
        .block_on(synthesize(
            location.store.clone(),
            &location.prefix,
            &location.display,
            &saved,
            &SynthOptions {
                model,
                optimizer: true,
                metadata_only: true,
                dist_optimizer: None,
                step: Some(1),
                progress: None,
            },
        ))
        .unwrap();
    let target = megatron_gpt(MegatronGpt {
        tp: 8,
        pp: 8,
        dp: 32,
        num_layers: layers,
        zero1: true,
    })
    .unwrap();
    println!(
        "model {model}: saved megatron tp8 pp16 dp64 zero1 (metadata only), target tp8 pp8 dp32 zero1"
    );

    runtime.block_on(async {
        let state = AppState::new(ServerConfig::new(root.display().to_string())).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve(listener, state.clone(), async move {
            let _ = stop_rx.await;
        }));
        let client = PlanClient::new(&format!("http://{addr}"), PlanClientOptions::default()).unwrap();
        let plan_target = PlanTarget::Layout(target.clone());

        let started = Instant::now();
        let created = client.create_plan("llama/step-000001", &plan_target).await.unwrap();
        let cold = started.elapsed().as_secs_f64();
        let started = Instant::now();
        let again = client.create_plan("llama/step-000001", &plan_target).await.unwrap();
        let warm = started.elapsed().as_secs_f64();
        assert_eq!(created.plan, again.plan);
        println!(
            "POST /v1/plans: cold {cold:.3} s (metadata load + plan of {} ranks), warm {:.2} ms",
            created.world,
            warm * 1e3
        );

        let world = created.world;
        let http = reqwest::Client::new();
        let url = |rank: u32| format!("http://{addr}/v1/plans/{}/ranks/{rank}", created.plan);
        for (name, accept) in [("JSON", "application/json"), ("Arrow IPC", tessera_server::ARROW_STREAM)] {
            // One at a time: latency.
            let mut latencies = Vec::new();
            let mut bytes = 0usize;
            for i in 0..256u32 {
                let rank = (i * 8 + 3) % world;
                let t = Instant::now();
                let body = http.get(url(rank)).header("accept", accept).send().await.unwrap().bytes().await.unwrap();
                latencies.push(t.elapsed().as_secs_f64() * 1e3);
                bytes += body.len();
            }
            latencies.sort_by(f64::total_cmp);
            // 64 clients at once over all ranks: throughput.
            let t = Instant::now();
            let done: usize = futures::stream::iter(0..world)
                .map(|rank| {
                    let http = http.clone();
                    let u = url(rank);
                    async move { http.get(u).header("accept", accept).send().await.unwrap().bytes().await.unwrap().len() }
                })
                .buffer_unordered(64)
                .count()
                .await;
            let rps = done as f64 / t.elapsed().as_secs_f64();
            println!(
                "GET rank plan ({name}, warm): p50 {:.2} ms, p99 {:.2} ms over 256 ranks (mean {:.0} KiB); {rps:.0} requests/s with 64 clients over all {world} ranks",
                percentile(&latencies, 0.5),
                percentile(&latencies, 0.99),
                bytes as f64 / 256.0 / 1024.0
            );
        }
        let metrics = state.metrics();
        println!("plan computations: {:?}", metrics);
        let _ = stop_tx.send(());
        let _ = tokio::time::timeout(Duration::from_secs(15), server).await;
    });
}
