//! The NCCL data plane: one communicator per rank, owned by the rank's plane thread (a raw
//! `ncclComm_t` is `!Send`), device memory of the rank's GPU, and grouped point-to-point on a
//! stream of its own. [`connect_nccl`] builds the whole transport: TCP control mesh, the unique id
//! broadcast from rank 0 over it, the communicator, the sequencer.

use std::ffi::c_char;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaEvent, CudaStream, result, sys};
use cudarc::nccl::result as nccl;
use cudarc::nccl::sys as nccl_sys;
use tessera_planner::StridedRuns;

use super::device::{CudaDevice, DeviceBuffer};
use super::{driver_error, probe};
use crate::LoaderError;
use crate::device::{DeviceMemory, check_span};
use crate::transport::plane::{DataPlane, PlaneOp, PlaneThread, check_runs};
use crate::transport::rendezvous::RendezvousConfig;
use crate::transport::{SequencedTransport, TcpTransport, Transport, TransportOptions};

/// The NCCL transport: TCP for control, NCCL for data.
pub type NcclTransport = SequencedTransport<TcpTransport, NcclPlane>;

/// Control tag of the unique id rank 0 hands every rank (the sequencer uses 1 and 2).
const TAG_UNIQUE_ID: u64 = 3;

fn nccl_error(what: &str, error: nccl::NcclError) -> LoaderError {
    LoaderError::Cuda {
        detail: format!("{what}: NCCL error {:?}", error.0),
    }
}

/// One rank's NCCL communicator on its device (see the module docs). Lives on its plane thread.
pub struct NcclPlane {
    rank: u32,
    world: u32,
    label: String,
    ordinal: u32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    done: CudaEvent,
    comm: nccl_sys::ncclComm_t,
    timeout: Duration,
    /// The widest pitch a 2-D copy accepts on this device.
    max_pitch: u64,
    /// Why the communicator was aborted, once it was.
    broken: Option<String>,
}

