//! A load whose exchange runs over the job's own torch process group (`tessera.load` when
//! `torch.distributed` is initialized): tessera plans, reads and places; Python moves the bytes
//! the exchange protocol asks for with torch's point-to-point ops (gloo, or NCCL), so the job
//! needs no second rendezvous and no extra port. The protocol is the loader's own
//! (`tessera_loader::exchange::protocol`, the one tessera's transports run): hand-shake, shares
//! in parts, direct copies between ranks of one host and their acknowledgements are decided
//! there, not in Python.
//!
//! The steps, each a method the Python layer calls in order on every rank:
//! 1. [`group_load`]: the rank's state-dict entries checked against the checkpoint.
//! 2. The load job's rounds (`tessera_ops::job`): [`GroupLoad::job_start`] and
//!    [`GroupLoad::job_step`] hand the Python pump what to put in the job's store, where to
//!    arrive and what to fetch or wait for, and do the rounds' local work here (rank 0 plans the
//!    whole job once; each rank takes its own rank plan; rank 0 checks the pair digests and the
//!    jointly read boxes); [`GroupLoad::read`] reads the rank's own pieces (verified) straight
//!    into its arrays when the rounds say so.
//! 3. The exchange ([`GroupLoad::exchange`], a [`GroupExchange`]): `start` hands out the first
//!    actions (send these bytes, receive that message), `sent` and `received` take completions
//!    and hand out the next, until `waiting_on` says it is over.
//! 4. [`GroupLoad::finish`]: checks that every message was placed and returns the report. A load
//!    that did not get here is never reported as done.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use anyhow::{Result, anyhow, bail};
use bytes::Bytes;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tessera_loader::exchange::ExchangeMessages;
use tessera_loader::exchange::direct::Exposure;
use tessera_loader::exchange::protocol::{Action, ExchangeProtocol};
use tessera_loader::exchange::relay::with_relay_buffers;
use tessera_loader::load::RankReport;
use tessera_loader::read::ReadStats;
use tessera_metadata::TensorMeta;
use tessera_planner::RankPlan;

use tessera_ops::OpsError;
use tessera_ops::job::{
    Action as JobStep, Event, Hello, JobCoordinator, JobWork, RankRounds, RankWork, Round,
    RoundSteps, Taken,
};
use tessera_ops::memory_tier::TierLoad;

use crate::checkpoint::OpenedCheckpoint;
use crate::load::{fqn_of, load_options, parse_read_order, resolve_target, single_device};
use crate::memory::{HostMemory, PyOwnedBytes, first_overlap};
use crate::records::LoadTarget;
use crate::{Cancel, block_on_cancellable, py_error};

/// One rank's load over a process group (see the module docs).
#[pyclass(frozen, module = "tessera._tessera")]
pub struct GroupLoad {
    state: Arc<Mutex<GroupState>>,
    /// Set by `cancel` from the failure agreement's thread while `plan` or `read` runs (which
    /// hold `state`): another rank failed, so this one stops within 100 ms.
    cancel: Cancel,
}

struct GroupState {
    location: String,
    /// The rounds' local work on this rank (`tessera_ops::job::RankWork`): the checkpoint as it
    /// reads it, its requests and memory tier, rank 0's coordinator, the plan as made.
    job: RankWork,
    rank: u32,
    world: u32,
    verify: bool,
    /// The caller's arrays, then (once planned) a scratch buffer per piece this rank reads in
    /// storage order only to relay to others (`tessera_loader::exchange::relay`).
    buffers: Vec<Buffer>,
    plan: Option<Arc<RankPlan>>,
    /// The job's rounds before the exchange (`tessera_ops::job`), once started.
    rounds: Option<RankRounds>,
    /// The plan's exchange messages, cut (and checked) when planned; the protocol takes them
    /// when the exchange starts.
    messages: Option<ExchangeMessages>,
    /// Whether the driver moves host memory, so that ranks of one host may copy directly.
    direct: bool,
    read: Option<(ReadStats, f64)>,
    started: Instant,
    /// Seconds from `started` until this rank took its plan (the rounds up to the plan: the
    /// coordinator's planning, or its replay of a live step's plan, included).
    planned_seconds: Option<f64>,
    /// This rank's exchange token while peers may copy out of its arrays (see
    /// `tessera_loader::exchange::direct`); dropped (zeroed) by `close` and `finish`.
    exposure: Option<Exposure>,
    /// The exchange, once started.
    protocol: Option<ExchangeProtocol<Arc<RankPlan>>>,
    /// The driver's operations in flight by id: what each is, and a send's bytes (kept alive
    /// until the driver says they went out).
    operations: HashMap<u64, Operation>,
    next_operation: u64,
    /// Whether this rank offers and accepts direct copies (`TESSERA_CROSS_MEMORY`).
    cross_memory: bool,
}

