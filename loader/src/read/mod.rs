//! The read path: the pieces a rank reads itself, fetched from storage through the
//! [`RangeScheduler`] and assembled into their wire bytes (row-major over the piece).
//!
//! Every read piece's source runs become byte ranges of its file; the scheduler coalesces them
//! (a column slice of a row-major box is one range per row, merged where rows touch; an
//! element-wise transposed source is one run per element, merged into one range when the piece
//! covers its whole span), verifies and fetches them in bounded parts. As each part arrives, the
//! bytes of every run it overlaps are copied into that run's piece; a piece is handed to the caller
//! the moment its last byte lands, and its buffer is dropped. Memory stays within the scheduler's
//! byte budget plus the pieces that are partly assembled; since parts are requested in file order
//! and pieces are contiguous stretches of their file, those are few.
//!
//! A piece that is a whole saved box (the common case when a layout matches the saved one, and
//! always in `convert`) is checked against the crc32c of the box's own metadata row instead of
//! block checksums, folded from the parts as they arrive (`crc32c_combine`, since parts complete
//! in any order), and fetched without the checksum blocks around it. Block checksums only prove
//! that a file holds what was written; the box crc also proves the metadata points the box at its
//! own bytes (a metadata row with another box's offset passes every block check). A piece that is
//! part of a box is verified the same way, the box fetched whole, when the box is no larger than
//! the checksum blocks the piece would need: small tensors split over ranks then cost their own
//! bytes rather than a 64 KiB block on each side of every slice. Such a piece is handed on only
//! once its box has checked out.

use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::ObjectStore;
use object_store::path::{Path, PathPart};
use std::collections::HashMap;

use tessera_metadata::formats::native::BlockChecksums;
use tessera_metadata::{BoxChecksum, CheckpointMeta, MetadataError};
use tessera_planner::{RankPiece, RankPlan, SourceRead, StridedRuns};

pub mod decoded;
pub(crate) mod mapped;
pub mod overlay;
pub(crate) mod positioned;
pub mod scheduler;

use crate::LoaderError;
use crate::read::positioned::{JointSpan, LocalFiles, LocalPaths, PositionedRead};
use crate::read::scheduler::{FileRange, RangeScheduler, SourceFile, union_len};
use crate::verify::crc_fold::Crc;
use crate::verify::joint::JointRead;

pub use crate::read::scheduler::{
    OBJECT_STORE_COALESCE_GAP, ReadOptions, default_coalesce_gap, exact_multi_range,
};

/// Whether the kernel's copy out of the page cache was measured to slow down when the
/// destination and the file offset disagree modulo 64 on this kind of CPU, so that misaligned
/// local reads should go through a bounce buffer ([`ReadOptions::bounce_reads`]'s default): on
/// AMD (and Hygon) x86-64 CPUs, a third of its speed (the 2-vCPU AMD EPYC VM, BENCHMARKS.md
/// "Reading through a bounce buffer"); on Intel no difference, and the bounce's second copy
/// cost 15 % of a whole-model load (BENCHMARKS.md, issue 31 item 5). Elsewhere: not measured, no
/// bounce.
pub fn misaligned_copies_are_slow() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        let id = core::arch::x86_64::__cpuid(0);
        let mut vendor = [0u8; 12];
        for (i, word) in [id.ebx, id.edx, id.ecx].iter().enumerate() {
            vendor[i * 4..i * 4 + 4].copy_from_slice(&word.to_le_bytes());
        }
        matches!(&vendor, b"AuthenticAMD" | b"HygonGenuine")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// What [`read_pieces`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReadStats {
    /// Pieces read (and handed to `on_piece`).
    pub pieces: usize,
    /// Bytes of the pieces' source runs: what the plan needs from storage.
    pub bytes_needed: u64,
    /// Bytes requested from storage (verification's whole blocks included, retries not).
    /// Equals `bytes_needed` when not verifying (and no two runs read the same byte).
    pub bytes_fetched: u64,
    /// Of `bytes_needed`, the bytes of files read from local copies instead of the checkpoint's
    /// storage ([`ReadOptions::local_files`]: a memory tier's).
    pub bytes_from_local_copies: u64,
    /// Of `bytes_needed`, the bytes read from a live publisher's shared memory on this host
    /// ([`ReadOptions::shared_files`]) instead of over HTTP.
    pub bytes_from_shared_memory: u64,
    /// Local copies that failed a read (a changed byte, a truncation, not a regular file): each
    /// named with why. Their bytes were read from the checkpoint's storage instead.
    pub local_copy_fallbacks: Vec<String>,
    /// Bytes fetched only to complete checksum blocks.
    pub verify_extra_bytes: u64,
    /// Bytes checked against block checksums (0 when not verifying).
    pub bytes_verified: u64,
    /// Saved boxes fetched whole and checked against their metadata row's crc32c instead of
    /// block checksums (pieces that are whole boxes, and small boxes of which a piece is a part).
    pub boxes_verified: u64,
    /// Bytes read while verifying that no checksum covered: parts of saved boxes of a format
    /// without checksum blocks (DCP) that no joint check partitions, and boxes whose format
    /// records no checksum. 0 when not verifying.
    pub bytes_unverified: u64,
    /// Bytes the store returned: `bytes_fetched` plus the gaps that requests spanning several
    /// small parts fetched ([`ReadOptions::coalesce_gap`]).
    pub bytes_transferred: u64,
    /// Storage requests, one `get_range` each (small parts of one file may share one; retries
    /// not included).
    pub requests: u64,
    /// Parts fetched (ranges of at most the part size).
    pub parts: u64,
    /// Failed requests that were retried.
    pub retries: u64,
    /// This rank's folds of the saved boxes it reads in parts for joint checks
    /// ([`crate::verify::joint`]; only with [`ReadOptions::joint_checks`] and verification).
    pub joint_folds: Vec<crate::verify::joint::JointFold>,
    /// Wall time.
    pub elapsed: Duration,
}

