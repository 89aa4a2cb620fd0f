//! Memory the caller owns, by address: how NumPy arrays and CPU torch tensors reach the loader.
//!
//! The stable ABI of Python 3.10 (`abi3-py310`) has no buffer protocol, so the Python layer
//! passes each array's data address and byte length (`__array_interface__`, `data_ptr()`), after
//! checking that the array is C-contiguous and writable, and keeps the arrays referenced for the
//! whole call. This module is the one place that turns those numbers back into slices.
#![allow(unsafe_code)]

use std::ptr::NonNull;

/// `len` writable bytes at a caller-owned address.
#[derive(Debug)]
pub struct HostMemory {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a HostMemory is an exclusive borrow of memory nothing else touches during the call
// (see `HostMemory::new`), so moving it to or sharing it with runtime threads is what a
// `&mut [u8]` would allow.
unsafe impl Send for HostMemory {}
// SAFETY: as above; shared access only reads through `as_ref`.
unsafe impl Sync for HostMemory {}

impl HostMemory {
    /// Wraps `len` bytes at `address` (0 is allowed only for `len == 0`).
    ///
    /// # Safety
    /// For as long as the value lives, `address..address + len` must be one allocation, writable,
    /// initialized, and neither freed, moved nor accessed by anything else; distinct values must
    /// not overlap.
    pub unsafe fn new(address: usize, len: usize) -> Option<Self> {
        if len == 0 {
            return Some(Self {
                ptr: NonNull::dangling(),
                len: 0,
            });
        }
        NonNull::new(address as *mut u8).map(|ptr| Self { ptr, len })
    }
}

impl AsMut<[u8]> for HostMemory {
    fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: `new`'s contract: valid, exclusive, `len` bytes (dangling is fine for 0).
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl AsRef<[u8]> for HostMemory {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: as in `as_mut`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

/// Bytes of a Python object (a received tensor) that tessera reads after the call that handed
/// them over: the object stays referenced for as long as the bytes are.
pub struct PyOwnedBytes {
    _owner: pyo3::Py<pyo3::PyAny>,
    memory: HostMemory,
}

impl PyOwnedBytes {
    /// `memory` (which `owner` holds) with `owner` kept alive.
    pub fn new(owner: pyo3::Py<pyo3::PyAny>, memory: HostMemory) -> Self {
        Self {
            _owner: owner,
            memory,
        }
    }
}

impl AsRef<[u8]> for PyOwnedBytes {
    fn as_ref(&self) -> &[u8] {
        self.memory.as_ref()
    }
}

/// Ranges `[address, address + len)` that overlap, as indices into `spans`: two targets sharing
/// memory would be written twice and race.
pub fn first_overlap(spans: &[(usize, usize)]) -> Option<(usize, usize)> {
    let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].1 > 0).collect();
    order.sort_by_key(|&i| spans[i].0);
    order.windows(2).find_map(|w| {
        let (a, b) = (spans[w[0]], spans[w[1]]);
        (a.0.saturating_add(a.1) > b.0).then_some((w[0], w[1]))
    })
}
