//! The multi-rank save-and-commit protocol of the native format.
//!
//! Every rank says which boxes (and objects) it holds; [`save_rank`] gets every rank's
//! [`Holdings`], already gathered (see [`crate::coord::all_gather_json`]). A box held by several
//! ranks (data-parallel replicas) is written once, by the holder the planner's worst-fit
//! [`assign_writers`] picks, so write bytes are balanced over the ranks rather than piled on the
//! lowest one. Each rank writes its boxes to its own data file (`data/rank-<r>.bin`) and reports
//! what it wrote to rank 0, which commits (metadata, checksums, manifest last) only when every
//! rank succeeded, and tells every rank the outcome. A failure anywhere leaves no manifest: the
//! directory never shows as a checkpoint.
//!
//! Before any rank writes, rank 0 takes the output's write claim ([`crate::claim`]) and tells
//! every rank whether it got it; the other ranks wait for that word before they write. So a
//! second job saving into the same directory fails on every rank at once, naming the holder,
//! instead of mixing its data files into the first job's (the manifest alone is created
//! exclusively, and it is written last). Rank 0 removes the claim after the commit or the failure,
//! before it tells the ranks the outcome, so a job that retries at once finds it gone.
//!
//! Every rank writes through one store per save, opened here and wrapped in
//! [`RetryingStore`]: a write request that fails transiently is tried again with the storage
//! options' [`RetryPolicy`](tessera_storage::RetryPolicy), and a data file large enough to go up
//! in parts (whose parts object_store cannot retry one by one) is written again from the start,
//! since the rank holds its bytes. A failure that outlasts the attempts fails the save like any
//! other. [`SaveOptions::store_layer`] wraps that store below the retries: how tests inject
//! faults.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use object_store::ObjectStore;
use serde::{Deserialize, Serialize};
use tessera_loader::transport::Transport;
use tessera_metadata::formats::native::{Manifest, NativeWriter, WriteOptions, WrittenFile};
use tessera_metadata::{DType, TensorBox, TensorMeta};
use tessera_planner::{Request, RequestSet, Target, assign_writers};
use tessera_storage::{GaveUp, Location, RetryingStore, StorageOptions};

use crate::claim::{Claim, ClaimOptions};
use crate::coord::{TAG_SAVE_CLAIM, TAG_SAVE_DONE, TAG_SAVE_FILES};
use crate::{OpsError, ResultExt};

/// One box a rank holds.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct HeldBox {
    /// The tensor.
    pub fqn: String,
    /// Its dtype (`bf16`, `f32`, …).
    pub dtype: String,
    /// Its global shape.
    pub shape: Vec<u64>,
    /// The box's offsets.
    pub offsets: Vec<u64>,
    /// The box's lengths.
    pub lengths: Vec<u64>,
}

/// What one rank holds, as the other ranks learn it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holdings {
    /// Its boxes.
    pub boxes: Vec<HeldBox>,
    /// The keys of its non-tensor objects.
    pub objects: Vec<String>,
}

/// A wrapper put around the store a save writes through, below its retries (so what it fails is
/// retried as a real store's failure would be). Tests inject faults with it.
#[derive(Clone)]
pub struct StoreLayer(Arc<WrapStore>);

/// The function a [`StoreLayer`] holds.
type WrapStore = dyn Fn(Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore> + Send + Sync;

impl StoreLayer {
    /// A layer that wraps the opened store with `wrap`.
    pub fn new(
        wrap: impl Fn(Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(wrap))
    }
}

impl fmt::Debug for StoreLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("StoreLayer(..)")
    }
}

/// What [`save_rank`] returns on every rank once the checkpoint is committed.
#[derive(Clone, Debug, PartialEq)]
pub struct Saved {
    /// The committed manifest (the same on every rank).
    pub manifest: Manifest,
    /// This rank's retries of failed writes: write requests tried again, plus data files written
    /// again from the start.
    pub write_retries: u64,
}

/// Options of [`save_rank`].
#[derive(Clone, Debug, Default)]
pub struct SaveOptions {
    /// Training step recorded in the manifest.
    pub step: Option<u64>,
    /// Credentials and endpoints on top of the environment.
    pub storage: StorageOptions,
    /// Remove a stale write claim on the output first (its writer is known to be dead) and save
    /// anyway. Never while the other writer may still run: the two would mix their files.
    pub break_claim: bool,
    /// Wraps the store this rank writes through (tests: fault injection). `None` in production.
    pub store_layer: Option<StoreLayer>,
}

