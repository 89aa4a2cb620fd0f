//! Positioned reads from local files straight into destination memory: the read path's one-copy
//! route for checkpoints in a local directory.
//!
//! Through `object_store`, a local read allocates a fresh buffer per request, copies the file's
//! bytes into it out of the page cache (faulting its pages in first) and hands it on, and the
//! placement copies it again into the destination. A piece whose wire bytes are one contiguous
//! stretch of its file and land in one contiguous stretch of one destination (whole tensors,
//! row slices: most pieces of most reshards) needs neither: `pread` puts the file's bytes where
//! they belong, one copy. Pieces laid out any other way (column slices, transposes, a piece
//! placed twice) keep the store path.
//!
//! A read whose destination does not agree with its file offset modulo 64 goes through a small
//! per-thread bounce buffer that does ([`read_exact_at`]): the kernel's copy out of the page
//! cache was measured at a third of its speed when they disagree.
//!
//! The reads of a batch run on up to `threads` scoped threads (`std::thread::scope`), each into
//! its own disjoint part of the destinations, split with `split_at_mut`: no unsafe code, and no
//! read can outlive the buffers, because the scope joins every thread before it returns (the
//! caller's future cannot be dropped mid-batch: the batch is synchronous). A batch is bounded by
//! the caller (a few parts' worth), so the async runtime is held for milliseconds at a time.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;
use std::sync::Arc;

use crate::LoaderError;
use crate::read::scheduler::{ReadOptions, SourceFile};
use crate::verify::crc_fold::{Crc, Fold};

/// One positioned read: `len` bytes of plan file `file` from `offset`, into destination `dest`
/// from byte `dst_start`; with `crc`, that crc of the bytes read is returned too (a saved box
/// checked against its metadata row). With `strided`, the bytes are runs of the file rather
/// than one stretch of it ([`crate::read::mapped`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PositionedRead {
    /// Index into the plan's files.
    pub file: u32,
    pub offset: u64,
    pub len: u64,
    /// `(run, stride)`: the destination's `len` bytes are runs of `run` bytes, each `stride`
    /// file bytes after the one before (a column slice); `None`: one stretch of the file.
    pub strided: Option<(u64, u64)>,
    /// The saved box these bytes are part of, checked jointly with the other ranks' parts: the
    /// read returns its bytes' fold instead of a crc ([`JointSpan`]).
    pub joint: Option<JointSpan>,
    /// Index into the destination buffers.
    pub dest: usize,
    pub dst_start: u64,
    pub crc: Option<Crc>,
}

/// The box of a jointly checked read ([`crate::verify::joint`]): its crc algorithm, first file
/// byte and length. The read folds its runs at their offsets in the box.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct JointSpan {
    pub crc: Crc,
    pub start: u64,
    pub len: u64,
}

/// Where a read's store paths are local files: under the local store's root (a local
/// checkpoint), and single files elsewhere (a memory tier's copies of some data files,
/// [`crate::read::tier`]), which win over the root.
#[derive(Clone, Debug, Default)]
pub struct LocalPaths {
    /// The directory the store's paths are relative to ([`ReadOptions::local_root`]).
    pub root: Option<PathBuf>,
    /// Store paths read from these files instead ([`ReadOptions::local_files`]).
    pub files: Arc<HashMap<String, PathBuf>>,
    /// Store paths read from a publisher's shared memory on this host
    /// ([`ReadOptions::shared_files`]).
    pub shared: Arc<HashMap<String, PathBuf>>,
}

impl LocalPaths {
    /// The local paths of `options`, or `None` when nothing is read by position.
    pub(crate) fn of(options: &ReadOptions) -> Option<LocalPaths> {
        (options.local_root.is_some()
            || !options.local_files.is_empty()
            || !options.shared_files.is_empty())
        .then(|| LocalPaths {
            root: options.local_root.clone(),
            files: Arc::clone(&options.local_files),
            shared: Arc::clone(&options.shared_files),
        })
    }

    /// Whether the store path `path` is a local file that can be read by position: one of the
    /// single files, or a path under the root that maps to a file name as written
    /// ([`readable_path`]).
    pub(crate) fn readable(&self, path: &object_store::path::Path) -> bool {
        self.files.contains_key(path.as_ref())
            || self.shared.contains_key(path.as_ref())
            || (self.root.is_some() && readable_path(path))
    }

