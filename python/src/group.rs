//! A load whose exchange runs over the job's own torch process group (`tessera.load` when
//! `torch.distributed` is initialized): tessera plans, reads and places; Python moves the ring
//! exchange's messages with torch's point-to-point ops (gloo, or NCCL), so the job needs no second
//! rendezvous and no extra port.
//!
//! The steps, each a method the Python layer calls in order on every rank:
//! 1. [`group_load`]: the rank's state-dict entries checked against the checkpoint;
//!    [`GroupLoad::requests_json`] is what the ranks all-gather over the group.
//! 2. [`GroupLoad::plan`]: every rank plans the whole job from every rank's requests (the planner
//!    is deterministic, so all get the same plan) or fetches its part from a plan server; returns
//!    the sizes of the messages to send and receive.
//! 3. [`GroupLoad::read`]: the rank's own pieces, read (verified) straight into its arrays.
//! 4. [`GroupLoad::gather`] fills each outgoing message buffer, Python sends and receives them,
//!    [`GroupLoad::place`] puts each received message into the arrays.
//! 5. [`GroupLoad::finish`]: checks that every message was placed and returns the report. A load
//!    that did not get here is never reported as done.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use anyhow::{Result, anyhow, bail};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tessera_loader::cross_memory::{Exposure, PeerMemory, ShareDescriptor};
use tessera_loader::exchange::{
    ExchangeMessages, copy_share, describe_share, gather_message, place_message,
};
use tessera_loader::joint;
use tessera_loader::load::{Checkpoint, RankReport};
use tessera_loader::read::ReadStats;
use tessera_loader::relay::with_relay_buffers;
use tessera_metadata::TensorMeta;
use tessera_planner::{ExplicitRequest, ExplicitRequests, RankPlan};

use crate::checkpoint::OpenedCheckpoint;
use crate::load::{
    TargetTuple, Wanted, fqn_of, load_options, parse_read_order, rank_plan_for, resolve_target,
    single_device,
};
use crate::memory::{HostMemory, first_overlap};
use crate::{block_on, py_error};

/// One rank's load over a process group (see the module docs).
#[pyclass(frozen, module = "tessera._tessera")]
pub struct GroupLoad {
    state: Mutex<GroupState>,
}

struct GroupState {
    location: String,
    checkpoint: Arc<Checkpoint>,
    rank: u32,
    world: u32,
    verify: bool,
    wanted: Vec<Wanted>,
    /// The caller's arrays, then (once planned) a scratch buffer per piece this rank reads in
    /// storage order only to relay to others (`tessera_loader::relay`).
    buffers: Vec<Buffer>,
    plan: Option<RankPlan>,
    messages: ExchangeMessages,
    read: Option<(ReadStats, f64)>,
    gathered: Vec<bool>,
    placed: Vec<bool>,
    started: Instant,
    /// This rank's exchange token while peers may copy out of its arrays (see
    /// `tessera_loader::cross_memory`); dropped (zeroed) by `close` and `finish`.
    exposure: Option<Exposure>,
    /// Peers whose shares this rank copies out of their memory.
    sources: HashMap<u32, PeerMemory>,
    /// Bytes copied that way.
    received_direct: u64,
    /// Whether this rank offers and accepts direct copies (`TESSERA_CROSS_MEMORY`).
    cross_memory: bool,
    /// Whether the boxes this rank read or received in parts were checked against every
    /// reader's folds (`check_joint`; `tessera_loader::joint`).
    joint_checked: bool,
}

/// A destination of the load: one of the caller's arrays, or a relayed piece's scratch.
enum Buffer {
    Caller(HostMemory),
    Scratch(Vec<u8>),
}

impl AsRef<[u8]> for Buffer {
    fn as_ref(&self) -> &[u8] {
        match self {
            Buffer::Caller(m) => m.as_ref(),
            Buffer::Scratch(v) => v,
        }
    }
}

impl AsMut<[u8]> for Buffer {
    fn as_mut(&mut self) -> &mut [u8] {
        match self {
            Buffer::Caller(m) => m.as_mut(),
            Buffer::Scratch(v) => v,
        }
    }
}