/// Reads every piece of `plan` that this rank reads itself (`read` is `Some`) from the files
/// under `prefix` in `store` and calls `on_piece(index into plan.pieces, wire bytes)` once per
/// piece as soon as all its bytes are in (in no particular order). Bytes are verified against
/// `checksums` when `options.verify` is set and checksums are given, and (also only when
/// `options.verify` is set) pieces that are whole saved boxes of `meta` (the checkpoint the plan was made from) against the box's own crc32c when `meta`
/// records one ([`MetadataError::BoxChecksumMismatch`] otherwise). `progress(n)` is called with
/// the number of bytes just delivered to pieces; the calls add up to
/// [`ReadStats::bytes_needed`] (the plan's `summary.bytes_read`).
///
/// Errors name the file and byte range: [`LoaderError::MissingFile`], [`LoaderError::ShortRead`],
/// [`LoaderError::Checksum`], a box checksum mismatch ([`LoaderError::Metadata`]),
/// [`LoaderError::Storage`] (after retries for transient errors); an
/// error from `on_piece` stops the read and is returned. Must run inside a tokio runtime; dropping
/// the future aborts the requests in flight.
// Eight arguments: the two verification inputs (block checksums, box crcs from the metadata)
// are separate because either may be absent (foreign formats, plans tested without metadata).
#[allow(clippy::too_many_arguments)]
pub async fn read_pieces(
    store: Arc<dyn ObjectStore>,
    prefix: &Path,
    plan: &RankPlan,
    checksums: Option<&BlockChecksums>,
    meta: Option<&CheckpointMeta>,
    options: &ReadOptions,
    mut on_piece: impl FnMut(usize, &[u8]) -> Result<(), LoaderError>,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<ReadStats, LoaderError> {
    // Wire buffers, allocated when a piece's first byte arrives and handed on when complete.
    let mut wires: Vec<Option<Vec<u8>>> = vec![None; plan.pieces.len()];
    read_runs(
        store,
        prefix,
        plan,
        checksums,
        meta,
        options,
        None,
        |event| match event {
            Delivery::Bytes(piece, wire_offset, bytes) => {
                let total = plan.pieces[piece].bytes as usize;
                let wire = wires[piece].get_or_insert_with(|| vec![0u8; total]);
                let at = wire_offset as usize;
                wire[at..at + bytes.len()].copy_from_slice(bytes);
                Ok(())
            }
            Delivery::Complete(piece) => match wires[piece].take() {
                Some(wire) => on_piece(piece, &wire),
                None => on_piece(piece, &[]),
            },
            // Only reads with destinations are given targets for positioned reads.
            Delivery::Positioned { .. } => Err(LoaderError::InvalidPlan {
                detail: "a positioned read without destination buffers".to_string(),
            }),
        },
        progress,
    )
    .await
}

/// Reads this rank's pieces straight into its destination buffers (one per plan destination),
/// through each piece's place runs: no wire buffer, one copy from the fetched bytes. Verified as
/// [`read_pieces`] says.
#[allow(clippy::too_many_arguments)]
pub async fn read_into<B: AsMut<[u8]>>(
    store: Arc<dyn ObjectStore>,
    prefix: &Path,
    plan: &RankPlan,
    checksums: Option<&BlockChecksums>,
    meta: Option<&CheckpointMeta>,
    options: &ReadOptions,
    buffers: &mut [B],
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<ReadStats, LoaderError> {
    read_into_with(
        store,
        prefix,
        plan,
        checksums,
        meta,
        options,
        buffers,
        progress,
        |_, _| Ok(()),
    )
    .await
}

/// [`read_into`], calling `on_complete(piece, buffers)` as soon as each piece (index into
/// `plan.pieces`) this rank reads is wholly placed: the hook of the overlapped exchange
/// (`crate::load`'s overlapped exchange), which sends a share the moment its last piece lands.
/// The hook gets the buffers mutably: it may place bytes that arrived from peers meanwhile, which
/// the plan puts in regions no piece of this rank's reads touches.
#[allow(clippy::too_many_arguments)]
pub async fn read_into_with<B: AsMut<[u8]>>(
    store: Arc<dyn ObjectStore>,
    prefix: &Path,
    plan: &RankPlan,
    checksums: Option<&BlockChecksums>,
    meta: Option<&CheckpointMeta>,
    options: &ReadOptions,
    buffers: &mut [B],
    progress: Option<&(dyn Fn(u64) + Sync)>,
    mut on_complete: impl FnMut(usize, &mut [B]) -> Result<(), LoaderError>,
) -> Result<ReadStats, LoaderError> {
    let placers = plan
        .pieces
        .iter()
        .map(|p| match p.read {
            Some(_) => crate::exchange::place::WirePlacer::new(plan, p).map(Some),
            None => Ok(None),
        })
        .collect::<Result<Vec<_>, LoaderError>>()?;
    // Where each read piece's wire bytes land as one stretch of one destination: those may be
    // read from local files straight into it.
    let targets: Vec<Option<(usize, u64)>> = plan
        .pieces
        .iter()
        .zip(&placers)
        .map(|(p, placer)| {
            placer
                .as_ref()
                .and_then(|_| crate::exchange::place::contiguous_target(p))
        })
        .collect();
    read_runs(
        store,
        prefix,
        plan,
        checksums,
        meta,
        options,
        Some(&targets),
        |event| match event {
            Delivery::Bytes(piece, wire_offset, bytes) => match &placers[piece] {
                Some(placer) => placer.place(wire_offset, bytes, buffers),
                None => Ok(()),
            },
            Delivery::Complete(piece) => match &placers[piece] {
                Some(_) => on_complete(piece, buffers),
                None => Ok(()),
            },
            Delivery::Positioned {
                files,
                sources,
                reads,
                threads,
                crcs,
            } => {
                *crcs = crate::read::positioned::read_positioned(
                    files, sources, reads, buffers, threads,
                )?;
                Ok(())
            }
        },
        progress,
    )
    .await
}

/// What the read core hands on.
enum Delivery<'a> {
    /// Wire bytes of a piece (index into the plan's pieces) from this offset on.
    Bytes(usize, u64, &'a [u8]),
    /// The piece's last byte has been delivered (at once for an empty piece), and verified.
    Complete(usize),
    /// Perform these positioned reads into the destinations and put each one's crc32c (0 where
    /// not asked) in `crcs` ([`crate::read::positioned::read_positioned`]).
    Positioned {
        files: &'a LocalFiles,
        sources: &'a [SourceFile],
        reads: &'a [PositionedRead],
        threads: usize,
        crcs: &'a mut Vec<u32>,
    },
}

/// A piece read by position straight into its destination.
#[derive(Debug)]
struct PositionedSource {
    /// Index into the plan's pieces.
    piece: usize,
    /// Index into the plan's files.
    file: u32,
    offset: u64,
    len: u64,
    /// `(run, stride)` of a column slice ([`PositionedRead::strided`]); `None`: one stretch.
    strided: Option<(u64, u64)>,
    dest: usize,
    dst_start: u64,
    /// Its own box check (index into the positioned checks), when it is a whole saved box.
    check: Option<usize>,
    /// The joint check its runs are folded into (index into the read's joint reads).
    joint: Option<usize>,
}

/// Positioned reads are cut no smaller than this (1 MiB).
const POSITIONED_READ_MIN_BYTES: u64 = 1 << 20;

/// At most this many positioned reads go in one batch (bounds its bookkeeping; the bytes of a
/// batch are bounded by the read options' in-flight parts).
const MAX_POSITIONED_BATCH: usize = 1024;

/// The shared read core: schedules and fetches every run of every piece this rank reads and
/// hands each fetched run, then the piece's completion, to `deliver`. With `targets` (per plan
/// piece, the destination and offset its wire bytes land at as one stretch) and a local root in
/// `options`, such pieces whose bytes are one stretch of their file are read by position
/// straight into their destination (`Delivery::Positioned`), first, in bounded batches.
#[allow(clippy::too_many_arguments)]
async fn read_runs(
    store: Arc<dyn ObjectStore>,
    prefix: &Path,
    plan: &RankPlan,
    checksums: Option<&BlockChecksums>,
    meta: Option<&CheckpointMeta>,
    options: &ReadOptions,
    targets: Option<&[Option<(usize, u64)>]>,
    mut deliver: impl FnMut(Delivery<'_>) -> Result<(), LoaderError>,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<ReadStats, LoaderError> {
    let started = Instant::now();
    let mut files = Vec::with_capacity(plan.files.len());
    for key in &plan.files {
        files.push(SourceFile {
            path: resolve(prefix, key)?,
            key: key.clone(),
        });
    }

    let mut sort = ReadSort::new(plan, checksums, meta, options, targets, &files)?;
    for (index, piece) in plan.pieces.iter().enumerate() {
        let Some(read) = &piece.read else {
            continue;
        };
        if sort.add(index, piece, read)? {
            deliver(Delivery::Complete(index))?;
        }
    }
    let (sorted, local) = sort.finish();
    let SortedReads {
        sources,
        ranges,
        box_ranges,
        box_needed,
        checks,
        mut joint,
        positioned,
        mut positioned_checks,
        pieces,
        bytes_needed,
        bytes_from_local_copies,
        bytes_from_shared_memory,
        bytes_unverified,
    } = sorted;

    // Distinct bytes the pieces need, before `ranges` moves into the schedule.
    let needed_union = union_len(ranges.iter().chain(&box_needed).copied().collect());
    drop(box_needed);
    let scheduler = RangeScheduler::new(store, files, checksums, options);
    let schedule = scheduler.schedule_checked(ranges, box_ranges)?;
    let mut joint_left = Vec::with_capacity(joint.len());
    for j in &mut joint {
        joint_left.push(j.seal(plan.rank)?);
    }
    let mut assembly = Assembly::new(sources, checks, joint);

    let mut positioned_stats = (0u64, 0u64);
    if let Some(local) = &local {
        positioned_stats = read_by_position(
            local,
            scheduler.files(),
            options,
            &positioned,
            (&mut positioned_checks, &mut assembly.joint),
            &mut deliver,
            progress,
        )
        .await?;
        assembly.boxes_verified += positioned_checks.len() as u64;
    }

    let fetched = scheduler
        .fetch_with(&schedule.parts, &schedule.caller_checked, |part, bytes| {
            assembly.part(part, bytes, &mut deliver, progress)
        })
        .await?;
    assembly.check_complete(plan, &joint_left)?;

    let (positioned_reads, positioned_bytes) = positioned_stats;
    Ok(ReadStats {
        pieces,
        bytes_needed,
        bytes_from_local_copies,
        bytes_from_shared_memory,
        local_copy_fallbacks: Vec::new(),
        bytes_fetched: schedule.bytes_fetched + positioned_bytes,
        verify_extra_bytes: if scheduler.verifying() || !assembly.checks.is_empty() {
            schedule.bytes_fetched.saturating_sub(needed_union)
        } else {
            0
        },
        bytes_verified: fetched.bytes_verified,
        boxes_verified: assembly.boxes_verified,
        bytes_unverified,
        bytes_transferred: fetched.bytes_transferred + positioned_bytes,
        requests: fetched.requests + positioned_reads,
        parts: fetched.parts + positioned_reads,
        retries: fetched.retries,
        joint_folds: assembly.joint.iter().map(JointRead::result).collect(),
        elapsed: started.elapsed(),
    })
}

/// What [`ReadSort`] leaves for the fetch: every read piece, sorted by how it is read and
/// verified, and the counts of the read's stats that the sorting already knows.
#[derive(Default)]
struct SortedReads {
    /// Pieces fetched through the scheduler.
    sources: Vec<Source>,
    /// Ranges verified by block checksums (extended to whole blocks when fetched).
    ranges: Vec<FileRange>,
    /// Saved boxes fetched whole and checked against their own crc32c: no checksum blocks.
    box_ranges: Vec<FileRange>,
    /// What the pieces verified by box need of their file (for the accounting of what
    /// verification added).
    box_needed: Vec<FileRange>,
    checks: Vec<BoxCrc>,
    /// Saved boxes this rank reads a part of and verifies with the other readers after the read
    /// (joint checks): their pieces are fetched exactly, without checksum blocks, and folded.
    joint: Vec<JointRead>,
    /// Pieces read by position straight into their destination.
    positioned: Vec<PositionedSource>,
    /// Box checks of positioned pieces: each its own, never folded from scheduled parts.
    positioned_checks: Vec<BoxCrc>,
    pieces: usize,
    bytes_needed: u64,
    bytes_from_local_copies: u64,
    bytes_from_shared_memory: u64,
    bytes_unverified: u64,
}

/// Sorts the pieces this rank reads by how each is read and verified: by position straight into
/// its destination (a whole stretch or a column slice of a local file), or scheduled from the
/// store and checked by its box's crc32c, by block checksums, jointly with the other readers of
/// its box, or not at all.
struct ReadSort<'a> {
    plan: &'a RankPlan,
    options: &'a ReadOptions,
    files: &'a [SourceFile],
    targets: Option<&'a [Option<(usize, u64)>]>,
    /// `None` when not verifying: `verify: false` turns off every checksum, the boxes' too.
    boxes: Option<BoxLookup<'a>>,
    block_checksums: Option<&'a BlockChecksums>,
    /// The local files positioned reads go through (only for reads with destinations).
    local: Option<LocalFiles>,
    /// Box check (index into `out.checks`) by (file, box start): the pieces of one box share it.
    check_of: HashMap<(u32, u64), usize>,
    /// Joint read (index into `out.joint`) by piece id.
    joint_of: HashMap<u32, usize>,
    /// One piece's source ranges (reused).
    piece_ranges: Vec<FileRange>,
    out: SortedReads,
}

impl<'a> ReadSort<'a> {
    /// Sets the sort up: the joint checks this rank takes part in (only when verifying with
    /// joint checks on), and the local files when positioned reads are possible.
    fn new(
        plan: &'a RankPlan,
        checksums: Option<&'a BlockChecksums>,
        meta: Option<&'a CheckpointMeta>,
        options: &'a ReadOptions,
        targets: Option<&'a [Option<(usize, u64)>]>,
        files: &'a [SourceFile],
    ) -> Result<Self, LoaderError> {
        let mut out = SortedReads::default();
        let mut joint_of: HashMap<u32, usize> = HashMap::new();
        if let (true, Some(meta)) = (options.joint_checks && options.verify, meta) {
            for check in plan.joint_checks.iter().filter(|c| !c.pieces.is_empty()) {
                let saved = crate::verify::joint::saved_box(meta, plan, check)?;
                let Some(file) = plan.files.iter().position(|f| *f == saved.key) else {
                    return Err(LoaderError::InvalidPlan {
                        detail: format!(
                            "rank {}: joint check {}: the plan reads no part of {} ({})",
                            plan.rank, check.id, saved.entry, saved.key
                        ),
                    });
                };
                for &piece in &check.pieces {
                    joint_of.insert(piece, out.joint.len());
                }
                out.joint.push(JointRead::new(check.id, file as u32, saved));
            }
        }
        let local = match (LocalPaths::of(options), targets) {
            (Some(paths), Some(_)) => {
                Some(LocalFiles::new(paths, files.len(), options.bounce_reads))
            }
            _ => None,
        };
        Ok(ReadSort {
            plan,
            options,
            files,
            targets,
            boxes: meta.filter(|_| options.verify).map(BoxLookup::new),
            block_checksums: checksums.filter(|_| options.verify),
            local,
            check_of: HashMap::new(),
            joint_of,
            piece_ranges: Vec::new(),
            out,
        })
    }

    /// The sorted reads and the local files the positioned ones go through.
    fn finish(self) -> (SortedReads, Option<LocalFiles>) {
        (self.out, self.local)
    }

    /// Sorts piece `index` (`read` is how this rank reads it); true when it is empty, so
    /// complete at once.
    fn add(
        &mut self,
        index: usize,
        piece: &RankPiece,
        read: &SourceRead,
    ) -> Result<bool, LoaderError> {
        let plan = self.plan;
        self.out.pieces += 1;
        self.out.bytes_needed += piece.bytes;
        if read.file as usize >= self.files.len() {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "rank {}: piece {} reads file #{} but the plan lists {} files",
                    plan.rank,
                    piece.id,
                    read.file,
                    self.files.len()
                ),
            });
        }
        let runs = Runs::new(&read.runs, piece.bytes).map_err(|why| LoaderError::InvalidPlan {
            detail: format!("rank {}: piece {}: {why}", plan.rank, piece.id),
        })?;
        if piece.bytes == 0 {
            return Ok(true);
        }
        let files = self.files;
        let file = &files[read.file as usize];
        if self.options.local_files.contains_key(file.path.as_ref()) {
            self.out.bytes_from_local_copies += piece.bytes;
        } else if self.options.shared_files.contains_key(file.path.as_ref()) {
            self.out.bytes_from_shared_memory += piece.bytes;
        }
        let target = self.targets.and_then(|t| t.get(index).copied().flatten());
        let joint_read = self.joint_of.get(&piece.id).copied();
        // A piece of a joint check reads the checked box's file, whichever way it is read.
        if let Some(j) = joint_read
            && self.out.joint[j].file != read.file
        {
            let joint = &self.out.joint[j];
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "rank {}: piece {} of joint check {} reads another file than {}",
                    plan.rank, piece.id, joint.check, joint.saved.key
                ),
            });
        }
        let at = PieceAt {
            index,
            piece,
            file: (read.file, file),
            target,
            joint: joint_read,
        };
        if !self.read_whole_by_position(&at, &runs)? && !self.read_slice_by_position(&at, &runs)? {
            self.schedule(&at, runs)?;
        }
        Ok(false)
    }

    /// Reads the piece by position when its wire is one stretch of a local file landing in one
    /// stretch of a destination, and its verification (if any) is its own box's crc32c; false
    /// when it is not read so.
    fn read_whole_by_position(
        &mut self,
        at: &PieceAt<'_>,
        runs: &Runs,
    ) -> Result<bool, LoaderError> {
        let (file_index, file) = at.file;
        let (Some(local), Some((dest, dst_start)), None) =
            (self.local.as_mut(), at.target, at.joint)
        else {
            return Ok(false);
        };
        if !(runs.is_identity() && local.readable(file)) {
            return Ok(false);
        }
        let own_box = self
            .boxes
            .as_mut()
            .and_then(|b| b.whole_box(self.plan, at.piece, runs, at.file));
        if own_box.is_none() && self.block_checksums.is_some() {
            return Ok(false);
        }
        if own_box.is_none() && self.options.verify {
            self.out.bytes_unverified += runs.total;
        }
        local.open(file_index, file)?;
        let check = own_box.map(|check| {
            self.out.positioned_checks.push(check);
            self.out.positioned_checks.len() - 1
        });
        self.out.positioned.push(PositionedSource {
            piece: at.index,
            file: file_index,
            offset: runs.src_offset,
            len: runs.total,
            strided: None,
            dest,
            dst_start,
            check,
            joint: None,
        });
        Ok(true)
    }

    /// Reads a column slice (one run per saved row, the runs landing back to back in one stretch
    /// of a destination) by position too when it is checked jointly (its runs folded as they are
    /// read) or nothing checks it: a format without block checksums, or no verification
    /// ([`mapped`]). False when it is not read so.
    fn read_slice_by_position(
        &mut self,
        at: &PieceAt<'_>,
        runs: &Runs,
    ) -> Result<bool, LoaderError> {
        let (file_index, file) = at.file;
        let plan = self.plan;
        let (Some(local), Some((dest, dst_start)), Some(strided)) =
            (self.local.as_mut(), at.target, runs.single_stride())
        else {
            return Ok(false);
        };
        if !((at.joint.is_some() || self.block_checksums.is_none() || !self.options.verify)
            && local.readable(file)
            && self
                .boxes
                .as_mut()
                .and_then(|b| b.whole_box(plan, at.piece, runs, at.file))
                .is_none())
        {
            return Ok(false);
        }
        if let Some(j) = at.joint {
            self.piece_ranges.clear();
            runs.src_ranges(file_index, &mut self.piece_ranges);
            for r in &self.piece_ranges {
                self.out.joint[j].add_by_position(*r, plan.rank)?;
            }
        } else if self.options.verify {
            self.out.bytes_unverified += runs.total;
        }
        local.open(file_index, file)?;
        self.out.positioned.push(PositionedSource {
            piece: at.index,
            file: file_index,
            offset: runs.src_offset,
            len: runs.total,
            strided: Some(strided),
            dest,
            dst_start,
            check: None,
            joint: at.joint,
        });
        Ok(true)
    }

    /// Schedules the piece's runs from the store: folded into its joint check, or checked by a
    /// box's crc32c, or by block checksums (or by nothing, said in the report).
    fn schedule(&mut self, at: &PieceAt<'_>, runs: Runs) -> Result<(), LoaderError> {
        let (file_index, _) = at.file;
        self.piece_ranges.clear();
        runs.src_ranges(file_index, &mut self.piece_ranges);
        if let Some(j) = at.joint {
            for r in &self.piece_ranges {
                self.out.joint[j].add(*r, self.plan.rank)?;
            }
            self.out.box_ranges.extend_from_slice(&self.piece_ranges);
            self.out.box_needed.extend_from_slice(&self.piece_ranges);
            self.out.sources.push(Source {
                piece: at.index,
                file: file_index,
                runs,
                check: None,
            });
            return Ok(());
        }
        let check = match self.box_check(at, &runs)? {
            Some(check) => {
                let key = (file_index, check.start);
                let check_at = match self.check_of.get(&key) {
                    Some(&check_at) => check_at,
                    None => {
                        self.out.box_ranges.push(FileRange {
                            file: file_index,
                            start: check.start,
                            end: check.end,
                        });
                        self.out.checks.push(check);
                        self.check_of.insert(key, self.out.checks.len() - 1);
                        self.out.checks.len() - 1
                    }
                };
                self.out.box_needed.extend_from_slice(&self.piece_ranges);
                Some(check_at)
            }
            None => {
                self.out.ranges.extend_from_slice(&self.piece_ranges);
                if self.block_checksums.is_none() && self.options.verify {
                    // No checksum covers a part of a box read alone (a format without
                    // blocks, a box no joint check partitions): said in the report.
                    self.out.bytes_unverified += runs.total;
                }
                None
            }
        };
        self.out.sources.push(Source {
            piece: at.index,
            file: file_index,
            runs,
            check,
        });
        Ok(())
    }

    /// The box check of a scheduled piece, if any. A whole box is checked by its own crc32c
    /// (which also proves the metadata points it at its own bytes). A part of a box is too when
    /// fetching the whole box costs no more than the checksum blocks around the part: a small
    /// tensor split over ranks otherwise costs a whole 64 KiB block on each side of every rank's
    /// slice of it. Needs the piece's ranges in `piece_ranges`.
    fn box_check(&mut self, at: &PieceAt<'_>, runs: &Runs) -> Result<Option<BoxCrc>, LoaderError> {
        let Some(b) = self.boxes.as_mut() else {
            return Ok(None);
        };
        if let Some(check) = b.whole_box(self.plan, at.piece, runs, at.file) {
            return Ok(Some(check));
        }
        match (
            self.block_checksums,
            b.containing_box(self.plan, at.piece, runs, at.file),
        ) {
            (Some(blocks), Some(check)) => {
                let cost = block_cost(blocks, &at.file.1.key, &self.piece_ranges)?;
                Ok((check.end - check.start <= cost).then_some(check))
            }
            _ => Ok(None),
        }
    }
}

