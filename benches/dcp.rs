//! DCP loading benchmark (a bench binary: `cargo bench --bench dcp`).
//!
//! A synthetic gpt-small checkpoint with optimizer states (about 2.3 GB) is written in PyTorch
//! DCP's byte format (`.metadata` pickle + `__<rank>_0.distcp` files of `torch.save` zips, by the
//! test-only writer in `support/dcp_writer.rs`) as saved by FSDP over 4 ranks, then loaded at
//! Megatron tp2 dp2 (4 ranks, in-process transport), from page cache. In the same run, the
//! whole-blob approach of torch's `FileSystemReader`: every rank reads each `torch.save` blob it
//! needs anything from whole (once per rank), takes the zip apart in memory and slices what it
//! needs. `TESSERA_BENCH_MODEL=gpt-tiny` runs a small case.
//!
//! `TESSERA_BENCH_STORE_MBPS=1000` puts every rank behind its own storage link of that many MB/s
//! (`tessera_storage::testing::ThrottledStore`, for both approaches): storage-bound, as on a
//! network file system or an object store, where the bytes each approach reads set its time. The
//! storage limit printed is the unique bytes over the ranks' links together.
#![allow(missing_docs, clippy::unwrap_used)]

#[path = "support/slice.rs"]
mod slice;

#[path = "support/dcp_writer.rs"]
mod dcp_writer;

#[path = "support/model.rs"]
mod model;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use object_store::ObjectStoreExt;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::exchange::place::allocate;
use tessera_loader::load::{LoadOptions, load_rank};
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_metadata::formats::torch::blob::parse_tensor_blob;
use tessera_metadata::formats::torch::zip::Segments;
use tessera_planner::presets::{MegatronGpt, fsdp, megatron_gpt};
use tessera_planner::{PlanOptions, RankPlan, Target, assign_writers};
use tessera_storage::testing::ThrottledStore;
use tessera_synth as synth;

use dcp_writer::BlobExtent;

use model::bench_model;

