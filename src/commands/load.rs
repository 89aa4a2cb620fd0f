//! `tessera load`: load a checkpoint into a layout, every rank on this machine (in-process or as
//! separate processes over TCP or NCCL on loopback) or one rank of a real job (`--rank`), into
//! host memory or GPU memory (`--device cuda[:N]`, feature `cuda`), with a report.
//!
//! A rank's load into host memory is the load job's rounds over the job's own transport
//! (`tessera_ops::job`: rank 0 plans once, every rank takes its own plan, the ranks agree on it,
//! read, check the saved boxes read in parts and exchange; `tessera_ops::job::host`), shared with
//! the Python package's torch path. Here are the flags, the ranks this command plays itself
//! (tasks of this process, or `--rank` processes it spawns), and the rendering. GPU memory
//! (`--device cuda`) loads through the CUDA pipeline with a plan made by every rank (`gpu`).

mod args;
mod finish;
#[cfg(feature = "cuda")]
mod gpu;
mod metrics;
mod report;
mod spawn;

use std::io::IsTerminal;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::device::{CUDA_BUILT, cuda_not_built};
use tessera_loader::load::{LoadOptions, RankReport};
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::InProcTransport;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_ops::job::host::{HostJob, HostLoad, OnPlanned, allocated};
use tessera_ops::load::{LoadSwitches, PlanServer, plan_options};
use tessera_ops::publish::lease::{Lease, MAX_LEASE_SECONDS};
use tessera_planner::{ExplicitRequest, ExplicitRequests, PlanSummary, RequestSet};
use tessera_storage::RetryPolicy;

pub use args::{LoadArgs, TransportKind};
pub use finish::dump_names;
pub use spawn::{TOKEN_ENV, rank_args};

/// Refuses what this build or the arguments cannot do, before any work.
fn check_device(args: &LoadArgs) -> Result<()> {
    if args.device.is_cuda() && !CUDA_BUILT {
        return Err(cuda_not_built(&format!("--device {}", args.device)).into());
    }
    // No driver: say so now, not after opening and planning the checkpoint.
    #[cfg(feature = "cuda")]
    if args.device.is_cuda() {
        tessera_loader::device::cuda::probe::driver()?;
    }
    if args.transport == TransportKind::Nccl {
        if !CUDA_BUILT {
            return Err(cuda_not_built("--transport nccl").into());
        }
        if !args.device.is_cuda() {
            bail!("--transport nccl moves data between GPUs: give --device cuda (or cuda:N)");
        }
    }
    Ok(())
}

/// The load's options from the flags (`retry` from the storage flags) and the environment's
/// side-by-side switches.
fn load_options(args: &LoadArgs, retry: &RetryPolicy, switches: &LoadSwitches) -> LoadOptions {
    let read = ReadOptions {
        verify: args.verify,
        retry: retry.clone(),
        coalesce_gap: args.coalesce_gap,
        ..ReadOptions::default()
    };
    tessera_ops::load::load_options(read, switches)
}