/// A piece being sorted, with what the sort looked up for it.
struct PieceAt<'p> {
    /// Index into the plan's pieces.
    index: usize,
    piece: &'p RankPiece,
    /// Index into the plan's files, and the file.
    file: (u32, &'p SourceFile),
    /// Where its wire bytes land as one stretch of one destination, if they do.
    target: Option<(usize, u64)>,
    /// Its joint check (index into the joint reads), if any.
    joint: Option<usize>,
}

/// Assembles the scheduled pieces from the fetched parts: copies each part's bytes into every
/// run it overlaps, folds them into the box and joint checks it covers, and completes a piece
/// once its last byte is in and the box check it waits for (if any) has passed.
struct Assembly {
    sources: Vec<Source>,
    source_index: SpanIndex,
    /// Per source: bytes not yet delivered.
    remaining: Vec<u64>,
    checks: Vec<BoxCrc>,
    check_index: SpanIndex,
    /// Per box check: the sources whose bytes are all in but whose box is not yet verified.
    waiting: Vec<Vec<usize>>,
    joint: Vec<JointRead>,
    joint_index: SpanIndex,
    boxes_verified: u64,
}

impl Assembly {
    fn new(sources: Vec<Source>, checks: Vec<BoxCrc>, joint: Vec<JointRead>) -> Self {
        let source_index = SpanIndex::new(
            sources
                .iter()
                .map(|s| (s.file, s.runs.src_offset, s.runs.src_end)),
        );
        let check_index = SpanIndex::new(checks.iter().map(|c| (c.file, c.start, c.end)));
        let joint_index =
            SpanIndex::new(joint.iter().map(|j| (j.file, j.saved.start, j.saved.end)));
        Assembly {
            remaining: sources.iter().map(|s| s.runs.total).collect(),
            waiting: vec![Vec::new(); checks.len()],
            sources,
            source_index,
            checks,
            check_index,
            joint,
            joint_index,
            boxes_verified: 0,
        }
    }

