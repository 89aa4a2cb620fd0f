//! What a registry directory holds: each live publication with its steps, their state
//! (complete, incomplete naming the ranks not yet there, retired), their publisher ranks and
//! URLs, bytes, tensors and times; what `tessera live list|show`, the server's `/v1/live` and
//! its web UI show.
//!
//! The registry is written while it is listed (publisher ranks drop parts in, rank 0 commits,
//! retires, consumers take leases), so nothing a writer can leave half-done fails the listing: a
//! step directory without parts is an incomplete step, a file that vanished between the listing
//! and the read is one that is not there, and a part that does not parse is named (its file) in
//! that step's `problems` while the rest of the step is listed. Only an unreadable registry, or
//! a publication asked for by name that is not there, is an error.
//!
//! A step's state follows the files of the layout in [`super`] (the same rule as
//! `python/tessera/_live.py`'s `_complete` and `_incomplete`):
//! - `manifest.json` and `publishers.json`: **complete**, loadable;
//! - `publishers.json` without the manifest: **retired** (rank 0 removes the manifest when it
//!   retires a step; its commit writes `publishers.json` only just before the manifest, so for
//!   that moment a step being committed reads the same);
//! - otherwise **incomplete**: the ranks whose parts are missing, or, with every part there,
//!   not committed yet (rank 0 committing, or its commit failed).
//!
//! Reading costs a few small files per step listed (each part's head, the manifest), so a
//! listing reads only the newest [`ListOptions::steps`] steps of each publication, plus the
//! newest complete one when it is older; older steps are counted, not read.

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::path::{Path as FsPath, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use tessera_metadata::formats::native::{Created, MANIFEST_FILE, Manifest};
use tessera_storage::PUBLISHERS_FILE;

use super::PARTS_DIR;
use crate::OpsError;

/// Steps of each publication a listing reads by default (the newest ones).
pub const DEFAULT_LISTED_STEPS: usize = 10;
/// Largest part, `publishers.json` or manifest file read for a listing (a part holds every box
/// and block checksum of a rank's shard: a few MB for a huge one). Larger is reported, not read.
const MAX_FILE_BYTES: u64 = 256 * 1024 * 1024;
/// Longest publication name (`python/tessera/_live.py`'s `_NAME`).
const MAX_NAME: usize = 200;

/// How much a listing reads.
#[derive(Clone, Copy, Debug)]
pub struct ListOptions {
    /// Steps of each publication listed, newest first ([`DEFAULT_LISTED_STEPS`]); the newest
    /// complete step is summarized even when older. 0 lists none (the summary only).
    pub steps: usize,
}

impl Default for ListOptions {
    fn default() -> Self {
        Self {
            steps: DEFAULT_LISTED_STEPS,
        }
    }
}

/// A step's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepState {
    /// Every rank published and rank 0 committed: `live://NAME@STEP` loads it.
    Complete,
    /// Some rank's part is missing (`missing_ranks`), or rank 0 has not committed it yet.
    Incomplete,
    /// Committed once, then retired (superseded past `keep`, or `pub.retire()`): no longer
    /// loadable.
    Retired,
}

impl StepState {
    /// `complete`, `incomplete` or `retired`.
    pub fn as_str(self) -> &'static str {
        match self {
            StepState::Complete => "complete",
            StepState::Incomplete => "incomplete",
            StepState::Retired => "retired",
        }
    }
}

/// One publisher rank of a step: where it serves its data file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublisherEntry {
    /// The publisher rank.
    pub rank: u32,
    /// Its server's origin, `http://host:port`.
    pub url: String,
    /// The data file's path on that server.
    pub path: String,
    /// Bytes of its data file (as its part says; absent when only `publishers.json` names it).
    pub bytes: Option<u64>,
}

/// One step of a publication.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepEntry {
    /// The step.
    pub step: u64,
    /// Its directory, `<registry>/<name>/step-<N>`.
    pub dir: String,
    /// Complete, incomplete or retired.
    pub state: StepState,
    /// Why it is not complete, in words (absent when complete).
    pub detail: Option<String>,
    /// The publishing job's ranks, as its parts say (absent when no part says).
    pub world: Option<u32>,
    /// Ranks whose parts are there (and read), ascending.
    pub ranks: Vec<u32>,
    /// Ranks of `0..world` whose parts are not there (or do not read: see `problems`).
    pub missing_ranks: Vec<u32>,
    /// Each rank's server, by rank.
    pub publishers: Vec<PublisherEntry>,
    /// Bytes the publishers serve (every data file): the manifest's when committed, else the
    /// parts' sum.
    pub bytes: Option<u64>,
    /// Bytes of all tensors, each element once (committed steps).
    pub tensor_bytes: Option<u64>,
    /// Tensors: the manifest's, else the distinct tensors the parts there hold.
    pub tensors: Option<u64>,
    /// When the last part there was written, RFC 3339 UTC.
    pub published: Option<String>,
    /// When rank 0 committed it (the manifest's time).
    pub committed: Option<String>,
    /// Consumers' lease files on it (each a load reading it, or one that died holding it).
    pub leases: u64,
    /// Files of the step that could not be read, each naming the file.
    pub problems: Vec<String>,
}

