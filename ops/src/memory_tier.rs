//! The save side of a node's memory tier ([`tessera_loader::tier`], the format): once a save
//! committed, each rank leaves a copy of the data file it wrote under its node's tier directory
//! (its boxes at the same offsets, then the record naming the committed checkpoint's identity),
//! and prunes the tier to its budget: the newest `keep` copies, at most `max_bytes`. A save that
//! fails or is killed before its commit leaves no record, so its bytes never count; the next
//! prune (or `tessera gc --memory-tier`) removes them.
//!
//! A tier is often shared (`/dev/shm`) and may be named by mistake (the checkpoints' root): the
//! prune removes only folders tessera provably made there (their marker,
//! [`tessera_loader::tier::is_copy_dir`]), and a tier that is, holds or lies inside a
//! checkpoint is refused before a save writes anything ([`check_tier_dir`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::tier::{
    RECORD_SUFFIX, TIER_FORMAT, TIER_VERSION, TierCandidates, TierCopies, TierEntry, TierRecord,
    Verified, copy_dir_name, find_candidates, find_copies, is_copy_dir, now_unix_ms, write_copy,
};
use tessera_metadata::formats::native::{Manifest, WrittenFile};
use tessera_metadata::{CheckpointMeta, TensorMeta};
use tessera_planner::{ReadSources, SourceTier};

use crate::OpsError;
use crate::save::Holdings;

/// Copies a tier keeps by default: the newest two (the one being written while the last
/// complete one is still there to resume from).
pub const DEFAULT_KEEP: usize = 2;

/// Where and how much a save keeps in its node's memory tier.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryTier {
    /// The node-local directory (e.g. `/dev/shm/tessera/<run>`): ranks that name the same one on
    /// one host are one node.
    pub dir: PathBuf,
    /// Copies (saved checkpoints) kept, newest first; at least 1.
    pub keep: usize,
    /// Bytes the tier may hold; the oldest copies go first, never the one just left. A rank's
    /// file larger than this is not copied.
    pub max_bytes: Option<u64>,
}

impl MemoryTier {
    /// The tier at `dir` with the default budget ([`DEFAULT_KEEP`] copies, no byte bound).
    pub fn new(dir: impl Into<PathBuf>) -> Self {
        Self {
            dir: dir.into(),
            keep: DEFAULT_KEEP,
            max_bytes: None,
        }
    }
}

/// The refusal of a memory tier together with a plan server (`server` names it as the front
/// end's caller gave it: `server=URL`, `--server URL`): a server plans reads from storage only,
/// so it cannot send a rank to its node's copies. Every front end refuses with this, before
/// planning where it can.
pub fn refuse_with_server(server: &str) -> OpsError {
    OpsError::invalid(format!(
        "a plan server plans reads from storage only, so the memory tier's copies cannot be \
         used with {server}: load without a server to read from the tier"
    ))
}

/// What leaving a copy did.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct LeftCopy {
    /// The copy's data file (`None`: this rank wrote no file, or it exceeds the byte budget).
    pub path: Option<PathBuf>,
    /// Bytes of its tensor boxes (what loads read from it; its plain values come on top).
    pub bytes: u64,
    /// Why no copy was left, when none was.
    pub skipped: Option<String>,
    /// What the prune removed.
    pub pruned: Pruned,
}

/// What one rank gave a save: its holdings, their bytes (in the order of `mine.boxes`) and its
/// plain values, encoded.
#[derive(Clone, Copy, Debug)]
pub struct RankBytes<'a> {
    /// The boxes this rank holds.
    pub mine: &'a Holdings,
    /// Their bytes.
    pub data: &'a [&'a [u8]],
    /// Plain values by key.
    pub objects: &'a [(String, Vec<u8>)],
}

