//! One rank's load, end to end: allocate the destination buffers, read this rank's pieces from
//! storage (verified) straight into them, then run the ring exchange for the pieces other ranks
//! read. Also the embedded plan source: planning locally from the checkpoint, no service needed.

use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tessera_metadata::formats::dcp::IndexStats;
use tessera_metadata::formats::native::{BlockChecksums, Manifest};
use tessera_metadata::{CheckpointMeta, Format, OpenOptions, open_any};
use tessera_planner::{Plan, PlanOptions, RankPlan, RequestSet, plan};

use crate::exchange::{check_buffer_sizes, check_rank, invalid};
use crate::read::{
    ReadOptions, ReadStats, default_coalesce_gap, exact_multi_range, read_into_with,
};
use crate::transport::Transport;
use crate::{LoaderError, place, relay};
use tessera_storage::Location;

/// A checkpoint opened for loading, in any format tessera reads: its store, metadata and (native
/// checkpoints with data) block checksums. DCP and safetensors checkpoints record no checksums a
/// partial read could be checked against, so they load unverified (`checksums` is `None`).
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// Where it lives; `location.prefix` is the root its data file paths are relative to (for a
    /// single safetensors file, the folder holding it).
    pub location: Location,
    /// Its format.
    pub format: Format,
    /// Its manifest (native checkpoints only).
    pub manifest: Option<Manifest>,
    /// Training step, when known.
    pub step: Option<u64>,
    /// Whether its data files are there (a native metadata-only checkpoint has none).
    pub has_data: bool,
    /// Its global metadata.
    pub meta: Arc<CheckpointMeta>,
    /// Block checksums of its data files (native checkpoints with data only).
    pub checksums: Option<Arc<BlockChecksums>>,
    /// DCP: how the per-blob zip index was obtained and what its header reads cost.
    pub index: Option<IndexStats>,
}

impl Checkpoint {
    /// Opens a checkpoint in any format ([`open_any`]) with default options: native (manifest,
    /// verified metadata, block checksums), DCP, or safetensors.
    pub async fn open(location: Location) -> Result<Checkpoint, LoaderError> {
        Checkpoint::open_with(location, &OpenOptions::default()).await
    }

    /// [`Checkpoint::open`] with options (e.g. a cache directory for DCP blob indexes).
    pub async fn open_with(
        mut location: Location,
        options: &OpenOptions,
    ) -> Result<Checkpoint, LoaderError> {
        let opened = open_any(location.store.as_ref(), &location.prefix, options).await?;
        location.prefix = opened.root.clone();
        Ok(Checkpoint {
            location,
            format: opened.format,
            manifest: opened.manifest().cloned(),
            step: opened.step,
            has_data: opened.has_data,
            index: opened.dcp().map(|d| d.stats.clone()),
            meta: Arc::new(opened.meta),
            checksums: opened.block_checksums.map(Arc::new),
        })
    }

    /// Refuses a plan made for another checkpoint: one whose recorded identity differs from this
    /// checkpoint's ([`LoaderError::PlanForOtherCheckpoint`], naming the checkpoint and both
    /// identities). A plan without an identity against a checkpoint that has one (a server or
    /// plan file older than identities) is refused too ([`LoaderError::PlanWithoutIdentity`]):
    /// nothing would tie its offsets to these files. Only metadata assembled in memory, which
    /// has no identity, loads plans unchecked.
    pub fn check_plan(&self, plan: &RankPlan) -> Result<(), LoaderError> {
        match (plan.checkpoint_identity.as_deref(), self.meta.identity()) {
            (None, Some(opened)) => Err(LoaderError::PlanWithoutIdentity {
                rank: plan.rank,
                checkpoint: self.location.display.clone(),
                checkpoint_identity: opened.to_string(),
            }),
            (Some(planned), Some(opened)) if planned != opened => {
                Err(LoaderError::PlanForOtherCheckpoint {
                    rank: plan.rank,
                    checkpoint: self.location.display.clone(),
                    plan_identity: planned.to_string(),
                    checkpoint_identity: opened.to_string(),
                })
            }
            _ => Ok(()),
        }
    }

    /// Reads the pieces `plan` has this rank read, verified when the checkpoint has block
    /// checksums (and whole saved boxes against their own crc32c), straight into `buffers` (one per
    /// plan destination), reporting progress as `options` says. A plan made for another checkpoint
    /// is refused first ([`Checkpoint::check_plan`]): every load path reads through here.
    pub async fn read_into<B: AsMut<[u8]>>(
        &self,
        plan: &RankPlan,
        options: &LoadOptions,
        buffers: &mut [B],
    ) -> Result<ReadStats, LoaderError> {
        self.read_into_with(plan, options, buffers, |_, _| Ok(()))
            .await
    }

