//! Host-to-device upload through a bounded pool of pinned staging buffers.
//!
//! A device copies from pinned (page-locked) host memory asynchronously and at full link speed;
//! from ordinary (pageable) memory it copies slowly and synchronously. The loader's host buffers
//! are pageable, so the bytes go through a few pinned buffers, a chunk at a time:
//!
//! ```text
//! lane 0:  fill A0 | fill B0 | fill A0 (waits for A0's copy) | ...
//! lane 1:  fill A1 | fill B1 | ...
//! copy:         A0 → dev | A1 → dev | B0 → dev | B1 → dev | ...   (one dedicated stream)
//! ```
//!
//! Each lane is a thread with `buffers` pinned buffers (two: ping-pong) used round-robin: it fills
//! one with the next chunk while the copy engine moves the previous one, and waits for a buffer's
//! copy to finish (its event) before filling it again. Several lanes fill in parallel because one
//! CPU core's memcpy (about 10 GB/s) is slower than a PCIe 5 link (about 50 GB/s). Pinned memory
//! is bounded by `lanes × buffers × chunk_bytes` (64 MiB by default), allocated once per pool and
//! reused by every upload.
//!
//! The pool is generic over a [`CopyEngine`]: the CUDA one (`cuda::CudaCopyEngine`, feature
//! `cuda`) and a host emulation for the CPU tests (`testing::HostCopyEngine`). An engine never
//! hands out a buffer whose copy may still be running, so the pool needs no unsafe code.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use crate::LoaderError;
use crate::device::{DeviceMemory, check_span};

/// A device's host-to-device copy engine with pinned staging buffers ("slots").
pub trait CopyEngine: Sync {
    /// A pinned host buffer and what tells when its last copy is done.
    type Slot: Send;
    /// Device memory the engine copies into.
    type Target: DeviceMemory;

    /// The device, for messages (`cuda:0`).
    fn device(&self) -> String;

    /// Allocates a pinned buffer of `bytes`.
    fn alloc_slot(&self, bytes: usize) -> Result<Self::Slot, LoaderError>;

    /// Called once on each lane thread before it uses the engine (CUDA binds its context).
    fn begin_lane(&self) -> Result<(), LoaderError> {
        Ok(())
    }

    /// Waits until the slot's last copy is done, then lets `fill` write the whole buffer.
    fn fill<R>(
        &self,
        slot: &mut Self::Slot,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, LoaderError>;

    /// Starts copying the slot's first `len` bytes to `target` at `offset`; returns without
    /// waiting. The span is checked against the target.
    fn upload(
        &self,
        slot: &mut Self::Slot,
        len: usize,
        target: &Self::Target,
        offset: u64,
    ) -> Result<(), LoaderError>;

    /// Waits until every copy started so far is done.
    fn synchronize(&self) -> Result<(), LoaderError>;
}

/// Shape of a [`StagingPool`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagingOptions {
    /// Bytes of one pinned buffer (one copy). A few MiB: large enough that the copy engine's
    /// per-copy cost (a few microseconds) is noise, small enough that filling and copying overlap
    /// well and pinned memory stays small.
    pub chunk_bytes: usize,
    /// Pinned buffers per lane (2: ping-pong).
    pub buffers: usize,
    /// Threads filling buffers in parallel.
    pub lanes: usize,
}

impl Default for StagingOptions {
    /// 8 MiB chunks, ping-pong, and one lane per two cores up to 4: 64 MiB of pinned memory at
    /// most, and about 4 × 10 GB/s of memcpy to keep a PCIe 5 link busy.
    fn default() -> Self {
        let cores = std::thread::available_parallelism().map_or(1, usize::from);
        Self {
            chunk_bytes: 8 << 20,
            buffers: 2,
            lanes: (cores / 2).clamp(1, 4),
        }
    }
}

impl StagingOptions {
    /// The pinned memory a pool with these options holds.
    pub fn pinned_bytes(&self) -> usize {
        self.lanes
            .saturating_mul(self.buffers)
            .saturating_mul(self.chunk_bytes)
    }
}

/// What an upload moved, and how fast.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct UploadStats {
    /// Bytes copied to the device.
    pub bytes: u64,
    /// Copies (chunks).
    pub chunks: u64,
    /// Wall time from the first fill to the last copy's completion.
    pub seconds: f64,
}

impl UploadStats {
    /// Host-to-device throughput in GB/s (10^9 bytes per second).
    pub fn gb_per_s(&self) -> f64 {
        if self.seconds > 0.0 {
            self.bytes as f64 / self.seconds / 1e9
        } else {
            0.0
        }
    }
}

/// One host-to-device copy asked of [`StagingPool::upload`].
#[derive(Debug)]
pub struct Upload<'a, T> {
    /// Host bytes (pageable memory is fine: they are staged).
    pub source: &'a [u8],
    /// Where they go.
    pub target: &'a T,
    /// Byte offset in `target`.
    pub offset: u64,
}

