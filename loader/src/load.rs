//! One rank's load, end to end: allocate the destination buffers, read this rank's pieces from
//! storage (verified) straight into them, then run the ring exchange for the pieces other ranks
//! read. Also the embedded plan source: planning locally from the checkpoint, no service needed.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;

use serde::{Deserialize, Serialize};
use tessera_metadata::formats::dcp::IndexStats;
use tessera_metadata::formats::native::{BlockChecksums, Manifest};
use tessera_metadata::{CheckpointMeta, Format, OpenOptions, open_any};
use tessera_planner::{Plan, PlanOptions, RankPlan, RequestSet, plan};

use crate::exchange::{
    ExchangeMessages, ExchangeStats, check_buffer_sizes, check_rank, gather_message, invalid,
    place_message,
};
use crate::read::{
    ReadOptions, ReadStats, default_coalesce_gap, exact_multi_range, read_into_with,
};
use crate::transport::Transport;
use crate::transport::exchange_tag;
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

/// Options of [`load_rank`].
#[derive(Clone, Default)]
pub struct LoadOptions {
    /// Read scheduling and verification.
    pub read: ReadOptions,
    /// Called with the bytes of every completed read (for a progress bar).
    pub progress: Option<Arc<dyn Fn(u64) + Send + Sync>>,
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("read", &self.read)
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
    // Pieces this rank reads in storage order only to pass on need somewhere to stay.
    let (stats, read_seconds, exchanged) = match relay::with_relay_buffers(plan) {
        None => read_and_exchange(checkpoint, plan, transport, options, buffers, started).await?,
        Some(relaying) => {
            let mut slots = relay::slots(&relaying, buffers);
            read_and_exchange(
                checkpoint, &relaying, transport, options, &mut slots, started,
            )
            .await?
        }
    };
    let exchange_seconds = started.elapsed().as_secs_f64() - read_seconds;
    Ok(RankReport::of_host_load(
        plan,
        &stats,
        read_seconds,
        (exchanged.bytes_sent, exchanged.bytes_received),
        exchange_seconds,
        started.elapsed().as_secs_f64(),
    ))
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

/// Whether reads and the exchange overlap: yes unless `TESSERA_EXCHANGE_OVERLAP=0` (a switch for
/// side-by-side measurements, and a way back should a transport misbehave under concurrency).
fn overlap_enabled() -> bool {
    std::env::var("TESSERA_EXCHANGE_OVERLAP").map_or(true, |v| v.trim() != "0")
}

/// Reads this rank's pieces and runs its ring exchanges at the same time: a share goes out the
/// moment its last piece is placed and verified (ByteCheckpoint's "overlap tensor reading with
/// transferring"), receives run from the start, and what arrives is placed between reads (the plan
/// puts received pieces where none of this rank's reads land) or, the rest, once reading is done.
/// The wire protocol is [`crate::exchange::run_exchanges`]'s: one message per group and round.
///
/// Memory: a share is gathered once per group (the same bytes go to every round's peer) and held
/// until sent; what arrives waits at most until the read ends: at most the rank's own
/// destination bytes. A share is sent only once every one of its pieces passed verification, so
/// a corrupt read fails this rank before any peer sees the bytes.
///
/// Returns the read's stats, the seconds until the read ended, and the exchange's stats.
async fn read_and_exchange<T: Transport, B: AsMut<[u8]> + AsRef<[u8]>>(
    checkpoint: &Checkpoint,
    plan: &RankPlan,
    transport: &T,
    options: &LoadOptions,
    buffers: &mut [B],
    started: Instant,
) -> Result<(ReadStats, f64, ExchangeStats), LoaderError> {
    let messages = ExchangeMessages::of_plan(plan)?;
    if messages.outgoing.is_empty() && messages.incoming.is_empty() || !overlap_enabled() {
        // Nothing to exchange, or the exchange after the whole read (TESSERA_EXCHANGE_OVERLAP=0).
        let stats = checkpoint.read_into(plan, options, buffers).await?;
        let read_seconds = started.elapsed().as_secs_f64();
        let exchanged = crate::exchange::run_exchanges(transport, plan, buffers).await?;
        return Ok((stats, read_seconds, exchanged));
    }
    // Outgoing messages by piece: how many of each message's pieces are still being read.
    let mut left: Vec<usize> = messages.outgoing.iter().map(|m| m.pieces.len()).collect();
    let mut by_piece: std::collections::HashMap<usize, Vec<usize>> =
        std::collections::HashMap::new();
    for (m, message) in messages.outgoing.iter().enumerate() {
        for &piece in &message.pieces {
            by_piece.entry(piece).or_default().push(m);
        }
    }
    let (ready, mut to_send) = tokio::sync::mpsc::unbounded_channel::<(usize, Bytes)>();
    let arrived: std::sync::Mutex<Vec<(usize, Bytes)>> = std::sync::Mutex::new(Vec::new());
    let mut placed = 0usize;
    let exchange_started = Instant::now();

    let read = async {
        // The share of a group is the same for every round's peer: gathered once.
        let mut gathered: std::collections::HashMap<(u32, Vec<usize>), Bytes> =
            std::collections::HashMap::new();
        let mut send_ready = |m: usize, buffers: &[B]| -> Result<(), LoaderError> {
            let message = &messages.outgoing[m];
            let key = (message.group, message.pieces.clone());
            let data = match gathered.get(&key) {
                Some(data) => data.clone(),
                None => {
                    let mut out = vec![0u8; message.bytes as usize];
                    gather_message(plan, message, buffers, &mut out)?;
                    let data = Bytes::from(out);
                    gathered.insert(key, data.clone());
                    data
                }
            };
            // The network side ends only after this side dropped `ready`: a closed channel
            // means it failed, and its error is the one reported.
            let _ = ready.send((m, data));
            Ok(())
        };
        let mut place_arrived = |buffers: &mut [B]| -> Result<(), LoaderError> {
            let pending = std::mem::take(
                &mut *arrived
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
            for (i, data) in pending {
                place_message(plan, &messages.incoming[i], &data, buffers)?;
                placed += 1;
            }
            Ok(())
        };
        let stats = checkpoint
            .read_into_with(plan, options, buffers, |piece, buffers| {
                if let Some(waiting) = by_piece.get(&piece) {
                    for &m in waiting {
                        left[m] -= 1;
                        if left[m] == 0 {
                            send_ready(m, buffers)?;
                        }
                    }
                }
                place_arrived(buffers)
            })
            .await?;
        let read_seconds = started.elapsed().as_secs_f64();
        // A message whose pieces were all empty (or none read here) never completed a piece.
        if let Some((m, &missing)) = left.iter().enumerate().find(|(_, n)| **n > 0) {
            let message = &messages.outgoing[m];
            return Err(invalid(
                plan,
                format!(
                    "group {} round {}: {missing} of the pieces to send to rank {} were never read",
                    message.group, message.round, message.to
                ),
            ));
        }
        // Closing the channel tells the network side that nothing more will be sent.
        drop(ready);
        Ok::<_, LoaderError>((stats, read_seconds))
    };

    let network = async {
        let mut sends = futures::stream::FuturesUnordered::new();
        let mut receives: futures::stream::FuturesUnordered<_> = messages
            .incoming
            .iter()
            .enumerate()
            .map(|(i, expect)| async move {
                let data = transport.recv(expect.from, expect.tag).await.map_err(|e| {
                    e.in_context(
                        &format!("group {} round {}", expect.group, expect.round),
                        &format!(
                            "group {} round {} (tag {:#x})",
                            expect.group,
                            expect.round,
                            exchange_tag(expect.group, expect.round)
                        ),
                    )
                })?;
                if data.len() as u64 != expect.bytes {
                    return Err(LoaderError::Transport {
                        rank: plan.rank,
                        peer: expect.from,
                        detail: format!(
                            "group {} round {}: expected {} bytes but got {}",
                            expect.group,
                            expect.round,
                            expect.bytes,
                            data.len()
                        ),
                    });
                }
                Ok::<_, LoaderError>((i, data))
            })
            .collect();
        let (mut sent, mut received) = (0u64, 0u64);
        let mut channel_open = true;
        loop {
            tokio::select! {
                next = to_send.recv(), if channel_open => match next {
                    Some((m, data)) => {
                        let message = &messages.outgoing[m];
                        sends.push(async move {
                            let len = data.len() as u64;
                            transport.send(message.to, message.tag, data).await.map_err(|e| {
                                e.in_context(
                                    &format!("group {} round {}", message.group, message.round),
                                    &format!(
                                        "group {} round {} (tag {:#x})",
                                        message.group, message.round, message.tag
                                    ),
                                )
                            })?;
                            Ok::<u64, LoaderError>(len)
                        });
                    }
                    None => channel_open = false,
                },
                Some(done) = sends.next(), if !sends.is_empty() => sent += done?,
                Some(got) = receives.next(), if !receives.is_empty() => {
                    let (i, data) = got?;
                    received += data.len() as u64;
                    arrived
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((i, data));
                }
                else => break,
            }
        }
        Ok::<_, LoaderError>((sent, received))
    };

    let ((stats, read_seconds), (sent, received)) =
        futures::future::try_join(read, network).await?;
    // What arrived after the last read.
    let pending = std::mem::take(
        &mut *arrived
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner),
    );
    for (i, data) in pending {
        place_message(plan, &messages.incoming[i], &data, buffers)?;
        placed += 1;
    }
    if placed != messages.incoming.len() {
        return Err(invalid(
            plan,
            format!(
                "{} of the {} messages to receive were placed: the load is incomplete",
                placed,
                messages.incoming.len()
            ),
        ));
    }
    Ok((
        stats,
        read_seconds,
        ExchangeStats {
            bytes_sent: sent,
            bytes_received: received,
            messages: (messages.outgoing.len() + messages.incoming.len()) as u64,
            elapsed: exchange_started.elapsed(),
        },
    ))
}