/// One publication: its newest complete step in brief, and its newest steps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PublicationEntry {
    /// The name (`live://NAME`).
    pub name: String,
    /// Its directory, `<registry>/<name>`.
    pub dir: String,
    /// The step `live://NAME` loads now.
    pub newest_complete: Option<u64>,
    /// The newest step of any state.
    pub newest: Option<u64>,
    /// Step directories, of any state.
    pub steps_total: u64,
    /// Of the newest complete step: the publisher ranks, bytes and tensors.
    pub world: Option<u32>,
    /// Of the newest complete step: its publishers.
    pub publishers: Vec<PublisherEntry>,
    /// Of the newest complete step: bytes served.
    pub bytes: Option<u64>,
    /// Of the newest complete step: tensors.
    pub tensors: Option<u64>,
    /// The newest [`ListOptions::steps`] steps, newest first.
    pub steps: Vec<StepEntry>,
    /// Whether older steps were left out of `steps`.
    pub steps_truncated: bool,
}

/// A registry's publications.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegistryListing {
    /// The registry directory.
    pub registry: String,
    /// Its publications, by name.
    pub publications: Vec<PublicationEntry>,
    /// Entries of the registry that could not be read, each naming the entry.
    pub problems: Vec<String>,
}

/// Checks a publication name the way `tessera.publish` does (1 to 200 ASCII letters, digits,
/// `_`, `.`, `-`, starting with a letter or digit), so a name from a URL never leaves the
/// registry (`..`, `/`).
pub fn check_name(name: &str) -> Result<(), OpsError> {
    let mut chars = name.chars();
    let good = name.len() <= MAX_NAME
        && chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'));
    if good {
        Ok(())
    } else {
        Err(OpsError::invalid(format!(
            "publication name {name:?}: use 1 to {MAX_NAME} ASCII letters, digits, '_', '.' or '-', starting with a letter or digit"
        )))
    }
}

