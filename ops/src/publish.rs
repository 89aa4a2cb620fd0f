//! Live publications (`tessera.publish`): a step of a running job's state, readable by other
//! jobs as a native checkpoint whose data files stay in the publishing processes' memory.
//!
//! ```text
//! <registry>/<name>/latest                    "step-000100", moved after each commit
//! <registry>/<name>/step-000100/
//! ├── parts/rank-<r>.json     each publisher rank's part, written atomically (temp + rename):
//! │                           its boxes, its data file as laid out (offsets, block and box
//! │                           crc32c) and the URL it serves it at
//! ├── metadata.arrow          ┐ rank 0, once every rank's part is there: the ordinary native
//! ├── checksums.arrow         │ commit of those files (data/publisher-rank-<r>.bin), so the
//! ├── publishers.json         │ checksums readers verify are the ones recorded at snapshot time
//! ├── durable.json            │ optional (`publish(durable=)`, rank 0, before its part): a
//! │                           │ checkpoint of the same step on storage, `{"name", "step",
//! │                           │ "checkpoint"}`, which a load falls back to when a publisher dies
//! └── manifest.json           ┘ written last: the step is complete (readable) from here on
//! ```
//!
//! Each rank lays its boxes out as its data file would hold them ([`write_part_file`]: the
//! native writer into memory, so offsets, 4 KiB alignment, block crc32c and per-box crc32c are
//! the format's own) and serves those bytes itself (`tessera_storage::RangeServer` over HTTP,
//! and to consumers on its host as shared memory, `tessera_storage::shared_file`); nothing
//! passes between publisher ranks but the registry's files, so a publication needs no
//! rendezvous and never uses the job's process group from a background thread. A reader opens a
//! complete step as `live+file://<step dir>` (`tessera_storage::LiveStore`) and loads it with
//! the ordinary plan, verified reads and exchange.
//!
//! A step stays incomplete (no manifest) until every rank's part is there; [`missing_ranks`]
//! says which ranks a reader is waiting for.

pub mod lease;
pub mod listing;
pub mod retire;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path as FsPath;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::memory::InMemory;
use object_store::path::Path;
use serde::{Deserialize, Serialize};
use tessera_metadata::TensorBox;
use tessera_metadata::formats::native::{
    Manifest, MemorySink, NativeWriter, WriteOptions, WrittenFile,
};
use tessera_storage::PUBLISHERS_FILE;
use tessera_storage::shared_file::{SharedFile, SharedFileWriter};

use crate::save::{HeldBox, Holdings, global_tensors};
use crate::{OpsError, ResultExt};

/// Folder of the ranks' parts in a step directory.
pub const PARTS_DIR: &str = "parts";
/// Largest part file read (its boxes and block checksums: a few MB for a huge shard).
const MAX_PART_BYTES: u64 = 256 * 1024 * 1024;
/// How often rank 0 looks for the other ranks' parts while it waits for them.
const PART_POLL: Duration = Duration::from_millis(20);

/// One publisher rank's part of a step.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Part {
    /// The publisher rank.
    pub rank: u32,
    /// The publishing job's ranks.
    pub world: u32,
    /// The step.
    pub step: u64,
    /// The origin its server listens at, `http://host:port`.
    pub url: String,
    /// The data file's path on that server.
    pub path: String,
    /// Its boxes (and object keys), as the step's tensors are assembled from.
    pub holdings: Holdings,
    /// Its data file as laid out: size, block crc32c, each box's byte range and crc32c.
    pub file: WrittenFile,
    /// How a consumer on the publisher's host opens the data file as shared memory instead of
    /// reading it over HTTP (`tessera_storage::shared_file`); `None`: HTTP only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared: Option<tessera_storage::shared_file::SharedHandle>,
}

/// The data file name (without `data/` and `.bin`) of publisher rank `rank`: named so that a
/// reader's error about the file names the publisher rank.
pub fn data_file_name(rank: u32) -> String {
    format!("publisher-rank-{rank}")
}