/// Runs the command; returns the report text.
pub async fn run(args: &LoadArgs) -> Result<String> {
    // What clap cannot check: a positive --peer-timeout, the storage flags' policy.
    let peer_timeout = args.peer_timeout()?;
    let retry = args.storage.policy()?;
    check_device(args)?;
    let (args, _lease) = with_live_step(args)?;
    let args = &args;
    // Rank processes spawned here share the DCP blob index through a cache directory, so the
    // zip headers are read once (by this process), not once per rank.
    let shared_cache = match (args.rank, args.transport) {
        (None, TransportKind::Tcp | TransportKind::Nccl)
            if std::env::var_os(super::CACHE_DIR_ENV).is_none() =>
        {
            Some(tempfile::tempdir().context("creating a directory for the shared blob index")?)
        }
        _ => None,
    };
    let shared_cache = shared_cache.as_ref().map(|d| d.path());
    let opened = open_checkpoint(args, &retry, shared_cache).await?;
    check_plan_flags(args)?;
    let switches = LoadSwitches::from_env();
    let planning = plan_options(
        args.dedup,
        Some(args.read_order),
        args.transport == TransportKind::Nccl,
        &switches,
    );
    let requests = requests_for(args, &opened)?;
    let ranks = ExplicitRequests::of(&requests, opened.meta.tensors()).ranks;
    // One bound for every wait on a peer, rendezvous included (`HostJob::transport_options`).
    let job = Job {
        args: args.clone(),
        host: HostJob {
            checkpoint: Arc::new(opened),
            location: args.checkpoint.clone(),
            world: ranks.len() as u32,
            planning,
            filter: args.filter().describe(),
            server: plan_server(args)?,
            memory_tier: args.memory_tier.as_ref().map(std::path::PathBuf::from),
            verify: args.verify,
            options: load_options(args, &retry, &switches),
            timeout: peer_timeout,
        },
        requests: Arc::new(ranks),
    };
    #[cfg(feature = "cuda")]
    if args.device.is_cuda() {
        match args.rank {
            Some(rank) if args.transport == TransportKind::Nccl => {
                return gpu::load_rank(&job, &requests, rank).await;
            }
            Some(_) => {}
            None => gpu::check_nccl(args, job.world())?,
        }
    }
    if let Some(rank) = args.rank {
        return load_rank(&job, rank).await;
    }
    let (loaded, kind) = match args.transport {
        TransportKind::InProc => load_all_inproc(&job).await?,
        TransportKind::Tcp | TransportKind::Nccl => {
            let world = job.world();
            let loaded = spawn::load_all_spawned(args, (world, peer_timeout), shared_cache).await?;
            let kind = format!(
                "{} processes on 127.0.0.1{}",
                args.transport.name(),
                on_device(args)
            );
            (loaded, kind)
        }
    };
    finish_job(&job, &loaded, &kind)
}

/// The report of every rank of the job, with the files `--report-json` and `--metrics-file` ask
/// for.
fn finish_job(job: &Job, loaded: &Loaded, kind: &str) -> Result<String> {
    let args = &job.args;
    if let Some(path) = &args.report_json {
        report::write_all_ranks_json(path, &loaded.summary, &loaded.reports)?;
    }
    if let Some(path) = &args.metrics_file {
        metrics::write_metrics(path, &loaded.reports)?;
    }
    Ok(report::report(
        args,
        &job.host.checkpoint,
        &loaded.summary,
        &loaded.reports,
        loaded.plan_seconds,
        kind,
    ))
}

/// What the ranks of a load reported: each rank's report, the job's plan in numbers and how long
/// planning took.
pub(crate) struct Loaded {
    pub(crate) reports: Vec<RankReport>,
    pub(crate) summary: PlanSummary,
    pub(crate) plan_seconds: f64,
}

/// `args` with a `live://NAME[@STEP]` checkpoint resolved in `--registry` to its step's
/// location (`live+file://`), once, so that every rank this command spawns loads the same step
/// (ranks of a real job, `--rank`, should name the step: `live://NAME@STEP`), and a lease on that
/// step which keeps its publisher from retiring it until the returned guard is dropped (the
/// load's end, however it ends; a killed command's lease runs out after
/// `MAX_LEASE_SECONDS`). A registry that cannot hold the lease is said on stderr, and the load
/// goes on: should the step be retired meanwhile, a read fails naming its publisher.
fn with_live_step(args: &LoadArgs) -> Result<(LoadArgs, Option<Lease>)> {
    let Some((name, step)) = tessera_ops::publish::listing::parse_live_url(&args.checkpoint)?
    else {
        return Ok((args.clone(), None));
    };
    let registry = args.registry.as_ref().with_context(|| {
        format!(
            "{}: a live publication is found in a registry: give --registry DIR",
            args.checkpoint
        )
    })?;
    let (step, dir) = tessera_ops::publish::listing::resolve(registry, name, step)
        .with_context(|| args.checkpoint.clone())?;
    let lease = match Lease::take(&dir, MAX_LEASE_SECONDS) {
        Ok(lease) => Some(lease),
        Err(e) => {
            eprintln!("warning: {e}: the publisher may retire the step while this load reads it");
            None
        }
    };
    if !args.quiet && !args.json {
        let held = lease
            .as_ref()
            .and_then(Lease::path)
            .map_or(String::new(), |p| format!(", leased by {}", p.display()));
        eprintln!("{}: step {step} ({}){held}", args.checkpoint, dir.display());
    }
    let mut resolved = args.clone();
    resolved.checkpoint = format!("live+file://{}", dir.display());
    Ok((resolved, lease))
}