/// The step of a step directory's name (`step-000100`).
pub(super) fn step_of(dir_name: &str) -> Option<u64> {
    let digits = dir_name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Every publication in `registry`, by name. Fails only when `registry` cannot be listed.
pub fn list_registry(
    registry: &FsPath,
    options: &ListOptions,
) -> Result<RegistryListing, OpsError> {
    let entries = std::fs::read_dir(registry).map_err(|e| registry_error(registry, &e))?;
    let mut names = Vec::new();
    let mut problems = Vec::new();
    for entry in entries {
        let entry = match entry {
            Ok(entry) => entry,
            Err(e) => {
                problems.push(format!("listing {}: {e}", registry.display()));
                continue;
            }
        };
        let Some(name) = entry.file_name().to_str().map(str::to_string) else {
            continue;
        };
        // Hidden and temporary entries, and anything not named as a publication.
        if check_name(&name).is_err() {
            continue;
        }
        // A symlink to a directory counts (std's metadata follows it).
        match std::fs::metadata(entry.path()) {
            Ok(meta) if meta.is_dir() => names.push(name),
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => problems.push(format!("{}: {e}", entry.path().display())),
        }
    }
    names.sort();
    let mut publications = Vec::with_capacity(names.len());
    for name in names {
        match read_publication(registry, &name, options) {
            Ok(Some(publication)) => publications.push(publication),
            // Removed since the registry was listed.
            Ok(None) => {}
            Err(e) => problems.push(e.to_string()),
        }
    }
    Ok(RegistryListing {
        registry: registry.display().to_string(),
        publications,
        problems,
    })
}

/// The publication `name` in `registry`; [`OpsError::UnknownPublication`] when there is none.
pub fn list_publication(
    registry: &FsPath,
    name: &str,
    options: &ListOptions,
) -> Result<PublicationEntry, OpsError> {
    check_name(name)?;
    if let Err(e) = std::fs::metadata(registry) {
        return Err(registry_error(registry, &e));
    }
    read_publication(registry, name, options)?.ok_or_else(|| OpsError::UnknownPublication {
        name: name.to_string(),
        registry: registry.display().to_string(),
    })
}

fn registry_error(registry: &FsPath, e: &std::io::Error) -> OpsError {
    if e.kind() == ErrorKind::NotFound {
        OpsError::invalid(format!(
            "registry {}: no such directory (the directory publishers were given as registry=)",
            registry.display()
        ))
    } else {
        OpsError::invalid(format!("listing registry {}: {e}", registry.display()))
    }
}

/// `None` when the publication's directory is not there (or not a directory).
fn read_publication(
    registry: &FsPath,
    name: &str,
    options: &ListOptions,
) -> Result<Option<PublicationEntry>, OpsError> {
    let dir = registry.join(name);
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
            return Ok(None);
        }
        Err(e) => {
            return Err(OpsError::invalid(format!(
                "listing publication {}: {e}",
                dir.display()
            )));
        }
    };
    // Newest first, from the names alone: only the steps listed are read.
    let mut steps: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let step = step_of(e.file_name().to_str()?)?;
            Some((step, e.path()))
        })
        .filter(|(_, path)| path.is_dir())
        .collect();
    steps.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    let listed: Vec<StepEntry> = steps
        .iter()
        .take(options.steps)
        .map(|(step, path)| read_step(*step, path))
        .collect();
    // The step `live://NAME` loads: the newest complete one, read when not listed above.
    let newest_complete = match listed.iter().find(|s| s.state == StepState::Complete) {
        Some(step) => Some(step.clone()),
        None => steps
            .iter()
            .skip(options.steps)
            .find(|(_, path)| is_complete(path))
            .map(|(step, path)| read_step(*step, path)),
    };
    Ok(Some(PublicationEntry {
        name: name.to_string(),
        dir: dir.display().to_string(),
        newest_complete: newest_complete.as_ref().map(|s| s.step),
        newest: steps.first().map(|(step, _)| *step),
        steps_total: steps.len() as u64,
        world: newest_complete.as_ref().and_then(|s| s.world),
        publishers: newest_complete
            .as_ref()
            .map(|s| s.publishers.clone())
            .unwrap_or_default(),
        bytes: newest_complete.as_ref().and_then(|s| s.bytes),
        tensors: newest_complete.as_ref().and_then(|s| s.tensors),
        steps_truncated: steps.len() > listed.len(),
        steps: listed,
    }))
}

/// The publication and step a `live://NAME[@STEP]` URL names (`None` for a URL of another
/// scheme; an error naming the URL for a step that is not a number).
pub fn parse_live_url(url: &str) -> Result<Option<(&str, Option<u64>)>, OpsError> {
    let Some(rest) = url.strip_prefix("live://") else {
        return Ok(None);
    };
    match rest.split_once('@') {
        Some((name, step)) => {
            let step = step.parse::<u64>().map_err(|_| {
                OpsError::invalid(format!(
                    "{url}: the step after '@' must be a number (live://NAME@STEP)"
                ))
            })?;
            Ok(Some((name, Some(step))))
        }
        None => Ok(Some((rest, None))),
    }
}

/// The step `live://NAME[@STEP]` names in `registry` and its directory: `step` when given and
/// complete, else the newest complete step. What a consumer loads (`tessera.load`, `tessera load`)
/// goes through here; when there is no such step the error says what is missing in the words of
/// the listing (never published; the publisher ranks that have not published it; not committed).
pub fn resolve(
    registry: &FsPath,
    name: &str,
    step: Option<u64>,
) -> Result<(u64, PathBuf), OpsError> {
    check_name(name)?;
    let base = registry.join(name);
    if let Some(step) = step {
        // The layout's name of a step (`step-000100`, see `ops/src/publish.rs`).
        let dir = base.join(format!("step-{step:06}"));
        if !dir.is_dir() {
            return Err(OpsError::invalid(format!(
                "step {step} of live publication {name} was never published in {}",
                registry.display()
            )));
        }
        if !is_complete(&dir) {
            return Err(OpsError::invalid(not_loadable(
                name,
                &read_step(step, &dir),
            )));
        }
        return Ok((step, dir));
    }
    let entries = match std::fs::read_dir(&base) {
        Ok(entries) => entries,
        Err(e) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
            return Err(OpsError::UnknownPublication {
                name: name.to_string(),
                registry: registry.display().to_string(),
            });
        }
        Err(e) => {
            return Err(OpsError::invalid(format!(
                "reading {}: {e}",
                base.display()
            )));
        }
    };
    let mut steps: Vec<(u64, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| Some((step_of(e.file_name().to_str()?)?, e.path())))
        .filter(|(_, path)| path.is_dir())
        .collect();
    steps.sort_by_key(|(step, _)| std::cmp::Reverse(*step));
    if let Some((step, dir)) = steps.iter().find(|(_, dir)| is_complete(dir)) {
        return Ok((*step, dir.clone()));
    }
    let newest: Vec<String> = steps
        .iter()
        .take(3)
        .map(|(step, dir)| not_loadable(name, &read_step(*step, dir)))
        .collect();
    Err(OpsError::invalid(format!(
        "live publication {name} in {} has no complete step ({})",
        registry.display(),
        if newest.is_empty() {
            "no step at all".to_string()
        } else {
            newest.join("; ")
        }
    )))
}

