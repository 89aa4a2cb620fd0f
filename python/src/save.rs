//! `tessera.save`: a native checkpoint written from the ranks that hold the data.
//!
//! Every rank says which boxes it holds (all-gathered when the job has several ranks). A box held
//! by several ranks (data-parallel replicas) is written once, by the lowest of them. Each rank
//! writes its boxes to its own data file (`data/rank-<r>.bin`) and sends what it wrote to rank 0,
//! which commits (metadata, checksums, manifest last) and tells every rank the outcome. A failure
//! anywhere leaves no manifest: the directory never shows as a checkpoint.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use anyhow::{Context, Result, anyhow, bail};
use bytes::Bytes;
use pyo3::prelude::*;
use serde::{Deserialize, Serialize};
use tessera_loader::transport::{Transport, TransportOptions};
use tessera_metadata::formats::native::{NativeWriter, WriteOptions, WrittenFile};
use tessera_metadata::{DType, TensorBox, TensorMeta};
use tessera_storage as storage;

use crate::memory::HostMemory;
use crate::{coord, py_error, runtime, storage_options};

/// One held box as the Python layer describes it:
/// `(fqn, dtype, global_shape, offsets, address, nbytes)`; the box's lengths are what the bytes
/// hold, given separately as `lengths`.
type BoxTuple = (String, String, Vec<u64>, Vec<u64>, Vec<u64>, usize, usize);

/// What a rank holds, as the other ranks learn it.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct Held {
    boxes: Vec<HeldBox>,
    objects: Vec<String>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
struct HeldBox {
    fqn: String,
    dtype: String,
    shape: Vec<u64>,
    offsets: Vec<u64>,
    lengths: Vec<u64>,
}

/// The checkpoint's tensors (sorted by name) from every rank's boxes; ranks must agree on each
/// tensor's dtype and shape.
fn global_tensors(all: &[Held]) -> Result<Vec<TensorMeta>> {
    let mut tensors: BTreeMap<&str, (DType, &[u64], usize)> = BTreeMap::new();
    for (rank, held) in all.iter().enumerate() {
        for b in &held.boxes {
            let dtype = DType::parse(&b.dtype)
                .map_err(|_| anyhow!("tensor {}: tessera has no dtype {}", b.fqn, b.dtype))?;
            match tensors.get(b.fqn.as_str()) {
                None => {
                    tensors.insert(&b.fqn, (dtype, &b.shape, rank));
                }
                Some(&(d, shape, first)) if d != dtype || shape != b.shape.as_slice() => bail!(
                    "tensor {}: rank {first} saves it as {d} of shape {shape:?} but rank {rank} as {dtype} of shape {:?}",
                    b.fqn,
                    b.shape
                ),
                Some(_) => {}
            }
        }
    }
    Ok(tensors
        .into_iter()
        .map(|(fqn, (dtype, shape, _))| TensorMeta::new(fqn, dtype, shape.to_vec()))
        .collect())
}

/// The lowest rank holding each distinct box and object: the one that writes it.
fn writers(all: &[Held]) -> (HashMap<&HeldBox, usize>, HashMap<&str, usize>) {
    let mut boxes = HashMap::new();
    let mut objects = HashMap::new();
    for (rank, held) in all.iter().enumerate() {
        for b in &held.boxes {
            boxes.entry(b).or_insert(rank);
        }
        for key in &held.objects {
            objects.entry(key.as_str()).or_insert(rank);
        }
    }
    (boxes, objects)
}

/// A rank's file for rank 0, or why it has none.
type FileReport = Result<Option<WrittenFile>, String>;

/// Everything one `save` call needs, owned.
struct SaveJob {
    path: String,
    boxes: Vec<BoxTuple>,
    objects: Vec<(String, Vec<u8>)>,
    rank: u32,
    world: u32,
    rendezvous: Option<(String, u16)>,
    step: Option<u64>,
    storage: storage::StorageOptions,
    timeout: Duration,
}

async fn run_save(job: SaveJob) -> Result<String> {
    let mut held = Held {
        boxes: Vec::with_capacity(job.boxes.len()),
        objects: job.objects.iter().map(|(k, _)| k.clone()).collect(),
    };
    let mut memory = Vec::with_capacity(job.boxes.len());
    for (fqn, dtype, shape, offsets, lengths, address, nbytes) in job.boxes {
        // SAFETY: the Python layer passes the data address and byte length of a C-contiguous
        // array it keeps referenced until this call returns; it is only read.
        #[allow(unsafe_code)]
        let m = unsafe { HostMemory::new(address, nbytes) }
            .ok_or_else(|| anyhow!("tensor {fqn}: null data address"))?;
        memory.push(m);
        held.boxes.push(HeldBox {
            fqn,
            dtype,
            shape,
            offsets,
            lengths,
        });
    }

    match &job.rendezvous {
        Some((addr, port)) if job.world > 1 => {
            let transport = coord::connect(job.rank, job.world, addr, *port, job.timeout).await?;
            let all =
                coord::all_gather_json(&transport, coord::TAG_SAVE_BOXES, &held, "boxes").await?;
            save_as_rank(
                &job.path,
                &job.storage,
                job.step,
                &all,
                &job.objects,
                &memory,
                &transport,
            )
            .await
        }
        _ if job.world > 1 => bail!(
            "saving from {} ranks needs a rendezvous (MASTER_ADDR and a port) so that rank 0 can commit what every rank wrote",
            job.world
        ),
        _ => {
            let mut mesh = tessera_loader::transport::InProcTransport::mesh(
                1,
                TransportOptions::with_timeout(job.timeout),
            );
            let transport = mesh
                .pop()
                .ok_or_else(|| anyhow!("no in-process transport"))?;
            save_as_rank(
                &job.path,
                &job.storage,
                job.step,
                &[held],
                &job.objects,
                &memory,
                &transport,
            )
            .await
        }
    }
}

