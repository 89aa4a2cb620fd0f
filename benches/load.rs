//! Loading benchmark (a bench binary: `cargo bench --bench load`).
//!
//! A synthetic gpt-small checkpoint with optimizer states (about 2.3 GB) saved as FSDP over 4 ranks
//! is loaded at Megatron tp2 dp2 (4 ranks, in-process transport), from page cache. In the same run:
//! (a) reading the same data files sequentially end to end, and (b) the naive approach: every rank
//! reads each saved chunk it overlaps whole and slices what it needs in memory (what DCP's reader
//! does). `TESSERA_BENCH_MODEL=gpt-tiny` runs a small case.
//!
//! Then the same checkpoint loaded by columns (every matrix split over the 4 ranks along dim 1,
//! vectors along dim 0: across the saved row order), verify on, read per request and in storage
//! order (planner `ReadOrder`): requests, bytes fetched and time of each. `TESSERA_BENCH_LOAD`
//! picks the cases (`tp2dp2`, `columns`, comma separated; default both).
#![allow(missing_docs, clippy::unwrap_used)]

#[path = "support/slice.rs"]
mod slice;

#[path = "support/synth_fsdp.rs"]
mod synth_fsdp;

#[path = "support/model.rs"]
mod model;

use std::time::Instant;

use futures::StreamExt;
use object_store::ObjectStoreExt;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::exchange::place::allocate;
use tessera_loader::load::RankReport;
use tessera_loader::load::{LoadOptions, load_rank};
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::InProcTransport;
use tessera_loader::transport::TransportOptions;
use tessera_metadata::row_major_strides;
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_planner::{
    ExplicitRequest, ExplicitRequests, PlanOptions, RankPlan, ReadOrder, RequestSet,
};

use model::bench_model;
use synth_fsdp::synth_fsdp4;

