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
//! **The commit deadline.** A rank does not wait for the outcome forever: its report says how long
//! it waits ([`SaveOptions::outcome_wait`], counted from when its report is sent), and rank 0
//! measures that from when the report arrived, less a safety margin for the message's way
//! ([`commit_margin`]). Rank 0 commits only if every report arrived and it is ready before the
//! earliest of those deadlines: it then tells every rank that it commits (with the manifest it is
//! about to write), checks the deadlines once more, and writes the manifest, the commit point.
//! Ready too late (rank 0 was paused, its disk slow), it commits nothing and says which rank it
//! would have kept waiting past its time. So a rank that hears nothing within its wait knows that
//! rank 0 will not commit, and says "not committed" ([`OpsError::NoAnswer`]). A rank that heard
//! "committing" waits as long again for the outcome, and if that does not come it looks at the
//! checkpoint itself: this save's manifest there is a commit (success, with a warning that rank 0
//! answered late), none there is [`OpsError::OutcomeUnknown`] (rank 0 may still write it), never
//! a failure. A step after the commit point that fails (moving `<run>/latest`, removing the write
//! claim) is [`OpsError::CommittedBut`] on every rank: committed, and which step did not happen.
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
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use object_store::ObjectStore;
use serde::{Deserialize, Serialize};
use tessera_loader::LoaderError;
use tessera_loader::transport::Transport;
use tessera_metadata::formats::native::{
    LATEST_FILE, Manifest, NativeWriter, WriteOptions, WrittenFile, read_block_checksums,
    read_manifest,
};
use tessera_metadata::{DType, MetadataError, TensorBox, TensorMeta};
use tessera_planner::{Request, RequestSet, Target, assign_writers};
use tessera_storage::{GaveUp, Location, RetryingStore, StorageOptions};

use crate::claim::{Claim, ClaimOptions};
use crate::coord::{TAG_SAVE_CLAIM, TAG_SAVE_DONE, TAG_SAVE_FILES};
use crate::memory_tier::{LeftCopy, MemoryTier, RankBytes, leave_copy};
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
    /// Set when this rank learned of the commit by looking at the checkpoint, because rank 0 did
    /// not answer within [`SaveOptions::outcome_wait`]: the save is committed, but rank 0 (or the
    /// way to it) was slow enough to say so.
    pub warning: Option<String>,
    /// What this rank left in its node's memory tier ([`SaveOptions::memory_tier`]): the copy,
    /// or why leaving it failed (the checkpoint is committed either way; a load then reads this
    /// rank's file from storage).
    pub memory_tier: Option<Result<LeftCopy, String>>,
}

/// A step after the commit point that did not happen: the checkpoint is committed all the same
/// ([`OpsError::CommittedBut`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum AfterCommit {
    /// `<run>/latest` still names an older step (or none): a caller following it does not find
    /// this checkpoint, which opens by its own path. The next committed step moves it on.
    LatestNotMoved {
        /// The pointer.
        latest: String,
        /// Why it was not written.
        detail: String,
    },
    /// The save's write claim is still in the committed directory (harmless to readers; a save
    /// into a committed directory is refused anyway).
    ClaimNotRemoved {
        /// Why removing it failed.
        detail: String,
    },
}

impl fmt::Display for AfterCommit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AfterCommit::LatestNotMoved { latest, detail } => {
                write!(f, "{latest} was not moved to it: {detail}")
            }
            AfterCommit::ClaimNotRemoved { detail } => {
                write!(f, "its write claim was not removed: {detail}")
            }
        }
    }
}

/// How long a rank waits for rank 0's word by default: the transports' default wait for a peer.
pub const DEFAULT_OUTCOME_WAIT: Duration = Duration::from_secs(60);

/// The largest safety margin rank 0 keeps before a rank's deadline ([`commit_margin`]).
pub const MAX_COMMIT_MARGIN: Duration = Duration::from_secs(5);

/// How much earlier than a rank's announced deadline rank 0 must be ready to commit: the time the
/// rank's report and rank 0's answer may spend on their way, and rank 0's lag in noticing that the
/// report arrived while it was still writing. A quarter of the wait, at most
/// [`MAX_COMMIT_MARGIN`]: seconds for a job's minute-long waits, less for the short waits of tests.
/// Computed by rank 0 from the wait each rank sends, so the ranks cannot disagree on it.
pub fn commit_margin(wait: Duration) -> Duration {
    (wait / 4).min(MAX_COMMIT_MARGIN)
}

