//! The load job's coordination at scale (a bench binary: `cargo bench --bench job_scale`).
//!
//! N simulated ranks in one process run the real rounds of `tessera_ops::job` (the state machine
//! every front end pumps) over the instrumented in-memory board
//! (`tessera_ops::job::memory_board`), with the real coordinator planning Llama 3 405B with
//! optimizer states (`synth --metadata-only`, saved `megatron-gpt --tp 8 --pp 16 --dp 64
//! --zero1`) for `--tp 8 --pp 8 --dp N/64 --zero1`, at N = 256, 2,048 and 16,384
//! (`TESSERA_BENCH_WORLDS=256,2048` picks). Reported per rank (other than the coordinator): bytes
//! and messages put and read, the time and peak heap of taking its plan; for the coordinator:
//! the same, and its planning time and peak heap. Side by side, what the all-gather the
//! process-group path used before would have made each rank read (every rank's hello), and what
//! DCP's load planning moves at the same N: each rank's local plan (a read item per overlap of
//! its requests with the saved chunks, pickled at 179 bytes each, measured with torch 2.15 on
//! Megatron-like names) gathered on its coordinator and the global plan scattered back.
#![allow(missing_docs, clippy::unwrap_used)]

#[path = "support/heap.rs"]
mod heap;
#[path = "support/model.rs"]
mod model;

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use tessera_loader::checkpoint::Checkpoint;
use tessera_ops::OpsError;
use tessera_ops::job::memory_board::run_rounds;
use tessera_ops::job::{
    Answer, Hello, JobCoordinator, JobWork, RoundSteps, Taken, Verdict, planned_rank,
};
use tessera_ops::load::agreement::{JobTerms, checkpoint_key, job_plan_terms};
use tessera_ops::memory_tier::TierOffer;
use tessera_planner::baseline::all_pairs_read_items;
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_planner::{ExplicitRequests, PlanOptions};
use tessera_storage::Location;
use tessera_synth::{SynthOptions, synthesize};

use model::bench_model;

/// Pickled bytes of one DCP `ReadItem` in a `LoadPlan` (torch 2.15, Megatron-like names, 2-D
/// boxes), measured once: `pickle.dumps(LoadPlan(items))` / len(items) for 1,000 items.
const DCP_READ_ITEM_BYTES: u64 = 179;

/// One simulated rank's local work: the real coordinator on rank 0, the real plan intake on
/// every rank; what taking its plan cost.
struct SimRank<'a> {
    rank: u32,
    coordinator: Option<JobCoordinator>,
    runtime: &'a tokio::runtime::Runtime,
    coordinate_s: f64,
    coordinate_peak: u64,
    take_s: f64,
    take_peak: u64,
}

impl RoundSteps for SimRank<'_> {
    fn take(&mut self, answer: Bytes) -> Result<Taken, OpsError> {
        let base = heap::reset_peak();
        let started = Instant::now();
        let taken = match Answer::decode(self.rank, &answer)? {
            Answer::Plan {
                plan,
                joint_at_coordinator,
                ..
            } => Taken::Planned(planned_rank(&plan, joint_at_coordinator)),
            other => return Err(OpsError::invalid(format!("unexpected answer {other:?}"))),
        };
        self.take_s = started.elapsed().as_secs_f64();
        self.take_peak = heap::peak_since(base);
        Ok(taken)
    }

    fn verify_tier(&mut self, _node: Vec<u32>) -> Result<Bytes, OpsError> {
        Err(OpsError::invalid("no memory tier in the simulation"))
    }

    fn agree(&mut self, reports: Vec<Bytes>) -> Result<Bytes, OpsError> {
        Verdict::of_reports(&reports)?.encode()
    }

    fn accept(&mut self, verdict: Bytes) -> Result<(), OpsError> {
        Verdict::accept(self.rank, &verdict)
    }

    fn check_joint(&mut self, _folds: Vec<(u32, Bytes)>) -> Result<(), OpsError> {
        Ok(())
    }

    fn check_joint_all(&mut self, folds: Vec<Option<Bytes>>) -> Result<(), OpsError> {
        self.coordinator.as_ref().unwrap().check_joint(&folds, true)
    }
}

impl JobWork for SimRank<'_> {
    fn coordinate(&mut self, hellos: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        let coordinator = self.coordinator.as_mut().unwrap();
        let base = heap::reset_peak();
        let started = Instant::now();
        let answers = self.runtime.block_on(coordinator.coordinate(&hellos));
        self.coordinate_s = started.elapsed().as_secs_f64();
        self.coordinate_peak = heap::peak_since(base);
        answers
    }

    fn settle(&mut self, _verified: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        Err(OpsError::invalid("no memory tier in the simulation"))
    }
}

fn kib(b: f64) -> String {
    format!("{:.1} KiB", b / 1024.0)
}

