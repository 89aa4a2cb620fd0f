//! `tessera.load` and `tessera.plan`: a rank's wanted boxes (from its state dict) checked against
//! the checkpoint, planned (here, or by a tessera server), read and exchanged straight into the
//! caller's memory.
//!
//! Ranks either load independently (each plans and reads only what it needs: no coordination,
//! replicated tensors read once per rank) or, given a rendezvous, as one job: they all-gather
//! their requests, plan the whole job (every rank computes the same plan, or the server computes
//! it once), read each shared byte once and pass it on in the ring exchange.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, anyhow, bail};
use pyo3::prelude::*;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, RankReport};
use tessera_loader::plan_client::PlanTarget;
use tessera_loader::read::ReadOptions;
use tessera_loader::tier::TierCopies;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{InProcTransport, Transport, TransportOptions};
use tessera_metadata::{DType, TensorMeta};
use tessera_ops::job::host::{HostJob, allocated, callers};
use tessera_ops::load::{Destination, JobPlan, LoadSwitches, PlanServer, load_rank, plan_options};
use tessera_ops::memory_tier::{sources_of, view_with_tier};
use tessera_planner::{
    ExplicitRequest, ExplicitRequests, Layout, RankPlan, ReadOrder, ReadSources,
};
use tessera_storage as storage;

use crate::memory::{HostMemory, first_overlap};

use crate::checkpoint::OpenedCheckpoint;
use crate::records::LoadTarget;
use crate::{block_on, py_error, runtime, storage_options};

/// A state-dict entry, checked against the checkpoint.
#[derive(Debug)]
pub(crate) struct Wanted {
    pub(crate) request: ExplicitRequest,
    pub(crate) address: usize,
    pub(crate) nbytes: usize,
}

fn shape_text(shape: &[u64]) -> String {
    format!("{shape:?}")
}

/// Checks one entry against the checkpoint's tensor of the same name and turns it into a request.
pub(crate) fn resolve_target(
    tensors: &HashMap<&str, &TensorMeta>,
    location: &str,
    target: LoadTarget,
) -> Result<Wanted> {
    let LoadTarget {
        fqn,
        dtype,
        shape,
        offsets,
        flat_start,
        address,
        nbytes,
        cuda_device: _,
    } = target;
    let Some(meta) = tensors.get(fqn.as_str()) else {
        bail!(
            "tensor {fqn:?} is not in checkpoint {location} ({} tensors; `tessera.inspect` lists them)",
            tensors.len()
        );
    };
    let dtype = DType::parse(&dtype)
        .map_err(|_| anyhow!("tensor {fqn}: tessera has no dtype matching the array's {dtype}"))?;
    if dtype != meta.dtype {
        bail!(
            "tensor {fqn}: the checkpoint stores {} but the array is {} (tessera does not cast)",
            meta.dtype,
            dtype
        );
    }
    let numel = shape
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| anyhow!("tensor {fqn}: the array's shape {shape:?} overflows"))?;
    if numel.checked_mul(dtype.size()) != Some(nbytes as u64) {
        bail!(
            "tensor {fqn}: the array's shape {} of {dtype} needs {} bytes but its memory has {nbytes}",
            shape_text(&shape),
            numel.saturating_mul(dtype.size())
        );
    }
    let request = match (offsets, flat_start) {
        (Some(_), Some(_)) => bail!("tensor {fqn}: give a box's offsets or a flat start, not both"),
        (None, Some(start)) => {
            let total = meta.numel();
            let end = start.checked_add(numel).filter(|&end| end <= total);
            let Some(end) = end else {
                bail!(
                    "tensor {fqn}: flat range [{start}, {}) reaches past the checkpoint's {total} elements (shape {})",
                    start.saturating_add(numel),
                    shape_text(&meta.shape)
                );
            };
            ExplicitRequest::Flat {
                fqn,
                flat: [start, end],
            }
        }
        (None, None) => {
            if shape != meta.shape {
                // DCP's own words first ("Size mismatch between saved ... and current: ..."),
                // which code written for dcp.load matches on.
                bail!(
                    "Size mismatch between saved {} and current: {} for {fqn}: tensor {fqn}: the checkpoint's shape is {} but the array's is {} (pass (array, offsets) for a part of it)",
                    shape_text(&meta.shape),
                    shape_text(&shape),
                    shape_text(&meta.shape),
                    shape_text(&shape)
                );
            }
            ExplicitRequest::Box {
                fqn,
                offsets: vec![0; shape.len()],
                lengths: shape,
            }
        }
        (Some(offsets), None) => {
            if offsets.len() != meta.shape.len() || shape.len() != meta.shape.len() {
                bail!(
                    "tensor {fqn}: the checkpoint's tensor has {} dims but the box has offsets {} and shape {}",
                    meta.shape.len(),
                    shape_text(&offsets),
                    shape_text(&shape)
                );
            }
            let fits = offsets
                .iter()
                .zip(&shape)
                .zip(&meta.shape)
                .all(|((&o, &l), &d)| o.checked_add(l).is_some_and(|end| end <= d));
            if !fits {
                bail!(
                    "tensor {fqn}: box at offsets {} of shape {} reaches past the checkpoint's shape {}",
                    shape_text(&offsets),
                    shape_text(&shape),
                    shape_text(&meta.shape)
                );
            }
            ExplicitRequest::Box {
                fqn,
                offsets,
                lengths: shape,
            }
        }
    };
    Ok(Wanted {
        request,
        address,
        nbytes,
    })
}