/// Leaves this rank's copy of the committed checkpoint at `checkpoint` (its `manifest`) in
/// `tier`: every entry of `file` (what this rank wrote; `None` when it wrote nothing), tensor
/// boxes and plain values, taken from `given`, then prunes the tier. `tensors` are the
/// checkpoint's, as the save numbered them.
pub fn leave_copy(
    tier: &MemoryTier,
    checkpoint: &str,
    manifest: &Manifest,
    file: Option<&WrittenFile>,
    tensors: &[TensorMeta],
    given: RankBytes<'_>,
) -> Result<LeftCopy, OpsError> {
    let Some(file) = file else {
        return Ok(LeftCopy {
            skipped: Some("this rank wrote no data file".into()),
            ..LeftCopy::default()
        });
    };
    let identity = tessera_metadata::native_identity(&manifest.to_json()?);
    if let Some(max) = tier.max_bytes.filter(|&max| file.size() > max) {
        return Ok(LeftCopy {
            skipped: Some(format!(
                "{} is {} bytes, more than the tier's budget of {max}",
                file.path(),
                file.size()
            )),
            pruned: prune(&tier.dir, tier.keep, tier.max_bytes, None, false)?,
            ..LeftCopy::default()
        });
    }
    let held: HashMap<(&str, &[u64]), usize> = given
        .mine
        .boxes
        .iter()
        .enumerate()
        .map(|(i, b)| ((b.fqn.as_str(), b.offsets.as_slice()), i))
        .collect();
    let mut entries = Vec::with_capacity(file.chunks().len() + file.objects().len());
    let mut bytes = Vec::with_capacity(entries.capacity());
    let mut tensor_bytes = 0;
    for chunk in file.chunks() {
        let fqn = tensors
            .get(chunk.tensor as usize)
            .map(|t| t.fqn.as_str())
            .unwrap_or_default();
        let offsets: Vec<u64> = chunk.region.offsets.iter().copied().collect();
        let Some(&i) = held.get(&(fqn, offsets.as_slice())) else {
            return Err(OpsError::invalid(format!(
                "memory tier: {} holds box {} of {fqn}, which this rank does not hold",
                file.path(),
                chunk.region
            )));
        };
        let what = || format!("box {} of {fqn}", chunk.region);
        // A box written in parts would be several chunks of one buffer; the save writes whole.
        let buffer = given.data.get(i).copied().unwrap_or_default();
        entries.push(entry(
            file,
            what,
            chunk.bytes.offset,
            chunk.bytes.length,
            chunk.crc32c,
            buffer,
        )?);
        bytes.push(buffer);
        tensor_bytes += chunk.bytes.length;
    }
    for object in file.objects() {
        let what = || format!("value {}", object.key);
        let Some((_, buffer)) = given.objects.iter().find(|(k, _)| *k == object.key) else {
            return Err(OpsError::invalid(format!(
                "memory tier: {} holds {}, which this rank did not save",
                file.path(),
                what()
            )));
        };
        entries.push(entry(
            file,
            what,
            object.offset,
            object.length,
            object.crc32c,
            buffer,
        )?);
        bytes.push(buffer.as_slice());
    }
    let record = TierRecord {
        format: TIER_FORMAT.into(),
        version: TIER_VERSION,
        checkpoint: checkpoint.to_string(),
        identity,
        step: manifest.step,
        file: file.path().to_string(),
        size: file.size(),
        entries,
        saved_unix_ms: now_unix_ms(),
    };
    let path = write_copy(&tier.dir, &record, &bytes)?;
    let keep_name = copy_dir_name(&record.identity, record.step);
    let pruned = prune(
        &tier.dir,
        tier.keep,
        tier.max_bytes,
        Some(&keep_name),
        false,
    )?;
    Ok(LeftCopy {
        path: Some(path),
        bytes: tensor_bytes,
        skipped: None,
        pruned,
    })
}

/// One entry of a copy's record, checked against the bytes this rank holds for it.
fn entry(
    file: &WrittenFile,
    what: impl Fn() -> String,
    offset: u64,
    length: u64,
    crc32c: Option<u32>,
    buffer: &[u8],
) -> Result<TierEntry, OpsError> {
    let Some(crc32c) = crc32c else {
        return Err(OpsError::invalid(format!(
            "memory tier: {} in {} has no crc32c",
            what(),
            file.path()
        )));
    };
    if buffer.len() as u64 != length {
        return Err(OpsError::invalid(format!(
            "memory tier: {} is {length} bytes in {} but {} in memory",
            what(),
            file.path(),
            buffer.len()
        )));
    }
    Ok(TierEntry {
        offset,
        length,
        crc32c,
    })
}