fn gb(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

/// The naive reader for one rank: every saved chunk the rank needs anything from is fetched whole
/// (once per rank), then every piece is sliced out of it in memory. No exchange: each rank reads
/// all it needs itself, as DCP's reader does.
async fn naive_rank(checkpoint: &Checkpoint, plan: &RankPlan) -> u64 {
    let meta = &checkpoint.meta;
    let mut buffers = allocate(plan);
    let by_chunk = slice::pieces_by_chunk(meta, plan);
    let mut fetched = 0u64;
    for (c, pieces) in by_chunk {
        let chunk = &meta.chunks()[c];
        let file = &meta.files()[chunk.bytes.file as usize].path;
        let mut path = checkpoint.location.prefix.clone();
        for part in file.split('/') {
            path = path.join(part);
        }
        let bytes = checkpoint
            .location
            .store
            .get_range(
                &path,
                chunk.bytes.offset..chunk.bytes.offset + chunk.bytes.length,
            )
            .await
            .unwrap();
        fetched += bytes.len() as u64;
        let chunk_strides = row_major_strides(&chunk.region.lengths);
        for i in pieces {
            let p = &plan.pieces[i];
            let esize = plan.tensors[p.tensor as usize].dtype.size();
            let rel = chunk.region.relative_offsets(&p.region);
            let origin: u64 = rel
                .iter()
                .zip(&chunk_strides)
                .map(|(o, s)| o * s)
                .sum::<u64>()
                * esize;
            slice::place_from_chunk(plan, p, &bytes, origin, &chunk_strides, &mut buffers);
        }
    }
    fetched
}

/// Every matrix split over `world` ranks along dim 1 (as `torch.chunk` does), every vector along
/// dim 0, scalars whole.
fn columns(checkpoint: &Checkpoint, world: u64) -> RequestSet {
    let tensors = checkpoint.meta.tensors();
    let ranks = (0..world)
        .map(|r| {
            tensors
                .iter()
                .map(|t| {
                    let mut offsets = vec![0; t.shape.len()];
                    let mut lengths = t.shape.to_vec();
                    if !t.shape.is_empty() {
                        let dim = usize::from(t.shape.len() >= 2);
                        let n = t.shape[dim];
                        let chunk = n.div_ceil(world);
                        offsets[dim] = (r * chunk).min(n);
                        lengths[dim] = ((r + 1) * chunk).min(n) - offsets[dim];
                    }
                    ExplicitRequest::Box {
                        fqn: t.fqn.clone(),
                        offsets,
                        lengths,
                    }
                })
                .collect()
        })
        .collect();
    ExplicitRequests { ranks }.resolve(tensors).unwrap()
}

/// Loads `plans` over in-process ranks with verify on; the reports and the wall time.
fn load_ranks(
    runtime: &tokio::runtime::Runtime,
    checkpoint: &Checkpoint,
    plans: &[RankPlan],
) -> (Vec<RankReport>, f64) {
    runtime.block_on(async {
        let transports = InProcTransport::mesh(plans.len() as u32, TransportOptions::default());
        let started = Instant::now();
        let mut tasks = Vec::new();
        for (plan, transport) in plans.iter().cloned().zip(transports) {
            let checkpoint = checkpoint.clone();
            tasks.push(tokio::spawn(async move {
                let options = LoadOptions::default();
                load_rank(&checkpoint, plan, &transport, &options)
                    .await
                    .unwrap()
                    .report
            }));
        }
        let mut reports = Vec::new();
        for t in tasks {
            reports.push(t.await.unwrap());
        }
        (reports, started.elapsed().as_secs_f64())
    })
}

/// The column case: per request vs storage order, verify on, 3 runs each.
fn columns_case(runtime: &tokio::runtime::Runtime, checkpoint: &Checkpoint) {
    let requests = columns(checkpoint, 4);
    println!(
        "| run | read order | requests | bytes fetched | io amplification | bytes exchanged | seconds |"
    );
    println!("|---|---|---|---|---|---|---|");
    let orders = [ReadOrder::Request, ReadOrder::Storage, ReadOrder::Auto];
    let plans: Vec<Vec<RankPlan>> = orders
        .iter()
        .map(|&read_order| {
            let options = PlanOptions {
                read_order,
                ..PlanOptions::default()
            };
            let plan = checkpoint.plan(&requests, &options).unwrap();
            (0..4).map(|r| plan.rank_plan(r).unwrap()).collect()
        })
        .collect();
    for run in 1..=3 {
        for (order, plans) in orders.iter().zip(&plans) {
            let (reports, s) = load_ranks(runtime, checkpoint, plans);
            let sum = |f: fn(&RankReport) -> u64| reports.iter().map(f).sum::<u64>();
            let (read, fetched) = (sum(|r| r.bytes_read), sum(|r| r.bytes_fetched));
            println!(
                "| {run} | {order:?} | {} | {fetched} | {:.3} | {} | {s:.3} |",
                sum(|r| r.requests),
                fetched as f64 / read as f64,
                sum(|r| r.bytes_sent),
            );
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let cases = std::env::var("TESSERA_BENCH_LOAD").unwrap_or_else(|_| "tp2dp2,columns".into());
    let model = bench_model("gpt-small");
    let layers = model.config().num_layers;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let bench = synth_fsdp4(&runtime, model);
    let total = bench.bytes;
    println!(
        "model {model} with optimizer states saved fsdp dp4: {:.2} GB in {} files (synth {:.1} s)",
        total as f64 / 1e9,
        bench.manifest.files.len(),
        bench.synth_seconds
    );
    let checkpoint = &bench.checkpoint;
    // Warm the page cache for the column case too (the tp2dp2 case reads every file first).
    let warm = checkpoint
        .plan(&columns(checkpoint, 4), &PlanOptions::default())
        .unwrap();
    let warm: Vec<RankPlan> = (0..4).map(|r| warm.rank_plan(r).unwrap()).collect();
    let _ = load_ranks(&runtime, checkpoint, &warm);
    if cases.split(',').any(|c| c == "columns") {
        columns_case(&runtime, checkpoint);
    }
    if !cases.split(',').any(|c| c == "tp2dp2") {
        return;
    }
    let target = megatron_gpt(MegatronGpt {
        tp: 2,
        pp: 1,
        dp: 2,
        num_layers: layers,
        zero1: false,
    })
    .unwrap();
    let requests = target.resolve(checkpoint.meta.tensors()).unwrap();
    let plan = checkpoint.plan(&requests, &PlanOptions::default()).unwrap();
    let rank_plans: Vec<RankPlan> = (0..4).map(|r| plan.rank_plan(r).unwrap()).collect();

    // (a) Sequential: every data file read end to end, 4 files at a time.
    let sequential =
        || {
            runtime.block_on(async {
                let started = Instant::now();
                let bytes: u64 =
                    futures::stream::iter(bench.manifest.files.iter().map(|f| {
                        let store = checkpoint.location.store.clone();
                        let path = checkpoint
                            .location
                            .prefix
                            .clone()
                            .join("data")
                            .join(f.path.trim_start_matches("data/"));
                        async move {
                            store.get(&path).await.unwrap().bytes().await.unwrap().len() as u64
                        }
                    }))
                    .buffer_unordered(4)
                    .fold(0u64, |a, b| async move { a + b })
                    .await;
                (bytes, started.elapsed().as_secs_f64())
            })
        };
    let _ = sequential(); // warm the page cache
    let load = |verify: bool| {
        runtime.block_on(async {
            let transports = InProcTransport::mesh(4, TransportOptions::default());
            let started = Instant::now();
            let mut tasks = Vec::new();
            for (rank, transport) in transports.into_iter().enumerate() {
                let checkpoint = checkpoint.clone();
                let rank_plan = rank_plans[rank].clone();
                tasks.push(tokio::spawn(async move {
                    let options = LoadOptions {
                        read: ReadOptions {
                            verify,
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
            (reports, started.elapsed().as_secs_f64())
        })
    };
    let naive = || {
        runtime.block_on(async {
            let started = Instant::now();
            let mut tasks = Vec::new();
            for rank_plan in &rank_plans {
                let checkpoint = checkpoint.clone();
                let rank_plan = rank_plan.clone();
                tasks.push(tokio::spawn(async move {
                    naive_rank(&checkpoint, &rank_plan).await
                }));
            }
            let mut fetched = 0;
            for t in tasks {
                fetched += t.await.unwrap();
            }
            (fetched, started.elapsed().as_secs_f64())
        })
    };
    let needed = plan.summary().bytes_needed;
    let unique = plan.summary().unique_bytes_needed;
    println!(
        "plan: {} needed over 4 ranks, {} unique, {} exchanged",
        needed,
        unique,
        plan.summary().bytes_exchanged
    );
    // Effective throughput = the checkpoint's unique bytes delivered per second (what the
    // sequential read delivers too); ratios are within one run.
    println!(
        "| run | approach | bytes from storage | seconds | effective GB/s | vs sequential | speed vs naive |"
    );
    println!("|---|---|---|---|---|---|---|");
    for run in 1..=3 {
        let (seq_bytes, seq_s) = sequential();
        let (naive_fetched, naive_s) = naive();
        let seq_rate = gb(seq_bytes, seq_s);
        println!(
            "| {run} | sequential read of all files | {seq_bytes} | {seq_s:.3} | {seq_rate:.2} | 1.00 | |"
        );
        for verify in [true, false] {
            let (reports, s) = load(verify);
            let read: u64 = reports.iter().map(|r| r.bytes_read).sum();
            let fetched: u64 = reports.iter().map(|r| r.bytes_fetched).sum();
            println!(
                "| {run} | tessera load, verify {verify} | {fetched} (read {read}, amplification {:.4}) | {s:.3} | {:.2} | {:.2} | {:.2}x |",
                read as f64 / unique as f64,
                gb(unique, s),
                gb(unique, s) / seq_rate,
                naive_s / s
            );
        }
        println!(
            "| {run} | naive whole-chunk reads | {naive_fetched} | {naive_s:.3} | {:.2} | {:.2} | 1.00x |",
            gb(unique, naive_s),
            gb(unique, naive_s) / seq_rate
        );
    }
}
