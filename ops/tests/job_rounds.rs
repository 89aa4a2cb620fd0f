//! The load job's rounds (`tessera_ops::job`) run for whole jobs over the in-memory board, with
//! the real coordinator planning a synthesized checkpoint: what a rank reads from the channel
//! does not grow with the world (its own answer and two short words), ranks that opened other
//! checkpoints are refused on every rank, and a rank whose plan describes a pair differently
//! from its peer's is refused before any read.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use bytes::Bytes;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use tessera_loader::checkpoint::Checkpoint;
use tessera_ops::OpsError;
use tessera_ops::job::memory_board::run_rounds;
use tessera_ops::job::{Hello, JobCoordinator, JobWork, PairReport, RankWork, Taken, Verdict};
use tessera_ops::load::agreement::{JobTerms, checkpoint_key, job_plan_terms};
use tessera_ops::memory_tier::{TierLoad, TierOffer};
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_planner::{ExplicitRequests, PlanOptions};
use tessera_storage::Location;
use tessera_synth::{Model, SynthOptions, synthesize};

struct Job {
    runtime: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
    checkpoint: Arc<Checkpoint>,
    name: String,
    layers: u64,
}

fn saved() -> Job {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let location = Location {
        store: Arc::new(LocalFileSystem::new_with_prefix(dir.path()).unwrap()),
        prefix: Path::from("ckpt"),
        display: dir.path().join("ckpt").display().to_string(),
        local_root: None,
    };
    let layers = Model::GptTiny.config().num_layers;
    let layout = megatron_gpt(MegatronGpt {
        tp: 2,
        pp: 1,
        dp: 2,
        num_layers: layers,
        zero1: true,
    })
    .unwrap();
    runtime
        .block_on(synthesize(
            location.store.clone(),
            &location.prefix,
            &location.display,
            &layout,
            &SynthOptions {
                model: Model::GptTiny,
                optimizer: true,
                metadata_only: true,
                dist_optimizer: None,
                step: Some(1),
                progress: None,
            },
        ))
        .unwrap();
    let checkpoint = Arc::new(
        runtime
            .block_on(Checkpoint::open(location.clone()))
            .unwrap(),
    );
    Job {
        runtime,
        _dir: dir,
        checkpoint,
        name: location.display,
        layers,
    }
}

impl Job {
    fn terms(&self) -> JobTerms {
        JobTerms {
            location: self.name.clone(),
            checkpoint: checkpoint_key(&self.checkpoint, &self.name).unwrap(),
            plan: job_plan_terms(&self.checkpoint, &PlanOptions::default(), &[], None),
        }
    }

    /// Every rank's hello for `--tp 2 --dp world/2`.
    fn hellos(&self, world: u32) -> Vec<Hello> {
        let requests = megatron_gpt(MegatronGpt {
            tp: 2,
            pp: 1,
            dp: world / 2,
            num_layers: self.layers,
            zero1: true,
        })
        .unwrap()
        .resolve(self.checkpoint.meta.tensors())
        .unwrap();
        ExplicitRequests::of(&requests, self.checkpoint.meta.tensors())
            .ranks
            .into_iter()
            .map(|requests| Hello {
                requests,
                tier: TierOffer::default(),
                terms: self.terms(),
            })
            .collect()
    }

    fn ranks(&self, world: u32) -> Vec<Rank<'_>> {
        self.hellos(world)
            .into_iter()
            .enumerate()
            .map(|(rank, hello)| {
                let rank = rank as u32;
                let mut work = RankWork::new(
                    rank,
                    world,
                    Arc::clone(&self.checkpoint),
                    hello.requests,
                    TierLoad::default(),
                    false,
                );
                if rank == 0 {
                    work.coordinate_with(JobCoordinator::new(
                        Arc::clone(&self.checkpoint),
                        self.name.clone(),
                        PlanOptions::default(),
                        None,
                        true,
                    ));
                }
                Rank {
                    rank,
                    job: self,
                    work,
                    answer_bytes: 0,
                    tamper: false,
                }
            })
            .collect()
    }
}

/// One rank's local work: every front end's (`RankWork`: the real coordinator on rank 0, the
/// real plan intake, checked against the rank's own requests, everywhere), which a rank may lie
/// around.
struct Rank<'a> {
    rank: u32,
    job: &'a Job,
    work: RankWork,
    answer_bytes: u64,
    /// Reports a digest for its first peer that its plan does not hold.
    tamper: bool,
}

