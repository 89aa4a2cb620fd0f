//! One rank's whole load job into host buffers over the job's own transport, the driver every
//! front end with a [`Transport`] shares (the CLI's in-process ranks, its `--rank` processes): the
//! rounds ([`super::transport_board::run_job`]: rank 0 plans once, each rank takes its own plan,
//! the plan agreement, the read of its own pieces, the joint checks), then the exchange of what
//! it read with its peers ([`tessera_loader::exchange::exchange_after_read`]), then its report.
//! [`HostJob`] is what every rank of one job loads with; [`HostJob::load_rank`] one rank's load,
//! into buffers allocated once its plan is known ([`allocated`]) or the caller's own
//! ([`callers`]: a Python caller's arrays). A device destination loads here into host buffers
//! and uploads them after (`crate::load::cuda::upload`).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::exchange::relay::{self, Slot, with_relay_buffers};
use tessera_loader::exchange::{check_buffer_sizes, exchange_after_read, place};
use tessera_loader::load::{LoadOptions, RankReport};
use tessera_loader::read::ReadStats;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{TcpTransport, Transport, TransportOptions};
use tessera_planner::{ExplicitRequest, PlanOptions, PlanSummary, RankPlan};

use super::transport_board::{ReadPieces, run_job};
use super::{Hello, JobCoordinator, JobFailure, RankWork, Round};
use crate::OpsError;
use crate::load::PlanServer;
use crate::load::agreement::{JobTerms, checkpoint_key, job_fingerprint, job_plan_terms};
use crate::memory_tier::TierLoad;

/// One load job as the ranks a front end plays over a transport load it: the checkpoint as
/// opened and as named, the number of ranks, how rank 0 plans (here with `planning` and the
/// tensor `filter`'s flags, or on `server`), the memory tier each rank offers, and how each
/// reads. Each rank brings its own requests ([`HostJob::load_rank`]); rank 0 learns the others'
/// from their hellos.
#[derive(Clone)]
pub struct HostJob {
    /// The checkpoint as opened.
    pub checkpoint: Arc<Checkpoint>,
    /// How the user named it.
    pub location: String,
    /// Ranks in the job.
    pub world: u32,
    /// The planner's options (dedup among them).
    pub planning: PlanOptions,
    /// The tensor filter's flags as given (empty: every tensor), which every rank must share.
    pub filter: Vec<String>,
    /// The tessera server that plans instead, if any.
    pub server: Option<PlanServer>,
    /// This host's memory tier, if any.
    pub memory_tier: Option<PathBuf>,
    /// Whether reads verify.
    pub verify: bool,
    /// The load's options.
    pub options: LoadOptions,
    /// The transport's timeout, which bounds every wait of the rounds.
    pub timeout: Duration,
}

/// Makes a rank's destination buffers, one per destination of its plan, once the plan is
/// taken: [`allocated`] or [`callers`].
pub type MakeBuffers<B> = Box<dyn FnOnce(&RankPlan) -> Result<Vec<B>, OpsError> + Send>;

/// Fresh zeroed host buffers of the plan's sizes.
pub fn allocated() -> MakeBuffers<Vec<u8>> {
    Box::new(|plan| Ok(place::allocate(plan)))
}

/// The caller's buffers, one per request in order (the plan's destinations follow the requests);
/// refused, naming the rank and the destination, when they do not fit the plan rank 0 made.
pub fn callers<B: AsRef<[u8]> + Send + 'static>(buffers: Vec<B>) -> MakeBuffers<B> {
    Box::new(move |plan| {
        check_buffer_sizes(plan, buffers.iter().map(|b| b.as_ref().len() as u64)).map_err(
            |detail| {
                OpsError::invalid(format!(
                    "rank {}: the job's plan does not fit the arrays given: {detail}",
                    plan.rank
                ))
            },
        )?;
        Ok(buffers)
    })
}

impl HostJob {
    /// `config` (a rank's place in tessera's own TCP rendezvous) for this job only: rank 0 turns
    /// away a rank of another job (another checkpoint as opened, another world, or other
    /// `job_texts`: the layout or requests files a front end read) and calls the job off,
    /// naming the option, when its ranks would plan differently (read order, dedup, filter,
    /// server).
    pub fn rendezvous(
        &self,
        config: RendezvousConfig,
        job_texts: &[&[u8]],
    ) -> Result<RendezvousConfig, OpsError> {
        let key = checkpoint_key(&self.checkpoint, &self.location)?;
        let terms = job_plan_terms(
            &self.checkpoint,
            &self.planning,
            &self.filter,
            self.server.as_ref(),
        );
        Ok(config
            .with_job(job_fingerprint(&key, job_texts, self.world))
            .with_plan(terms))
    }

    /// How this job's ranks wait on each other: `timeout` bounds every wait on a peer, the
    /// rendezvous included, and a waiting rank says whom it waits for every
    /// [`progress_interval`] meanwhile.
    pub fn transport_options(&self) -> TransportOptions {
        TransportOptions {
            timeout: self.timeout,
            connect_timeout: self.timeout,
            progress_every: Some(progress_interval(self.timeout)),
        }
    }

