//! `tessera load`: load a checkpoint into a layout, every rank on this machine (in-process or as
//! separate processes over TCP or NCCL on loopback) or one rank of a real job (`--rank`), into
//! host memory or GPU memory (`--device cuda[:N]`, feature `cuda`), with a report.
//!
//! What a rank's load *is* (the plan source, the rendezvous rule, the options, the pipeline into
//! host or CUDA memory) is `tessera_ops::load`, shared with the Python package; here are the
//! flags, the ranks this command plays itself, and the rendering.

mod finish;
#[cfg(feature = "cuda")]
mod gpu;
mod metrics;
mod report;
mod spawn;

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::device::{CUDA_BUILT, DeviceSpec, cuda_not_built};
use tessera_loader::exchange::place;
use tessera_loader::load::{LoadOptions, RankReport};
use tessera_loader::plan_client::{PlanTarget, server_checkpoint_id};
use tessera_loader::read::ReadOptions;
use tessera_loader::tier::TierCopies;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{InProcTransport, TcpTransport, Transport, TransportOptions};
use tessera_ops::load::agreement;
use tessera_ops::load::{Destination, JobPlan, LoadSwitches, PlanServer, plan_options};
use tessera_ops::memory_tier::{TierLoad, settle_over, sources_of, view_with_tier};
use tessera_planner::{ExplicitRequests, PlanOptions, RankPlan, ReadOrder, RequestSet};

pub use finish::dump_names;

/// How ranks talk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// Threads of this process.
    InProc,
    /// Separate processes over TCP (loopback when run by `load` itself).
    Tcp,
    /// Separate processes, TCP for control and NCCL for data, GPU to GPU (feature `cuda`).
    Nccl,
}

impl TransportKind {
    fn name(self) -> &'static str {
        match self {
            TransportKind::InProc => "inproc",
            TransportKind::Tcp => "tcp",
            TransportKind::Nccl => "nccl",
        }
    }
}

/// Arguments of `tessera load`.
#[derive(Clone, Debug)]
pub struct LoadArgs {
    /// Checkpoint location.
    pub checkpoint: String,
    /// Target layout JSON file.
    pub layout: Option<String>,
    /// Explicit requests JSON file.
    pub requests: Option<String>,
    /// Write `DIR/rank-<r>.safetensors` per rank.
    pub dump: Option<String>,
    /// Transport between ranks.
    pub transport: TransportKind,
    /// Where the destination buffers live.
    pub device: DeviceSpec,
    /// Run only this rank (a real job's rank; rendezvous from flags or torchrun's environment).
    pub rank: Option<u32>,
    /// World size with `--rank`.
    pub world: Option<u32>,
    /// Rendezvous address with `--rank`.
    pub master_addr: Option<String>,
    /// Rendezvous port with `--rank`.
    pub master_port: Option<u16>,
    /// Verify block checksums of what is read.
    pub verify: bool,
    /// Read each shared piece once and exchange it.
    pub dedup: bool,
    /// Largest gap one storage request may span (`--coalesce-gap`); `None`: the store kind's
    /// default (`tessera_loader::read::default_coalesce_gap`).
    pub coalesce_gap: Option<u64>,
    /// Check every loaded byte against the synthetic value formula.
    pub check: bool,
    /// This host's memory tier (`--memory-tier`): copies read instead of storage.
    pub memory_tier: Option<String>,
    /// Write the JSON report here (used by the per-rank processes of `--transport tcp`).
    pub report_json: Option<String>,
    /// Write the load's counters here in the OpenMetrics text format (`--metrics-file`).
    pub metrics_file: Option<String>,
    /// How saved chunks are read (`--read-order`).
    pub read_order: ReadOrder,
    /// Seconds a rank waits for a peer before giving up.
    pub peer_timeout: Duration,
    /// Print the progress bar and report.
    pub quiet: bool,
    /// Fetch rank plans from this tessera server instead of planning here.
    pub server: Option<String>,
    /// The checkpoint's id on the server (`<run>/<step>`); by default the last two components
    /// of the checkpoint location.
    pub checkpoint_id: Option<String>,
    /// Bearer token of the server (the CLI fills it from `TESSERA_TOKEN` when not given).
    pub token: Option<String>,
    /// Timeouts and attempts of every storage request, for the store and the reads alike
    /// (`--storage-read-timeout`, `--storage-attempts`): with a store that stalls, they bound
    /// how soon the load fails (docs/retry.md).
    pub retry: tessera_storage::RetryPolicy,
    /// Load only the tensors this takes (`--include`, `--exclude`).
    pub filter: super::select::TensorFilter,
    /// Print the report as one JSON document (`--json`).
    pub json: bool,
}

