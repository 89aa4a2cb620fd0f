//! Host destination buffers the loader allocates itself (the CLI, `load_rank`): zeroed, and on
//! Linux their pages faulted in up front, in one `madvise(MADV_POPULATE_WRITE)` call per buffer,
//! before the read writes into them.
//!
//! Fresh memory is what a one-shot load into new buffers pays most for on a VM: faulting in
//! 4.4 GB of destinations was 55 % of the CPU samples of a 4-rank CLI load (`clear_page_erms`
//! under the reads' copies and the direct copies' `process_vm_readv`; BENCHMARKS.md, issue 31).
//! Measured on the 2-core Intel VM, 4 processes first-touching 1 GiB each: populated up front on
//! 4 KiB pages 0.88–0.97 s, touched by the copies 1.0–1.15 s, on transparent huge pages
//! (`MADV_HUGEPAGE`, the previous default) anywhere from 0.35 to 4.0 s from run to run, and huge
//! pages populated up front 1.07–1.47 s. Up front on small pages is the fastest median and the
//! steadiest, and it takes the faults out of the read and the exchange, whose times then measure
//! reading and exchanging.

#![allow(unsafe_code)]

/// Buffers smaller than this are left to fault in as they are written (one call would save
/// next to nothing).
const POPULATE_MIN_BYTES: usize = 4 << 20;

/// A zeroed buffer of `len` bytes, its pages faulted in up front when large.
pub fn zeroed_buffer(len: usize) -> Vec<u8> {
    let mut buffer = vec![0u8; len];
    if len >= POPULATE_MIN_BYTES {
        populate(&mut buffer);
    }
    buffer
}

/// Faults in the whole 4 KiB pages of `buffer` for writing: advice only, contents unchanged (the
/// pages of a fresh zeroed allocation are zero either way); a kernel without
/// `MADV_POPULATE_WRITE` (before 5.14) or another OS changes nothing, and the pages fault in
/// as they are written.
#[cfg(target_os = "linux")]
fn populate(buffer: &mut [u8]) {
    const PAGE: usize = 4096;
    let start = buffer.as_mut_ptr() as usize;
    let aligned = start.next_multiple_of(PAGE);
    let end = (start + buffer.len()) / PAGE * PAGE;
    if end > aligned {
        // SAFETY: [aligned, end) lies inside `buffer`, which this function borrows mutably;
        // MADV_POPULATE_WRITE only faults the range's pages in, never changes their contents.
        unsafe {
            libc::madvise(
                aligned as *mut libc::c_void,
                end - aligned,
                libc::MADV_POPULATE_WRITE,
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn populate(_buffer: &mut [u8]) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_whatever_their_size() {
        for len in [0, 1, 4095, POPULATE_MIN_BYTES, POPULATE_MIN_BYTES + 12_345] {
            let buffer = zeroed_buffer(len);
            assert_eq!(buffer.len(), len);
            assert!(buffer.iter().all(|&b| b == 0), "{len}");
        }
    }
}