/// Where a publisher rank lays its data file out.
#[derive(Debug)]
pub enum PartMemory {
    /// A buffer of this process, served over HTTP only.
    Heap,
    /// Shared memory named after `tag` (`tessera_storage::shared_file`), served over HTTP and
    /// opened by consumers on this host; the heap where the kernel offers none.
    Shared {
        /// What the memfd's name starts with (`/proc/<pid>/fd/<n>` shows it).
        tag: String,
    },
    /// The shared memory of a retired step, rewritten from its start
    /// ([`SharedFile::into_writer`]): its pages are already faulted in.
    Reused(SharedFileWriter),
}

/// A publisher rank's data file as laid out.
#[derive(Clone, Debug)]
pub enum PartBytes {
    /// In this process's heap.
    Heap(Bytes),
    /// In shared memory.
    Shared(Arc<SharedFile>),
}

impl PartBytes {
    /// The file's bytes, for the range server (no copy).
    pub fn bytes(&self) -> Bytes {
        match self {
            PartBytes::Heap(bytes) => bytes.clone(),
            PartBytes::Shared(file) => file.bytes(),
        }
    }

    /// The shared file, when it is one.
    pub fn shared(&self) -> Option<&Arc<SharedFile>> {
        match self {
            PartBytes::Heap(_) => None,
            PartBytes::Shared(file) => Some(file),
        }
    }
}

/// The writer's sink for a data file laid out straight into shared memory.
#[derive(Debug)]
struct SharedSink(SharedFileWriter);

impl MemorySink for SharedSink {
    fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.0.append(data)
    }

    fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
        self
    }
}

/// Lays out `boxes` (whose bytes are `data`, row-major) and `objects` as the data file of
/// publisher rank `rank`, in `memory` (each byte copied once, checksums taken on the way);
/// returns the file and what the commit needs of it.
pub async fn write_part_file(
    rank: u32,
    boxes: &[HeldBox],
    data: &[&[u8]],
    objects: &[(String, Vec<u8>)],
    memory: PartMemory,
) -> Result<(PartBytes, WrittenFile), OpsError> {
    if boxes.len() != data.len() {
        return Err(OpsError::invalid(format!(
            "rank {rank}: {} boxes but {} byte buffers",
            boxes.len(),
            data.len()
        )));
    }
    let holdings = Holdings {
        boxes: boxes.to_vec(),
        objects: objects.iter().map(|(k, _)| k.clone()).collect(),
    };
    let tensors = global_tensors(std::slice::from_ref(&holdings))?;
    let index: HashMap<&str, u32> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.fqn.as_str(), i as u32))
        .collect();
    let store = Arc::new(InMemory::new());
    let prefix = Path::from("publication");
    let writer = NativeWriter::create(
        store.clone(),
        prefix.clone(),
        tensors.clone(),
        WriteOptions::default(),
    )
    .await?;
    let name = data_file_name(rank);
    // A memfd where the kernel offers one; the heap otherwise (the part then says HTTP only).
    let shared = match memory {
        PartMemory::Shared { tag } => SharedFileWriter::new(&tag).ok(),
        PartMemory::Reused(writer) => Some(writer),
        PartMemory::Heap => None,
    };
    let into_shared = shared.is_some();
    let mut file = match shared {
        Some(sink) => writer.data_file_into(&name, Box::new(SharedSink(sink)))?,
        None => {
            // Each box's bytes plus its alignment, the objects after them, reserved up front.
            let capacity = data
                .iter()
                .map(|d| d.len().next_multiple_of(4096))
                .chain(objects.iter().map(|(_, o)| o.len().next_multiple_of(4096)))
                .sum();
            writer.data_file_in_memory(&name, capacity)?
        }
    };
    for (b, bytes) in boxes.iter().zip(data) {
        let tensor = index.get(b.fqn.as_str()).copied().ok_or_else(|| {
            OpsError::invalid(format!("rank {rank}: tensor {} is not listed", b.fqn))
        })?;
        let region = TensorBox::new(b.offsets.clone(), b.lengths.clone());
        file.write_box(tensor, region, bytes)
            .await
            .with_context(|| format!("publishing tensor {} at offsets {:?}", b.fqn, b.offsets))?;
    }
    for (key, bytes) in objects {
        file.write_object(key, bytes)
            .await
            .with_context(|| format!("publishing object {key}"))?;
    }
    if into_shared {
        let (sink, written) = file.finish_into::<SharedSink>()?;
        let shared = sink.0.finish().map_err(|e| {
            OpsError::invalid(format!("rank {rank}: mapping its shared memory: {e}"))
        })?;
        return Ok((PartBytes::Shared(shared), written));
    }
    let (bytes, written) = file.finish_in_memory()?;
    Ok((PartBytes::Heap(bytes), written))
}