/// The server's plan of this job: `--server` with the checkpoint's id there (`--checkpoint-id`, by
/// default the last two components of the location) and the layout or requests.
async fn plan_on_server(args: &LoadArgs, server: &str, checkpoint: &Checkpoint) -> Result<JobPlan> {
    let id = match &args.checkpoint_id {
        Some(id) => id.clone(),
        None => server_checkpoint_id(&args.checkpoint).with_context(|| {
            format!(
                "cannot tell the server-side id of {}; give --checkpoint-id <run>/<step>",
                args.checkpoint
            )
        })?,
    };
    let target = match (&args.layout, &args.requests) {
        (Some(layout), None) => PlanTarget::Layout(super::read_layout(layout)?),
        (None, Some(path)) => PlanTarget::Requests(
            ExplicitRequests::from_json(&super::read_text(path)?)
                .with_context(|| format!("reading requests {path}"))?,
        ),
        _ => bail!("give exactly one of --layout or --requests"),
    };
    let server = PlanServer {
        url: server.to_string(),
        checkpoint_id: id,
        token: args.token.clone(),
    };
    Ok(JobPlan::on_server(checkpoint, &args.checkpoint, &server, &target, args.dedup).await?)
}

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

/// The load's options from the flags and the environment's side-by-side switches.
fn load_options(args: &LoadArgs, switches: &LoadSwitches) -> LoadOptions {
    let read = ReadOptions {
        verify: args.verify,
        retry: args.retry.clone(),
        coalesce_gap: args.coalesce_gap,
        ..ReadOptions::default()
    };
    tessera_ops::load::load_options(read, switches)
}

/// Runs the command; returns the report text.
pub async fn run(args: &LoadArgs) -> Result<String> {
    check_device(args)?;
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
    let opened = open_checkpoint(args, shared_cache.as_ref().map(|d| d.path())).await?;
    let (checkpoint, tier) = with_memory_tier(args, opened.clone())?;
    let switches = LoadSwitches::from_env();
    let started = Instant::now();
    let planning = plan_options(
        args.dedup,
        Some(args.read_order),
        args.transport == TransportKind::Nccl,
        &switches,
    );
    let plan = job_plan(args, &checkpoint, tier.as_ref(), &planning).await?;
    let plan_seconds = started.elapsed().as_secs_f64();
    let options = load_options(args, &switches);
    // One bound for every wait on a peer, rendezvous included (it had its own 300 s default).
    let transport_options = TransportOptions {
        timeout: args.peer_timeout,
        connect_timeout: args.peer_timeout,
        progress_every: Some(progress_interval(args.peer_timeout)),
    };
    #[cfg(feature = "cuda")]
    if args.rank.is_none() {
        gpu::check_nccl(args, plan.world())?;
    }

    if let Some(rank) = args.rank {
        let job = JobAt {
            opened: &opened,
            checkpoint: &checkpoint,
            plan: &plan,
            planning: &planning,
        };
        let (report, memory) = load_rank(args, rank, &job, transport_options, &options).await?;
        if let Some(path) = &args.report_json {
            std::fs::write(path, serde_json::to_vec(&report)?)
                .with_context(|| format!("writing {path}"))?;
        }
        if let Some(path) = &args.metrics_file {
            metrics::write_metrics(path, std::slice::from_ref(&report))?;
        }
        let kind = match memory.label() {
            None => "tcp, one rank".to_string(),
            Some(device) => format!("{}, one rank, {device}", args.transport.name()),
        };
        return Ok(report::report(
            args,
            &checkpoint,
            &plan,
            &[report],
            plan_seconds,
            &kind,
        ));
    }

    let (reports, kind) = match args.transport {
        TransportKind::InProc => {
            load_all_inproc(args, &checkpoint, &plan, options, transport_options).await?
        }
        TransportKind::Tcp | TransportKind::Nccl => {
            let reports =
                spawn::load_all_tcp(args, plan.world(), shared_cache.as_ref().map(|d| d.path()))
                    .await?;
            let mut kind = format!("{} processes on 127.0.0.1", args.transport.name());
            if args.device.is_cuda() {
                kind.push_str(&format!(", {}", args.device));
            }
            (reports, kind)
        }
    };
    if let Some(path) = &args.report_json {
        report::write_all_ranks_json(path, &plan, &reports)?;
    }
    if let Some(path) = &args.metrics_file {
        metrics::write_metrics(path, &reports)?;
    }
    Ok(report::report(
        args,
        &checkpoint,
        &plan,
        &reports,
        plan_seconds,
        &kind,
    ))
}

