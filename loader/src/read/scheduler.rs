//! The range scheduler: turns the byte ranges a rank needs into few, bounded, verified storage
//! requests, in the manner of lance's IO scheduler.
//!
//! ```text
//! file bytes     0        8K       16K      24K      32K      40K      48K      56K
//!                ├────────┼────────┼────────┼────────┼────────┼────────┼────────┤  checksum blocks
//! needed           ├─a─┼──b───┤       ├c─┤              ├─────────d─────────┤
//! coalesced        ├───a+b────┤       ├c─┤              ├─────────d─────────┤      touching only
//! verifying      ├──────────────────────────┤        ├──────────────────────────┤  whole blocks
//! parts (16K)    ├──────part───────┼──part──┤        ├──────part───────┼──part──┤  block aligned
//! ```
//!
//! Ranges are merged only when they touch or overlap, never across a gap: reading a gap would
//! fetch bytes nobody asked for, and the loader's promise is read amplification 1.00 (plus, when
//! verifying, at most one partial checksum block on each side of a range). Parts are fetched with
//! `get_range`, at most [`ReadOptions::max_in_flight`] at once and at most
//! [`ReadOptions::max_buffered_bytes`] requested but not yet consumed. Every part is checked
//! against the checkpoint's block checksums before the consumer sees it.
//!
//! Small neighbouring parts of one file may share one request: when the gap between them is at
//! most [`ReadOptions::coalesce_gap`] bytes, one `get_range` fetches them and the gap, and the
//! bytes are sliced back into the parts. That trades gap bytes for requests, and it is the
//! scheduler's own decision, counted: [`FetchStats::bytes_transferred`] is what the store
//! returned, gaps included. (object_store's `get_ranges` is not used: its HTTP stores merge
//! ranges less than 1 MiB apart on their own, which served a column reshard up to 4x the bytes
//! the report counted, issue 19.)
//!
//! Retries follow tessera's one [`RetryPolicy`] ([`ReadOptions::retry`]): errors that
//! [`tessera_storage::is_transient`] calls transient are retried with its jittered exponential
//! backoff, at most `max_attempts` times per request; permanent ones (a missing file, a truncated
//! file, a refused request) surface at once. The stores themselves do not retry (object_store's
//! own retry is off for every store [`tessera_storage::open`] builds), so a request is tried
//! exactly as often as the policy says.
//!
//! Cancellation: dropping the future of [`RangeScheduler::fetch`] aborts the requests in flight.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use backon::{ExponentialBuilder, Retryable};
use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use tessera_metadata::MetadataError;
use tessera_metadata::formats::native::BlockChecksums;
use tessera_storage::{RetryPolicy, StorageError, is_timeout, is_transient};
use tokio::task::{self, JoinSet};

use crate::LoaderError;
use crate::read::positioned::LocalPaths;

/// How the loader reads from storage.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadOptions {
    /// Largest single request in bytes (16 MiB; rounded down to whole checksum blocks when
    /// verifying). Object stores answer the first byte after 10–50 ms and then stream at
    /// 100–200 MB/s per connection, so a 16 MiB request spends most of its time transferring
    /// rather than waiting; a failed request re-fetches at most this much; and parts this size
    /// spread one large tensor over several connections. A value of 0 counts as 1.
    pub part_size: u64,
    /// Requests in flight at once (8). Eight connections at 100–200 MB/s each reach 1–2 GB/s per
    /// rank, about a rank's share of a node's network; more mostly raises the chance of being
    /// throttled (S3 `SlowDown`) when thousands of ranks start at once. A value of 0 counts as 1.
    pub max_in_flight: usize,
    /// Bytes requested but not yet consumed (256 MiB): twice what `max_in_flight` default parts
    /// hold, so the budget does not throttle the default configuration, while host memory per rank
    /// stays bounded whatever the checkpoint size. A part larger than the whole budget is still
    /// fetched, alone, so that no setting can deadlock.
    pub max_buffered_bytes: u64,
    /// How transient storage errors are retried: tessera's one [`RetryPolicy`] (the default: 5
    /// attempts per request, 20 ms before the first retry, doubled for every further one with
    /// jitter, capped at 5 s). The retries of one request then wait about 20 + 40 + 80 + 160 ms
    /// (up to twice that with jitter): enough to ride out a reset connection or a burst of 503s,
    /// short enough that a real outage fails the load within a second instead of hanging every
    /// rank. Only `max_attempts`, `first_backoff` and `max_backoff` apply here; the timeouts of a
    /// request are the store's, set when [`tessera_storage::open`] built it.
    pub retry: RetryPolicy,
    /// Check every fetched byte against the checkpoint's block checksums (true). Fetches whole
    /// checksum blocks: at most one partial block extra on each side of a coalesced range.
    /// Without block checksums (formats that have none) nothing is verified.
    pub verify: bool,
    /// Largest gap in bytes between two small parts of one file that one request may span,
    /// fetching the gap too; `None` takes the store kind's default
    /// ([`default_coalesce_gap`]: 0 for local files, [`OBJECT_STORE_COALESCE_GAP`] for object
    /// stores). Where the store is not known (a bare [`RangeScheduler`]) `None` means 0: no
    /// byte is read that nobody asked for.
    pub coalesce_gap: Option<u64>,
    /// Small parts that the gap keeps apart still share one `get_ranges` call (up to 1 MiB of
    /// them): only for stores whose `get_ranges` reads exactly the ranges asked for, in one
    /// request. Local files qualify (one open, one read per range; a request per row of a column
    /// slice made a local gpt-small tp4 load 3x slower); object_store's HTTP stores do not
    /// (their `get_ranges` merges ranges under 1 MiB apart and fetches the gaps, issue 19).
    /// `None` takes the store kind's ([`exact_multi_range`]); where the store is not known (a
    /// bare [`RangeScheduler`]) `None` means false.
    pub exact_multi_range: Option<bool>,
    /// The directory on the local file system that the store's paths are relative to, when the
    /// checkpoint is a local directory ([`tessera_storage::Location::local_root`]). Pieces whose
    /// bytes go to one contiguous stretch of one destination are then read with positioned reads
    /// (`pread`) straight into it: no intermediate buffer, one copy out of the page cache. `None`
    /// reads everything through the store. [`crate::checkpoint::Checkpoint`] fills it from its location
    /// when [`ReadOptions::positioned_reads`] is on.
    pub local_root: Option<std::path::PathBuf>,
    /// Store paths whose bytes are read from these local files instead, by position: a memory
    /// tier's copies of data files ([`crate::read::tier`]), wherever the checkpoint lives. Its
    /// store reads the same paths from the same files ([`crate::tier::TierStore`]), so
    /// reads that do not go by position get the same bytes.
    pub local_files: Arc<HashMap<String, std::path::PathBuf>>,
    /// Store paths whose bytes are read by position from a live publisher's shared memory on
    /// this host (`tessera_storage::Location::shared_files`, `/proc/self/fd/<n>` paths); the
    /// store serves the same paths from the same descriptors.
    pub shared_files: Arc<HashMap<String, std::path::PathBuf>>,
    /// Read local checkpoints by position ([`ReadOptions::local_root`]; true). Off, every read
    /// goes through the store: the side-by-side switch of benchmarks (front ends map
    /// `TESSERA_POSITIONED_READS=0` to it).
    pub positioned_reads: bool,
    /// Local reads whose destination disagrees with the file offset modulo 64 go through a
    /// cache-resident bounce buffer. By default where that was measured to pay
    /// ([`crate::read::misaligned_copies_are_slow`]: AMD CPUs, whose kernel copy ran at a third of
    /// its speed there; on Intel it runs at full speed and the bounce costs 15 %). Front ends
    /// map `TESSERA_BOUNCE_READS=0|1` to it.
    pub bounce_reads: bool,
    /// Read the pieces of the plan's joint checks (`RankPlan::joint_checks`) exactly, folding
    /// them for the check the ranks make together after reading ([`crate::verify::joint`]), instead of
    /// verifying them by whole checksum blocks here. Only loads that run that step set it (the
    /// host loads of [`crate::load`] and the Python group load); without it the pieces are
    /// verified by blocks like any other.
    pub joint_checks: bool,
}

