//! An opened checkpoint held by Python (`tessera._tessera.OpenedCheckpoint`): its metadata is read
//! once per `tessera.load` call (or once per `StorageReader`), then the state dict is checked
//! against it, its tensors are loaded and its non-tensor objects read, without opening it again.

use std::sync::Arc;

use anyhow::{Context, Result, anyhow};
use object_store::ObjectStoreExt;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tessera_loader::checkpoint::Checkpoint;
use tessera_metadata::BoxChecksum;
use tessera_storage::StorageOptions;

use crate::{py_error, runtime, storage_options};

/// A checkpoint opened for loading, in any format tessera reads.
#[pyclass(frozen, module = "tessera._tessera")]
pub struct OpenedCheckpoint {
    /// What the caller passed (path or URL), for messages.
    pub location: String,
    pub checkpoint: Arc<Checkpoint>,
    pub storage: StorageOptions,
}

/// Opens `checkpoint` (a path or URL) once to load it: manifest or `.metadata`, checksums, blob
/// index; a metadata-only checkpoint is refused (`tessera_ops::open::open_for_load`).
#[pyfunction]
#[pyo3(signature = (checkpoint, storage_env))]
pub fn open_checkpoint(
    py: Python<'_>,
    checkpoint: String,
    storage_env: Vec<(String, String)>,
) -> PyResult<OpenedCheckpoint> {
    let rt = runtime()?;
    let storage = storage_options(storage_env);
    let opened = py
        .detach(|| {
            rt.block_on(async {
                Ok::<_, anyhow::Error>(
                    tessera_ops::open::open_for_load(&checkpoint, &storage, None).await?,
                )
            })
        })
        .map_err(py_error)?;
    Ok(OpenedCheckpoint {
        location: checkpoint,
        checkpoint: Arc::new(opened),
        storage,
    })
}

#[pymethods]
impl OpenedCheckpoint {
    /// The path or URL it was opened from.
    #[getter]
    fn location(&self) -> &str {
        &self.location
    }

    /// What the open found that is not an error (files of an earlier save in the directory,
    /// ignored); `tessera.load` and the StorageReader raise them as warnings.
    #[getter]
    fn warnings(&self) -> Vec<String> {
        self.checkpoint.warnings.clone()
    }

    /// `native`, `dcp`, `safetensors`, ...
    #[getter]
    fn format(&self) -> String {
        self.checkpoint.format.to_string()
    }

    /// The training step, when the checkpoint records one.
    #[getter]
    fn step(&self) -> Option<u64> {
        self.checkpoint.step
    }

    /// What it holds, as JSON text: `{"tensors": {fqn: {"dtype", "shape"}}, "objects": [key]}`.
    fn entries(&self) -> PyResult<String> {
        let meta = &self.checkpoint.meta;
        let tensors: serde_json::Map<String, serde_json::Value> = meta
            .tensors()
            .iter()
            .map(|t| {
                (
                    t.fqn.clone(),
                    serde_json::json!({"dtype": t.dtype.to_string(), "shape": t.shape}),
                )
            })
            .collect();
        let objects: Vec<&str> = meta.objects().iter().map(|o| o.key.as_str()).collect();
        Ok(serde_json::json!({"tensors": tensors, "objects": objects}).to_string())
    }

    /// What a DCP checkpoint's `.metadata` records beyond tensors and objects, as JSON text:
    /// `{"version": str|null, "planner_data": {flat key: [path parts]}}`; `null` for other
    /// formats.
    fn dcp_record(&self) -> String {
        match &self.checkpoint.dcp_record {
            Some(record) => serde_json::json!({
                "version": record.version,
                "planner_data": record.planner_data,
            })
            .to_string(),
            None => "null".to_string(),
        }
    }

