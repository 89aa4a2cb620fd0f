//! A data plane: the device-side half of a transport that moves bytes between the device memory
//! of ranks with NCCL's semantics, and the thread that owns it.
//!
//! NCCL point-to-point is a rendezvous, not a mailbox: a send completes only once the peer has
//! posted the matching receive, the operations of one communicator run one after another, and
//! sends and receives between two ranks match in the order they were posted. A [`DataPlane`]
//! states exactly that contract, so the protocols built on it (the sequenced transport in
//! [`crate::transport::SequencedTransport`], the grouped ring in [`ring`]) can be tested on CPU
//! with an emulated plane that has the same blocking behaviour (`testing::EmulatedPlane`), and
//! run on GPUs with the NCCL plane (`cuda::NcclPlane`, feature `cuda`).
//!
//! cudarc's NCCL communicator is `!Send`, so each rank's plane lives on its own OS thread
//! ([`PlaneThread`]) and everything else talks to it through a channel of jobs.

pub mod ring;

use std::sync::mpsc;

use tessera_planner::StridedRuns;

use crate::LoaderError;
use crate::device::DeviceMemory;

/// One point-to-point operation of a [`DataPlane::group`].
#[derive(Debug)]
pub enum PlaneOp<'a, B> {
    /// Send the first `len` bytes of `buffer` to rank `peer`.
    Send {
        /// Receiving rank.
        peer: u32,
        /// Device memory holding the bytes.
        buffer: &'a B,
        /// Bytes to send.
        len: usize,
    },
    /// Receive `len` bytes from rank `peer` into the start of `buffer`.
    Recv {
        /// Sending rank.
        peer: u32,
        /// Device memory the bytes land in.
        buffer: &'a B,
        /// Bytes to receive (must equal what the peer sends).
        len: usize,
    },
}

/// Device memory and NCCL-style point-to-point between ranks (see the module docs). Methods run
/// on the plane's own thread, one at a time, and block until done.
pub trait DataPlane: 'static {
    /// Device memory of this plane.
    type Buffer: DeviceMemory;

    /// The device, for messages (`cuda:0`).
    fn device(&self) -> String;

    /// Allocates `len` bytes of device memory (contents unspecified).
    fn alloc(&mut self, len: usize) -> Result<Self::Buffer, LoaderError>;

    /// Copies host bytes into `dst` at `offset`.
    fn upload(&mut self, src: &[u8], dst: &Self::Buffer, offset: u64) -> Result<(), LoaderError>;

    /// Copies `dst.len()` bytes of `src` from `offset` to the host.
    fn download(
        &mut self,
        src: &Self::Buffer,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), LoaderError>;

    /// Copies along `runs` (byte offsets relative to each buffer's start) from `src` to `dst`,
    /// on the device. `src` and `dst` are different buffers. May return before the copy is done:
    /// it is ordered before the plane's later operations, and [`DataPlane::synchronize`] waits
    /// for it.
    fn copy_runs(
        &mut self,
        runs: &StridedRuns,
        src: &Self::Buffer,
        dst: &Self::Buffer,
    ) -> Result<(), LoaderError>;

    /// Posts every operation at once (an NCCL group) and waits until all have completed: each
    /// send matched by its peer's receive of the same length, in posting order per pair of ranks.
    /// Fails with [`LoaderError::PeerTimeout`] when a peer does not post its side within the
    /// plane's timeout, and with [`LoaderError::Transport`] when a peer is known to be gone;
    /// after such a failure the plane may refuse further work.
    fn group(&mut self, ops: &[PlaneOp<'_, Self::Buffer>]) -> Result<(), LoaderError>;

    /// Waits until every operation issued so far is done (device memory written by this plane
    /// may then be read elsewhere, e.g. copied back on another stream).
    fn synchronize(&mut self) -> Result<(), LoaderError>;
}

type Job<P> = Box<dyn FnOnce(&mut P) + Send>;

/// The OS thread that owns one rank's [`DataPlane`] and runs jobs on it in submission order.
pub struct PlaneThread<P: DataPlane> {
    device: String,
    jobs: Option<mpsc::Sender<Job<P>>>,
}

impl<P: DataPlane> PlaneThread<P> {
    /// Starts the thread and builds the plane on it with `make` (a plane that is `!Send` is
    /// created where it lives). Returns once `make` has succeeded, or with its error.
    pub fn spawn<F>(name: &str, make: F) -> Result<Self, LoaderError>
    where
        F: FnOnce() -> Result<P, LoaderError> + Send + 'static,
    {
        let (jobs, queue) = mpsc::channel::<Job<P>>();
        let (ready_tx, ready_rx) = mpsc::sync_channel::<Result<String, LoaderError>>(1);
        let spawned = std::thread::Builder::new()
            .name(name.to_string())
            .spawn(move || {
                let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(make))
                    .unwrap_or_else(|panic| {
                        Err(LoaderError::Device {
                            device: "data plane".to_string(),
                            detail: format!(
                                "creating the data plane panicked: {}",
                                panic_text(&*panic)
                            ),
                        })
                    });
                let mut plane = match made {
                    Ok(plane) => {
                        let _ = ready_tx.send(Ok(plane.device()));
                        plane
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                // Until every handle is dropped. A job that panics is reported to its waiter
                // (its reply channel closes) and the plane is not used again.
                while let Ok(job) = queue.recv() {
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&mut plane)))
                        .is_err()
                    {
                        return;
                    }
                }
            })
            .map_err(|e| LoaderError::Device {
                device: "data plane".to_string(),
                detail: format!("starting the data plane thread: {e}"),
            })?;
        drop(spawned);
        let device = match ready_rx.recv() {
            Ok(result) => result?,
            Err(_) => {
                return Err(LoaderError::Device {
                    device: "data plane".to_string(),
                    detail: "the data plane thread ended before the plane was created".to_string(),
                });
            }
        };
        Ok(Self {
            device,
            jobs: Some(jobs),
        })
    }

    /// The plane's device.
    pub fn device(&self) -> &str {
        &self.device
    }

    fn gone(&self) -> LoaderError {
        LoaderError::Device {
            device: self.device.clone(),
            detail: "the data plane thread is gone (an earlier job panicked or it shut down)"
                .to_string(),
        }
    }

    /// Queues `job`; it runs after every job submitted before it.
    pub fn submit(&self, job: impl FnOnce(&mut P) + Send + 'static) -> Result<(), LoaderError> {
        match &self.jobs {
            Some(jobs) => jobs.send(Box::new(job)).map_err(|_| self.gone()),
            None => Err(self.gone()),
        }
    }

    /// Runs `job` on the plane and returns its result.
    pub async fn run<R: Send + 'static>(
        &self,
        job: impl FnOnce(&mut P) -> R + Send + 'static,
    ) -> Result<R, LoaderError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(move |plane| {
            let _ = tx.send(job(plane));
        })?;
        rx.await.map_err(|_| self.gone())
    }

    /// [`PlaneThread::run`] for callers outside async code.
    pub fn run_blocking<R: Send + 'static>(
        &self,
        job: impl FnOnce(&mut P) -> R + Send + 'static,
    ) -> Result<R, LoaderError> {
        let (tx, rx) = mpsc::sync_channel(1);
        self.submit(move |plane| {
            let _ = tx.send(job(plane));
        })?;
        rx.recv().map_err(|_| self.gone())
    }
}