/// Refuses flags that cannot plan together, before any rank starts.
fn check_plan_flags(args: &LoadArgs) -> Result<()> {
    match (&args.memory_tier, &args.server) {
        (Some(_), Some(url)) => {
            let refusal = tessera_ops::memory_tier::refuse_with_server(&format!("--server {url}"));
            return Err(refusal.into());
        }
        (Some(_), None) if args.transport == TransportKind::Nccl => {
            bail!("--memory-tier is not supported with --transport nccl yet; use --transport tcp")
        }
        _ => {}
    }
    if args.server.is_some() && !args.filter().is_everything() {
        bail!(
            "--include/--exclude filter a plan made here; a server plans every tensor (drop --server)"
        );
    }
    Ok(())
}

/// The tessera server that plans the job (`--server`), with the checkpoint's id there
/// (`--checkpoint-id`, by default the last two components of the location).
fn plan_server(args: &LoadArgs) -> Result<Option<PlanServer>> {
    let Some(url) = &args.server else {
        return Ok(None);
    };
    Ok(Some(PlanServer::for_checkpoint(
        url.clone(),
        &args.checkpoint,
        args.checkpoint_id.clone(),
        args.token.clone(),
        "--checkpoint-id <run>/<step>",
    )?))
}

/// One load job as this command runs its ranks: the flags, what every rank loads with
/// (`tessera_ops::job::host::HostJob`), and each rank's requests.
#[derive(Clone)]
pub(crate) struct Job {
    args: LoadArgs,
    host: HostJob,
    requests: Arc<Vec<Vec<ExplicitRequest>>>,
}

impl Job {
    fn world(&self) -> u32 {
        self.host.world
    }

    /// Rank `rank`'s requests.
    fn requests_of(&self, rank: u32) -> Vec<ExplicitRequest> {
        self.requests
            .get(rank as usize)
            .cloned()
            .unwrap_or_default()
    }

    /// What this command does with a rank's host load: the upload to its GPU (`--device cuda`),
    /// else `--check` and `--dump` of its buffers.
    fn finish_rank(&self, loaded: HostLoad) -> Result<HostLoad> {
        #[cfg(feature = "cuda")]
        if self.args.device.is_cuda() {
            return gpu::upload(&self.args, loaded);
        }
        finish::finish_rank(&self.args, &loaded.plan, &loaded.buffers)?;
        Ok(loaded)
    }
}

/// This process's one rank of a job (`--rank`): the shared driver meets the other ranks at the
/// rendezvous and runs its load over TCP (`HostJob::load_rank_over_tcp`); here the flags checked
/// and the rank's report.
async fn load_rank(job: &Job, rank: u32) -> Result<String> {
    let args = &job.args;
    let world = job.world();
    if let Some(w) = args.world
        && w != world
    {
        bail!("--world {w} but the layout has {world} ranks");
    }
    let (config, texts) = rendezvous(job, rank)?;
    let texts: Vec<&[u8]> = texts.iter().map(|t| t.as_bytes()).collect();
    let loaded = job
        .host
        .load_rank_over_tcp((config, &texts), job.requests_of(rank), allocated(), None)
        .await?;
    let loaded = job.finish_rank(loaded)?;
    for why in &loaded.work.tier_copies().ignored {
        eprintln!("warning: memory tier: {why}");
    }
    let summary = loaded.job_summary()?.clone();
    if let Some(path) = &args.report_json {
        spawn::write_rank_json(path, &loaded.report, &summary, loaded.plan_seconds)?;
    }
    if let Some(path) = &args.metrics_file {
        metrics::write_metrics(path, std::slice::from_ref(&loaded.report))?;
    }
    Ok(report::report(
        args,
        &job.host.checkpoint,
        &summary,
        &[loaded.report],
        loaded.plan_seconds,
        &format!("tcp, one rank{}", on_device(args)),
    ))
}

