//! Host emulations of the device side, so the GPU pipeline's logic runs in CPU tests:
//! [`HostMemory`] stands in for device memory, [`HostCopyEngine`] for a CUDA copy stream with
//! pinned staging buffers (copies run later, on another thread, like DMA), and [`EmulatedPlane`]
//! for an NCCL communicator, with NCCL's blocking semantics: a send completes only once the peer
//! posted the matching receive, operations between two ranks match in posting order, a length
//! mismatch fails both sides, and a rank waits for a peer that never comes until its timeout.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tessera_planner::StridedRuns;

use crate::LoaderError;
use crate::device::staging::CopyEngine;
use crate::device::{DeviceMemory, check_span};
use crate::exchange::place::copy_runs;
use crate::transport::plane::{DataPlane, PlaneOp, check_runs};

const DEVICE: &str = "emulated";

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Host memory standing in for a device buffer (shared: clones are the same buffer).
#[derive(Clone, Debug, Default)]
pub struct HostMemory(Arc<Mutex<Vec<u8>>>);

impl HostMemory {
    /// A zero-filled buffer of `len` bytes.
    pub fn zeroed(len: usize) -> Self {
        Self::from_vec(vec![0; len])
    }

    /// A buffer holding `bytes`.
    pub fn from_vec(bytes: Vec<u8>) -> Self {
        Self(Arc::new(Mutex::new(bytes)))
    }

    /// A copy of the bytes ("copy back to the host").
    pub fn to_vec(&self) -> Vec<u8> {
        lock(&self.0).clone()
    }
}

impl DeviceMemory for HostMemory {
    fn len(&self) -> usize {
        lock(&self.0).len()
    }
}

/// What a [`HostCopyEngine`] saw, for tests of the staging pool.
#[derive(Debug, Default)]
pub struct HostEngineStats {
    /// Pinned buffers allocated.
    pub slots: AtomicUsize,
    /// Pinned bytes allocated.
    pub slot_bytes: AtomicU64,
    /// Copies started.
    pub uploads: AtomicU64,
    /// Buffers filled.
    pub fills: AtomicU64,
    /// Fills that started while some copy was still running (filling overlapped copying).
    pub fills_during_copy: AtomicU64,
    /// Most copies in flight at once.
    pub max_in_flight: AtomicUsize,
}

struct SlotEvent {
    pending: Mutex<bool>,
    done: Condvar,
}

struct EngineShared {
    in_flight: Mutex<usize>,
    idle: Condvar,
    stats: HostEngineStats,
}

struct CopyJob {
    buffer: Arc<Mutex<Vec<u8>>>,
    len: usize,
    target: HostMemory,
    offset: usize,
    event: Arc<SlotEvent>,
}

/// A pinned buffer of a [`HostCopyEngine`].
pub struct HostSlot {
    buffer: Arc<Mutex<Vec<u8>>>,
    event: Arc<SlotEvent>,
}

/// A copy engine on the host: copies run on their own thread, after `delay` each, in the order
/// they were started (one stream), so filling and copying overlap as they do on a GPU.
pub struct HostCopyEngine {
    shared: Arc<EngineShared>,
    jobs: Option<mpsc::Sender<CopyJob>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl HostCopyEngine {
    /// An engine whose copies each take at least `delay`.
    pub fn new(delay: Duration) -> Self {
        let shared = Arc::new(EngineShared {
            in_flight: Mutex::new(0),
            idle: Condvar::new(),
            stats: HostEngineStats::default(),
        });
        let (jobs, queue) = mpsc::channel::<CopyJob>();
        let worker = Arc::clone(&shared);
        let thread = std::thread::spawn(move || {
            while let Ok(job) = queue.recv() {
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                {
                    let source = lock(&job.buffer);
                    let mut target = lock(&job.target.0);
                    target[job.offset..job.offset + job.len].copy_from_slice(&source[..job.len]);
                }
                // Count the copy done before its buffer is released, as the stream would.
                *lock(&worker.in_flight) -= 1;
                worker.idle.notify_all();
                *lock(&job.event.pending) = false;
                job.event.done.notify_all();
            }
        });
        Self {
            shared,
            jobs: Some(jobs),
            thread: Some(thread),
        }
    }

    /// What the engine saw so far.
    pub fn stats(&self) -> &HostEngineStats {
        &self.shared.stats
    }
}

impl Drop for HostCopyEngine {
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl std::fmt::Debug for HostCopyEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostCopyEngine").finish_non_exhaustive()
    }
}

