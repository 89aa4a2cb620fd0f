//! S3 benchmark (a bench binary: `cargo bench --bench s3`): what a load from an object store
//! transfers, counted at the server.
//!
//! The storage crate's S3 test server (s3s-fs on 127.0.0.1, one process) holds a synthetic
//! checkpoint (gpt-small by default, `TESSERA_BENCH_MODEL=gpt-tiny` for a quick run; optimizer
//! states with `TESSERA_BENCH_OPTIMIZER=1`) saved FSDP over 4 ranks. It is loaded into a column
//! reshard (Megatron tp4: the column-parallel weights are a quarter of every row) and TP2×DP2 by 4
//! ranks over the in-process transport, without verification (so that checksum blocks do not fill
//! the gaps), with three coalescing gaps: 0 (exact ranges), 64 KiB (tessera's object-store
//! default) and 1 MiB (object_store's `get_ranges` default, which tessera used before issue 19).
//! For each: bytes and GETs the server served for the data files, what the report says, seconds.
//!
//! First it measures what a request and a byte cost on this server: many small GETs against one
//! large one, which gives the gap worth one request.
#![allow(missing_docs, clippy::unwrap_used)]

#[path = "support/model.rs"]
mod model;

use std::sync::Arc;
use std::time::Instant;

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, RankReport, load_rank};
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_planner::presets::{MegatronGpt, fsdp, megatron_gpt};
use tessera_planner::{PlanOptions, RankPlan};
use tessera_storage::testing::S3TestServer;
use tessera_synth::{SynthOptions, synthesize};

use model::bench_model;

const URL: &str = "s3://bench/run/step-000001";

/// Seconds per request and per byte of ranged GETs on this server (median of 3 rounds each).
fn request_and_byte_cost(runtime: &tokio::runtime::Runtime, store: Arc<dyn ObjectStore>) {
    let path = Path::from("cost/blob.bin");
    let size: u64 = 64 << 20;
    runtime
        .block_on(store.put(&path, PutPayload::from(vec![7u8; size as usize])))
        .unwrap();
    let small = 4096u64;
    let n = 2000u64;
    let mut per_request = Vec::new();
    let mut per_byte = Vec::new();
    for _ in 0..3 {
        // `n` small GETs one after another (no overlap: the cost of one round trip each).
        let started = Instant::now();
        runtime.block_on(async {
            for i in 0..n {
                let at = (i * 65_536) % (size - small);
                store.get_range(&path, at..at + small).await.unwrap();
            }
        });
        let small_s = started.elapsed().as_secs_f64() / n as f64;
        // One GET of the whole blob: bytes per second of one connection.
        let started = Instant::now();
        runtime.block_on(store.get_range(&path, 0..size)).unwrap();
        let big_s = started.elapsed().as_secs_f64();
        let byte_s = big_s / size as f64;
        per_byte.push(byte_s);
        per_request.push(small_s - small as f64 * byte_s);
    }
    per_request.sort_by(f64::total_cmp);
    per_byte.sort_by(f64::total_cmp);
    let (request, byte) = (per_request[1], per_byte[1]);
    println!(
        "request cost {:.3} ms (median of 3 x {n} sequential 4 KiB GETs, transfer deducted); \
         byte cost {:.3} ns ({:.2} GB/s, one 64 MiB GET); break-even gap {:.0} KiB",
        request * 1e3,
        byte * 1e9,
        1.0 / byte / 1e9,
        request / byte / 1024.0
    );
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let model = bench_model("gpt-small");
    let optimizer = std::env::var("TESSERA_BENCH_OPTIMIZER").is_ok_and(|v| v == "1");
    let layers = model.config().num_layers;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let server = S3TestServer::start(dir.path());
    server.create_bucket("bench");
    let options = server.options();

    request_and_byte_cost(&runtime, server.store("bench"));

    let location = tessera_storage::create_with(URL, &options).unwrap();
    let started = Instant::now();
    let manifest = runtime
        .block_on(synthesize(
            location.store.clone(),
            &location.prefix,
            &location.display,
            &fsdp(4).unwrap(),
            &SynthOptions {
                model,
                optimizer,
                metadata_only: false,
                dist_optimizer: None,
                step: Some(1),
                progress: None,
            },
        ))
        .unwrap();
    let total: u64 = manifest.files.iter().map(|f| f.size).sum();
    println!(
        "model {model} (optimizer states: {optimizer}) saved fsdp dp4 on the S3 test server: \
         {:.3} GB in {} files (synth {:.1} s)",
        total as f64 / 1e9,
        manifest.files.len(),
        started.elapsed().as_secs_f64()
    );
    let checkpoint = runtime
        .block_on(Checkpoint::open(
            tessera_storage::open_with(URL, &options).unwrap(),
        ))
        .unwrap();

    println!(
        "| target | coalesce gap | bytes needed (unique) | bytes served (server) | GETs (server) | \
         bytes transferred (report) | requests (report) | served / needed | seconds |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for (name, tp, dp) in [("column reshard tp4", 4, 1), ("tp2 dp2", 2, 2)] {
        let target = megatron_gpt(MegatronGpt {
            tp,
            pp: 1,
            dp,
            num_layers: layers,
            zero1: false,
        })
        .unwrap();
        let requests = target.resolve(checkpoint.meta.tensors()).unwrap();
        let plan = checkpoint.plan(&requests, &PlanOptions::default()).unwrap();
        let rank_plans: Vec<RankPlan> = (0..4).map(|r| plan.rank_plan(r).unwrap()).collect();
        let unique = plan.summary().unique_bytes_needed;
        for (gap_name, gap) in [
            ("0", 0u64),
            ("64 KiB (default)", 64 << 10),
            ("1 MiB (get_ranges' default)", 1 << 20),
        ] {
            server.reset_served();
            let started = Instant::now();
            let reports: Vec<RankReport> = runtime.block_on(async {
                let transports = InProcTransport::mesh(4, TransportOptions::default());
                let mut tasks = Vec::new();
                for (rank, transport) in transports.into_iter().enumerate() {
                    let checkpoint = checkpoint.clone();
                    let rank_plan = rank_plans[rank].clone();
                    tasks.push(tokio::spawn(async move {
                        let options = LoadOptions {
                            read: ReadOptions {
                                verify: false,
                                coalesce_gap: Some(gap),
                                ..ReadOptions::default()
                            },
                            progress: None,
                            ..LoadOptions::default()
                        };
                        load_rank(&checkpoint, rank_plan, &transport, &options)
                            .await
                            .unwrap()
                            .report
                    }));
                }
                let mut reports = Vec::new();
                for t in tasks {
                    reports.push(t.await.unwrap());
                }
                reports
            });
            let seconds = started.elapsed().as_secs_f64();
            let served = server.served_where(|p| p.contains("/data/"));
            let transferred: u64 = reports.iter().map(|r| r.bytes_transferred).sum();
            let requests: u64 = reports.iter().map(|r| r.requests).sum();
            println!(
                "| {name} | {gap_name} | {unique} | {} | {} | {transferred} | {requests} | {:.2} | {seconds:.2} |",
                served.get_body_bytes,
                served.get_requests,
                served.get_body_bytes as f64 / unique as f64,
            );
        }
    }
}