/// The default [`ReadOptions::coalesce_gap`] of object stores (S3, GCS, Azure, HTTP): 64 KiB.
///
/// A request costs a round trip plus the store's time to first byte; a gap costs its transfer.
/// Measured on the loopback S3 test server (`cargo bench --bench s3`, BENCHMARKS.md "S3"): one
/// request 0.29 ms, one byte 5.6 ns on one connection (0.18 GB/s), so a request is worth about
/// 50 KiB of gap; 64 KiB is that break-even, rounded to a power of two. The bound it gives: the
/// bytes a load transfers exceed the bytes it fetches by at most 64 KiB per request saved.
/// Stores far from the reader (cloud S3: 10–50 ms to first byte, 100–200 MB/s per connection)
/// break even at 1–10 MB; there `--coalesce-gap` trades bytes for requests, and the report
/// shows both.
pub const OBJECT_STORE_COALESCE_GAP: u64 = 64 * 1024;

/// The default [`ReadOptions::exact_multi_range`] for a checkpoint at `location` (what the user
/// typed): true for local paths and `file://`, false for object stores.
pub fn exact_multi_range(location: &str) -> bool {
    default_coalesce_gap(location) == 0
}

/// The default [`ReadOptions::coalesce_gap`] for a checkpoint at `location` (what the user typed):
/// 0 for local paths and `file://` (a local read costs no round trip, so a gap is pure waste),
/// [`OBJECT_STORE_COALESCE_GAP`] for every `scheme://` of an object store.
pub fn default_coalesce_gap(location: &str) -> u64 {
    match tessera_storage::LocationKind::of(location) {
        tessera_storage::LocationKind::Local => 0,
        tessera_storage::LocationKind::Remote => OBJECT_STORE_COALESCE_GAP,
    }
}

impl Default for ReadOptions {
    fn default() -> Self {
        Self {
            part_size: 16 * 1024 * 1024,
            max_in_flight: 8,
            max_buffered_bytes: 256 * 1024 * 1024,
            retry: RetryPolicy::default(),
            verify: true,
            coalesce_gap: None,
            exact_multi_range: None,
            local_root: None,
            local_files: Arc::default(),
            shared_files: Arc::default(),
            positioned_reads: true,
            bounce_reads: crate::read::misaligned_copies_are_slow(),
            joint_checks: false,
        }
    }
}

/// A file the scheduler reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceFile {
    /// Its object path in the store.
    pub path: Path,
    /// Its path relative to the checkpoint root: the key of its block checksums.
    pub key: String,
}

/// Bytes `start..end` of file `file` (an index into the scheduler's files). Both the ranges a
/// caller needs and the parts the scheduler fetches.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FileRange {
    /// Index into the scheduler's files.
    pub file: u32,
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
}

impl FileRange {
    /// Bytes in the range.
    pub fn len(&self) -> u64 {
        self.end.saturating_sub(self.start)
    }

    /// True when the range holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The requests that fetch a set of ranges.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Parts to fetch, by file then offset; they do not overlap.
    pub parts: Vec<FileRange>,
    /// Bytes of the union of the asked-for ranges.
    pub bytes_needed: u64,
    /// Bytes of all parts: `bytes_needed` plus what verification adds.
    pub bytes_fetched: u64,
    /// Per part (same order as `parts`; empty when there are none): true when the part holds
    /// only bytes of caller-checked ranges ([`RangeScheduler::schedule_checked`]) and is not
    /// checked against block checksums. Pass it to [`RangeScheduler::fetch_with`].
    pub caller_checked: Vec<bool>,
}

/// What a [`RangeScheduler::fetch`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Storage requests that succeeded: one `get_range` each (several small parts may share
    /// one; retries not included).
    pub requests: u64,
    /// Bytes the store returned for those requests: `bytes_fetched` plus the gaps that
    /// coalescing spanned ([`ReadOptions::coalesce_gap`]). Failed attempts are not included.
    pub bytes_transferred: u64,
    /// Parts fetched (ranges of at most the part size).
    pub parts: u64,
    /// Failed attempts that were retried.
    pub retries: u64,
    /// Bytes fetched.
    pub bytes_fetched: u64,
    /// Bytes checked against block checksums.
    pub bytes_verified: u64,
}

/// Fetches byte ranges of a set of files from one store (see the module docs).
#[derive(Debug)]
pub struct RangeScheduler<'a> {
    store: Arc<dyn ObjectStore>,
    files: Vec<SourceFile>,
    checksums: Option<&'a BlockChecksums>,
    options: ReadOptions,
}

impl<'a> RangeScheduler<'a> {
    /// A scheduler over `files` of `store`. `checksums` are used when `options.verify` is set;
    /// they must cover every file (by [`SourceFile::key`]).
    pub fn new(
        store: Arc<dyn ObjectStore>,
        files: Vec<SourceFile>,
        checksums: Option<&'a BlockChecksums>,
        options: &ReadOptions,
    ) -> Self {
        Self {
            store,
            files,
            checksums: checksums.filter(|_| options.verify),
            options: options.clone(),
        }
    }