impl CopyEngine for HostCopyEngine {
    type Slot = HostSlot;
    type Target = HostMemory;

    fn device(&self) -> String {
        DEVICE.to_string()
    }

    fn alloc_slot(&self, bytes: usize) -> Result<HostSlot, LoaderError> {
        self.shared.stats.slots.fetch_add(1, Ordering::Relaxed);
        self.shared
            .stats
            .slot_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        Ok(HostSlot {
            buffer: Arc::new(Mutex::new(vec![0; bytes])),
            event: Arc::new(SlotEvent {
                pending: Mutex::new(false),
                done: Condvar::new(),
            }),
        })
    }

    fn fill<R>(
        &self,
        slot: &mut HostSlot,
        fill: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, LoaderError> {
        let mut pending = lock(&slot.event.pending);
        while *pending {
            pending = slot
                .event
                .done
                .wait(pending)
                .unwrap_or_else(PoisonError::into_inner);
        }
        drop(pending);
        let stats = &self.shared.stats;
        stats.fills.fetch_add(1, Ordering::Relaxed);
        if *lock(&self.shared.in_flight) > 0 {
            stats.fills_during_copy.fetch_add(1, Ordering::Relaxed);
        }
        Ok(fill(&mut lock(&slot.buffer)))
    }

    fn upload(
        &self,
        slot: &mut HostSlot,
        len: usize,
        target: &HostMemory,
        offset: u64,
    ) -> Result<(), LoaderError> {
        check_span(DEVICE, "upload", offset, len as u64, target.len())?;
        if len > lock(&slot.buffer).len() {
            return Err(LoaderError::Device {
                device: DEVICE.to_string(),
                detail: format!("upload of {len} bytes from a smaller staging buffer"),
            });
        }
        *lock(&slot.event.pending) = true;
        {
            let mut in_flight = lock(&self.shared.in_flight);
            *in_flight += 1;
            self.shared
                .stats
                .max_in_flight
                .fetch_max(*in_flight, Ordering::Relaxed);
        }
        self.shared.stats.uploads.fetch_add(1, Ordering::Relaxed);
        let job = CopyJob {
            buffer: Arc::clone(&slot.buffer),
            len,
            target: target.clone(),
            offset: offset as usize,
            event: Arc::clone(&slot.event),
        };
        match &self.jobs {
            Some(jobs) if jobs.send(job).is_ok() => Ok(()),
            _ => Err(LoaderError::Device {
                device: DEVICE.to_string(),
                detail: "the copy thread is gone".to_string(),
            }),
        }
    }

    fn synchronize(&self) -> Result<(), LoaderError> {
        let mut in_flight = lock(&self.shared.in_flight);
        while *in_flight > 0 {
            in_flight = self
                .shared
                .idle
                .wait(in_flight)
                .unwrap_or_else(PoisonError::into_inner);
        }
        Ok(())
    }
}

/// How a posted operation ended.
enum Outcome {
    Sent,
    Received(Vec<u8>),
    Failed(String),
}

/// Posted operations between one (from, to) pair, oldest first: op id and bytes (sends) or
/// length (receives).
type Queue<T> = HashMap<(u32, u32), VecDeque<(u64, T)>>;

#[derive(Default)]
struct BoardState {
    alive: Vec<bool>,
    next_id: u64,
    /// Posted, unmatched sends per (from, to): op id and bytes.
    sends: Queue<Vec<u8>>,
    /// Posted, unmatched receives per (from, to): op id and length.
    recvs: Queue<usize>,
    done: HashMap<u64, Outcome>,
}

struct Board {
    state: Mutex<BoardState>,
    changed: Condvar,
    /// Groups run, for tests.
    groups: AtomicU64,
}

impl BoardState {
    /// Matches what can be matched between `from` and `to`.
    fn settle(&mut self, from: u32, to: u32) {
        let key = (from, to);
        loop {
            let both = self.sends.get(&key).is_some_and(|q| !q.is_empty())
                && self.recvs.get(&key).is_some_and(|q| !q.is_empty());
            if !both {
                return;
            }
            let (Some((send_id, data)), Some((recv_id, len))) = (
                self.sends.get_mut(&key).and_then(VecDeque::pop_front),
                self.recvs.get_mut(&key).and_then(VecDeque::pop_front),
            ) else {
                return;
            };
            if data.len() == len {
                self.done.insert(send_id, Outcome::Sent);
                self.done.insert(recv_id, Outcome::Received(data));
            } else {
                let why = format!(
                    "rank {from} sent {} bytes to rank {to}, which posted a receive of {len}",
                    data.len()
                );
                self.done.insert(send_id, Outcome::Failed(why.clone()));
                self.done.insert(recv_id, Outcome::Failed(why));
            }
        }
    }
}

/// One rank's end of an emulated NCCL communicator (see the module docs). Dropping it counts as
/// the rank dying: peers waiting for it fail at once.
pub struct EmulatedPlane {
    rank: u32,
    world: u32,
    timeout: Duration,
    board: Arc<Board>,
    broken: Option<String>,
}

impl EmulatedPlane {
    /// A communicator of `world` ranks; element `i` is rank `i`. An operation waits at most
    /// `timeout` for its peer.
    pub fn mesh(world: u32, timeout: Duration) -> Vec<EmulatedPlane> {
        let board = Arc::new(Board {
            state: Mutex::new(BoardState {
                alive: vec![true; world as usize],
                ..BoardState::default()
            }),
            changed: Condvar::new(),
            groups: AtomicU64::new(0),
        });
        (0..world)
            .map(|rank| EmulatedPlane {
                rank,
                world,
                timeout,
                board: Arc::clone(&board),
                broken: None,
            })
            .collect()
    }