/// Why step `entry` of publication `name` cannot be loaded, naming the publication.
fn not_loadable(name: &str, entry: &StepEntry) -> String {
    let step = entry.step;
    let detail = entry
        .detail
        .clone()
        .unwrap_or_else(|| format!("step {step} is not complete"));
    match detail.strip_prefix(&format!("step {step}")) {
        Some(rest) => format!("step {step} of live publication {name}{rest}"),
        None => format!("step {step} of live publication {name}: {detail}"),
    }
}

/// Whether a step directory is complete (the consumers' rule: manifest and publishers there).
fn is_complete(dir: &FsPath) -> bool {
    dir.join(MANIFEST_FILE).is_file() && dir.join(PUBLISHERS_FILE).is_file()
}

/// Whether the step in `dir` was committed and then retired (its publishers, no manifest), by
/// the files alone (the module doc's rule; [`read_step`] also reads them).
pub(super) fn is_retired(dir: &FsPath) -> bool {
    dir.join(PUBLISHERS_FILE).is_file() && !dir.join(MANIFEST_FILE).exists()
}

/// What a listing reads of a part: its head, the tensors its boxes belong to and its data
/// file's size. Fields it does not name (block checksums, byte ranges, fields added later) are
/// skipped, so a part with more fields still lists.
#[derive(Deserialize)]
struct PartHead {
    rank: u32,
    world: u32,
    step: u64,
    url: String,
    path: String,
    holdings: HoldingsHead,
    file: FileHead,
}

#[derive(Deserialize)]
struct HoldingsHead {
    boxes: Vec<BoxHead>,
}

#[derive(Deserialize)]
struct BoxHead {
    fqn: String,
}

#[derive(Deserialize)]
struct FileHead {
    size: u64,
}

#[derive(Deserialize)]
struct PublishersFile {
    publishers: Vec<PublisherHead>,
}

#[derive(Deserialize)]
struct PublisherHead {
    rank: u32,
    url: String,
    path: String,
}