/// Where a job's ranks meet: rank 0's address and port.
type Rendezvous = Option<(String, u16)>;

/// How a rank's plan came about, for its report.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Planning {
    /// Replayed from another live step of the same layout (`tessera_ops::load::replay`).
    pub(crate) reused: bool,
    /// Seconds from the requests to the rank's plan (planning or replaying, and checking it).
    pub(crate) seconds: f64,
}

/// Plans `requests` (every rank's) and returns rank `rank`'s plan and whether it was replayed:
/// on the server when given (its plan checked against the opened checkpoint's identity first),
/// else here, in the read order given (`None`: the planner's cost model, as in every front
/// end), a live step's replayed when this process planned one of the same layout. `sources`:
/// the copies of data files the ranks' memory tiers hold, which only a plan made here can use.
pub(crate) async fn rank_plan_for(
    checkpoint: &Checkpoint,
    location: &str,
    (requests, rank): (ExplicitRequests, u32),
    dedup: bool,
    read_order: Option<ReadOrder>,
    (server, sources): (Option<&PlanServer>, &ReadSources),
) -> Result<(RankPlan, bool)> {
    let plan = match server {
        Some(server) if !sources.is_empty() => {
            return Err(tessera_ops::memory_tier::refuse_with_server(&format!(
                "server={}",
                server.url
            ))
            .into());
        }
        Some(server) => {
            JobPlan::on_server(
                checkpoint,
                location,
                server,
                &PlanTarget::Requests(requests),
                dedup,
            )
            .await?
        }
        None => {
            let set = requests.resolve(checkpoint.meta.tensors())?;
            let options = plan_options(dedup, read_order, false, &LoadSwitches::from_env());
            JobPlan::local_with_sources(checkpoint, &set, &options, sources)?
        }
    };
    Ok((plan.rank_plan(rank).await?, plan.replayed()))
}

/// Throttles progress calls into Python (each takes the GIL) to a few per second.
pub(crate) struct Progress {
    callback: Py<PyAny>,
    total: u64,
    state: Mutex<(u64, Instant)>,
}

impl Progress {
    fn advance(&self, bytes: u64) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.0 += bytes;
        let done = state.0;
        if done < self.total && state.1.elapsed() < Duration::from_millis(200) {
            return;
        }
        state.1 = Instant::now();
        drop(state);
        // A failing progress callback must not fail the load: its error is printed by Python.
        Python::attach(|py| {
            if let Err(error) = self.callback.call1(py, (done, self.total)) {
                error.print(py);
            }
        });
    }
}