impl GroupLoad {
    fn state(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl GroupState {
    /// Whether this rank's read verified (and so folded its parts of jointly checked boxes).
    fn verifying(&self) -> bool {
        self.checkpoint.verifies(self.verify)
    }

    fn plan(&self, step: &str) -> Result<&RankPlan> {
        self.plan
            .as_ref()
            .ok_or_else(|| anyhow!("rank {}: {step} before the plan", self.rank))
    }

    fn check_read(&self, step: &str) -> Result<()> {
        if self.read.is_none() {
            bail!(
                "rank {}: {step} before this rank read its own pieces",
                self.rank
            );
        }
        Ok(())
    }
}

/// Checks the rank's entries (host memory only: CUDA tensors go through host staging in the
/// Python layer) against the checkpoint and prepares the load.
#[pyfunction]
#[pyo3(signature = (checkpoint, targets, rank, world, verify))]
pub fn group_load(
    checkpoint: PyRef<'_, OpenedCheckpoint>,
    targets: Vec<TargetTuple>,
    rank: u32,
    world: u32,
    verify: bool,
) -> PyResult<GroupLoad> {
    prepare(&checkpoint, targets, rank, world, verify)
        .map(|state| GroupLoad {
            state: Mutex::new(state),
        })
        .map_err(py_error)
}

fn prepare(
    opened: &OpenedCheckpoint,
    targets: Vec<TargetTuple>,
    rank: u32,
    world: u32,
    verify: bool,
) -> Result<GroupState> {
    if world == 0 || rank >= world {
        bail!("rank {rank} is outside a group of {world} ranks");
    }
    if let Some(ordinal) = single_device(&targets)? {
        bail!(
            "rank {rank}: a process-group load places into host memory; cuda:{ordinal} tensors are staged by the Python layer"
        );
    }
    let by_name: HashMap<&str, &TensorMeta> = opened
        .checkpoint
        .meta
        .tensors()
        .iter()
        .map(|t| (t.fqn.as_str(), t))
        .collect();
    let wanted = targets
        .into_iter()
        .map(|t| resolve_target(&by_name, &opened.location, t))
        .collect::<Result<Vec<_>>>()?;
    let spans: Vec<(usize, usize)> = wanted.iter().map(|w| (w.address, w.nbytes)).collect();
    if let Some((a, b)) = first_overlap(&spans) {
        bail!(
            "entries {} and {} share memory; every entry needs its own array",
            fqn_of(&wanted[a].request),
            fqn_of(&wanted[b].request)
        );
    }
    let mut buffers = Vec::with_capacity(wanted.len());
    for w in &wanted {
        // SAFETY: the Python layer passes the data address and byte length of a C-contiguous,
        // writable host array it keeps referenced for as long as this GroupLoad lives (it drops
        // the GroupLoad before releasing the arrays); overlaps were refused above.
        #[allow(unsafe_code)]
        let memory = unsafe { HostMemory::new(w.address, w.nbytes) }
            .ok_or_else(|| anyhow!("tensor {}: null data address", fqn_of(&w.request)))?;
        buffers.push(Buffer::Caller(memory));
    }
    Ok(GroupState {
        location: opened.location.clone(),
        checkpoint: Arc::clone(&opened.checkpoint),
        rank,
        world,
        verify,
        wanted,
        buffers,
        plan: None,
        messages: ExchangeMessages::default(),
        read: None,
        gathered: Vec::new(),
        placed: Vec::new(),
        started: Instant::now(),
        exposure: None,
        sources: HashMap::new(),
        received_direct: 0,
        cross_memory: tessera_ops::load::LoadSwitches::from_env().cross_memory,
        joint_checked: false,
    })
}

/// The messages to send or receive: `(peer, bytes, exchange group, round)` each.
type MessageSizes = Vec<(u32, u64, u32, u32)>;

#[pymethods]
impl GroupLoad {
    /// This rank's requests as JSON text (what the ranks all-gather).
    fn requests_json(&self) -> PyResult<String> {
        let state = self.state();
        let mine: Vec<&ExplicitRequest> = state.wanted.iter().map(|w| &w.request).collect();
        serde_json::to_string(&mine).map_err(|e| py_error(e.into()))
    }

    /// Plans the job from every rank's requests (`all_requests[r]`: rank r's
    /// [`GroupLoad::requests_json`]), here or on `server`. Returns `(outgoing, incoming)`: the
    /// peer, size, exchange group and round of every message this rank sends and receives, in exchange order.
    #[pyo3(signature = (all_requests, dedup, server=None, server_id=None, token=None, read_order=None))]
    #[allow(clippy::too_many_arguments)]
    fn plan(
        &self,
        py: Python<'_>,
        all_requests: Vec<String>,
        dedup: bool,
        server: Option<String>,
        server_id: Option<String>,
        token: Option<String>,
        read_order: Option<&str>,
    ) -> PyResult<(MessageSizes, MessageSizes)> {
        let read_order = parse_read_order(read_order)?;
        let (checkpoint, rank, world, location) = {
            let state = self.state();
            (
                Arc::clone(&state.checkpoint),
                state.rank,
                state.world,
                state.location.clone(),
            )
        };
        if all_requests.len() != world as usize {
            return Err(py_error(anyhow!(
                "rank {rank}: {} ranks' requests gathered for a group of {world}",
                all_requests.len()
            )));
        }
        let ranks = all_requests
            .iter()
            .enumerate()
            .map(|(r, text)| {
                serde_json::from_str::<Vec<ExplicitRequest>>(text)
                    .map_err(|e| anyhow!("rank {r}'s requests are not valid: {e}"))
            })
            .collect::<Result<Vec<_>>>()
            .map_err(py_error)?;
        let server = match server {
            Some(url) => Some(tessera_ops::load::PlanServer {
                checkpoint_id: server_id
                    .or_else(|| tessera_loader::plan_client::server_checkpoint_id(&location))
                    .ok_or_else(|| {
                        py_error(anyhow!(
                            "cannot tell the server's id of checkpoint {location:?}: pass server_id=\"<run>/<step>\""
                        ))
                    })?,
                url,
                token,
            }),
            None => None,
        };
        let plan = block_on(py, async {
            rank_plan_for(
                &checkpoint,
                &location,
                ExplicitRequests { ranks },
                rank,
                dedup,
                read_order,
                server.as_ref(),
            )
            .await
        })?;
        let mut state = self.state();
        // The plan's destinations are this rank's requests in order: check they are the arrays.
        let sizes = state.buffers.iter().map(|b| b.as_ref().len() as u64);
        if sizes.len() != plan.destinations.len()
            || sizes.zip(&plan.destinations).any(|(len, d)| len != d.bytes)
        {
            return Err(py_error(anyhow!(
                "rank {rank}: the plan's {} destinations do not match this rank's {} arrays",
                plan.destinations.len(),
                state.buffers.len()
            )));
        }
        // Pieces read in storage order only to pass on get scratch destinations after the arrays.
        let plan = match with_relay_buffers(&plan) {
            Some(relaying) => {
                let caller = state.buffers.len();
                for dest in &relaying.destinations[caller..] {
                    state.buffers.push(Buffer::Scratch(
                        tessera_loader::host_memory::zeroed_buffer(dest.bytes as usize),
                    ));
                }
                relaying
            }
            None => plan,
        };
        // Whole shares, one message each: this path exchanges after the whole read, so parts
        // (which let a share start while the rest is read) would only add messages.
        let messages =
            ExchangeMessages::of_plan_in_parts(&plan, u64::MAX).map_err(|e| py_error(e.into()))?;
        let outgoing = messages
            .outgoing
            .iter()
            .map(|m| (m.to, m.bytes, m.group, m.round))
            .collect();
        let incoming = messages
            .incoming
            .iter()
            .map(|m| (m.from, m.bytes, m.group, m.round))
            .collect();
        state.gathered = vec![false; messages.outgoing.len()];
        state.placed = vec![false; messages.incoming.len()];
        state.messages = messages;
        state.plan = Some(plan);
        Ok((outgoing, incoming))
    }

    /// Reads this rank's own pieces, verified, straight into its arrays (interruptible).
    #[pyo3(signature = (progress=None))]
    fn read(&self, py: Python<'_>, progress: Option<Py<PyAny>>) -> PyResult<()> {
        let mut state = self.state();
        let state = &mut *state;
        let plan = state
            .plan
            .as_ref()
            .ok_or_else(|| py_error(anyhow!("rank {}: reading before the plan", state.rank)))?;
        let total = plan
            .pieces
            .iter()
            .filter(|p| p.read.is_some())
            .map(|p| p.bytes)
            .sum();
        let mut options = load_options(state.verify, progress, total);
        // Parts of boxes several ranks read are folded here and checked by `check_joint`.
        options.read.joint_checks = true;
        let checkpoint = Arc::clone(&state.checkpoint);
        let started = Instant::now();
        let buffers = &mut state.buffers;
        let stats = block_on(py, async {
            Ok(checkpoint.read_into(plan, &options, buffers).await?)
        })?;
        state.read = Some((stats, started.elapsed().as_secs_f64()));
        Ok(())
    }

    /// This rank's folds of the saved boxes it read in parts (joint checks), to all-gather
    /// over the group after the read.
    fn joint_folds<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let state = self.state();
        state.check_read("folding").map_err(py_error)?;
        let folds = state
            .read
            .as_ref()
            .map(|(stats, _)| stats.joint_folds.as_slice())
            .unwrap_or_default();
        Ok(PyBytes::new(py, &joint::encode(state.verifying(), folds)))
    }

    /// Checks every jointly read box this rank holds bytes of against every rank's folds
    /// (`joint_folds` of ranks 0..world, in rank order). Raises naming the box, its file and
    /// readers when the parts do not add up to its crc32c.
    fn check_joint(&self, folds: Vec<Bound<'_, PyBytes>>) -> PyResult<()> {
        let mut state = self.state();
        let result = (|| {
            let plan = state.plan("checking jointly read boxes")?;
            state.check_read("checking jointly read boxes")?;
            if folds.len() != state.world as usize {
                bail!(
                    "rank {}: folds from {} ranks, expected {}",
                    state.rank,
                    folds.len(),
                    state.world
                );
            }
            let mut by_rank = joint::FoldsByRank::new();
            for (peer, data) in folds.iter().enumerate() {
                let peer = peer as u32;
                by_rank.insert(
                    peer,
                    joint::decode(state.rank, peer, data.as_bytes(), None)?,
                );
            }
            joint::check_joint_boxes(
                plan,
                Some(&state.checkpoint.meta),
                &by_rank,
                state.verifying(),
            )?;
            Ok(())
        })();
        result.map_err(py_error)?;
        state.joint_checked = true;
        Ok(())
    }

    /// Fills outgoing message `index` into `nbytes` bytes at `address` (a buffer Python then
    /// sends).
    fn gather(&self, index: usize, address: usize, nbytes: usize) -> PyResult<()> {
        let mut state = self.state();
        let state = &mut *state;
        let result = (|| {
            state.check_read("gathering a message")?;
            let plan = state.plan("gathering a message")?;
            let message = state
                .messages
                .outgoing
                .get(index)
                .ok_or_else(|| anyhow!("rank {}: no outgoing message {index}", state.rank))?;
            // SAFETY: Python passes a contiguous uint8 buffer it owns and does not touch during
            // the call.
            #[allow(unsafe_code)]
            let mut out = unsafe { HostMemory::new(address, nbytes) }
                .ok_or_else(|| anyhow!("outgoing message {index}: null address"))?;
            gather_message(plan, message, &state.buffers, out.as_mut())?;
            state.gathered[index] = true;
            Ok(())
        })();
        result.map_err(py_error)
    }

    /// Places received message `index` (`nbytes` bytes at `address`) into the arrays.
    fn place(&self, index: usize, address: usize, nbytes: usize) -> PyResult<()> {
        let mut state = self.state();
        let state = &mut *state;
        let result =
            (|| {
                let plan = state.plan.as_ref().ok_or_else(|| {
                    anyhow!("rank {}: placing a message before the plan", state.rank)
                })?;
                let message =
                    state.messages.incoming.get(index).ok_or_else(|| {
                        anyhow!("rank {}: no incoming message {index}", state.rank)
                    })?;
                // SAFETY: Python passes the received uint8 buffer, which it keeps alive for the call.
                #[allow(unsafe_code)]
                let data = unsafe { HostMemory::new(address, nbytes) }
                    .ok_or_else(|| anyhow!("incoming message {index}: null address"))?;
                place_message(plan, message, data.as_ref(), &mut state.buffers)?;
                state.placed[index] = true;
                Ok(())
            })();
        result.map_err(py_error)
    }

    /// This rank's hello for direct copies: its exchange token (created now, held until
    /// `close` or `finish`), or that it declines (`TESSERA_CROSS_MEMORY=0`).
    fn hello<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let mut state = self.state();
        let offers = state.cross_memory;
        let exposure = state.exposure.get_or_insert_with(Exposure::new);
        PyBytes::new(py, &exposure.offer(offers))
    }

