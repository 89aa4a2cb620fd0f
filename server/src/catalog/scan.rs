//! Listing the storage root: runs are its directories, checkpoints the directories of a run. A
//! directory with a native manifest is committed (its row comes from the manifest alone); one
//! holding a DCP or safetensors checkpoint is committed as far as a listing can tell (counts come
//! with the first open); a `step-<N>` directory with neither is an incomplete save; other
//! directories are ignored.
//!
//! One bad entry does not take the whole catalog down: when a local root's directory cannot be
//! listed by the store (a symlink loop, an entry the OS refuses), it is read entry by entry, and
//! what cannot be read is skipped and reported in the catalog's `problems`.

use std::path::PathBuf;

use futures::{StreamExt, TryStreamExt};
use object_store::path::{Path, PathPart};
use object_store::{ListResult, ObjectStore};
use tessera_metadata::formats::native::{
    LATEST_FILE, read_latest, read_manifest_identified, step_from_dir_name,
};
use tessera_metadata::formats::{
    Listing, bytecheckpoint, dcp, deepspeed, safetensors, step_from_name,
};
use tessera_metadata::{Format, MetadataError};

use super::facts::CheckpointFacts;
use super::wire::{CatalogProblem, CatalogResponse, CheckpointEntry, CheckpointStatus, RunEntry};
use crate::id::{is_valid_segment, truncate};
use crate::{ApiError, CheckpointId};

/// Runs listed at once, and checkpoint manifests read at once per run: enough to hide object
/// store latency (~20 ms a request) in catalogs of hundreds of checkpoints, few enough not to
/// look like a flood to the store.
const LIST_CONCURRENCY: usize = 8;
const MANIFEST_CONCURRENCY: usize = 16;

/// What a directory listing found: files (name, size, modification time) and folders.
#[derive(Default)]
struct Entries {
    files: Vec<(String, u64, Option<String>)>,
    dirs: Vec<(String, Path)>,
}

impl Entries {
    fn from_store(listing: ListResult) -> Self {
        Self {
            files: listing
                .objects
                .into_iter()
                .filter_map(|o| {
                    let name = o.location.filename()?.to_string();
                    Some((name, o.size, Some(o.last_modified.to_rfc3339())))
                })
                .collect(),
            dirs: listing
                .common_prefixes
                .into_iter()
                .filter_map(|p| Some((p.filename()?.to_string(), p)))
                .collect(),
        }
    }

    /// The names, as the format detectors take them.
    fn names(&self) -> Listing {
        let mut names = Listing::default();
        for (name, size, _) in &self.files {
            names.files.insert(name.clone(), *size);
        }
        for (name, _) in &self.dirs {
            names.dirs.insert(name.clone());
        }
        names
    }
}

/// Where the scan reads: the store, the root in it, and the root as a local directory when it is
/// one (for the entry-by-entry fallback).
struct Scanner<'a> {
    store: &'a dyn ObjectStore,
    root: &'a Path,
    local: Option<&'a std::path::Path>,
}

impl Scanner<'_> {
    /// Lists `prefix`. When the store cannot and the root is local, reads the directory entry
    /// by entry instead, skipping (and reporting) the entries that cannot be read.
    async fn list(
        &self,
        prefix: &Path,
        problems: &mut Vec<CatalogProblem>,
    ) -> Result<Entries, ApiError> {
        let error = match self.store.list_with_delimiter(Some(prefix)).await {
            Ok(listing) => return Ok(Entries::from_store(listing)),
            Err(e) => e,
        };
        let Some(dir) = self.local_dir(prefix) else {
            return Err(ApiError::storage(format!("listing {prefix}"), &error));
        };
        tracing::warn!(%prefix, %error, "listing failed; reading the directory entry by entry");
        let owned_prefix = prefix.clone();
        let root = self.root.clone();
        let read = tokio::task::spawn_blocking(move || list_local(&dir, &owned_prefix, &root))
            .await
            .map_err(|e| ApiError::Internal {
                detail: format!("listing {prefix}: {e}"),
            })?;
        match read {
            Ok((entries, found)) => {
                for problem in &found {
                    tracing::warn!(path = %problem.path, error = %problem.error, "catalog entry skipped");
                }
                problems.extend(found);
                Ok(entries)
            }
            Err(_) => Err(ApiError::storage(format!("listing {prefix}"), &error)),
        }
    }

    /// The local directory of `prefix`, when the root is local.
    fn local_dir(&self, prefix: &Path) -> Option<PathBuf> {
        let mut dir = self.local?.to_path_buf();
        for part in prefix.prefix_match(self.root)? {
            dir.push(part.as_ref());
        }
        Some(dir)
    }
}