/// The plan server a load names (`None` without one): its id of the checkpoint at `location` is
/// `server_id`, else the location's last two components.
fn plan_server(
    location: &str,
    server: Option<String>,
    server_id: Option<String>,
    token: Option<String>,
) -> Result<Option<tessera_ops::load::PlanServer>> {
    let Some(url) = server else {
        return Ok(None);
    };
    let server = tessera_ops::load::PlanServer::for_checkpoint(
        url,
        location,
        server_id,
        token,
        "server_id=\"<run>/<step>\"",
    )?;
    Ok(Some(server))
}

/// Shares go whole, one message each: this path exchanges after the whole read, so parts (which
/// let a share start while the rest is read) would only add messages, each a wait in Python
/// (measured: tp2dp2 exchange 0.27 s whole vs 0.38 s in 64 MiB parts, BENCHMARKS.md).
const WHOLE_SHARES: u64 = u64::MAX;

/// An operation the driver runs for the protocol.
enum Operation {
    Send { to: u32, tag: u64, _data: Bytes },
    Recv { from: u32, tag: u64 },
}

/// An action of the exchange as the Python driver takes it.
#[pyclass(frozen, get_all, module = "tessera._tessera")]
pub struct ExchangeAction {
    /// The operation's id, which the driver reports back when it completes.
    op: u64,
    /// "send", "send_framed" (its length goes first, under `tag + 1`) or "recv".
    kind: &'static str,
    /// The peer rank in the group.
    peer: u32,
    /// The pair tag to send or receive under.
    tag: u32,
    /// Bytes sent or expected; -1: a framed message of any length.
    nbytes: i64,
    /// Where a send's bytes lie (they stay there until the driver reports the send done).
    address: usize,
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
    fn plan(&self, step: &str) -> Result<&Arc<RankPlan>> {
        self.plan
            .as_ref()
            .ok_or_else(|| anyhow!("rank {}: {step} before the plan", self.rank))
    }

    fn protocol(&mut self, step: &str) -> Result<&mut ExchangeProtocol<Arc<RankPlan>>> {
        let rank = self.rank;
        self.protocol
            .as_mut()
            .ok_or_else(|| anyhow!("rank {rank}: {step} before the exchange started"))
    }