/// Opens the checkpoint to load (its DCP blob index shared through `shared_cache` when given),
/// saying its warnings; a metadata-only checkpoint is refused.
async fn open_checkpoint(
    args: &LoadArgs,
    shared_cache: Option<&std::path::Path>,
) -> Result<Checkpoint> {
    let mut open_options = super::open_options();
    if let Some(dir) = shared_cache {
        open_options.dcp.cache_dir = Some(dir.to_path_buf());
    }
    let location =
        tessera_storage::open_with(&args.checkpoint, &super::storage_options(&args.retry))?;
    tessera_ops::open::check_local(&args.checkpoint)
        .with_context(|| format!("opening checkpoint {}", args.checkpoint))?;
    let checkpoint = Checkpoint::open_with(location, &open_options)
        .await
        .with_context(|| format!("opening checkpoint {}", args.checkpoint))?;
    for warning in &checkpoint.warnings {
        eprintln!("warning: {warning}");
    }
    if !checkpoint.has_data {
        bail!(
            "{}: a metadata-only checkpoint has no data to load",
            args.checkpoint
        );
    }
    Ok(checkpoint)
}

/// The checkpoint as this command plans it, and the memory tier copies its ranks share. A rank
/// of a job (--rank) verifies its share of its node's copies with the other ranks (in
/// [`load_rank`]); this command's own ranks share one tier, verified here once.
fn with_memory_tier(
    args: &LoadArgs,
    checkpoint: Checkpoint,
) -> Result<(Checkpoint, Option<TierCopies>)> {
    Ok(match &args.memory_tier {
        Some(_) if args.server.is_some() => bail!(
            "--memory-tier: a plan server plans reads from storage only; drop --server to read from the tier"
        ),
        Some(_) if args.transport == TransportKind::Nccl => {
            bail!("--memory-tier is not supported with --transport nccl yet; use --transport tcp")
        }
        Some(_) if args.rank.is_some() => (checkpoint, None),
        Some(dir) => {
            let (view, copies) = view_with_tier(&checkpoint, std::path::Path::new(dir))?;
            for why in &copies.ignored {
                eprintln!("warning: memory tier {dir}: {why}");
            }
            (view, Some(copies))
        }
        None => (checkpoint, None),
    })
}