/// The planner's read order from its Python name (`auto`, `request`, `storage`; `None`: the
/// cost model's choice).
pub(crate) fn parse_read_order(name: Option<&str>) -> PyResult<Option<ReadOrder>> {
    match name {
        None => Ok(None),
        Some("auto") => Ok(Some(ReadOrder::Auto)),
        Some("request") => Ok(Some(ReadOrder::Request)),
        Some("storage") => Ok(Some(ReadOrder::Storage)),
        Some(other) => Err(pyo3::exceptions::PyValueError::new_err(format!(
            "read_order must be \"auto\", \"request\" or \"storage\", not {other:?}"
        ))),
    }
}

/// Load options: verification, the environment's side-by-side switches, and progress reported
/// to a Python callback (`None`: none).
pub(crate) fn load_options(verify: bool, progress: Option<Py<PyAny>>, total: u64) -> LoadOptions {
    let read = ReadOptions {
        verify,
        ..ReadOptions::default()
    };
    let mut options = tessera_ops::load::load_options(read, &LoadSwitches::from_env());
    if let Some(callback) = progress {
        let progress = Arc::new(Progress {
            callback,
            total,
            state: Mutex::new((0, Instant::now())),
        });
        options.progress = Some(Arc::new(move |bytes| progress.advance(bytes)));
    }
    options
}

/// Everything one `load_into` call needs, owned (it moves into the runtime).
struct LoadJob {
    location: String,
    checkpoint: Arc<Checkpoint>,
    targets: Vec<LoadTarget>,
    rank: u32,
    world: u32,
    rendezvous: Rendezvous,
    server: Option<PlanServer>,
    verify: bool,
    dedup: bool,
    read_order: Option<ReadOrder>,
    timeout: Duration,
    progress: Option<Py<PyAny>>,
    /// The node's memory tier to read copies from.
    memory_tier: Option<String>,
}

