//! Whole-cluster planning benchmark (a bench binary, run with `cargo bench --bench plan`).
//!
//! Llama 3 405B with optimizer states, saved by `megatron-gpt --tp 8 --pp 16 --dp 64
//! --num-layers 126 --zero1` (metadata only), planned for `--tp 8 --pp 8 --dp 32 --zero1` and for
//! `--tp 4 --pp 4 --dp 8`. Reports metadata write/load time and size, whole-cluster plan time and
//! peak memory, per-rank plan extraction, and the all-pairs intersection baseline measured in the
//! same run. `TESSERA_BENCH_MODEL=llama3-8b` (with `TESSERA_BENCH_LAYERS=32`) runs a smaller case.
//!
//! `TESSERA_BENCH_OPTIMIZER` picks how the saved checkpoint holds its optimizer states, a comma
//! separated list run one after the other: `zero1` (default: box-shaped DP shards, `--zero1`) and
//! `flat` (Megatron's distributed optimizer, `synth --dist-optimizer-flat`: the layout without
//! `--zero1`, each DP rank saving flat ranges of the TP-local boxes).
#![allow(missing_docs, clippy::unwrap_used)]

#[path = "support/heap.rs"]
mod heap;
#[path = "support/model.rs"]
mod model;

use std::sync::Arc;
use std::time::Instant;

use object_store::local::LocalFileSystem;
use object_store::path::Path;
use tessera_metadata::formats::native::open_checkpoint;
use tessera_planner::baseline::all_pairs_read_items;
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_planner::{PlanOptions, plan};
use tessera_storage::Location;
use tessera_synth::{SynthOptions, synthesize};

use model::bench_model;

fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let model = bench_model("llama3-405b");
    let variants = std::env::var("TESSERA_BENCH_OPTIMIZER").unwrap_or_else(|_| "zero1".to_string());
    for variant in variants.split(',') {
        let flat = match variant.trim() {
            "zero1" => false,
            "flat" => true,
            other => panic!("TESSERA_BENCH_OPTIMIZER: unknown {other:?} (zero1, flat)"),
        };
        run(model, flat);
    }
}