/// Options of [`save_rank`].
#[derive(Clone, Debug)]
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
    /// How long a rank other than 0 waits for rank 0's decision after sending its report, and,
    /// once rank 0 said it commits, as long again for the outcome. Rank 0 commits only while every
    /// rank still waits (see the module docs), so a rank that stops waiting never finds the save
    /// committed behind its back. Front ends set it to their wait for a peer.
    pub outcome_wait: Duration,
    /// Also leave this rank's data file in its node's memory tier once the save committed
    /// ([`crate::memory_tier`]); `None`: storage only.
    pub memory_tier: Option<MemoryTier>,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            step: None,
            storage: StorageOptions::default(),
            break_claim: false,
            store_layer: None,
            outcome_wait: DEFAULT_OUTCOME_WAIT,
            memory_tier: None,
        }
    }
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

/// What a rank other than 0 sends rank 0 once it has written its share.
#[derive(Debug, Serialize, Deserialize)]
struct Report {
    /// Its file, or why it has none.
    file: FileReport,
    /// How long it waits for rank 0's decision, counted from when its send of this report
    /// returned (milliseconds). A duration, not a time: the ranks' clocks need not agree.
    waits_ms: u64,
}

/// Rank 0's word to every other rank, under `TAG_SAVE_DONE`: [`Done::Committing`] first when it
/// commits, then the outcome; only the outcome when it does not.
#[derive(Debug, Serialize, Deserialize)]
enum Done {
    /// Every rank wrote, every rank still waits: rank 0 writes this manifest next (the commit
    /// point). A rank that hears no outcome after this compares the manifest it finds with it.
    Committing { manifest: Manifest },
    /// Committed.
    Committed { manifest: Manifest },
    /// Committed, but a step after the commit point failed.
    CommittedBut {
        manifest: Manifest,
        after: AfterCommit,
    },
    /// Not committed; rank 0's error, and [`OpsError::is_permanent`] of it on rank 0.
    NotCommitted { detail: String, permanent: bool },
}

/// Writes this rank's share of a native checkpoint at `path` and takes part in the commit.
///
/// `all` is every rank's holdings (indexed by rank, the same on every rank), `data[i]` the bytes
/// of `all[rank].boxes[i]` (row-major over the box), `objects` this rank's objects. Returns the
/// committed manifest on every rank (with this rank's write retries), or the error: this rank's
/// own, rank 0's verdict ([`OpsError::RanksFailed`] naming the ranks that failed,
/// [`OpsError::TooLateToCommit`]), or what this rank concluded when rank 0 did not answer in time
/// ([`OpsError::NoAnswer`], [`OpsError::OutcomeUnknown`]). [`OpsError::CommittedBut`] is a
/// committed checkpoint.
pub async fn save_rank<T: Transport>(
    path: &str,
    options: &SaveOptions,
    all: &[Holdings],
    data: &[&[u8]],
    objects: &[(String, Vec<u8>)],
    transport: &T,
) -> Result<Saved, OpsError> {
    let (mut saved, file) = save_durable(path, options, all, data, objects, transport).await?;
    if let Some(tier) = &options.memory_tier {
        let rank = transport.rank() as usize;
        let left = match (global_tensors(all), all.get(rank)) {
            (Ok(tensors), Some(mine)) => {
                // Blocking file writes on this task: the save is over, nothing else of this
                // rank's waits on it, and the buffers are borrowed (no thread of their own).
                let given = RankBytes {
                    mine,
                    data,
                    objects,
                };
                leave_copy(tier, path, &saved.manifest, file.as_ref(), &tensors, given)
            }
            (Err(e), _) => Err(e),
            (_, None) => Err(OpsError::invalid(format!("rank {rank}: no holdings"))),
        };
        saved.memory_tier = Some(left.map_err(|e| {
            format!(
                "rank {rank} left no copy in the memory tier {}: {e}",
                tier.dir.display()
            )
        }));
    }
    Ok(saved)
}