    /// Loads rank `config.rank` of this job, whose requests are `requests`, over tessera's own
    /// TCP mesh: `config` (its place in the rendezvous, as a front end found it) made this job's
    /// only ([`HostJob::rendezvous`] with `job_texts`), the mesh joined with
    /// [`HostJob::transport_options`], then the rank's load ([`HostJob::load_rank`]). The one way
    /// a rank of a real job loads into host memory, from the CLI (`--rank`, and the processes
    /// `tessera load` spawns) and from Python (`exchange=True`).
    pub async fn load_rank_over_tcp<B: AsMut<[u8]> + AsRef<[u8]> + Send>(
        &self,
        (config, job_texts): (RendezvousConfig, &[&[u8]]),
        requests: Vec<ExplicitRequest>,
        buffers: MakeBuffers<B>,
        on_planned: Option<OnPlanned>,
    ) -> Result<HostLoad<B>, OpsError> {
        let rank = config.rank;
        let config = self.rendezvous(config, job_texts)?;
        // The rendezvous's errors name the rank and rank 0's address already.
        let transport = TcpTransport::connect(&config, self.transport_options()).await?;
        self.load_rank((rank, requests), transport, buffers, on_planned)
            .await
    }

    /// Loads rank `rank`, whose requests are `requests`, over `transport` ([`load_host`]) into
    /// the buffers `buffers` makes: its hello (its requests, its memory-tier offer, the
    /// checkpoint as opened and the plan's options) and its work (rank 0 the coordinator, which
    /// plans the job once, here or on the server).
    pub async fn load_rank<T: Transport + 'static, B: AsMut<[u8]> + AsRef<[u8]> + Send>(
        &self,
        (rank, requests): (u32, Vec<ExplicitRequest>),
        transport: T,
        buffers: MakeBuffers<B>,
        on_planned: Option<OnPlanned>,
    ) -> Result<HostLoad<B>, OpsError> {
        if rank >= self.world {
            return Err(OpsError::invalid(format!(
                "rank {rank} is outside a job of {} ranks",
                self.world
            )));
        }
        let tier = TierLoad::find(&self.checkpoint, self.memory_tier.as_deref());
        let hello = Hello {
            requests: requests.clone(),
            tier: tier.offer().clone(),
            terms: JobTerms {
                location: self.location.clone(),
                checkpoint: checkpoint_key(&self.checkpoint, &self.location)?,
                plan: job_plan_terms(
                    &self.checkpoint,
                    &self.planning,
                    &self.filter,
                    self.server.as_ref(),
                ),
            },
        }
        .encode()?;
        let mut work = RankWork::new(
            rank,
            self.world,
            Arc::clone(&self.checkpoint),
            requests,
            tier,
            self.verify,
        );
        if rank == 0 {
            work.coordinate_with(JobCoordinator::new(
                Arc::clone(&self.checkpoint),
                self.location.clone(),
                self.planning.clone(),
                self.server.clone(),
                self.planning.dedup,
            ));
        }
        load_host(
            Arc::new(transport),
            (work, hello),
            buffers,
            &self.options,
            (self.timeout, on_planned),
        )
        .await
    }
}

/// What a rank's load left: its plan, its buffers (one per plan destination, loaded), its report
/// and its work (the memory-tier copies it read, the job's plan in numbers).
pub struct HostLoad<B = Vec<u8>> {
    /// This rank's plan.
    pub plan: Arc<RankPlan>,
    /// Its loaded buffers, one per destination of `plan`.
    pub buffers: Vec<B>,
    /// Its report.
    pub report: RankReport,
    /// Its work in the rounds.
    pub work: RankWork,
    /// Seconds until it held its plan, agreed (the rounds before its read).
    pub plan_seconds: f64,
}

impl<B> HostLoad<B> {
    /// The job's plan in numbers as this rank took it from the coordinator; an error naming the
    /// rank when the answer did not say it.
    pub fn job_summary(&self) -> Result<&PlanSummary, OpsError> {
        self.work.job_summary().ok_or_else(|| {
            OpsError::invalid(format!(
                "rank {}: the coordinator's answer did not say the job's plan",
                self.plan.rank
            ))
        })
    }
}

/// How often a rank waiting on a peer says whom it waits for: every 5 s, more often for a short
/// `timeout` (a quarter of it, at least 1 s) so that a wait always says something before it
/// fails.
pub fn progress_interval(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(5))
}

/// Called on every rank once its plan is taken, before it reads (a front end sizes its progress
/// bar by the job's bytes to read).
pub type OnPlanned = Arc<dyn Fn(&PlanSummary) + Send + Sync>;

/// The read of the rounds into host buffers: what it leaves for the exchange.
struct HostRead<'o, B> {
    options: &'o LoadOptions,
    on_planned: Option<OnPlanned>,
    started: Instant,
    make_buffers: Option<MakeBuffers<B>>,
    buffers: Vec<B>,
    /// The plan with scratch destinations for pieces read only to pass on, and their buffers.
    relaying: Option<(RankPlan, Vec<Vec<u8>>)>,
    stats: Option<(ReadStats, f64)>,
    plan_seconds: f64,
}