    /// Takes in one fetched part (`bytes` are the file bytes of `part`).
    fn part(
        &mut self,
        part: FileRange,
        bytes: &[u8],
        deliver: &mut impl FnMut(Delivery<'_>) -> Result<(), LoaderError>,
        progress: Option<&(dyn Fn(u64) + Sync)>,
    ) -> Result<(), LoaderError> {
        let mut delivered = 0u64;
        for s in self.source_index.overlapping(part) {
            let source = &mut self.sources[s];
            let piece = source.piece;
            let copied = source
                .runs
                .copy_from(part.start, bytes, |wire_offset, run| {
                    deliver(Delivery::Bytes(piece, wire_offset, run))
                })?;
            delivered += copied;
            self.remaining[s] -= copied;
            if copied > 0 && self.remaining[s] == 0 {
                // A piece whose box is still being checked completes when the check does.
                match source.check {
                    Some(c) if !self.checks[c].done() => self.waiting[c].push(s),
                    _ => deliver(Delivery::Complete(piece))?,
                }
            }
        }
        for j in self.joint_index.overlapping(part) {
            self.joint[j].fold_part(part.start, bytes);
        }
        for c in self.check_index.overlapping(part) {
            let check = &mut self.checks[c];
            if check.fold(part.start, bytes) && check.done() {
                check.finish()?;
                self.boxes_verified += 1;
                for s in std::mem::take(&mut self.waiting[c]) {
                    deliver(Delivery::Complete(self.sources[s].piece))?;
                }
            }
        }
        if let (Some(progress), true) = (progress, delivered > 0) {
            progress(delivered);
        }
        Ok(())
    }

    /// After the fetch: every scheduled piece, box check and joint fold got all its bytes
    /// (`joint_left`: what each joint read was sealed with). A plan whose runs the schedule
    /// does not cover is refused here rather than handing on pieces with holes.
    fn check_complete(&self, plan: &RankPlan, joint_left: &[u64]) -> Result<(), LoaderError> {
        if let Some((source, left)) = self
            .sources
            .iter()
            .zip(&self.remaining)
            .find(|(_, left)| **left > 0)
        {
            let piece = &plan.pieces[source.piece];
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "rank {}: piece {}: {} of its {} bytes were never fetched",
                    plan.rank, piece.id, left, piece.bytes
                ),
            });
        }
        if let Some(check) = self.checks.iter().find(|c| !c.done()) {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "rank {}: {} of {} was never fetched whole",
                    plan.rank, check.entry, check.path
                ),
            });
        }
        for (j, want) in self.joint.iter().zip(joint_left) {
            if j.fold.bytes() != *want {
                return Err(LoaderError::InvalidPlan {
                    detail: format!(
                        "rank {}: joint check {}: {} of the {} bytes this rank reads of {} were fetched",
                        plan.rank,
                        j.check,
                        j.fold.bytes(),
                        want,
                        j.saved.entry
                    ),
                });
            }
        }
        Ok(())
    }
}

