//! One rank's load, end to end: allocate the destination buffers, read this rank's pieces from
//! storage (verified) straight into them while the ring exchange passes on the pieces other
//! ranks read, then the joint checks of boxes read in parts.

pub mod host_memory;
mod totals;

use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tessera_planner::RankPlan;

use crate::LoaderError;
use crate::checkpoint::Checkpoint;
use crate::exchange::{check_buffer_sizes, check_rank, invalid, place, relay};
use crate::read::{ReadOptions, ReadStats};
use crate::transport::Transport;

pub use totals::LoadTotals;

/// Options of [`load_rank`]. Library code reads no environment: front ends build these (the
/// CLI and the Python package through `tessera_ops::load`, which maps the `TESSERA_*`
/// switches onto them).
#[derive(Clone)]
pub struct LoadOptions {
    /// Read scheduling and verification.
    pub read: ReadOptions,
    /// Called with the bytes of every completed read (for a progress bar).
    pub progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
    /// Bytes per message when a share is sent in parts (`None`:
    /// [`crate::exchange::SHARE_PART_BYTES`]). Every rank of a load must use the same value.
    pub share_part_bytes: Option<u64>,
    /// Reads and the exchange overlap: a share goes out as soon as its pieces are read (true).
    /// Off, the exchange starts after the whole read (a switch for side-by-side measurements,
    /// and a way back should a transport misbehave under concurrency).
    pub exchange_overlap: bool,
    /// Offer and accept direct copies between ranks of one host ([`crate::exchange::direct`];
    /// true). A rank that does not offer says so in its hello, so ranks with different
    /// settings still agree on every pair.
    pub cross_memory: bool,
}

impl Default for LoadOptions {
    fn default() -> Self {
        LoadOptions {
            read: ReadOptions::default(),
            progress: None,
            share_part_bytes: None,
            exchange_overlap: true,
            cross_memory: true,
        }
    }
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("read", &self.read)
            .field("share_part_bytes", &self.share_part_bytes)
            .field("exchange_overlap", &self.exchange_overlap)
            .field("cross_memory", &self.cross_memory)
            .finish_non_exhaustive()
    }
}

