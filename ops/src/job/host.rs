//! One rank's whole load job into host buffers over the job's own transport, the driver every
//! front end with a [`Transport`] shares (the CLI's in-process ranks, its `--rank` processes): the
//! rounds ([`super::transport_board::run_job`]: rank 0 plans once, each rank takes its own plan,
//! the plan agreement, the read of its own pieces, the joint checks), then the exchange of what
//! it read with its peers ([`tessera_loader::exchange::exchange_after_read`]), then its report.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::BoxFuture;
use tessera_loader::exchange::relay::{self, Slot, with_relay_buffers};
use tessera_loader::exchange::{exchange_after_read, place};
use tessera_loader::load::{LoadOptions, RankReport};
use tessera_loader::read::ReadStats;
use tessera_loader::transport::Transport;
use tessera_planner::{PlanSummary, RankPlan};

use super::transport_board::{ReadPieces, run_job};
use super::{JobFailure, RankWork, Round};
use crate::OpsError;

/// What a rank's load left: its plan, its buffers (one per plan destination, loaded), its report
/// and its work (the memory-tier copies it read, the job's plan in numbers).
pub struct HostLoad {
    /// This rank's plan.
    pub plan: Arc<RankPlan>,
    /// Its loaded buffers, one per destination of `plan`.
    pub buffers: Vec<Vec<u8>>,
    /// Its report.
    pub report: RankReport,
    /// Its work in the rounds.
    pub work: RankWork,
    /// Seconds until it held its plan, agreed (the rounds before its read).
    pub plan_seconds: f64,
}

/// Called on every rank once its plan is taken, before it reads (a front end sizes its progress
/// bar by the job's bytes to read).
pub type OnPlanned = Arc<dyn Fn(&PlanSummary) + Send + Sync>;

/// The read of the rounds into host buffers: what it leaves for the exchange.
struct HostRead<'o> {
    options: &'o LoadOptions,
    on_planned: Option<OnPlanned>,
    started: Instant,
    buffers: Vec<Vec<u8>>,
    /// The plan with scratch destinations for pieces read only to pass on, and their buffers.
    relaying: Option<(RankPlan, Vec<Vec<u8>>)>,
    stats: Option<(ReadStats, f64)>,
    plan_seconds: f64,
}

impl ReadPieces<RankWork> for HostRead<'_> {
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
            self.buffers = place::allocate(&plan);
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

/// Loads rank `transport.rank()` of a job: its rounds over `transport` (`hello`, its
/// [`super::Hello`] encoded; `work`, with the coordinator on rank 0), its read with `options`,
/// the exchange, and its report. `timeout`: the transport's, which bounds every wait of the
/// rounds. An error is this rank's own, or names the rank that failed first
/// ([`JobFailure::on_rank`]).
pub async fn load_host<T: Transport + 'static>(
    transport: Arc<T>,
    timeout: Duration,
    mut work: RankWork,
    hello: Bytes,
    options: &LoadOptions,
    on_planned: Option<OnPlanned>,
) -> Result<HostLoad, OpsError> {
    let rank = transport.rank();
    let started = Instant::now();
    // Pieces of boxes read in parts by several ranks are folded, and checked in the rounds.
    let mut options = options.clone();
    options.read.joint_checks = true;
    let mut reader = HostRead {
        options: &options,
        on_planned,
        started,
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
            let mut slots: Vec<Slot<'_, Vec<u8>>> = buffers
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
