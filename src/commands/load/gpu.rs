//! `tessera load --device cuda[:N]` (feature `cuda`): what is the command's own about GPUs. Each
//! rank's GPU, its destinations allocated there, the NCCL rules, and copying the buffers back
//! for `--check` and `--dump`; the load itself is the shared pipeline
//! (`tessera_ops::load::load_rank` into a CUDA destination, or over NCCL).
//!
//! Not on the load job's rounds yet (`tessera_ops::job`, which read into host buffers): every
//! rank plans the whole job here (or fetches the server's), a rank of a real job (`--rank`)
//! settles the memory tier with its peers over the job's transport and plans again, and the
//! pipeline agrees on the plan and checks jointly read boxes over the transport itself.

use std::io::IsTerminal;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::device::DeviceSpec;
use tessera_loader::device::cuda::{CudaDevice, DeviceBuffer, connect_nccl};
use tessera_loader::load::{LoadOptions, RankReport};
use tessera_loader::plan_client::PlanTarget;
use tessera_loader::tier::TierCopies;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{InProcTransport, TcpTransport, Transport, TransportOptions};
use tessera_ops::load::cuda::{CudaDestination, load_rank_nccl};
use tessera_ops::load::{Destination, JobPlan};
use tessera_ops::memory_tier::{TierLoad, settle_over, sources_of, view_with_tier};
use tessera_planner::{ExplicitRequests, RankPlan, RequestSet};

use super::{Job, LoadArgs, Loaded, TransportKind, finish_job, rendezvous, report, spawn};

/// Loads the job into GPU memory: every rank of this machine (in-process, or spawned processes
/// over TCP or NCCL), or this process's one rank of a real job (`--rank`).
pub(super) async fn run(
    job: &Job,
    requests: &RequestSet,
    transport_options: TransportOptions,
    shared_cache: Option<&std::path::Path>,
) -> Result<String> {
    let args = &job.args;
    let started = Instant::now();
    let (checkpoint, tier) = with_memory_tier(args, (*job.opened).clone())?;
    let plan = job_plan(job, &checkpoint, tier.as_ref(), requests).await?;
    let plan_seconds = started.elapsed().as_secs_f64();
    let world = plan.world();
    if let Some(rank) = args.rank {
        return load_rank(
            job,
            &checkpoint,
            &plan,
            rank,
            transport_options,
            plan_seconds,
        )
        .await;
    }
    check_nccl(args, world)?;
    let (reports, kind) = match args.transport {
        TransportKind::InProc => {
            load_all_inproc(job, &checkpoint, &plan, transport_options).await?
        }
        TransportKind::Tcp | TransportKind::Nccl => {
            let loaded = spawn::load_all_tcp(args, world, shared_cache).await?;
            let kind = format!(
                "{} processes on 127.0.0.1, {}",
                args.transport.name(),
                args.device
            );
            (loaded.reports, kind)
        }
    };
    let loaded = Loaded {
        reports,
        summary: plan.summary().clone(),
        plan_seconds,
    };
    finish_job(job, &loaded, &kind)
}