    /// Opens the local file of store path `path`. A missing file is [`LoaderError::MissingFile`]
    /// naming the store path, as a read through the store says.
    pub(crate) fn open(&self, path: &object_store::path::Path) -> Result<File, LoaderError> {
        // A publisher's shared memory: `/proc/self/fd/<n>` of the descriptor the live store
        // opened and checked (a link by design, so not `open_regular`).
        if let Some(file) = self.shared.get(path.as_ref()) {
            return File::open(file).map_err(|e| LoaderError::Io {
                action: "opening the publisher's shared memory",
                path: format!("{} (of {path})", file.display()),
                source: e,
            });
        }
        match (self.files.get(path.as_ref()), &self.root) {
            // A memory-tier copy: only ever a regular file, opened without blocking (a FIFO in
            // its place must not hold the load in `open(2)`); errors name the copy.
            (Some(file), _) => crate::tier::open_regular(file).map_err(|e| LoaderError::Io {
                action: "opening the memory-tier copy",
                path: format!("{} (of {path})", file.display()),
                source: e,
            }),
            (None, Some(root)) => open_local(root, path),
            (None, None) => Err(LoaderError::MissingFile {
                path: path.to_string(),
            }),
        }
    }
}

/// The local files of a read, opened on first use.
#[derive(Debug)]
pub(crate) struct LocalFiles {
    paths: LocalPaths,
    opened: Vec<Option<File>>,
    /// Per plan file: it is a memory-tier copy ([`LocalPaths::files`]), never mapped.
    copies: Vec<bool>,
    /// Misaligned reads go through the bounce buffer ([`read_exact_at`]).
    bounce: bool,
}

impl LocalFiles {
    /// The files at `paths`; `count` plan files; `bounce`: misaligned reads go through the
    /// bounce buffer ([`read_exact_at`]).
    pub fn new(paths: LocalPaths, count: usize, bounce: bool) -> Self {
        Self {
            paths,
            opened: (0..count).map(|_| None).collect(),
            copies: vec![false; count],
            bounce,
        }
    }

    /// Whether `source` can be read by position ([`LocalPaths::readable`]).
    pub fn readable(&self, source: &SourceFile) -> bool {
        self.paths.readable(&source.path)
    }

    /// Opens plan file `file` (at `source`) unless it is open already ([`LocalPaths::open`]).
    pub fn open(&mut self, file: u32, source: &SourceFile) -> Result<(), LoaderError> {
        let Some(slot) = self.opened.get_mut(file as usize) else {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "file #{file} read by position but the plan lists {} files",
                    self.opened.len()
                ),
            });
        };
        if slot.is_none() {
            *slot = Some(self.paths.open(&source.path)?);
            if let Some(copy) = self.copies.get_mut(file as usize) {
                *copy = self.paths.files.contains_key(source.path.as_ref())
                    || self.paths.shared.contains_key(source.path.as_ref());
            }
        }
        Ok(())
    }

    fn file(&self, file: u32) -> Result<&File, LoaderError> {
        self.opened
            .get(file as usize)
            .and_then(Option::as_ref)
            .ok_or_else(|| LoaderError::InvalidPlan {
                detail: format!("file #{file} read by position before it was opened"),
            })
    }
}