/// Loads one rank; its report, the memory-tier copies it saw and did not take (with why), and
/// how its plan came about.
async fn run_load(job: LoadJob) -> Result<(RankReport, Vec<String>, Planning)> {
    let checkpoint = &*job.checkpoint;
    let by_name: HashMap<&str, &TensorMeta> = checkpoint
        .meta
        .tensors()
        .iter()
        .map(|t| (t.fqn.as_str(), t))
        .collect();
    let device = single_device(&job.targets)?;
    if device.is_some() && !cfg!(feature = "cuda") {
        bail!(
            "this build of tessera has no CUDA support: rebuild the package with the `cuda` feature (`maturin develop --release --features cuda`) to load into CUDA tensors"
        );
    }
    let wanted = job
        .targets
        .into_iter()
        .map(|t| resolve_target(&by_name, &job.location, t))
        .collect::<Result<Vec<_>>>()?;
    let spans: Vec<(usize, usize)> = wanted.iter().map(|w| (w.address, w.nbytes)).collect();
    if let Some((a, b)) = first_overlap(&spans) {
        bail!(
            "entries {} and {} share memory; every entry needs its own array",
            fqn_of(&wanted[a].request),
            fqn_of(&wanted[b].request)
        );
    }
    let mine: Vec<ExplicitRequest> = wanted.iter().map(|w| w.request.clone()).collect();
    let memory = match device {
        None => {
            let mut buffers = Vec::with_capacity(wanted.len());
            for w in &wanted {
                // SAFETY: the Python layer passes the data address and byte length of a
                // C-contiguous, writable host array it keeps referenced until this call returns;
                // overlaps were refused above.
                #[allow(unsafe_code)]
                let memory = unsafe { HostMemory::new(w.address, w.nbytes) }
                    .ok_or_else(|| anyhow!("tensor {}: null data address", fqn_of(&w.request)))?;
                buffers.push(memory);
            }
            Memory::Host(buffers)
        }
        Some(ordinal) => Memory::Cuda { ordinal, spans },
    };
    let total: u64 = wanted.iter().map(|w| w.nbytes as u64).sum();
    let options = load_options(job.verify, job.progress, total);

    match (&job.rendezvous, job.world) {
        (Some((addr, port)), world) if world > 1 => {
            let host_job = HostJob {
                checkpoint: Arc::clone(&job.checkpoint),
                location: job.location.clone(),
                world,
                planning: plan_options(job.dedup, job.read_order, false, &LoadSwitches::from_env()),
                filter: Vec::new(),
                server: job.server.clone(),
                memory_tier: job.memory_tier.as_ref().map(std::path::PathBuf::from),
                verify: job.verify,
                options,
                timeout: job.timeout,
            };
            let config = RendezvousConfig::new(job.rank, world, addr, *port)?;
            load_over_rounds(&host_job, config, mine, memory).await
        }
        _ => {
            let (view, tier) = match &job.memory_tier {
                Some(dir) => view_with_tier(checkpoint, std::path::Path::new(dir))?,
                None => (checkpoint.clone(), TierCopies::default()),
            };
            let checkpoint = &view;
            let planning_started = Instant::now();
            let (plan, reused) = rank_plan_for(
                checkpoint,
                &job.location,
                (ExplicitRequests { ranks: vec![mine] }, 0),
                job.dedup,
                job.read_order,
                (job.server.as_ref(), &sources_of(&[tier.file_indices()])),
            )
            .await?;
            let planning = Planning {
                reused,
                seconds: planning_started.elapsed().as_secs_f64(),
            };
            let mut mesh = InProcTransport::mesh(1, TransportOptions::with_timeout(job.timeout));
            let transport = mesh
                .pop()
                .ok_or_else(|| anyhow!("no in-process transport"))?;
            let mut report =
                execute(checkpoint, plan, Arc::new(transport), &options, memory).await?;
            report.rank = job.rank;
            Ok((report, tier.ignored, planning))
        }
    }
}

/// Rank `config.rank` of a job over tessera's own TCP mesh at `config`: the load job's rounds
/// (rank 0 plans once, each rank takes its own plan; rank 0 turns away a rank of another job and
/// calls the job off when its ranks would plan differently) as the CLI's ranks run them
/// (`tessera_ops::job::host::HostJob::load_rank_over_tcp`), straight into the caller's host
/// arrays, or into host buffers then uploaded to its CUDA tensors.
async fn load_over_rounds(
    job: &HostJob,
    config: RendezvousConfig,
    requests: Vec<ExplicitRequest>,
    memory: Memory,
) -> Result<(RankReport, Vec<String>, Planning)> {
    let rank = config.rank;
    let (report, work, seconds) = match memory {
        Memory::Host(buffers) => {
            let loaded = job
                .load_rank_over_tcp((config, &[]), requests, callers(buffers), None)
                .await
                .with_context(|| format!("rank {rank} loading"))?;
            (loaded.report, loaded.work, loaded.plan_seconds)
        }
        Memory::Cuda { ordinal, spans } => {
            let loaded = job
                .load_rank_over_tcp((config, &[]), requests, allocated(), None)
                .await
                .with_context(|| format!("rank {rank} loading"))?;
            let mut report = loaded.report;
            upload_cuda(&loaded.plan, &loaded.buffers, &mut report, ordinal, &spans)
                .with_context(|| format!("rank {rank} loading into cuda:{ordinal}"))?;
            (report, loaded.work, loaded.plan_seconds)
        }
    };
    // Rank 0 made or replayed the job's one plan; every rank reads which from its summary.
    let planning = Planning {
        reused: work.job_summary().is_some_and(|s| s.replayed),
        seconds,
    };
    Ok((report, work.tier_copies().ignored.clone(), planning))
}