/// Reads the `positioned` pieces straight into their destinations (through `deliver`) in
/// batches of at most the read options' in-flight parts, verifying whole boxes by their crc32c,
/// and delivers each piece's completion as its batch ends; returns (reads, bytes). Between
/// batches the task yields, so that an exchange sharing it (the overlapped exchange) moves on.
async fn read_by_position(
    local: &LocalFiles,
    sources: &[SourceFile],
    options: &ReadOptions,
    positioned: &[PositionedSource],
    (checks, joint): (&mut [BoxCrc], &mut [JointRead]),
    deliver: &mut impl FnMut(Delivery<'_>) -> Result<(), LoaderError>,
    progress: Option<&(dyn Fn(u64) + Sync)>,
) -> Result<(u64, u64), LoaderError> {
    // Reads of at most a quarter part: the threads of a batch all wait for its last read, so
    // smaller reads keep them busy to the end (a syscall per 4 MiB costs nothing measurable).
    let part_size = (options.part_size / 4).max(POSITIONED_READ_MIN_BYTES);
    let batch_bytes = options
        .part_size
        .max(1)
        .saturating_mul(options.max_in_flight.max(1) as u64);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = options.max_in_flight.clamp(1, cores);
    // Every read (at most a part each), with the positioned piece it belongs to.
    let mut reads: Vec<(usize, PositionedRead)> = Vec::new();
    for (s, source) in positioned.iter().enumerate() {
        // A column slice is cut between runs: each read takes whole runs, a part's worth.
        let (step, stride) = match source.strided {
            Some((run, stride)) => (run.max(1) * (part_size / run.max(1)).max(1), stride),
            None => (part_size, 0),
        };
        let mut at = 0;
        while at < source.len {
            let len = (source.len - at).min(step);
            let offset = match source.strided {
                Some((run, _)) => source.offset + at / run.max(1) * stride,
                None => source.offset + at,
            };
            reads.push((
                s,
                PositionedRead {
                    file: source.file,
                    offset,
                    len,
                    strided: source.strided,
                    joint: source.joint.map(|j| JointSpan {
                        crc: Crc::of(joint[j].saved.checksum),
                        start: joint[j].saved.start,
                        len: joint[j].saved.end - joint[j].saved.start,
                    }),
                    dest: source.dest,
                    dst_start: source.dst_start + at,
                    crc: source.check.map(|c| Crc::of(checks[c].expected)),
                },
            ));
            at += len;
        }
    }
    let mut left: Vec<u64> = positioned.iter().map(|p| p.len).collect();
    let (mut count, mut total) = (0u64, 0u64);
    let mut start = 0;
    while start < reads.len() {
        let mut end = start;
        let mut bytes = 0u64;
        while end < reads.len() && end - start < MAX_POSITIONED_BATCH && (bytes < batch_bytes) {
            bytes += reads[end].1.len;
            end += 1;
        }
        let batch: Vec<PositionedRead> = reads[start..end].iter().map(|r| r.1).collect();
        let mut crcs = Vec::new();
        deliver(Delivery::Positioned {
            files: local,
            sources,
            reads: &batch,
            threads,
            crcs: &mut crcs,
        })?;
        for (&(s, read), &crc) in reads[start..end].iter().zip(&crcs) {
            let source = &positioned[s];
            if let Some(c) = source.check {
                checks[c].add(read.offset, crc, read.len);
            }
            if let Some(j) = source.joint {
                joint[j].fold.absorb(crc, read.len);
            }
            left[s] -= read.len;
            if left[s] == 0 {
                if let Some(c) = source.check {
                    checks[c].finish()?;
                }
                deliver(Delivery::Complete(source.piece))?;
            }
        }
        count += (end - start) as u64;
        total += bytes;
        if let Some(progress) = progress {
            progress(bytes);
        }
        start = end;
        tokio::task::yield_now().await;
    }
    Ok((count, total))
}

/// The object path of `relative` (a `/`-separated path from the plan) under `prefix`. Plans
/// come over the network, so `.`, `..`, empty segments and other odd segments are refused rather
/// than allowed to point outside the checkpoint.
pub(crate) fn resolve(prefix: &Path, relative: &str) -> Result<Path, LoaderError> {
    let bad = |why: String| LoaderError::InvalidPlan {
        detail: format!(
            "file path {relative:?} is not a relative path inside the checkpoint ({why})"
        ),
    };
    let mut path = prefix.clone();
    for segment in relative.split('/') {
        if segment.is_empty() {
            return Err(bad("an empty segment".to_string()));
        }
        let part =
            PathPart::parse(segment).map_err(|e| bad(format!("segment {segment:?}: {e}")))?;
        path = path.join(part);
    }
    Ok(path)
}

/// A piece being read.
#[derive(Debug)]
struct Source {
    /// Index into the plan's pieces.
    piece: usize,
    /// Index into the plan's files.
    file: u32,
    runs: Runs,
    /// The box check (index into the read's checks) that verifies the piece's bytes instead of
    /// block checksums: the piece is a whole saved box, or lies in one that is fetched whole.
    check: Option<usize>,
}

/// Finds the saved box of the checkpoint's metadata that a piece is, if it is a whole one.
struct BoxLookup<'a> {
    meta: &'a CheckpointMeta,
    /// Tensor index by FQN, built on first use (plans name tensors by FQN).
    tensors: Option<HashMap<&'a str, u32>>,
}