/// The save to storage: what [`save_rank`] does before the memory tier; also returns the data
/// file this rank wrote.
async fn save_durable<T: Transport>(
    path: &str,
    options: &SaveOptions,
    all: &[Holdings],
    data: &[&[u8]],
    objects: &[(String, Vec<u8>)],
    transport: &T,
) -> Result<(Saved, Option<WrittenFile>), OpsError> {
    let world = transport.world();
    // A memory tier that is, holds or lies inside a checkpoint fails the save like a bad
    // location does, before anything is written: its prune must never meet a checkpoint.
    let opened = open_store(path, options).and_then(|opened| {
        if let Some(tier) = &options.memory_tier {
            let checkpoint = tessera_storage::local_directory(path);
            crate::memory_tier::check_tier_dir(&tier.dir, checkpoint.as_deref())?;
        }
        Ok(opened)
    });
    if transport.rank() != 0 {
        return save_other_rank(path, options, opened, all, data, objects, transport).await;
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
        (Ok(mut commit), Err(e)) => {
            let detail = e.to_string();
            commit.after = Some(match commit.after {
                None => AfterCommit::ClaimNotRemoved { detail },
                // The pointer is what a caller follows: it stays the headline.
                Some(AfterCommit::LatestNotMoved {
                    latest,
                    detail: first,
                }) => AfterCommit::LatestNotMoved {
                    latest,
                    detail: format!("{first} (and the write claim was not removed: {detail})"),
                },
                Some(other) => other,
            });
            Ok(commit)
        }
        (outcome, _) => outcome,
    };
    let message = match &outcome {
        Ok(Commit {
            manifest,
            after: None,
            ..
        }) => Done::Committed {
            manifest: manifest.clone(),
        },
        Ok(Commit {
            manifest,
            after: Some(after),
            ..
        }) => Done::CommittedBut {
            manifest: manifest.clone(),
            after: after.clone(),
        },
        Err(e) => Done::NotCommitted {
            detail: e.to_string(),
            permanent: e.is_permanent(),
        },
    };
    let message = Bytes::from(encode(&message)?);
    for peer in 1..world {
        // A rank that already gave up cannot be told; the others still are.
        let _ = transport.send(peer, TAG_SAVE_DONE, message.clone()).await;
    }
    let commit = outcome?;
    if let Some(after) = commit.after {
        return Err(OpsError::CommittedBut {
            checkpoint: path.to_string(),
            after,
            manifest: Box::new(commit.manifest),
        });
    }
    Ok((
        Saved {
            manifest: commit.manifest,
            write_retries: opened.retrying.retries() + commit.file_retries,
            warning: None,
            memory_tier: None,
        },
        commit.file,
    ))
}

/// A rank other than 0: waits for rank 0's claim, writes its share, reports it with how long it
/// will wait, and follows rank 0's word (or, without it, the checkpoint itself).
async fn save_other_rank<T: Transport>(
    path: &str,
    options: &SaveOptions,
    opened: Result<Opened, OpsError>,
    all: &[Holdings],
    data: &[&[u8]],
    objects: &[(String, Vec<u8>)],
    transport: &T,
) -> Result<(Saved, Option<WrittenFile>), OpsError> {
    let rank = transport.rank();
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
    let report = Report {
        file: match &written {
            Ok((_, file, _)) => Ok(file.clone()),
            Err(e) => Err(e.to_string()),
        },
        waits_ms: u64::try_from(options.outcome_wait.as_millis()).unwrap_or(u64::MAX),
    };
    transport
        .send(0, TAG_SAVE_FILES, Bytes::from(encode(&report)?))
        .await?;
    let (opened, file, file_retries) = match (opened, written) {
        (Ok(opened), Ok((_, file, file_retries))) => (opened, file, file_retries),
        (_, Err(e)) => {
            // Rank 0 commits nothing now, but it still holds the claim: hearing it out means a
            // job that retries as soon as this returns finds the claim gone.
            let _ = hear_from_rank_0(transport, options.outcome_wait).await;
            return Err(e);
        }
        (Err(e), Ok(_)) => return Err(e),
    };
    let waiting = Waiting {
        path,
        location: &opened.location,
        rank,
        wait: options.outcome_wait,
        tensors: global_tensors(all)?.len() as u64,
    };
    let (manifest, warning) = follow_rank_0(&waiting, file.as_ref(), transport).await?;
    Ok((
        Saved {
            manifest,
            write_retries: opened.retrying.retries() + file_retries,
            warning,
            memory_tier: None,
        },
        file,
    ))
}