/// The store one rank of a save writes through, and its retry counter.
struct Opened {
    location: Location,
    retrying: Arc<RetryingStore>,
}

/// Opens `path` for this rank's writes: the options' store, the test layer if any, the retries
/// on top.
fn open_store(path: &str, options: &SaveOptions) -> Result<Opened, OpsError> {
    let (location, retrying) =
        open_for_writing(path, &options.storage, options.store_layer.as_ref())?;
    Ok(Opened { location, retrying })
}

/// Opens `path` for writing a checkpoint the way every tessera writer does (`tessera.save`,
/// `tessera convert`): the store of `storage`, wrapped by `layer` (tests) and then in
/// [`RetryingStore`] with `storage.retry`, so transient write failures are retried alike
/// everywhere. Returns the location (whose store is the retrying one) and the retry counter.
pub fn open_for_writing(
    path: &str,
    storage: &StorageOptions,
    layer: Option<&StoreLayer>,
) -> Result<(Location, Arc<RetryingStore>), OpsError> {
    let mut location = tessera_storage::create_with(path, storage)?;
    let base = match layer {
        Some(layer) => (layer.0)(location.store.clone()),
        None => location.store.clone(),
    };
    let retrying = Arc::new(RetryingStore::new(base, storage.retry.clone()));
    location.store = retrying.clone();
    Ok((location, retrying))
}

/// What the claim's holder records as its command.
pub const SAVE_COMMAND: &str = "tessera.save";

/// How a refused save breaks a stale claim, for the error.
const HOW_TO_BREAK: &str = "rerun the save with break_claim=True";

/// Rank 0's word on the write claim, sent to every other rank before anyone writes.
#[derive(Debug, Serialize, Deserialize)]
enum ClaimReport {
    /// Rank 0 holds the claim: write.
    Held,
    /// Another writer holds it (the fields of [`OpsError::Claimed`]).
    Claimed {
        location: String,
        claim: String,
        holder: String,
        how_to_break: String,
    },
    /// Taking it failed otherwise (the location, the store); `permanent` as
    /// [`OpsError::is_permanent`] said on rank 0.
    Failed { detail: String, permanent: bool },
}

/// The checkpoint's tensors (sorted by name) from every rank's boxes; ranks must agree on each
/// tensor's dtype and shape.
pub fn global_tensors(all: &[Holdings]) -> Result<Vec<TensorMeta>, OpsError> {
    let mut tensors: BTreeMap<&str, (DType, &[u64], usize)> = BTreeMap::new();
    for (rank, held) in all.iter().enumerate() {
        for b in &held.boxes {
            let dtype = DType::parse(&b.dtype).map_err(|_| {
                OpsError::invalid(format!(
                    "tensor {}: tessera has no dtype {}",
                    b.fqn, b.dtype
                ))
            })?;
            match tensors.get(b.fqn.as_str()) {
                None => {
                    tensors.insert(&b.fqn, (dtype, &b.shape, rank));
                }
                Some(&(d, shape, first)) if d != dtype || shape != b.shape.as_slice() => {
                    return Err(OpsError::invalid(format!(
                        "tensor {}: rank {first} saves it as {d} of shape {shape:?} but rank {rank} as {dtype} of shape {:?}",
                        b.fqn, b.shape
                    )));
                }
                Some(_) => {}
            }
        }
    }
    Ok(tensors
        .into_iter()
        .map(|(fqn, (dtype, shape, _))| TensorMeta::new(fqn, dtype, shape.to_vec()))
        .collect())
}