/// What a prune removed (or, dry, would remove).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Pruned {
    /// Copies removed: their folders.
    pub removed: Vec<PathBuf>,
    /// Bytes of their files.
    pub bytes: u64,
    /// Copies kept: their folders, newest first.
    pub kept: Vec<PathBuf>,
    /// Bytes of the kept copies' files.
    pub kept_bytes: u64,
}

/// One copy folder of a tier.
struct CopyDir {
    path: PathBuf,
    /// The newest record's time; `None` for a copy without any record (a save that died, or
    /// one still writing).
    saved: Option<u64>,
    /// Its last change, for copies without records.
    modified: u64,
    bytes: u64,
}

/// Prunes the tier at `dir` to the newest `keep` complete copies and at most `max_bytes`, never
/// removing the copy folder named `protect` (the one just left). Copy folders without any record
/// older than the oldest kept copy are what died saves left, and go too. Only copy folders
/// tessera made count ([`is_copy_dir`]); nothing else there is listed or touched, and a `dir`
/// that is, holds or lies inside a checkpoint is refused ([`check_tier_dir`]). `dry_run`
/// removes nothing. A missing `dir` is an empty tier.
pub fn prune(
    dir: &Path,
    keep: usize,
    max_bytes: Option<u64>,
    protect: Option<&str>,
    dry_run: bool,
) -> Result<Pruned, OpsError> {
    check_tier_dir(dir, None)?;
    let mut copies = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Pruned::default()),
        Err(e) => return Err(io_error("listing the memory tier", dir, e)),
    };
    for entry in entries.flatten() {
        let path = entry.path();
        // Only folders tessera made (their marker): anything else in a shared tier is another
        // program's, however old and whatever it holds.
        if !entry.file_type().is_ok_and(|t| t.is_dir()) || !is_copy_dir(&path) {
            continue;
        }
        let mut copy = CopyDir {
            path,
            saved: None,
            modified: 0,
            bytes: 0,
        };
        survey(&copy.path.clone(), &mut copy, 0);
        copies.push(copy);
    }
    // Complete copies newest first; the protected one counts as newest.
    let is_protected =
        |c: &CopyDir| protect.is_some_and(|name| c.path.file_name().is_some_and(|n| n == name));
    let (mut complete, incomplete): (Vec<CopyDir>, Vec<CopyDir>) = copies
        .into_iter()
        .partition(|c| c.saved.is_some() || is_protected(c));
    complete.sort_by_key(|c| (!is_protected(c), std::cmp::Reverse(c.saved)));
    let keep = keep.max(1);
    let mut removed: Vec<CopyDir> = complete.split_off(keep.min(complete.len()));
    if let Some(max) = max_bytes {
        while complete.iter().map(|c| c.bytes).sum::<u64>() > max
            && complete.last().is_some_and(|c| !is_protected(c))
        {
            removed.extend(complete.pop());
        }
    }
    let oldest_kept = complete.iter().filter_map(|c| c.saved).min();
    removed.extend(
        incomplete
            .into_iter()
            .filter(|c| oldest_kept.is_some_and(|t| c.modified < t)),
    );
    if !dry_run {
        for copy in &removed {
            match std::fs::remove_dir_all(&copy.path) {
                Ok(()) => {}
                // Another rank of the node pruned it first.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io_error("removing an old memory-tier copy", &copy.path, e)),
            }
        }
    }
    Ok(Pruned {
        bytes: removed.iter().map(|c| c.bytes).sum(),
        removed: removed.into_iter().map(|c| c.path).collect(),
        kept_bytes: complete.iter().map(|c| c.bytes).sum(),
        kept: complete.into_iter().map(|c| c.path).collect(),
    })
}

/// Adds the files under `dir` to `copy`: bytes, newest change, newest record.
fn survey(dir: &Path, copy: &mut CopyDir, depth: u32) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(meta) = entry.metadata() else { continue };
        if meta.is_dir() {
            if depth < 3 {
                survey(&path, copy, depth + 1);
            }
            continue;
        }
        let modified = meta
            .modified()
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |d| d.as_millis() as u64);
        copy.modified = copy.modified.max(modified);
        copy.bytes += meta.len();
        if path.to_string_lossy().ends_with(RECORD_SUFFIX) {
            let saved = std::fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<TierRecord>(&b).ok())
                .map_or(modified, |r| r.saved_unix_ms);
            copy.saved = Some(copy.saved.map_or(saved, |s| s.max(saved)));
        }
    }
}