/// What a rank other than 0 needs while it waits for rank 0's word.
struct Waiting<'a> {
    path: &'a str,
    location: &'a Location,
    rank: u32,
    wait: Duration,
    /// The checkpoint's number of tensors (every rank computes the same from `all`).
    tensors: u64,
}

/// A rank other than 0, its report sent: rank 0's decision, then the outcome; the committed
/// manifest (and a warning when this rank had to find it out itself) or why there is none.
async fn follow_rank_0<T: Transport>(
    waiting: &Waiting<'_>,
    mine: Option<&WrittenFile>,
    transport: &T,
) -> Result<(Manifest, Option<String>), OpsError> {
    let &Waiting {
        path, rank, wait, ..
    } = waiting;
    let announced = match hear_from_rank_0(transport, wait).await {
        Ok(bytes) => match decode_done(&bytes)? {
            Done::Committing { manifest } => manifest,
            done => return outcome(path, done).map(|manifest| (manifest, None)),
        },
        Err(cause) => {
            // Rank 0 commits only after telling every rank, and only while each still waits
            // (less the margin for the message's way), so silence until now means it never will.
            // A look at the checkpoint backs that up, in case the margin was not enough.
            let expected = Expected::Own {
                file: mine,
                tensors: waiting.tensors,
            };
            let no_answer = |cause, found: &str| OpsError::NoAnswer {
                checkpoint: path.to_string(),
                rank,
                waited: wait,
                cause,
                found: found.to_string(),
            };
            return match look(waiting, expected).await {
                Ok(Found::Ours(manifest)) => Ok((*manifest, Some(late(waiting, &cause)))),
                Ok(Found::Nothing) => Err(no_answer(cause, "there is no manifest")),
                Ok(Found::Another) => Err(no_answer(cause, ANOTHER)),
                Err(e) => Err(no_answer(
                    cause,
                    &format!("its manifest could not be looked at ({e})"),
                )),
            };
        }
    };
    match hear_from_rank_0(transport, wait).await {
        Ok(bytes) => outcome(path, decode_done(&bytes)?).map(|manifest| (manifest, None)),
        // Rank 0 was past its decision: the manifest may be there, or still on its way.
        Err(cause) => {
            let unknown = |cause| OpsError::OutcomeUnknown {
                checkpoint: path.to_string(),
                rank,
                waited: wait,
                cause,
            };
            match look(waiting, Expected::Announced(&announced)).await {
                Ok(Found::Ours(manifest)) => Ok((*manifest, Some(late(waiting, &cause)))),
                Ok(Found::Nothing) => Err(unknown(cause)),
                Ok(Found::Another) => Err(OpsError::NoAnswer {
                    checkpoint: path.to_string(),
                    rank,
                    waited: wait,
                    cause,
                    found: ANOTHER.to_string(),
                }),
                Err(e) => Err(unknown(format!(
                    "{cause}; looking for its manifest also failed: {e}"
                ))),
            }
        }
    }
}

/// What a rank that found another save's manifest says it found.
const ANOTHER: &str = "the manifest there is another save's";

/// The warning of a rank that found the save committed without rank 0's word.
fn late(waiting: &Waiting<'_>, cause: &str) -> String {
    format!(
        "checkpoint {} is committed, but rank 0 did not answer rank {} within {:?} ({cause}): rank {} found this save's manifest there itself",
        waiting.path, waiting.rank, waiting.wait, waiting.rank
    )
}

/// Rank 0's outcome as this rank returns it.
fn outcome(path: &str, done: Done) -> Result<Manifest, OpsError> {
    match done {
        Done::Committed { manifest } => Ok(manifest),
        Done::CommittedBut { manifest, after } => Err(OpsError::CommittedBut {
            checkpoint: path.to_string(),
            after,
            manifest: Box::new(manifest),
        }),
        Done::NotCommitted { detail, permanent } => {
            Err(OpsError::NotCommitted { detail, permanent })
        }
        Done::Committing { .. } => Err(OpsError::invalid(
            "rank 0 said twice that it commits (a protocol error)",
        )),
    }
}

fn decode_done(bytes: &[u8]) -> Result<Done, OpsError> {
    serde_json::from_slice(bytes).map_err(|source| OpsError::Message {
        what: "rank 0's commit outcome".to_string(),
        source,
    })
}

