//! Host destination buffers the loader allocates itself (the CLI, `load_rank`): zeroed, and on
//! Linux backed by transparent huge pages where the system allows them on request
//! (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, the common default). A fresh
//! buffer costs a page fault per 4 KiB page on first touch, in the middle of the read; with
//! 2 MiB pages that is 512 times fewer faults (measured in BENCHMARKS.md, issue 16).

#![allow(unsafe_code)]

/// Buffers smaller than this stay on ordinary pages (a huge page would mostly be waste).
const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

/// A zeroed buffer of `len` bytes, asked to be backed by huge pages when large.
pub fn zeroed_buffer(len: usize) -> Vec<u8> {
    let mut buffer = vec![0u8; len];
    if len >= HUGE_PAGE_MIN_BYTES {
        advise_huge_pages(&mut buffer);
    }
    buffer
}

/// Asks the kernel to back the whole 4 KiB pages of `buffer` with huge pages: advice only,
/// contents unchanged; refused advice (no THP, another OS) changes nothing.
#[cfg(target_os = "linux")]
fn advise_huge_pages(buffer: &mut [u8]) {
    const PAGE: usize = 4096;
    let start = buffer.as_mut_ptr() as usize;
    let aligned = start.next_multiple_of(PAGE);
    let end = (start + buffer.len()) / PAGE * PAGE;
    if end > aligned {
        // SAFETY: [aligned, end) lies inside `buffer`, which this function borrows mutably;
        // MADV_HUGEPAGE changes how the range is backed, never its contents.
        unsafe {
            libc::madvise(
                aligned as *mut libc::c_void,
                end - aligned,
                libc::MADV_HUGEPAGE,
            );
        }
    }
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_buffer: &mut [u8]) {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zeroed_whatever_their_size() {
        for len in [
            0,
            1,
            4095,
            HUGE_PAGE_MIN_BYTES,
            HUGE_PAGE_MIN_BYTES + 12_345,
        ] {
            let buffer = zeroed_buffer(len);
            assert_eq!(buffer.len(), len);
            assert!(buffer.iter().all(|&b| b == 0), "{len}");
        }
    }
}
