//! The native module (`tessera._tessera`) of the tessera Python package: loading a checkpoint
//! (native, PyTorch DCP, safetensors; local or object store) into memory a running job already
//! owns, planning, inspecting and saving. The Python layer (`python/tessera/__init__.py`) turns
//! state dicts (NumPy arrays, torch tensors, DTensors) into the typed records these functions
//! take (`records`: an entry to load into, a box a save holds; `LoadRequest`, `SaveRequest`);
//! everything that touches storage, plans or other ranks is the Rust loader's.
//!
//! Every function releases the GIL while it works and runs on one process-wide tokio runtime.
//! Errors are `tessera.TesseraError` with the loader's message (it names the file, tensor, rank or
//! field).

mod checkpoint;
mod group;
mod load;
mod memory;
mod publish;
mod records;
mod save;

use std::future::Future;
use std::sync::OnceLock;
use std::time::Duration;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use tessera_storage::StorageOptions;

create_exception!(
    _tessera,
    TesseraError,
    PyException,
    "An error of tessera: bad checkpoint, mismatching request, storage, server or peer failure."
);

/// The runtime every call runs on: created on first use, shared by all calls.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    if let Some(rt) = RUNTIME.get() {
        return Ok(rt);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("tessera")
        .build()
        .map_err(|e| TesseraError::new_err(format!("starting the tessera runtime: {e}")))?;
    Ok(RUNTIME.get_or_init(|| rt))
}

/// An `anyhow` error as a `TesseraError`, with its whole context chain.
fn py_error(error: anyhow::Error) -> PyErr {
    TesseraError::new_err(format!("{error:#}"))
}

/// Runs `work` on the runtime with the GIL released, checking for signals every 100 ms: Ctrl-C
/// (`KeyboardInterrupt`) or another signal handler's exception stops the wait and is raised,
/// dropping the work. Dropping it is safe for caller-owned memory: the loader writes into the
/// caller's arrays only from within this future, never from tasks that outlive it.
fn block_on<T: Send>(
    py: Python<'_>,
    work: impl Future<Output = anyhow::Result<T>> + Send,
) -> PyResult<T> {
    block_on_cancellable(py, None, work)
}

/// A reason to stop a wait, set from another thread (the process-group load's failure
/// agreement: another rank failed, so this rank's read is abandoned within 100 ms).
#[derive(Default)]
pub(crate) struct Cancel(std::sync::Mutex<Option<String>>);

impl Cancel {
    /// Stops the wait, for `reason` (the first reason given is kept).
    pub(crate) fn cancel(&self, reason: String) {
        let mut slot = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        slot.get_or_insert(reason);
    }

    /// The reason, once cancelled.
    pub(crate) fn reason(&self) -> Option<String> {
        self.0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// [`block_on`], also stopping (with `TesseraError(reason)`) as soon as `cancel` is set.
fn block_on_cancellable<T: Send>(
    py: Python<'_>,
    cancel: Option<&Cancel>,
    work: impl Future<Output = anyhow::Result<T>> + Send,
) -> PyResult<T> {
    let rt = runtime()?;
    py.detach(|| {
        rt.block_on(async {
            let mut work = std::pin::pin!(work);
            let mut tick = tokio::time::interval(Duration::from_millis(100));
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    done = &mut work => return done.map_err(py_error),
                    _ = tick.tick() => {
                        Python::attach(|py| py.check_signals())?;
                        if let Some(reason) = cancel.and_then(Cancel::reason) {
                            return Err(py_error(anyhow::anyhow!(reason)));
                        }
                    }
                }
            }
        })
    })
}

/// Storage options from the `storage_options` mapping of the Python API.
fn storage_options(env: Vec<(String, String)>) -> StorageOptions {
    StorageOptions {
        env,
        ignore_process_env: false,
        ..StorageOptions::default()
    }
}

/// What `tessera inspect --json` prints, as JSON text.
#[pyfunction]
#[pyo3(signature = (checkpoint, storage_env))]
fn inspect(
    py: Python<'_>,
    checkpoint: String,
    storage_env: Vec<(String, String)>,
) -> PyResult<String> {
    let rt = runtime()?;
    let options = storage_options(storage_env);
    py.detach(|| {
        rt.block_on(tessera_ops::describe::describe(&checkpoint, &options))
            .map(|doc| doc.to_string())
            .map_err(anyhow::Error::from)
    })
    .map_err(py_error)
}

/// tessera's name of a dtype given by any of its names (`float32`, `torch.bfloat16`, `F16`), or
/// `None` when tessera has no such dtype.
#[pyfunction]
fn canonical_dtype(name: &str) -> Option<&'static str> {
    tessera_metadata::DType::parse(name).ok().map(|d| d.name())
}

/// The package version (the crate's).
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The `tessera._tessera` module.
#[pymodule]
fn _tessera(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TesseraError", m.py().get_type::<TesseraError>())?;
    m.add_function(wrap_pyfunction!(inspect, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_class::<checkpoint::OpenedCheckpoint>()?;
    m.add_function(wrap_pyfunction!(checkpoint::open_checkpoint, m)?)?;
    m.add_class::<group::GroupLoad>()?;
    m.add_class::<group::GroupExchange>()?;
    m.add_class::<group::ExchangeAction>()?;
    m.add_class::<group::JobAction>()?;
    m.add_function(wrap_pyfunction!(group::group_load, m)?)?;
    m.add_function(wrap_pyfunction!(canonical_dtype, m)?)?;
    m.add_function(wrap_pyfunction!(load::plan, m)?)?;
    m.add_class::<records::LoadTarget>()?;
    m.add_class::<load::LoadRequest>()?;
    m.add_function(wrap_pyfunction!(load::load_into, m)?)?;
    m.add_function(wrap_pyfunction!(load::rendezvous_endpoint, m)?)?;
    m.add_class::<records::HeldBox>()?;
    m.add_class::<save::SaveRequest>()?;
    m.add_function(wrap_pyfunction!(save::save, m)?)?;
    m.add_class::<publish::PublishRequest>()?;
    m.add_function(wrap_pyfunction!(publish::publish_part, m)?)?;
    m.add_function(wrap_pyfunction!(publish::commit_publication, m)?)?;
    m.add_function(wrap_pyfunction!(publish::unpublish, m)?)?;
    m.add_function(wrap_pyfunction!(publish::resolve_live, m)?)?;
    m.add_class::<publish::StepLease>()?;
    m.add_function(wrap_pyfunction!(publish::step_leased, m)?)?;
    m.add_function(wrap_pyfunction!(publish::retire_step, m)?)?;
    m.add(
        "MAX_LEASE_SECONDS",
        tessera_ops::publish::lease::MAX_LEASE_SECONDS,
    )?;
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(publish::damage_publication, m)?)?;
    #[cfg(feature = "fault-injection")]
    m.add_function(wrap_pyfunction!(publish::hold_publication, m)?)?;
    Ok(())
}