impl<B: AsMut<[u8]> + AsRef<[u8]> + Send> ReadPieces<RankWork> for HostRead<'_, B> {
    fn read<'a>(&'a mut self, work: &'a mut RankWork) -> BoxFuture<'a, Result<Bytes, OpsError>> {
        Box::pin(async move {
            let plan = Arc::clone(work.plan().ok_or_else(|| {
                OpsError::invalid(format!(
                    "rank {}: reading before the plan was taken",
                    work.rank()
                ))
            })?);
            self.plan_seconds = self.started.elapsed().as_secs_f64();
            let started = Instant::now();
            if let (Some(on_planned), Some(summary)) = (&self.on_planned, work.job_summary()) {
                on_planned(summary);
            }
            let make_buffers = self
                .make_buffers
                .take()
                .ok_or_else(|| OpsError::invalid(format!("rank {}: read twice", work.rank())))?;
            self.buffers = make_buffers(&plan)?;
            let checkpoint = Arc::clone(work.checkpoint());
            let stats = match with_relay_buffers(&plan) {
                None => {
                    checkpoint
                        .read_into(&plan, self.options, &mut self.buffers)
                        .await?
                }
                Some(relaying) => {
                    let mut slots = relay::slots(&relaying, &mut self.buffers);
                    let stats = checkpoint
                        .read_into(&relaying, self.options, &mut slots)
                        .await?;
                    let scratch = slots
                        .into_iter()
                        .filter_map(|slot| match slot {
                            Slot::Scratch(bytes) => Some(bytes),
                            Slot::Caller(_) => None,
                        })
                        .collect();
                    self.relaying = Some((relaying, scratch));
                    stats
                }
            };
            let folds = work.read_done(stats.joint_folds.clone());
            self.stats = Some((stats, started.elapsed().as_secs_f64()));
            Ok(folds)
        })
    }
}

/// Loads rank `transport.rank()` of a job: its rounds over `transport` (`work`, with the
/// coordinator on rank 0, and `hello`, its [`super::Hello`] encoded), its read with `options`
/// into the buffers `buffers` makes, the exchange, and its report. `timeout`: the transport's,
/// which bounds every wait of the rounds. An error is this rank's own, or names the rank that
/// failed first ([`JobFailure::on_rank`]).
pub async fn load_host<T: Transport + 'static, B: AsMut<[u8]> + AsRef<[u8]> + Send>(
    transport: Arc<T>,
    (mut work, hello): (RankWork, Bytes),
    buffers: MakeBuffers<B>,
    options: &LoadOptions,
    (timeout, on_planned): (Duration, Option<OnPlanned>),
) -> Result<HostLoad<B>, OpsError> {
    let rank = transport.rank();
    let started = Instant::now();
    // Pieces of boxes read in parts by several ranks are folded, and checked in the rounds.
    let mut options = options.clone();
    options.read.joint_checks = true;
    let mut reader = HostRead {
        options: &options,
        on_planned,
        started,
        make_buffers: Some(buffers),
        buffers: Vec::new(),
        relaying: None,
        stats: None,
        plan_seconds: 0.0,
    };
    run_job(
        Arc::clone(&transport),
        timeout,
        &mut work,
        hello,
        &mut reader,
    )
    .await
    .map_err(|failure: JobFailure| failure.on_rank(rank))?;
    let HostRead {
        mut buffers,
        relaying,
        stats,
        plan_seconds,
        ..
    } = reader;
    let (plan, Some((stats, read_seconds))) = (work.plan().cloned(), stats) else {
        return Err(OpsError::invalid(format!(
            "rank {rank}: the job's rounds reached the exchange before this rank read ({})",
            Round::Read.step()
        )));
    };
    let plan = plan.ok_or_else(|| OpsError::invalid(format!("rank {rank}: no plan")))?;
    let exchanged = match relaying {
        None => exchange_after_read(&plan, &*transport, &options, &mut buffers).await?,
        Some((relaying, scratch)) => {
            let mut slots: Vec<Slot<'_, B>> = buffers
                .iter_mut()
                .map(Slot::Caller)
                .chain(scratch.into_iter().map(Slot::Scratch))
                .collect();
            exchange_after_read(&relaying, &*transport, &options, &mut slots).await?
        }
    };
    let total = started.elapsed().as_secs_f64();
    let mut report = RankReport::of_host_load(
        &plan,
        &stats,
        read_seconds,
        (exchanged.bytes_sent, exchanged.bytes_received),
        exchanged.elapsed.as_secs_f64(),
        total,
    );
    report.bytes_received_direct = exchanged.bytes_received_direct;
    report.exchange_wait_seconds = exchanged.waited.as_secs_f64();
    Ok(HostLoad {
        plan,
        buffers,
        report,
        work,
        plan_seconds,
    })
}
