//! The CUDA copy engine of the staging pool: pinned host buffers, asynchronous host-to-device
//! copies on a dedicated stream, and an event per buffer that says when its copy is done.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, PinnedHostSlice, result, sys};

use super::device::{CudaDevice, DeviceBuffer};
use super::driver_error;
use crate::LoaderError;
use crate::device::staging::CopyEngine;
use crate::device::{DeviceMemory, check_span};

/// Host-to-device copies of one device on a stream of their own (see [`crate::device::staging`]).
pub struct CudaCopyEngine {
    label: String,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
}

impl std::fmt::Debug for CudaCopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaCopyEngine")
            .field("device", &self.label)
            .finish_non_exhaustive()
    }
}

/// A pinned staging buffer and the event recorded after its last copy.
pub struct CudaSlot {
    buffer: PinnedHostSlice<u8>,
    event: CudaEvent,
    /// A copy from the buffer was started and not yet waited for.
    pending: bool,
}

impl Drop for CudaSlot {
    fn drop(&mut self) {
        // The pinned memory is freed right after this: no copy may still read it.
        if self.pending {
            let _ = self.event.synchronize();
        }
    }
}

impl CudaCopyEngine {
    pub(crate) fn new(device: &CudaDevice) -> Result<Self, LoaderError> {
        let ctx = Arc::clone(device.context());
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("creating the staging stream", e))?;
        Ok(Self {
            label: device.label(),
            ctx,
            stream,
        })
    }

    /// The engine's stream.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl CopyEngine for CudaCopyEngine {
    type Slot = CudaSlot;
    type Target = DeviceBuffer;

    fn device(&self) -> String {
        self.label.clone()
    }

    fn alloc_slot(&self, bytes: usize) -> Result<CudaSlot, LoaderError> {
        let what = format!("allocating {bytes} bytes of pinned host memory");
        // Write-combined: the CPU only writes staging buffers (streaming stores, no cache
        // pollution) and the GPU reads them over PCIe.
        // SAFETY: the memory starts uninitialised; it is zero-filled below before any slice of it
        // is handed out.
        let mut buffer = unsafe {
            self.ctx
                .alloc_pinned_with_flags::<u8>(bytes, sys::CU_MEMHOSTALLOC_WRITECOMBINED)
        }
        .map_err(|e| driver_error(&what, e))?;
        buffer
            .as_mut_slice()
            .map_err(|e| driver_error(&what, e))?
            .fill(0);
        let event = self
            .ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| driver_error("creating a staging event", e))?;
        Ok(CudaSlot {
            buffer,
            event,
            pending: false,
        })
    }

    fn begin_lane(&self) -> Result<(), LoaderError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("binding the device to a staging thread", e))
    }

    fn fill<R>(
        &self,
        slot: &mut CudaSlot,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, LoaderError> {
        if slot.pending {
            slot.event
                .synchronize()
                .map_err(|e| driver_error("waiting for a staging copy", e))?;
            slot.pending = false;
        }
        let bytes = slot
            .buffer
            .as_mut_slice()
            .map_err(|e| driver_error("reaching a staging buffer", e))?;
        Ok(fill(bytes))
    }

    fn upload(
        &self,
        slot: &mut CudaSlot,
        len: usize,
        target: &DeviceBuffer,
        offset: u64,
    ) -> Result<(), LoaderError> {
        check_span(
            &self.label,
            "staged upload",
            offset,
            len as u64,
            target.len(),
        )?;
        if len == 0 {
            return Ok(());
        }
        if !Arc::ptr_eq(&self.ctx, &target.ctx) && self.ctx.cu_ctx() != target.ctx.cu_ctx() {
            return Err(LoaderError::Device {
                device: self.label.clone(),
                detail: format!("a staged upload into a buffer of cuda:{}", target.ordinal()),
            });
        }
        let source = slot
            .buffer
            .as_slice()
            .map_err(|e| driver_error("reaching a staging buffer", e))?;
        let Some(source) = source.get(..len) else {
            return Err(LoaderError::Device {
                device: self.label.clone(),
                detail: format!("a {len}-byte upload from a smaller staging buffer"),
            });
        };
        // SAFETY: the target span was checked above; the source is pinned memory owned by the
        // slot, which is not written again (`fill` waits for `event` first) nor freed (the slot's
        // drop waits for it) until the event recorded right after this copy has completed.
        unsafe { result::memcpy_htod_async(target.ptr + offset, source, self.stream.cu_stream()) }
            .map_err(|e| driver_error("starting a staged upload", e))?;
        slot.pending = true;
        slot.event
            .record(&self.stream)
            .map_err(|e| driver_error("recording a staging event", e))
    }

    fn synchronize(&self) -> Result<(), LoaderError> {
        self.stream
            .synchronize()
            .map_err(|e| driver_error("waiting for staged uploads", e))
    }
}