/// Writes this rank's share and takes part in the commit; returns the manifest as JSON text.
async fn save_as_rank<T: Transport>(
    path: &str,
    storage_options: &storage::StorageOptions,
    step: Option<u64>,
    all: &[Held],
    objects: &[(String, Vec<u8>)],
    memory: &[HostMemory],
    transport: &T,
) -> Result<String> {
    let (rank, world) = (transport.rank(), transport.world());
    let written: Result<(NativeWriter, Option<WrittenFile>)> = async {
        let tensors = global_tensors(all)?;
        let location = storage::create_with(path, storage_options)?;
        let writer = NativeWriter::create(
            location.store.clone(),
            location.prefix.clone(),
            tensors,
            WriteOptions {
                step,
                ..WriteOptions::default()
            },
        )
        .await
        .with_context(|| format!("starting checkpoint {path}"))?;
        let index: HashMap<&str, u32> = writer
            .tensors()
            .iter()
            .enumerate()
            .map(|(i, t)| (t.fqn.as_str(), i as u32))
            .collect();
        let (box_writers, object_writers) = writers(all);
        let mine = &all[rank as usize];
        let owned: Vec<usize> = (0..mine.boxes.len())
            .filter(|&i| box_writers.get(&mine.boxes[i]) == Some(&(rank as usize)))
            .collect();
        let owned_objects: Vec<&(String, Vec<u8>)> = objects
            .iter()
            .filter(|(k, _)| object_writers.get(k.as_str()) == Some(&(rank as usize)))
            .collect();
        if owned.is_empty() && owned_objects.is_empty() {
            return Ok((writer, None));
        }
        let mut file = writer.data_file(&format!("rank-{rank}"))?;
        for i in owned {
            let b = &mine.boxes[i];
            let tensor = index[b.fqn.as_str()];
            let region = TensorBox::new(b.offsets.clone(), b.lengths.clone());
            file.write_box(tensor, region, memory[i].as_ref())
                .await
                .with_context(|| format!("writing tensor {} at offsets {:?}", b.fqn, b.offsets))?;
        }
        for (key, bytes) in owned_objects {
            file.write_object(key, bytes)
                .await
                .with_context(|| format!("writing object {key}"))?;
        }
        let file = file.finish().await?;
        Ok((writer, Some(file)))
    }
    .await;

    if rank != 0 {
        let report: FileReport = match &written {
            Ok((_, file)) => Ok(file.clone()),
            Err(e) => Err(format!("{e:#}")),
        };
        transport
            .send(
                0,
                coord::TAG_SAVE_FILES,
                Bytes::from(serde_json::to_vec(&report)?),
            )
            .await?;
        let outcome = transport.recv(0, coord::TAG_SAVE_DONE).await?;
        let outcome: Result<String, String> = serde_json::from_slice(&outcome)?;
        written?;
        return outcome.map_err(|e| anyhow!("{e}"));
    }

    // Rank 0: gather every rank's file, commit when all wrote, tell everyone.
    let mut files = Vec::new();
    let mut failures = Vec::new();
    for peer in 1..world {
        let report = transport.recv(peer, coord::TAG_SAVE_FILES).await;
        match report.map_err(anyhow::Error::from).and_then(|bytes| {
            serde_json::from_slice::<FileReport>(&bytes).map_err(anyhow::Error::from)
        }) {
            Ok(Ok(file)) => files.extend(file),
            Ok(Err(e)) => failures.push(format!("rank {peer}: {e}")),
            Err(e) => failures.push(format!("rank {peer}: {e:#}")),
        }
    }
    let outcome: Result<String> = match written {
        Err(e) => Err(e.context("rank 0")),
        Ok(_) if !failures.is_empty() => Err(anyhow!(
            "not committed, ranks failed: {}",
            failures.join("; ")
        )),
        Ok((writer, file)) => {
            files.extend(file);
            writer
                .commit(files)
                .await
                .with_context(|| format!("committing checkpoint {path}"))
                .and_then(|manifest| Ok(serde_json::to_string(&manifest)?))
        }
    };
    let message: Result<&String, String> = outcome.as_ref().map_err(|e| format!("{e:#}"));
    let message = Bytes::from(serde_json::to_vec(&message)?);
    for peer in 1..world {
        // A rank that already gave up cannot be told; the others still are.
        let _ = transport
            .send(peer, coord::TAG_SAVE_DONE, message.clone())
            .await;
    }
    outcome
}

/// Saves boxes (and byte objects) as a native checkpoint at `path`; returns its manifest as JSON.
#[pyfunction]
#[pyo3(signature = (path, boxes, objects, rank, world, rendezvous, step, storage_env, timeout_s))]
#[allow(clippy::too_many_arguments)]
pub fn save(
    py: Python<'_>,
    path: String,
    boxes: Vec<BoxTuple>,
    objects: Vec<(String, Vec<u8>)>,
    rank: u32,
    world: u32,
    rendezvous: Option<(String, u16)>,
    step: Option<u64>,
    storage_env: Vec<(String, String)>,
    timeout_s: f64,
) -> PyResult<String> {
    let rt = runtime()?;
    let job = SaveJob {
        path,
        boxes,
        objects,
        rank,
        world,
        rendezvous,
        step,
        storage: storage_options(storage_env),
        timeout: Duration::from_secs_f64(timeout_s.max(0.001)),
    };
    py.detach(|| rt.block_on(run_save(job))).map_err(py_error)
}