impl<'a> BoxLookup<'a> {
    fn new(meta: &'a CheckpointMeta) -> Self {
        Self {
            meta,
            tensors: None,
        }
    }

    /// The check of `piece` when it reads, from `file`, exactly the bytes of a saved box with the
    /// same tensor and region whose metadata row records a crc32c. Anything else (a part of a
    /// box, a format without box checksums, a plan made from other metadata) is not checked here.
    fn whole_box(
        &mut self,
        plan: &RankPlan,
        piece: &RankPiece,
        runs: &Runs,
        file: (u32, &SourceFile),
    ) -> Option<BoxCrc> {
        let (file_index, file) = file;
        let contiguous = runs.sorted && runs.src_end - runs.src_offset == runs.total;
        if !contiguous || runs.total == 0 {
            return None;
        }
        let meta = self.meta;
        let (fqn, tensor) = self.tensor(plan, piece)?;
        let chunk = meta
            .chunks_of(tensor)
            .iter()
            .find(|c| c.region == piece.region)?;
        let expected = chunk.checksum()?;
        let same_bytes = meta.files().get(chunk.bytes.file as usize)?.path == file.key
            && chunk.bytes.offset == runs.src_offset
            && chunk.bytes.length == runs.total;
        same_bytes.then(|| BoxCrc {
            file: file_index,
            path: file.path.to_string(),
            entry: format!("tensor {fqn} box {}", chunk.region),
            start: runs.src_offset,
            end: runs.src_end,
            expected,
            folded: 0,
            segments: Vec::new(),
        })
    }

    /// The check of the saved box (of the piece's tensor, with a recorded crc32c) whose bytes in
    /// `file` hold every byte `piece` reads: a part of a box, fetched whole to be verified.
    fn containing_box(
        &mut self,
        plan: &RankPlan,
        piece: &RankPiece,
        runs: &Runs,
        file: (u32, &SourceFile),
    ) -> Option<BoxCrc> {
        let (file_index, file) = file;
        let meta = self.meta;
        let (fqn, tensor) = self.tensor(plan, piece)?;
        let chunk = meta.chunks_of(tensor).iter().find(|c| {
            c.bytes.offset <= runs.src_offset
                && runs.src_end <= c.bytes.offset.saturating_add(c.bytes.length)
                && meta
                    .files()
                    .get(c.bytes.file as usize)
                    .is_some_and(|f| f.path == file.key)
        })?;
        Some(BoxCrc {
            file: file_index,
            path: file.path.to_string(),
            entry: format!("tensor {fqn} box {}", chunk.region),
            start: chunk.bytes.offset,
            end: chunk.bytes.offset.checked_add(chunk.bytes.length)?,
            expected: chunk.checksum()?,
            folded: 0,
            segments: Vec::new(),
        })
    }

    /// The FQN of the piece's tensor and its index in the metadata.
    fn tensor<'p>(&mut self, plan: &'p RankPlan, piece: &RankPiece) -> Option<(&'p str, u32)> {
        let meta = self.meta;
        let fqn = plan.tensors.get(piece.tensor as usize)?.fqn.as_str();
        let tensors = self.tensors.get_or_insert_with(|| {
            meta.tensors()
                .iter()
                .enumerate()
                .map(|(i, t)| (t.fqn.as_str(), i as u32))
                .collect()
        });
        Some((fqn, *tensors.get(fqn)?))
    }
}

/// Bytes fetched to verify `ranges` of the file `key` by block checksums: the whole blocks that
/// cover them, each block once.
fn block_cost(
    checksums: &BlockChecksums,
    key: &str,
    ranges: &[FileRange],
) -> Result<u64, LoaderError> {
    let mut covering = Vec::with_capacity(ranges.len());
    for r in ranges {
        let c = checksums.covering_byte_range(key, r.start, r.end)?;
        covering.push(FileRange {
            file: r.file,
            start: c.start,
            end: c.end,
        });
    }
    Ok(union_len(covering))
}

/// The checksum of a whole saved box, assembled from the parts that hold its bytes.
#[derive(Debug)]
struct BoxCrc {
    /// Index into the plan's files.
    file: u32,
    /// Store path of the data file.
    path: String,
    entry: String,
    start: u64,
    end: u64,
    expected: BoxChecksum,
    /// Bytes of the box folded in so far.
    folded: u64,
    /// (file offset, crc, length) of the box's bytes in each part seen so far.
    segments: Vec<(u64, u32, u64)>,
}

impl BoxCrc {
    /// Folds in the box's bytes among `bytes` (file bytes from `start`); true when there were
    /// some.
    fn fold(&mut self, start: u64, bytes: &[u8]) -> bool {
        let end = start + bytes.len() as u64;
        let (lo, hi) = (self.start.max(start), self.end.min(end));
        if lo < hi {
            let slice = &bytes[(lo - start) as usize..(hi - start) as usize];
            self.add(lo, Crc::of(self.expected).checksum(slice), hi - lo);
        }
        lo < hi
    }

    /// Adds the crc of the box's `len` bytes at file offset `offset` (read elsewhere).
    fn add(&mut self, offset: u64, crc: u32, len: u64) {
        self.segments.push((offset, crc, len));
        self.folded += len;
    }

    /// True when every byte of the box has been folded in (parts never overlap).
    fn done(&self) -> bool {
        self.folded >= self.end - self.start
    }

    /// Combines the segments in file order and compares with the recorded checksum.
    fn finish(&mut self) -> Result<(), LoaderError> {
        self.segments.sort_unstable_by_key(|s| s.0);
        let mut at = self.start;
        let mut crc = 0u32;
        for &(offset, part, len) in &self.segments {
            if offset != at {
                // Parts never overlap and cover every byte of a complete piece; a gap here would
                // be a scheduler bug, so say so rather than report a bogus checksum.
                return Err(LoaderError::InvalidPlan {
                    detail: format!(
                        "{}: the bytes of {} were assembled with a gap at {at}",
                        self.path, self.entry
                    ),
                });
            }
            crc = Crc::of(self.expected).combine(crc, part, len);
            at += len;
        }
        if crc != self.expected.value() || at != self.end {
            return Err(MetadataError::BoxChecksumMismatch {
                path: self.path.clone(),
                entry: std::mem::take(&mut self.entry),
                start: self.start,
                end: self.end,
                algorithm: self.expected.algorithm(),
                expected: self.expected.value(),
                actual: crc,
            }
            .into());
        }
        Ok(())
    }
}