/// What one rank did.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct RankReport {
    /// The rank.
    pub rank: u32,
    /// Bytes of its destination buffers.
    pub bytes_needed: u64,
    /// Bytes of pieces it read from storage.
    pub bytes_read: u64,
    /// Of `bytes_read`, the bytes read from this node's memory-tier copies
    /// ([`crate::tier`]) instead of storage.
    #[serde(default)]
    pub bytes_from_memory_tier: u64,
    /// Of `bytes_read`, the bytes of a live publication read from its publishers' shared memory
    /// on this host (`tessera_storage::shared_file`) instead of over HTTP.
    #[serde(default)]
    pub bytes_from_publisher_memory: u64,
    /// Of `bytes_read`, the bytes read from the checkpoint's storage (over HTTP for a live
    /// publication): `bytes_read - bytes_from_memory_tier - bytes_from_publisher_memory`.
    #[serde(default)]
    pub bytes_from_storage: u64,
    /// Memory-tier copies that failed a read after they were verified (changed, truncated,
    /// replaced), each named with why; what this rank read of them came from storage instead.
    #[serde(default)]
    pub memory_tier_fallbacks: Vec<String>,
    /// Bytes requested (read + checksum-block extension).
    pub bytes_fetched: u64,
    /// Of `bytes_fetched`, the bytes only verification needed (whole checksum blocks around
    /// the data, the rest of small boxes read whole to check their own crc32c).
    pub verify_extra_bytes: u64,
    /// Read amplification of the bytes needed: data fetched (`bytes_fetched` less
    /// `verify_extra_bytes`) / `bytes_read`. 1.00 when no byte outside the pieces is read.
    #[serde(default)]
    pub read_amplification: f64,
    /// Total I/O per byte needed, verification included: `bytes_fetched` / `bytes_read`.
    /// Checksum blocks around small tensors can make this several times `read_amplification`.
    #[serde(default)]
    pub io_amplification: f64,
    /// Saved boxes fetched whole and verified by the crc32c of their own metadata row (these
    /// need no checksum blocks): whole-box pieces, and small boxes of which a part was needed.
    #[serde(default)]
    pub boxes_verified: u64,
    /// Bytes read while verifying that no checksum covered (parts of DCP blobs that no joint
    /// check partitions, formats that record no checksums); 0 when not verifying.
    #[serde(default)]
    pub bytes_unverified: u64,
    /// Bytes the store returned: `bytes_fetched` plus the gaps between small ranges that one
    /// request spanned ([`ReadOptions::coalesce_gap`](crate::read::ReadOptions::coalesce_gap)).
    /// What the wire carried, counted per request, for every kind of store.
    #[serde(default)]
    pub bytes_transferred: u64,
    /// Storage requests (one `get_range` each; retries not included).
    pub requests: u64,
    /// Retried storage requests.
    pub retries: u64,
    /// Bytes sent to peers.
    pub bytes_sent: u64,
    /// Bytes received from peers.
    pub bytes_received: u64,
    /// Of `bytes_received`, the bytes this rank copied straight out of a peer's memory on this
    /// host (one copy, no socket; see [`crate::exchange::direct`]).
    #[serde(default)]
    pub bytes_received_direct: u64,
    /// Seconds reading and placing.
    pub read_seconds: f64,
    /// Seconds exchanging: from the end of this rank's reads to the end of its load (placing
    /// what peers sent, the joint checks' round).
    pub exchange_seconds: f64,
    /// Of `exchange_seconds`, the seconds this rank waited on its peers: for shares to arrive
    /// after its own reads ended (a peer still reading, bytes on their way) and for the other
    /// readers' joint-check folds. What is left is this rank's own exchange work. In a torch job
    /// the exchange starts once every rank has read, and this is the time spent waiting on the
    /// process group's messages.
    #[serde(default)]
    pub exchange_wait_seconds: f64,
    /// Bytes copied host to device (device loads only; 0 for host buffers).
    #[serde(default)]
    pub h2d_bytes: u64,
    /// Seconds of the host-to-device upload, pinned staging included.
    #[serde(default)]
    pub h2d_seconds: f64,
    /// Seconds in all.
    pub total_seconds: f64,
}

/// A rank's loaded buffers, with its plan (which says what each buffer is) and report.
#[derive(Debug)]
pub struct LoadedRank {
    /// The plan executed.
    pub plan: RankPlan,
    /// One buffer per `plan.destinations`.
    pub buffers: Vec<Vec<u8>>,
    /// What it took.
    pub report: RankReport,
}

/// Loads one rank: reads, places, exchanges. Fails (never returns partial buffers as success) if
/// any read, checksum or peer fails.
pub async fn load_rank<T: Transport>(
    checkpoint: &Checkpoint,
    plan: RankPlan,
    transport: &T,
    options: &LoadOptions,
) -> Result<LoadedRank, LoaderError> {
    let mut buffers = place::allocate(&plan);
    let report = load_rank_into(checkpoint, &plan, transport, options, &mut buffers).await?;
    Ok(LoadedRank {
        plan,
        buffers,
        report,
    })
}