/// Performs `reads` (files opened in `files`, store paths in `sources` for messages) into
/// `buffers` on up to `threads` threads and returns each read's crc (0 where not asked), or for
/// a jointly checked read its fold ([`JointSpan`]).
/// Reads must not overlap in their destinations and must lie inside them (a plan that says
/// otherwise is refused before anything is read).
pub(crate) fn read_positioned<B: AsMut<[u8]>>(
    files: &LocalFiles,
    sources: &[SourceFile],
    reads: &[PositionedRead],
    buffers: &mut [B],
    threads: usize,
) -> Result<Vec<u32>, LoaderError> {
    let mut targets = split_destinations(reads, buffers)?;
    let threads = threads.clamp(1, reads.len().max(1));
    let mut crcs = vec![0u32; reads.len()];
    if threads == 1 {
        for (i, target) in targets.iter_mut().enumerate() {
            crcs[i] = read_one(files, sources, &reads[i], target)?;
        }
        return Ok(crcs);
    }
    // Each thread takes the next read not yet taken: the threads walk the batch in file order
    // together (one forward stream for the kernel's read-ahead), and reads of unequal sizes
    // (whole tensors of a model) keep every thread busy until the batch's last read.
    let next = std::sync::atomic::AtomicUsize::new(0);
    let targets: Vec<std::sync::Mutex<&mut [u8]>> =
        targets.into_iter().map(std::sync::Mutex::new).collect();
    let results: Vec<Result<Vec<(usize, u32)>, LoaderError>> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (next, targets) = (&next, &targets);
                scope.spawn(move || {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(target) = targets.get(i) else {
                            return Ok(done);
                        };
                        // Taken by this thread alone: the lock is never contended.
                        let mut target = match target.lock() {
                            Ok(guard) => guard,
                            Err(poisoned) => poisoned.into_inner(),
                        };
                        done.push((i, read_one(files, sources, &reads[i], &mut target)?));
                    }
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(result) => result,
                Err(panic) => std::panic::resume_unwind(panic),
            })
            .collect()
    });
    for result in results {
        for (i, crc) in result? {
            crcs[i] = crc;
        }
    }
    Ok(crcs)
}

/// The destination bytes of every read (in `reads` order), as disjoint mutable slices.
fn split_destinations<'b, B: AsMut<[u8]>>(
    reads: &[PositionedRead],
    buffers: &'b mut [B],
) -> Result<Vec<&'b mut [u8]>, LoaderError> {
    let mut order: Vec<usize> = (0..reads.len()).collect();
    order.sort_unstable_by_key(|&i| (reads[i].dest, reads[i].dst_start));
    let mut whole: Vec<Option<&'b mut [u8]>> =
        buffers.iter_mut().map(|b| Some(b.as_mut())).collect();
    let mut targets: Vec<Option<&'b mut [u8]>> = (0..reads.len()).map(|_| None).collect();
    let mut k = 0;
    while k < order.len() {
        let dest = reads[order[k]].dest;
        let Some(mut rest) = whole.get_mut(dest).and_then(Option::take) else {
            return Err(LoaderError::InvalidPlan {
                detail: format!("a read lands in missing destination {dest}"),
            });
        };
        let mut at = 0u64;
        while let Some(&i) = order.get(k).filter(|&&i| reads[i].dest == dest) {
            let read = &reads[i];
            let bad = |why: &str| LoaderError::InvalidPlan {
                detail: format!(
                    "the read of file #{} bytes {}..{} {why} (destination {dest} bytes {}..{})",
                    read.file,
                    read.offset,
                    read.offset.saturating_add(read.len),
                    read.dst_start,
                    read.dst_start.saturating_add(read.len)
                ),
            };
            if read.dst_start < at {
                return Err(bad("overlaps another piece's bytes"));
            }
            let skip = usize::try_from(read.dst_start - at).unwrap_or(usize::MAX);
            let len = usize::try_from(read.len).unwrap_or(usize::MAX);
            if skip.saturating_add(len) > rest.len() {
                return Err(bad("reaches past its destination"));
            }
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip);
            let (target, tail) = tail.split_at_mut(len);
            targets[i] = Some(target);
            rest = tail;
            at = read.dst_start + read.len;
            k += 1;
        }
    }
    Ok(targets.into_iter().flatten().collect())
}