/// Saves the checkpoint (optimizer states box-shaped `--zero1`, or `flat` as Megatron's
/// distributed optimizer) and plans it into the target layouts.
fn run(model: tessera_synth::Model, flat: bool) {
    let layers = model.config().num_layers;
    let saved = MegatronGpt {
        tp: 8,
        pp: 16,
        dp: 64,
        num_layers: layers,
        zero1: !flat,
    };
    let targets = [
        MegatronGpt {
            tp: 8,
            pp: 8,
            dp: 32,
            num_layers: layers,
            zero1: true,
        },
        MegatronGpt {
            tp: 4,
            pp: 4,
            dp: 8,
            num_layers: layers,
            zero1: false,
        },
    ];
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let location = Location {
        store: Arc::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap()),
        prefix: Path::from("ckpt"),
        display: "bench".to_string(),
        local_root: None,
        shared_files: Default::default(),
    };

    println!(
        "\n=== model {model}: saved megatron tp8 pp16 dp64 {}, metadata only",
        if flat {
            "with --dist-optimizer-flat (flat-range optimizer states)"
        } else {
            "zero1 (box-shaped optimizer states)"
        }
    );
    let started = Instant::now();
    let manifest = runtime
        .block_on(synthesize(
            location.store.clone(),
            &location.prefix,
            &location.display,
            &megatron_gpt(saved).unwrap(),
            &SynthOptions {
                model,
                optimizer: true,
                metadata_only: true,
                dist_optimizer: flat.then(|| "dp".to_string()),
                step: Some(1),
                progress: None,
            },
        ))
        .unwrap();
    println!(
        "synth (metadata only): {:.2} s; {} tensors, {} saved boxes, metadata.arrow {:.1} MiB",
        started.elapsed().as_secs_f64(),
        manifest.tensors,
        manifest.chunks,
        manifest.metadata.size as f64 / (1 << 20) as f64
    );

    let base = heap::reset_peak();
    let started = Instant::now();
    let checkpoint = runtime
        .block_on(open_checkpoint(location.store.as_ref(), &location.prefix))
        .unwrap();
    let load_s = started.elapsed().as_secs_f64();
    let meta = Arc::new(checkpoint.meta);
    println!(
        "metadata load (read + crc + decode + validate): {load_s:.2} s, peak heap {:.2} GiB, resident {:.2} GiB",
        gib(heap::peak_since(base)),
        gib(heap::live() - base)
    );

    for target in targets {
        let name = format!(
            "tp{} pp{} dp{}{}",
            target.tp,
            target.pp,
            target.dp,
            if target.zero1 { " zero1" } else { "" }
        );
        let layout = megatron_gpt(target).unwrap();
        let base = heap::reset_peak();
        let started = Instant::now();
        let requests = layout.resolve(meta.tensors()).unwrap();
        let resolve_s = started.elapsed().as_secs_f64();
        let p = plan(&meta, &requests, &PlanOptions::default()).unwrap();
        let total_s = started.elapsed().as_secs_f64();
        let peak = heap::peak_since(base);
        let s = p.summary().clone();
        if std::env::var_os("TESSERA_BENCH_PLAN_ONLY").is_some() {
            println!("target {name}: plan {total_s:.3} s");
            continue;
        }

        let world = p.world_size();
        let sample: Vec<u32> = (0..64).map(|i| (i * world / 64).min(world - 1)).collect();
        let mut extract = Vec::new();
        let mut json_bytes = 0;
        let mut arrow_bytes = 0;
        for &r in &sample {
            let t = Instant::now();
            let rp = p.rank_plan(r).unwrap();
            extract.push(t.elapsed().as_secs_f64());
            json_bytes += rp.to_json().len();
            arrow_bytes += rp.to_arrow_ipc().unwrap().len();
        }
        extract.sort_by(f64::total_cmp);
        let mean = extract.iter().sum::<f64>() / extract.len() as f64;

        drop(p);
        let base = heap::reset_peak();
        let started = Instant::now();
        let items = all_pairs_read_items(&meta, &requests);
        let baseline_s = started.elapsed().as_secs_f64();
        let baseline_peak = heap::peak_since(base);
        let pairs: usize = items.iter().map(Vec::len).sum();
        drop(items);

        println!("\ntarget {name}: {world} ranks");
        println!("  resolve layout      {resolve_s:.3} s");
        println!(
            "  whole-cluster plan  {total_s:.3} s (incl. resolve), peak heap {:.2} GiB",
            gib(peak)
        );
        println!(
            "  pieces {} | groups {} | bytes read {:.1} GiB | amplification {:.4} | exchanged {:.1} GiB | max/mean read per rank {:.2}/{:.2} GiB",
            s.pieces,
            s.exchange_groups,
            gib(s.bytes_read),
            s.read_amplification,
            gib(s.bytes_exchanged),
            gib(s.max_read_per_rank),
            s.mean_read_per_rank / (1u64 << 30) as f64
        );
        println!(
            "  rank plan extraction: mean {:.2} ms, max {:.2} ms over {} ranks; JSON {:.0} KiB, Arrow {:.0} KiB per rank (mean)",
            mean * 1e3,
            extract.last().unwrap() * 1e3,
            sample.len(),
            json_bytes as f64 / sample.len() as f64 / 1024.0,
            arrow_bytes as f64 / sample.len() as f64 / 1024.0
        );
        println!(
            "  all-pairs baseline (per-rank scan, read items, no dedup): {baseline_s:.3} s, peak heap {:.2} GiB, {pairs} read items -> tessera plan is {:.1}x faster",
            gib(baseline_peak),
            baseline_s / total_s
        );
    }
}
