//! The load job's rounds (`tessera_ops::job`) run for whole jobs over the in-memory board, with
//! the real coordinator planning a synthesized checkpoint: what a rank reads from the channel
//! does not grow with the world (its own answer and two short words), ranks that opened other
//! checkpoints are refused on every rank, and a rank whose plan describes a pair differently
//! from its peer's is refused before any read. Then the same rounds over the job's own transport
//! (in-process and TCP on loopback, rank 0 holding the board): plans agree, a tampered pair is
//! refused on every rank before any read, a rank whose read fails is named on every rank (those
//! still reading stopped by its word), a rank that dies is named on every other.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::future::BoxFuture;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::LoadOptions;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{InProcTransport, TcpTransport, Transport, TransportOptions};
use tessera_ops::OpsError;
use tessera_ops::job::host::{HostJob, HostLoad, allocated};
use tessera_ops::job::memory_board::{JobFailure, run_rounds};
use tessera_ops::job::transport_board::{ReadPieces, run_job};
use tessera_ops::job::{
    AsyncJobWork, Hello, JobCoordinator, JobWork, PairReport, RankWork, Round, RoundSteps, Taken,
    Verdict,
};
use tessera_ops::load::agreement::{JobTerms, checkpoint_key, job_plan_terms};
use tessera_ops::memory_tier::{TierLoad, TierOffer};
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_planner::{ExplicitRequests, PlanOptions, RankPlan, Target};
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
    saved_with(true)
}