/// A piece's read runs with the outer dims ordered by falling source stride, so that iteration
/// walks the file forward for every real layout (row-major slices and permuted, e.g. transposed,
/// sources alike).
#[derive(Debug)]
struct Runs {
    run_bytes: u64,
    counts: Vec<u64>,
    src_strides: Vec<u64>,
    dst_strides: Vec<u64>,
    src_offset: u64,
    dst_offset: u64,
    /// One past the last source byte.
    src_end: u64,
    /// Bytes moved.
    total: u64,
    /// Runs are disjoint and strictly increasing in source order, so a part's first run can be
    /// computed and the walk can stop at the part's end. Otherwise (overlapping source runs, which
    /// no checkpoint layout produces but a plan could say) every part scans every run.
    sorted: bool,
}

impl Runs {
    /// Checks `runs` (from a plan, so untrusted: checked arithmetic) against a piece of
    /// `piece_bytes` wire bytes and orders them.
    fn new(runs: &StridedRuns, piece_bytes: u64) -> Result<Runs, String> {
        let n = runs.counts.len();
        if runs.src_strides.len() != n || runs.dst_strides.len() != n {
            return Err(format!(
                "read runs with {} counts, {} source strides and {} destination strides",
                n,
                runs.src_strides.len(),
                runs.dst_strides.len()
            ));
        }
        let overflow = || "read runs overflow 64-bit byte offsets".to_string();
        let empty = runs.run_bytes == 0 || runs.counts.contains(&0);
        let mut dims: Vec<(u64, u64, u64)> = (0..n)
            .filter(|&d| runs.counts[d] != 1)
            .map(|d| (runs.counts[d], runs.src_strides[d], runs.dst_strides[d]))
            .collect();
        if empty {
            dims.clear();
        }
        dims.sort_by_key(|d| std::cmp::Reverse(d.1));
        let total = if empty {
            0
        } else {
            dims.iter()
                .try_fold(runs.run_bytes, |acc, d| acc.checked_mul(d.0))
                .ok_or_else(overflow)?
        };
        if total != piece_bytes {
            return Err(format!(
                "its read runs move {total} bytes but the piece has {piece_bytes}"
            ));
        }
        let span = |stride: fn(&(u64, u64, u64)) -> u64, origin: u64| -> Option<u64> {
            if empty {
                return Some(origin);
            }
            dims.iter()
                .try_fold(origin.checked_add(runs.run_bytes)?, |acc, d| {
                    acc.checked_add((d.0 - 1).checked_mul(stride(d))?)
                })
        };
        let src_end = span(|d| d.1, runs.src_offset).ok_or_else(overflow)?;
        let dst_end = span(|d| d.2, runs.dst_offset).ok_or_else(overflow)?;
        if dst_end > piece_bytes {
            return Err(format!(
                "its read runs write up to wire byte {dst_end} of a {piece_bytes}-byte piece"
            ));
        }
        // Disjoint and increasing when every dim's stride clears everything inside it.
        let mut inner = runs.run_bytes;
        let mut sorted = true;
        for d in dims.iter().rev() {
            if d.1 < inner {
                sorted = false;
                break;
            }
            inner += (d.0 - 1) * d.1;
        }
        Ok(Runs {
            run_bytes: runs.run_bytes,
            counts: dims.iter().map(|d| d.0).collect(),
            src_strides: dims.iter().map(|d| d.1).collect(),
            dst_strides: dims.iter().map(|d| d.2).collect(),
            src_offset: runs.src_offset,
            dst_offset: runs.dst_offset,
            src_end,
            total,
            sorted,
        })
    }

    /// Whether wire byte i is file byte `src_offset + i` for every byte: the piece is one stretch
    /// of its file, in file order.
    fn is_identity(&self) -> bool {
        self.sorted
            && self.src_end - self.src_offset == self.total
            && self.dst_offset == 0
            && self.src_strides == self.dst_strides
    }

    /// `(run bytes, source stride)` when the runs are one row of runs in file order landing back
    /// to back on the wire (a column slice of a row-major box, any number of rows merged into
    /// one dim): what a strided positioned read takes ([`mapped`]).
    fn single_stride(&self) -> Option<(u64, u64)> {
        match (self.counts.as_slice(), self.src_strides.as_slice()) {
            ([count], [stride])
                if *count > 1
                    && self.sorted
                    && self.dst_offset == 0
                    && self.dst_strides == [self.run_bytes]
                    && *stride > self.run_bytes =>
            {
                Some((self.run_bytes, *stride))
            }
            _ => None,
        }
    }

    /// Appends the source byte ranges of the runs to `out`, merged where runs touch.
    fn src_ranges(&self, file: u32, out: &mut Vec<FileRange>) {
        if self.total == 0 {
            return;
        }
        // A piece that fills its span (a whole stored box, in any element order) is one range.
        if self.sorted && self.src_end - self.src_offset == self.total {
            out.push(FileRange {
                file,
                start: self.src_offset,
                end: self.src_end,
            });
            return;
        }
        let mut cursor = Cursor::start(self);
        let mut current: Option<FileRange> = None;
        while let Some((src, _)) = cursor.next(self) {
            let end = src + self.run_bytes;
            match &mut current {
                Some(c) if self.sorted && c.end == src => c.end = end,
                _ => {
                    if let Some(done) = current.replace(FileRange {
                        file,
                        start: src,
                        end,
                    }) {
                        out.push(done);
                    }
                }
            }
        }
        out.extend(current);
    }

    /// Hands the bytes of the runs that `bytes` (file bytes from `start`) holds to
    /// `sink(wire offset, bytes)`; returns how many.
    fn copy_from(
        &self,
        start: u64,
        bytes: &[u8],
        mut sink: impl FnMut(u64, &[u8]) -> Result<(), LoaderError>,
    ) -> Result<u64, LoaderError> {
        let end = start + bytes.len() as u64;
        let mut cursor = if self.sorted {
            Cursor::seek(self, start)
        } else {
            Cursor::start(self)
        };
        let mut copied = 0;
        while let Some((src, dst)) = cursor.next(self) {
            if self.sorted && src >= end {
                break;
            }
            let lo = src.max(start);
            let hi = (src + self.run_bytes).min(end);
            if lo >= hi {
                continue;
            }
            let n = (hi - lo) as usize;
            let from = (lo - start) as usize;
            sink(dst + (lo - src), &bytes[from..from + n])?;
            copied += hi - lo;
        }
        Ok(copied)
    }
}

/// An odometer over a [`Runs`], last dim fastest.
struct Cursor {
    index: Vec<u64>,
    done: bool,
}

impl Cursor {
    fn start(runs: &Runs) -> Cursor {
        Cursor {
            index: vec![0; runs.counts.len()],
            done: runs.total == 0,
        }
    }

    /// For sorted runs: positioned at the first run that ends after file byte `at`. Greedy digit
    /// extraction finds the last run starting at or before `at` (every stride clears the dims
    /// inside it, so the mixed-radix digits are unique); if `at` lies past that run's end, the
    /// next run is the first.
    fn seek(runs: &Runs, at: u64) -> Cursor {
        let mut cursor = Cursor::start(runs);
        if cursor.done || at <= runs.src_offset {
            return cursor;
        }
        let mut rest = at - runs.src_offset;
        for (d, (&count, &stride)) in runs.counts.iter().zip(&runs.src_strides).enumerate() {
            let digit = (rest / stride).min(count - 1);
            cursor.index[d] = digit;
            rest -= digit * stride;
        }
        if rest >= runs.run_bytes {
            cursor.advance(runs);
        }
        cursor
    }

    fn advance(&mut self, runs: &Runs) {
        for d in (0..self.index.len()).rev() {
            self.index[d] += 1;
            if self.index[d] < runs.counts[d] {
                return;
            }
            self.index[d] = 0;
        }
        self.done = true;
    }