/// Where a load's destinations are.
enum Memory {
    /// Host arrays.
    Host(Vec<HostMemory>),
    /// CUDA tensors on one device: (address, bytes) per destination.
    Cuda {
        ordinal: u32,
        spans: Vec<(usize, usize)>,
    },
}

/// The one device every target is on (`None`: host memory); a mix is refused.
pub(crate) fn single_device(targets: &[LoadTarget]) -> Result<Option<u32>> {
    let mut devices = targets.iter().map(|t| (t.cuda_device, t.fqn.as_str()));
    let Some((first, first_fqn)) = devices.next() else {
        return Ok(None);
    };
    for (device, fqn) in devices {
        if device != first {
            let name =
                |d: Option<u32>| d.map_or("host memory".to_string(), |n| format!("cuda:{n}"));
            bail!(
                "{first_fqn} is in {} but {fqn} in {}: load each device's tensors with a call of their own",
                name(first),
                name(device)
            );
        }
    }
    Ok(first)
}

/// Loads `plan` into `memory` over `transport`: the pipeline every front end shares
/// (`tessera_ops::load::load_rank`), host arrays or CUDA tensors alike.
async fn execute<T: Transport + 'static>(
    checkpoint: &Checkpoint,
    plan: RankPlan,
    transport: Arc<T>,
    options: &LoadOptions,
    memory: Memory,
) -> Result<RankReport> {
    let rank = transport.rank();
    match memory {
        Memory::Host(mut buffers) => load_rank(
            checkpoint,
            &plan,
            &transport,
            Destination::Host(&mut buffers),
            options,
        )
        .await
        .with_context(|| format!("rank {rank} loading")),
        Memory::Cuda { ordinal, spans } => {
            load_cuda(checkpoint, &plan, &transport, options, ordinal, &spans)
                .await
                .with_context(|| format!("rank {rank} loading into cuda:{ordinal}"))
        }
    }
}

/// Loads into caller-owned CUDA memory (torch tensors' `data_ptr()`): the shared pipeline into
/// host buffers, then the pinned staging upload.
#[cfg(feature = "cuda")]
async fn load_cuda<T: Transport>(
    checkpoint: &Checkpoint,
    plan: &RankPlan,
    transport: &T,
    options: &LoadOptions,
    ordinal: u32,
    spans: &[(usize, usize)],
) -> Result<RankReport> {
    use tessera_loader::device::cuda::CudaDevice;
    use tessera_ops::load::cuda::CudaDestination;

    let device = CudaDevice::open(ordinal)?;
    let mut buffers = wrap_cuda(&device, spans);
    let destination = Destination::<HostMemory>::Cuda(CudaDestination {
        device: &device,
        buffers: &mut buffers,
    });
    Ok(load_rank(checkpoint, plan, transport, destination, options).await?)
}

/// Uploads a rank's host load into caller-owned CUDA memory (torch tensors' `data_ptr()`)
/// through pinned staging; the report gains the upload.
#[cfg(feature = "cuda")]
fn upload_cuda(
    plan: &RankPlan,
    host: &[Vec<u8>],
    report: &mut RankReport,
    ordinal: u32,
    spans: &[(usize, usize)],
) -> Result<()> {
    use tessera_loader::device::cuda::CudaDevice;
    use tessera_ops::load::cuda::CudaDestination;

    let device = CudaDevice::open(ordinal)?;
    let mut buffers = wrap_cuda(&device, spans);
    let destination = CudaDestination {
        device: &device,
        buffers: &mut buffers,
    };
    Ok(destination.upload(plan, host, report)?)
}

/// The caller's CUDA tensors as device buffers.
#[cfg(feature = "cuda")]
fn wrap_cuda(
    device: &tessera_loader::device::cuda::CudaDevice,
    spans: &[(usize, usize)],
) -> Vec<tessera_loader::device::cuda::DeviceBuffer> {
    spans
        .iter()
        .map(|&(address, len)| {
            // SAFETY: the Python layer passes the data pointer and byte length of contiguous CUDA
            // tensors on this device (torch allocates in the primary context) that it keeps
            // referenced until this call returns; overlaps were refused.
            #[allow(unsafe_code)]
            unsafe {
                device.wrap(address as u64, len)
            }
        })
        .collect()
}