/// A tp2 dp2 checkpoint of GptTiny; with its data unless `metadata_only`.
fn saved_with(metadata_only: bool) -> Job {
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
        shared_files: Default::default(),
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
                metadata_only,
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

impl RoundSteps for Rank<'_> {
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

impl JobWork for Rank<'_> {
    fn coordinate(&mut self, hellos: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        self.job.runtime.block_on(self.work.coordinate(hellos))
    }

    fn settle(&mut self, _verified: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        unreachable!("no memory tier here")
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

// The same rounds over the job's own transport (`tessera_ops::job::transport_board`): rank 0
// holds the board and serves every peer; in-process and over TCP on loopback.

/// A rank's work over a transport: `RankWork`, which may lie about one pair as `Rank` does.
struct Over {
    work: RankWork,
    tamper: bool,
}

impl RoundSteps for Over {
    fn take(&mut self, answer: Bytes) -> Result<Taken, OpsError> {
        let taken = self.work.take(answer)?;
        match (taken, self.tamper) {
            (Taken::Planned(mut planned), true) => {
                let plan = self.work.plan().unwrap();
                let mut report = PairReport::of(plan);
                let peer = (plan.rank + 1) % plan.world;
                report.pairs.retain(|&(p, _)| p != peer);
                report.pairs.push((peer, 0xbad));
                report.pairs.sort_unstable();
                planned.pairs = report.encode();
                Ok(Taken::Planned(planned))
            }
            (taken, _) => Ok(taken),
        }
    }
    fn verify_tier(&mut self, node: Vec<u32>) -> Result<Bytes, OpsError> {
        self.work.verify_tier(&node)
    }
    fn agree(&mut self, reports: Vec<Bytes>) -> Result<Bytes, OpsError> {
        self.work.agree(&reports)
    }
    fn accept(&mut self, verdict: Bytes) -> Result<(), OpsError> {
        self.work.accept(&verdict)
    }
    fn check_joint(&mut self, folds: Vec<(u32, Bytes)>) -> Result<(), OpsError> {
        self.work.check_joint(&folds)
    }
    fn check_joint_all(&mut self, folds: Vec<Option<Bytes>>) -> Result<(), OpsError> {
        self.work.check_joint_all(&folds)
    }
}

impl AsyncJobWork for Over {
    async fn coordinate(&mut self, hellos: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        self.work.coordinate(hellos).await
    }
    async fn settle(&mut self, verified: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        self.work.settle(verified).await
    }
    fn reached_exchange(&mut self) {
        self.work.reached_exchange()
    }
}

/// How a rank of a transport test behaves.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Plays {
    /// Honestly, reading nothing.
    Honest,
    /// Reports a digest for its next peer that its plan does not hold.
    Tampers,
    /// Its read fails.
    ReadFails,
    /// Its read never ends: only another rank's failure stops it.
    ReadsForever,
    /// Dies before its first word (its transport dropped).
    Dies,
}

/// A rank's read as `plays` says, counted in `reads`.
struct Reader {
    plays: Plays,
    reads: Arc<AtomicUsize>,
}

impl ReadPieces<Over> for Reader {
    fn read<'a>(&'a mut self, over: &'a mut Over) -> BoxFuture<'a, Result<Bytes, OpsError>> {
        Box::pin(async move {
            self.reads.fetch_add(1, Ordering::SeqCst);
            match self.plays {
                Plays::ReadFails => Err(OpsError::invalid(format!(
                    "rank {}: storage refused shard-7",
                    over.work.rank()
                ))),
                Plays::ReadsForever => futures::future::pending().await,
                _ => Ok(over.work.read_done(Vec::new())),
            }
        })
    }
}

const TIMEOUT: Duration = Duration::from_secs(60);

/// Every destination `loaded` holds is the synthetic checkpoint's bytes there (`what` names
/// the rank in failures).
fn assert_synthetic_bytes(loaded: &HostLoad, what: &str) {
    for (dest, buffer) in loaded.plan.destinations.iter().zip(&loaded.buffers) {
        let tensor = &loaded.plan.tensors[dest.tensor as usize];
        match &dest.target {
            Target::Box(region) => tessera_synth::check_box(tensor, region, buffer),
            Target::Flat { start, end } => tessera_synth::check_flat(tensor, *start, *end, buffer),
        }
        .unwrap_or_else(|e| panic!("{what} {}: {e}", tensor.fqn));
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// What each rank of a job over `transports` ended with (`plays[r]`: how rank r behaves,
/// `hellos[r]`: what it says), and how many ranks read.
async fn run_over<T: Transport + 'static>(
    job: &Job,
    transports: Vec<T>,
    hellos: Vec<Hello>,
    plays: &[Plays],
) -> (Vec<Result<Arc<RankPlan>, JobFailure>>, usize) {
    let world = transports.len() as u32;
    let reads = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for ((transport, hello), &plays) in transports.into_iter().zip(hellos).zip(plays) {
        let rank = transport.rank();
        let mut work = RankWork::new(
            rank,
            world,
            Arc::clone(&job.checkpoint),
            hello.requests.clone(),
            TierLoad::default(),
            false,
        );
        if rank == 0 {
            work.coordinate_with(JobCoordinator::new(
                Arc::clone(&job.checkpoint),
                job.name.clone(),
                PlanOptions::default(),
                None,
                true,
            ));
        }
        let mut over = Over {
            work,
            tamper: plays == Plays::Tampers,
        };
        let hello = hello.encode().unwrap();
        let reads = Arc::clone(&reads);
        tasks.push(tokio::spawn(async move {
            if plays == Plays::Dies {
                drop(transport);
                return None;
            }
            let mut reader = Reader { plays, reads };
            let outcome =
                run_job(Arc::new(transport), TIMEOUT, &mut over, hello, &mut reader).await;
            Some(outcome.map(|()| Arc::clone(over.work.plan().unwrap())))
        }));
    }
    let mut outcomes = Vec::new();
    for task in tasks {
        if let Some(outcome) = task.await.unwrap() {
            outcomes.push(outcome);
        }
    }
    (outcomes, reads.load(Ordering::SeqCst))
}

async fn tcp_mesh(world: u32) -> Vec<TcpTransport> {
    let port = free_port();
    let tasks: Vec<_> = (0..world)
        .map(|rank| {
            let config = RendezvousConfig::new(rank, world, "127.0.0.1", port).unwrap();
            tokio::spawn(async move {
                TcpTransport::connect(&config, TransportOptions::with_timeout(TIMEOUT)).await
            })
        })
        .collect();
    let mut mesh = Vec::new();
    for task in tasks {
        mesh.push(task.await.unwrap().unwrap());
    }
    mesh
}

/// Runs `plays` over an in-process mesh and over TCP on loopback; `check` sees each outcome.
fn over_both(
    job: &Job,
    hellos: &[Hello],
    plays: &[Plays],
    check: impl Fn(&str, &[Result<Arc<RankPlan>, JobFailure>], usize),
) {
    let world = plays.len() as u32;
    let (outcomes, reads) = job.runtime.block_on(run_over(
        job,
        InProcTransport::mesh(world, TransportOptions::with_timeout(TIMEOUT)),
        hellos.to_vec(),
        plays,
    ));
    check("in-process", &outcomes, reads);
    let (outcomes, reads) = job.runtime.block_on(async {
        let mesh = tcp_mesh(world).await;
        run_over(job, mesh, hellos.to_vec(), plays).await
    });
    check("tcp", &outcomes, reads);
}

#[test]
fn over_a_transport_every_rank_takes_its_own_plan_of_one_agreed_plan() {
    let job = saved();
    let hellos = job.hellos(4);
    over_both(
        &job,
        &hellos,
        &[Plays::Honest; 4],
        |how, outcomes, reads| {
            assert_eq!(reads, 4, "{how}");
            for (r, outcome) in outcomes.iter().enumerate() {
                let plan = outcome
                    .as_ref()
                    .unwrap_or_else(|e| panic!("{how} rank {r}: {e}"));
                assert_eq!((plan.rank, plan.world), (r as u32, 4), "{how}");
                assert_eq!(
                    plan.destinations.len(),
                    hellos[r].requests.len(),
                    "{how} rank {r}: one destination per request"
                );
            }
            // Both ends of every pair describe what they pass each other alike.
            let reports: Vec<Bytes> = outcomes
                .iter()
                .map(|o| PairReport::of(o.as_ref().unwrap()).encode())
                .collect();
            assert_eq!(Verdict::of_reports(&reports).unwrap().count, 0, "{how}");
        },
    );
}

#[test]
fn over_a_transport_a_tampered_pair_is_refused_on_every_rank_before_any_read() {
    let job = saved();
    let mut plays = [Plays::Honest; 4];
    plays[1] = Plays::Tampers;
    over_both(&job, &job.hellos(4), &plays, |how, outcomes, reads| {
        assert_eq!(reads, 0, "{how}: a rank read before the plan was agreed");
        for (r, outcome) in outcomes.iter().enumerate() {
            let text = outcome.as_ref().unwrap_err().to_string();
            // Its own verdict, or the first rank's failure that rank 0 passed on before it
            // took it: the pair is named either way.
            let own = match r {
                1 => "this rank's plan and the plan of rank 2 disagree",
                2 => "this rank's plan and the plan of rank 1 disagree",
                _ => "the plans of ranks 1 and 2 disagree",
            };
            assert!(
                text.contains(own) || text.contains("the plans of ranks 1 and 2 disagree"),
                "{how} rank {r}: {text}"
            );
        }
    });
}

#[test]
fn over_a_transport_a_rank_whose_read_fails_is_named_on_every_rank_even_those_still_reading() {
    let job = saved();
    let mut plays = [Plays::ReadsForever; 4];
    plays[2] = Plays::ReadFails;
    over_both(&job, &job.hellos(4), &plays, |how, outcomes, reads| {
        // Rank 2 read; a rank told of its failure before it took the verdict never reads.
        assert!(reads >= 1, "{how}");
        for (r, outcome) in outcomes.iter().enumerate() {
            let failure = outcome.as_ref().unwrap_err();
            assert_eq!(
                (failure.rank, failure.round),
                (2, Round::Read),
                "{how} rank {r}"
            );
            let text = failure.to_string();
            assert!(
                text.starts_with(
                    "rank 2 failed reading its pieces: rank 2: storage refused shard-7"
                ),
                "{how} rank {r}: {text}"
            );
        }
    });
}

#[test]
fn over_a_transport_a_rank_that_dies_is_named_on_every_other_rank() {
    let job = saved();
    let mut plays = [Plays::Honest; 4];
    plays[3] = Plays::Dies;
    over_both(&job, &job.hellos(4), &plays, |how, outcomes, reads| {
        assert_eq!(reads, 0, "{how}: the job went on without rank 3");
        assert_eq!(outcomes.len(), 3, "{how}");
        for (r, outcome) in outcomes.iter().enumerate() {
            let failure = outcome.as_ref().unwrap_err();
            let text = failure.to_string();
            assert_eq!(failure.rank, 3, "{how} rank {r}: {text}");
            assert!(text.contains("rank 3"), "{how} rank {r}: {text}");
        }
    });
}

#[test]
fn over_a_transport_ranks_that_opened_other_checkpoints_each_raise_the_refusal() {
    let job = saved();
    let mut hellos = job.hellos(4);
    hellos[2].terms.checkpoint = "native:another-save".to_string();
    hellos[2].terms.location = "/elsewhere/step-2".to_string();
    over_both(
        &job,
        &hellos,
        &[Plays::Honest; 4],
        |how, outcomes, reads| {
            assert_eq!(reads, 0, "{how}");
            for (r, outcome) in outcomes.iter().enumerate() {
                let text = outcome.as_ref().unwrap_err().to_string();
                assert!(
                text.contains("the ranks of this job load different checkpoints: rank 2 loads /elsewhere/step-2 (native:another-save)"),
                "{how} rank {r}: {text}"
            );
            }
        },
    );
}

/// Every rank's whole load over the transport (`job::host::load_host`): the rounds, the read,
/// the joint checks, the exchange; then every loaded byte is the synthetic value it should be.
#[test]
fn over_a_transport_every_rank_loads_its_bytes() {
    let job = saved_with(false);
    let world = 4;
    let hellos = job.hellos(world);
    let load = |transports: Vec<Box<dyn FnOnce() -> BoxedLoad + Send>>| {
        job.runtime.block_on(async {
            let tasks: Vec<_> = transports.into_iter().map(|t| tokio::spawn(t())).collect();
            let mut loads = Vec::new();
            for task in tasks {
                loads.push(task.await.unwrap());
            }
            loads
        })
    };
    let inproc = InProcTransport::mesh(world, TransportOptions::with_timeout(TIMEOUT))
        .into_iter()
        .map(|t| host_rank(&job, t, &hellos))
        .collect();
    let tcp = job
        .runtime
        .block_on(tcp_mesh(world))
        .into_iter()
        .map(|t| host_rank(&job, t, &hellos))
        .collect();
    for (how, loads) in [("in-process", load(inproc)), ("tcp", load(tcp))] {
        let mut received = 0;
        for (r, loaded) in loads.into_iter().enumerate() {
            let loaded = loaded.unwrap_or_else(|e| panic!("{how} rank {r}: {e}"));
            assert_eq!(loaded.plan.rank, r as u32, "{how}");
            assert_eq!(loaded.buffers.len(), hellos[r].requests.len(), "{how}");
            assert_synthetic_bytes(&loaded, &format!("{how} rank {r}"));
            assert_eq!(loaded.report.bytes_needed, loaded.plan.summary.bytes_needed);
            received += loaded.report.bytes_received;
            let summary = loaded.work.job_summary().unwrap();
            assert_eq!(summary.ranks, world, "{how}");
        }
        // DP replicas read each piece once and pass it on: the exchange moved bytes.
        assert!(received > 0, "{how}: nothing was exchanged");
    }
}

type BoxedLoad =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<HostLoad, OpsError>> + Send>>;

/// Rank `transport.rank()`'s whole load (`HostJob::load_rank`), ready to spawn.
fn host_rank<T: Transport + 'static>(
    job: &Job,
    transport: T,
    hellos: &[Hello],
) -> Box<dyn FnOnce() -> BoxedLoad + Send> {
    let requests = hellos[transport.rank() as usize].requests.clone();
    let job = host_job(job, hellos.len() as u32);
    Box::new(move || {
        Box::pin(async move {
            let rank = transport.rank();
            job.load_rank((rank, requests), transport, allocated(), None)
                .await
        })
    })
}

/// What every rank of `job`'s `world` ranks loads with.
fn host_job(job: &Job, world: u32) -> HostJob {
    HostJob {
        checkpoint: Arc::clone(&job.checkpoint),
        location: job.name.clone(),
        world,
        planning: PlanOptions::default(),
        filter: Vec::new(),
        server: None,
        memory_tier: None,
        verify: true,
        options: LoadOptions::default(),
        timeout: TIMEOUT,
    }
}

/// Every rank of `host`'s job through the one call the CLI's `--rank` and spawned ranks and
/// `tessera.load(exchange=True)` share (`HostJob::load_rank_over_tcp`), rank r bringing
/// `texts[r]` as the files its front end read.
fn over_tcp_rendezvous(
    job: &Job,
    host: &HostJob,
    hellos: &[Hello],
    texts: &[&'static [u8]],
) -> Vec<Result<HostLoad, OpsError>> {
    let world = hellos.len() as u32;
    let port = free_port();
    job.runtime.block_on(async {
        let tasks: Vec<_> = (0..world)
            .map(|rank| {
                let host = host.clone();
                let requests = hellos[rank as usize].requests.clone();
                let text = texts[rank as usize];
                tokio::spawn(async move {
                    let config = RendezvousConfig::new(rank, world, "127.0.0.1", port).unwrap();
                    host.load_rank_over_tcp((config, &[text]), requests, allocated(), None)
                        .await
                })
            })
            .collect();
        let mut loads = Vec::new();
        for task in tasks {
            loads.push(task.await.unwrap());
        }
        loads
    })
}

/// The ranks of a real job meet at tessera's TCP rendezvous and load through one shared call
/// (`HostJob::load_rank_over_tcp`): every loaded byte is the synthetic value it should be and
/// every rank took the job's one plan. A rank that read another layout file is another job's:
/// rank 0 turns it away as it checks in, naming the two jobs.
#[test]
fn ranks_of_a_real_job_load_over_the_tcp_rendezvous_and_another_jobs_rank_is_turned_away() {
    let job = saved_with(false);
    let world = 4;
    let hellos = job.hellos(world);
    let host = host_job(&job, world);
    let texts: [&'static [u8]; 4] = [b"layout"; 4];
    let loads = over_tcp_rendezvous(&job, &host, &hellos, &texts);
    for (r, loaded) in loads.into_iter().enumerate() {
        let loaded = loaded.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        assert_eq!(loaded.plan.rank, r as u32);
        assert_synthetic_bytes(&loaded, &format!("rank {r}"));
        assert_eq!(loaded.job_summary().unwrap().ranks, world);
    }
    // Rank 0 waits for the rank it turned away only this long.
    let host = HostJob {
        timeout: Duration::from_secs(3),
        ..host
    };
    let texts: [&'static [u8]; 4] = [b"layout", b"layout", b"layout", b"another layout"];
    let loads = over_tcp_rendezvous(&job, &host, &hellos, &texts);
    let text = loads[3].as_ref().err().expect("rank 3 loaded").to_string();
    assert!(
        text.contains("rank 3: the master at 127.0.0.1:")
            && text.contains("turned this rank away: it loads job"),
        "{text}"
    );
    assert!(loads[0].is_err(), "rank 0 loaded without rank 3");
}