fn io_error(what: &str, path: &FsPath, e: std::io::Error) -> OpsError {
    OpsError::invalid(format!("{what} {}: {e}", path.display()))
}

/// Writes `part` as `<step_dir>/parts/rank-<r>.json`, atomically (a temporary file renamed), so
/// a reader never sees half a part.
pub fn write_part(step_dir: &FsPath, part: &Part) -> Result<(), OpsError> {
    let dir = step_dir.join(PARTS_DIR);
    std::fs::create_dir_all(&dir).map_err(|e| io_error("creating", &dir, e))?;
    let json = serde_json::to_vec(part)
        .map_err(|e| OpsError::invalid(format!("encoding rank {}'s part: {e}", part.rank)))?;
    let path = dir.join(format!("rank-{}.json", part.rank));
    let temp = dir.join(format!(
        ".rank-{}.json.{}.tmp",
        part.rank,
        std::process::id()
    ));
    std::fs::write(&temp, json).map_err(|e| io_error("writing", &temp, e))?;
    std::fs::rename(&temp, &path).map_err(|e| io_error("renaming into", &path, e))
}

/// The parts present in `step_dir`, by rank (temporary files skipped).
pub fn read_parts(step_dir: &FsPath) -> Result<BTreeMap<u32, Part>, OpsError> {
    let dir = step_dir.join(PARTS_DIR);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => return Err(io_error("listing", &dir, e)),
    };
    let mut parts = BTreeMap::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_error("listing", &dir, e))?;
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with("rank-") && name.ends_with(".json")) {
            continue;
        }
        let path = entry.path();
        let size = entry
            .metadata()
            .map_err(|e| io_error("reading", &path, e))?
            .len();
        if size > MAX_PART_BYTES {
            return Err(OpsError::invalid(format!(
                "{}: {size} bytes, over the cap of {MAX_PART_BYTES}",
                path.display()
            )));
        }
        let bytes = std::fs::read(&path).map_err(|e| io_error("reading", &path, e))?;
        let part: Part = serde_json::from_slice(&bytes)
            .map_err(|e| OpsError::invalid(format!("{}: not a part: {e}", path.display())))?;
        parts.insert(part.rank, part);
    }
    Ok(parts)
}

/// The ranks of a `world`-rank publication whose parts `parts` lacks.
pub fn missing_ranks(parts: &BTreeMap<u32, Part>, world: u32) -> Vec<u32> {
    (0..world).filter(|r| !parts.contains_key(r)).collect()
}

/// Rank 0: waits (up to `wait`) until every one of the `world` ranks' parts of `step` is in
/// `step_dir`, then commits the step ([`commit_step`]). Fails naming the ranks whose parts did
/// not come, or a part that disagrees on the step or the world.
pub async fn await_and_commit(
    step_dir: &FsPath,
    world: u32,
    step: u64,
    wait: Duration,
) -> Result<Manifest, OpsError> {
    let deadline = Instant::now() + wait;
    let parts = loop {
        let parts = read_parts(step_dir)?;
        for part in parts.values() {
            if part.world != world || part.step != step {
                return Err(OpsError::invalid(format!(
                    "{}: rank {}'s part is of step {} of a {}-rank publication, this is step {step} of {world} ranks",
                    step_dir.display(),
                    part.rank,
                    part.step,
                    part.world
                )));
            }
        }
        let missing = missing_ranks(&parts, world);
        if missing.is_empty() {
            break parts;
        }
        if Instant::now() >= deadline {
            return Err(OpsError::invalid(format!(
                "step {step} at {} is not complete: within {:.1} s publisher ranks {missing:?} of {world} did not publish it (parts present: ranks {:?})",
                step_dir.display(),
                wait.as_secs_f64(),
                parts.keys().collect::<Vec<_>>()
            )));
        }
        tokio::time::sleep(PART_POLL).await;
    };
    let parts: Vec<Part> = parts.into_values().collect();
    commit_step(step_dir, &parts, step).await
}