    /// Whether this rank copies the shares of `peer`, whose hello is `hello`, straight out of its
    /// memory (it offers, this rank does too, and its token reads back from here).
    fn answer(&self, peer: u32, hello: &[u8]) -> PyResult<bool> {
        let mut state = self.state();
        let memory = PeerMemory::accept(hello, state.cross_memory)
            .map_err(|e| py_error(anyhow!("rank {}: rank {peer}'s hello: {e}", state.rank)))?;
        let direct = memory.is_some();
        match memory {
            Some(m) => state.sources.insert(peer, m),
            None => state.sources.remove(&peer),
        };
        Ok(direct)
    }

    /// The descriptor of outgoing message `index` for a peer that copies it out of this rank's
    /// memory (instead of [`GroupLoad::gather`]); the arrays must stay put until it acknowledges.
    fn describe<'py>(&self, py: Python<'py>, index: usize) -> PyResult<Bound<'py, PyBytes>> {
        let mut state = self.state();
        let state = &mut *state;
        let result = (|| {
            state.check_read("describing a message")?;
            if state.exposure.is_none() {
                bail!("rank {}: describing a message without a hello", state.rank);
            }
            let plan = state.plan("describing a message")?;
            let message = state
                .messages
                .outgoing
                .get(index)
                .ok_or_else(|| anyhow!("rank {}: no outgoing message {index}", state.rank))?;
            let descriptor = describe_share(plan, message, &state.buffers)?;
            state.gathered[index] = true;
            Ok(descriptor.encode())
        })();
        result.map(|d| PyBytes::new(py, &d)).map_err(py_error)
    }

    /// Copies incoming message `index` straight out of its sender's memory, as its descriptor
    /// (`nbytes` bytes at `address`) says, into the arrays.
    fn copy(&self, index: usize, address: usize, nbytes: usize) -> PyResult<()> {
        let mut state = self.state();
        let state = &mut *state;
        let result = (|| {
            let plan = state
                .plan
                .as_ref()
                .ok_or_else(|| anyhow!("rank {}: copying a message before the plan", state.rank))?;
            let message = state
                .messages
                .incoming
                .get(index)
                .ok_or_else(|| anyhow!("rank {}: no incoming message {index}", state.rank))?;
            let source = state.sources.get(&message.from).ok_or_else(|| {
                anyhow!(
                    "rank {}: rank {} sent a share descriptor but its memory was not found readable",
                    state.rank,
                    message.from
                )
            })?;
            // SAFETY: Python passes the received uint8 buffer, which it keeps alive for the call.
            #[allow(unsafe_code)]
            let data = unsafe { HostMemory::new(address, nbytes) }
                .ok_or_else(|| anyhow!("incoming descriptor {index}: null address"))?;
            let descriptor = ShareDescriptor::decode(data.as_ref()).map_err(|e| {
                anyhow!(
                    "rank {}: rank {}'s share descriptor: {e}",
                    state.rank,
                    message.from
                )
            })?;
            copy_share(plan, message, source, &descriptor, &mut state.buffers)?;
            state.received_direct += message.bytes;
            state.placed[index] = true;
            Ok(())
        })();
        result.map_err(py_error)
    }

    /// Ends this rank's offer of its memory: peers copying from it now fail rather than keep
    /// bytes of arrays that may change. Called when the exchange ends, whatever its outcome.
    fn close(&self) {
        self.state().exposure = None;
    }

    /// The rank's report as JSON text, once its pieces are read and every message it expects is
    /// placed; an error naming what is missing otherwise.
    fn finish(&self, exchange_seconds: f64) -> PyResult<String> {
        let mut state = self.state();
        state.exposure = None;
        let result = (|| {
            let plan = state.plan("finishing")?;
            state.check_read("finishing")?;
            let Some((stats, read_seconds)) = &state.read else {
                unreachable!("checked above")
            };
            if !plan.joint_checks.is_empty() && !state.joint_checked {
                bail!(
                    "rank {}: the saved boxes this rank read or received in parts were never \
                     checked against the other readers' folds: the load is incomplete",
                    state.rank
                );
            }
            if let Some(i) = state.placed.iter().position(|&p| !p) {
                let m = &state.messages.incoming[i];
                bail!(
                    "rank {}: the message of group {} round {} from rank {} ({} bytes) was never placed: the load is incomplete",
                    state.rank,
                    m.group,
                    m.round,
                    m.from,
                    m.bytes
                );
            }
            if let Some(i) = state.gathered.iter().position(|&g| !g) {
                let m = &state.messages.outgoing[i];
                bail!(
                    "rank {}: the message of group {} round {} to rank {} was never gathered",
                    state.rank,
                    m.group,
                    m.round,
                    m.to
                );
            }
            let sent = state.messages.outgoing.iter().map(|m| m.bytes).sum();
            let received = state.messages.incoming.iter().map(|m| m.bytes).sum();
            let mut report = RankReport::of_host_load(
                plan,
                stats,
                *read_seconds,
                (sent, received),
                exchange_seconds,
                state.started.elapsed().as_secs_f64(),
            );
            report.bytes_received_direct = state.received_direct;
            Ok(serde_json::to_string(&report)?)
        })();
        result.map_err(py_error)
    }
}