/// Reads a small file of the registry: `Ok(None)` when it is not there (not written yet, or
/// removed meanwhile), an error naming the file when it is too large or unreadable.
fn read_small(path: &FsPath) -> Result<Option<Vec<u8>>, String> {
    match std::fs::metadata(path) {
        Ok(meta) if meta.len() > MAX_FILE_BYTES => {
            return Err(format!(
                "{}: {} bytes, over the cap of {MAX_FILE_BYTES}",
                path.display(),
                meta.len()
            ));
        }
        Ok(_) => {}
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("{}: {e}", path.display())),
    }
    match std::fs::read(path) {
        Ok(bytes) => Ok(Some(bytes)),
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

fn rfc3339(time: SystemTime) -> Option<String> {
    let secs = time.duration_since(UNIX_EPOCH).ok()?.as_secs();
    match Created::at_unix_seconds(secs) {
        Created::Rfc3339(text) => Some(text),
        Created::UnixSeconds(secs) => Some(secs.to_string()),
    }
}

/// A step's parts (`parts/rank-<r>.json`) that parse and sit where they say, with the newest
/// one's modification time; what does not is added to `problems`, naming the file.
fn read_parts(
    step: u64,
    dir: &FsPath,
    problems: &mut Vec<String>,
) -> (Vec<PartHead>, Option<SystemTime>) {
    let mut parts: Vec<PartHead> = Vec::new();
    let mut newest_part: Option<SystemTime> = None;
    let parts_dir = dir.join(PARTS_DIR);
    match std::fs::read_dir(&parts_dir) {
        Ok(entries) => {
            for entry in entries.filter_map(Result::ok) {
                let file_name = entry.file_name();
                let Some(file_name) = file_name.to_str() else {
                    continue;
                };
                // `rank-<r>.json`; the writers' temporary files start with a dot.
                let Some(named) = file_name
                    .strip_prefix("rank-")
                    .and_then(|rest| rest.strip_suffix(".json"))
                    .and_then(|r| r.parse::<u32>().ok())
                else {
                    continue;
                };
                let path = entry.path();
                let bytes = match read_small(&path) {
                    Ok(Some(bytes)) => bytes,
                    Ok(None) => continue,
                    Err(problem) => {
                        problems.push(problem);
                        continue;
                    }
                };
                let part: PartHead = match serde_json::from_slice(&bytes) {
                    Ok(part) => part,
                    Err(e) => {
                        problems.push(format!("{}: not a part: {e}", path.display()));
                        continue;
                    }
                };
                if part.rank != named || part.step != step {
                    problems.push(format!(
                        "{}: the part says rank {} of step {}, its place says rank {named} of step {step}",
                        path.display(),
                        part.rank,
                        part.step
                    ));
                    continue;
                }
                if let Ok(modified) = entry.metadata().and_then(|m| m.modified()) {
                    newest_part = newest_part.max(Some(modified));
                }
                parts.push(part);
            }
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => problems.push(format!("{}: {e}", parts_dir.display())),
    }
    (parts, newest_part)
}

/// What rank 0's commit left in a step's directory: its manifest and its publishers' list, each
/// when there and readable (what is there and is not is added to `problems`).
fn read_commit(
    dir: &FsPath,
    problems: &mut Vec<String>,
) -> (Option<Manifest>, Option<Vec<PublisherHead>>) {
    let manifest_path = dir.join(MANIFEST_FILE);
    let manifest = match read_small(&manifest_path) {
        Ok(Some(bytes)) => {
            match Manifest::from_json(&bytes, &manifest_path.display().to_string()) {
                Ok(manifest) => Some(manifest),
                Err(e) => {
                    problems.push(e.to_string());
                    None
                }
            }
        }
        Ok(None) => None,
        Err(problem) => {
            problems.push(problem);
            None
        }
    };
    let publishers_path = dir.join(PUBLISHERS_FILE);
    let served = match read_small(&publishers_path) {
        Ok(Some(bytes)) => match serde_json::from_slice::<PublishersFile>(&bytes) {
            Ok(file) => Some(file.publishers),
            Err(e) => {
                problems.push(format!(
                    "{}: not a publishers file: {e}",
                    publishers_path.display()
                ));
                None
            }
        },
        Ok(None) => None,
        Err(problem) => {
            problems.push(problem);
            None
        }
    };

    (manifest, served)
}

/// One step's entry: its parts and commit read from `dir`, its state and why, publishers,
/// sizes, times and leases; never an error (what cannot be read is in its `problems`).
fn read_step(step: u64, dir: &FsPath) -> StepEntry {
    let mut problems = Vec::new();
    let (mut parts, newest_part) = read_parts(step, dir, &mut problems);
    parts.sort_by_key(|p| p.rank);

    // The world: what the parts say; parts that disagree are named.
    let worlds: BTreeSet<u32> = parts.iter().map(|p| p.world).collect();
    let world = worlds.iter().next_back().copied();
    if worlds.len() > 1 {
        problems.push(format!(
            "{}: its parts disagree on the publishing job's ranks ({})",
            dir.join(PARTS_DIR).display(),
            worlds
                .iter()
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let ranks: Vec<u32> = parts.iter().map(|p| p.rank).collect();
    let missing_ranks: Vec<u32> = match world {
        Some(world) => (0..world).filter(|r| !ranks.contains(r)).collect(),
        None => Vec::new(),
    };

    let manifest_path = dir.join(MANIFEST_FILE);
    let (manifest, served) = read_commit(dir, &mut problems);
    let manifest_there = manifest_path.exists();
    let (state, detail) = if manifest.is_some() && served.is_some() {
        (StepState::Complete, None)
    } else if served.is_some() && !manifest_there {
        (
            StepState::Retired,
            Some(format!(
                "step {step} was committed and then retired (its manifest removed): no longer loadable"
            )),
        )
    } else {
        (
            StepState::Incomplete,
            Some(incomplete_detail(
                step,
                world,
                &ranks,
                &missing_ranks,
                manifest_there,
            )),
        )
    };

    // Publishers: the committed list when there is one, with each rank's bytes from its part.
    let publishers = match &served {
        Some(served) => served
            .iter()
            .map(|p| PublisherEntry {
                rank: p.rank,
                url: p.url.clone(),
                path: p.path.clone(),
                bytes: parts
                    .iter()
                    .find(|part| part.rank == p.rank)
                    .map(|part| part.file.size),
            })
            .collect(),
        None => parts
            .iter()
            .map(|p| PublisherEntry {
                rank: p.rank,
                url: p.url.clone(),
                path: p.path.clone(),
                bytes: Some(p.file.size),
            })
            .collect(),
    };
    let part_tensors: BTreeSet<&str> = parts
        .iter()
        .flat_map(|p| p.holdings.boxes.iter().map(|b| b.fqn.as_str()))
        .collect();
    let (bytes, tensor_bytes, tensors, committed) = match &manifest {
        Some(m) => (
            Some(m.files.iter().map(|f| f.size).sum()),
            Some(m.tensor_bytes),
            Some(m.tensors),
            Some(match &m.created {
                Created::Rfc3339(text) => text.clone(),
                Created::UnixSeconds(secs) => secs.to_string(),
            }),
        ),
        None if !parts.is_empty() => (
            Some(parts.iter().map(|p| p.file.size).sum()),
            None,
            Some(part_tensors.len() as u64),
            None,
        ),
        None => (None, None, None, None),
    };
    let leases = super::lease::lease_files(dir);
    StepEntry {
        step,
        dir: dir.display().to_string(),
        state,
        detail,
        world,
        ranks,
        missing_ranks,
        publishers,
        bytes,
        tensor_bytes,
        tensors,
        published: newest_part.and_then(rfc3339),
        committed,
        leases,
        problems,
    }
}

/// Why a step is not complete, in the words `tessera.load` uses for it.
fn incomplete_detail(
    step: u64,
    world: Option<u32>,
    ranks: &[u32],
    missing: &[u32],
    manifest_there: bool,
) -> String {
    match world {
        None => format!("step {step} has no published part"),
        Some(world) if !missing.is_empty() => format!(
            "step {step} is not complete: publisher ranks {missing:?} of {world} have not published it (parts present: ranks {ranks:?})"
        ),
        Some(world) if manifest_there => format!(
            "step {step}: every one of its {world} ranks published its part, but its manifest or publishers.json does not read (see problems)"
        ),
        Some(world) => format!(
            "step {step} is not committed: every one of its {world} ranks published its part but rank 0 has not committed it (still committing, or its commit failed)"
        ),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::super::{Part, commit_step, write_part, write_part_file};
    use super::*;
    use crate::save::{HeldBox, Holdings};

    /// Rank `rank`'s part of step `step` of a `world`-rank publication of `w` (2 rows of 2 f32 each
    /// rank), written into the registry as `tessera.publish` writes it.
    async fn publish_part(registry: &FsPath, step: u64, rank: u32, world: u32) -> Part {
        let boxes = vec![HeldBox {
            fqn: "w".to_string(),
            dtype: "f32".to_string(),
            shape: vec![u64::from(world) * 2, 2],
            offsets: vec![u64::from(rank) * 2, 0],
            lengths: vec![2, 2],
        }];
        let bytes: Vec<u8> = (0..4u32)
            .flat_map(|v| (v as f32 + rank as f32).to_le_bytes())
            .collect();
        let (_, file) =
            write_part_file(rank, &boxes, &[&bytes], &[], super::super::PartMemory::Heap)
                .await
                .unwrap();
        let dir = step_dir(registry, step);
        let part = Part {
            rank,
            world,
            step,
            url: format!("http://127.0.0.1:{}", 9000 + rank),
            path: format!("m/step-{step:06}/data/publisher-rank-{rank}.bin"),
            holdings: Holdings {
                boxes,
                objects: Vec::new(),
            },
            file,
            shared: None,
        };
        write_part(&dir, &part).unwrap();
        part
    }

    fn step_dir(registry: &FsPath, step: u64) -> PathBuf {
        registry.join("m").join(format!("step-{step:06}"))
    }

    async fn commit(registry: &FsPath, step: u64, parts: &[Part]) {
        commit_step(&step_dir(registry, step), parts, step)
            .await
            .unwrap();
    }

    /// Steps 1 (retired), 2 (complete), 3 (rank 1 missing), 4 (rank 1's part malformed), 5 (a
    /// directory without parts yet), of a 2-rank publication `m`.
    async fn registry() -> tempfile::TempDir {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        for step in [1, 2] {
            let parts = vec![
                publish_part(root, step, 0, 2).await,
                publish_part(root, step, 1, 2).await,
            ];
            commit(root, step, &parts).await;
        }
        // Retiring removes the manifest (`_live.py`'s `_retire`).
        std::fs::remove_file(step_dir(root, 1).join(MANIFEST_FILE)).unwrap();
        publish_part(root, 3, 0, 2).await;
        publish_part(root, 4, 0, 2).await;
        std::fs::write(
            step_dir(root, 4).join(PARTS_DIR).join("rank-1.json"),
            b"{\"rank\": 1, \"wor",
        )
        .unwrap();
        std::fs::create_dir_all(step_dir(root, 5)).unwrap();
        // Not publications: a file, a hidden directory; not steps: `latest`, a temp dir.
        std::fs::write(root.join("README"), b"x").unwrap();
        std::fs::create_dir_all(root.join(".trash")).unwrap();
        std::fs::write(root.join("m").join("latest"), b"step-000002").unwrap();
        std::fs::create_dir_all(root.join("m").join("step-000009.tmp")).unwrap();
        dir
    }

    #[tokio::test]
    async fn each_state_is_listed_with_what_makes_it_so() {
        let dir = registry().await;
        let listing = list_registry(dir.path(), &ListOptions::default()).unwrap();
        assert_eq!(listing.problems, Vec::<String>::new());
        assert_eq!(listing.publications.len(), 1, "{listing:?}");
        let m = &listing.publications[0];
        assert_eq!(m.name, "m");
        assert_eq!(m.newest_complete, Some(2));
        assert_eq!(m.newest, Some(5));
        assert_eq!(m.steps_total, 5);
        assert!(!m.steps_truncated);
        assert_eq!(m.world, Some(2));
        assert_eq!(
            m.publishers.iter().map(|p| p.rank).collect::<Vec<_>>(),
            vec![0, 1]
        );
        let steps: Vec<(u64, StepState)> = m.steps.iter().map(|s| (s.step, s.state)).collect();
        assert_eq!(
            steps,
            vec![
                (5, StepState::Incomplete),
                (4, StepState::Incomplete),
                (3, StepState::Incomplete),
                (2, StepState::Complete),
                (1, StepState::Retired),
            ]
        );
        let by_step = |n: u64| m.steps.iter().find(|s| s.step == n).unwrap();

        // Complete: the manifest's bytes (both data files, as each part laid its file out),
        // tensors, commit time and each rank's server.
        let complete = by_step(2);
        let manifest: Manifest = serde_json::from_slice(
            &std::fs::read(step_dir(dir.path(), 2).join(MANIFEST_FILE)).unwrap(),
        )
        .unwrap();
        let sizes: Vec<u64> = manifest.files.iter().map(|f| f.size).collect();
        assert_eq!(sizes.len(), 2);
        assert_eq!(complete.bytes, Some(sizes.iter().sum()));
        assert_eq!(m.bytes, complete.bytes);
        assert_eq!(complete.tensors, Some(1));
        assert_eq!(complete.tensor_bytes, Some(4 * 2 * 4));
        assert!(
            complete
                .committed
                .as_deref()
                .is_some_and(|t| t.ends_with('Z'))
        );
        assert!(
            complete
                .published
                .as_deref()
                .is_some_and(|t| t.ends_with('Z'))
        );
        assert_eq!(complete.detail, None);
        assert_eq!(
            complete.publishers,
            vec![
                PublisherEntry {
                    rank: 0,
                    url: "http://127.0.0.1:9000".to_string(),
                    path: "m/step-000002/data/publisher-rank-0.bin".to_string(),
                    bytes: Some(sizes[0]),
                },
                PublisherEntry {
                    rank: 1,
                    url: "http://127.0.0.1:9001".to_string(),
                    path: "m/step-000002/data/publisher-rank-1.bin".to_string(),
                    bytes: Some(sizes[1]),
                },
            ]
        );

        // Incomplete: the missing rank named, bytes and tensors from the part that is there.
        let waiting = by_step(3);
        assert_eq!(waiting.world, Some(2));
        assert_eq!(waiting.ranks, vec![0]);
        assert_eq!(waiting.missing_ranks, vec![1]);
        assert_eq!(waiting.bytes, Some(sizes[0]));
        assert_eq!(waiting.tensors, Some(1));
        assert_eq!(waiting.committed, None);
        let detail = waiting.detail.as_deref().unwrap();
        assert!(
            detail.contains("publisher ranks [1] of 2 have not published it"),
            "{detail}"
        );
        assert!(waiting.problems.is_empty(), "{:?}", waiting.problems);

        // A malformed part: named in the step's problems, its rank counted missing, the rest
        // of the step (and the listing) still there.
        let malformed = by_step(4);
        assert_eq!(malformed.state, StepState::Incomplete);
        assert_eq!(malformed.ranks, vec![0]);
        assert_eq!(malformed.missing_ranks, vec![1]);
        assert_eq!(malformed.problems.len(), 1, "{:?}", malformed.problems);
        let problem = &malformed.problems[0];
        let bad_file = step_dir(dir.path(), 4).join("parts").join("rank-1.json");
        assert!(
            problem.starts_with(&format!("{}: not a part: ", bad_file.display())),
            "{problem}"
        );

        // A step directory made before any part is in it.
        let empty = by_step(5);
        assert_eq!(empty.world, None);
        assert_eq!(empty.bytes, None);
        assert_eq!(
            empty.detail.as_deref(),
            Some("step 5 has no published part")
        );

        // Retired: committed once (its publishers remain), manifest gone.
        let retired = by_step(1);
        assert_eq!(retired.ranks, vec![0, 1]);
        assert_eq!(retired.publishers.len(), 2);
        assert_eq!(retired.committed, None);
        assert!(retired.detail.as_deref().unwrap().contains("retired"));
    }

    #[tokio::test]
    async fn a_listing_reads_the_newest_steps_and_still_finds_the_newest_complete() {
        let dir = registry().await;
        let m = list_publication(dir.path(), "m", &ListOptions { steps: 2 }).unwrap();
        assert_eq!(
            m.steps.iter().map(|s| s.step).collect::<Vec<_>>(),
            vec![5, 4]
        );
        assert!(m.steps_truncated);
        assert_eq!(m.steps_total, 5);
        // Step 2 is past the two listed, and still the one `live://m` loads.
        assert_eq!(m.newest_complete, Some(2));
        assert_eq!(m.world, Some(2));
        assert!(m.bytes.is_some_and(|b| b > 0));

        let summary = list_publication(dir.path(), "m", &ListOptions { steps: 0 }).unwrap();
        assert!(summary.steps.is_empty());
        assert_eq!(summary.newest_complete, Some(2));
    }

    #[tokio::test]
    async fn fields_a_later_version_adds_are_skipped() {
        let dir = registry().await;
        // A field in a part and in `publishers.json` (a durable checkpoint's location, say).
        let part_path = step_dir(dir.path(), 3).join("parts").join("rank-0.json");
        let mut part: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&part_path).unwrap()).unwrap();
        part["durable"] = serde_json::json!({"checkpoint": "s3://b/run/step-3"});
        std::fs::write(&part_path, serde_json::to_vec(&part).unwrap()).unwrap();
        let publishers_path = step_dir(dir.path(), 2).join(PUBLISHERS_FILE);
        let mut publishers: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&publishers_path).unwrap()).unwrap();
        publishers["durable"] = serde_json::json!("run/step-000002");
        publishers["publishers"][0]["host"] = serde_json::json!("node-7");
        std::fs::write(&publishers_path, serde_json::to_vec(&publishers).unwrap()).unwrap();

        let m = list_publication(dir.path(), "m", &ListOptions::default()).unwrap();
        let step = |n: u64| m.steps.iter().find(|s| s.step == n).unwrap();
        assert_eq!(step(3).ranks, vec![0]);
        assert!(step(3).problems.is_empty(), "{:?}", step(3).problems);
        assert_eq!(step(2).state, StepState::Complete);
        assert!(step(2).problems.is_empty(), "{:?}", step(2).problems);
    }

    #[tokio::test]
    async fn an_unknown_publication_and_a_missing_registry_are_named() {
        let dir = registry().await;
        let err = list_publication(dir.path(), "policy", &ListOptions::default()).unwrap_err();
        assert!(
            matches!(err, OpsError::UnknownPublication { .. }),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "no live publication policy in registry {}",
                dir.path().display()
            )
        );
        let err = list_publication(dir.path(), "../m", &ListOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("publication name \"../m\""), "{err}");
        let gone = dir.path().join("nowhere");
        let err = list_registry(&gone, &ListOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("registry {}: no such directory", gone.display())),
            "{err}"
        );
    }

    #[test]
    fn names_that_would_leave_the_registry_are_refused() {
        for bad in ["", "..", ".hidden", "a/b", "a\\b", "-x", &"x".repeat(201)] {
            let err = check_name(bad).unwrap_err().to_string();
            assert!(err.contains("publication name"), "{bad}: {err}");
        }
        for good in ["policy", "llama-3.1_8b", "0", &"x".repeat(200)] {
            check_name(good).unwrap();
        }
    }

    #[test]
    fn step_directories_are_read_by_their_names() {
        assert_eq!(step_of("step-000100"), Some(100));
        assert_eq!(step_of("step-7"), Some(7));
        assert_eq!(step_of("step-"), None);
        assert_eq!(step_of("step-1x"), None);
        assert_eq!(step_of("latest"), None);
    }
}
