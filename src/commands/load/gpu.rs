//! `tessera load --device cuda[:N]` (feature `cuda`): each rank's destinations in GPU memory,
//! uploaded through pinned staging; the exchange on the host (in-process or TCP) or GPU to GPU
//! (`--transport nccl`). `--check` and `--dump` copy the buffers back.

use std::path::Path;

use anyhow::{Context, Result, bail};
use tessera_loader::cuda::{CudaDevice, DeviceBuffer, connect_nccl};
use tessera_loader::device::DeviceSpec;
use tessera_loader::device_load::{DeviceExchange, OnHost, load_rank_to_device};
use tessera_loader::load::{Checkpoint, LoadOptions, LoadedRank, RankReport};
use tessera_loader::staging::StagingOptions;
use tessera_loader::transport::{InProcTransport, TcpTransport, TransportOptions};
use tessera_planner::RankPlan;

use super::{LoadArgs, Planned, TransportKind};

/// The GPU of `rank`: `cuda:N` as given, else the rank's local rank modulo the GPUs visible here.
/// A rank of a real job (`from_env`) takes its local rank from torchrun's `LOCAL_RANK` when set;
/// ranks this process plays itself are numbered by rank.
fn ordinal(args: &LoadArgs, rank: u32, from_env: bool) -> Result<u32> {
    let count = CudaDevice::count()?;
    let local = from_env
        .then(|| std::env::var("LOCAL_RANK").ok())
        .flatten()
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(rank);
    Ok(args.device.cuda_ordinal(local, count).unwrap_or(0))
}

/// Loads one rank into freshly allocated buffers on `device`; copies them back for `--check` and
/// `--dump`.
async fn load_one<X: DeviceExchange<DeviceBuffer>>(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: RankPlan,
    exchange: &X,
    device: &CudaDevice,
    options: &LoadOptions,
) -> Result<RankReport> {
    let rank = plan.rank;
    let mut staging = device.staging(StagingOptions::default()).with_context(|| {
        format!(
            "rank {rank}: setting up pinned staging on {}",
            device.label()
        )
    })?;
    let destinations = device
        .alloc_destinations(&plan)
        .with_context(|| format!("rank {rank}: allocating destinations on {}", device.label()))?;
    let loaded = load_rank_to_device(
        checkpoint,
        plan,
        exchange,
        &mut staging,
        destinations,
        options,
    )
    .await
    .with_context(|| format!("rank {rank} on {}", device.label()))?;
    if args.check || args.dump.is_some() {
        let buffers = loaded
            .buffers
            .iter()
            .map(|b| device.to_host(b))
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("rank {rank}: copying its buffers back"))?;
        super::finish_rank(
            args,
            &LoadedRank {
                plan: loaded.plan,
                buffers,
                report: loaded.report.clone(),
            },
        )?;
    }
    Ok(loaded.report)
}

/// The whole command on GPUs (after planning).
pub(super) async fn run(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: &Planned,
    plan_seconds: f64,
    options: LoadOptions,
    transport_options: TransportOptions,
    shared_cache: Option<&Path>,
) -> Result<String> {
    let world = plan.world();
    // NCCL refuses two ranks on one GPU: say so before starting any process.
    if args.transport == TransportKind::Nccl && args.rank.is_none() && world > 1 {
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
    }

    if let Some(rank) = args.rank {
        if let Some(w) = args.world
            && w != world
        {
            bail!("--world {w} but the layout has {world} ranks");
        }
        let config = super::rendezvous(args, rank, world)?;
        let device = CudaDevice::open(ordinal(args, rank, true)?)?;
        let rank_plan = plan.rank_plan(rank).await?;
        let report = match args.transport {
            TransportKind::Nccl => {
                let transport = connect_nccl(&config, transport_options, &device).await?;
                load_one(args, checkpoint, rank_plan, &transport, &device, &options).await?
            }
            TransportKind::Tcp | TransportKind::InProc => {
                let transport = OnHost(TcpTransport::connect(&config, transport_options).await?);
                load_one(args, checkpoint, rank_plan, &transport, &device, &options).await?
            }
        };
        if let Some(path) = &args.report_json {
            std::fs::write(path, serde_json::to_vec(&report)?)
                .with_context(|| format!("writing {path}"))?;
        }
        if let Some(path) = &args.metrics_file {
            super::metrics::write_metrics(path, std::slice::from_ref(&report))?;
        }
        let kind = format!("{}, one rank, {}", args.transport.name(), device.label());
        return Ok(super::report(
            args,
            checkpoint,
            plan,
            &[report],
            plan_seconds,
            &kind,
        ));
    }

    let (reports, kind) = match args.transport {
        TransportKind::InProc => {
            let transports = InProcTransport::mesh(world, transport_options);
            let mut tasks = Vec::with_capacity(world as usize);
            let mut devices = Vec::with_capacity(world as usize);
            for (rank, transport) in transports.into_iter().enumerate() {
                let rank = rank as u32;
                let device = CudaDevice::open(ordinal(args, rank, false)?)?;
                devices.push(device.label());
                let rank_plan = plan.rank_plan(rank).await?;
                let (args, checkpoint, options) =
                    (args.clone(), checkpoint.clone(), options.clone());
                tasks.push(tokio::spawn(async move {
                    load_one(
                        &args,
                        &checkpoint,
                        rank_plan,
                        &OnHost(transport),
                        &device,
                        &options,
                    )
                    .await
                }));
            }
            let mut reports = Vec::with_capacity(tasks.len());
            let mut failures = Vec::new();
            for (rank, task) in tasks.into_iter().enumerate() {
                match task.await {
                    Ok(Ok(report)) => reports.push(report),
                    Ok(Err(e)) => failures.push(format!("rank {rank}: {e:#}")),
                    Err(e) => failures.push(format!("rank {rank}: task failed: {e}")),
                }
            }
            if !failures.is_empty() {
                bail!("the load failed:\n  {}", failures.join("\n  "));
            }
            devices.dedup();
            (reports, format!("in-process, {}", devices.join(" ")))
        }
        TransportKind::Tcp | TransportKind::Nccl => (
            super::load_all_tcp(args, world, shared_cache).await?,
            format!(
                "{} processes on 127.0.0.1, {}",
                args.transport.name(),
                args.device
            ),
        ),
    };
    if let Some(path) = &args.report_json {
        super::write_all_ranks_json(path, plan, &reports)?;
    }
    if let Some(path) = &args.metrics_file {
        super::metrics::write_metrics(path, &reports)?;
    }
    Ok(super::report(
        args,
        checkpoint,
        plan,
        &reports,
        plan_seconds,
        &kind,
    ))
}