    /// The scheduler's files.
    pub fn files(&self) -> &[SourceFile] {
        &self.files
    }

    /// True when fetched parts are checked against block checksums.
    pub fn verifying(&self) -> bool {
        self.checksums.is_some()
    }

    fn file(&self, file: u32) -> Result<&SourceFile, LoaderError> {
        self.files
            .get(file as usize)
            .ok_or_else(|| LoaderError::InvalidPlan {
                detail: format!(
                    "byte range of file #{file}, but there are {} files",
                    self.files.len()
                ),
            })
    }

    /// Coalesces `ranges` (touching or overlapping ranges of one file become one; gaps stay),
    /// extends them to whole checksum blocks when verifying (and coalesces again: two ranges in
    /// one block share it), and splits them into parts of at most `part_size` bytes, block
    /// aligned when verifying. Empty ranges need no request.
    pub fn schedule(&self, ranges: Vec<FileRange>) -> Result<Schedule, LoaderError> {
        self.schedule_checked(ranges, Vec::new())
    }

    /// [`Self::schedule`] for `ranges` plus `checked`: ranges the caller verifies itself (a whole
    /// saved box against the crc32c of its metadata row). When verifying, those are fetched as
    /// they are, not extended to whole checksum blocks, and their parts are marked in
    /// [`Schedule::caller_checked`] so that [`Self::fetch_with`] skips their block check. Where a
    /// checked range overlaps the blocks that `ranges` need anyway, those bytes come (block
    /// checked) with the blocks and only the rest is fetched separately. A small box thus costs
    /// its own bytes instead of a whole block (64 KiB by default) on each side.
    pub fn schedule_checked(
        &self,
        mut ranges: Vec<FileRange>,
        mut checked: Vec<FileRange>,
    ) -> Result<Schedule, LoaderError> {
        ranges.retain(|r| r.end > r.start);
        checked.retain(|r| r.end > r.start);
        for r in ranges.iter().chain(&checked) {
            self.file(r.file)?;
        }
        let bytes_needed = coalesce(ranges.iter().chain(&checked).copied().collect())
            .iter()
            .map(FileRange::len)
            .sum();
        let Some(checksums) = self.checksums else {
            // Nothing is block checked, so the caller's ranges are ranges like any other.
            ranges.extend(checked);
            let parts = split(&coalesce(ranges), self.options.part_size.max(1));
            let bytes_fetched = parts.iter().map(FileRange::len).sum();
            return Ok(Schedule {
                caller_checked: vec![false; parts.len()],
                parts,
                bytes_needed,
                bytes_fetched,
            });
        };
        let merged = coalesce(ranges);
        let mut extended = Vec::with_capacity(merged.len());
        for r in &merged {
            let key = &self.file(r.file)?.key;
            let covering = checksums.covering_byte_range(key, r.start, r.end)?;
            extended.push(FileRange {
                file: r.file,
                start: covering.start,
                end: covering.end,
            });
        }
        let bs = checksums.block_size();
        let block_parts = split(
            &coalesce(extended),
            (self.options.part_size / bs).max(1) * bs,
        );
        let own = subtract(&coalesce(checked), &block_parts);
        let own_parts = split(&own, self.options.part_size.max(1));
        let mut tagged: Vec<(FileRange, bool)> = block_parts
            .into_iter()
            .map(|p| (p, false))
            .chain(own_parts.into_iter().map(|p| (p, true)))
            .collect();
        // Parts in file order, as `fetch` expects (it groups neighbouring small parts).
        tagged.sort_unstable();
        let (parts, caller_checked): (Vec<FileRange>, Vec<bool>) = tagged.into_iter().unzip();
        let bytes_fetched = parts.iter().map(FileRange::len).sum();
        Ok(Schedule {
            parts,
            bytes_needed,
            bytes_fetched,
            caller_checked,
        })
    }

    /// Fetches `parts` (as [`Self::schedule`] gives them; they are requested in order) and hands
    /// each one, verified, to `on_part` together with its bytes, in completion order. An error
    /// from `on_part` or from storage stops the fetch; the requests still in flight are aborted.
    pub async fn fetch(
        &self,
        parts: &[FileRange],
        on_part: impl FnMut(FileRange, &[u8]) -> Result<(), LoaderError>,
    ) -> Result<FetchStats, LoaderError> {
        self.fetch_with(parts, &[], on_part).await
    }

    /// [`Self::fetch`], skipping the block check of the parts that `caller_checked` (as
    /// [`Schedule::caller_checked`] gives it) marks: the caller verifies those bytes itself.
    /// A part without an entry is block checked.
    pub async fn fetch_with(
        &self,
        parts: &[FileRange],
        caller_checked: &[bool],
        mut on_part: impl FnMut(FileRange, &[u8]) -> Result<(), LoaderError>,
    ) -> Result<FetchStats, LoaderError> {
        let max_in_flight = self.options.max_in_flight.max(1);
        let backoff = self.options.retry.backoff();
        let mut stats = FetchStats::default();
        let mut tasks: JoinSet<Result<Vec<Fetched>, LoaderError>> = JoinSet::new();
        // What each task fetches: spans of the file (one `get_range` each, or all in one
        // `get_ranges` call on a store that reads ranges exactly), each with the parts it holds.
        let mut task_parts: HashMap<task::Id, Vec<Segment>> = HashMap::new();
        // One task (this one) launches requests and consumes their bytes, so a counter is all the
        // byte budget needs: a request's bytes (gaps included) are reserved when it starts and
        // released when `on_part` has consumed its parts.
        let mut reserved: u64 = 0;
        // Parts of a local directory's files are read by position into buffers reused from part
        // to part (at most the parts in flight), not into a fresh allocation per request whose
        // pages the kernel must fault in and zero: the first load of a process paid most of its
        // store-path reads in page faults (BENCHMARKS.md, issue 16).
        let local = LocalPaths::of(&self.options).map(|paths| {
            Arc::new(LocalParts::new(
                paths,
                self.options.part_size.max(1),
                self.options.bounce_reads,
            ))
        });
        let mut next = 0;
        loop {
            while next < parts.len() && tasks.len() < max_in_flight {
                let Some((path, segments, task_bytes)) =
                    self.next_request(parts, &mut next, reserved)?
                else {
                    break;
                };
                reserved += task_bytes;
                let store = Arc::clone(&self.store);
                let spans: Vec<Range<u64>> = segments.iter().map(|s| s.span.clone()).collect();
                let handle = match (&local, spans.as_slice()) {
                    // One span of a local file: read by position into a reused buffer.
                    (Some(local), [span]) if local.paths.readable(&path) => {
                        tasks.spawn(fetch_local(Arc::clone(local), path, span.clone()))
                    }
                    _ => tasks.spawn(fetch_spans(store, path, spans, backoff)),
                };
                task_parts.insert(handle.id(), segments);
            }
            let Some(joined) = tasks.join_next_with_id().await else {
                break;
            };
            let (index, result) = match joined {
                Ok((id, result)) => (task_parts.remove(&id), result),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                // Only a runtime shutting down cancels a request task.
                Err(e) => {
                    let segments = task_parts.remove(&e.id());
                    return Err(self.cancelled(parts, segments, e));
                }
            };
            let Some(segments) = index else {
                return Err(LoaderError::InvalidPlan {
                    detail: "a storage request finished that was never started".to_string(),
                });
            };
            let fetched = result?;
            stats.requests += 1;
            reserved -= self.hand_on(
                parts,
                caller_checked,
                (segments, fetched),
                &mut stats,
                &mut on_part,
            )?;
        }
        Ok(stats)
    }