/// Files whose presence makes a folder a checkpoint (or one being saved): native's manifest,
/// metadata and write claim, DCP's `.metadata`, and a run's `latest` pointer next to its steps.
const CHECKPOINT_FILES: [&str; 5] = [
    tessera_metadata::formats::native::MANIFEST_FILE,
    tessera_metadata::formats::native::METADATA_FILE,
    tessera_metadata::formats::native::LATEST_FILE,
    crate::claim::CLAIM_FILE,
    ".metadata",
];

/// Folders looked at below a tier for checkpoints it holds: the tier's own folders and theirs
/// (`root/step-3`, `root/run/step-3`); a shared tier (`/dev/shm`) may hold many.
const CHECK_DEPTH: u32 = 2;

/// Entries of one folder looked at for checkpoints: bounds the check in a crowded shared tier.
const CHECK_ENTRIES: usize = 4096;

/// Refuses a memory tier at `dir` that would mix tessera's copies with checkpoints, which the
/// prune of its copies must never meet: `dir` is a checkpoint (or a run's root, with `latest`),
/// lies inside one, or holds one up to [`CHECK_DEPTH`] folders down (the checkpoints' root given
/// as the tier); or `checkpoint` (the local folder of the checkpoint being saved) is `dir` or
/// inside it, or holds it. An empty path is refused (it would be the current directory).
pub fn check_tier_dir(dir: &Path, checkpoint: Option<&Path>) -> Result<(), OpsError> {
    let refuse = |why: String| {
        Err(OpsError::invalid(format!(
            "memory tier {}: {why}; a memory tier is a directory of its own (e.g. \
             /dev/shm/tessera/<run>) that holds only the copies tessera leaves there",
            dir.display()
        )))
    };
    if dir.as_os_str().is_empty() {
        return refuse("an empty path (it would be the current directory)".into());
    }
    let tier = resolved(dir);
    if let Some(checkpoint) = checkpoint {
        let checkpoint = resolved(checkpoint);
        if checkpoint.starts_with(&tier) {
            return refuse(format!(
                "the checkpoint being saved, {}, would be inside it",
                checkpoint.display()
            ));
        }
        if tier.starts_with(&checkpoint) {
            return refuse(format!(
                "it is inside the checkpoint being saved, {}",
                checkpoint.display()
            ));
        }
    }
    for folder in tier.ancestors() {
        if let Some(file) = checkpoint_file(folder) {
            let what = if folder == tier {
                "it is"
            } else {
                "it is inside"
            };
            return refuse(format!("{what} {}", checkpoint_named(folder, file)));
        }
    }
    if let Some((folder, file)) = holds_checkpoint(&tier, 1) {
        return refuse(format!("it holds {}", checkpoint_named(&folder, file)));
    }
    Ok(())
}

/// `folder`, which has `file` ([`CHECKPOINT_FILES`]), as a refusal names it.
fn checkpoint_named(folder: &Path, file: &str) -> String {
    if file == tessera_metadata::formats::native::LATEST_FILE {
        format!(
            "the run of checkpoints {} (it has {file})",
            folder.display()
        )
    } else {
        format!("the checkpoint {} (it has {file})", folder.display())
    }
}

/// `path` absolute, through its symbolic links as far as it exists (a tier need not exist yet).
fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut existing = absolute.as_path();
    let mut rest = Vec::new();
    loop {
        if let Ok(real) = std::fs::canonicalize(existing) {
            return rest.iter().rev().fold(real, |p, part| p.join(part));
        }
        match (existing.parent(), existing.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                existing = parent;
            }
            _ => return absolute,
        }
    }
}

/// The file that makes `folder` a checkpoint, if it has one ([`CHECKPOINT_FILES`]).
fn checkpoint_file(folder: &Path) -> Option<&'static str> {
    CHECKPOINT_FILES
        .into_iter()
        .find(|f| std::fs::symlink_metadata(folder.join(f)).is_ok())
}

