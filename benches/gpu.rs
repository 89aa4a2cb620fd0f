//! GPU loading benchmark (`cargo bench --bench gpu --features cuda`, or `make bench-gpu`). Needs
//! a CUDA GPU; elsewhere it prints why it skips and exits 0. In one run, on `cuda:0`:
//!
//! 1. Host-to-device: N bytes (`TESSERA_BENCH_H2D_MB`, default 2048 MB) copied by one plain
//!    `cuMemcpyHtoDAsync` from a pinned buffer (the baseline), and the same bytes from ordinary
//!    pageable memory through the loader's pinned staging pool, for a few pool shapes. The ratio
//!    of staged to plain GB/s is the staging efficiency (goal: at least 0.90 for the default).
//! 2. End to end: a synthetic gpt-small checkpoint with optimizer states (about 2.3 GB, saved as
//!    FSDP over 4 ranks; `TESSERA_BENCH_MODEL` picks another model) loaded from page cache into
//!    GPU memory as whole tensors (one rank): GB/s of destination bytes per second of load
//!    (verified reads, placement, staged upload), checked byte for byte afterwards.
//!
//! `benches/torch_dcp_load.py` times PyTorch's `dcp.load` of the same checkpoint into CUDA
//! tensors for the comparison in BENCHMARKS.md.
#![allow(missing_docs, clippy::unwrap_used)]

#[path = "support/synth_fsdp.rs"]
mod synth_fsdp;

#[path = "support/model.rs"]
mod model;

use std::time::Instant;

use tessera_loader::device::cuda::CudaDevice;
use tessera_loader::device::load::{OnHost, load_rank_to_device};
use tessera_loader::device::staging::{StagingOptions, Upload};
use tessera_loader::load::LoadOptions;
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_planner::presets::fsdp;
use tessera_planner::{PlanOptions, Target};
use tessera_synth as synth;

use model::bench_model;
use synth_fsdp::synth_fsdp4;

fn gb(bytes: u64, seconds: f64) -> f64 {
    bytes as f64 / seconds / 1e9
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let device = match CudaDevice::count() {
        Ok(n) if n > 0 => CudaDevice::open(0).unwrap(),
        Ok(_) => {
            println!("skipped: no CUDA device is visible");
            return;
        }
        Err(e) => {
            println!("skipped: {e}");
            return;
        }
    };
    println!("device cuda:0: {}", device.name());
    h2d(&device);
    end_to_end(&device);
}

/// Plain pinned copy against staged copies of the same bytes.
fn h2d(device: &CudaDevice) {
    let mb: usize = std::env::var("TESSERA_BENCH_H2D_MB")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(2048);
    let n = mb * 1_000_000;
    // Pageable, touched (as the loader's host buffers are after reading).
    let source: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(31)).collect();
    let target = device.alloc(n).unwrap();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let default = StagingOptions::default();
    let mut shapes = vec![default.clone()];
    for lanes in [1, 2, 4, 8] {
        if lanes <= cores && lanes != default.lanes {
            shapes.push(StagingOptions {
                lanes,
                ..default.clone()
            });
        }
    }
    for chunk_mb in [4, 16] {
        shapes.push(StagingOptions {
            chunk_bytes: chunk_mb << 20,
            ..default.clone()
        });
    }
    println!();
    println!("host to device, {} MB, {cores} cores", n / 1_000_000);
    println!("| run | copy | pinned memory | seconds | GB/s | vs plain pinned |");
    println!("|---|---|---|---|---|---|");
    for run in 1..=3 {
        let plain = device.plain_pinned_upload(&source, &target).unwrap();
        let plain_rate = gb(n as u64, plain);
        println!(
            "| {run} | plain cuMemcpyHtoDAsync from pinned | {} MB | {plain:.3} | {plain_rate:.2} | 1.00 |",
            n / 1_000_000
        );
        for shape in &shapes {
            let mut pool = device.staging(shape.clone()).unwrap();
            let stats = pool
                .upload(&[Upload {
                    source: &source,
                    target: &target,
                    offset: 0,
                }])
                .unwrap();
            println!(
                "| {run} | staged from pageable, {} lanes × {} × {} MiB{} | {} MiB | {:.3} | {:.2} | {:.2} |",
                shape.lanes,
                shape.buffers,
                shape.chunk_bytes >> 20,
                if *shape == default { " (default)" } else { "" },
                shape.pinned_bytes() >> 20,
                stats.seconds,
                stats.gb_per_s(),
                stats.gb_per_s() / plain_rate
            );
        }
    }
    let back = device.to_host(&target).unwrap();
    assert!(back == source, "the staged bytes on the device differ");
}

/// A synthetic checkpoint from page cache into GPU memory, whole tensors on one rank.
fn end_to_end(device: &CudaDevice) {
    let model = bench_model("gpt-small");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let bench = synth_fsdp4(&runtime, model);
    let total = bench.bytes;
    let checkpoint = &bench.checkpoint;
    let requests = fsdp(1).unwrap().resolve(checkpoint.meta.tensors()).unwrap();
    let plan = checkpoint
        .plan(&requests, &PlanOptions::default())
        .unwrap()
        .rank_plan(0)
        .unwrap();
    let needed = plan.summary.bytes_needed;
    println!();
    println!(
        "end to end: {model} with optimizer states, {:.2} GB in {} files (fsdp dp4), into {} as whole tensors",
        total as f64 / 1e9,
        bench.manifest.files.len(),
        device.label()
    );
    println!("| run | verify | seconds | read s | h2d s | h2d GB/s | end-to-end GB/s |");
    println!("|---|---|---|---|---|---|---|");
    let transport = OnHost(InProcTransport::mesh(1, TransportOptions::default()).remove(0));
    let mut pool = device.staging(StagingOptions::default()).unwrap();
    let mut buffers = device.alloc_destinations(&plan).unwrap();
    // Run 0 warms the page cache and is not reported.
    for run in 0..=3 {
        for verify in [true, false] {
            let options = LoadOptions {
                read: ReadOptions {
                    verify,
                    ..ReadOptions::default()
                },
                progress: None,
                ..LoadOptions::default()
            };
            let started = Instant::now();
            let loaded = runtime
                .block_on(load_rank_to_device(
                    checkpoint,
                    plan.clone(),
                    &transport,
                    &mut pool,
                    buffers,
                    &options,
                ))
                .unwrap();
            let seconds = started.elapsed().as_secs_f64();
            buffers = loaded.buffers;
            let report = loaded.report;
            if run > 0 {
                println!(
                    "| {run} | {verify} | {seconds:.3} | {:.3} | {:.3} | {:.2} | {:.2} |",
                    report.read_seconds,
                    report.h2d_seconds,
                    gb(report.h2d_bytes, report.h2d_seconds),
                    gb(needed, seconds)
                );
            }
        }
    }
    // Every byte on the device, against the formula.
    for (dest, buffer) in plan.destinations.iter().zip(&buffers) {
        let tensor = &plan.tensors[dest.tensor as usize];
        let bytes = device.to_host(buffer).unwrap();
        match &dest.target {
            Target::Box(region) => synth::check_box(tensor, region, &bytes).unwrap(),
            Target::Flat { start, end } => synth::check_flat(tensor, *start, *end, &bytes).unwrap(),
        }
    }
    println!("checked: every byte in GPU memory matches the synthetic formula");
}
