//! `tessera.publish`: this rank's part of a live publication's step (`tessera_ops::publish`):
//! its boxes laid out as its data file in memory, served by this process's range server
//! (`tessera_storage::RangeServer`, one per bound host, started on first use), and its part
//! written to the registry; rank 0 then commits the step once every rank's part is there.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::time::Duration;

use anyhow::{Context, Result, anyhow};
use pyo3::prelude::*;
use tessera_ops::publish::{self, Part, PartMemory};
use tessera_ops::save::{HeldBox as OpsBox, Holdings};
use tessera_storage::RangeServer;
use tessera_storage::shared_file::SharedFile;

use crate::block_on;
use crate::memory::HostMemory;
use crate::records::HeldBox;

/// The process's range servers, by the host they are bound to.
fn servers() -> &'static Mutex<HashMap<String, Arc<RangeServer>>> {
    static SERVERS: OnceLock<Mutex<HashMap<String, Arc<RangeServer>>>> = OnceLock::new();
    SERVERS.get_or_init(Mutex::default)
}

fn server(host: &str) -> Result<Arc<RangeServer>> {
    let mut servers = servers().lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(server) = servers.get(host) {
        return Ok(server.clone());
    }
    let server = Arc::new(RangeServer::start(host)?);
    servers.insert(host.to_string(), server.clone());
    Ok(server)
}

/// The data files this process shares as memory with consumers on its host, by served path:
/// kept here (as well as in the range server's `Bytes`) so that the fault-injection hook damages
/// the very bytes consumers read, and `unpublish` lets them go.
fn shared_files() -> &'static Mutex<HashMap<String, Arc<SharedFile>>> {
    static SHARED: OnceLock<Mutex<HashMap<String, Arc<SharedFile>>>> = OnceLock::new();
    SHARED.get_or_init(Mutex::default)
}

/// Retired steps' shared files kept for this process's next steps to lay out in, at most this
/// many: writing a step into memory whose pages are already faulted in costs a copy, where fresh
/// shared memory costs the kernel reclaiming page cache page by page first (BENCHMARKS.md: a warm
/// step's persist 1.1-1.3 s in fresh memory against 0.26-0.31 s for the first one).
const SPARE_SHARED_FILES: usize = 2;

/// The retired steps' shared files waiting to be reused, smallest first.
fn spare_files() -> &'static Mutex<Vec<Arc<SharedFile>>> {
    static SPARE: OnceLock<Mutex<Vec<Arc<SharedFile>>>> = OnceLock::new();
    SPARE.get_or_init(Mutex::default)
}

/// Keeps a retired step's shared file for reuse: the largest [`SPARE_SHARED_FILES`] stay.
fn keep_spare(file: Arc<SharedFile>) {
    let mut spare = spare_files().lock().unwrap_or_else(PoisonError::into_inner);
    spare.push(file);
    spare.sort_by_key(|f| f.size());
    if spare.len() > SPARE_SHARED_FILES {
        spare.remove(0);
    }
}

/// A writer in a retired step's shared memory, the largest kept, when one is free (no response
/// of the range server still holds it; one that is held is let go).
fn reuse_spare() -> Option<tessera_storage::shared_file::SharedFileWriter> {
    let mut spare = spare_files().lock().unwrap_or_else(PoisonError::into_inner);
    while let Some(file) = spare.pop() {
        if let Ok(writer) = SharedFile::into_writer(file) {
            return Some(writer);
        }
    }
    None
}

/// What one rank's part of a step needs besides its boxes (Python sets the fields by name).
#[pyclass(module = "tessera._tessera", get_all, set_all, from_py_object)]
#[derive(Clone, Debug)]
pub struct PublishRequest {
    /// The publication's name (the registry folder).
    name: String,
    /// The step.
    step: u64,
    /// This publisher rank.
    rank: u32,
    /// The publishing job's ranks.
    world: u32,
    /// The address this process serves its bytes on (what consumers connect to).
    host: String,
    /// Consumers on this host read the data file as shared memory (a memfd they open through
    /// `/proc`) instead of over HTTP.
    share_memory: bool,
}

#[pymethods]
impl PublishRequest {
    /// A request with every field at its default (rank 0 of 1, loopback).
    #[new]
    fn new() -> Self {
        Self {
            name: String::new(),
            step: 0,
            rank: 0,
            world: 1,
            host: "127.0.0.1".to_string(),
            share_memory: true,
        }
    }

    fn __repr__(&self) -> String {
        format!("{self:?}")
    }
}

/// Lays this rank's boxes (and objects) out as its data file, serves it, and writes its part
/// into `step_dir`; returns JSON `{"url", "path", "bytes"}` (the served file's origin, path and
/// size). The boxes' memory is read during the call only.
#[pyfunction]
#[pyo3(signature = (step_dir, boxes, objects, request))]
pub fn publish_part(
    py: Python<'_>,
    step_dir: String,
    boxes: Vec<HeldBox>,
    objects: Vec<(String, Vec<u8>)>,
    request: PublishRequest,
) -> PyResult<String> {
    block_on(
        py,
        run_part(PathBuf::from(step_dir), boxes, objects, request),
    )
}