impl NcclPlane {
    /// Joins the communicator `id` as `rank` of `world` on `device`. Blocks until every rank has
    /// joined (NCCL's own rendezvous); call it on the thread that will own the plane.
    pub fn new(
        device: &CudaDevice,
        rank: u32,
        world: u32,
        id: [u8; 128],
        timeout: Duration,
    ) -> Result<NcclPlane, LoaderError> {
        probe::nccl()?;
        let ctx = Arc::clone(device.context());
        let label = device.label();
        ctx.bind_to_thread()
            .map_err(|e| driver_error("binding the device to the NCCL thread", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| driver_error("creating the NCCL stream", e))?;
        let done = ctx
            .new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
            .map_err(|e| driver_error("creating the NCCL event", e))?;
        let max_pitch = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_PITCH)
            .map_or(0, |p| u64::try_from(p).unwrap_or(0));
        let unique = nccl_sys::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let (nranks, me) = match (i32::try_from(world), i32::try_from(rank)) {
            (Ok(n), Ok(r)) => (n, r),
            _ => {
                return Err(LoaderError::Cuda {
                    detail: format!("an NCCL communicator of {world} ranks is too large"),
                });
            }
        };
        let mut comm = MaybeUninit::<nccl_sys::ncclComm_t>::uninit();
        let what = format!("joining the NCCL communicator as rank {rank} of {world} on {label}");
        // SAFETY: `comm` is a valid place for the handle; the id came from ncclGetUniqueId on rank
        // 0; the device's context is current on this thread, so NCCL uses that device.
        probe::guarded(&what, || unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), nranks, unique, me)
        })?
        .map_err(|e| nccl_error(&what, e))?;
        // SAFETY: ncclCommInitRank succeeded, so it wrote the handle.
        let comm = unsafe { comm.assume_init() };
        Ok(NcclPlane {
            rank,
            world,
            ordinal: device.ordinal(),
            label,
            ctx,
            stream,
            done,
            comm,
            timeout,
            max_pitch,
            broken: None,
        })
    }

    fn check_buffer(&self, buffer: &DeviceBuffer) -> Result<(), LoaderError> {
        if buffer.ctx.cu_ctx() == self.ctx.cu_ctx() {
            Ok(())
        } else {
            Err(LoaderError::Device {
                device: self.label.clone(),
                detail: format!(
                    "a buffer of cuda:{} given to the NCCL plane of cuda:{}",
                    buffer.ordinal(),
                    self.ordinal
                ),
            })
        }
    }

    /// Makes the device's context current on this thread (the plane thread binds it once, but a
    /// buffer of another device dropped here would have switched it).
    fn bind(&self) -> Result<(), LoaderError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| driver_error("binding the device to the NCCL thread", e))
    }

    fn sync(&self, what: &str) -> Result<(), LoaderError> {
        self.stream.synchronize().map_err(|e| driver_error(what, e))
    }

    /// Aborts the communicator (a peer failed or timed out): pending operations end, and the
    /// plane refuses further work.
    fn abort(&mut self, why: &LoaderError) {
        if self.broken.is_none() {
            // SAFETY: `comm` is this plane's live communicator; abort is the documented way to
            // end it with operations still pending. It is not used again (`broken` is set).
            let _ = unsafe { nccl::comm_abort(self.comm) };
            self.broken = Some(why.to_string());
        }
    }

    /// Enqueues device-to-device copies along `runs` (checked by the caller) on the stream.
    fn enqueue_runs(
        &self,
        runs: &StridedRuns,
        src: sys::CUdeviceptr,
        dst: sys::CUdeviceptr,
    ) -> Result<(), LoaderError> {
        let what = "copying on the device";
        let stream = self.stream.cu_stream();
        if runs.run_bytes == 0 || runs.counts.contains(&0) {
            return Ok(());
        }
        let run = runs.run_bytes as usize;
        let Some(last) = runs.counts.len().checked_sub(1) else {
            // SAFETY: the caller checked both spans against their buffers.
            return unsafe {
                result::memcpy_dtod_async(dst + runs.dst_offset, src + runs.src_offset, run, stream)
            }
            .map_err(|e| driver_error(what, e));
        };
        let (height, src_pitch, dst_pitch) = (
            runs.counts[last],
            runs.src_strides[last],
            runs.dst_strides[last],
        );
        // The innermost dimension as one 2-D copy when the pitches allow it; the outer ones as a
        // loop (an odometer over the remaining counts).
        // The driver may refuse device-to-device 2-D copies whose pitches did not come from
        // cuMemAllocPitch (a parameter error, returned before anything is queued): the rows are
        // then copied one by one.
        let mut two_d = src_pitch >= runs.run_bytes
            && dst_pitch >= runs.run_bytes
            && src_pitch <= self.max_pitch
            && dst_pitch <= self.max_pitch;
        let outer = &runs.counts[..last];
        let mut index = vec![0u64; outer.len()];
        loop {
            let mut s = runs.src_offset;
            let mut d = runs.dst_offset;
            for (k, &i) in index.iter().enumerate() {
                s += i * runs.src_strides[k];
                d += i * runs.dst_strides[k];
            }
            let mut rows = !two_d;
            if two_d {
                let copy = sys::CUDA_MEMCPY2D {
                    srcXInBytes: 0,
                    srcY: 0,
                    srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    srcHost: std::ptr::null(),
                    srcDevice: src + s,
                    srcArray: std::ptr::null_mut(),
                    srcPitch: src_pitch as usize,
                    dstXInBytes: 0,
                    dstY: 0,
                    dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_DEVICE,
                    dstHost: std::ptr::null_mut(),
                    dstDevice: dst + d,
                    dstArray: std::ptr::null_mut(),
                    dstPitch: dst_pitch as usize,
                    WidthInBytes: run,
                    Height: height as usize,
                };
                // SAFETY: a device-to-device 2-D copy inside spans the caller checked; `copy` is
                // read by the driver during the call only.
                match unsafe { sys::cuMemcpy2DAsync_v2(&copy, stream) } {
                    sys::CUresult::CUDA_SUCCESS => {}
                    sys::CUresult::CUDA_ERROR_INVALID_VALUE => {
                        two_d = false;
                        rows = true;
                    }
                    other => return Err(driver_error(what, cudarc::driver::DriverError(other))),
                }
            }
            if rows {
                for h in 0..height {
                    // SAFETY: each run lies inside the spans the caller checked.
                    unsafe {
                        result::memcpy_dtod_async(
                            dst + d + h * dst_pitch,
                            src + s + h * src_pitch,
                            run,
                            stream,
                        )
                    }
                    .map_err(|e| driver_error(what, e))?;
                }
            }
            // Next outer index, last dimension fastest.
            let mut k = outer.len();
            loop {
                if k == 0 {
                    return Ok(());
                }
                k -= 1;
                index[k] += 1;
                if index[k] < outer[k] {
                    break;
                }
                index[k] = 0;
            }
        }
    }
}

impl Drop for NcclPlane {
    fn drop(&mut self) {
        if self.broken.is_none() {
            let _ = self.ctx.bind_to_thread();
            let _ = self.stream.synchronize();
            // SAFETY: the communicator is live and idle (its stream was synchronized); it is
            // destroyed once, here.
            let _ = unsafe { nccl::comm_destroy(self.comm) };
        }
    }
}