/// A checkpoint in the folders under `dir` (`depth` levels below the tier), not looking into
/// tier copies or through symbolic links.
fn holds_checkpoint(dir: &Path, depth: u32) -> Option<(PathBuf, &'static str)> {
    let entries = std::fs::read_dir(dir).ok()?;
    for entry in entries.flatten().take(CHECK_ENTRIES) {
        let path = entry.path();
        if !entry.file_type().is_ok_and(|t| t.is_dir()) || is_copy_dir(&path) {
            continue;
        }
        if let Some(file) = checkpoint_file(&path) {
            return Some((path, file));
        }
        if depth < CHECK_DEPTH
            && let Some(found) = holds_checkpoint(&path, depth + 1)
        {
            return Some(found);
        }
    }
    None
}

fn io_error(action: &str, path: &Path, e: std::io::Error) -> OpsError {
    OpsError::invalid(format!("{action} {}: {e}", path.display()))
}

/// The load side: this rank's view of `checkpoint` when its node's tier is at `dir`, with the
/// copies found there (only this checkpoint's, each verified: [`find_copies`]). A checkpoint
/// without an identity (assembled in memory) has no copies anywhere.
pub fn view_with_tier(
    checkpoint: &Checkpoint,
    dir: &Path,
) -> Result<(Checkpoint, TierCopies), OpsError> {
    let Some(identity) = checkpoint.meta.identity() else {
        return Ok((checkpoint.clone(), TierCopies::default()));
    };
    let copies = find_copies(dir, &checkpoint.meta, identity);
    Ok((checkpoint.with_tier_copies(&copies)?, copies))
}

/// The planner's sources from every rank's offer (`offers[r]`: the data files rank r found in
/// its node's tier): each file readable by the ranks that offered it.
pub fn sources_of(offers: &[Vec<u32>]) -> ReadSources {
    let mut sources = ReadSources::none();
    for (rank, files) in offers.iter().enumerate() {
        for &file in files {
            sources.add(file, SourceTier::NodeMemory, [rank as u32]);
        }
    }
    sources
}

/// What a rank offers first when a job loads with memory tiers: its node and the candidate
/// copies there, not yet verified ([`TierLoad`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierOffer {
    /// This host and the tier's canonical path: ranks naming the same directory on one host
    /// share its copies. Empty: no tier.
    pub node: String,
    /// Data files with a candidate copy there, ascending.
    pub files: Vec<u32>,
}

/// One rank's side of a load with memory tiers, in two rounds over the job: every rank offers
/// its node and candidate copies ([`TierLoad::offer`]); the ranks of a node split the copies and
/// each verifies its share ([`TierLoad::verify_share`]); once every rank said what verified,
/// [`TierLoad::settle`] gives this rank's view of the checkpoint and the planner's sources. A
/// node's copies are read whole once to verify them, whatever its number of ranks.
#[derive(Debug, Default)]
pub struct TierLoad {
    offer: TierOffer,
    candidates: TierCandidates,
}

impl TierLoad {
    /// Finds the candidate copies of `checkpoint` in the tier at `dir` (records only); a rank
    /// without a tier (`None`) offers nothing.
    pub fn find(checkpoint: &Checkpoint, dir: Option<&Path>) -> Self {
        let (Some(dir), Some(identity)) = (dir, checkpoint.meta.identity()) else {
            return Self::default();
        };
        let candidates = find_candidates(dir, &checkpoint.meta, identity);
        let canonical = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
        let host = crate::claim::host_name();
        Self {
            offer: TierOffer {
                node: format!("{host}:{}", canonical.display()),
                files: candidates.file_indices(),
            },
            candidates,
        }
    }

    /// What this rank offers in the first round.
    pub fn offer(&self) -> &TierOffer {
        &self.offer
    }

    /// The second round: verifies the share of its node's candidates that falls to rank `rank`
    /// (the node's ranks, ascending, take its files in turn), given every rank's offer.
    pub fn verify_share(&self, meta: &CheckpointMeta, offers: &[TierOffer], rank: u32) -> Verified {
        self.verify_in_node(meta, &node_ranks(offers, &self.offer.node), rank)
    }

