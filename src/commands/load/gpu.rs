//! `tessera load --device cuda[:N]` (feature `cuda`): what is the command's own about GPUs. Each
//! rank's GPU, its destinations allocated there, the NCCL rules, and copying the buffers back
//! for `--check` and `--dump`; the load itself is the shared pipeline
//! (`tessera_ops::load::load_rank` into a CUDA destination).

use anyhow::{Context, Result, bail};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::device::DeviceSpec;
use tessera_loader::device::cuda::{CudaDevice, DeviceBuffer, connect_nccl};
use tessera_loader::load::{LoadOptions, RankReport};
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{Transport, TransportOptions};
use tessera_ops::load::Destination;
use tessera_ops::load::cuda::{CudaDestination, load_rank_nccl};
use tessera_planner::RankPlan;

use super::{LoadArgs, RankMemory, TransportKind};

/// The GPU of `rank`: `cuda:N` as given, else the rank's local rank modulo the GPUs visible here.
/// A rank of a real job (`from_env`) takes its local rank from torchrun's `LOCAL_RANK` when set;
/// ranks this process plays itself are numbered by rank.
pub(super) fn open_device(args: &LoadArgs, rank: u32, from_env: bool) -> Result<CudaDevice> {
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

/// Loads one rank into freshly allocated buffers on `device`, the exchange on the host over
/// `transport`; copies them back for `--check` and `--dump`.
pub(super) async fn load_one<T: Transport>(
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
pub(super) async fn load_nccl(
    args: &LoadArgs,
    checkpoint: &Checkpoint,
    plan: RankPlan,
    config: &RendezvousConfig,
    transport_options: TransportOptions,
    memory: &RankMemory,
    options: &LoadOptions,
) -> Result<RankReport> {
    let RankMemory::Cuda(device) = memory else {
        bail!("--transport nccl moves data between GPUs: give --device cuda (or cuda:N)");
    };
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