/// The job's plan: from the plan server (--server), or made here, reading what `tier` holds
/// from it.
async fn job_plan(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    tier: Option<&TierCopies>,
    planning: &PlanOptions,
) -> Result<JobPlan> {
    Ok(match &args.server {
        Some(_) if !args.filter.is_everything() => bail!(
            "--include/--exclude filter a plan made here; a server plans every tensor (drop --server)"
        ),
        Some(server) => plan_on_server(args, server, checkpoint).await?,
        None => {
            let requests = requests_for(args, checkpoint)?;
            // Every rank of this command (in-process, or spawned on this host) sees the same
            // tier; a rank of a job over several hosts (--rank) plans again with every rank's
            // offer once the ranks meet.
            let offers = match (tier, args.rank) {
                (Some(copies), None) => {
                    vec![copies.file_indices(); requests.world_size() as usize]
                }
                _ => Vec::new(),
            };
            JobPlan::local_with_sources(checkpoint, &requests, planning, &sources_of(&offers))?
        }
    })
}

/// What one rank of a job (--rank) loads from: the checkpoint as opened (whose node tier copies
/// it offers), as planned, the job's plan and the options it was planned with.
struct JobAt<'a> {
    opened: &'a Checkpoint,
    checkpoint: &'a Checkpoint,
    plan: &'a JobPlan,
    planning: &'a PlanOptions,
}

/// Loads this process's one rank of a job: meets the other ranks, settles the memory tier
/// copies with them (planning again over those when there is a tier), and loads over TCP (or
/// NCCL) into the rank's memory, which it returns with the report.
async fn load_rank(
    args: &LoadArgs,
    rank: u32,
    job: &JobAt<'_>,
    transport_options: TransportOptions,
    options: &LoadOptions,
) -> Result<(RankReport, RankMemory)> {
    let world = job.plan.world();
    if let Some(w) = args.world
        && w != world
    {
        bail!("--world {w} but the layout has {world} ranks");
    }
    let config = rendezvous(args, job.checkpoint, job.planning, rank, world)?;
    let memory = RankMemory::for_rank(args, rank, true)?;
    let rank_plan = job.plan.rank_plan(rank).await?;
    let report = match args.transport {
        #[cfg(feature = "cuda")]
        TransportKind::Nccl => {
            gpu::load_nccl(
                args,
                job.checkpoint,
                rank_plan,
                &config,
                transport_options,
                &memory,
                options,
            )
            .await?
        }
        _ => {
            let transport = TcpTransport::connect(&config, transport_options).await?;
            // Every rank takes part (offering nothing without a tier), so that ranks that
            // disagree on --memory-tier still meet.
            let found = TierLoad::find(
                job.opened,
                args.memory_tier.as_deref().map(std::path::Path::new),
            );
            let (view, sources, copies) = settle_over(&found, job.opened, &transport).await?;
            for why in &copies.ignored {
                eprintln!("warning: memory tier: {why}");
            }
            let rank_plan = if args.memory_tier.is_some() {
                let requests = requests_for(args, &view)?;
                JobPlan::local_with_sources(&view, &requests, job.planning, &sources)?
                    .rank_plan(rank)
                    .await?
            } else {
                rank_plan
            };
            let checkpoint = view;
            load_one(args, &checkpoint, rank_plan, &transport, &memory, options).await?
        }
    };
    Ok((report, memory))
}

/// Where one rank's buffers live.
enum RankMemory {
    /// Host memory.
    Host,
    /// A CUDA device (`--device cuda[:N]`).
    #[cfg(feature = "cuda")]
    Cuda(tessera_loader::device::cuda::CudaDevice),
}

impl RankMemory {
    /// Rank `rank`'s memory as `--device` says; `from_env`: a rank of a real job (its GPU from
    /// torchrun's `LOCAL_RANK`), else a rank this process plays itself.
    fn for_rank(args: &LoadArgs, rank: u32, from_env: bool) -> Result<RankMemory> {
        match args.device {
            DeviceSpec::Cpu => Ok(RankMemory::Host),
            #[cfg(feature = "cuda")]
            DeviceSpec::Cuda(_) => Ok(RankMemory::Cuda(gpu::open_device(args, rank, from_env)?)),
            #[cfg(not(feature = "cuda"))]
            DeviceSpec::Cuda(_) => {
                let _ = (rank, from_env);
                Err(cuda_not_built(&format!("--device {}", args.device)).into())
            }
        }
    }