async fn run_part(
    step_dir: PathBuf,
    boxes: Vec<HeldBox>,
    objects: Vec<(String, Vec<u8>)>,
    request: PublishRequest,
) -> Result<String> {
    let rank = request.rank;
    let mut held = Vec::with_capacity(boxes.len());
    let mut memory = Vec::with_capacity(boxes.len());
    for b in boxes {
        // SAFETY: the Python layer passes the data address and byte length of a C-contiguous
        // array (a region of the staging pool) it keeps referenced until this call returns; it
        // is only read.
        #[allow(unsafe_code)]
        let m = unsafe { HostMemory::new(b.address, b.nbytes) }
            .ok_or_else(|| anyhow!("tensor {}: null data address", b.fqn))?;
        memory.push(m);
        held.push(OpsBox {
            fqn: b.fqn,
            dtype: b.dtype,
            shape: b.global_shape,
            offsets: b.offsets,
            lengths: b.lengths,
        });
    }
    let data: Vec<&[u8]> = memory.iter().map(AsRef::as_ref).collect();
    let step_name = step_dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| anyhow!("{}: no step directory name", step_dir.display()))?;
    // Laid out straight into shared memory where the kernel offers it (consumers on this host
    // read it there); the heap, HTTP only, otherwise: the part says which by its handle.
    // A retired step's shared memory first: its pages are there already.
    let (memory, reused) = match request.share_memory.then(reuse_spare).flatten() {
        Some(writer) => (PartMemory::Reused(writer), true),
        None if request.share_memory => (
            PartMemory::Shared {
                tag: format!("tessera-{}-{step_name}-rank{rank}", request.name),
            },
            false,
        ),
        None => (PartMemory::Heap, false),
    };
    let (laid_out, file) = publish::write_part_file(rank, &held, &data, &objects, memory).await?;
    let path = format!("{}/{step_name}/{}", request.name, file.path());
    let server = server(&request.host)
        .with_context(|| format!("rank {rank}: serving publication {}", request.name))?;
    let bytes = laid_out.bytes();
    let size = bytes.len();
    server.serve(&path, bytes);
    let shared = laid_out.shared().cloned();
    if let Some(file) = &shared {
        shared_files()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(path.clone(), Arc::clone(file));
    }
    let part = Part {
        rank,
        world: request.world,
        step: request.step,
        url: server.url(),
        path: path.clone(),
        holdings: Holdings {
            boxes: held,
            objects: objects.iter().map(|(k, _)| k.clone()).collect(),
        },
        file,
        shared: shared.as_ref().map(|f| f.handle().clone()),
    };
    if let Err(e) = publish::write_part(&step_dir, &part) {
        server.remove(&path);
        shared_files()
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&path);
        return Err(e.into());
    }
    Ok(serde_json::to_string(&serde_json::json!({
        "url": part.url,
        "path": path,
        "bytes": size,
        "shared": part.shared.is_some(),
        "reused_memory": reused,
    }))?)
}

/// Rank 0: waits up to `timeout_s` for every one of the `world` ranks' parts of `step` in
/// `step_dir`, then commits the step (manifest last); returns the manifest as JSON.
#[pyfunction]
#[pyo3(signature = (step_dir, world, step, timeout_s))]
pub fn commit_publication(
    py: Python<'_>,
    step_dir: String,
    world: u32,
    step: u64,
    timeout_s: f64,
) -> PyResult<String> {
    block_on(py, async move {
        let manifest = publish::await_and_commit(
            &PathBuf::from(step_dir),
            world,
            step,
            Duration::from_secs_f64(timeout_s.max(0.001)),
        )
        .await?;
        Ok(serde_json::to_string(&manifest)?)
    })
}

/// The step `live://NAME[@STEP]` names in `registry` and its directory
/// (`tessera_ops::publish::listing::resolve`: the given step when complete, else the newest
/// complete one; an error naming what is missing otherwise).
#[pyfunction]
#[pyo3(signature = (registry, name, step=None))]
pub fn resolve_live(registry: &str, name: &str, step: Option<u64>) -> PyResult<(u64, String)> {
    let (step, dir) = publish::listing::resolve(std::path::Path::new(registry), name, step)
        .map_err(|e| crate::py_error(anyhow::Error::from(e)))?;
    Ok((step, dir.display().to_string()))
}

/// A consumer's lease on a live step (`tessera_ops::publish::lease`, the one writer of the
/// format): taken when made, removed by `release()` or when the object goes. Python's `live://`
/// loads hold one while they read (`tessera._live.Lease`).
#[pyclass(module = "tessera._tessera")]
pub struct StepLease {
    lease: Option<publish::lease::Lease>,
}

