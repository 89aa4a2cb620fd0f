//! CUDA memory as a load's destination (feature `cuda`). The rank's bytes take the host
//! pipeline of every load (reads overlapped with the exchange, direct copies, joint checks)
//! into host buffers, then go up through a bounded pool of pinned staging buffers; over NCCL
//! the exchange runs device to device after the upload instead. Only the device buffers, the
//! staging upload and the NCCL plane are CUDA's own.

use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::device::cuda::{CudaDevice, DeviceBuffer, NcclTransport};
use tessera_loader::device::load::{DeviceExchange, load_rank_to_device, upload_loaded};
use tessera_loader::device::staging::StagingOptions;
use tessera_loader::load::{LoadOptions, RankReport};
use tessera_planner::RankPlan;

use crate::{OpsError, ResultExt};

/// Device buffers on one CUDA device, one per plan destination of the plan's sizes: allocated
/// here ([`CudaDevice::alloc_destinations`]) or the caller's own (torch tensors, wrapped). After
/// a successful load `buffers` holds them, filled.
pub struct CudaDestination<'a> {
    /// The device.
    pub device: &'a CudaDevice,
    /// The buffers.
    pub buffers: &'a mut Vec<DeviceBuffer>,
}

impl CudaDestination<'_> {
    /// Uploads what a rank loaded into host buffers (the load job's rounds,
    /// `crate::job::host`; one buffer per destination of `plan`) into the device buffers
    /// through pinned staging, and adds the upload to `report`.
    pub fn upload<H: AsRef<[u8]>>(
        self,
        plan: &RankPlan,
        host: &[H],
        report: &mut RankReport,
    ) -> Result<(), OpsError> {
        let (rank, device) = (plan.rank, self.device.label());
        let started = std::time::Instant::now();
        let mut staging = self
            .device
            .staging(StagingOptions::default())
            .with_context(|| format!("rank {rank}: setting up pinned staging on {device}"))?;
        let uploaded = upload_loaded(&mut staging, plan, host, self.buffers)
            .with_context(|| format!("rank {rank}: uploading to {device}"))?;
        report.h2d_bytes = uploaded.bytes;
        report.h2d_seconds = uploaded.seconds;
        report.total_seconds += started.elapsed().as_secs_f64();
        Ok(())
    }

    /// Loads `plan` into the buffers with `exchange` (on the host before the upload, or device
    /// to device after it).
    pub(crate) async fn load<X: DeviceExchange<DeviceBuffer>>(
        self,
        checkpoint: &Checkpoint,
        plan: &RankPlan,
        exchange: &X,
        options: &LoadOptions,
    ) -> Result<RankReport, OpsError> {
        let (rank, device) = (plan.rank, self.device.label());
        let mut staging = self
            .device
            .staging(StagingOptions::default())
            .with_context(|| format!("rank {rank}: setting up pinned staging on {device}"))?;
        let buffers = std::mem::take(self.buffers);
        let loaded = load_rank_to_device(
            checkpoint,
            plan.clone(),
            exchange,
            &mut staging,
            buffers,
            options,
        )
        .await
        .with_context(|| format!("rank {rank} on {device}"))?;
        *self.buffers = loaded.buffers;
        Ok(loaded.report)
    }
}

/// [`super::load_rank`] over NCCL: the rank's own reads go up to the device and the plan's
/// ring exchange runs GPU to GPU on the NCCL plane.
pub async fn load_rank_nccl(
    checkpoint: &Checkpoint,
    plan: &RankPlan,
    transport: &NcclTransport,
    destination: CudaDestination<'_>,
    options: &LoadOptions,
) -> Result<RankReport, OpsError> {
    destination.load(checkpoint, plan, transport, options).await
}