    /// The next storage request: the part `parts[*next]` and, when it is small, the small parts
    /// of the same file after it that ride along; `next` moves past them. `None` when the byte
    /// budget (with `reserved` bytes taken) has no room for it. Returns the file's path, the
    /// request's spans with their parts, and its bytes, gaps included.
    fn next_request(
        &self,
        parts: &[FileRange],
        next: &mut usize,
        reserved: u64,
    ) -> Result<Option<(Path, Vec<Segment>, u64)>, LoaderError> {
        let budget = self.options.max_buffered_bytes;
        let gap = self.options.coalesce_gap.unwrap_or(0);
        let multi_range = self.options.exact_multi_range.unwrap_or(false);
        // One request spans at most a part size, gaps included: the bound the part size sets.
        let max_span = self.options.part_size.max(1);
        let part = parts[*next];
        // A part larger than the whole budget goes alone: waiting for more room than exists
        // would never end.
        if reserved > 0 && reserved.saturating_add(part.len()) > budget {
            return Ok(None);
        }
        let file = self.file(part.file)?;
        // Small parts (the rows of a column slice) ride together in one `get_range` when the
        // gaps between them are at most `coalesce_gap`: one request instead of thousands, at the
        // price of the gap bytes, which are counted. Only ranges that are small in their own
        // right: parts cut from a large range are part-size long and go one per request.
        let small = SMALL_PART.min(self.options.part_size / 4);
        let mut segments = vec![Segment {
            parts: vec![*next],
            span: part.start..part.end,
        }];
        let mut task_bytes = part.len();
        let mut count = 1;
        *next += 1;
        while part.len() < small
            && *next < parts.len()
            && count < MAX_PARTS_PER_REQUEST
            && parts[*next].file == part.file
            && parts[*next].len() < small
        {
            let candidate = parts[*next];
            let Some(last) = segments.last_mut() else {
                break;
            };
            let spanned = candidate.start >= last.span.end
                && candidate.start - last.span.end <= gap
                && candidate.end - last.span.start <= max_span;
            let added = if spanned {
                candidate.end - last.span.end
            } else {
                candidate.len()
            };
            if reserved.saturating_add(task_bytes + added) > budget {
                break;
            }
            if spanned {
                last.span.end = candidate.end;
                last.parts.push(*next);
            } else if multi_range && task_bytes + added <= SMALL_PART {
                // A store that reads several ranges exactly in one call (local files: one open,
                // one read each) takes the small parts the gap keeps apart together, as many as
                // fit in SMALL_PART.
                segments.push(Segment {
                    parts: vec![*next],
                    span: candidate.start..candidate.end,
                });
            } else {
                break;
            }
            task_bytes += added;
            count += 1;
            *next += 1;
        }
        Ok(Some((file.path.clone(), segments, task_bytes)))
    }

    /// The error of a request task that was cancelled (`segments`: what it fetched, if known),
    /// naming the file and bytes it was reading.
    fn cancelled(
        &self,
        parts: &[FileRange],
        segments: Option<Vec<Segment>>,
        e: task::JoinError,
    ) -> LoaderError {
        let request = segments.and_then(|segments| {
            let first = segments.first()?;
            let last = segments.last()?;
            let file = parts.get(*first.parts.first()?)?.file;
            Some((file, first.span.start..last.span.end))
        });
        let (path, action) = match request {
            Some((file, span)) => match self.file(file) {
                Ok(file) => (
                    file.path.to_string(),
                    format!("reading bytes {}..{} of", span.start, span.end),
                ),
                Err(error) => return error,
            },
            None => (String::new(), "reading".to_string()),
        };
        StorageError::Store {
            action,
            path,
            source: object_store::Error::JoinError { source: e },
        }
        .into()
    }

    /// Hands the parts of a finished request (its segments and what was fetched for each) to
    /// `on_part`, each verified against the block checksums unless `caller_checked` says the
    /// caller checks it, counting them in `stats`; returns the bytes the request had reserved.
    fn hand_on(
        &self,
        parts: &[FileRange],
        caller_checked: &[bool],
        (segments, fetched): (Vec<Segment>, Vec<Fetched>),
        stats: &mut FetchStats,
        on_part: &mut impl FnMut(FileRange, &[u8]) -> Result<(), LoaderError>,
    ) -> Result<u64, LoaderError> {
        let mut released = 0;
        for (segment, fetched) in segments.into_iter().zip(fetched) {
            let span = segment.span;
            stats.retries += u64::from(fetched.retries);
            stats.bytes_transferred += fetched.bytes.len() as u64;
            for index in segment.parts {
                let part = parts[index];
                stats.parts += 1;
                stats.bytes_fetched += part.len();
                // `fetch_spans` checked the length of every span, so every slice is in it.
                let from = usize::try_from(part.start - span.start).unwrap_or(usize::MAX);
                let to = usize::try_from(part.end - span.start).unwrap_or(usize::MAX);
                let Some(bytes) = fetched.bytes.get(from..to) else {
                    return Err(LoaderError::InvalidPlan {
                        detail: format!(
                            "part {}..{} lies outside its request {}..{}",
                            part.start, part.end, span.start, span.end
                        ),
                    });
                };
                // Verified here rather than in the request task: crc32c runs at memory speed
                // (CPU CRC instructions), far above what storage delivers, and the checksums
                // stay borrowed.
                let checked_by_caller = caller_checked.get(index).copied().unwrap_or(false);
                if let (Some(checksums), false) = (self.checksums, checked_by_caller) {
                    let file = self.file(part.file)?;
                    verify(checksums, file, part.start, bytes)?;
                    stats.bytes_verified += part.len();
                }
                on_part(part, bytes)?;
            }
            released += span.end - span.start;
        }
        Ok(released)
    }
}