    /// The device's label (`cuda:0 (NVIDIA H100 ...)`); `None` for host memory.
    fn label(&self) -> Option<String> {
        match self {
            RankMemory::Host => None,
            #[cfg(feature = "cuda")]
            RankMemory::Cuda(device) => Some(device.label()),
        }
    }
}

/// Loads rank `plan.rank` over `transport` into `memory` (the pipeline every front end shares,
/// `tessera_ops::load::load_rank`), then checks and dumps its buffers.
async fn load_one<T: Transport>(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: RankPlan,
    transport: &T,
    memory: &RankMemory,
    options: &LoadOptions,
) -> Result<RankReport> {
    match memory {
        RankMemory::Host => {
            let mut buffers = place::allocate(&plan);
            let report = tessera_ops::load::load_rank(
                checkpoint,
                &plan,
                transport,
                Destination::Host(&mut buffers),
                options,
            )
            .await?;
            finish::finish_rank(args, &plan, &buffers)?;
            Ok(report)
        }
        #[cfg(feature = "cuda")]
        RankMemory::Cuda(device) => {
            gpu::load_one(args, checkpoint, plan, transport, device, options).await
        }
    }
}

fn requests_for(args: &LoadArgs, checkpoint: &Checkpoint) -> Result<RequestSet> {
    let mut requests = match (&args.layout, &args.requests) {
        (Some(path), None) => {
            let layout = super::read_layout(path)?;
            let requests = layout
                .resolve(checkpoint.meta.tensors())
                .with_context(|| format!("resolving layout {path} against {}", args.checkpoint))?;
            // Once per job: every rank of a real job resolves the same layout.
            if args.rank.unwrap_or(0) == 0 {
                super::warn_layout(path, &layout, checkpoint.meta.tensors());
            }
            requests
        }
        (None, Some(path)) => ExplicitRequests::from_json(&super::read_text(path)?)
            .and_then(|r| r.resolve(checkpoint.meta.tensors()))
            .with_context(|| format!("reading requests {path}"))?,
        _ => bail!("give exactly one of --layout or --requests"),
    };
    args.filter.apply(
        &mut requests,
        checkpoint.meta.tensors(),
        checkpoint.meta.objects(),
        &args.checkpoint,
    )?;
    Ok(requests)
}

/// How often a waiting rank says whom it waits for: every 5 s, more often for a short timeout
/// (a quarter of it, at least 1 s) so that a wait always says something before it fails.
fn progress_interval(timeout: Duration) -> Duration {
    (timeout / 4).clamp(Duration::from_secs(1), Duration::from_secs(5))
}

/// A fingerprint of which job this is: what it loads (the checkpoint as opened, not as named:
/// see `tessera_ops::load::agreement`) into what (the layout or requests as text, the world).
/// Rank 0 turns away a connection whose fingerprint differs as another job's; how the plan is
/// made (read order, dedup, filter, server) is compared option by option instead
/// ([`plan_terms`]).
fn job_fingerprint(args: &LoadArgs, checkpoint: &Checkpoint, world: u32) -> Result<u64> {
    let key = agreement::checkpoint_key(checkpoint, &args.checkpoint)?;
    let mut parts: Vec<String> = Vec::new();
    for path in [&args.layout, &args.requests].into_iter().flatten() {
        parts.push(super::read_text(path)?);
    }
    let parts: Vec<&[u8]> = parts.iter().map(|p| p.as_bytes()).collect();
    Ok(agreement::job_fingerprint(&key, &parts, world))
}

