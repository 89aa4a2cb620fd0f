//! A CUDA device and buffers in its memory: allocated by the loader (one per destination), or
//! the caller's own memory wrapped by address and length (a torch tensor's `data_ptr()`).

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, result, sys};
use tessera_planner::RankPlan;

use super::staging::CudaCopyEngine;
use super::{driver_error, probe};
use crate::LoaderError;
use crate::device::staging::{StagingOptions, StagingPool};
use crate::device::{DeviceMemory, check_span};

/// One CUDA device (its primary context, shared with torch and anything else in the process) and
/// a stream of its own for the loader's copies.
#[derive(Clone)]
pub struct CudaDevice {
    ordinal: u32,
    name: String,
    ctx: Arc<CudaContext>,
    copy: Arc<CudaStream>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Number of CUDA devices visible here; a [`LoaderError::Cuda`] when there is no driver.
    pub fn count() -> Result<u32, LoaderError> {
        Ok(probe::driver()?.devices)
    }

    /// Opens `cuda:<ordinal>`. Fails with [`LoaderError::Cuda`] (never a panic) when the driver
    /// is missing or the device does not exist.
    pub fn open(ordinal: u32) -> Result<CudaDevice, LoaderError> {
        let info = probe::driver()?;
        if ordinal >= info.devices {
            return Err(LoaderError::Cuda {
                detail: format!(
                    "device cuda:{ordinal} does not exist: {} CUDA device{} visible here (CUDA_VISIBLE_DEVICES?)",
                    info.devices,
                    if info.devices == 1 { " is" } else { "s are" }
                ),
            });
        }
        let what = format!("opening cuda:{ordinal}");
        let ctx = probe::guarded(&what, || CudaContext::new(ordinal as usize))?
            .map_err(|e| driver_error(&what, e))?;
        let name = ctx.name().unwrap_or_else(|_| "unknown GPU".to_string());
        let copy = ctx
            .new_stream()
            .map_err(|e| driver_error("creating the copy stream", e))?;
        Ok(CudaDevice {
            ordinal,
            name,
            ctx,
            copy,
        })
    }

    /// The device's ordinal (`n` of `cuda:n`).
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// `cuda:n`.
    pub fn label(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    /// The GPU's name (`NVIDIA H200`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The context (the device's primary context).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    fn bind(&self) -> Result<(), LoaderError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error(&format!("binding {} to this thread", self.label()), e))
    }

    /// A zero-filled buffer of `len` bytes in device memory.
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer, LoaderError> {
        DeviceBuffer::alloc(&self.ctx, self.ordinal, len, true)
    }

    /// One zero-filled device buffer per destination of `plan`.
    pub fn alloc_destinations(&self, plan: &RankPlan) -> Result<Vec<DeviceBuffer>, LoaderError> {
        plan.destinations
            .iter()
            .map(|d| {
                let len = usize::try_from(d.bytes).map_err(|_| LoaderError::Device {
                    device: self.label(),
                    detail: format!("a {}-byte destination does not fit in memory", d.bytes),
                })?;
                self.alloc(len)
            })
            .collect()
    }

    /// Wraps memory the caller owns (a torch tensor's storage, say) as a destination buffer.
    /// The loader writes into it and never frees it.
    ///
    /// # Safety
    ///
    /// `ptr` must be the address of at least `len` bytes of device memory of this device,
    /// allocated in this device's primary context (what the CUDA runtime and torch use) or
    /// otherwise accessible from it, that stay allocated for as long as the returned buffer
    /// lives, and that nothing else reads or writes until the load using it has returned.
    pub unsafe fn wrap(&self, ptr: u64, len: usize) -> DeviceBuffer {
        DeviceBuffer {
            ptr,
            len,
            owned: false,
            ordinal: self.ordinal,
            ctx: Arc::clone(&self.ctx),
        }
    }

    /// Copies `buffer` back to host memory (tests and `--check`/`--dump` use this).
    pub fn to_host(&self, buffer: &DeviceBuffer) -> Result<Vec<u8>, LoaderError> {
        let mut out = vec![0u8; buffer.len];
        if buffer.len == 0 {
            return Ok(out);
        }
        self.bind()?;
        let stream = self.copy.cu_stream();
        // SAFETY: `buffer` covers `buffer.len` bytes of device memory (allocated by this module,
        // or promised by the caller of `wrap`), `out` is a host slice of exactly that length that
        // outlives the copy: the stream is synchronized before `out` is touched or returned.
        unsafe { result::memcpy_dtoh_async(&mut out, buffer.ptr, stream) }
            .map_err(|e| driver_error("copying device memory to the host", e))?;
        self.copy
            .synchronize()
            .map_err(|e| driver_error("copying device memory to the host", e))?;
        Ok(out)
    }