/// The next message from rank 0 under `TAG_SAVE_DONE` within `wait`, or why none came (the wait
/// ran out, rank 0 is gone).
async fn hear_from_rank_0<T: Transport>(transport: &T, wait: Duration) -> Result<Bytes, String> {
    let until = Instant::now() + wait;
    loop {
        let left = until.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, transport.recv(0, TAG_SAVE_DONE)).await {
            Ok(Ok(bytes)) => return Ok(bytes),
            // The transport's own wait for a peer may be shorter than the save's: this rank told
            // rank 0 how long it waits, and it keeps its word.
            Ok(Err(LoaderError::PeerTimeout { .. })) if Instant::now() < until => {}
            Ok(Err(LoaderError::PeerTimeout { .. })) | Err(_) => {
                return Err("nothing arrived".to_string());
            }
            Ok(Err(e)) => return Err(e.to_string()),
        }
    }
}

/// Which manifest a rank that heard no outcome counts as this save's.
enum Expected<'a> {
    /// The one rank 0 announced before its commit point.
    Announced(&'a Manifest),
    /// Without an announcement: one of this save's number of tensors that lists this rank's file
    /// with its size and block checksums. A rank that wrote no file has only the tensor count to
    /// go by; another job's manifest there would need a broken write claim.
    Own {
        file: Option<&'a WrittenFile>,
        tensors: u64,
    },
}

/// What a rank that heard no outcome finds at the checkpoint.
#[derive(Debug, PartialEq)]
enum Found {
    /// This save's manifest: committed.
    Ours(Box<Manifest>),
    /// No manifest (yet).
    Nothing,
    /// Another save's manifest: the manifest is created exclusively, so this save's can no
    /// longer be written.
    Another,
}