/// The options of this job's plan that every rank must share: planned here with `planning` (as
/// `checkpoint` plans with them) and the tensor filter, or on the server.
fn plan_terms(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    planning: &PlanOptions,
) -> Vec<(String, String)> {
    let server = args.server.as_ref().map(|url| PlanServer {
        url: url.clone(),
        // As the plan was asked for (`plan_on_server`, which fails when there is none).
        checkpoint_id: args
            .checkpoint_id
            .clone()
            .or_else(|| server_checkpoint_id(&args.checkpoint))
            .unwrap_or_default(),
        token: None,
    });
    agreement::job_plan_terms(
        checkpoint,
        planning,
        &args.filter.describe(),
        server.as_ref(),
    )
}

/// Rank `rank`'s rendezvous by the one rule of `tessera_ops::load::rendezvous` (flags, then
/// `TESSERA_PORT`, then torchrun's `MASTER_ADDR` and `MASTER_PORT + 1`), for this job only, and
/// with the plan options every rank must share.
fn rendezvous(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    planning: &PlanOptions,
    rank: u32,
    world: u32,
) -> Result<RendezvousConfig> {
    let job = job_fingerprint(args, checkpoint, world)?;
    let config = tessera_ops::load::rendezvous::rank_rendezvous(
        args.master_addr.as_deref(),
        args.master_port,
        rank,
        world,
        |name| std::env::var(name).ok(),
    )?;
    Ok(config
        .with_job(job)
        .with_plan(plan_terms(args, checkpoint, planning)))
}

/// Every rank of the job in this process, each on its own task over an in-process mesh (each on
/// its GPU with `--device cuda`); returns the reports and how the ranks ran.
async fn load_all_inproc(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: &JobPlan,
    mut options: LoadOptions,
    transport_options: TransportOptions,
) -> Result<(Vec<RankReport>, String)> {
    let world = plan.world();
    let total = plan.summary().bytes_read;
    // A bar only where a person watches: not with --quiet, not into a pipe or a log file.
    let bar = (!args.quiet && std::io::stderr().is_terminal()).then(|| {
        let bar = ProgressBar::new(total);
        bar.set_style(
            ProgressStyle::with_template(
                "  read {binary_bytes} of {binary_total_bytes} ({percent}%) {wide_bar} {binary_bytes_per_sec}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    });
    if let Some(bar) = bar.clone() {
        options.progress = Some(Arc::new(move |bytes| bar.inc(bytes)));
    }
    let transports = InProcTransport::mesh(world, transport_options);
    let mut tasks = Vec::with_capacity(world as usize);
    let mut devices = Vec::new();
    for (rank, transport) in transports.into_iter().enumerate() {
        let rank = rank as u32;
        let memory = RankMemory::for_rank(args, rank, false)?;
        devices.extend(memory.label());
        let rank_plan = plan.rank_plan(rank).await?;
        let (args, checkpoint, options) = (args.clone(), checkpoint.clone(), options.clone());
        tasks.push(tokio::spawn(async move {
            load_one(&args, &checkpoint, rank_plan, &transport, &memory, &options).await
        }));
    }
    let mut reports = Vec::with_capacity(tasks.len());
    let mut failures = Vec::new();
    let mut classes = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        match task.await {
            Ok(Ok(report)) => reports.push(report),
            Ok(Err(e)) => {
                classes.push(crate::exit::classify(&e));
                failures.push(format!("rank {rank}: {e}"));
            }
            Err(e) => {
                classes.push(crate::exit::ErrorClass::Other);
                failures.push(format!("rank {rank}: task failed: {e}"));
            }
        }
    }
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    if !failures.is_empty() {
        // Its own type: the exit code is that of the rank whose trouble made the others fail.
        return Err(crate::exit::RanksFailed {
            failures,
            class: crate::exit::root_class(classes),
        }
        .into());
    }
    devices.dedup();
    let mut kind = "in-process".to_string();
    if !devices.is_empty() {
        kind.push_str(&format!(", {}", devices.join(" ")));
    }
    Ok((reports, kind))
}