/// [`load_rank`] into buffers the caller owns, one per `plan.destinations` and exactly as long
/// (a Python/NumPy integration passes the arrays' memory, so nothing is copied twice). The
/// buffers need not be zeroed: the plan writes every byte of every destination. On error their
/// contents are unspecified.
pub async fn load_rank_into<T: Transport, B: AsMut<[u8]> + AsRef<[u8]>>(
    checkpoint: &Checkpoint,
    plan: &RankPlan,
    transport: &T,
    options: &LoadOptions,
    buffers: &mut [B],
) -> Result<RankReport, LoaderError> {
    check_rank(plan, transport.rank(), transport.world())?;
    check_buffer_sizes(plan, buffers.iter().map(|b| b.as_ref().len() as u64))
        .map_err(|detail| invalid(plan, detail))?;
    // A plan for another checkpoint, or one that disagrees with its metadata, is refused before
    // any peer is contacted; then, before any peer is sent a byte, the ranks' plans must
    // describe what they pass each other alike.
    checkpoint.check_plan(plan)?;
    crate::exchange::agree::agree_on_plan(transport, plan).await?;
    let started = Instant::now();
    // Pieces of boxes read in parts by several ranks are checked jointly after the reads.
    let mut joint_options = options.clone();
    joint_options.read.joint_checks = true;
    let options = &joint_options;
    // Pieces this rank reads in storage order only to pass on need somewhere to stay.
    let (stats, read_seconds, exchanged) = match relay::with_relay_buffers(plan) {
        None => {
            crate::exchange::drive::read_and_exchange(
                checkpoint, plan, transport, options, buffers, started,
            )
            .await?
        }
        Some(relaying) => {
            let mut slots = relay::slots(&relaying, buffers);
            crate::exchange::drive::read_and_exchange(
                checkpoint, &relaying, transport, options, &mut slots, started,
            )
            .await?
        }
    };
    // The joint checks' round is a wait for the other readers' folds (checking them costs
    // microseconds).
    let joint_started = Instant::now();
    checkpoint
        .verify_joint_checks(transport, plan, options, &stats)
        .await?;
    let joint_wait = joint_started.elapsed();
    let exchange_seconds = started.elapsed().as_secs_f64() - read_seconds;
    let mut report = RankReport::of_host_load(
        plan,
        &stats,
        read_seconds,
        (exchanged.bytes_sent, exchanged.bytes_received),
        exchange_seconds,
        started.elapsed().as_secs_f64(),
    );
    report.bytes_received_direct = exchanged.bytes_received_direct;
    report.exchange_wait_seconds = (exchanged.waited + joint_wait).as_secs_f64();
    Ok(report)
}

impl RankReport {
    /// The report of a load into host memory: the plan's needs, the read's stats, the bytes
    /// passed to and from peers, and the seconds of each phase (no host-to-device copy).
    pub fn of_host_load(
        plan: &RankPlan,
        stats: &ReadStats,
        read_seconds: f64,
        (bytes_sent, bytes_received): (u64, u64),
        exchange_seconds: f64,
        total_seconds: f64,
    ) -> RankReport {
        RankReport {
            rank: plan.rank,
            bytes_needed: plan.summary.bytes_needed,
            bytes_read: stats.bytes_needed,
            bytes_from_memory_tier: stats.bytes_from_local_copies,
            bytes_from_publisher_memory: stats.bytes_from_shared_memory,
            bytes_from_storage: stats.bytes_needed
                - stats.bytes_from_local_copies
                - stats.bytes_from_shared_memory,
            memory_tier_fallbacks: stats.local_copy_fallbacks.clone(),
            bytes_fetched: stats.bytes_fetched,
            verify_extra_bytes: stats.verify_extra_bytes,
            read_amplification: ratio(
                stats.bytes_fetched.saturating_sub(stats.verify_extra_bytes),
                stats.bytes_needed,
            ),
            io_amplification: ratio(stats.bytes_fetched, stats.bytes_needed),
            boxes_verified: stats.boxes_verified,
            bytes_unverified: stats.bytes_unverified,
            bytes_transferred: stats.bytes_transferred,
            requests: stats.requests,
            retries: stats.retries,
            bytes_sent,
            bytes_received,
            bytes_received_direct: 0,
            read_seconds,
            exchange_seconds,
            exchange_wait_seconds: 0.0,
            h2d_bytes: 0,
            h2d_seconds: 0.0,
            total_seconds,
        }
    }
}

/// `num / den` as an amplification: 1.00 when nothing was needed (nothing read is no waste).
pub fn ratio(num: u64, den: u64) -> f64 {
    if den == 0 {
        1.0
    } else {
        num as f64 / den as f64
    }
}
