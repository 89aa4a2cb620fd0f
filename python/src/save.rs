//! `tessera.save`: a native checkpoint written from the ranks that hold the data, through the
//! shared save-and-commit protocol (`tessera_ops::save`): replicas written once by the holder the
//! planner's worst-fit assignment picks, rank 0 commits (manifest last) after every rank reported
//! success; a failure anywhere leaves no manifest. Rank 0 holds the output's write claim while the
//! ranks write, so a second job saving into the same directory fails naming the first.

use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use pyo3::prelude::*;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{InProcTransport, TcpTransport, TransportOptions};
use tessera_ops::coord;
use tessera_ops::memory_tier::MemoryTier;
use tessera_ops::save::{Holdings, SaveOptions, save_rank};

#[cfg(feature = "fault-injection")]
use std::sync::{Arc, Mutex};
#[cfg(feature = "fault-injection")]
use tessera_ops::save::StoreLayer;
#[cfg(feature = "fault-injection")]
use tessera_storage::testing::{FaultConfig, FaultyStore};

/// Test hook: a fault specification (`write_every_nth:N`, `write_outage`,
/// `write_outage_after:N`) for the store every save of this process writes through. Read only by
/// builds with the `fault-injection` feature; other builds refuse to save while it is set.
pub const TEST_FAULTS_ENV: &str = "TESSERA_TEST_FAULTS";
use tessera_storage::StorageOptions;

use crate::memory::HostMemory;
use crate::records::HeldBox;
use crate::{block_on, storage_options};

/// Everything one `save` call needs, owned.
struct SaveJob {
    path: String,
    boxes: Vec<HeldBox>,
    objects: Vec<(String, Vec<u8>)>,
    rank: u32,
    world: u32,
    rendezvous: Option<(String, u16)>,
    step: Option<u64>,
    storage: StorageOptions,
    break_claim: bool,
    timeout: Duration,
    memory_tier: Option<MemoryTier>,
}

async fn run_save(job: SaveJob) -> Result<String> {
    let mut held = Holdings {
        boxes: Vec::with_capacity(job.boxes.len()),
        objects: job.objects.iter().map(|(k, _)| k.clone()).collect(),
    };
    let mut memory = Vec::with_capacity(job.boxes.len());
    for HeldBox {
        fqn,
        dtype,
        global_shape,
        offsets,
        lengths,
        address,
        nbytes,
    } in job.boxes
    {
        // SAFETY: the Python layer passes the data address and byte length of a C-contiguous
        // array it keeps referenced until this call returns; it is only read.
        #[allow(unsafe_code)]
        let m = unsafe { HostMemory::new(address, nbytes) }
            .ok_or_else(|| anyhow!("tensor {fqn}: null data address"))?;
        memory.push(m);
        held.boxes.push(tessera_ops::save::HeldBox {
            fqn,
            dtype,
            shape: global_shape,
            offsets,
            lengths,
        });
    }
    let data: Vec<&[u8]> = memory.iter().map(AsRef::as_ref).collect();
    let faults = TestFaults::from_env()?;
    let options = SaveOptions {
        step: job.step,
        storage: job.storage,
        break_claim: job.break_claim,
        store_layer: faults.layer(),
        // One bound for every wait on a peer, as the transport's.
        outcome_wait: job.timeout,
        memory_tier: job.memory_tier,
    };
    let saved = match &job.rendezvous {
        Some((addr, port)) if job.world > 1 => {
            let transport =
                connect(job.rank, job.world, &job.path, job.timeout, addr, *port).await?;
            let all =
                coord::all_gather_json(&transport, coord::TAG_SAVE_BOXES, &held, "boxes").await?;
            save_rank(&job.path, &options, &all, &data, &job.objects, &transport).await?
        }
        _ if job.world > 1 => bail!(
            "saving from {} ranks needs a rendezvous (MASTER_ADDR and a port) so that rank 0 can commit what every rank wrote",
            job.world
        ),
        _ => {
            let mut mesh = InProcTransport::mesh(1, TransportOptions::with_timeout(job.timeout));
            let transport = mesh
                .pop()
                .ok_or_else(|| anyhow!("no in-process transport"))?;
            save_rank(
                &job.path,
                &options,
                &[held],
                &data,
                &job.objects,
                &transport,
            )
            .await?
        }
    };
    Ok(serde_json::to_string(&serde_json::json!({
        "manifest": saved.manifest,
        "write_retries": saved.write_retries,
        "injected_write_faults": faults.injected(),
        "warning": saved.warning,
        "memory_tier": match &saved.memory_tier {
            None => serde_json::Value::Null,
            Some(Ok(left)) => serde_json::to_value(left)?,
            Some(Err(error)) => serde_json::json!({ "error": error }),
        },
    }))?)
}

/// The faults `TESSERA_TEST_FAULTS` asks for (`fault-injection` builds), and the stores that
/// injected them, so the report can say how many were injected.
#[cfg(feature = "fault-injection")]
struct TestFaults {
    config: Option<FaultConfig>,
    stores: Arc<Mutex<Vec<Arc<FaultyStore>>>>,
}