/// Which of `rank`'s boxes it writes (indices into `all[rank].boxes`): the planner's worst-fit
/// assignment over every rank's holdings, so each distinct box is written exactly once.
pub fn boxes_to_write(
    tensors: &[TensorMeta],
    all: &[Holdings],
    rank: usize,
) -> Result<Vec<usize>, OpsError> {
    let index: HashMap<&str, u32> = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| (t.fqn.as_str(), i as u32))
        .collect();
    let holdings = RequestSet {
        ranks: all
            .iter()
            .map(|held| {
                held.boxes
                    .iter()
                    .map(|b| Request {
                        tensor: index[b.fqn.as_str()],
                        target: Target::Box(TensorBox::new(b.offsets.clone(), b.lengths.clone())),
                    })
                    .collect()
            })
            .collect(),
        disjoint: false,
    };
    let writes = assign_writers(tensors, &holdings)?;
    let Some(assigned) = writes.get(rank) else {
        return Ok(Vec::new());
    };
    let mine: HashMap<(u32, TensorBox), usize> = all[rank]
        .boxes
        .iter()
        .enumerate()
        .map(|(i, b)| {
            (
                (
                    index[b.fqn.as_str()],
                    TensorBox::new(b.offsets.clone(), b.lengths.clone()),
                ),
                i,
            )
        })
        .collect();
    let mut owned: Vec<usize> = assigned
        .iter()
        .filter_map(|item| mine.get(&(item.tensor, item.region.clone())).copied())
        .collect();
    owned.sort_unstable();
    Ok(owned)
}

/// The lowest rank holding each object: objects are small (a step counter, optimizer settings),
/// so balancing them buys nothing.
fn object_writers(all: &[Holdings]) -> HashMap<&str, usize> {
    let mut writers = HashMap::new();
    for (rank, held) in all.iter().enumerate() {
        for key in &held.objects {
            writers.entry(key.as_str()).or_insert(rank);
        }
    }
    writers
}

/// A rank's file for rank 0, or why it has none.
type FileReport = Result<Option<WrittenFile>, String>;

/// Writes this rank's share of a native checkpoint at `path` and takes part in the commit.
///
/// `all` is every rank's holdings (indexed by rank, the same on every rank), `data[i]` the bytes
/// of `all[rank].boxes[i]` (row-major over the box), `objects` this rank's objects. Returns the
/// committed manifest on every rank (with this rank's write retries), or the error: this rank's
/// own, or rank 0's verdict ([`OpsError::RanksFailed`] naming the ranks that failed).
pub async fn save_rank<T: Transport>(
    path: &str,
    options: &SaveOptions,
    all: &[Holdings],
    data: &[&[u8]],
    objects: &[(String, Vec<u8>)],
    transport: &T,
) -> Result<Saved, OpsError> {
    let (rank, world) = (transport.rank(), transport.world());
    let opened = open_store(path, options);
    if rank != 0 {
        wait_for_claim(path, transport).await?;
        let written = match &opened {
            Ok(opened) => {
                write_share(
                    path,
                    options,
                    &opened.location,
                    all,
                    data,
                    objects,
                    rank as usize,
                )
                .await
            }
            Err(e) => Err(OpsError::invalid(e.to_string())),
        };
        let report: FileReport = match &written {
            Ok((_, file, _)) => Ok(file.clone()),
            Err(e) => Err(e.to_string()),
        };
        transport
            .send(0, TAG_SAVE_FILES, Bytes::from(encode(&report)?))
            .await?;
        let outcome = transport.recv(0, TAG_SAVE_DONE).await?;
        let outcome: Result<Manifest, String> =
            serde_json::from_slice(&outcome).map_err(|source| OpsError::Message {
                what: "rank 0's commit outcome".to_string(),
                source,
            })?;
        let (_, _, file_retries) = written?;
        let manifest = outcome.map_err(OpsError::invalid)?;
        return Ok(Saved {
            manifest,
            write_retries: write_retries(&opened, file_retries),
        });
    }

    let (claim, opened) = claim_for_all(path, options, opened, transport).await?;
    let outcome = write_and_commit(
        path,
        options,
        &opened.location,
        all,
        data,
        objects,
        transport,
    )
    .await;
    // Released before the ranks hear the outcome: a job that retries the save as soon as it
    // returns must not find its own claim.
    let released = claim
        .release()
        .await
        .with_context(|| format!("removing the write claim of {path}"));
    let outcome = match (outcome, released) {
        (Ok(_), Err(e)) => Err(OpsError::Context {
            context: format!("checkpoint {path} was committed, but"),
            inner: Box::new(e),
        }),
        (outcome, _) => outcome,
    };
    let message: Result<&Manifest, String> = outcome
        .as_ref()
        .map(|(manifest, _)| manifest)
        .map_err(ToString::to_string);
    let message = Bytes::from(encode(&message)?);
    for peer in 1..world {
        // A rank that already gave up cannot be told; the others still are.
        let _ = transport.send(peer, TAG_SAVE_DONE, message.clone()).await;
    }
    let (manifest, file_retries) = outcome?;
    Ok(Saved {
        manifest,
        write_retries: opened.retrying.retries() + file_retries,
    })
}