fn mib(b: f64) -> String {
    format!("{:.1} MiB", b / (1u64 << 20) as f64)
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let worlds: Vec<u32> = std::env::var("TESSERA_BENCH_WORLDS")
        .unwrap_or_else(|_| "256,2048,16384".to_string())
        .split(',')
        .map(|w| w.trim().parse().unwrap())
        .collect();
    let model = bench_model("llama3-405b");
    let layers = model.config().num_layers;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let location = Location {
        store: Arc::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap()),
        prefix: Path::from("ckpt"),
        display: dir.path().join("ckpt").display().to_string(),
        local_root: None,
        shared_files: Default::default(),
    };
    let saved = MegatronGpt {
        tp: 8,
        pp: 16,
        dp: 64,
        num_layers: layers,
        zero1: true,
    };
    let started = Instant::now();
    runtime
        .block_on(synthesize(
            location.store.clone(),
            &location.prefix,
            &location.display,
            &megatron_gpt(saved).unwrap(),
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
    println!(
        "model {model}: saved megatron tp8 pp16 dp64 zero1, metadata only ({:.1} s)",
        started.elapsed().as_secs_f64()
    );
    let checkpoint = Arc::new(
        runtime
            .block_on(Checkpoint::open(location.clone()))
            .unwrap(),
    );
    let name = location.display.clone();
    let planning = PlanOptions::default();
    let terms = JobTerms {
        location: name.clone(),
        checkpoint: checkpoint_key(&checkpoint, &name).unwrap(),
        plan: job_plan_terms(&checkpoint, &planning, &[], None),
    };

    println!(
        "\n| ranks | per rank: bytes put / read | per rank: messages put / read, arrivals | per rank: take plan (time, peak heap) | coordinator: bytes read / put | coordinator: plan (time, peak heap) | gather-all before: bytes read per rank | DCP: local plan per rank (up = down) | DCP coordinator in/out |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for world in worlds {
        assert!(world % 64 == 0, "worlds are multiples of 64 (tp8 pp8)");
        let target = MegatronGpt {
            tp: 8,
            pp: 8,
            dp: world / 64,
            num_layers: layers,
            zero1: true,
        };
        let requests = megatron_gpt(target)
            .unwrap()
            .resolve(checkpoint.meta.tensors())
            .unwrap();
        let explicit = ExplicitRequests::of(&requests, checkpoint.meta.tensors());
        let hellos: Vec<Bytes> = explicit
            .ranks
            .into_iter()
            .map(|requests| {
                Hello {
                    requests,
                    tier: TierOffer::default(),
                    terms: terms.clone(),
                }
                .encode()
                .unwrap()
            })
            .collect();
        let hello_bytes: u64 = hellos.iter().map(|h| h.len() as u64).sum();
        let dcp_items: Vec<u64> = all_pairs_read_items(&checkpoint.meta, &requests)
            .iter()
            .map(|items| items.len() as u64)
            .collect();
        drop(requests);
        let mut works: Vec<SimRank> = (0..world)
            .map(|rank| SimRank {
                rank,
                coordinator: (rank == 0).then(|| {
                    JobCoordinator::new(
                        Arc::clone(&checkpoint),
                        name.clone(),
                        planning.clone(),
                        None,
                        true,
                    )
                }),
                runtime: &runtime,
                coordinate_s: 0.0,
                coordinate_peak: 0,
                take_s: 0.0,
                take_peak: 0,
            })
            .collect();
        let started = Instant::now();
        let traffic = run_rounds(&mut works, hellos, |_| Bytes::new()).unwrap();
        let rounds_s = started.elapsed().as_secs_f64();
        let others = &traffic[1..];
        let n = others.len().max(1) as f64;
        let mean = |f: &dyn Fn(&tessera_ops::job::memory_board::Traffic) -> u64| {
            others.iter().map(f).sum::<u64>() as f64 / n
        };
        let max_read = others.iter().map(|t| t.bytes_read).max().unwrap_or(0);
        let takes = &works[1..];
        let take_s = takes.iter().map(|w| w.take_s).sum::<f64>() / n;
        let take_peak = takes.iter().map(|w| w.take_peak).max().unwrap_or(0);
        let dcp_mean =
            dcp_items.iter().sum::<u64>() as f64 / world as f64 * DCP_READ_ITEM_BYTES as f64;
        let dcp_all = dcp_items.iter().sum::<u64>() * DCP_READ_ITEM_BYTES;
        println!(
            "| {world} | {} / {} (max read {}) | {:.1} / {:.1}, {:.0} | {:.1} ms, {} | {} / {} | {:.2} s, {} | {} | {} | {} / {} |",
            kib(mean(&|t| t.bytes_put)),
            kib(mean(&|t| t.bytes_read)),
            kib(max_read as f64),
            mean(&|t| t.puts),
            mean(&|t| t.reads),
            mean(&|t| t.arrivals),
            take_s * 1e3,
            kib(take_peak as f64),
            mib(traffic[0].bytes_read as f64),
            mib(traffic[0].bytes_put as f64),
            works[0].coordinate_s,
            mib(works[0].coordinate_peak as f64),
            mib(hello_bytes as f64),
            kib(dcp_mean),
            mib(dcp_all as f64),
            mib(dcp_all as f64),
        );
        eprintln!("world {world}: rounds in {rounds_s:.1} s");
    }
}