    /// The current run as (source offset, wire offset), then moves on.
    fn next(&mut self, runs: &Runs) -> Option<(u64, u64)> {
        if self.done {
            return None;
        }
        let mut src = runs.src_offset;
        let mut dst = runs.dst_offset;
        for (d, &i) in self.index.iter().enumerate() {
            src += i * runs.src_strides[d];
            dst += i * runs.dst_strides[d];
        }
        self.advance(runs);
        Some((src, dst))
    }
}

/// Finds the sources a fetched part overlaps: per file, source spans sorted by start with a
/// running maximum of their ends, so a lookup walks back from the last span starting before the
/// part's end only while some earlier span still reaches into the part.
struct SpanIndex {
    /// Per file: (span start, span end, index), by start.
    spans: Vec<Vec<(u64, u64, usize)>>,
    /// Per file: running maximum of span ends.
    reach: Vec<Vec<u64>>,
}

impl SpanIndex {
    /// An index of `(file, start, end)` spans; `overlapping` yields their positions.
    fn new(items: impl Iterator<Item = (u32, u64, u64)>) -> SpanIndex {
        let mut spans: Vec<Vec<(u64, u64, usize)>> = Vec::new();
        for (i, (file, start, end)) in items.enumerate() {
            let file = file as usize;
            if spans.len() <= file {
                spans.resize_with(file + 1, Vec::new);
            }
            spans[file].push((start, end, i));
        }
        let mut reach = Vec::with_capacity(spans.len());
        for list in &mut spans {
            list.sort_unstable();
            let mut max = 0;
            reach.push(
                list.iter()
                    .map(|&(_, end, _)| {
                        max = max.max(end);
                        max
                    })
                    .collect(),
            );
        }
        SpanIndex { spans, reach }
    }

    fn overlapping(&self, part: FileRange) -> impl Iterator<Item = usize> + '_ {
        let file = part.file as usize;
        let spans = self.spans.get(file).map_or(&[][..], Vec::as_slice);
        let reach = self.reach.get(file).map_or(&[][..], Vec::as_slice);
        let before_end = spans.partition_point(|&(start, _, _)| start < part.end);
        (0..before_end)
            .rev()
            .take_while(move |&i| reach[i] > part.start)
            .filter(move |&i| spans[i].1 > part.start)
            .map(move |i| spans[i].2)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tessera_planner::Side;

    fn runs(esize: u64, lengths: &[u64], src_origin: u64, src_strides: &[u64]) -> StridedRuns {
        let wire = tessera_metadata::row_major_strides(lengths);
        StridedRuns::new(
            esize,
            lengths,
            Side {
                origin: src_origin,
                strides: src_strides,
            },
            Side {
                origin: 0,
                strides: &wire,
            },
        )
    }

    /// Copies through `r` part by part (parts of `part` bytes) from `file` and returns the wire.
    fn assemble(r: &Runs, file: &[u8], part: usize) -> Vec<u8> {
        let mut wire = vec![0u8; r.total as usize];
        let mut copied = 0;
        for (i, chunk) in file.chunks(part).enumerate() {
            copied += r
                .copy_from((i * part) as u64, chunk, |at, bytes| {
                    wire[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
                    Ok(())
                })
                .unwrap();
        }
        assert_eq!(copied, r.total);
        wire
    }

    #[test]
    fn transposed_source_is_one_range_and_reassembles_from_small_parts() {
        // A [3, 4] u8 box stored transposed (column-major): element (i, j) at j*3 + i.
        let file: Vec<u8> = (0..12).collect();
        let strided = runs(1, &[3, 4], 0, &[1, 3]);
        assert_eq!(strided.num_runs(), 12);
        let r = Runs::new(&strided, 12).unwrap();
        assert!(r.sorted);
        let mut ranges = Vec::new();
        r.src_ranges(0, &mut ranges);
        assert_eq!(
            ranges,
            vec![FileRange {
                file: 0,
                start: 0,
                end: 12
            }]
        );
        let expected: Vec<u8> = (0..3u8)
            .flat_map(|i| (0..4u8).map(move |j| j * 3 + i))
            .collect();
        for part in [1, 2, 5, 12] {
            assert_eq!(assemble(&r, &file, part), expected, "part size {part}");
        }
    }

    #[test]
    fn column_slice_keeps_its_gaps() {
        // Columns 2..4 of a [3, 6] u8 row-major box at file offset 10.
        let strided = runs(1, &[3, 2], 12, &[6, 1]);
        let r = Runs::new(&strided, 6).unwrap();
        let mut ranges = Vec::new();
        r.src_ranges(1, &mut ranges);
        let starts: Vec<(u64, u64)> = ranges.iter().map(|r| (r.start, r.end)).collect();
        assert_eq!(starts, vec![(12, 14), (18, 20), (24, 26)]);
        let file: Vec<u8> = (0..40).collect();
        assert_eq!(assemble(&r, &file, 7), vec![12, 13, 18, 19, 24, 25]);
        // A seek into a gap lands on the next run.
        let mut c = Cursor::seek(&r, 15);
        assert_eq!(c.next(&r), Some((18, 2)));
        // A seek past the end finds nothing.
        let mut c = Cursor::seek(&r, 26);
        assert_eq!(c.next(&r), None);
    }

    #[test]
    fn overlapping_source_runs_still_copy_correctly() {
        // Stride 0: every row reads the same two bytes.
        let strided = StridedRuns {
            run_bytes: 2,
            counts: vec![3],
            src_offset: 4,
            src_strides: vec![0],
            dst_offset: 0,
            dst_strides: vec![2],
        };
        let r = Runs::new(&strided, 6).unwrap();
        assert!(!r.sorted);
        let file: Vec<u8> = (0..10).collect();
        assert_eq!(assemble(&r, &file, 3), vec![4, 5, 4, 5, 4, 5]);
    }

    #[test]
    fn runs_that_disagree_with_the_piece_are_refused() {
        let strided = runs(4, &[2, 2], 0, &[2, 1]);
        assert_eq!(
            Runs::new(&strided, 12).unwrap_err(),
            "its read runs move 16 bytes but the piece has 12"
        );
        let mut bad = strided.clone();
        bad.dst_offset = 8;
        assert_eq!(
            Runs::new(&bad, 16).unwrap_err(),
            "its read runs write up to wire byte 24 of a 16-byte piece"
        );
        let mut huge = strided;
        huge.counts = vec![u64::MAX, 2];
        huge.src_strides = vec![8, 4];
        huge.dst_strides = vec![8, 4];
        huge.run_bytes = 4;
        assert_eq!(
            Runs::new(&huge, 16).unwrap_err(),
            "read runs overflow 64-bit byte offsets"
        );
    }

    #[test]
    fn the_read_future_is_send() {
        // Loaders spawn one task per rank: the future must be `Send` when its callbacks are.
        fn send<T: Send>(_: &T) {}
        let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
        let plan = RankPlan {
            rank: 0,
            world: 1,
            files: Vec::new(),
            tensors: Vec::new(),
            destinations: Vec::new(),
            pieces: Vec::new(),
            exchanges: Vec::new(),
            summary: Default::default(),
            checkpoint_identity: None,
            joint_checks: Vec::new(),
        };
        let progress = |_: u64| {};
        let (prefix, options) = (Path::from("x"), ReadOptions::default());
        let future = read_pieces(
            store,
            &prefix,
            &plan,
            None,
            None,
            &options,
            |_, _| Ok(()),
            Some(&progress),
        );
        send(&future);
    }

    #[test]
    fn plan_paths_stay_inside_the_checkpoint() {
        let prefix = Path::from("runs/a/step-1");
        assert_eq!(
            resolve(&prefix, "data/r0.bin").unwrap(),
            Path::from("runs/a/step-1/data/r0.bin")
        );
        for bad in ["../x", "data//x", "/abs", "data/.", ""] {
            assert!(resolve(&prefix, bad).is_err(), "{bad}");
        }
    }
}