fn write_retries(opened: &Result<Opened, OpsError>, file_retries: u64) -> u64 {
    opened.as_ref().map_or(0, |o| o.retrying.retries()) + file_retries
}

/// The context of every rank's error when rank 0 could not claim `path`.
fn claim_context(path: &str) -> String {
    format!("rank 0 claiming {path} for writing")
}

/// Rank 0: takes the write claim on `path` and tells every other rank whether it holds it. On
/// failure every rank gets the same error (see [`wait_for_claim`]).
async fn claim_for_all<T: Transport>(
    path: &str,
    options: &SaveOptions,
    opened: Result<Opened, OpsError>,
    transport: &T,
) -> Result<(Claim, Opened), OpsError> {
    let taken = match opened {
        Ok(opened) => Claim::take(
            &opened.location,
            SAVE_COMMAND,
            &ClaimOptions {
                break_existing: options.break_claim,
                how_to_break: Some(HOW_TO_BREAK.to_string()),
            },
        )
        .await
        .map(|claim| (claim, opened)),
        Err(e) => Err(e),
    };
    let report = match &taken {
        Ok(_) => ClaimReport::Held,
        Err(OpsError::Claimed {
            location,
            claim,
            holder,
            how_to_break,
        }) => ClaimReport::Claimed {
            location: location.clone(),
            claim: claim.clone(),
            holder: holder.clone(),
            how_to_break: how_to_break.clone(),
        },
        Err(e) => ClaimReport::Failed {
            detail: e.to_string(),
            permanent: e.is_permanent(),
        },
    };
    let message = match encode(&report) {
        Ok(message) => Bytes::from(message),
        Err(e) => {
            if let Ok((claim, _)) = taken {
                let _ = claim.release().await;
            }
            return Err(e);
        }
    };
    for peer in 1..transport.world() {
        // A rank that cannot be told fails on its own (its recv times out); rank 0 then finds
        // its report missing and commits nothing.
        let _ = transport.send(peer, TAG_SAVE_CLAIM, message.clone()).await;
    }
    taken.with_context(|| claim_context(path))
}

/// A rank other than 0: waits for rank 0's word on the claim; an error unless rank 0 holds it.
async fn wait_for_claim<T: Transport>(path: &str, transport: &T) -> Result<(), OpsError> {
    let rank = transport.rank();
    let bytes = transport
        .recv(0, TAG_SAVE_CLAIM)
        .await
        .with_context(|| format!("rank {rank} waiting for rank 0 to claim {path}"))?;
    let report: ClaimReport =
        serde_json::from_slice(&bytes).map_err(|source| OpsError::Message {
            what: "rank 0's claim report".to_string(),
            source,
        })?;
    let inner = match report {
        ClaimReport::Held => return Ok(()),
        ClaimReport::Claimed {
            location,
            claim,
            holder,
            how_to_break,
        } => OpsError::Claimed {
            location,
            claim,
            holder,
            how_to_break,
        },
        ClaimReport::Failed {
            detail,
            permanent: true,
        } => OpsError::invalid(detail),
        // Kept transient, as it was on rank 0: a retry may pass.
        ClaimReport::Failed {
            detail,
            permanent: false,
        } => OpsError::RanksFailed {
            failures: vec![format!("rank 0: {detail}")],
        },
    };
    Err(OpsError::Context {
        context: claim_context(path),
        inner: Box::new(inner),
    })
}

/// Rank 0, holding the claim: writes its share, gathers every rank's file and commits when all
/// wrote.
async fn write_and_commit<T: Transport>(
    path: &str,
    options: &SaveOptions,
    location: &Location,
    all: &[Holdings],
    data: &[&[u8]],
    objects: &[(String, Vec<u8>)],
    transport: &T,
) -> Result<(Manifest, u64), OpsError> {
    let written = write_share(path, options, location, all, data, objects, 0).await;
    let mut files = Vec::new();
    let mut failures = Vec::new();
    for peer in 1..transport.world() {
        match transport.recv(peer, TAG_SAVE_FILES).await {
            Ok(bytes) => match serde_json::from_slice::<FileReport>(&bytes) {
                Ok(Ok(file)) => files.extend(file),
                Ok(Err(e)) => failures.push(format!("rank {peer}: {e}")),
                Err(e) => failures.push(format!("rank {peer}: undecodable report: {e}")),
            },
            Err(e) => failures.push(format!("rank {peer}: {e}")),
        }
    }
    match written {
        Err(e) => Err(OpsError::Context {
            context: "rank 0".to_string(),
            inner: Box::new(e),
        }),
        Ok(_) if !failures.is_empty() => Err(OpsError::RanksFailed { failures }),
        Ok((writer, file, file_retries)) => {
            files.extend(file);
            let manifest = writer
                .commit(files)
                .await
                .with_context(|| format!("committing checkpoint {path}"))?;
            Ok((manifest, file_retries))
        }
    }
}