/// Reads local directory `dir` (the store's `prefix`) entry by entry: an entry whose target
/// cannot be read (a symlink loop: `ELOOP`), or a symlink to a directory that contains it (which
/// would list itself forever), is a problem instead of a failure of the whole listing.
fn list_local(
    dir: &std::path::Path,
    prefix: &Path,
    root: &Path,
) -> std::io::Result<(Entries, Vec<CatalogProblem>)> {
    let mut entries = Entries::default();
    let mut problems = Vec::new();
    let here = std::fs::canonicalize(dir)?;
    let relative = |name: &str| {
        let mut parts: Vec<String> = prefix
            .prefix_match(root)
            .map(|p| p.map(|part| part.as_ref().to_string()).collect())
            .unwrap_or_default();
        parts.push(name.to_string());
        parts.join("/")
    };
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let Ok(name) = entry.file_name().into_string() else {
            continue;
        };
        let path = entry.path();
        let meta = match std::fs::metadata(&path) {
            Ok(meta) => meta,
            Err(e) => {
                problems.push(CatalogProblem {
                    path: relative(&name),
                    error: format!("cannot be read, skipped: {e}"),
                });
                continue;
            }
        };
        if meta.is_dir() {
            let target = std::fs::canonicalize(&path)?;
            if here.starts_with(&target) {
                problems.push(CatalogProblem {
                    path: relative(&name),
                    error: format!(
                        "a symlink loop (it leads back to {}), skipped",
                        if target == here {
                            "its own directory"
                        } else {
                            "a directory above it"
                        }
                    ),
                });
                continue;
            }
            let Ok(part) = PathPart::parse(&name) else {
                continue;
            };
            let dir = prefix.clone().join(part);
            entries.dirs.push((name, dir));
        } else {
            entries.files.push((name, meta.len(), None));
        }
    }
    entries.dirs.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((entries, problems))
}

/// Lists the root: runs, then each run's checkpoint directories and `latest` pointer.
/// `local` is the root as a local directory, when it is one.
pub(crate) async fn scan(
    store: &dyn ObjectStore,
    root: &Path,
    local: Option<&std::path::Path>,
) -> Result<CatalogResponse, ApiError> {
    let scanner = Scanner { store, root, local };
    let mut problems = Vec::new();
    let top = scanner.list(root, &mut problems).await?;
    let runs: Vec<(String, Path)> = top
        .dirs
        .into_iter()
        .filter(|(name, _)| is_valid_segment(name))
        .collect();
    let scanner_ref = &scanner;
    let mut scanned: Vec<(RunEntry, Vec<CheckpointEntry>, Vec<CatalogProblem>)> =
        futures::stream::iter(runs)
            .map(|(run, prefix)| scan_run(scanner_ref, run, prefix))
            .buffer_unordered(LIST_CONCURRENCY)
            .try_collect()
            .await?;
    scanned.sort_by(|a, b| a.0.run.cmp(&b.0.run));
    let mut response = CatalogResponse {
        runs: Vec::with_capacity(scanned.len()),
        checkpoints: Vec::new(),
        problems,
        // Filled in per answer (`routes::checkpoints::list`): publications change every step.
        live: None,
    };
    for (run, checkpoints, found) in scanned {
        response.runs.push(run);
        response.checkpoints.extend(checkpoints);
        response.problems.extend(found);
    }
    response.problems.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(response)
}

async fn scan_run(
    scanner: &Scanner<'_>,
    run: String,
    prefix: Path,
) -> Result<(RunEntry, Vec<CheckpointEntry>, Vec<CatalogProblem>), ApiError> {
    let store = scanner.store;
    let mut problems = Vec::new();
    let listing = scanner.list(&prefix, &mut problems).await?;
    let has_pointer = listing.files.iter().any(|(name, _, _)| name == LATEST_FILE);
    let latest = if has_pointer {
        match read_latest(store, &prefix).await {
            Ok(Some(step)) if is_valid_segment(&step) => Some(step),
            Ok(_) => None,
            Err(MetadataError::Store {
                action,
                path,
                source,
            }) => {
                return Err(ApiError::storage(format!("{action} {path}"), &source));
            }
            Err(e) => {
                tracing::warn!(%run, error = %e, "unreadable latest pointer");
                None
            }
        }
    } else {
        None
    };
    let dirs: Vec<(String, Path)> = listing
        .dirs
        .into_iter()
        .filter(|(name, _)| is_valid_segment(name))
        .collect();
    let run_ref = &run;
    let latest_ref = &latest;
    let mut checkpoints: Vec<CheckpointEntry> = futures::stream::iter(dirs)
        .map(|(name, dir)| async move {
            let id = CheckpointId::from_parts(run_ref, &name)?;
            let is_latest = latest_ref.as_deref() == Some(name.as_str());
            checkpoint_entry(scanner, &dir, &id, is_latest).await
        })
        .buffer_unordered(MANIFEST_CONCURRENCY)
        .try_filter_map(|entry| async move { Ok(entry) })
        .try_collect::<Vec<(CheckpointEntry, Vec<CatalogProblem>)>>()
        .await?
        .into_iter()
        .map(|(entry, found)| {
            problems.extend(found);
            entry
        })
        .collect();
    checkpoints.sort_by(|a, b| {
        (a.step.unwrap_or(u64::MAX), &a.name).cmp(&(b.step.unwrap_or(u64::MAX), &b.name))
    });
    let run_entry = RunEntry {
        latest: latest.map(|step| format!("{run}/{step}")),
        checkpoints: checkpoints.len() as u64,
        run,
    };
    Ok((run_entry, checkpoints, problems))
}