/// A bounded set of pinned staging buffers over a copy engine (see the module docs).
pub struct StagingPool<E: CopyEngine> {
    engine: E,
    options: StagingOptions,
    /// Per lane, its buffers.
    lanes: Vec<Vec<E::Slot>>,
}

/// A chunk of an upload: copy `index`, bytes `start..end` of its source.
#[derive(Clone, Copy, Debug)]
struct Chunk {
    index: usize,
    start: usize,
    end: usize,
}

impl<E: CopyEngine> StagingPool<E> {
    /// Allocates the pool's pinned buffers (all of them, now: an upload never allocates).
    pub fn new(engine: E, options: StagingOptions) -> Result<Self, LoaderError> {
        let device = engine.device();
        let invalid = |detail: String| LoaderError::Device {
            device: device.clone(),
            detail,
        };
        if options.chunk_bytes == 0 || options.buffers == 0 || options.lanes == 0 {
            return Err(invalid(format!(
                "staging needs at least one lane of one non-empty buffer, got {options:?}"
            )));
        }
        let lanes = (0..options.lanes)
            .map(|_| {
                (0..options.buffers)
                    .map(|_| engine.alloc_slot(options.chunk_bytes))
                    .collect::<Result<Vec<_>, _>>()
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            engine,
            options,
            lanes,
        })
    }

    /// The copy engine.
    pub fn engine(&self) -> &E {
        &self.engine
    }

    /// The pool's shape.
    pub fn options(&self) -> &StagingOptions {
        &self.options
    }

    /// Pinned memory held by the pool.
    pub fn pinned_bytes(&self) -> usize {
        self.options.pinned_bytes()
    }

    /// Copies every `uploads[i].source` to its target and offset, staged through the pinned
    /// buffers, and waits until all of it is on the device. Blocks the calling thread (it runs
    /// the lanes as scoped threads); from async code, call it where blocking is allowed.
    pub fn upload(
        &mut self,
        uploads: &[Upload<'_, E::Target>],
    ) -> Result<UploadStats, LoaderError> {
        let device = self.engine.device();
        for (i, upload) in uploads.iter().enumerate() {
            check_span(
                &device,
                &format!("upload {i}"),
                upload.offset,
                upload.source.len() as u64,
                upload.target.len(),
            )?;
        }
        let chunk_bytes = self.options.chunk_bytes;
        let chunks: Vec<Chunk> = uploads
            .iter()
            .enumerate()
            .flat_map(|(index, upload)| {
                (0..upload.source.len())
                    .step_by(chunk_bytes)
                    .map(move |start| Chunk {
                        index,
                        start,
                        end: (start + chunk_bytes).min(upload.source.len()),
                    })
            })
            .collect();
        let started = Instant::now();
        let lanes = self.lanes.len().min(chunks.len()).max(1);
        let stop = AtomicBool::new(false);
        let first_error: Mutex<Option<LoaderError>> = Mutex::new(None);
        let engine = &self.engine;
        let run_lane = |lane: usize, slots: &mut Vec<E::Slot>| {
            let result = (|| {
                engine.begin_lane()?;
                for (k, chunk) in chunks.iter().skip(lane).step_by(lanes).enumerate() {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let count = slots.len();
                    let slot = &mut slots[k % count];
                    let upload = &uploads[chunk.index];
                    let source = &upload.source[chunk.start..chunk.end];
                    engine.fill(slot, |buffer| {
                        buffer[..source.len()].copy_from_slice(source)
                    })?;
                    engine.upload(
                        slot,
                        source.len(),
                        upload.target,
                        upload.offset + chunk.start as u64,
                    )?;
                }
                Ok::<(), LoaderError>(())
            })();
            if let Err(e) = result {
                stop.store(true, Ordering::Relaxed);
                first_error
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .get_or_insert(e);
            }
        };
        if lanes == 1 {
            if let Some(slots) = self.lanes.first_mut() {
                run_lane(0, slots);
            }
        } else {
            std::thread::scope(|scope| {
                for (lane, slots) in self.lanes.iter_mut().take(lanes).enumerate() {
                    let run_lane = &run_lane;
                    std::thread::Builder::new()
                        .name(format!("tessera-stage-{lane}"))
                        .spawn_scoped(scope, move || run_lane(lane, slots))
                        .map_err(|e| LoaderError::Device {
                            device: device.clone(),
                            detail: format!("starting staging lane {lane}: {e}"),
                        })?;
                }
                Ok::<(), LoaderError>(())
            })?;
        }
        // Even after a failure: no copy may still read a buffer once this returns.
        let synced = self.engine.synchronize();
        if let Some(e) = first_error
            .into_inner()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            return Err(e);
        }
        synced?;
        Ok(UploadStats {
            bytes: uploads.iter().map(|u| u.source.len() as u64).sum(),
            chunks: chunks.len() as u64,
            seconds: started.elapsed().as_secs_f64(),
        })
    }
}

impl<E: CopyEngine + std::fmt::Debug> std::fmt::Debug for StagingPool<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StagingPool")
            .field("engine", &self.engine)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}