/// Reads `read` into `target` (its exact length) and returns its crc when asked, or the fold of
/// its runs in their box when it is checked jointly.
fn read_one(
    files: &LocalFiles,
    sources: &[SourceFile],
    read: &PositionedRead,
    target: &mut [u8],
) -> Result<u32, LoaderError> {
    let file = files.file(read.file)?;
    let path = || {
        sources
            .get(read.file as usize)
            .map_or_else(|| format!("file #{}", read.file), |s| s.path.to_string())
    };
    let (run, stride) = match read.strided {
        None => {
            read_exact_at(file, target, read.offset, files.bounce, path)?;
            (read.len.max(1), read.len)
        }
        Some((run, stride)) => {
            crate::read::mapped::read_strided(
                file,
                target,
                crate::read::mapped::StridedSource {
                    offset: read.offset,
                    run,
                    stride,
                },
                path,
                // A tier copy may be truncated while it is read: a mapping would make that
                // SIGBUS, a read per run makes it a short read (and a read from storage).
                !files
                    .copies
                    .get(read.file as usize)
                    .copied()
                    .unwrap_or(false),
            )?;
            (run.max(1), stride)
        }
    };
    if let Some(joint) = read.joint {
        // Runs in file order: one ascending run of segments of the box.
        let mut fold = Fold::new(joint.crc, joint.len);
        {
            let mut segments = fold.run();
            for (i, bytes) in target.chunks(run as usize).enumerate() {
                let at = read.offset + i as u64 * stride;
                segments.add(at - joint.start, bytes);
            }
        }
        return Ok(fold.value());
    }
    Ok(read.crc.map_or(0, |crc| crc.checksum(target)))
}

/// Whether the store path `path` can be read by position: it maps to a file name as written.
/// A path with a percent sign is one the store encoded (characters a file name may hold but an
/// object path may not), and only the store knows how it decodes it.
pub(crate) fn readable_path(path: &object_store::path::Path) -> bool {
    !path.as_ref().contains('%')
}

/// Opens the file at store path `path` under the local store's `root`. A missing file is
/// [`LoaderError::MissingFile`] naming its store path, as a read through the store says.
pub(crate) fn open_local(
    root: &std::path::Path,
    path: &object_store::path::Path,
) -> Result<File, LoaderError> {
    open_file(&root.join(path.as_ref()), path)
}

/// Opens `local`, the file of store path `path` (named in a missing file's error).
fn open_file(
    local: &std::path::Path,
    path: &object_store::path::Path,
) -> Result<File, LoaderError> {
    File::open(local).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => LoaderError::MissingFile {
            path: path.to_string(),
        },
        _ => LoaderError::Io {
            action: "opening",
            path: local.display().to_string(),
            source: e,
        },
    })
}

/// A bounced read goes through a per-thread buffer of this size (see [`read_exact_at`]): small
/// enough to stay in a core's L2 cache.
pub(crate) const BOUNCE_BYTES: usize = 128 << 10;

/// The kernel copies at full speed only when destination and file offset agree modulo this.
const COPY_ALIGNMENT: u64 = 64;

/// Reads smaller than this are never bounced: a syscall costs more than their copy.
const MIN_BOUNCED_BYTES: usize = 4096;