/// Starts the checkpoint and writes what this rank owns; the writer (for rank 0's commit), this
/// rank's file if it owns anything, and how many times the file was written again.
async fn write_share(
    path: &str,
    options: &SaveOptions,
    location: &Location,
    all: &[Holdings],
    data: &[&[u8]],
    objects: &[(String, Vec<u8>)],
    rank: usize,
) -> Result<(NativeWriter, Option<WrittenFile>, u64), OpsError> {
    let mine = all.get(rank).ok_or_else(|| {
        OpsError::invalid(format!(
            "rank {rank}: no holdings among {} ranks",
            all.len()
        ))
    })?;
    if data.len() != mine.boxes.len() {
        return Err(OpsError::invalid(format!(
            "rank {rank}: {} boxes but {} data buffers",
            mine.boxes.len(),
            data.len()
        )));
    }
    let tensors = global_tensors(all)?;
    let owned = boxes_to_write(&tensors, all, rank)?;
    let writer = NativeWriter::create(
        location.store.clone(),
        location.prefix.clone(),
        tensors,
        WriteOptions {
            step: options.step,
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
    let writers = object_writers(all);
    let owned_objects: Vec<&(String, Vec<u8>)> = objects
        .iter()
        .filter(|(k, _)| writers.get(k.as_str()) == Some(&rank))
        .collect();
    if owned.is_empty() && owned_objects.is_empty() {
        return Ok((writer, None, 0));
    }
    let boxes: Vec<(u32, &HeldBox, &[u8])> = owned
        .iter()
        .map(|&i| (index[mine.boxes[i].fqn.as_str()], &mine.boxes[i], data[i]))
        .collect();
    let name = format!("rank-{rank}");
    // Single-request failures were already retried by the store; what reaches here transient is
    // a part or the completion of a multipart upload, which only a new upload can redo.
    let mut waits = options.storage.retry.waits();
    let mut again = 0;
    loop {
        match write_file(&writer, &name, &boxes, &owned_objects).await {
            Ok(file) => return Ok((writer, Some(file), again)),
            Err(e) if !e.is_permanent() && !gave_up(&e) => match waits.next() {
                Some(wait) => {
                    tokio::time::sleep(wait).await;
                    again += 1;
                }
                None => return Err(e),
            },
            Err(e) => return Err(e),
        }
    }
}

/// Writes this rank's data file `data/<name>.bin` from the start. On failure the file's writer is
/// dropped, which frees the name for another try.
async fn write_file(
    writer: &NativeWriter,
    name: &str,
    boxes: &[(u32, &HeldBox, &[u8])],
    objects: &[&(String, Vec<u8>)],
) -> Result<WrittenFile, OpsError> {
    let mut file = writer.data_file(name)?;
    for &(tensor, b, bytes) in boxes {
        let region = TensorBox::new(b.offsets.clone(), b.lengths.clone());
        file.write_box(tensor, region, bytes)
            .await
            .with_context(|| format!("writing tensor {} at offsets {:?}", b.fqn, b.offsets))?;
    }
    for (key, bytes) in objects {
        file.write_object(key, bytes)
            .await
            .with_context(|| format!("writing object {key}"))?;
    }
    Ok(file.finish().await?)
}

/// Whether `error` is a store request that [`RetryingStore`] already retried to the end: trying
/// the whole file again would multiply its attempts, not add a chance.
fn gave_up(error: &OpsError) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = source {
        if e.is::<GaveUp>() {
            return true;
        }
        source = e.source();
    }
    false
}

fn encode<V: Serialize>(value: &V) -> Result<Vec<u8>, OpsError> {
    serde_json::to_vec(value).map_err(|source| OpsError::Message {
        what: "a save message".to_string(),
        source,
    })
}
