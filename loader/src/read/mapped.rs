//! Strided reads of local files: the runs of a column slice (one short run per saved row),
//! copied out of a read-only mapping of the file's page cache straight into the destination.
//!
//! A column slice of a row-major box is one run per row, and on the shapes people train a run is
//! short: a rank's slice of a bf16 row of 2048–8192 elements is 1–4 KiB. Read per run, that is a
//! syscall per 1–4 KiB (about a microsecond each, BENCHMARKS.md "Small strided pieces"); through
//! the object store path, a request, a fetched buffer and a second copy per run. Mapped, the runs
//! are plain memory copies: the cost is setting up the page tables of the span the runs cover,
//! done in one go by `MAP_POPULATE` (no fault per page).
//!
//! Runs of a page or more are read with one `pread` each instead: mapping would set up the pages
//! of the other ranks' columns as well, and a page-sized copy costs more than the syscall.
//!
//! Mapping a file is the one way here a read can fail without an error: if another process
//! truncates the file while it is mapped, touching a page past the new end raises SIGBUS. The
//! file's length is checked against the span before mapping (a file that ends early is a
//! [`LoaderError::ShortRead`], as for every read), and a mapping lives only for the copy of one
//! read (at most a part, 16 MiB of destination bytes by default). Committed checkpoint files are
//! never rewritten in place by tessera or by the writers it reads (they write a new file and
//! rename it), which is what makes the remaining window acceptable, as it is for safetensors'
//! and `torch.load(mmap=True)`'s mappings.

#![allow(unsafe_code)]

use std::fs::File;

use crate::LoaderError;

/// Runs at least this long are read with one `pread` each instead of through a mapping.
pub(crate) const MAPPED_RUN_LIMIT: u64 = 4096;

/// A read of `count` runs of `run` bytes each, the first at file offset `offset`, each next one
/// `stride` bytes further on, landing back to back in `target` (`count × run` bytes).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StridedSource {
    pub offset: u64,
    pub run: u64,
    pub stride: u64,
}

impl StridedSource {
    /// One past the last file byte the read takes, for `count` runs.
    fn end(&self, count: u64) -> Option<u64> {
        count
            .checked_sub(1)?
            .checked_mul(self.stride)?
            .checked_add(self.offset)?
            .checked_add(self.run)
    }
}

/// Fills `target` with the runs of `source` from `file`. Errors name the store path (`path()`)
/// and the read's whole byte span: a file that ends before the span does is a ShortRead with
/// the bytes the file has of it.
/// `mappable: false` reads every run with its own `pread`, never through a mapping: for files
/// that may be truncated while they are read (a node's memory-tier copies, which other programs
/// can reach), where a mapping would turn that into SIGBUS instead of a
/// [`LoaderError::ShortRead`].
pub(crate) fn read_strided(
    file: &File,
    target: &mut [u8],
    source: StridedSource,
    path: impl Fn() -> String,
    mappable: bool,
) -> Result<(), LoaderError> {
    let run = source.run.max(1);
    let len = target.len() as u64;
    if len == 0 {
        return Ok(());
    }
    let count = len.div_ceil(run);
    let invalid = |why: &str| LoaderError::InvalidPlan {
        detail: format!(
            "a strided read of {} ({len} bytes in runs of {run} every {} bytes from {}) {why}",
            path(),
            source.stride,
            source.offset
        ),
    };
    if !len.is_multiple_of(run) || (count > 1 && source.stride < run) {
        return Err(invalid("does not divide into disjoint runs"));
    }
    let end = source
        .end(count)
        .ok_or_else(|| invalid("overflows 64-bit offsets"))?;
    let io = |action: &'static str, e: std::io::Error| LoaderError::Io {
        action,
        path: format!("{} bytes {}..{end}", path(), source.offset),
        source: e,
    };
    let file_len = file.metadata().map_err(|e| io("reading", e))?.len();
    if file_len < end {
        return Err(LoaderError::ShortRead {
            path: path(),
            start: source.offset,
            end,
            got: file_len.saturating_sub(source.offset),
        });
    }
    if run >= MAPPED_RUN_LIMIT || !mappable {
        for (i, chunk) in target.chunks_mut(run as usize).enumerate() {
            crate::read::positioned::read_exact_at(
                file,
                chunk,
                source.offset + i as u64 * source.stride,
                false,
                &path,
            )?;
        }
        return Ok(());
    }
    let mapping = Mapping::new(file, source.offset, end).map_err(|e| io("mapping", e))?;
    let bytes = mapping.bytes();
    let run = run as usize;
    let stride = source.stride as usize;
    for (i, chunk) in target.chunks_mut(run).enumerate() {
        let at = mapping.lead + i * stride;
        chunk.copy_from_slice(&bytes[at..at + run]);
    }
    Ok(())
}

/// A read-only, private mapping of file bytes `start..end` (widened to whole pages), unmapped
/// when dropped.
struct Mapping {
    base: *mut libc::c_void,
    len: usize,
    /// Bytes between the mapping's first byte (page-aligned) and file byte `start`.
    lead: usize,
}