#[cfg(not(feature = "cuda"))]
fn upload_cuda(
    _plan: &RankPlan,
    _host: &[Vec<u8>],
    _report: &mut RankReport,
    ordinal: u32,
    _spans: &[(usize, usize)],
) -> Result<()> {
    bail!("cuda:{ordinal}: this build of tessera has no CUDA support (the `cuda` feature)")
}

#[cfg(not(feature = "cuda"))]
async fn load_cuda<T: Transport>(
    _checkpoint: &Checkpoint,
    _plan: &RankPlan,
    _transport: &T,
    _options: &LoadOptions,
    ordinal: u32,
    _spans: &[(usize, usize)],
) -> Result<RankReport> {
    bail!("cuda:{ordinal}: this build of tessera has no CUDA support (the `cuda` feature)")
}

pub(crate) fn fqn_of(request: &ExplicitRequest) -> &str {
    match request {
        ExplicitRequest::Box { fqn, .. } | ExplicitRequest::Flat { fqn, .. } => fqn,
    }
}

/// Rank 0's address and port for tessera's own rendezvous by the one rule every front end keeps
/// (`tessera_ops::load::rendezvous`): the arguments, else `MASTER_ADDR` and `TESSERA_PORT` or
/// `MASTER_PORT + 1`. `None` unless both are known.
#[pyfunction]
#[pyo3(signature = (master_addr, master_port))]
pub fn rendezvous_endpoint(
    master_addr: Option<String>,
    master_port: Option<u16>,
) -> PyResult<Rendezvous> {
    let (addr, port) = tessera_ops::load::rendezvous::master(
        master_addr.as_deref().filter(|a| !a.is_empty()),
        master_port,
        |name| std::env::var(name).ok(),
    )
    .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    Ok(addr.zip(port))
}

/// What a load of one rank asks, besides the checkpoint and its entries: the typed request
/// [`load_into`] takes (Python sets its fields by name; each has a default).
#[pyclass(module = "tessera._tessera", get_all, set_all, from_py_object)]
#[derive(Clone, Debug)]
pub struct LoadRequest {
    /// This rank.
    rank: u32,
    /// The job's ranks.
    world: u32,
    /// Rank 0's address and port, for tessera's own rendezvous (`None`: no exchange).
    rendezvous: Rendezvous,
    /// A tessera server that plans instead, its id of the checkpoint, its token.
    server: Option<String>,
    checkpoint_id: Option<String>,
    token: Option<String>,
    /// Verify what is read against the checkpoint's checksums.
    verify: bool,
    /// Read each shared piece once and exchange it.
    dedup: bool,
    /// Seconds a rank waits for its peers.
    timeout_s: f64,
    /// `auto`, `request` or `storage` (`None`: the planner's cost model).
    read_order: Option<String>,
    /// The node's memory tier to read copies from.
    memory_tier: Option<String>,
}