#[pymethods]
impl StepLease {
    /// Takes a lease on the step in `step_dir` for `seconds` (at most `MAX_LEASE_SECONDS`); an
    /// error (`OSError`) names the lease file when the registry cannot hold it.
    #[new]
    fn new(step_dir: &str, seconds: f64) -> PyResult<Self> {
        let lease = publish::lease::Lease::take(std::path::Path::new(step_dir), seconds)
            .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string()))?;
        Ok(Self { lease: Some(lease) })
    }

    /// The lease file (`None` once released).
    #[getter]
    fn path(&self) -> Option<String> {
        self.lease
            .as_ref()
            .and_then(|l| l.path())
            .map(|p| p.display().to_string())
    }

    /// Removes the lease file; releasing twice is fine.
    fn release(&mut self) -> PyResult<()> {
        match self.lease.take() {
            Some(lease) => lease
                .release()
                .map_err(|e| pyo3::exceptions::PyOSError::new_err(e.to_string())),
            None => Ok(()),
        }
    }
}

/// Rank 0 retires the step in `step_dir` (`tessera_ops::publish::retire`): its manifest goes,
/// and so do the directories of the publication's older retired steps beyond the newest few
/// that no lease holds. Returns the steps whose directories were removed.
#[pyfunction]
pub fn retire_step(step_dir: &str) -> PyResult<Vec<u64>> {
    publish::retire::retire_step(std::path::Path::new(step_dir))
        .map(|retired| retired.removed)
        .map_err(|e| crate::py_error(anyhow::Error::from(e)))
}

/// Whether a consumer's lease on the step in `step_dir` still runs (the publisher keeps serving
/// it).
#[pyfunction]
pub fn step_leased(step_dir: &str) -> bool {
    publish::lease::step_leased(
        std::path::Path::new(step_dir),
        publish::lease::unix_seconds(),
    )
}

/// Stops serving the file at `path` (a retired step); true when it was served. With
/// `reuse_memory`, its shared memory, if any, is kept for this process's next steps
/// ([`SPARE_SHARED_FILES`]); without (a consumer's lease still runs on the step), it is freed
/// once the last reader lets go, so what a consumer opened keeps its bytes.
#[pyfunction]
#[pyo3(signature = (path, reuse_memory=false))]
pub fn unpublish(path: &str, reuse_memory: bool) -> bool {
    let shared = shared_files()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .remove(path);
    let served = servers()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .values()
        .any(|server| server.remove(path));
    if let Some(file) = shared.filter(|_| reuse_memory) {
        keep_spare(file);
    }
    served
}

/// Test hook (`fault-injection` builds): flips the bits of byte `offset` of the file served at
/// `path`, as a damaged transfer or a publisher's memory error would; readers must fail naming
/// the publisher rank and tensor.
#[cfg(feature = "fault-injection")]
#[pyfunction]
pub fn damage_publication(path: &str, offset: usize) -> PyResult<()> {
    // A file shared as memory is damaged in place: what HTTP serves and what consumers on this
    // host read through their descriptors are the same pages.
    let shared = shared_files()
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get(path)
        .cloned();
    if let Some(file) = shared {
        if offset as u64 >= file.handle().size {
            return Err(crate::TesseraError::new_err(format!(
                "{path}: offset {offset} past its {} bytes",
                file.handle().size
            )));
        }
        return file
            .flip_byte(offset as u64)
            .map_err(|e| crate::TesseraError::new_err(format!("{path}: {e}")));
    }
    let servers = servers().lock().unwrap_or_else(PoisonError::into_inner);
    for server in servers.values() {
        if let Some(bytes) = server.get(path) {
            let mut damaged = bytes.to_vec();
            let Some(byte) = damaged.get_mut(offset) else {
                return Err(crate::TesseraError::new_err(format!(
                    "{path}: offset {offset} past its {} bytes",
                    bytes.len()
                )));
            };
            *byte ^= 0xff;
            server.serve(path, damaged.into());
            return Ok(());
        }
    }
    Err(crate::TesseraError::new_err(format!(
        "{path} is not served"
    )))
}

/// Test hook (`fault-injection` builds): holds (`hold=True`) or releases the requests for the
/// file served at `path`; returns how many requests this process's servers hold right now.
#[cfg(feature = "fault-injection")]
#[pyfunction]
#[pyo3(signature = (path, hold))]
pub fn hold_publication(path: &str, hold: bool) -> u64 {
    let servers = servers().lock().unwrap_or_else(PoisonError::into_inner);
    for server in servers.values() {
        if hold {
            server.hold(path);
        } else {
            server.release(path);
        }
    }
    servers.values().map(|s| s.held_requests()).sum()
}