/// Looks for this save's manifest at the checkpoint.
async fn look(waiting: &Waiting<'_>, expected: Expected<'_>) -> Result<Found, OpsError> {
    let location = waiting.location;
    let found = match read_manifest(location.store.as_ref(), &location.prefix).await {
        Ok(found) => found,
        Err(MetadataError::MissingManifest { .. }) => return Ok(Found::Nothing),
        Err(e) => return Err(e.into()),
    };
    let ours = match expected {
        Expected::Announced(announced) => &found == announced,
        Expected::Own { tensors, .. } if found.tensors != tensors => false,
        Expected::Own {
            file: Some(mine), ..
        } => {
            found.file_size(mine.path()) == Some(mine.size())
                && (found.checksums.is_none() || {
                    let checksums =
                        read_block_checksums(location.store.as_ref(), &location.prefix, &found)
                            .await?;
                    checksums
                        .file(mine.path())
                        .is_some_and(|blocks| blocks.crcs == mine.block_crcs())
                })
        }
        Expected::Own { file: None, .. } => true,
    };
    Ok(if ours {
        Found::Ours(Box::new(found))
    } else {
        Found::Another
    })
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

/// The run's `latest` pointer next to the checkpoint at `path`, written as the user wrote `path`
/// (the store's own name for it is relative to where the store is rooted).
fn latest_of(path: &str) -> String {
    let trimmed = path.trim_end_matches('/');
    match trimmed.rsplit_once('/') {
        Some((parent, _)) => format!("{parent}/{LATEST_FILE}"),
        None => LATEST_FILE.to_string(),
    }
}

/// What rank 0 committed.
struct Commit {
    manifest: Manifest,
    /// A step after the commit point that failed.
    after: Option<AfterCommit>,
    /// Rank 0's data file written again from the start.
    file_retries: u64,
    /// Rank 0's data file.
    file: Option<WrittenFile>,
}

/// A rank that reported success, waiting for the outcome until `heard_at + waits` (rank 0's
/// clock: when the report arrived).
struct Deadline {
    rank: u32,
    heard_at: Instant,
    waits: Duration,
}

/// Whether rank 0 may still commit: every rank still waits, with [`commit_margin`] to spare.
/// Otherwise the error names the rank closest to giving up.
fn check_deadlines(deadlines: &[Deadline]) -> Result<(), OpsError> {
    let now = Instant::now();
    let Some(first) = deadlines
        .iter()
        .min_by_key(|d| d.heard_at + d.waits - commit_margin(d.waits))
    else {
        return Ok(());
    };
    let margin = commit_margin(first.waits);
    let ready_after = now.saturating_duration_since(first.heard_at);
    if ready_after + margin < first.waits {
        return Ok(());
    }
    Err(OpsError::TooLateToCommit {
        rank: first.rank,
        waits: first.waits,
        margin,
        ready_after,
    })
}

/// Every other rank's report as it arrives, with when (rank 0's clock), while rank 0 writes its
/// own share: listening only afterwards would date a report that waited in the transport's
/// buffer too late, and so place its rank's deadline after the rank stops waiting. A report is
/// awaited as before, at least one full transport wait after rank 0's write `finished`.
async fn collect_reports<T: Transport>(
    transport: &T,
    finished: &OnceLock<Instant>,
) -> Vec<Result<(Bytes, Instant), LoaderError>> {
    let reports = (1..transport.world()).map(|peer| async move {
        loop {
            let asked = Instant::now();
            match transport.recv(peer, TAG_SAVE_FILES).await {
                Ok(bytes) => return Ok((bytes, Instant::now())),
                Err(LoaderError::PeerTimeout { .. })
                    if finished.get().is_none_or(|&done| done > asked) => {}
                Err(e) => return Err(e),
            }
        }
    });
    futures::future::join_all(reports).await
}

/// Rank 0, holding the claim: writes its share, gathers every rank's file and commits when all
/// wrote and all still wait for the outcome.
async fn write_and_commit<T: Transport>(
    path: &str,
    options: &SaveOptions,
    location: &Location,
    all: &[Holdings],
    data: &[&[u8]],
    objects: &[(String, Vec<u8>)],
    transport: &T,
) -> Result<Commit, OpsError> {
    let finished = OnceLock::new();
    let write = async {
        let written = write_share(path, options, location, all, data, objects, 0).await;
        let _ = finished.set(Instant::now());
        written
    };
    let (written, reports) = futures::join!(write, collect_reports(transport, &finished));
    let mut files = Vec::new();
    let mut failures = Vec::new();
    let mut deadlines = Vec::new();
    for (peer, report) in (1..transport.world()).zip(reports) {
        let decoded = report.map_err(|e| e.to_string()).and_then(|(bytes, at)| {
            serde_json::from_slice::<Report>(&bytes)
                .map(|report| (report, at))
                .map_err(|e| format!("undecodable report: {e}"))
        });
        match decoded {
            Ok((
                Report {
                    file: Ok(file),
                    waits_ms,
                },
                heard_at,
            )) => {
                files.extend(file);
                deadlines.push(Deadline {
                    rank: peer,
                    heard_at,
                    waits: Duration::from_millis(waits_ms),
                });
            }
            Ok((Report { file: Err(e), .. }, _)) | Err(e) => {
                failures.push(format!("rank {peer}: {e}"));
            }
        }
    }
    let (writer, file, file_retries) = match written {
        Err(e) => {
            return Err(OpsError::Context {
                context: "rank 0".to_string(),
                inner: Box::new(e),
            });
        }
        Ok(_) if !failures.is_empty() => return Err(OpsError::RanksFailed { failures }),
        Ok(written) => written,
    };
    files.extend(file.clone());
    let committing = || format!("committing checkpoint {path}");
    let prepared = writer.prepare(files).await.with_context(committing)?;
    check_deadlines(&deadlines)?;
    let announce = Bytes::from(encode(&Done::Committing {
        manifest: prepared.manifest().clone(),
    })?);
    for peer in 1..transport.world() {
        transport
            .send(peer, TAG_SAVE_DONE, announce.clone())
            .await
            .with_context(|| format!("telling rank {peer} that rank 0 commits {path}"))?;
    }
    // The announcements took time too: each must have reached its rank before it gives up.
    check_deadlines(&deadlines)?;
    let manifest = prepared.manifest().clone();
    match prepared.commit().await {
        Ok(manifest) => Ok(Commit {
            manifest,
            after: None,
            file_retries,
            file,
        }),
        Err(MetadataError::LatestNotMoved { source, .. }) => Ok(Commit {
            manifest,
            after: Some(AfterCommit::LatestNotMoved {
                latest: latest_of(path),
                detail: source.to_string(),
            }),
            file_retries,
            file,
        }),
        Err(e) => Err(e).with_context(committing),
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A one-tensor checkpoint at `location` whose data file holds `bytes`, committed or not;
    /// the written file.
    async fn checkpoint(location: &Location, bytes: &[u8], commit: bool) -> WrittenFile {
        let tensors = vec![TensorMeta::new("w", DType::F32, vec![16])];
        let writer = NativeWriter::create(
            location.store.clone(),
            location.prefix.clone(),
            tensors,
            WriteOptions::default(),
        )
        .await
        .unwrap();
        let mut file = writer.data_file("rank-1").unwrap();
        file.write_box(0, TensorBox::new(vec![0], vec![16]), bytes)
            .await
            .unwrap();
        let written = file.finish().await.unwrap();
        if commit {
            writer.commit(vec![written.clone()]).await.unwrap();
        }
        written
    }

    #[tokio::test]
    async fn a_rank_without_word_counts_only_a_manifest_listing_its_own_bytes_as_this_save() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("step-1").display().to_string();
        let location = tessera_storage::create_with(&path, &StorageOptions::default()).unwrap();
        let waiting = Waiting {
            path: &path,
            location: &location,
            rank: 1,
            wait: Duration::from_secs(1),
            tensors: 1,
        };
        let ours = [7u8; 64];
        let file = checkpoint(&location, &ours, false).await;
        let own = |file| Expected::Own { file, tensors: 1 };
        // Written, not committed: nothing to find.
        assert_eq!(
            look(&waiting, own(Some(&file))).await.unwrap(),
            Found::Nothing
        );

        // Committed with these bytes: this save's.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("step-1").display().to_string();
        let location = tessera_storage::create_with(&path, &StorageOptions::default()).unwrap();
        let waiting = Waiting {
            location: &location,
            ..waiting
        };
        let committed = checkpoint(&location, &ours, true).await;
        let Found::Ours(found) = look(&waiting, own(Some(&committed))).await.unwrap() else {
            panic!("this save's manifest not recognized");
        };
        assert_eq!(found.files[0].path, "data/rank-1.bin");

        // The same name and size with other bytes (another job's save after a broken claim):
        // its block checksums tell it apart.
        let other_dir = tempfile::tempdir().unwrap();
        let other_path = other_dir.path().join("step-1").display().to_string();
        let other = tessera_storage::create_with(&other_path, &StorageOptions::default()).unwrap();
        let theirs = checkpoint(&other, &[9u8; 64], false).await;
        assert_eq!(theirs.size(), committed.size());
        assert_eq!(
            look(&waiting, own(Some(&theirs))).await.unwrap(),
            Found::Another
        );
        // Another number of tensors is another save, file or no file.
        let tensors_differ = Expected::Own {
            file: None,
            tensors: 2,
        };
        assert_eq!(
            look(&waiting, tensors_differ).await.unwrap(),
            Found::Another
        );
        assert!(matches!(
            look(&waiting, own(None)).await.unwrap(),
            Found::Ours(_)
        ));
    }

    #[test]
    fn rank_0_commits_only_while_every_rank_waits_with_the_margin_to_spare() {
        assert_eq!(
            commit_margin(Duration::from_secs(60)),
            MAX_COMMIT_MARGIN,
            "a minute's wait keeps the full margin"
        );
        assert_eq!(
            commit_margin(Duration::from_secs(2)),
            Duration::from_millis(500)
        );
        let now = Instant::now();
        let heard = |rank, ago_ms, waits_ms| Deadline {
            rank,
            heard_at: now - Duration::from_millis(ago_ms),
            waits: Duration::from_millis(waits_ms),
        };
        // 10 s into a 60 s wait and 1 s into a 2 s one: both wait long enough yet.
        check_deadlines(&[heard(1, 10_000, 60_000), heard(2, 1_000, 2_000)]).unwrap();
        // Rank 2 gives up in 0.4 s, inside its 0.5 s margin: the one named, though rank 3's
        // report came earlier.
        let err = check_deadlines(&[heard(3, 20_000, 60_000), heard(2, 1_600, 2_000)]).unwrap_err();
        let OpsError::TooLateToCommit {
            rank,
            waits,
            margin,
            ready_after,
        } = err
        else {
            panic!("{err}");
        };
        assert_eq!(
            (rank, waits, margin),
            (2, Duration::from_secs(2), Duration::from_millis(500))
        );
        assert!(ready_after >= Duration::from_millis(1_600));
        check_deadlines(&[]).unwrap();
    }
}