    /// This rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Groups run by all ranks of the communicator so far.
    pub fn groups_run(&self) -> u64 {
        self.board.groups.load(Ordering::Relaxed)
    }

    fn fail(&mut self, error: LoaderError) -> LoaderError {
        self.broken = Some(error.to_string());
        error
    }
}

impl Drop for EmulatedPlane {
    fn drop(&mut self) {
        let mut state = lock(&self.board.state);
        if let Some(alive) = state.alive.get_mut(self.rank as usize) {
            *alive = false;
        }
        drop(state);
        self.board.changed.notify_all();
    }
}

impl std::fmt::Debug for EmulatedPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedPlane")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl DataPlane for EmulatedPlane {
    type Buffer = HostMemory;

    fn device(&self) -> String {
        format!("{DEVICE} rank {}", self.rank)
    }

    fn alloc(&mut self, len: usize) -> Result<HostMemory, LoaderError> {
        Ok(HostMemory::zeroed(len))
    }

    fn upload(&mut self, src: &[u8], dst: &HostMemory, offset: u64) -> Result<(), LoaderError> {
        check_span(
            &self.device(),
            "upload",
            offset,
            src.len() as u64,
            dst.len(),
        )?;
        let at = offset as usize;
        lock(&dst.0)[at..at + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn download(
        &mut self,
        src: &HostMemory,
        offset: u64,
        dst: &mut [u8],
    ) -> Result<(), LoaderError> {
        check_span(
            &self.device(),
            "download",
            offset,
            dst.len() as u64,
            src.len(),
        )?;
        let at = offset as usize;
        dst.copy_from_slice(&lock(&src.0)[at..at + dst.len()]);
        Ok(())
    }

    fn copy_runs(
        &mut self,
        runs: &StridedRuns,
        src: &HostMemory,
        dst: &HostMemory,
    ) -> Result<(), LoaderError> {
        let source = src.to_vec();
        let mut target = lock(&dst.0);
        check_runs(&self.device(), "copy", runs, source.len(), target.len())?;
        copy_runs(runs, &source, &mut target);
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), LoaderError> {
        // Host copies are done when they return.
        Ok(())
    }

    fn group(&mut self, ops: &[PlaneOp<'_, HostMemory>]) -> Result<(), LoaderError> {
        let rank = self.rank;
        if let Some(why) = &self.broken {
            return Err(LoaderError::Transport {
                rank,
                peer: rank,
                detail: format!("the communicator was aborted after an earlier failure: {why}"),
            });
        }
        self.board.groups.fetch_add(1, Ordering::Relaxed);
        // Post everything, then match.
        let mut mine: Vec<(u64, u32, bool, usize)> = Vec::with_capacity(ops.len());
        {
            let mut state = lock(&self.board.state);
            let mut touched = HashSet::new();
            for op in ops {
                let (peer, buffer, len, is_send) = match op {
                    PlaneOp::Send { peer, buffer, len } => (*peer, *buffer, *len, true),
                    PlaneOp::Recv { peer, buffer, len } => (*peer, *buffer, *len, false),
                };
                if peer >= self.world {
                    return Err(LoaderError::Transport {
                        rank,
                        peer,
                        detail: format!("no rank {peer} in a communicator of {}", self.world),
                    });
                }
                if len > buffer.len() {
                    return Err(LoaderError::Device {
                        device: self.device(),
                        detail: format!(
                            "a {len}-byte transfer with rank {peer} on a {}-byte buffer",
                            buffer.len()
                        ),
                    });
                }
                let id = state.next_id;
                state.next_id += 1;
                if is_send {
                    let data = lock(&buffer.0)[..len].to_vec();
                    state
                        .sends
                        .entry((rank, peer))
                        .or_default()
                        .push_back((id, data));
                    touched.insert((rank, peer));
                } else {
                    state
                        .recvs
                        .entry((peer, rank))
                        .or_default()
                        .push_back((id, len));
                    touched.insert((peer, rank));
                }
                mine.push((id, peer, is_send, len));
            }
            for (from, to) in touched {
                state.settle(from, to);
            }
        }
        self.board.changed.notify_all();

        // Wait for every operation of the group (a send waits for its receive).
        let deadline = Instant::now() + self.timeout;
        let mut state = lock(&self.board.state);
        let failure = loop {
            let pending: Vec<&(u64, u32, bool, usize)> = mine
                .iter()
                .filter(|(id, ..)| !state.done.contains_key(id))
                .collect();
            if let Some((_, peer, is_send, len)) = pending.first() {
                if let Some(dead) = pending.iter().find(|(_, peer, ..)| {
                    !state.alive.get(*peer as usize).copied().unwrap_or(false)
                }) {
                    break Some(LoaderError::Transport {
                        rank,
                        peer: dead.1,
                        detail: format!(
                            "rank {} is gone (its data plane was dropped) with a {}-byte {} pending",
                            dead.1,
                            dead.3,
                            if dead.2 {
                                "send to it"
                            } else {
                                "receive from it"
                            }
                        ),
                    });
                }
                let now = Instant::now();
                if now >= deadline {
                    break Some(LoaderError::PeerTimeout {
                        rank,
                        peer: *peer,
                        what: format!(
                            "the matching {} of a {len}-byte {}",
                            if *is_send { "receive" } else { "send" },
                            if *is_send { "send" } else { "receive" }
                        ),
                        waited: self.timeout,
                    });
                }
                state = self
                    .board
                    .changed
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(PoisonError::into_inner)
                    .0;
                continue;
            }
            break None;
        };
        if let Some(error) = failure {
            // Like ncclCommAbort: withdraw what is still posted; this plane is done.
            let ids: HashSet<u64> = mine.iter().map(|(id, ..)| *id).collect();
            for queue in state.sends.values_mut() {
                queue.retain(|(id, _)| !ids.contains(id));
            }
            for queue in state.recvs.values_mut() {
                queue.retain(|(id, _)| !ids.contains(id));
            }
            for id in &ids {
                state.done.remove(id);
            }
            drop(state);
            return Err(self.fail(error));
        }
        let mut outcomes = Vec::with_capacity(mine.len());
        for (id, peer, ..) in &mine {
            outcomes.push((*peer, state.done.remove(id)));
        }
        drop(state);
        let mut failed = None;
        for ((peer, outcome), op) in outcomes.into_iter().zip(ops) {
            match (outcome, op) {
                (Some(Outcome::Received(data)), PlaneOp::Recv { buffer, .. }) => {
                    lock(&buffer.0)[..data.len()].copy_from_slice(&data);
                }
                (Some(Outcome::Sent), PlaneOp::Send { .. }) => {}
                (Some(Outcome::Failed(why)), _) => {
                    failed.get_or_insert(LoaderError::Transport {
                        rank,
                        peer,
                        detail: why,
                    });
                }
                _ => {
                    failed.get_or_insert(LoaderError::Transport {
                        rank,
                        peer,
                        detail: "an operation ended without an outcome".to_string(),
                    });
                }
            }
        }
        match failed {
            Some(error) => Err(self.fail(error)),
            None => Ok(()),
        }
    }
}