impl<P: DataPlane> Drop for PlaneThread<P> {
    fn drop(&mut self) {
        // Closing the queue ends the thread after its current job; it is not joined, since a job
        // may be waiting for a peer until the plane's timeout.
        self.jobs.take();
    }
}

impl<P: DataPlane> std::fmt::Debug for PlaneThread<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PlaneThread")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// The message of a caught panic.
pub(crate) fn panic_text(panic: &(dyn std::any::Any + Send)) -> String {
    if let Some(text) = panic.downcast_ref::<&str>() {
        (*text).to_string()
    } else if let Some(text) = panic.downcast_ref::<String>() {
        text.clone()
    } else {
        "unknown panic".to_string()
    }
}

/// Checks that `runs` is well formed and stays inside a `src_len`-byte source and a
/// `dst_len`-byte destination, with checked arithmetic (plans come over the network, and a
/// device copy past a buffer's end corrupts memory no bounds check would catch later).
pub(crate) fn check_runs(
    device: &str,
    what: &str,
    runs: &StridedRuns,
    src_len: usize,
    dst_len: usize,
) -> Result<(), LoaderError> {
    let bad = |detail: String| LoaderError::Device {
        device: device.to_string(),
        detail: format!("{what}: {detail}"),
    };
    if runs.counts.len() != runs.src_strides.len() || runs.counts.len() != runs.dst_strides.len() {
        return Err(bad("byte runs with mismatched dimensions".to_string()));
    }
    let end = |offset: u64, strides: &[u64]| -> Option<u64> {
        if runs.run_bytes == 0 || runs.counts.contains(&0) {
            return Some(offset);
        }
        let mut last = offset;
        for (&count, &stride) in runs.counts.iter().zip(strides) {
            last = last.checked_add((count - 1).checked_mul(stride)?)?;
        }
        last.checked_add(runs.run_bytes)
    };
    match (
        end(runs.src_offset, &runs.src_strides),
        end(runs.dst_offset, &runs.dst_strides),
    ) {
        (Some(src_end), Some(dst_end))
            if src_end <= src_len as u64 && dst_end <= dst_len as u64 =>
        {
            Ok(())
        }
        (src_end, dst_end) => Err(bad(format!(
            "byte runs reach byte {} of a {src_len}-byte source and byte {} of a {dst_len}-byte destination",
            src_end.map_or("(overflow)".to_string(), |e| e.to_string()),
            dst_end.map_or("(overflow)".to_string(), |e| e.to_string()),
        ))),
    }
}
