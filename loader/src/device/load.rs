//! One rank's load into device memory: the host pipeline of [`crate::load`] (verified reads
//! placed into host buffers), then the upload through a pinned staging pool. With the exchange
//! on the host (any [`Transport`], [`OnHost`]) the host side is the whole pipeline every host
//! load runs ([`crate::load::load_rank_into`]: reads overlapped with the ring exchange, direct
//! copies between ranks of one host, joint checks of boxes read in parts); with the exchange on
//! the device (the grouped ring on a data plane, [`SequencedTransport`]) the host side is this
//! rank's own reads, and the ring runs device to device after the upload.
//!
//! Generic over the device: [`CopyEngine`] and [`DataPlane`] are implemented for CUDA and NCCL
//! (feature `cuda`) and by host emulations (feature `testing`), which is how this pipeline is
//! tested on machines without a GPU.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tessera_planner::RankPlan;

use crate::LoaderError;
use crate::checkpoint::Checkpoint;
use crate::device::DeviceMemory;
use crate::device::staging::{CopyEngine, StagingPool, Upload, UploadStats};
use crate::exchange::{ExchangeStats, check_buffer_sizes, check_rank};
use crate::exchange::{place, relay};
use crate::load::{LoadOptions, RankReport, load_rank_into};
use crate::transport::plane::DataPlane;
use crate::transport::plane::ring::ring_exchange;
use crate::transport::{SequencedTransport, Transport};

/// How a device load exchanges pieces between ranks.
pub trait DeviceExchange<B: DeviceMemory>: Sync {
    /// This rank.
    fn rank(&self) -> u32;

    /// Number of ranks.
    fn world(&self) -> u32;

    /// Loads what this rank has on the host before the upload into `host` (one buffer per plan
    /// destination): the whole host pipeline when the exchange is on the host, this rank's own
    /// reads when it runs on the device.
    fn load_host(
        &self,
        checkpoint: &Checkpoint,
        plan: &RankPlan,
        options: &LoadOptions,
        host: &mut [Vec<u8>],
    ) -> impl Future<Output = Result<RankReport, LoaderError>> + Send;

    /// Runs the exchange on the device buffers, after the upload, if this is where it happens;
    /// hands the buffers back.
    fn on_device(
        &self,
        plan: Arc<RankPlan>,
        buffers: Vec<B>,
    ) -> impl Future<Output = Result<(Vec<B>, Option<ExchangeStats>), LoaderError>> + Send;
}

/// The exchange over any [`Transport`] (an `Arc` or a reference of one to share it), on host
/// buffers before the upload (what the in-process and TCP transports do for device loads).
#[derive(Debug)]
pub struct OnHost<T>(pub T);

impl<B: DeviceMemory, T: Transport> DeviceExchange<B> for OnHost<T> {
    fn rank(&self) -> u32 {
        self.0.rank()
    }

    fn world(&self) -> u32 {
        self.0.world()
    }

    async fn load_host(
        &self,
        checkpoint: &Checkpoint,
        plan: &RankPlan,
        options: &LoadOptions,
        host: &mut [Vec<u8>],
    ) -> Result<RankReport, LoaderError> {
        load_rank_into(checkpoint, plan, &self.0, options, host).await
    }

    async fn on_device(
        &self,
        _plan: Arc<RankPlan>,
        buffers: Vec<B>,
    ) -> Result<(Vec<B>, Option<ExchangeStats>), LoaderError> {
        Ok((buffers, None))
    }
}

/// The grouped ring on the data plane, device to device, after the upload.
impl<C, P> DeviceExchange<P::Buffer> for SequencedTransport<C, P>
where
    C: Transport + 'static,
    P: DataPlane,
{
    fn rank(&self) -> u32 {
        Transport::rank(self)
    }

    fn world(&self) -> u32 {
        Transport::world(self)
    }

    /// This rank's own reads, verified by checksum blocks: the ring moves the rest device to
    /// device and has no channel for the folds of joint checks, nor buffers for pieces relayed
    /// in storage order (a device ring plans in request order).
    async fn load_host(
        &self,
        checkpoint: &Checkpoint,
        plan: &RankPlan,
        options: &LoadOptions,
        host: &mut [Vec<u8>],
    ) -> Result<RankReport, LoaderError> {
        if relay::with_relay_buffers(plan).is_some() {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "rank {}: the plan relays pieces read in storage order, which the device \
                     ring has no buffers for: plan with read order `request`, or exchange on the \
                     host",
                    plan.rank
                ),
            });
        }
        // The ring moves bytes between ranks: their plans must describe them alike (a plan
        // for another checkpoint is refused first, before any peer is contacted).
        checkpoint.check_plan(plan)?;
        crate::exchange::agree::agree_on_plan(self, plan).await?;
        let started = Instant::now();
        let mut by_blocks = options.clone();
        by_blocks.read.joint_checks = false;
        let read = checkpoint.read_into(plan, &by_blocks, host).await?;
        let seconds = started.elapsed().as_secs_f64();
        Ok(RankReport::of_host_load(
            plan,
            &read,
            seconds,
            (0, 0),
            0.0,
            seconds,
        ))
    }

    async fn on_device(
        &self,
        plan: Arc<RankPlan>,
        buffers: Vec<P::Buffer>,
    ) -> Result<(Vec<P::Buffer>, Option<ExchangeStats>), LoaderError> {
        let (buffers, stats) = self
            .plane()
            .run(move |plane| {
                let stats = ring_exchange(plane, &plan, &buffers);
                (buffers, stats)
            })
            .await?;
        Ok((buffers, Some(stats?)))
    }
}