/// The checkpoint as this command plans it, and the memory tier copies its ranks share. A rank
/// of a job (--rank) verifies its share of its node's copies with the other ranks (in
/// [`load_rank`]); this command's own ranks share one tier, verified here once.
fn with_memory_tier(
    args: &LoadArgs,
    checkpoint: Checkpoint,
) -> Result<(Checkpoint, Option<TierCopies>)> {
    Ok(match &args.memory_tier {
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
    job: &Job,
    checkpoint: &Checkpoint,
    tier: Option<&TierCopies>,
    requests: &RequestSet,
) -> Result<JobPlan> {
    let args = &job.args;
    if let Some(server) = &job.server {
        let target = PlanTarget::Requests(ExplicitRequests {
            ranks: job.requests.to_vec(),
        });
        return Ok(
            JobPlan::on_server(checkpoint, &args.checkpoint, server, &target, args.dedup).await?,
        );
    }
    // Every rank of this command (in-process, or spawned on this host) sees the same tier; a
    // rank of a job over several hosts (--rank) plans again with every rank's offer once the
    // ranks meet.
    let offers = match (tier, args.rank) {
        (Some(copies), None) => vec![copies.file_indices(); requests.world_size() as usize],
        _ => Vec::new(),
    };
    Ok(JobPlan::local_with_sources(
        checkpoint,
        requests,
        &job.planning,
        &sources_of(&offers),
    )?)
}

/// Loads this process's one rank of a job: meets the other ranks, settles the memory tier
/// copies with them (planning again over those when there is a tier), and loads over TCP (or
/// NCCL) into the rank's GPU.
async fn load_rank(
    job: &Job,
    checkpoint: &Checkpoint,
    plan: &JobPlan,
    rank: u32,
    transport_options: TransportOptions,
    plan_seconds: f64,
) -> Result<String> {
    let args = &job.args;
    let world = plan.world();
    if let Some(w) = args.world
        && w != world
    {
        bail!("--world {w} but the layout has {world} ranks");
    }
    let config = rendezvous(job, rank)?;
    let device = open_device(args, rank, true)?;
    let rank_plan = plan.rank_plan(rank).await?;
    let report = match args.transport {
        TransportKind::Nccl => {
            load_nccl(
                args,
                checkpoint,
                rank_plan,
                &config,
                transport_options,
                &device,
                &job.options,
            )
            .await?
        }
        _ => {
            let transport = TcpTransport::connect(&config, transport_options).await?;
            // Every rank takes part (offering nothing without a tier), so that ranks that
            // disagree on --memory-tier still meet.
            let found = TierLoad::find(
                &job.opened,
                args.memory_tier.as_deref().map(std::path::Path::new),
            );
            let (view, sources, copies) = settle_over(&found, &job.opened, &transport).await?;
            for why in &copies.ignored {
                eprintln!("warning: memory tier: {why}");
            }
            let rank_plan = if args.memory_tier.is_some() {
                let requests = super::requests_for(args, &view)?;
                JobPlan::local_with_sources(&view, &requests, &job.planning, &sources)?
                    .rank_plan(rank)
                    .await?
            } else {
                rank_plan
            };
            load_one(args, &view, rank_plan, &transport, &device, &job.options).await?
        }
    };
    if let Some(path) = &args.report_json {
        spawn::write_rank_json(path, &report, plan.summary(), plan_seconds)?;
    }
    if let Some(path) = &args.metrics_file {
        super::metrics::write_metrics(path, std::slice::from_ref(&report))?;
    }
    let kind = format!("{}, one rank, {}", args.transport.name(), device.label());
    Ok(report::report(
        args,
        checkpoint,
        plan.summary(),
        &[report],
        plan_seconds,
        &kind,
    ))
}

/// Every rank of the job in this process, each on its own GPU and task over an in-process mesh.
async fn load_all_inproc(
    job: &Job,
    checkpoint: &Checkpoint,
    plan: &JobPlan,
    transport_options: TransportOptions,
) -> Result<(Vec<RankReport>, String)> {
    let args = &job.args;
    let world = plan.world();
    let mut options = job.options.clone();
    // A bar only where a person watches: not with --quiet, not into a pipe or a log file.
    let bar = (!args.quiet && std::io::stderr().is_terminal()).then(|| {
        let bar = ProgressBar::new(plan.summary().bytes_read);
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
        let device = open_device(args, rank, false)?;
        devices.push(device.label());
        let rank_plan = plan.rank_plan(rank).await?;
        let (args, checkpoint, options) = (args.clone(), checkpoint.clone(), options.clone());
        tasks.push(tokio::spawn(async move {
            load_one(&args, &checkpoint, rank_plan, &transport, &device, &options).await
        }));
    }
    let reports = super::join_ranks(tasks).await;
    if let Some(bar) = bar {
        bar.finish_and_clear();
    }
    let reports = reports?;
    devices.dedup();
    Ok((reports, format!("in-process, {}", devices.join(" "))))
}

/// The GPU of `rank`: `cuda:N` as given, else the rank's local rank modulo the GPUs visible here.
/// A rank of a real job (`from_env`) takes its local rank from torchrun's `LOCAL_RANK` when set;
/// ranks this process plays itself are numbered by rank.
fn open_device(args: &LoadArgs, rank: u32, from_env: bool) -> Result<CudaDevice> {
    let count = CudaDevice::count()?;
    let local = from_env
        .then(|| std::env::var("LOCAL_RANK").ok())
        .flatten()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(rank);
    Ok(CudaDevice::open(
        args.device.cuda_ordinal(local, count).unwrap_or(0),
    )?)
}

/// NCCL refuses two ranks on one GPU: say so before starting any process.
fn check_nccl(args: &LoadArgs, world: u32) -> Result<()> {
    if args.transport != TransportKind::Nccl || world <= 1 {
        return Ok(());
    }
    if let DeviceSpec::Cuda(Some(_)) = args.device {
        bail!(
            "NCCL needs one GPU per rank, but --device {} puts all {world} ranks on one GPU (use --device cuda)",
            args.device
        );
    }
    let gpus = CudaDevice::count()?;
    if world > gpus {
        bail!(
            "NCCL needs one GPU per rank: the layout has {world} ranks but {gpus} GPU{} visible here",
            if gpus == 1 { " is" } else { "s are" }
        );
    }
    Ok(())
}

/// Loads one rank into freshly allocated buffers on `device`, the exchange on the host over
/// `transport`; copies them back for `--check` and `--dump`.
async fn load_one<T: Transport>(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: RankPlan,
    transport: &T,
    device: &CudaDevice,
    options: &LoadOptions,
) -> Result<RankReport> {
    let mut buffers = allocate(device, &plan)?;
    let destination = Destination::<Vec<u8>>::Cuda(CudaDestination {
        device,
        buffers: &mut buffers,
    });
    let report =
        tessera_ops::load::load_rank(checkpoint, &plan, transport, destination, options).await?;
    finish(args, device, &plan, &buffers)?;
    Ok(report)
}

/// One rank of a real job over NCCL (`--rank`, `--transport nccl`): the rank's reads go up to
/// its GPU and the ring exchange runs GPU to GPU.
async fn load_nccl(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: RankPlan,
    config: &RendezvousConfig,
    transport_options: TransportOptions,
    device: &CudaDevice,
    options: &LoadOptions,
) -> Result<RankReport> {
    let transport = connect_nccl(config, transport_options, device).await?;
    let mut buffers = allocate(device, &plan)?;
    let destination = CudaDestination {
        device,
        buffers: &mut buffers,
    };
    let report = load_rank_nccl(checkpoint, &plan, &transport, destination, options).await?;
    finish(args, device, &plan, &buffers)?;
    Ok(report)
}

fn allocate(device: &CudaDevice, plan: &RankPlan) -> Result<Vec<DeviceBuffer>> {
    device.alloc_destinations(plan).with_context(|| {
        format!(
            "rank {}: allocating destinations on {}",
            plan.rank,
            device.label()
        )
    })
}

/// `--check` and `--dump` of a rank's device buffers: copied back first.
fn finish(
    args: &LoadArgs,
    device: &CudaDevice,
    plan: &RankPlan,
    buffers: &[DeviceBuffer],
) -> Result<()> {
    if !args.check && args.dump.is_none() {
        return Ok(());
    }
    let host = buffers
        .iter()
        .map(|b| device.to_host(b))
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("rank {}: copying its buffers back", plan.rank))?;
    super::finish::finish_rank(args, plan, &host)
}