    /// `actions` as the driver takes them, each registered under a fresh operation id.
    fn hand_out(&mut self, actions: Vec<Action>) -> Vec<ExchangeAction> {
        actions
            .into_iter()
            .map(|action| {
                let id = self.next_operation;
                self.next_operation += 1;
                match action {
                    Action::Send {
                        to,
                        tag,
                        pair_tag,
                        data,
                        framed,
                    } => {
                        let out = ExchangeAction {
                            op: id,
                            kind: if framed { "send_framed" } else { "send" },
                            peer: to,
                            tag: pair_tag,
                            nbytes: data.len() as i64,
                            address: data.as_ptr() as usize,
                        };
                        self.operations.insert(
                            id,
                            Operation::Send {
                                to,
                                tag,
                                _data: data,
                            },
                        );
                        out
                    }
                    Action::Recv {
                        from,
                        tag,
                        pair_tag,
                        bytes,
                    } => {
                        self.operations.insert(id, Operation::Recv { from, tag });
                        let bytes = bytes.map_or(-1, |b| i64::try_from(b).unwrap_or(i64::MAX));
                        ExchangeAction {
                            op: id,
                            kind: "recv",
                            peer: from,
                            tag: pair_tag,
                            nbytes: bytes,
                            address: 0,
                        }
                    }
                }
            })
            .collect()
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

/// One action of the job's rounds as the Python pump takes it: `kind` is "put" (`value` under
/// `key`), "arrive" (every rank must reach `key`, the round), "get" (`keys` now, `None` where
/// absent), "await" (`key` once written), "read" (this rank's pieces, then `job_step("read")`),
/// "exchange" (the rounds are done) or "fail" (this rank failed `step`: publish `message`).
#[pyclass(frozen, get_all, module = "tessera._tessera")]
pub struct JobAction {
    kind: &'static str,
    key: String,
    keys: Vec<String>,
    value: Option<Py<PyBytes>>,
    /// What the rank does in this round, as failures name it ("planning its pieces").
    step: &'static str,
    message: String,
}

impl JobAction {
    fn new(kind: &'static str, round: Round) -> Self {
        Self {
            kind,
            key: String::new(),
            keys: Vec::new(),
            value: None,
            step: round.step(),
            message: String::new(),
        }
    }

    fn of(py: Python<'_>, action: JobStep, round: Round) -> Self {
        match action {
            JobStep::Put { key, value } => Self {
                key,
                value: Some(PyBytes::new(py, &value).unbind()),
                ..Self::new("put", round)
            },
            JobStep::Arrive { round } => Self {
                key: round.key_name().to_string(),
                ..Self::new("arrive", round)
            },
            JobStep::Get { keys, round } => Self {
                keys,
                ..Self::new("get", round)
            },
            JobStep::Await { key, round } => Self {
                key,
                ..Self::new("await", round)
            },
            JobStep::Read => Self::new("read", Round::Read),
            JobStep::Exchange => Self::new("exchange", round),
        }
    }

    fn fail(round: Round, error: OpsError) -> Self {
        Self {
            message: format!("{:#}", anyhow::Error::from(error)),
            ..Self::new("fail", round)
        }
    }
}

/// The local work of the job's rounds on this rank ([`JobWork`]): `tessera_ops::job::RankWork`'s
/// (the coordinator's planning on rank 0, taking this rank's plan, its memory-tier share, the
/// verdict and the joint checks), with the GIL released while it plans or verifies, and this
/// rank's arrays checked against its plan.
struct GroupWork<'a, 'py> {
    state: &'a mut GroupState,
    py: Python<'py>,
    cancel: &'a Cancel,
    /// Ctrl-C or a cancellation (another rank failed) during long work: raised as it is.
    interrupted: &'a mut Option<PyErr>,
}

/// Runs `work` with the GIL released, stopping on Ctrl-C or a cancellation (kept in
/// `interrupted`, reported to the rounds as this rank's failure).
// The rounds' own error type ([`JobWork`]'s), returned as it is rather than boxed per call.
#[allow(clippy::result_large_err)]
fn wait<T: Send>(
    py: Python<'_>,
    cancel: &Cancel,
    interrupted: &mut Option<PyErr>,
    work: impl Future<Output = Result<T, OpsError>> + Send,
) -> Result<T, OpsError> {
    match block_on_cancellable(py, Some(cancel), async { Ok(work.await) }) {
        Ok(outcome) => outcome,
        Err(error) => {
            let message = error.to_string();
            *interrupted = Some(error);
            Err(OpsError::invalid(message))
        }
    }
}

impl GroupWork<'_, '_> {
    /// Checks the plan `RankWork` took against this rank's arrays and cuts its exchange
    /// messages, so that a plan whose exchange does not add up fails before any read.
    fn take_plan(&mut self) -> Result<()> {
        let state = &mut *self.state;
        let rank = state.rank;
        let plan = state
            .job
            .plan()
            .ok_or_else(|| anyhow!("rank {rank}: the plan was not taken"))?;
        // The plan's destinations are this rank's requests in order: check they are the arrays.
        let sizes = state.buffers.iter().map(|b| b.as_ref().len() as u64);
        if sizes.len() != plan.destinations.len()
            || sizes.zip(&plan.destinations).any(|(len, d)| len != d.bytes)
        {
            bail!(
                "rank {rank}: the plan's {} destinations do not match this rank's {} arrays",
                plan.destinations.len(),
                state.buffers.len()
            );
        }
        // Pieces read in storage order only to pass on get scratch destinations after the arrays.
        let plan = match with_relay_buffers(plan) {
            Some(relaying) => {
                let caller = state.buffers.len();
                for dest in &relaying.destinations[caller..] {
                    state.buffers.push(Buffer::Scratch(
                        tessera_loader::load::host_memory::zeroed_buffer(dest.bytes as usize),
                    ));
                }
                Arc::new(relaying)
            }
            None => Arc::clone(plan),
        };
        let messages = ExchangeMessages::of_plan_in_parts(&plan, WHOLE_SHARES)?;
        state.messages = Some(messages);
        state.plan = Some(plan);
        state.planned_seconds = Some(state.started.elapsed().as_secs_f64());
        Ok(())
    }
}

impl RoundSteps for GroupWork<'_, '_> {
    fn take(&mut self, answer: Bytes) -> Result<Taken, OpsError> {
        let taken = self.state.job.take(answer)?;
        if matches!(taken, Taken::Planned(_)) {
            self.take_plan()
                .map_err(|e| OpsError::invalid(format!("{e:#}")))?;
        }
        Ok(taken)
    }

    // Verifying reads the node's copies: the GIL is released meanwhile, and the rounds' own
    // error comes back through `detach` as it is.
    #[allow(clippy::result_large_err)]
    fn verify_tier(&mut self, node: Vec<u32>) -> Result<Bytes, OpsError> {
        let job = &self.state.job;
        self.py.detach(|| job.verify_tier(&node))
    }

    fn agree(&mut self, reports: Vec<Bytes>) -> Result<Bytes, OpsError> {
        self.state.job.agree(&reports)
    }

    fn accept(&mut self, verdict: Bytes) -> Result<(), OpsError> {
        self.state.job.accept(&verdict)
    }

    fn check_joint_all(&mut self, folds: Vec<Option<Bytes>>) -> Result<(), OpsError> {
        self.state.job.check_joint_all(&folds)
    }

    fn check_joint(&mut self, folds: Vec<(u32, Bytes)>) -> Result<(), OpsError> {
        self.state.job.check_joint(&folds)
    }
}

impl JobWork for GroupWork<'_, '_> {
    fn coordinate(&mut self, hellos: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        let job = &mut self.state.job;
        wait(
            self.py,
            self.cancel,
            self.interrupted,
            job.coordinate(hellos),
        )
    }

    fn settle(&mut self, verified: Vec<Bytes>) -> Result<Vec<Bytes>, OpsError> {
        let job = &mut self.state.job;
        wait(self.py, self.cancel, self.interrupted, job.settle(verified))
    }
}

/// The exchange of one rank's load over a process group ([`GroupLoad::exchange`]): the
/// protocol's actions handed to the Python driver, and the completions it reports back.
#[pyclass(frozen, module = "tessera._tessera")]
pub struct GroupExchange {
    state: Arc<Mutex<GroupState>>,
}

impl GroupExchange {
    fn state(&self) -> MutexGuard<'_, GroupState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[pymethods]
impl GroupExchange {
    /// Starts the exchange once this rank's pieces are read: the first actions for the driver
    /// (the hand-shake where ranks may copy directly, the receives, the shares ready to go).
    fn start(&self) -> PyResult<Vec<ExchangeAction>> {
        let mut state = self.state();
        let state = &mut *state;
        let result = (|| {
            state.check_read("exchanging")?;
            let plan = Arc::clone(state.plan("exchanging")?);
            let Some(messages) = state.messages.take() else {
                bail!("rank {}: the exchange started twice", state.rank);
            };
            let hello = if state.direct {
                let offers = state.cross_memory;
                let exposure = state.exposure.get_or_insert_with(Exposure::new);
                Some(Bytes::from(exposure.offer(offers)))
            } else {
                None
            };
            let mut protocol = ExchangeProtocol::new(plan, messages, hello, state.cross_memory);
            let mut actions = protocol.start();
            actions.extend(protocol.all_read(&state.buffers)?);
            protocol.reads_done()?;
            state.protocol = Some(protocol);
            Ok(state.hand_out(actions))
        })();
        result.map_err(py_error)
    }

    /// Operation `operation` (a send) went out: the next actions.
    fn sent(&self, operation: u64) -> PyResult<Vec<ExchangeAction>> {
        let mut state = self.state();
        let result = (|| {
            let Some(Operation::Send { to, tag, .. }) = state.operations.remove(&operation) else {
                bail!(
                    "rank {}: operation {operation} is not a send in flight",
                    state.rank
                );
            };
            let actions = state.protocol("sending")?.sent(to, tag);
            Ok(state.hand_out(actions))
        })();
        result.map_err(py_error)
    }

    /// Operation `operation` (a receive) got its message: `nbytes` bytes at `address` in
    /// `buffer` (the tensor holding them, kept alive while tessera needs them). Places what
    /// arrived and returns the next actions.
    fn received(
        &self,
        operation: u64,
        buffer: Py<PyAny>,
        address: usize,
        nbytes: usize,
    ) -> PyResult<Vec<ExchangeAction>> {
        let mut state = self.state();
        let state = &mut *state;
        let result = (|| {
            let Some(Operation::Recv { from, tag }) = state.operations.remove(&operation) else {
                bail!(
                    "rank {}: operation {operation} is not a receive in flight",
                    state.rank
                );
            };
            // SAFETY: Python passes the data address and length of the received uint8 tensor
            // `buffer`, which nothing else touches and which the Bytes keeps referenced.
            #[allow(unsafe_code)]
            let memory = unsafe { HostMemory::new(address, nbytes) }
                .ok_or_else(|| anyhow!("operation {operation}: null address"))?;
            let data = Bytes::from_owner(PyOwnedBytes::new(buffer, memory));
            let protocol = state.protocol.as_mut().ok_or_else(|| {
                anyhow!("rank {}: receiving before the exchange started", state.rank)
            })?;
            let mut actions = protocol.received(from, tag, data)?;
            actions.extend(protocol.pump(&mut state.buffers)?);
            Ok(state.hand_out(actions))
        })();
        result.map_err(py_error)
    }

    /// The ranks the exchange still waits on; `None` once it is over (every share placed and
    /// delivered).
    fn waiting_on(&self) -> Option<Vec<u32>> {
        match self.state().protocol.as_ref() {
            Some(p) if p.is_done() => None,
            Some(p) => Some(p.waiting_on()),
            None => Some(Vec::new()),
        }
    }

    /// What this rank says before it fails (negative acknowledgements of the direct shares it
    /// did not copy, so that their senders fail at once).
    fn farewell(&self) -> Vec<ExchangeAction> {
        let mut state = self.state();
        let actions = state
            .protocol
            .as_mut()
            .map(|p| p.farewell())
            .unwrap_or_default();
        state.hand_out(actions)
    }

    /// Ends this rank's offer of its memory: peers copying from it now fail rather than keep
    /// bytes of arrays that may change. Called when the exchange ends, whatever its outcome.
    fn close(&self) {
        self.state().exposure = None;
    }
}

/// Checks the rank's entries (host memory only: CUDA tensors go through host staging in the
/// Python layer) against the checkpoint and prepares the load.
#[pyfunction]
#[pyo3(signature = (checkpoint, targets, rank, world, verify, memory_tier=None))]
pub fn group_load(
    py: Python<'_>,
    checkpoint: PyRef<'_, OpenedCheckpoint>,
    targets: Vec<LoadTarget>,
    rank: u32,
    world: u32,
    verify: bool,
    memory_tier: Option<String>,
) -> PyResult<GroupLoad> {
    let opened = &*checkpoint;
    py.detach(|| prepare(opened, targets, rank, world, verify, memory_tier.as_deref()))
        .map(|state| GroupLoad {
            state: Arc::new(Mutex::new(state)),
            cancel: Cancel::default(),
        })
        .map_err(py_error)
}

fn prepare(
    opened: &OpenedCheckpoint,
    targets: Vec<LoadTarget>,
    rank: u32,
    world: u32,
    verify: bool,
    memory_tier: Option<&str>,
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
    let tier = TierLoad::find(&opened.checkpoint, memory_tier.map(std::path::Path::new));
    let requests = wanted.iter().map(|w| w.request.clone()).collect();
    Ok(GroupState {
        location: opened.location.clone(),
        job: RankWork::new(
            rank,
            world,
            Arc::clone(&opened.checkpoint),
            requests,
            tier,
            verify,
        ),
        rank,
        world,
        verify,
        buffers,
        plan: None,
        rounds: None,
        messages: None,
        direct: false,
        read: None,
        started: Instant::now(),
        planned_seconds: None,
        exposure: None,
        protocol: None,
        operations: HashMap::new(),
        next_operation: 0,
        cross_memory: tessera_ops::load::LoadSwitches::from_env().cross_memory,
    })
}

#[pymethods]
impl GroupLoad {
    /// Starts the job's rounds on this rank (`tessera_ops::job`): its hello (requests, memory-tier
    /// offer, the checkpoint as opened and its plan options) goes to the coordinator, rank 0,
    /// which plans once (here, or on `server`) for every rank. `direct`: the driver moves host
    /// memory, so ranks of one host may copy shares straight out of each other's arrays.
    /// Returns the first actions for the Python pump.
    #[pyo3(signature = (*, server=None, server_id=None, token=None, read_order=None, direct=false))]
    fn job_start(
        &self,
        py: Python<'_>,
        server: Option<String>,
        server_id: Option<String>,
        token: Option<String>,
        read_order: Option<&str>,
        direct: bool,
    ) -> PyResult<Vec<JobAction>> {
        use tessera_ops::load::agreement::{JobTerms, checkpoint_key, job_plan_terms};
        let read_order = parse_read_order(read_order)?;
        let mut state = self.state();
        let state = &mut *state;
        let server = plan_server(&state.location, server, server_id, token).map_err(py_error)?;
        let planning = tessera_ops::load::plan_options(
            true,
            read_order,
            false,
            &tessera_ops::load::LoadSwitches::from_env(),
        );
        let hello = Hello {
            requests: state.job.requests().to_vec(),
            tier: state.job.tier().offer().clone(),
            terms: JobTerms {
                location: state.location.clone(),
                checkpoint: checkpoint_key(state.job.checkpoint(), &state.location)
                    .map_err(|e| py_error(e.into()))?,
                plan: job_plan_terms(state.job.checkpoint(), &planning, &[], server.as_ref()),
            },
        };
        let hello = hello.encode().map_err(|e| py_error(e.into()))?;
        if state.rank == 0 {
            state.job.coordinate_with(JobCoordinator::new(
                Arc::clone(state.job.checkpoint()),
                state.location.clone(),
                planning,
                server,
                true,
            ));
        }
        state.direct = direct;
        let mut rounds = RankRounds::new(state.rank, state.world);
        let actions = rounds.start(hello);
        state.rounds = Some(rounds);
        Ok(actions
            .into_iter()
            .map(|a| JobAction::of(py, a, Round::Requests))
            .collect())
    }

    /// The job's next actions after `event` ("arrived"; "got" with the values fetched, `None`
    /// for a key no rank wrote; "read" with this rank's folds), doing the local work of the
    /// rounds here (the coordinator's plan, taking this rank's plan, the memory tier's share,
    /// the joint checks). A failure comes back as one "fail" action naming the step, for the
    /// pump to publish; Ctrl-C and a cancellation raise.
    fn job_step(
        &self,
        py: Python<'_>,
        event: &str,
        values: Vec<Option<Vec<u8>>>,
    ) -> PyResult<Vec<JobAction>> {
        let event = match event {
            "arrived" => Event::Arrived,
            "got" => Event::Got(values.into_iter().map(|v| v.map(Bytes::from)).collect()),
            "read" => Event::Read(Bytes::from(
                values.into_iter().flatten().next().unwrap_or_default(),
            )),
            other => {
                return Err(py_error(anyhow!(
                    "job_step: unknown event {other:?} (arrived, got or read)"
                )));
            }
        };
        let mut state = self.state();
        let state = &mut *state;
        let mut rounds = state
            .rounds
            .take()
            .ok_or_else(|| py_error(anyhow!("rank {}: job_step before job_start", state.rank)))?;
        let mut interrupted = None;
        let outcome = {
            let mut work = GroupWork {
                state,
                py,
                cancel: &self.cancel,
                interrupted: &mut interrupted,
            };
            rounds.step(&mut work, event)
        };
        let round = rounds.round();
        state.rounds = Some(rounds);
        if let Some(error) = interrupted {
            return Err(error);
        }
        Ok(match outcome {
            Ok(actions) => {
                // Reaching the exchange means the joint checks passed, here or at the coordinator.
                if actions.iter().any(|a| matches!(a, JobStep::Exchange)) {
                    state.job.reached_exchange();
                }
                actions
                    .into_iter()
                    .map(|a| JobAction::of(py, a, round))
                    .collect()
            }
            Err(error) => vec![JobAction::fail(round, error)],
        })
    }

    /// Reads this rank's own pieces, verified, straight into its arrays (interruptible), when
    /// the rounds say so. Returns this rank's folds of the saved boxes it read in parts (joint
    /// checks), for `job_step("read", [folds])`.
    #[pyo3(signature = (progress=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let mut state = self.state();
        let state = &mut *state;
        let plan =
            Arc::clone(state.plan.as_ref().ok_or_else(|| {
                py_error(anyhow!("rank {}: reading before the plan", state.rank))
            })?);
        let total = plan
            .pieces
            .iter()
            .filter(|p| p.read.is_some())
            .map(|p| p.bytes)
            .sum();
        let mut options = load_options(state.verify, progress, total);
        // Parts of boxes several ranks read are folded here and checked in the joint checks.
        options.read.joint_checks = true;
        let checkpoint = Arc::clone(state.job.checkpoint());
        let started = Instant::now();
        let buffers = &mut state.buffers;
        let stats = block_on_cancellable(py, Some(&self.cancel), async {
            Ok(checkpoint.read_into(&plan, &options, buffers).await?)
        })?;
        let folds = state.job.read_done(stats.joint_folds.clone());
        state.read = Some((stats, started.elapsed().as_secs_f64()));
        Ok(PyBytes::new(py, &folds))
    }
    /// The exchange of this load (`tessera_loader::exchange::protocol`), for the driver to run
    /// once the rounds handed over to it.
    fn exchange(&self) -> GroupExchange {
        GroupExchange {
            state: Arc::clone(&self.state),
        }
    }

    /// Stops this rank's planning or reading within 100 ms, raising `reason`: another rank of the
    /// job failed (the failure agreement calls this from its own thread; `plan` and `read` hold
    /// the state's lock, this does not take it).
    fn cancel(&self, reason: String) {
        self.cancel.cancel(reason);
    }

    /// The rank's report as JSON text (with `memory_tier_ignored`: the tier copies not taken or
    /// read from storage after all, each with why), once its pieces are read and every message
    /// it expects is placed; an error naming what is missing otherwise. `exchange_wait_seconds`: of
    /// `exchange_seconds`, the time the driver waited on the group's messages.
    fn finish(&self, exchange_seconds: f64, exchange_wait_seconds: f64) -> PyResult<String> {
        let mut state = self.state();
        state.exposure = None;
        let result = (|| {
            let plan = state.plan("finishing")?;
            state.check_read("finishing")?;
            let Some((stats, read_seconds)) = &state.read else {
                unreachable!("checked above")
            };
            if !plan.joint_checks.is_empty() && !state.job.joint_checked() {
                bail!(
                    "rank {}: the saved boxes this rank read or received in parts were never \
                     checked against the other readers' folds: the load is incomplete",
                    state.rank
                );
            }
            let Some(protocol) = state.protocol.as_ref() else {
                bail!(
                    "rank {}: the exchange never started: the load is incomplete",
                    state.rank
                );
            };
            if !protocol.is_done() {
                bail!(
                    "rank {}: the exchange is unfinished (still waiting on ranks {:?}): the load is incomplete",
                    state.rank,
                    protocol.waiting_on()
                );
            }
            let exchanged = protocol.stats();
            let (sent, received) = (exchanged.bytes_sent, exchanged.bytes_received);
            let mut report = RankReport::of_host_load(
                plan,
                stats,
                *read_seconds,
                (sent, received),
                exchange_seconds,
                state.started.elapsed().as_secs_f64(),
            );
            report.bytes_received_direct = exchanged.bytes_received_direct;
            report.exchange_wait_seconds = exchange_wait_seconds.min(exchange_seconds).max(0.0);
            // The memory-tier copies this rank's node did not take, with why, and those that
            // failed a read after their check (read from storage instead).
            let mut ignored = state.job.tier_copies().ignored.clone();
            ignored.extend(report.memory_tier_fallbacks.iter().cloned());
            let mut json = serde_json::to_value(&report)?;
            json["memory_tier_ignored"] = serde_json::json!(ignored);
            // The coordinator made or replayed the job's one plan; its summary says which.
            json["plan_reused"] =
                serde_json::json!(state.job.job_summary().is_some_and(|s| s.replayed));
            json["plan_seconds"] = serde_json::json!(state.planned_seconds.unwrap_or(0.0));
            Ok(serde_json::to_string(&json)?)
        })();
        result.map_err(py_error)
    }
}