thread_local! {
    static BOUNCE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Fills `target` with the bytes of `file` from `offset`, retrying interrupted calls; a file that
/// ends early is [`LoaderError::ShortRead`] naming the store path (`path()`), as the store's
/// reads say.
///
/// Where `target` and `offset` differ modulo 64, the kernel's copy out of the page cache runs
/// at a third of its speed on the machines we measured (2.5–2.7 vs 8.5–9.4 GB/s; BENCHMARKS.md "Reading
/// through a bounce buffer"); glibc's copy does not care. Such a read goes through a
/// cache-resident bounce buffer placed to agree with the file offset, and user space copies on
/// into the target. Aligned reads go straight in: one copy. `bounce: false` reads everything
/// straight in ([`crate::read::ReadOptions::bounce_reads`]).
pub(crate) fn read_exact_at(
    file: &File,
    target: &mut [u8],
    offset: u64,
    bounce: bool,
    path: impl Fn() -> String,
) -> Result<(), LoaderError> {
    let request = (offset, offset + target.len() as u64);
    let misaligned = !(target.as_ptr() as u64)
        .wrapping_sub(offset)
        .is_multiple_of(COPY_ALIGNMENT);
    if !misaligned || target.len() < MIN_BOUNCED_BYTES || !bounce {
        return pread_exact(file, target, offset, request, &path);
    }
    BOUNCE.with(|bounce| {
        let mut bounce = bounce.borrow_mut();
        let room = BOUNCE_BYTES + COPY_ALIGNMENT as usize;
        if bounce.len() < room {
            bounce.resize(room, 0);
        }
        let mut at = offset;
        for chunk in target.chunks_mut(BOUNCE_BYTES) {
            // Start where the staged bytes agree with the file offset modulo the alignment.
            let base = bounce.as_ptr() as u64;
            let skip = (at.wrapping_sub(base)) % COPY_ALIGNMENT;
            let staged = &mut bounce[skip as usize..skip as usize + chunk.len()];
            pread_exact(file, staged, at, request, &path)?;
            chunk.copy_from_slice(staged);
            at += chunk.len() as u64;
        }
        Ok(())
    })
}

/// One `pread` loop filling `target` from file offset `at`, a stretch of the caller's `request`
/// (`start..end`), which its errors name: a file that ends early is a ShortRead of the request
/// with the bytes it got before the end.
fn pread_exact(
    file: &File,
    target: &mut [u8],
    at: u64,
    (start, end): (u64, u64),
    path: &impl Fn() -> String,
) -> Result<(), LoaderError> {
    let mut done = 0usize;
    while done < target.len() {
        match file.read_at(&mut target[done..], at + done as u64) {
            Ok(0) => {
                return Err(LoaderError::ShortRead {
                    path: path(),
                    start,
                    end,
                    got: at - start + done as u64,
                });
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(source) => {
                return Err(LoaderError::Io {
                    action: "reading",
                    path: format!("{} bytes {start}..{end}", path()),
                    source,
                });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
pub(crate) mod tests {
    use super::*;
    use object_store::path::Path;

    fn under(root: &std::path::Path) -> LocalPaths {
        LocalPaths {
            root: Some(root.to_path_buf()),
            files: Arc::default(),
            shared: Arc::default(),
        }
    }

    fn source(name: &str) -> SourceFile {
        SourceFile {
            path: Path::from(name),
            key: name.to_string(),
        }
    }

    fn read(offset: u64, len: u64, dest: usize, dst_start: u64) -> PositionedRead {
        PositionedRead {
            file: 0,
            offset,
            len,
            dest,
            dst_start,
            crc: Some(Crc::Crc32c),
            strided: None,
            joint: None,
        }
    }

    fn files_with(bytes: &[u8]) -> (tempfile::TempDir, LocalFiles, Vec<SourceFile>) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("data"), bytes).unwrap();
        let sources = vec![source("data")];
        let mut files = LocalFiles::new(under(dir.path()), 1, true);
        files.open(0, &sources[0]).unwrap();
        (dir, files, sources)
    }

    #[test]
    fn reads_land_where_they_say_on_any_number_of_threads() {
        let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 251) as u8).collect();
        let (_dir, files, sources) = files_with(&data);
        // Out of destination order, two destinations, gaps between targets left untouched.
        let reads = [
            read(1000, 500, 1, 100),
            read(0, 10, 0, 0),
            read(3000, 1096, 0, 20),
            read(10, 90, 1, 0),
        ];
        for threads in [1, 2, 3, 8] {
            let mut buffers = vec![vec![0xEEu8; 1200], vec![0xEEu8; 700]];
            let crcs = read_positioned(&files, &sources, &reads, &mut buffers, threads).unwrap();
            assert_eq!(&buffers[0][..10], &data[..10]);
            assert!(buffers[0][10..20].iter().all(|&b| b == 0xEE));
            assert_eq!(&buffers[0][20..1116], &data[3000..4096]);
            assert_eq!(&buffers[1][..90], &data[10..100]);
            assert_eq!(&buffers[1][100..600], &data[1000..1500]);
            assert!(buffers[1][600..].iter().all(|&b| b == 0xEE));
            assert_eq!(crcs[0], crc32c::crc32c(&data[1000..1500]));
            assert_eq!(crcs[2], crc32c::crc32c(&data[3000..4096]));
        }
    }

    #[test]
    fn overlapping_or_outside_targets_are_refused_before_reading() {
        let (_dir, files, sources) = files_with(&[1u8; 64]);
        let mut buffers = vec![vec![0u8; 32]];
        let overlap = [read(0, 16, 0, 0), read(16, 16, 0, 8)];
        let e = read_positioned(&files, &sources, &overlap, &mut buffers, 2).unwrap_err();
        assert!(e.to_string().contains("overlaps another piece"), "{e}");
        assert!(buffers[0].iter().all(|&b| b == 0), "nothing read");
        let outside = [read(0, 16, 0, 20)];
        let e = read_positioned(&files, &sources, &outside, &mut buffers, 1).unwrap_err();
        assert!(
            e.to_string().contains("reaches past its destination"),
            "{e}"
        );
        let missing = [read(0, 16, 3, 0)];
        let e = read_positioned(&files, &sources, &missing, &mut buffers, 1).unwrap_err();
        assert!(e.to_string().contains("missing destination 3"), "{e}");
    }

    /// A ShortRead's path, start, end and bytes got; any other error fails the test.
    pub(crate) fn short_read(e: LoaderError) -> (String, u64, u64, u64) {
        match e {
            LoaderError::ShortRead {
                path,
                start,
                end,
                got,
            } => (path, start, end, got),
            other => panic!("expected a short read, got {other}"),
        }
    }

    /// Where in `buffer` a read from file offset `offset` lands `shift` bytes off the kernel's
    /// copy alignment (0: aligned, straight in; otherwise through the bounce buffer).
    fn start_with_shift(buffer: &[u8], offset: u64, shift: u64) -> u64 {
        (offset + shift).wrapping_sub(buffer.as_ptr() as u64) % COPY_ALIGNMENT
    }

    #[test]
    fn aligned_and_misaligned_reads_land_whole_and_short_ones_say_how_far_they_got() {
        // Several bounce chunks and a partial last one, from an odd file offset.
        let len = 3 * BOUNCE_BYTES + 12_345;
        let data: Vec<u8> = (0..len + 777).map(|i| (i * 31 % 253) as u8).collect();
        let (_dir, files, sources) = files_with(&data);
        for shift in [0, 5, 16, 63] {
            let mut buffers = vec![vec![0xEEu8; len + 2 * COPY_ALIGNMENT as usize]];
            let dst = start_with_shift(&buffers[0], 777, shift);
            let reads = [read(777, len as u64, 0, dst)];
            let crcs = read_positioned(&files, &sources, &reads, &mut buffers, 2).unwrap();
            let dst = dst as usize;
            assert_eq!(
                &buffers[0][dst..dst + len],
                &data[777..777 + len],
                "shift {shift}"
            );
            assert!(
                buffers[0][..dst]
                    .iter()
                    .chain(&buffers[0][dst + len..])
                    .all(|&b| b == 0xEE)
            );
            assert_eq!(crcs[0], crc32c::crc32c(&data[777..777 + len]));
        }
        // The file ends inside the third chunk: the error names the whole request.
        let short = 2 * BOUNCE_BYTES + 100;
        let (_dir, files, sources) = files_with(&data[..short]);
        for shift in [0, 5] {
            let mut buffers = vec![vec![0u8; len + 2 * COPY_ALIGNMENT as usize]];
            let dst = start_with_shift(&buffers[0], 0, shift);
            let reads = [read(0, len as u64, 0, dst)];
            let e = read_positioned(&files, &sources, &reads, &mut buffers, 1).unwrap_err();
            assert_eq!(
                short_read(e),
                ("data".to_string(), 0, len as u64, short as u64)
            );
        }
    }

    #[test]
    fn a_short_file_and_a_missing_file_are_named() {
        let (dir, files, sources) = files_with(&[9u8; 100]);
        let mut buffers = vec![vec![0u8; 64]];
        let e =
            read_positioned(&files, &sources, &[read(60, 64, 0, 0)], &mut buffers, 1).unwrap_err();
        assert_eq!(short_read(e), ("data".to_string(), 60, 124, 40));
        let mut files = LocalFiles::new(under(dir.path()), 2, true);
        let e = files.open(1, &source("gone/data_1")).unwrap_err();
        assert!(
            matches!(&e, LoaderError::MissingFile { path } if path == "gone/data_1"),
            "{e}"
        );
        assert!(!files.readable(&source("a b%")));
        assert!(files.readable(&source("step-1/__0_0.distcp")));
    }
}