/// The catalog row of checkpoint directory `dir` (with what was skipped reading it), or `None`
/// when it holds no checkpoint.
async fn checkpoint_entry(
    scanner: &Scanner<'_>,
    dir: &Path,
    id: &CheckpointId,
    latest: bool,
) -> Result<Option<(CheckpointEntry, Vec<CatalogProblem>)>, ApiError> {
    let mut problems = Vec::new();
    let entry = match read_manifest_identified(scanner.store, dir).await {
        Ok((manifest, identity)) => {
            Some(CheckpointFacts::from_manifest(&manifest, &identity, id.step()).entry(id, latest))
        }
        Err(MetadataError::MissingManifest { .. }) => {
            match foreign_entry(scanner, dir, id, latest, &mut problems).await? {
                Some(entry) => Some(entry),
                None => step_from_dir_name(id.step())
                    .is_some()
                    .then(|| CheckpointEntry::incomplete(id, latest)),
            }
        }
        Err(MetadataError::Store {
            action,
            path,
            source,
        }) => return Err(ApiError::storage(format!("{action} {path}"), &source)),
        Err(e) => Some(CheckpointEntry {
            status: CheckpointStatus::Invalid,
            error: Some(truncate(&e.to_string())),
            ..CheckpointEntry::incomplete(id, latest)
        }),
    };
    Ok(entry.map(|entry| (entry, problems)))
}

/// The catalog row of a directory without manifest.json that holds a foreign-format checkpoint:
/// a DCP save (its `.metadata` or per-rank `__<r>.metadata`, written last) or safetensors files,
/// told apart by the same rules as `open_any`. Only a listing is read: the commit time is the
/// newest object's, the bytes those of the files directly in the directory.
async fn foreign_entry(
    scanner: &Scanner<'_>,
    dir: &Path,
    id: &CheckpointId,
    latest: bool,
    problems: &mut Vec<CatalogProblem>,
) -> Result<Option<CheckpointEntry>, ApiError> {
    let listing = scanner.list(dir, problems).await?;
    let names = listing.names();
    // ByteCheckpoint writes DCP-like `.metadata` files of its own class, in component directories
    // (`model/`, `optimizer/`) of a save: telling them apart takes a small read of a `.metadata`.
    let bytecheckpoint = if names.files.contains_key(dcp::METADATA_FILE)
        || bytecheckpoint::TENSOR_COMPONENTS
            .iter()
            .any(|c| names.dirs.contains(*c))
    {
        match bytecheckpoint::detect(scanner.store, dir, &names).await {
            Ok(found) => found.is_some(),
            Err(e) => {
                problems.push(CatalogProblem {
                    path: id.to_string(),
                    error: format!("cannot tell whether it is a ByteCheckpoint save: {e}"),
                });
                false
            }
        }
    } else {
        false
    };
    let format = if bytecheckpoint {
        Format::ByteCheckpoint
    } else if dcp::is_dcp(&names) {
        Format::Dcp
    } else if safetensors::is_safetensors(&names) {
        Format::Safetensors
    } else if deepspeed::is_deepspeed(&names) {
        Format::DeepSpeed
    } else {
        return Ok(None);
    };
    // RFC 3339 times from one store, all in UTC: the newest sorts last.
    let created = listing
        .files
        .iter()
        .filter_map(|(_, _, modified)| modified.clone())
        .max();
    Ok(Some(CheckpointEntry {
        step: step_from_name(id.step()),
        status: CheckpointStatus::Committed,
        committed: true,
        format: Some(format.name().to_string()),
        created,
        data: Some("present".to_string()),
        bytes: Some(listing.files.iter().map(|(_, size, _)| size).sum()),
        ..CheckpointEntry::incomplete(id, latest)
    }))
}