/// Bytes in the union of `ranges`.
pub(crate) fn union_len(ranges: Vec<FileRange>) -> u64 {
    coalesce(ranges).iter().map(FileRange::len).sum()
}

/// Sorts `ranges` and merges those of one file that touch or overlap.
fn coalesce(mut ranges: Vec<FileRange>) -> Vec<FileRange> {
    ranges.sort_unstable();
    let mut merged: Vec<FileRange> = Vec::with_capacity(ranges.len());
    for r in ranges {
        match merged.last_mut() {
            Some(last) if last.file == r.file && r.start <= last.end => {
                last.end = last.end.max(r.end);
            }
            _ => merged.push(r),
        }
    }
    merged
}

/// Cuts each range into parts of at most `part_size` bytes (from its start, so block-aligned
/// ranges give block-aligned parts when `part_size` is whole blocks).
fn split(ranges: &[FileRange], part_size: u64) -> Vec<FileRange> {
    let mut parts = Vec::with_capacity(ranges.len());
    for r in ranges {
        let mut start = r.start;
        while start < r.end {
            let end = r.end.min(start.saturating_add(part_size));
            parts.push(FileRange {
                file: r.file,
                start,
                end,
            });
            start = end;
        }
    }
    parts
}

/// The bytes of `ranges` that are in none of `cover`; both sorted and without overlaps within
/// themselves (as [`coalesce`] and [`split`] leave them).
fn subtract(ranges: &[FileRange], cover: &[FileRange]) -> Vec<FileRange> {
    let mut out = Vec::with_capacity(ranges.len());
    let mut c = 0;
    for r in ranges {
        let mut start = r.start;
        // Skip covers that end before this range (by file, then offset).
        while c < cover.len() && (cover[c].file, cover[c].end) <= (r.file, start) {
            c += 1;
        }
        let mut k = c;
        while start < r.end && k < cover.len() && cover[k].file == r.file && cover[k].start < r.end
        {
            if cover[k].start > start {
                out.push(FileRange {
                    file: r.file,
                    start,
                    end: cover[k].start,
                });
            }
            start = start.max(cover[k].end);
            k += 1;
        }
        if start < r.end {
            out.push(FileRange {
                file: r.file,
                start,
                end: r.end,
            });
        }
    }
    out
}

/// Checks `bytes`, read from `file` at `start`, against its block checksums; a mismatch names the
/// file's store path and the bad block's byte range.
fn verify(
    checksums: &BlockChecksums,
    file: &SourceFile,
    start: u64,
    bytes: &[u8],
) -> Result<(), LoaderError> {
    match checksums.verify_range(&file.key, start, bytes) {
        Ok(()) => Ok(()),
        Err(MetadataError::ChecksumMismatch {
            expected, actual, ..
        }) => Err(
            bad_block(checksums, file, start, bytes).unwrap_or(LoaderError::Checksum {
                path: file.path.to_string(),
                start,
                end: start + bytes.len() as u64,
                expected,
                actual,
            }),
        ),
        Err(e) => Err(e.into()),
    }
}

/// The first block of `bytes` (read at the block boundary `start`) whose crc32c differs from the
/// recorded one, as a [`LoaderError::Checksum`]. `verify_range` reports the block as text only,
/// so the mismatch is located again here; this runs once per failed load.
fn bad_block(
    checksums: &BlockChecksums,
    file: &SourceFile,
    start: u64,
    bytes: &[u8],
) -> Option<LoaderError> {
    let blocks = checksums.file(&file.key)?;
    let bs = checksums.block_size();
    let first = start / bs;
    bytes
        .chunks(usize::try_from(bs).ok()?)
        .enumerate()
        .find_map(|(i, block)| {
            let index = first + i as u64;
            let expected = *blocks.crcs.get(usize::try_from(index).ok()?)?;
            let actual = crc32c::crc32c(block);
            (actual != expected).then(|| LoaderError::Checksum {
                path: file.path.to_string(),
                start: index * bs,
                end: index * bs + block.len() as u64,
                expected,
                actual,
            })
        })
}

/// Bytes `span` of a file, fetched as one range, holding `parts` (indices into the parts).
struct Segment {
    parts: Vec<usize>,
    span: Range<u64>,
}

/// Fetches `spans` of `path`: one `get_range` for one span; several (small ones, on a store
/// whose `get_ranges` reads exactly the ranges asked for) in one `get_ranges` call, which falls
/// back to the spans one by one when it fails, so that errors name the exact range and transient
/// ones are retried.
async fn fetch_spans(
    store: Arc<dyn ObjectStore>,
    path: Path,
    spans: Vec<Range<u64>>,
    backoff: ExponentialBuilder,
) -> Result<Vec<Fetched>, LoaderError> {
    if spans.len() > 1
        && let Ok(all) = store.get_ranges(&path, &spans).await
        && all.len() == spans.len()
        && all
            .iter()
            .zip(&spans)
            .all(|(b, r)| b.len() as u64 == r.end - r.start)
    {
        return Ok(all
            .into_iter()
            .map(|bytes| Fetched { bytes, retries: 0 })
            .collect());
    }
    let mut out = Vec::with_capacity(spans.len());
    for span in spans {
        out.push(fetch_part(store.as_ref(), &path, span, backoff).await?);
    }
    Ok(out)
}

/// Local files read by position into a pool of part buffers (see [`fetch_local`]).
struct LocalParts {
    paths: LocalPaths,
    /// Misaligned reads go through the bounce buffer ([`ReadOptions::bounce_reads`]).
    bounce: bool,
    /// Bytes of a new buffer: the largest part.
    buffer_bytes: usize,
    pool: std::sync::Mutex<Vec<Vec<u8>>>,
}