    /// Every tensor's saved boxes, as JSON text:
    /// `{fqn: {"dtype", "shape", "chunks": [[offsets, lengths], ...]}}` (tessera's dtype names).
    ///
    /// This is what a DCP `StorageReader` reports as `ChunkStorageMetadata`. DCP's planner needs
    /// chunks that do not overlap; every format's saved boxes are that already: opening a
    /// checkpoint validates that they are disjoint and cover the tensor, and flat-range saves
    /// (Megatron's distributed optimizer, DeepSpeed) are modelled as boxes.
    fn chunks(&self) -> String {
        let meta = &self.checkpoint.meta;
        let tensors: serde_json::Map<String, serde_json::Value> = meta
            .tensors()
            .iter()
            .enumerate()
            .map(|(index, t)| {
                let boxes: Vec<(&[u64], &[u64])> = meta
                    .chunks_of(index as u32)
                    .iter()
                    .map(|c| (&c.region.offsets[..], &c.region.lengths[..]))
                    .collect();
                (
                    t.fqn.clone(),
                    serde_json::json!({
                        "dtype": t.dtype.to_string(),
                        "shape": t.shape,
                        "chunks": boxes,
                    }),
                )
            })
            .collect();
        serde_json::Value::Object(tensors).to_string()
    }

    /// For each of `fqns`, a digest of the tensor's dtype, shape and saved boxes with their
    /// recorded checksums: in one process, equal digests mean the same boxes holding the same
    /// bytes as far as their checksums tell (delta loads compare two steps of a publication by
    /// them, tensor by tensor, without handing every box to Python). `None` for a tensor the
    /// checkpoint lacks or one with a box that records no checksum. Stable within a process only.
    fn box_digests(&self, fqns: Vec<String>) -> Vec<Option<String>> {
        use std::hash::{DefaultHasher, Hash, Hasher};
        let meta = &self.checkpoint.meta;
        fqns.iter()
            .map(|fqn| {
                let index = meta.tensor_index(fqn)?;
                let tensor = &meta.tensors()[index as usize];
                // Two independent 64-bit hashes: 128 bits between two steps' box lists.
                let mut hashers = [DefaultHasher::new(), DefaultHasher::new()];
                for (seed, h) in hashers.iter_mut().enumerate() {
                    (seed, tensor.dtype.to_string(), &tensor.shape).hash(h);
                }
                for chunk in meta.chunks_of(index) {
                    let sum = match chunk.checksum()? {
                        BoxChecksum::Crc32c(v) => (0u8, v),
                        BoxChecksum::Crc32(v) => (1u8, v),
                    };
                    for h in &mut hashers {
                        (&chunk.region.offsets, &chunk.region.lengths, sum).hash(h);
                    }
                }
                Some(format!(
                    "{:016x}{:016x}",
                    hashers[0].finish(),
                    hashers[1].finish()
                ))
            })
            .collect()
    }

    /// The stored bytes of the non-tensor objects `keys` (in that order), each checked against
    /// its crc32c where the format records one. A key the checkpoint does not hold is an error
    /// naming it.
    fn read_objects<'py>(
        &self,
        py: Python<'py>,
        keys: Vec<String>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let rt = runtime()?;
        let read = py
            .detach(|| rt.block_on(read_objects(&self.location, &self.checkpoint, &keys)))
            .map_err(py_error)?;
        Ok(read.iter().map(|b| PyBytes::new(py, b)).collect())
    }
}

async fn read_objects(
    location: &str,
    checkpoint: &Checkpoint,
    keys: &[String],
) -> Result<Vec<bytes::Bytes>> {
    let meta = &checkpoint.meta;
    let mut out = Vec::with_capacity(keys.len());
    for key in keys {
        let Some(object) = meta.objects().iter().find(|o| &o.key == key) else {
            return Err(anyhow!(
                "object {key:?} is not in checkpoint {location} ({} objects)",
                meta.objects().len()
            ));
        };
        let path = checkpoint.file_path(object.file)?;
        let file = &meta.files()[object.file as usize];
        let bytes = checkpoint
            .location
            .store
            .get_range(&path, object.offset..object.offset + object.length)
            .await
            .with_context(|| {
                format!(
                    "reading object {key} (bytes {}..{} of {}) from {location}",
                    object.offset,
                    object.offset + object.length,
                    file.path
                )
            })?;
        if bytes.len() as u64 != object.length {
            return Err(anyhow!(
                "object {key}: {} returned {} bytes for a {}-byte range",
                file.path,
                bytes.len(),
                object.length
            ));
        }
        if let Some(expected) = object.crc32c {
            let actual = crc32c::crc32c(&bytes);
            if actual != expected {
                return Err(anyhow!(
                    "object {key} in {} of {location}: crc32c {actual:#010x} but the metadata records {expected:#010x} (corrupt)",
                    file.path
                ));
            }
        }
        out.push(bytes);
    }
    Ok(out)
}