#[pymethods]
impl LoadRequest {
    /// A request with every field at its default (one rank, verified, deduplicated, 300 s).
    #[new]
    fn new() -> Self {
        Self {
            rank: 0,
            world: 1,
            rendezvous: None,
            server: None,
            checkpoint_id: None,
            token: None,
            verify: true,
            dedup: true,
            timeout_s: 300.0,
            read_order: None,
            memory_tier: None,
        }
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// Loads into caller-owned memory as `request` says; returns the rank's report as JSON text.
#[pyfunction]
#[pyo3(signature = (checkpoint, targets, request, progress=None))]
pub fn load_into(
    py: Python<'_>,
    checkpoint: PyRef<'_, OpenedCheckpoint>,
    targets: Vec<LoadTarget>,
    request: LoadRequest,
    progress: Option<Py<PyAny>>,
) -> PyResult<String> {
    let LoadRequest {
        rank,
        world,
        rendezvous,
        server,
        checkpoint_id,
        token,
        verify,
        dedup,
        timeout_s,
        read_order,
        memory_tier,
    } = request;
    let read_order = parse_read_order(read_order.as_deref())?;
    let server = match server {
        Some(url) => Some(
            PlanServer::for_checkpoint(
                url,
                &checkpoint.location,
                checkpoint_id,
                token,
                "server_id=\"<run>/<step>\"",
            )
            .map_err(|e| py_error(e.into()))?,
        ),
        None => None,
    };
    let job = LoadJob {
        location: checkpoint.location.clone(),
        checkpoint: Arc::clone(&checkpoint.checkpoint),
        targets,
        rank,
        world,
        rendezvous,
        server,
        verify,
        dedup,
        read_order,
        timeout: Duration::from_secs_f64(timeout_s.max(0.001)),
        progress,
        memory_tier,
    };
    // Interruptible: Ctrl-C raises KeyboardInterrupt while ranks wait or read.
    block_on(py, async {
        let (report, mut ignored, planning) = run_load(job).await?;
        // Copies that failed a read after they were verified were read from storage instead:
        // named with the ones never taken (each warned about by `tessera.load`).
        ignored.extend(report.memory_tier_fallbacks.iter().cloned());
        let mut json = serde_json::to_value(&report)?;
        json["memory_tier_ignored"] = serde_json::json!(ignored);
        json["plan_reused"] = serde_json::json!(planning.reused);
        json["plan_seconds"] = serde_json::json!(planning.seconds);
        Ok(serde_json::to_string(&json)?)
    })
}

/// A plan as JSON text: `{"world", "summary", "rank_plan"?}`. `layout_json` or `requests_json`
/// (every rank's requests) says what to plan for.
#[pyfunction]
#[pyo3(signature = (checkpoint, layout_json, requests_json, rank, dedup, storage_env))]
pub fn plan(
    py: Python<'_>,
    checkpoint: String,
    layout_json: Option<String>,
    requests_json: Option<String>,
    rank: Option<u32>,
    dedup: bool,
    storage_env: Vec<(String, String)>,
) -> PyResult<String> {
    let rt = runtime()?;
    let options = storage_options(storage_env);
    py.detach(move || {
        rt.block_on(plan_json(
            checkpoint,
            layout_json,
            requests_json,
            rank,
            dedup,
            options,
        ))
    })
    .map_err(py_error)
}

async fn plan_json(
    checkpoint: String,
    layout_json: Option<String>,
    requests_json: Option<String>,
    rank: Option<u32>,
    dedup: bool,
    options: storage::StorageOptions,
) -> Result<String> {
    let location = storage::open_with(&checkpoint, &options)?;
    let mut open = tessera_ops::open::open_options();
    open.block_checksums = false;
    let opened = Checkpoint::open_with(location, &open)
        .await
        .with_context(|| format!("opening checkpoint {checkpoint}"))?;
    let set = match (layout_json, requests_json) {
        (Some(layout), None) => Layout::from_json(&layout)
            .context("reading the layout")?
            .resolve(opened.meta.tensors())?,
        (None, Some(requests)) => ExplicitRequests::from_json(&requests)
            .context("reading the requests")?
            .resolve(opened.meta.tensors())?,
        _ => bail!("give exactly one of layout or requests"),
    };
    let plan = opened.plan(
        &set,
        &plan_options(dedup, None, false, &LoadSwitches::from_env()),
    )?;
    let mut doc = serde_json::json!({
        "world": plan.world_size(),
        "summary": plan.summary(),
    });
    if let Some(rank) = rank {
        if rank >= plan.world_size() {
            bail!(
                "rank {rank} is outside the plan's {} ranks",
                plan.world_size()
            );
        }
        let rank_plan: serde_json::Value = serde_json::from_str(&plan.rank_plan(rank)?.to_json())?;
        doc["rank_plan"] = rank_plan;
    }
    Ok(doc.to_string())
}
