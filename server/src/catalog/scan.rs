//! Listing the storage root: runs are its directories, checkpoints the directories of a run. A
//! directory with a native manifest is committed (its row comes from the manifest alone); one
//! holding a DCP or safetensors checkpoint is committed as far as a listing can tell (counts come
//! with the first open); a `step-<N>` directory with neither is an incomplete save; other
//! directories are ignored.

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ListResult, ObjectStore};
use tessera_metadata::formats::native::{
    LATEST_FILE, read_latest, read_manifest, step_from_dir_name,
};
use tessera_metadata::formats::{Listing, dcp, safetensors, step_from_name};
use tessera_metadata::{Format, MetadataError};

use super::facts::CheckpointFacts;
use super::wire::{CatalogResponse, CheckpointEntry, CheckpointStatus, RunEntry};
use crate::id::{is_valid_segment, truncate};
use crate::{ApiError, CheckpointId};

/// Runs listed at once, and checkpoint manifests read at once per run: enough to hide object
/// store latency (~20 ms a request) in catalogs of hundreds of checkpoints, few enough not to
/// look like a flood to the store.
const LIST_CONCURRENCY: usize = 8;
const MANIFEST_CONCURRENCY: usize = 16;

/// Lists the root: runs, then each run's checkpoint directories and `latest` pointer.
pub(crate) async fn scan(
    store: &dyn ObjectStore,
    root: &Path,
) -> Result<CatalogResponse, ApiError> {
    let top = store
        .list_with_delimiter(Some(root))
        .await
        .map_err(|e| ApiError::storage(format!("listing {root}"), &e))?;
    let runs: Vec<(String, Path)> = top
        .common_prefixes
        .into_iter()
        .filter_map(|prefix| {
            let name = prefix.filename()?.to_string();
            is_valid_segment(&name).then_some((name, prefix))
        })
        .collect();
    let mut scanned: Vec<(RunEntry, Vec<CheckpointEntry>)> = futures::stream::iter(runs)
        .map(|(run, prefix)| scan_run(store, run, prefix))
        .buffer_unordered(LIST_CONCURRENCY)
        .try_collect()
        .await?;
    scanned.sort_by(|a, b| a.0.run.cmp(&b.0.run));
    let mut response = CatalogResponse {
        runs: Vec::with_capacity(scanned.len()),
        checkpoints: Vec::new(),
    };
    for (run, checkpoints) in scanned {
        response.runs.push(run);
        response.checkpoints.extend(checkpoints);
    }
    Ok(response)
}

async fn scan_run(
    store: &dyn ObjectStore,
    run: String,
    prefix: Path,
) -> Result<(RunEntry, Vec<CheckpointEntry>), ApiError> {
    let listing = store
        .list_with_delimiter(Some(&prefix))
        .await
        .map_err(|e| ApiError::storage(format!("listing {prefix}"), &e))?;
    let has_pointer = listing
        .objects
        .iter()
        .any(|o| o.location.filename() == Some(LATEST_FILE));
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
        .common_prefixes
        .into_iter()
        .filter_map(|p| {
            let name = p.filename()?.to_string();
            is_valid_segment(&name).then_some((name, p))
        })
        .collect();
    let run_ref = &run;
    let latest_ref = &latest;
    let mut checkpoints: Vec<CheckpointEntry> = futures::stream::iter(dirs)
        .map(|(name, dir)| async move {
            let id = CheckpointId::from_parts(run_ref, &name)?;
            let is_latest = latest_ref.as_deref() == Some(name.as_str());
            checkpoint_entry(store, &dir, &id, is_latest).await
        })
        .buffer_unordered(MANIFEST_CONCURRENCY)
        .try_filter_map(|entry| async move { Ok(entry) })
        .try_collect()
        .await?;
    checkpoints.sort_by(|a, b| {
        (a.step.unwrap_or(u64::MAX), &a.name).cmp(&(b.step.unwrap_or(u64::MAX), &b.name))
    });
    let run_entry = RunEntry {
        latest: latest.map(|step| format!("{run}/{step}")),
        checkpoints: checkpoints.len() as u64,
        run,
    };
    Ok((run_entry, checkpoints))
}

/// The catalog row of checkpoint directory `dir`, or `None` when it holds no checkpoint.
async fn checkpoint_entry(
    store: &dyn ObjectStore,
    dir: &Path,
    id: &CheckpointId,
    latest: bool,
) -> Result<Option<CheckpointEntry>, ApiError> {
    match read_manifest(store, dir).await {
        Ok(manifest) => Ok(Some(
            CheckpointFacts::from_manifest(&manifest, id.step()).entry(id, latest),
        )),
        Err(MetadataError::MissingManifest { .. }) => {
            match foreign_entry(store, dir, id, latest).await? {
                Some(entry) => Ok(Some(entry)),
                None => Ok(step_from_dir_name(id.step())
                    .is_some()
                    .then(|| CheckpointEntry::incomplete(id, latest))),
            }
        }
        Err(MetadataError::Store {
            action,
            path,
            source,
        }) => Err(ApiError::storage(format!("{action} {path}"), &source)),
        Err(e) => Ok(Some(CheckpointEntry {
            status: CheckpointStatus::Invalid,
            error: Some(truncate(&e.to_string())),
            ..CheckpointEntry::incomplete(id, latest)
        })),
    }
}

/// The catalog row of a directory without manifest.json that holds a foreign-format checkpoint:
/// a DCP save (its `.metadata` or per-rank `__<r>.metadata`, written last) or safetensors files,
/// told apart by the same rules as `open_any`. Only a listing is read: the commit time is the
/// newest object's, the bytes those of the files directly in the directory.
async fn foreign_entry(
    store: &dyn ObjectStore,
    dir: &Path,
    id: &CheckpointId,
    latest: bool,
) -> Result<Option<CheckpointEntry>, ApiError> {
    let listing = store
        .list_with_delimiter(Some(dir))
        .await
        .map_err(|e| ApiError::storage(format!("listing {dir}"), &e))?;
    let names = names(&listing);
    let format = if dcp::is_dcp(&names) {
        Format::Dcp
    } else if safetensors::is_safetensors(&names) {
        Format::Safetensors
    } else {
        return Ok(None);
    };
    let created = listing
        .objects
        .iter()
        .map(|o| o.last_modified)
        .max()
        .map(|t| t.to_rfc3339());
    Ok(Some(CheckpointEntry {
        step: step_from_name(id.step()),
        status: CheckpointStatus::Committed,
        committed: true,
        format: Some(format.name().to_string()),
        created,
        data: Some("present".to_string()),
        bytes: Some(listing.objects.iter().map(|o| o.size).sum()),
        ..CheckpointEntry::incomplete(id, latest)
    }))
}

/// The names in a listing, as the format detectors take them.
fn names(listing: &ListResult) -> Listing {
    let mut names = Listing::default();
    for object in &listing.objects {
        if let Some(name) = object.location.filename() {
            names.files.insert(name.to_string(), object.size);
        }
    }
    for dir in &listing.common_prefixes {
        if let Some(name) = dir.filename() {
            names.dirs.insert(name.to_string());
        }
    }
    names
}