impl LocalParts {
    fn new(paths: LocalPaths, buffer_bytes: u64, bounce: bool) -> Self {
        Self {
            paths,
            bounce,
            buffer_bytes: usize::try_from(buffer_bytes).unwrap_or(usize::MAX),
            pool: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// A buffer of at least `len` bytes: a returned one, or a new one.
    fn take(&self, len: usize) -> Vec<u8> {
        let reused = self
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        match reused {
            Some(buffer) if buffer.len() >= len => buffer,
            _ => vec![0u8; len.max(self.buffer_bytes)],
        }
    }
}

/// A part read into a pooled buffer: its first `len` bytes; the buffer goes back to the pool
/// when the last `Bytes` of it is dropped.
struct PooledPart {
    buffer: Vec<u8>,
    len: usize,
    parts: Arc<LocalParts>,
}

impl AsRef<[u8]> for PooledPart {
    fn as_ref(&self) -> &[u8] {
        &self.buffer[..self.len]
    }
}

impl Drop for PooledPart {
    fn drop(&mut self) {
        let buffer = std::mem::take(&mut self.buffer);
        self.parts
            .pool
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(buffer);
    }
}

/// Reads `span` of the local file at store path `path` into a pooled buffer (on a blocking
/// thread). A missing file is [`LoaderError::MissingFile`] and a short one
/// [`LoaderError::ShortRead`], naming the store path, as through the store.
async fn fetch_local(
    parts: Arc<LocalParts>,
    path: Path,
    span: Range<u64>,
) -> Result<Vec<Fetched>, LoaderError> {
    let task = tokio::task::spawn_blocking(move || {
        let len = usize::try_from(span.end - span.start).unwrap_or(usize::MAX);
        let file = parts.paths.open(&path)?;
        let mut buffer = parts.take(len);
        let bounce = parts.bounce;
        crate::read::positioned::read_exact_at(
            &file,
            &mut buffer[..len],
            span.start,
            bounce,
            || path.to_string(),
        )?;
        let part = PooledPart { buffer, len, parts };
        Ok(vec![Fetched {
            bytes: Bytes::from_owner(part),
            retries: 0,
        }])
    });
    match task.await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Err(e) => Err(LoaderError::InvalidPlan {
            detail: format!("a local read was cancelled: {e}"),
        }),
    }
}

/// A fetched part.
struct Fetched {
    bytes: Bytes,
    retries: u32,
}

/// Parts smaller than this (and than a quarter of the part size) may share one request with
/// their neighbours ([`ReadOptions::coalesce_gap`]).
const SMALL_PART: u64 = 1 << 20;
/// At most this many parts share one request: bounds the bookkeeping of one request.
const MAX_PARTS_PER_REQUEST: usize = 1024;

/// How one attempt at a part failed.
enum Attempt {
    /// No retry can cure it: a missing or truncated file, a refused request.
    Permanent(LoaderError),
    /// Another attempt may cure it ([`is_transient`]).
    Transient(object_store::Error),
}

/// Fetches `range` of `path`, retrying transient errors with `backoff` (at most its `max_times`
/// retries); the number of retries goes into the result for the stats.
async fn fetch_part(
    store: &dyn ObjectStore,
    path: &Path,
    range: Range<u64>,
    backoff: ExponentialBuilder,
) -> Result<Fetched, LoaderError> {
    let (start, end) = (range.start, range.end);
    let range = &range;
    // Set by the first transient failure, which also looks at the object's size (once: a second
    // look would tell nothing new).
    let size_checked = &AtomicBool::new(false);
    let attempt = move || async move {
        match store.get_range(path, range.clone()).await {
            Ok(bytes) if bytes.len() as u64 == end - start => Ok(bytes),
            Ok(bytes) => Err(Attempt::Permanent(LoaderError::ShortRead {
                path: path.to_string(),
                start,
                end,
                got: bytes.len() as u64,
            })),
            Err(object_store::Error::NotFound { .. }) => {
                Err(Attempt::Permanent(LoaderError::MissingFile {
                    path: path.to_string(),
                }))
            }
            Err(error) if !is_transient(&error) => Err(Attempt::Permanent(
                StorageError::Store {
                    action: format!("reading bytes {start}..{end} of"),
                    path: path.to_string(),
                    source: error,
                }
                .into(),
            )),
            Err(error) => {
                // Local and in-memory stores (and some servers) report a range that starts past
                // the end of the object as a generic error; one look at the object's size tells
                // a truncated file, which no retry cures, from a passing failure.
                if !size_checked.swap(true, Ordering::Relaxed)
                    && let Some(permanent) = truncated_or_missing(store, path, range).await
                {
                    return Err(Attempt::Permanent(permanent));
                }
                Err(Attempt::Transient(error))
            }
        }
    };
    let mut retries = 0u32;
    let result = attempt
        .retry(backoff)
        .when(|e| matches!(e, Attempt::Transient(_)))
        .notify(|_, _| retries += 1)
        .await;
    match result {
        Ok(bytes) => Ok(Fetched { bytes, retries }),
        Err(Attempt::Permanent(error)) => Err(error),
        // Transient errors are retried until the policy's attempts are used up.
        Err(Attempt::Transient(error)) => {
            let attempts = retries + 1;
            // A stalled store's error reads "request or response body error"; saying that the
            // request timed out tells the operator the store went silent (see docs/retry.md).
            let timed_out = if is_timeout(&error) {
                ", the last one timed out"
            } else {
                ""
            };
            Err(StorageError::Store {
                action: format!(
                    "reading bytes {start}..{end} (gave up after {attempts} attempts{timed_out}) of"
                ),
                path: path.to_string(),
                source: error,
            }
            .into())
        }
    }
}

/// A permanent error when the object at `path` is gone or too short for `range`.
async fn truncated_or_missing(
    store: &dyn ObjectStore,
    path: &Path,
    range: &Range<u64>,
) -> Option<LoaderError> {
    match store.head(path).await {
        Ok(meta) if meta.size < range.end => Some(LoaderError::ShortRead {
            path: path.to_string(),
            start: range.start,
            end: range.end,
            got: meta.size.saturating_sub(range.start),
        }),
        Err(object_store::Error::NotFound { .. }) => Some(LoaderError::MissingFile {
            path: path.to_string(),
        }),
        _ => None,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use backon::BackoffBuilder;
    use std::time::Duration;
    use tessera_metadata::formats::native::FileBlocks;

    fn r(file: u32, start: u64, end: u64) -> FileRange {
        FileRange { file, start, end }
    }

    fn files(n: usize) -> Vec<SourceFile> {
        (0..n)
            .map(|i| SourceFile {
                path: Path::from(format!("ckpt/data/f{i}.bin")),
                key: format!("data/f{i}.bin"),
            })
            .collect()
    }

    fn store() -> Arc<dyn ObjectStore> {
        Arc::new(object_store::memory::InMemory::new())
    }

    /// 64-byte checksum blocks over a 1000-byte `data/f0.bin` (the first of [`files`]).
    fn blocks_of_f0() -> BlockChecksums {
        BlockChecksums::new(
            64,
            vec![FileBlocks {
                path: "data/f0.bin".to_string(),
                size: 1000,
                crcs: vec![0; 16],
            }],
        )
        .unwrap()
    }

    fn options(part_size: u64, verify: bool) -> ReadOptions {
        ReadOptions {
            part_size,
            verify,
            ..ReadOptions::default()
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn local_parts_are_read_by_position_into_reused_buffers() {
        let dir = tempfile::tempdir().unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::create_dir_all(dir.path().join("ckpt/data")).unwrap();
        std::fs::write(dir.path().join("ckpt/data/f0.bin"), &data).unwrap();
        std::fs::write(dir.path().join("ckpt/data/f1.bin"), &data[..500]).unwrap();
        // An empty store: every byte must come from the files.
        let options = ReadOptions {
            local_root: Some(dir.path().to_path_buf()),
            max_in_flight: 2,
            ..options(1000, false)
        };
        let scheduler = RangeScheduler::new(store(), files(3), None, &options);
        let schedule = scheduler.schedule(vec![r(0, 3, 9_990)]).unwrap();
        assert_eq!(schedule.parts.len(), 10);
        let mut got = vec![0u8; 10_000];
        let stats = scheduler
            .fetch(&schedule.parts, |part, bytes| {
                got[part.start as usize..part.end as usize].copy_from_slice(bytes);
                Ok(())
            })
            .await
            .unwrap();
        assert_eq!(&got[3..9_990], &data[3..9_990]);
        assert_eq!(stats.bytes_transferred, 9_987);
        let err = scheduler
            .fetch(&[r(1, 400, 700)], |_, _| Ok(()))
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&err, LoaderError::ShortRead { path, got: 100, .. } if path == "ckpt/data/f1.bin"),
            "{err:?}"
        );
        let err = scheduler
            .fetch(&[r(2, 0, 10)], |_, _| Ok(()))
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&err, LoaderError::MissingFile { path } if path == "ckpt/data/f2.bin"),
            "{err:?}"
        );
    }