impl JobWork for Rank<'_> {
    fn coordinate(&mut self, hellos: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        self.job.runtime.block_on(self.work.coordinate(hellos))
    }

    fn settle(&mut self, _verified: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        unreachable!("no memory tier here")
    }

    fn take(&mut self, answer: Bytes) -> Result<Taken, OpsError> {
        self.answer_bytes = answer.len() as u64;
        let taken = self.work.take(answer)?;
        match (taken, self.tamper) {
            (Taken::Planned(mut planned), true) => {
                let plan = self.work.plan().unwrap();
                let mut report = PairReport::of(plan);
                let peer = (self.rank + 1) % plan.world;
                report.pairs.retain(|&(p, _)| p != peer);
                report.pairs.push((peer, 0xbad));
                report.pairs.sort_unstable();
                planned.pairs = report.encode();
                Ok(Taken::Planned(planned))
            }
            (taken, _) => Ok(taken),
        }
    }

    fn verify_tier(&mut self, _node: Vec<u32>) -> Result<Bytes, OpsError> {
        unreachable!("no memory tier here")
    }

    fn agree(&mut self, reports: Vec<Bytes>) -> Result<Bytes, OpsError> {
        self.work.agree(&reports)
    }

    fn accept(&mut self, verdict: Bytes) -> Result<(), OpsError> {
        self.work.accept(&verdict)
    }

    fn check_joint(&mut self, _folds: Vec<(u32, Bytes)>) -> Result<(), OpsError> {
        Ok(())
    }

    fn check_joint_all(&mut self, folds: Vec<Option<Bytes>>) -> Result<(), OpsError> {
        self.work.check_joint_all(&folds)
    }
}

fn encode(hellos: &[Hello]) -> Vec<Bytes> {
    hellos.iter().map(|h| h.encode().unwrap()).collect()
}

#[test]
fn a_rank_reads_its_own_answer_and_two_words_whatever_the_world() {
    let job = saved();
    let mut reads_by_world = Vec::new();
    for world in [4u32, 16, 64] {
        let mut ranks = job.ranks(world);
        let traffic = run_rounds(&mut ranks, encode(&job.hellos(world)), |_| Bytes::new()).unwrap();
        for (r, (t, rank)) in traffic.iter().zip(&ranks).enumerate().skip(1) {
            // Its answer (its own plan), the plan's verdict and the joint checks' word.
            assert_eq!(t.reads, 3, "world {world} rank {r}: {t:?}");
            let verdict = Verdict::default().encode().unwrap().len() as u64;
            assert_eq!(
                t.bytes_read,
                rank.answer_bytes + verdict + 2,
                "world {world} rank {r}: {t:?}"
            );
            assert_eq!(t.arrivals, 3, "world {world} rank {r}: {t:?}");
        }
        // The coordinator: every hello, every pair report and every folds key, and its own three.
        assert_eq!(traffic[0].reads, 3 * u64::from(world) + 3, "world {world}");
        let max_read = traffic[1..].iter().map(|t| t.bytes_read).max().unwrap();
        reads_by_world.push((world, max_read));
    }
    // DP replicas' plans hold the same tensors: what a rank reads stays within its own share
    // (zero1's optimizer states spread thinner as the world grows), never growing with it.
    let (_, at_4) = reads_by_world[0];
    for &(world, bytes) in &reads_by_world[1..] {
        assert!(
            bytes <= at_4 * 3 / 2,
            "world {world}: a rank read {bytes} bytes, world 4: {at_4}"
        );
    }
}

#[test]
fn ranks_that_opened_other_checkpoints_are_refused_naming_both() {
    let job = saved();
    let mut hellos = job.hellos(4);
    hellos[2].terms.checkpoint = "native:another-save".to_string();
    hellos[2].terms.location = "/elsewhere/step-2".to_string();
    let mut ranks = job.ranks(4);
    let failure = run_rounds(&mut ranks, encode(&hellos), |_| Bytes::new()).unwrap_err();
    let text = failure.to_string();
    assert_eq!(failure.rank, 0, "{text}");
    assert!(
        text.contains("rank 0: the ranks of this job load different checkpoints: rank 2 loads /elsewhere/step-2 (native:another-save) but rank 0 loads"),
        "{text}"
    );
}

#[test]
fn a_pair_described_differently_by_its_two_ranks_is_refused_before_any_read() {
    let job = saved();
    let mut ranks = job.ranks(4);
    ranks[1].tamper = true;
    let mut reads = 0;
    let failure = run_rounds(&mut ranks, encode(&job.hellos(4)), |_| {
        reads += 1;
        Bytes::new()
    })
    .unwrap_err();
    let text = failure.to_string();
    assert_eq!(reads, 0, "a rank read before the plan was agreed: {text}");
    assert!(
        text.contains("this rank's plan and the plan of rank 1 disagree")
            || text.contains("the plans of ranks 1 and 2 disagree"),
        "{text}"
    );
}