/// A rank loaded into device memory: its plan (which says what each buffer is), one device
/// buffer per plan destination, and the report.
#[derive(Debug)]
pub struct DeviceLoadedRank<B> {
    /// The plan executed.
    pub plan: RankPlan,
    /// One device buffer per `plan.destinations`.
    pub buffers: Vec<B>,
    /// What it took (`h2d_bytes` and `h2d_seconds` filled in).
    pub report: RankReport,
}

/// Checks that `destinations` fit `plan`: one per plan destination, of its size.
pub fn check_destinations<B: DeviceMemory>(
    device: &str,
    plan: &RankPlan,
    destinations: &[B],
) -> Result<(), LoaderError> {
    check_buffer_sizes(plan, destinations.iter().map(|b| b.len() as u64)).map_err(|detail| {
        LoaderError::Device {
            device: device.to_string(),
            detail: format!("rank {}: {detail}", plan.rank),
        }
    })
}

/// Runs `f`, which blocks, where a tokio worker may block (a multi-thread runtime moves its
/// other tasks elsewhere meanwhile).
fn blocking<R>(f: impl FnOnce() -> R) -> R {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Uploads a rank's loaded host buffers (one per destination of `plan`) into `destinations`
/// (device buffers of the same sizes) through `staging`: the step every device load takes after
/// its host side, whoever ran that (here, or the load job's rounds in `tessera-ops`).
pub fn upload_loaded<E: CopyEngine, H: AsRef<[u8]>>(
    staging: &mut StagingPool<E>,
    plan: &RankPlan,
    host: &[H],
    destinations: &[E::Target],
) -> Result<UploadStats, LoaderError> {
    check_destinations(&staging.engine().device(), plan, destinations)?;
    let uploads: Vec<Upload<'_, E::Target>> = host
        .iter()
        .zip(destinations)
        .map(|(source, target)| Upload {
            source: source.as_ref(),
            target,
            offset: 0,
        })
        .collect();
    blocking(|| staging.upload(&uploads))
}

/// Loads one rank into `destinations` (device buffers, one per plan destination, of the plan's
/// sizes: allocated by the loader or the caller's own, e.g. torch tensors): the host side as
/// `exchange` says ([`DeviceExchange::load_host`]), the upload through `staging`, then the
/// exchange on the device if that is where it runs. Fails, never returning partly loaded
/// buffers as success, if any read, checksum, peer or copy fails.
pub async fn load_rank_to_device<E, X>(
    checkpoint: &Checkpoint,
    plan: RankPlan,
    exchange: &X,
    staging: &mut StagingPool<E>,
    destinations: Vec<E::Target>,
    options: &LoadOptions,
) -> Result<DeviceLoadedRank<E::Target>, LoaderError>
where
    E: CopyEngine,
    X: DeviceExchange<E::Target>,
{
    check_rank(&plan, exchange.rank(), exchange.world())?;
    check_destinations(&staging.engine().device(), &plan, &destinations)?;
    let started = Instant::now();
    let mut host = place::allocate(&plan);
    let mut report = exchange
        .load_host(checkpoint, &plan, options, &mut host)
        .await?;

    let uploaded = upload_loaded(staging, &plan, &host, &destinations)?;
    drop(host);

    let exchange_started = Instant::now();
    let plan = Arc::new(plan);
    let (buffers, device_exchange) = exchange.on_device(Arc::clone(&plan), destinations).await?;
    if let Some(exchanged) = device_exchange {
        report.bytes_sent = exchanged.bytes_sent;
        report.bytes_received = exchanged.bytes_received;
        report.bytes_received_direct = exchanged.bytes_received_direct;
        report.exchange_seconds += exchange_started.elapsed().as_secs_f64();
    }
    let plan = Arc::try_unwrap(plan).unwrap_or_else(|shared| (*shared).clone());
    report.h2d_bytes = uploaded.bytes;
    report.h2d_seconds = uploaded.seconds;
    report.total_seconds = started.elapsed().as_secs_f64();
    Ok(DeviceLoadedRank {
        plan,
        buffers,
        report,
    })
}