    /// [`Checkpoint::read_into`], calling `on_complete(piece, buffers)` as each piece this rank
    /// reads is wholly placed and verified (the overlapped exchange's hook).
    pub async fn read_into_with<B: AsMut<[u8]>>(
        &self,
        plan: &RankPlan,
        options: &LoadOptions,
        buffers: &mut [B],
        on_complete: impl FnMut(usize, &mut [B]) -> Result<(), LoaderError>,
    ) -> Result<ReadStats, LoaderError> {
        self.check_plan(plan)?;
        let read = self.read_options(options);
        read_into_with(
            Arc::clone(&self.location.store),
            &self.location.prefix,
            plan,
            self.checksums.as_deref(),
            Some(&self.meta),
            &read,
            buffers,
            options
                .progress
                .as_deref()
                .map(|p| p as &(dyn Fn(u64) + Sync)),
            on_complete,
        )
        .await
    }

    /// Whether a read of this checkpoint with `verify` checks its bytes: only when the checkpoint
    /// has block checksums (DCP and safetensors record none). Such a read also folds its parts
    /// of jointly checked boxes (see `read_runs`).
    pub fn verifies(&self, verify: bool) -> bool {
        verify && self.checksums.is_some()
    }

    /// The step after the reads of a load whose reads fold joint checks
    /// ([`ReadOptions::joint_checks`]): exchanges the folds with the other members and checks
    /// every jointly read box this rank holds bytes of ([`crate::joint`]). A load reports success
    /// only after it.
    pub async fn verify_joint_checks<T: Transport>(
        &self,
        transport: &T,
        plan: &RankPlan,
        options: &LoadOptions,
        stats: &ReadStats,
    ) -> Result<(), LoaderError> {
        let verifying = self.verifies(options.read.verify);
        crate::joint::verify_joint_checks(
            transport,
            plan,
            Some(&self.meta),
            verifying.then_some(stats.joint_folds.as_slice()),
            verifying,
        )
        .await
    }

    /// The store path of data file `file` (an index into `meta.files()`), checked like a plan's
    /// paths: relative, inside the checkpoint.
    pub fn file_path(&self, file: u32) -> Result<object_store::path::Path, LoaderError> {
        let Some(data) = self.meta.files().get(file as usize) else {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "file #{file} is not one of the {} files of checkpoint {}",
                    self.meta.files().len(),
                    self.location.display
                ),
            });
        };
        crate::read::resolve(&self.location.prefix, &data.path)
    }

    /// The read options with the store kind's defaults filled in: the gap worth spanning and
    /// whether ranged reads of one file may share a call depend on the kind of store.
    fn read_options(&self, options: &LoadOptions) -> ReadOptions {
        let mut read = options.read.clone();
        read.coalesce_gap = Some(
            read.coalesce_gap
                .unwrap_or_else(|| default_coalesce_gap(&self.location.display)),
        );
        read.exact_multi_range = Some(
            read.exact_multi_range
                .unwrap_or_else(|| exact_multi_range(&self.location.display)),
        );
        if read.local_root.is_none() && read.positioned_reads {
            read.local_root.clone_from(&self.location.local_root);
        }
        read
    }

    /// Plans `requests` against this checkpoint (the embedded plan source). Storage-order slabs
    /// are cut at this checkpoint's own checksum blocks when it has them.
    pub fn plan(&self, requests: &RequestSet, options: &PlanOptions) -> Result<Plan, LoaderError> {
        let mut options = options.clone();
        if let Some(blocks) = &self.checksums {
            options.slab_alignment = blocks.block_size();
        }
        Ok(plan(&self.meta, requests, &options)?)
    }
}

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
    /// Offer and accept direct copies between ranks of one host ([`crate::cross_memory`];
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
    /// Bytes requested from storage (read + checksum-block extension).
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
    /// host (one copy, no socket; see [`crate::cross_memory`]).
    #[serde(default)]
    pub bytes_received_direct: u64,
    /// Seconds reading and placing.
    pub read_seconds: f64,
    /// Seconds exchanging.
    pub exchange_seconds: f64,
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
    checkpoint
        .verify_joint_checks(transport, plan, options, &stats)
        .await?;
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
            bytes_fetched: stats.bytes_fetched,
            verify_extra_bytes: stats.verify_extra_bytes,
            read_amplification: ratio(
                stats.bytes_fetched.saturating_sub(stats.verify_extra_bytes),
                stats.bytes_needed,
            ),
            io_amplification: ratio(stats.bytes_fetched, stats.bytes_needed),
            boxes_verified: stats.boxes_verified,
            bytes_transferred: stats.bytes_transferred,
            requests: stats.requests,
            retries: stats.retries,
            bytes_sent,
            bytes_received,
            bytes_received_direct: 0,
            read_seconds,
            exchange_seconds,
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