fn gb(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

type Blobs = Arc<HashMap<(String, Vec<u64>), BlobExtent>>;

/// The per-rank storage link of `TESSERA_BENCH_STORE_MBPS`, in bytes per second.
fn store_link() -> Option<u64> {
    let mbps: f64 = std::env::var("TESSERA_BENCH_STORE_MBPS")
        .ok()?
        .parse()
        .unwrap();
    Some((mbps * 1e6) as u64)
}

/// The checkpoint as one rank sees it: behind its own throttled link when one is set (every read
/// through the store then; no positioned reads from the files).
fn rank_checkpoint(checkpoint: &Checkpoint, link: Option<u64>) -> Checkpoint {
    let mut checkpoint = checkpoint.clone();
    if let Some(bytes_per_second) = link {
        checkpoint.location.store = Arc::new(ThrottledStore::new(
            Arc::clone(&checkpoint.location.store),
            bytes_per_second,
        ));
        checkpoint.location.local_root = None;
    }
    checkpoint
}

/// The whole-blob reader for one rank: every saved chunk the rank needs anything from is fetched
/// as its whole `torch.save` zip (once per rank), the zip is taken apart in memory (as
/// `torch.load` does), then every piece is sliced out of the storage. No exchange.
async fn whole_blob_rank(
    checkpoint: &Checkpoint,
    blobs: &Blobs,
    plan: &RankPlan,
) -> (u64, Vec<Vec<u8>>) {
    let meta = &checkpoint.meta;
    let mut buffers = allocate(plan);
    let by_chunk = slice::pieces_by_chunk(meta, plan);
    let mut fetched = 0u64;
    for (c, pieces) in by_chunk {
        let chunk = &meta.chunks()[c];
        let fqn = &meta.tensors()[chunk.tensor as usize].fqn;
        let extent = &blobs[&(fqn.clone(), chunk.region.offsets.to_vec())];
        let path = checkpoint
            .location
            .prefix
            .clone()
            .join(extent.file.as_str());
        let bytes = checkpoint
            .location
            .store
            .get_range(&path, extent.offset..extent.offset + extent.length)
            .await
            .unwrap();
        fetched += bytes.len() as u64;
        let blob = parse_tensor_blob(&Segments::whole(bytes.clone())).unwrap();
        let storage =
            &bytes[blob.data_offset as usize..(blob.data_offset + blob.data_len) as usize];
        let chunk_strides = blob.stride.clone();
        for i in pieces {
            let p = &plan.pieces[i];
            let esize = plan.tensors[p.tensor as usize].dtype.size();
            let rel = chunk.region.relative_offsets(&p.region);
            let origin: u64 = (blob.storage_offset
                + rel
                    .iter()
                    .zip(&chunk_strides)
                    .map(|(o, s)| o * s)
                    .sum::<u64>())
                * esize;
            slice::place_from_chunk(plan, p, storage, origin, &chunk_strides, &mut buffers);
        }
    }
    (fetched, buffers)
}

/// Checks every destination buffer of a rank against the formula.
fn check_rank(plan: &RankPlan, buffers: &[Vec<u8>]) {
    for (dest, buffer) in plan.destinations.iter().zip(buffers) {
        let tensor = &plan.tensors[dest.tensor as usize];
        match &dest.target {
            Target::Box(region) => synth::check_box(tensor, region, buffer).unwrap(),
            Target::Flat { start, end } => synth::check_flat(tensor, *start, *end, buffer).unwrap(),
        }
    }
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let model = bench_model("gpt-small");
    let layers = model.config().num_layers;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = dir.path().join("dcp/step-1");

    // Save: fsdp dp4, every distinct box written once, as DCP.
    let tensors = synth::tensors(&model.config(), true);
    let holdings = fsdp(4).unwrap().resolve(&tensors).unwrap();
    let writes = assign_writers(&tensors, &holdings).unwrap();
    let started = Instant::now();
    let written = dcp_writer::write_dcp(&ckpt_dir, &tensors, &writes).unwrap();
    let total: u64 = written.files.iter().map(|(_, s)| s).sum();
    println!(
        "model {model} with optimizer states saved fsdp dp4 as DCP: {:.2} GB in {} files, {} blobs, .metadata {} bytes (write {:.1} s)",
        total as f64 / 1e9,
        written.files.len(),
        written.blobs.len(),
        written.metadata_bytes,
        started.elapsed().as_secs_f64()
    );
    let blobs: Blobs = Arc::new(written.blobs);

    let location = tessera_storage::open(&ckpt_dir.display().to_string()).unwrap();
    let started = Instant::now();
    let checkpoint = runtime.block_on(Checkpoint::open(location)).unwrap();
    let open_s = started.elapsed().as_secs_f64();
    let index = checkpoint.index.clone().unwrap();
    println!(
        "open ({:?}): {:.3} s; .metadata {} bytes, zip-header index of {} blobs: {} requests, {} bytes",
        checkpoint.format,
        open_s,
        index.metadata_bytes,
        index.blobs,
        index.requests,
        index.bytes_read
    );
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

    let link = store_link();
    let load = |keep_rank0: bool| {
        runtime.block_on(async {
            let transports = InProcTransport::mesh(4, TransportOptions::default());
            let started = Instant::now();
            let mut tasks = Vec::new();
            for (rank, transport) in transports.into_iter().enumerate() {
                let checkpoint = rank_checkpoint(&checkpoint, link);
                let rank_plan = rank_plans[rank].clone();
                tasks.push(tokio::spawn(async move {
                    let loaded =
                        load_rank(&checkpoint, rank_plan, &transport, &LoadOptions::default())
                            .await
                            .unwrap();
                    let buffers = (keep_rank0 && rank == 0).then_some(loaded.buffers);
                    (loaded.report, buffers)
                }));
            }
            let mut reports = Vec::new();
            let mut rank0 = None;
            for t in tasks {
                let (report, buffers) = t.await.unwrap();
                reports.push(report);
                rank0 = rank0.or(buffers);
            }
            (reports, rank0, started.elapsed().as_secs_f64())
        })
    };
    let whole_blob = |keep_rank0: bool| {
        runtime.block_on(async {
            let started = Instant::now();
            let mut tasks = Vec::new();
            for (rank, rank_plan) in rank_plans.iter().enumerate() {
                let checkpoint = rank_checkpoint(&checkpoint, link);
                let rank_plan = rank_plan.clone();
                let blobs = Arc::clone(&blobs);
                tasks.push(tokio::spawn(async move {
                    let (fetched, buffers) = whole_blob_rank(&checkpoint, &blobs, &rank_plan).await;
                    (fetched, (keep_rank0 && rank == 0).then_some(buffers))
                }));
            }
            let mut fetched = 0;
            let mut rank0 = None;
            for t in tasks {
                let (f, buffers) = t.await.unwrap();
                fetched += f;
                rank0 = rank0.or(buffers);
            }
            (fetched, rank0, started.elapsed().as_secs_f64())
        })
    };

    // Correctness first (this also warms the page cache).
    let (_, buffers, _) = load(true);
    check_rank(&rank_plans[0], &buffers.unwrap());
    let (_, buffers, _) = whole_blob(true);
    check_rank(&rank_plans[0], &buffers.unwrap());
    println!("rank 0's buffers match the formula (tessera load and whole-blob)");

    let needed = plan.summary().bytes_needed;
    let unique = plan.summary().unique_bytes_needed;
    println!(
        "plan: {needed} needed over 4 ranks, {unique} unique, {} exchanged",
        plan.summary().bytes_exchanged
    );
    // With a link per rank, the fastest any approach can go: the unique bytes over all links.
    let limit_s = link.map(|bps| unique as f64 / (4.0 * bps as f64));
    if let (Some(bps), Some(limit)) = (link, limit_s) {
        println!(
            "storage: each rank behind its own {:.0} MB/s link; limit {limit:.3} s (unique bytes over 4 links)",
            bps as f64 / 1e6
        );
    }
    let of_limit = |s: f64| limit_s.map_or(String::new(), |l| format!(" {:.2} |", l / s));
    println!(
        "| run | approach | bytes from storage | seconds | effective GB/s | speed vs whole-blob |{}",
        if link.is_some() {
            " of the storage limit |"
        } else {
            ""
        }
    );
    println!(
        "|---|---|---|---|---|---|{}",
        if link.is_some() { "---|" } else { "" }
    );
    for run in 1..=3 {
        let (blob_fetched, _, blob_s) = whole_blob(false);
        let (reports, _, s) = load(false);
        let read: u64 = reports.iter().map(|r| r.bytes_read).sum();
        let fetched: u64 = reports.iter().map(|r| r.bytes_fetched).sum();
        let requests: u64 = reports.iter().map(|r| r.requests).sum();
        // Where the time went: every rank's reads, and what came after its last read.
        let phases: Vec<String> = reports
            .iter()
            .map(|r| format!("{:.2}+{:.2}", r.read_seconds, r.exchange_seconds))
            .collect();
        eprintln!("run {run}: per rank read+after s: {}", phases.join(" "));
        println!(
            "| {run} | tessera load | {fetched} (read {read} in {requests} requests, amplification {:.4}) | {s:.3} | {:.2} | {:.2}x |{}",
            read as f64 / unique as f64,
            gb(unique, s),
            blob_s / s,
            of_limit(s)
        );
        println!(
            "| {run} | whole-blob reads (torch FileSystemReader-style) | {blob_fetched} (amplification {:.4}) | {blob_s:.3} | {:.2} | 1.00x |{}",
            blob_fetched as f64 / unique as f64,
            gb(unique, blob_s),
            of_limit(blob_s)
        );
    }
}