    #[test]
    fn local_part_buffers_go_back_to_the_pool_and_are_reused() {
        let parts = Arc::new(LocalParts::new(
            LocalPaths {
                root: Some(std::path::PathBuf::from("/")),
                files: Arc::default(),
                shared: Arc::default(),
            },
            64,
            true,
        ));
        let first = parts.take(10);
        let address = first.as_ptr();
        assert_eq!(first.len(), 64);
        drop(Bytes::from_owner(PooledPart {
            buffer: first,
            len: 10,
            parts: Arc::clone(&parts),
        }));
        let again = parts.take(64);
        assert_eq!(again.as_ptr(), address, "the returned buffer is reused");
        // A part larger than every pooled buffer gets a new one of its size.
        assert_eq!(parts.take(100).len(), 100);
    }

    #[test]
    fn coalesces_only_touching_or_overlapping_ranges() {
        let scheduler = RangeScheduler::new(store(), files(2), None, &options(1 << 20, false));
        let schedule = scheduler
            .schedule(vec![
                r(0, 100, 200),
                r(0, 0, 100),
                r(0, 150, 250),
                r(0, 251, 300),
                r(1, 0, 10),
                r(0, 400, 400),
            ])
            .unwrap();
        assert_eq!(
            schedule.parts,
            vec![r(0, 0, 250), r(0, 251, 300), r(1, 0, 10)]
        );
        assert_eq!(schedule.bytes_needed, 309);
        assert_eq!(schedule.bytes_fetched, 309);
    }

    #[test]
    fn splits_into_parts_of_at_most_part_size() {
        let scheduler = RangeScheduler::new(store(), files(1), None, &options(100, false));
        let schedule = scheduler.schedule(vec![r(0, 10, 260)]).unwrap();
        assert_eq!(
            schedule.parts,
            vec![r(0, 10, 110), r(0, 110, 210), r(0, 210, 260)]
        );
    }

    #[test]
    fn verification_extends_to_whole_blocks_and_aligns_parts() {
        let checksums = blocks_of_f0();
        // Part size 150 rounds down to two 64-byte blocks.
        let scheduler =
            RangeScheduler::new(store(), files(1), Some(&checksums), &options(150, true));
        assert!(scheduler.verifying());
        let schedule = scheduler
            .schedule(vec![r(0, 10, 20), r(0, 100, 120), r(0, 300, 990)])
            .unwrap();
        // 10..20 and 100..120 share block 1's neighbour: 0..64 and 64..128 touch and merge.
        assert_eq!(
            schedule.parts,
            vec![
                r(0, 0, 128),
                r(0, 256, 384),
                r(0, 384, 512),
                r(0, 512, 640),
                r(0, 640, 768),
                r(0, 768, 896),
                r(0, 896, 1000),
            ]
        );
        assert_eq!(schedule.bytes_needed, 10 + 20 + 690);
        assert_eq!(schedule.bytes_fetched, 128 + 1000 - 256);
    }

    #[test]
    fn caller_checked_ranges_fetch_only_their_own_bytes() {
        let checksums = blocks_of_f0();
        let scheduler =
            RangeScheduler::new(store(), files(1), Some(&checksums), &options(150, true));
        let schedule = scheduler
            .schedule_checked(
                vec![r(0, 10, 20)],
                // Inside block 0 (fetched for 10..20 anyway), straddling its end, on its own.
                vec![r(0, 30, 40), r(0, 60, 70), r(0, 200, 210), r(0, 500, 900)],
            )
            .unwrap();
        assert_eq!(
            schedule.parts,
            vec![
                r(0, 0, 64),
                r(0, 64, 70),
                r(0, 200, 210),
                r(0, 500, 650),
                r(0, 650, 800),
                r(0, 800, 900),
            ]
        );
        assert_eq!(
            schedule.caller_checked,
            vec![false, true, true, true, true, true]
        );
        assert_eq!(schedule.bytes_needed, 10 + 10 + 10 + 10 + 400);
        assert_eq!(schedule.bytes_fetched, 64 + 6 + 10 + 400);

        // Without verification they are ranges like any other.
        let plain = RangeScheduler::new(store(), files(1), Some(&checksums), &options(150, false));
        let schedule = plain
            .schedule_checked(vec![r(0, 10, 20)], vec![r(0, 15, 40)])
            .unwrap();
        assert_eq!(schedule.parts, vec![r(0, 10, 40)]);
        assert_eq!(schedule.caller_checked, vec![false]);
    }

    /// Rows of 100 bytes every 400 bytes (a quarter column slice), fetched with `gap` as the
    /// coalescing gap: the stats, and every row's bytes as handed to the consumer.
    async fn fetch_rows(gap: Option<u64>) -> (FetchStats, Vec<(FileRange, Vec<u8>)>) {
        let store = store();
        let data: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        let path = Path::from("ckpt/data/f0.bin");
        store.put(&path, data.into()).await.unwrap();
        let options = ReadOptions {
            coalesce_gap: gap,
            ..options(1 << 20, false)
        };
        let scheduler = RangeScheduler::new(store, files(1), None, &options);
        let rows: Vec<FileRange> = (0..100).map(|i| r(0, i * 400, i * 400 + 100)).collect();
        let schedule = scheduler.schedule(rows).unwrap();
        let mut got = Vec::new();
        let stats = scheduler
            .fetch(&schedule.parts, |part, bytes| {
                got.push((part, bytes.to_vec()));
                Ok(())
            })
            .await
            .unwrap();
        got.sort();
        for (part, bytes) in &got {
            let want: Vec<u8> = (part.start..part.end).map(|i| (i % 251) as u8).collect();
            assert_eq!(bytes, &want, "{part:?}");
        }
        assert_eq!(got.len(), 100);
        (stats, got)
    }