impl std::fmt::Debug for NcclPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclPlane")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.label)
            .finish_non_exhaustive()
    }
}

impl DataPlane for NcclPlane {
    type Buffer = DeviceBuffer;

    fn device(&self) -> String {
        self.label.clone()
    }

    fn alloc(&mut self, len: usize) -> Result<DeviceBuffer, LoaderError> {
        DeviceBuffer::alloc(&self.ctx, self.ordinal, len, false)
    }

    fn upload(&mut self, src: &[u8], dst: &DeviceBuffer, offset: u64) -> Result<(), LoaderError> {
        self.check_buffer(dst)?;
        check_span(&self.label, "upload", offset, src.len() as u64, dst.len())?;
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: span checked; `src` outlives the copy (the stream is synchronized below).
        unsafe { result::memcpy_htod_async(dst.ptr + offset, src, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying a message to the device", e))?;
        self.sync("copying a message to the device")
    }

    fn download(
        &mut self,
        src: &DeviceBuffer,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), LoaderError> {
        self.check_buffer(src)?;
        check_span(&self.label, "download", offset, dst.len() as u64, src.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: span checked; `dst` is not touched until the stream is synchronized below.
        unsafe { result::memcpy_dtoh_async(dst, src.ptr + offset, self.stream.cu_stream()) }
            .map_err(|e| driver_error("copying a message to the host", e))?;
        self.sync("copying a message to the host")
    }

    fn copy_runs(
        &mut self,
        runs: &StridedRuns,
        src: &DeviceBuffer,
        dst: &DeviceBuffer,
    ) -> Result<(), LoaderError> {
        self.check_buffer(src)?;
        self.check_buffer(dst)?;
        check_runs(&self.label, "device copy", runs, src.len(), dst.len())?;
        self.bind()?;
        // Stream-ordered before the group operations that follow on the same stream.
        self.enqueue_runs(runs, src.ptr, dst.ptr)
    }

    fn synchronize(&mut self) -> Result<(), LoaderError> {
        self.bind()?;
        self.sync("waiting for device copies")
    }

    fn group(&mut self, ops: &[PlaneOp<'_, DeviceBuffer>]) -> Result<(), LoaderError> {
        let rank = self.rank;
        if let Some(why) = &self.broken {
            return Err(LoaderError::Transport {
                rank,
                peer: rank,
                detail: format!(
                    "the NCCL communicator was aborted after an earlier failure: {why}"
                ),
            });
        }
        for op in ops {
            let (PlaneOp::Send { peer, buffer, len } | PlaneOp::Recv { peer, buffer, len }) = op;
            self.check_buffer(buffer)?;
            check_span(&self.label, "NCCL transfer", 0, *len as u64, buffer.len())?;
            if *peer >= self.world {
                return Err(LoaderError::Transport {
                    rank,
                    peer: *peer,
                    detail: format!("no rank {peer} in a communicator of {}", self.world),
                });
            }
        }
        self.bind()?;
        let stream = self.stream.cu_stream() as nccl_sys::cudaStream_t;
        nccl::group_start().map_err(|e| nccl_error("ncclGroupStart", e))?;
        let mut posted = Ok(());
        for op in ops {
            // `peer` fits in i32: it is below the world size, which does.
            posted = match op {
                // SAFETY: `buffer` holds at least `len` bytes of this device's memory (checked
                // above) and stays allocated until the group completes (it is borrowed for this
                // call, which waits for completion below).
                PlaneOp::Send { peer, buffer, len } => unsafe {
                    nccl::send(
                        buffer.ptr as *const std::ffi::c_void,
                        *len,
                        nccl_sys::ncclDataType_t::ncclUint8,
                        *peer as i32,
                        self.comm,
                        stream,
                    )
                },
                // SAFETY: as for the send; nothing else touches `buffer` until completion.
                PlaneOp::Recv { peer, buffer, len } => unsafe {
                    nccl::recv(
                        buffer.ptr as *mut std::ffi::c_void,
                        *len,
                        nccl_sys::ncclDataType_t::ncclUint8,
                        *peer as i32,
                        self.comm,
                        stream,
                    )
                },
            }
            .map(|_| ())
            .map_err(|e| nccl_error("posting an NCCL send or receive", e));
            if posted.is_err() {
                break;
            }
        }
        // The group must be closed even when posting failed.
        let ended = nccl::group_end().map_err(|e| nccl_error("ncclGroupEnd", e));
        if let Err(e) = posted.and(ended) {
            self.abort(&e);
            return Err(e);
        }
        self.done
            .record(&self.stream)
            .map_err(|e| driver_error("recording the NCCL event", e))?;
        // Wait for completion, watching NCCL's asynchronous errors and the timeout (a peer that
        // never posts its side would otherwise hang this thread forever).
        let started = Instant::now();
        let mut pause = Duration::from_micros(20);
        loop {
            match self.done.try_is_complete() {
                Ok(true) => return Ok(()),
                Ok(false) => {}
                Err(e) => {
                    let e = driver_error("waiting for NCCL transfers", e);
                    self.abort(&e);
                    return Err(e);
                }
            }
            let mut state = nccl_sys::ncclResult_t::ncclSuccess;
            // SAFETY: `comm` is live; NCCL writes one result through the valid pointer.
            let asked = unsafe { nccl_sys::ncclCommGetAsyncError(self.comm, &mut state) };
            if asked != nccl_sys::ncclResult_t::ncclSuccess
                || !matches!(
                    state,
                    nccl_sys::ncclResult_t::ncclSuccess | nccl_sys::ncclResult_t::ncclInProgress
                )
            {
                let peer = ops.first().map_or(rank, |op| match op {
                    PlaneOp::Send { peer, .. } | PlaneOp::Recv { peer, .. } => *peer,
                });
                let e = LoaderError::Transport {
                    rank,
                    peer,
                    detail: format!("NCCL reported {state:?} during a transfer"),
                };
                self.abort(&e);
                return Err(e);
            }
            if started.elapsed() >= self.timeout {
                let (peer, what) = ops.first().map_or((rank, String::new()), |op| match op {
                    PlaneOp::Send { peer, len, .. } => (
                        *peer,
                        format!("the receive matching a {len}-byte NCCL send"),
                    ),
                    PlaneOp::Recv { peer, len, .. } => (
                        *peer,
                        format!("the send matching a {len}-byte NCCL receive"),
                    ),
                });
                let e = LoaderError::PeerTimeout {
                    rank,
                    peer,
                    what,
                    waited: self.timeout,
                };
                self.abort(&e);
                return Err(e);
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }
}

/// Connects rank `config.rank` of `config.world` over NCCL on `device`: a TCP control mesh
/// through `MASTER_ADDR:MASTER_PORT`, rank 0's NCCL unique id sent to every rank over it, the
/// communicator on this rank's plane thread, and the sequencer. Fails with
/// [`LoaderError::Cuda`] when libcuda or libnccl is missing (probed first).
pub async fn connect_nccl(
    config: &RendezvousConfig,
    options: TransportOptions,
    device: &CudaDevice,
) -> Result<NcclTransport, LoaderError> {
    probe::nccl()?;
    let control = TcpTransport::connect(config, options.clone()).await?;
    let (rank, world) = (control.rank(), control.world());
    let id: [u8; 128] = if rank == 0 {
        let unique = probe::guarded("creating the NCCL unique id", nccl::get_uniqueid)?
            .map_err(|e| nccl_error("creating the NCCL unique id", e))?;
        let id = unique.internal.map(|c| c as u8);
        for peer in 1..world {
            control
                .send(peer, TAG_UNIQUE_ID, bytes::Bytes::copy_from_slice(&id))
                .await?;
        }
        id
    } else {
        let got = tokio::time::timeout(options.connect_timeout, control.recv(0, TAG_UNIQUE_ID))
            .await
            .map_err(|_| LoaderError::Rendezvous {
                detail: format!(
                    "rank {rank}: rank 0 did not send the NCCL unique id within {:?}",
                    options.connect_timeout
                ),
            })??;
        <[u8; 128]>::try_from(got.as_ref()).map_err(|_| LoaderError::Rendezvous {
            detail: format!(
                "rank {rank}: rank 0 sent a {}-byte NCCL unique id (128 expected)",
                got.len()
            ),
        })?
    };
    let device = device.clone();
    let timeout = options.timeout;
    let name = format!("tessera-nccl-{rank}");
    // ncclCommInitRank waits for every rank: off the async workers, bounded in time.
    let spawn = tokio::task::spawn_blocking(move || {
        PlaneThread::spawn(&name, move || {
            NcclPlane::new(&device, rank, world, id, timeout)
        })
    });
    let plane = match tokio::time::timeout(options.connect_timeout, spawn).await {
        Ok(Ok(plane)) => plane?,
        Ok(Err(e)) => {
            return Err(LoaderError::Cuda {
                detail: format!("creating the NCCL communicator: {e}"),
            });
        }
        Err(_) => {
            return Err(LoaderError::Rendezvous {
                detail: format!(
                    "rank {rank}: the NCCL communicator of {world} ranks was not up within {:?}",
                    options.connect_timeout
                ),
            });
        }
    };
    Ok(SequencedTransport::new(control, plane, options))
}