/// Every rank of the job in this process, each on its own task over an in-process mesh; returns
/// what they reported and how the ranks ran.
async fn load_all_inproc(job: &Job) -> Result<(Loaded, String)> {
    let mut job = job.clone();
    let kind = format!("in-process{}", on_device(&job.args));
    // A bar only where a person watches: not with --quiet, not into a pipe or a log file. Its
    // length is the job's bytes to read, known once rank 0 planned.
    let bar = (!job.args.quiet && std::io::stderr().is_terminal()).then(|| {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "  read {binary_bytes} of {binary_total_bytes} ({percent}%) {wide_bar} {binary_bytes_per_sec}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    let on_planned = bar.clone().map(|bar| -> OnPlanned {
        Arc::new(move |summary: &PlanSummary| bar.set_length(summary.bytes_read))
    });
    if let Some(bar) = bar.clone() {
        job.host.options.progress = Some(Arc::new(move |bytes| bar.inc(bytes)));
    }
    let transports = InProcTransport::mesh(job.world(), job.host.transport_options());
    let mut tasks = Vec::with_capacity(transports.len());
    for (rank, transport) in transports.into_iter().enumerate() {
        let (job, on_planned) = (job.clone(), on_planned.clone());
        let rank = rank as u32;
        tasks.push(tokio::spawn(async move {
            let loaded = job
                .host
                .load_rank(
                    (rank, job.requests_of(rank)),
                    transport,
                    allocated(),
                    on_planned,
                )
                .await?;
            job.finish_rank(loaded)
        }));
    }
    let loads = crate::ranks::join_tasks(tasks).await;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let loads = loads?;
    let first = loads.first().context("a job of no ranks")?;
    // The node's ranks share one tier and its verdicts: said once.
    for why in &first.work.tier_copies().ignored {
        eprintln!("warning: memory tier: {why}");
    }
    let loaded = Loaded {
        summary: first.job_summary()?.clone(),
        plan_seconds: first.plan_seconds,
        reports: loads.into_iter().map(|l| l.report).collect(),
    };
    Ok((loaded, kind))
}

/// Opens the checkpoint to load (its DCP blob index shared through `shared_cache` when given),
/// saying its warnings; a metadata-only checkpoint is refused.
async fn open_checkpoint(
    args: &LoadArgs,
    retry: &RetryPolicy,
    shared_cache: Option<&std::path::Path>,
) -> Result<Checkpoint> {
    let checkpoint = super::open_for_load(&args.checkpoint, retry, shared_cache).await?;
    for warning in &checkpoint.warnings {
        eprintln!("warning: {warning}");
    }
    Ok(checkpoint)
}

/// Every rank's requests: the target (`--layout`, `--requests`) as filtered (`--include`,
/// `--exclude`).
fn requests_for(args: &LoadArgs, checkpoint: &Checkpoint) -> Result<RequestSet> {
    let mut requests = super::target::resolve(
        &args.checkpoint,
        (args.layout.as_deref(), args.requests.as_deref()),
        &checkpoint.meta,
        None,
        args.rank.unwrap_or(0) == 0,
    )?;
    args.filter().apply(
        &mut requests,
        checkpoint.meta.tensors(),
        checkpoint.meta.objects(),
        &args.checkpoint,
    )?;
    Ok(requests)
}

/// Where the report says the bytes went: nothing for host memory, `, cuda[:N]` for a GPU.
fn on_device(args: &LoadArgs) -> String {
    if args.device.is_cuda() {
        format!(", {}", args.device)
    } else {
        String::new()
    }
}

/// Rank `rank`'s place in tessera's own TCP rendezvous by the one rule of
/// `tessera_ops::load::rendezvous` (flags, then `TESSERA_PORT`, then torchrun's `MASTER_ADDR` and
/// `MASTER_PORT + 1`), and the texts that make it this job's only besides the checkpoint as
/// opened and the world (`HostJob::rendezvous`): the layout or requests files as read.
fn rendezvous(job: &Job, rank: u32) -> Result<(RendezvousConfig, Vec<String>)> {
    let args = &job.args;
    let config = tessera_ops::load::rendezvous::rank_rendezvous(
        args.master_addr.as_deref(),
        args.master_port,
        rank,
        job.world(),
        |name| std::env::var(name).ok(),
    )?;
    let mut texts: Vec<String> = Vec::new();
    for path in [&args.layout, &args.requests].into_iter().flatten() {
        texts.push(super::read_text(path)?);
    }
    Ok((config, texts))
}