    #[tokio::test]
    async fn no_gap_fetches_exactly_the_rows_one_request_each() {
        for gap in [None, Some(0), Some(299)] {
            let (stats, _) = fetch_rows(gap).await;
            assert_eq!(stats.requests, 100, "gap {gap:?}");
            assert_eq!(stats.bytes_fetched, 100 * 100);
            assert_eq!(stats.bytes_transferred, 100 * 100, "gap {gap:?}");
        }
    }

    #[tokio::test]
    async fn a_gap_as_wide_as_the_holes_spans_them_and_counts_them() {
        let (stats, _) = fetch_rows(Some(300)).await;
        // One request from the first row's start to the last row's end, gaps included.
        assert_eq!(stats.requests, 1);
        assert_eq!(stats.parts, 100);
        assert_eq!(stats.bytes_fetched, 100 * 100);
        assert_eq!(stats.bytes_transferred, 99 * 400 + 100);
    }

    #[tokio::test]
    async fn a_store_that_reads_ranges_exactly_takes_them_in_one_call_without_the_gaps() {
        let store = store();
        let data: Vec<u8> = (0..40_000u32).map(|i| (i % 251) as u8).collect();
        store
            .put(&Path::from("ckpt/data/f0.bin"), data.into())
            .await
            .unwrap();
        let options = ReadOptions {
            exact_multi_range: Some(true),
            ..options(1 << 20, false)
        };
        let scheduler = RangeScheduler::new(store, files(1), None, &options);
        let rows: Vec<FileRange> = (0..100).map(|i| r(0, i * 400, i * 400 + 100)).collect();
        let schedule = scheduler.schedule(rows).unwrap();
        let mut seen = 0;
        let stats = scheduler
            .fetch(&schedule.parts, |part, bytes| {
                let want: Vec<u8> = (part.start..part.end).map(|i| (i % 251) as u8).collect();
                assert_eq!(bytes, &want[..], "{part:?}");
                seen += 1;
                Ok(())
            })
            .await
            .unwrap();
        assert_eq!(seen, 100);
        assert_eq!((stats.requests, stats.parts), (1, 100));
        assert_eq!(stats.bytes_transferred, 100 * 100);
    }

    #[tokio::test]
    async fn a_request_spans_at_most_a_part_size() {
        let store = store();
        let path = Path::from("ckpt/data/f0.bin");
        store.put(&path, vec![7u8; 40_000].into()).await.unwrap();
        // Part size 4000: small parts are under 1000 bytes; a request spans at most 4000.
        let options = ReadOptions {
            coalesce_gap: Some(300),
            ..options(4000, false)
        };
        let scheduler = RangeScheduler::new(store, files(1), None, &options);
        let rows: Vec<FileRange> = (0..100).map(|i| r(0, i * 400, i * 400 + 100)).collect();
        let schedule = scheduler.schedule(rows).unwrap();
        let stats = scheduler
            .fetch(&schedule.parts, |_, _| Ok(()))
            .await
            .unwrap();
        // Ten rows (9 * 400 + 100 = 3700 bytes) per request.
        assert_eq!(stats.requests, 10);
        assert_eq!(stats.bytes_transferred, 10 * 3700);
    }

    #[test]
    fn object_stores_span_small_gaps_local_files_none() {
        assert!(exact_multi_range("/data/ckpt") && !exact_multi_range("s3://bucket/ckpt"));
        assert_eq!(default_coalesce_gap("/data/ckpt"), 0);
        assert_eq!(default_coalesce_gap("file:///data/ckpt"), 0);
        assert_eq!(
            default_coalesce_gap("s3://bucket/ckpt"),
            OBJECT_STORE_COALESCE_GAP
        );
        assert_eq!(
            default_coalesce_gap("https://host/ckpt"),
            OBJECT_STORE_COALESCE_GAP
        );
    }

    #[test]
    fn subtract_keeps_what_no_cover_holds() {
        let ranges = [r(0, 0, 100), r(0, 150, 160), r(1, 0, 50)];
        let cover = [r(0, 10, 20), r(0, 30, 40), r(0, 90, 155), r(1, 50, 60)];
        assert_eq!(
            subtract(&ranges, &cover),
            vec![
                r(0, 0, 10),
                r(0, 20, 30),
                r(0, 40, 90),
                r(0, 155, 160),
                r(1, 0, 50)
            ]
        );
    }

    #[test]
    fn verify_off_ignores_checksums() {
        let checksums = BlockChecksums::new(64, Vec::new()).unwrap();
        let scheduler =
            RangeScheduler::new(store(), files(1), Some(&checksums), &options(150, false));
        assert!(!scheduler.verifying());
        let schedule = scheduler.schedule(vec![r(0, 10, 20)]).unwrap();
        assert_eq!(schedule.parts, vec![r(0, 10, 20)]);
    }

    #[test]
    fn a_range_of_an_unknown_file_is_an_invalid_plan() {
        let scheduler = RangeScheduler::new(store(), files(1), None, &options(150, false));
        let error = scheduler.schedule(vec![r(3, 0, 1)]).unwrap_err();
        assert_eq!(
            error.to_string(),
            "invalid plan: byte range of file #3, but there are 1 files"
        );
    }

    #[test]
    fn retries_follow_the_one_policy() {
        let options = ReadOptions::default();
        assert_eq!(options.retry, RetryPolicy::default());
        // Four retries (five attempts), each wait doubling from 20 ms, with up to as much again
        // of jitter.
        let waits: Vec<_> = options.retry.backoff().build().collect();
        assert_eq!(waits.len(), 4);
        for (k, wait) in waits.into_iter().enumerate() {
            let full = Duration::from_millis(20 << k);
            // backon computes in f32 seconds: allow a microsecond of rounding.
            let slack = Duration::from_micros(1);
            assert!(
                wait + slack >= full && wait < 2 * full + slack,
                "retry {k}: {wait:?}"
            );
        }
        let long = RetryPolicy {
            max_attempts: 40,
            ..RetryPolicy::default()
        };
        let max = long.max_backoff;
        assert!(long.backoff().build().all(|wait| wait <= 2 * max));
    }
}
