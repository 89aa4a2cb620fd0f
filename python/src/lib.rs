//! The native module (`tessera._tessera`) of the tessera Python package: loading a checkpoint
//! (native, PyTorch DCP, safetensors; local or object store) into memory a running job already
//! owns, planning, inspecting and saving. The Python layer (`python/tessera/__init__.py`) turns
//! state dicts (NumPy arrays, torch tensors, DTensors) into the flat descriptions these functions
//! take; everything that touches storage, plans or other ranks is the Rust loader's.
//!
//! Every function releases the GIL while it works and runs on one process-wide tokio runtime.
//! Errors are `tessera.TesseraError` with the loader's message (it names the file, tensor, rank or
//! field).

mod checkpoint;
mod load;
mod memory;
mod save;

use std::sync::OnceLock;

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
    m.add_function(wrap_pyfunction!(load::plan, m)?)?;
    m.add_function(wrap_pyfunction!(load::load_into, m)?)?;
    m.add_function(wrap_pyfunction!(save::save, m)?)?;
    Ok(())
}