/// Commits a step from every rank's part: the step's tensors from every rank's boxes, each
/// distinct box once (a replica is read from the lowest rank holding it), then the native
/// commit (metadata, block checksums), `publishers.json`, and the manifest last.
pub async fn commit_step(
    step_dir: &FsPath,
    parts: &[Part],
    step: u64,
) -> Result<Manifest, OpsError> {
    let all: Vec<Holdings> = parts.iter().map(|p| p.holdings.clone()).collect();
    let tensors = global_tensors(&all)?;
    let global: HashMap<&str, u32> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.fqn.as_str(), i as u32))
        .collect();
    let mut seen: HashSet<(u32, TensorBox)> = HashSet::new();
    let mut files = Vec::with_capacity(parts.len());
    for part in parts {
        // The tensor list this rank's writer numbered its chunks by.
        let local = global_tensors(std::slice::from_ref(&part.holdings))?;
        let mut file = part.file.clone();
        let mut unknown = None;
        file.reindex_chunks(|chunk| {
            let Some(t) = local
                .get(chunk.tensor as usize)
                .and_then(|t| global.get(t.fqn.as_str()))
            else {
                unknown = Some(chunk.tensor);
                return None;
            };
            seen.insert((*t, chunk.region.clone())).then_some(*t)
        });
        if let Some(tensor) = unknown {
            return Err(OpsError::invalid(format!(
                "publisher rank {}: its data file names tensor {tensor}, which its boxes do not list",
                part.rank
            )));
        }
        files.push(file);
    }
    let location = step_dir.display().to_string();
    let loc = tessera_storage::create_with(&location, &tessera_storage::StorageOptions::default())?;
    let writer = NativeWriter::create(
        loc.store.clone(),
        loc.prefix.clone(),
        tensors,
        WriteOptions {
            step: Some(step),
            ..WriteOptions::default()
        },
    )
    .await
    .with_context(|| format!("committing step {step} at {location}"))?;
    let prepared = writer
        .prepare(files)
        .await
        .with_context(|| format!("committing step {step} at {location}"))?;
    let publishers: Vec<serde_json::Value> = parts
        .iter()
        .map(|p| {
            let mut entry = serde_json::json!({
                "rank": p.rank,
                "file": p.file.path(),
                "url": p.url,
                "path": p.path,
            });
            if let Some(shared) = &p.shared {
                entry["shared"] = serde_json::json!(shared);
            }
            entry
        })
        .collect();
    let json = serde_json::to_vec_pretty(&serde_json::json!({ "publishers": publishers }))
        .map_err(|e| OpsError::invalid(format!("encoding {PUBLISHERS_FILE}: {e}")))?;
    let path = step_dir.join(PUBLISHERS_FILE);
    let temp = step_dir.join(format!(".{PUBLISHERS_FILE}.{}.tmp", std::process::id()));
    std::fs::write(&temp, json).map_err(|e| io_error("writing", &temp, e))?;
    std::fs::rename(&temp, &path).map_err(|e| io_error("renaming into", &path, e))?;
    prepared
        .commit()
        .await
        .with_context(|| format!("committing step {step} at {location}"))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn row_box(rank: u64) -> HeldBox {
        HeldBox {
            fqn: "w".to_string(),
            dtype: "f32".to_string(),
            shape: vec![4, 2],
            offsets: vec![rank * 2, 0],
            lengths: vec![2, 2],
        }
    }

    async fn part(rank: u32, world: u32, values: &[f32]) -> Part {
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let boxes = vec![row_box(u64::from(rank))];
        let (_, file) = write_part_file(rank, &boxes, &[&bytes], &[], PartMemory::Heap)
            .await
            .unwrap();
        Part {
            rank,
            world,
            step: 7,
            url: "http://127.0.0.1:1".to_string(),
            path: format!("m/step-000007/data/publisher-rank-{rank}.bin"),
            holdings: Holdings {
                boxes,
                objects: Vec::new(),
            },
            file,
            shared: None,
        }
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_part_laid_out_in_shared_memory_is_the_heap_layout_byte_for_byte() {
        let values: Vec<u8> = (0..40_000u32).map(|i| (i % 253) as u8).collect();
        let boxes = vec![HeldBox {
            fqn: "w".to_string(),
            dtype: "u8".to_string(),
            shape: vec![400, 100],
            offsets: vec![0, 0],
            lengths: vec![400, 100],
        }];
        let objects = vec![("step".to_string(), b"7".to_vec())];
        let (heap, heap_file) = write_part_file(0, &boxes, &[&values], &objects, PartMemory::Heap)
            .await
            .unwrap();
        let memory = PartMemory::Shared {
            tag: "tessera-test-part".to_string(),
        };
        let (shared, shared_file) = write_part_file(0, &boxes, &[&values], &objects, memory)
            .await
            .unwrap();
        assert!(heap.shared().is_none());
        let file = shared.shared().expect("laid out in shared memory");
        assert_eq!(shared.bytes(), heap.bytes());
        assert_eq!(file.handle().size, heap.bytes().len() as u64);
        assert_eq!(shared_file, heap_file);
        // A consumer on this host opens what the part will name.
        let opened = tessera_storage::shared_file::open_shared(file.handle()).unwrap();
        assert_eq!(opened.metadata().unwrap().len(), file.handle().size);

        // The next step laid out in the retired step's memory: the same layout, byte for byte,
        // in the same file (inode), and the bytes of the new step.
        let inode = file.handle().inode;
        let file = Arc::clone(file);
        drop(shared);
        drop(opened);
        let writer = SharedFile::into_writer(file).expect("nothing else holds it");
        let next: Vec<u8> = values.iter().map(|v| v.wrapping_add(1)).collect();
        let (heap, heap_file) = write_part_file(0, &boxes, &[&next], &objects, PartMemory::Heap)
            .await
            .unwrap();
        let (reused, reused_file) =
            write_part_file(0, &boxes, &[&next], &objects, PartMemory::Reused(writer))
                .await
                .unwrap();
        assert_eq!(reused.bytes(), heap.bytes());
        assert_eq!(reused_file, heap_file);
        assert_eq!(reused.shared().unwrap().handle().inode, inode);
    }

    #[tokio::test]
    async fn a_step_commits_once_every_rank_published_and_not_before() {
        let dir = tempfile::tempdir().unwrap();
        let step_dir = dir.path().join("m").join("step-000007");
        write_part(&step_dir, &part(0, 2, &[1.0, 2.0, 3.0, 4.0]).await).unwrap();
        let err = await_and_commit(&step_dir, 2, 7, Duration::from_millis(50))
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("publisher ranks [1] of 2"), "{err}");
        assert!(!step_dir.join("manifest.json").exists());

        write_part(&step_dir, &part(1, 2, &[5.0, 6.0, 7.0, 8.0]).await).unwrap();
        let manifest = await_and_commit(&step_dir, 2, 7, Duration::from_secs(5))
            .await
            .unwrap();
        assert_eq!(manifest.step, Some(7));
        assert_eq!(manifest.files.len(), 2);
        assert!(step_dir.join("manifest.json").exists());
        let publishers = std::fs::read_to_string(step_dir.join(PUBLISHERS_FILE)).unwrap();
        assert!(
            publishers.contains("data/publisher-rank-1.bin"),
            "{publishers}"
        );
    }
}