    /// [`TierLoad::verify_share`] given only the ranks of this rank's node (`node`, ascending):
    /// all a rank needs to know of the job for its share.
    pub fn verify_in_node(&self, meta: &CheckpointMeta, node: &[u32], rank: u32) -> Verified {
        let Some(position) = node.iter().position(|&r| r == rank) else {
            return self.candidates.verify(meta, |_| false);
        };
        let files = &self.offer.files;
        self.candidates.verify(meta, |file| {
            files
                .iter()
                .position(|&f| f == file)
                .is_some_and(|i| i % node.len() == position)
        })
    }

    /// After both rounds (`offers[r]`, `verified[r]`: rank r's): this rank's view of
    /// `checkpoint` (the copies its node verified read from the tier), the planner's sources (each
    /// node's verified copies readable by its ranks), and the copies this rank reads with what
    /// its node's ranks did not take and why.
    pub fn settle(
        &self,
        checkpoint: &Checkpoint,
        offers: &[TierOffer],
        verified: &[Verified],
    ) -> Result<(Checkpoint, ReadSources, TierCopies), OpsError> {
        let sources = sources_of_verified(offers, verified)?;
        let node = node_ranks(offers, &self.offer.node);
        let node_verified: Vec<&Verified> = node.iter().map(|&r| &verified[r as usize]).collect();
        let (view, mine) = self.accept_node(checkpoint, &node_verified)?;
        Ok((view, sources, mine))
    }

    /// This rank's view of `checkpoint` given what its node's ranks verified (`node_verified`:
    /// theirs, this rank's included), and the copies it reads with what the node did not take
    /// and why.
    pub fn accept_node(
        &self,
        checkpoint: &Checkpoint,
        node_verified: &[&Verified],
    ) -> Result<(Checkpoint, TierCopies), OpsError> {
        if self.offer.node.is_empty() {
            return Ok((
                checkpoint.with_tier_copies(&TierCopies::default())?,
                TierCopies::default(),
            ));
        }
        let mut held: Vec<u32> = node_verified
            .iter()
            .flat_map(|v| v.files.iter().copied())
            .collect();
        held.sort_unstable();
        held.dedup();
        let mut mine = self.candidates.accept(&held);
        for verified in node_verified {
            for why in &verified.ignored {
                if !mine.ignored.contains(why) {
                    mine.ignored.push(why.clone());
                }
            }
        }
        Ok((checkpoint.with_tier_copies(&mine)?, mine))
    }
}

/// The planner's sources once every rank said what verified (`offers[r]`, `verified[r]`: rank
/// r's): each node's verified copies, readable by the node's ranks that offered them.
pub fn sources_of_verified(
    offers: &[TierOffer],
    verified: &[Verified],
) -> Result<ReadSources, OpsError> {
    if offers.len() != verified.len() {
        return Err(OpsError::invalid(format!(
            "memory tier: {} offers but {} verifications gathered",
            offers.len(),
            verified.len()
        )));
    }
    let mut sources = ReadSources::none();
    for ranks in nodes_of(offers).into_values() {
        let mut held: Vec<u32> = ranks
            .iter()
            .flat_map(|&r| verified[r as usize].files.iter().copied())
            .collect();
        held.sort_unstable();
        held.dedup();
        for &r in &ranks {
            let offered = &offers[r as usize].files;
            for &file in held.iter().filter(|f| offered.binary_search(f).is_ok()) {
                sources.add(file, SourceTier::NodeMemory, [r]);
            }
        }
    }
    Ok(sources)
}

/// Every node that some rank offers copies of, with its ranks (ascending), in one pass over the
/// offers.
pub fn nodes_of(offers: &[TierOffer]) -> std::collections::BTreeMap<&str, Vec<u32>> {
    let mut nodes: std::collections::BTreeMap<&str, Vec<u32>> = std::collections::BTreeMap::new();
    for (r, offer) in offers.iter().enumerate() {
        if !offer.node.is_empty() {
            nodes.entry(offer.node.as_str()).or_default().push(r as u32);
        }
    }
    nodes
}

/// The ranks whose offer names `node`, ascending (none for the empty node).
fn node_ranks(offers: &[TierOffer], node: &str) -> Vec<u32> {
    if node.is_empty() {
        return Vec::new();
    }
    offers
        .iter()
        .enumerate()
        .filter(|(_, o)| o.node == node)
        .map(|(r, _)| r as u32)
        .collect()
}
