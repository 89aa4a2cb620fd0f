//! `tessera load --device cuda[:N]` (feature `cuda`): what is the command's own about GPUs. Each
//! rank's GPU, its destinations allocated there, the NCCL rules, and copying the buffers back
//! for `--check` and `--dump`.
//!
//! Over a host transport (in-process, TCP) a rank's load is the load job's rounds like any host
//! load (`tessera_ops::job::host`: rank 0 plans once, the exchange on the host), then the upload
//! through pinned staging. Over NCCL the exchange runs GPU to GPU after the upload
//! (`tessera_ops::load::cuda::load_rank_nccl`), which has no channel for the rounds' joint
//! checks: each `--rank` process takes its plan here (made here, or the server's) and the
//! device ring agrees on it with its peers before any byte moves.

use std::time::Instant;

use anyhow::{Context, Result, bail};
use tessera_loader::device::DeviceSpec;
use tessera_loader::device::cuda::{CudaDevice, DeviceBuffer, connect_nccl};
use tessera_loader::plan_client::PlanTarget;
use tessera_ops::job::host::HostLoad;
use tessera_ops::load::JobPlan;
use tessera_ops::load::cuda::{CudaDestination, load_rank_nccl};
use tessera_planner::{ExplicitRequests, RankPlan, RequestSet};

use super::{Job, LoadArgs, TransportKind, rendezvous, report, spawn};

/// Uploads a rank's host load to its GPU (then `--check` and `--dump` on the bytes copied back
/// from there); the report gains the upload and the host buffers are freed.
pub(super) fn upload(args: &LoadArgs, mut loaded: HostLoad) -> Result<HostLoad> {
    let plan = loaded.plan.clone();
    let device = open_device(args, plan.rank, args.rank.is_some())?;
    let mut buffers = allocate(&device, &plan)?;
    let destination = CudaDestination {
        device: &device,
        buffers: &mut buffers,
    };
    destination.upload(&plan, &loaded.buffers, &mut loaded.report)?;
    loaded.buffers = Vec::new();
    finish(args, &device, &plan, &buffers)?;
    Ok(loaded)
}

/// One rank of a real job over NCCL (`--rank`, `--transport nccl`): its plan taken here, its
/// reads up to its GPU, and the ring exchange GPU to GPU.
pub(super) async fn load_rank(job: &Job, requests: &RequestSet, rank: u32) -> Result<String> {
    let args = &job.args;
    let started = Instant::now();
    let checkpoint = &*job.host.checkpoint;
    let plan = match &job.host.server {
        Some(server) => {
            let target = PlanTarget::Requests(ExplicitRequests {
                ranks: job.requests.to_vec(),
            });
            JobPlan::on_server(checkpoint, &args.checkpoint, server, &target, args.dedup).await?
        }
        None => JobPlan::local(checkpoint, requests, &job.host.planning)?,
    };
    let plan_seconds = started.elapsed().as_secs_f64();
    let (config, texts) = rendezvous(job, rank)?;
    let texts: Vec<&[u8]> = texts.iter().map(|t| t.as_bytes()).collect();
    let config = job.host.rendezvous(config, &texts)?;
    let device = open_device(args, rank, true)?;
    let rank_plan = plan.rank_plan(rank).await?;
    let transport = connect_nccl(&config, job.host.transport_options(), &device).await?;
    let mut buffers = allocate(&device, &rank_plan)?;
    let destination = CudaDestination {
        device: &device,
        buffers: &mut buffers,
    };
    let report = load_rank_nccl(
        checkpoint,
        &rank_plan,
        &transport,
        destination,
        &job.host.options,
    )
    .await?;
    finish(args, &device, &rank_plan, &buffers)?;
    if let Some(path) = &args.report_json {
        spawn::write_rank_json(path, &report, plan.summary(), plan_seconds)?;
    }
    if let Some(path) = &args.metrics_file {
        super::metrics::write_metrics(path, std::slice::from_ref(&report))?;
    }
    let kind = format!("nccl, one rank, {}", device.label());
    Ok(report::report(
        args,
        checkpoint,
        plan.summary(),
        &[report],
        plan_seconds,
        &kind,
    ))
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
pub(super) fn check_nccl(args: &LoadArgs, world: u32) -> Result<()> {
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