impl Mapping {
    fn new(file: &File, start: u64, end: u64) -> std::io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as u64;
        let aligned = start / page * page;
        let len = usize::try_from(end - aligned)
            .map_err(|_| std::io::Error::other("span larger than the address space"))?;
        let offset = libc::off_t::try_from(aligned)
            .map_err(|_| std::io::Error::other("offset past off_t"))?;
        // SAFETY: a fresh read-only private mapping of an open file descriptor: it aliases no
        // Rust memory. Its pages stay valid until munmap in Drop; the one hazard, a concurrent
        // truncation of the file (SIGBUS on touch), is the module doc's.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_POPULATE,
                file.as_raw_fd(),
                offset,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(Mapping {
            base,
            len,
            lead: (start - aligned) as usize,
        })
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: `base..base + len` is mapped readable for the life of `self` (see `new`).
        unsafe { std::slice::from_raw_parts(self.base.cast::<u8>(), self.len) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping `new` made; no slice of it outlives `self`.
        unsafe {
            libc::munmap(self.base, self.len);
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn file_of(bytes: &[u8]) -> (tempfile::TempDir, File) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("data");
        std::fs::write(&path, bytes).unwrap();
        let file = File::open(&path).unwrap();
        (dir, file)
    }

    /// What a strided read must give: the runs, back to back.
    fn expected(data: &[u8], source: StridedSource, count: usize) -> Vec<u8> {
        (0..count)
            .flat_map(|i| {
                let at = source.offset as usize + i * source.stride as usize;
                data[at..at + source.run as usize].to_vec()
            })
            .collect()
    }

    #[test]
    fn column_runs_land_back_to_back_mapped_and_by_pread() {
        let data: Vec<u8> = (0..3 * 65536 + 333).map(|i| (i * 13 % 251) as u8).collect();
        let (_dir, file) = file_of(&data);
        // Short runs (mapped) from unaligned offsets, and page-sized runs (one pread each).
        for (offset, run, stride, count) in [
            (5u64, 24u64, 1000u64, 100usize),
            (4097, 1, 3, 5000),
            (0, 2048, 8192, 20),
            (70_000, 4096, 16384, 7),
            (123, 6000, 6001, 3),
        ] {
            let source = StridedSource {
                offset,
                run,
                stride,
            };
            for mappable in [true, false] {
                let mut target = vec![0u8; run as usize * count];
                read_strided(&file, &mut target, source, || "data".into(), mappable).unwrap();
                assert_eq!(
                    target,
                    expected(&data, source, count),
                    "{source:?} mappable {mappable}"
                );
            }
        }
    }

    /// A file that may shrink while it is read (a memory-tier copy) is read without a mapping:
    /// truncated between reads, the next read is a short read, not SIGBUS.
    #[test]
    fn an_unmappable_file_truncated_between_reads_is_a_short_read() {
        let data = vec![9u8; 3 * 4096];
        let (dir, file) = file_of(&data);
        let source = StridedSource {
            offset: 100,
            run: 16,
            stride: 4096,
        };
        let mut target = vec![0u8; 48];
        read_strided(&file, &mut target, source, || "copy".into(), false).unwrap();
        assert_eq!(target, vec![9u8; 48]);
        std::fs::OpenOptions::new()
            .write(true)
            .open(dir.path().join("data"))
            .unwrap()
            .set_len(4096)
            .unwrap();
        let e = read_strided(&file, &mut target, source, || "copy".into(), false).unwrap_err();
        assert_eq!(
            crate::read::positioned::tests::short_read(e),
            ("copy".to_string(), 100, 100 + 2 * 4096 + 16, 4096 - 100)
        );
    }

    #[test]
    fn a_file_that_ends_inside_the_span_is_a_short_read_naming_it() {
        let (_dir, file) = file_of(&[7u8; 10_000]);
        for run in [100u64, 5000] {
            let source = StridedSource {
                offset: 1000,
                run,
                stride: 9000,
            };
            let mut target = vec![0u8; 2 * run as usize];
            let e = read_strided(
                &file,
                &mut target,
                source,
                || "step/__0_0.distcp".into(),
                true,
            )
            .unwrap_err();
            assert_eq!(
                crate::read::positioned::tests::short_read(e),
                ("step/__0_0.distcp".to_string(), 1000, 10_000 + run, 9000)
            );
            assert!(target.iter().all(|&b| b == 0), "nothing copied");
        }
    }

    #[test]
    fn overlapping_or_ragged_runs_are_refused() {
        let (_dir, file) = file_of(&[1u8; 4096]);
        let mut target = vec![0u8; 64];
        for (run, stride) in [(32u64, 16u64), (30, 100)] {
            let source = StridedSource {
                offset: 0,
                run,
                stride,
            };
            let e = read_strided(&file, &mut target, source, || "data".into(), true).unwrap_err();
            assert!(
                e.to_string().contains("does not divide into disjoint runs"),
                "{e}"
            );
        }
    }
}