#[cfg(feature = "fault-injection")]
impl TestFaults {
    fn from_env() -> Result<Self> {
        let config = match std::env::var(TEST_FAULTS_ENV) {
            Ok(spec) if !spec.trim().is_empty() => Some(
                FaultConfig::parse(&spec).map_err(|e| anyhow!("{TEST_FAULTS_ENV}={spec}: {e}"))?,
            ),
            _ => None,
        };
        Ok(Self {
            config,
            stores: Arc::default(),
        })
    }

    fn layer(&self) -> Option<StoreLayer> {
        let config = self.config.clone()?;
        let stores = self.stores.clone();
        Some(StoreLayer::new(move |inner| {
            let faulty = Arc::new(FaultyStore::new(inner, config.clone()));
            stores
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .push(faulty.clone());
            faulty
        }))
    }

    /// Write requests failed on purpose during this save; `None` without faults.
    fn injected(&self) -> Option<u64> {
        self.config.as_ref()?;
        let stores = self
            .stores
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Some(stores.iter().map(|s| s.injected_writes()).sum())
    }
}

/// Without the `fault-injection` feature: no faults, and a set `TESSERA_TEST_FAULTS` is an error
/// (a test that asks for faults must not pass against a build that cannot inject them).
#[cfg(not(feature = "fault-injection"))]
struct TestFaults;

#[cfg(not(feature = "fault-injection"))]
impl TestFaults {
    fn from_env() -> Result<Self> {
        match std::env::var(TEST_FAULTS_ENV) {
            Ok(spec) if !spec.trim().is_empty() => bail!(
                "{TEST_FAULTS_ENV}={spec} is set, but this build of tessera's native module has no fault injection (build it with `maturin develop --features fault-injection`, as `make python-test` does, or unset the variable)"
            ),
            _ => Ok(Self),
        }
    }

    fn layer(&self) -> Option<tessera_ops::save::StoreLayer> {
        None
    }

    fn injected(&self) -> Option<u64> {
        None
    }
}

/// Joins the save's rendezvous. The fingerprint is the checkpoint's path: a job saving every step
/// rendezvouses on the same port once per save, and a rank that is one save ahead or behind (its
/// previous save failed early) is refused by rank 0, naming both, instead of writing its share of
/// one checkpoint into another's commit.
async fn connect(
    rank: u32,
    world: u32,
    path: &str,
    timeout: Duration,
    addr: &str,
    port: u16,
) -> Result<TcpTransport> {
    let fingerprint = (path.len() as u64) << 32 | u64::from(crc32c::crc32c(path.as_bytes()));
    let config = RendezvousConfig::new(rank, world, addr, port)?.with_job(fingerprint);
    TcpTransport::connect(&config, TransportOptions::with_timeout(timeout))
        .await
        .with_context(|| format!("rank {rank} joining the save of {path} at {addr}:{port}"))
}

/// What a save of one rank asks, besides where and what: the typed request [`save`] takes
/// (Python sets its fields by name; each has a default).
#[pyclass(module = "tessera._tessera", get_all, set_all, from_py_object)]
#[derive(Clone, Debug)]
pub struct SaveRequest {
    /// This rank.
    rank: u32,
    /// The job's ranks.
    world: u32,
    /// Rank 0's address and port, where the ranks meet to commit (`None`: one rank).
    rendezvous: Option<(String, u16)>,
    /// The step recorded in the manifest.
    step: Option<u64>,
    /// Storage settings (credentials, endpoint) by name.
    storage_env: Vec<(String, String)>,
    /// Remove a killed job's write claim first.
    break_claim: bool,
    /// Seconds a rank waits for its peers.
    timeout_s: f64,
    /// The node's memory tier: its directory, copies kept, bytes allowed.
    memory_tier: Option<(String, usize, Option<u64>)>,
}

#[pymethods]
impl SaveRequest {
    /// A request with every field at its default (one rank, 300 s).
    #[new]
    fn new() -> Self {
        Self {
            rank: 0,
            world: 1,
            rendezvous: None,
            step: None,
            storage_env: Vec::new(),
            break_claim: false,
            timeout_s: 300.0,
            memory_tier: None,
        }
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// Saves boxes (and byte objects) as a native checkpoint at `path`; returns JSON:
/// `{"manifest": …, "write_retries": n, "injected_write_faults": n or null, "warning": …,
/// "memory_tier": null | {"path", "bytes", "skipped", "pruned"} | {"error"}}`. The request's `memory_tier`:
/// `(dir, keep, max_bytes)` of the node's memory tier this rank leaves its file in after the
/// commit.
#[pyfunction]
#[pyo3(signature = (path, boxes, objects, request))]
pub fn save(
    py: Python<'_>,
    path: String,
    boxes: Vec<HeldBox>,
    objects: Vec<(String, Vec<u8>)>,
    request: SaveRequest,
) -> PyResult<String> {
    let SaveRequest {
        rank,
        world,
        rendezvous,
        step,
        storage_env,
        break_claim,
        timeout_s,
        memory_tier,
    } = request;
    let job = SaveJob {
        path,
        boxes,
        objects,
        rank,
        world,
        rendezvous,
        step,
        storage: storage_options(storage_env),
        break_claim,
        timeout: Duration::from_secs_f64(timeout_s.max(0.001)),
        memory_tier: memory_tier.map(|(dir, keep, max_bytes)| MemoryTier {
            dir: dir.into(),
            keep,
            max_bytes,
        }),
    };
    block_on(py, run_save(job))
}