    /// Uploads host bytes into `buffer` at `offset`, synchronously and without staging (small
    /// copies and tests; loads go through [`CudaDevice::staging`]).
    pub fn upload(
        &self,
        src: &[u8],
        buffer: &DeviceBuffer,
        offset: u64,
    ) -> Result<(), LoaderError> {
        check_span(
            &self.label(),
            "upload",
            offset,
            src.len() as u64,
            buffer.len,
        )?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the span was checked against the buffer; the stream is synchronized before
        // `src` (pageable, so the driver stages it anyway) can go away.
        unsafe { result::memcpy_htod_async(buffer.ptr + offset, src, self.copy.cu_stream()) }
            .map_err(|e| driver_error("copying host memory to the device", e))?;
        self.copy
            .synchronize()
            .map_err(|e| driver_error("copying host memory to the device", e))
    }

    /// The baseline the staging pool is measured against (benchmarks): `source` copied into a
    /// pinned buffer of its size (not timed), then one plain host-to-device copy of it into
    /// `target` (timed). Returns the seconds of that copy.
    pub fn plain_pinned_upload(
        &self,
        source: &[u8],
        target: &DeviceBuffer,
    ) -> Result<f64, LoaderError> {
        check_span(
            &self.label(),
            "pinned upload",
            0,
            source.len() as u64,
            target.len,
        )?;
        if source.is_empty() {
            return Ok(0.0);
        }
        let what = format!("allocating {} bytes of pinned host memory", source.len());
        // SAFETY: the memory starts uninitialised and is fully overwritten before it is read.
        let mut pinned = unsafe { self.ctx.alloc_pinned_with_flags::<u8>(source.len(), 0) }
            .map_err(|e| driver_error(&what, e))?;
        pinned
            .as_mut_slice()
            .map_err(|e| driver_error(&what, e))?
            .copy_from_slice(source);
        let bytes = pinned.as_slice().map_err(|e| driver_error(&what, e))?;
        self.bind()?;
        let started = std::time::Instant::now();
        // SAFETY: the span was checked; `pinned` lives until after the synchronize below.
        unsafe { result::memcpy_htod_async(target.ptr, bytes, self.copy.cu_stream()) }
            .map_err(|e| driver_error("a plain pinned upload", e))?;
        self.copy
            .synchronize()
            .map_err(|e| driver_error("a plain pinned upload", e))?;
        Ok(started.elapsed().as_secs_f64())
    }

    /// A copy engine on a stream of its own.
    pub fn copy_engine(&self) -> Result<CudaCopyEngine, LoaderError> {
        CudaCopyEngine::new(self)
    }

    /// A pinned staging pool on a copy stream of its own.
    pub fn staging(
        &self,
        options: StagingOptions,
    ) -> Result<StagingPool<CudaCopyEngine>, LoaderError> {
        StagingPool::new(self.copy_engine()?, options)
    }
}

/// Device memory of one CUDA device: owned (freed on drop) or the caller's (see
/// [`CudaDevice::wrap`]).
pub struct DeviceBuffer {
    pub(crate) ptr: sys::CUdeviceptr,
    pub(crate) len: usize,
    owned: bool,
    ordinal: u32,
    pub(crate) ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    /// Allocates `len` bytes in `ctx` (bound to the calling thread here), zero-filled if `zero`.
    pub(crate) fn alloc(
        ctx: &Arc<CudaContext>,
        ordinal: u32,
        len: usize,
        zero: bool,
    ) -> Result<DeviceBuffer, LoaderError> {
        let what = format!("allocating {len} bytes on cuda:{ordinal}");
        if len == 0 {
            // cuMemAlloc refuses 0 bytes; an empty buffer needs no memory.
            return Ok(DeviceBuffer {
                ptr: 0,
                len,
                owned: false,
                ordinal,
                ctx: Arc::clone(ctx),
            });
        }
        ctx.bind_to_thread().map_err(|e| driver_error(&what, e))?;
        // SAFETY: cuMemAlloc with a non-zero size in the bound context; the pointer is owned by
        // the returned buffer, which frees it exactly once.
        let ptr = unsafe { result::malloc_sync(len) }.map_err(|e| driver_error(&what, e))?;
        let buffer = DeviceBuffer {
            ptr,
            len,
            owned: true,
            ordinal,
            ctx: Arc::clone(ctx),
        };
        if zero {
            // SAFETY: `ptr` was just allocated with `len` bytes.
            unsafe { result::memset_d8_sync(ptr, 0, len) }.map_err(|e| driver_error(&what, e))?;
        }
        Ok(buffer)
    }

    /// The device address (for kernels or other libraries; valid while this buffer lives).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> u32 {
        self.ordinal
    }

    /// Whether the loader allocated it (and frees it on drop).
    pub fn is_owned(&self) -> bool {
        self.owned
    }
}

impl DeviceMemory for DeviceBuffer {
    fn len(&self) -> usize {
        self.len
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // Every copy into or out of loader buffers is synchronized before the call that issued
        // it returns; synchronizing the context first still keeps a free from racing anything.
        if self.ctx.bind_to_thread().is_ok() && self.ctx.synchronize().is_ok() {
            // SAFETY: the loader allocated `ptr` with cuMemAlloc and frees it once, here, after
            // all work in the context has finished.
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &format_args!("cuda:{}", self.ordinal))
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .field("owned", &self.owned)
            .finish()
    }
}
