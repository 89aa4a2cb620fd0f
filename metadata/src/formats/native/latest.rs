//! `<run>/latest`: a text file naming the newest committed step directory of a run. It is written
//! only after that step's manifest, and only moves forward, so following it never leads to an
//! incomplete checkpoint or back in time when an older step's commit finishes late. On object
//! stores it is replaced with a compare-and-swap, so two commits racing for it cannot move it
//! back either (see [`advance_latest`]).

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion};

use super::{LATEST_FILE, store_error};
use crate::MetadataError;

/// The step of a step directory name `step-<digits>` (e.g. `step-000100` is 100); `None` for any
/// other name.
pub fn step_from_dir_name(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("step-")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The step directory name in `<run_prefix>/latest`, or `None` when the run has no pointer yet.
pub async fn read_latest(
    store: &dyn ObjectStore,
    run_prefix: &Path,
) -> Result<Option<String>, MetadataError> {
    let path = run_prefix.clone().join(LATEST_FILE);
    let bytes = match store.get(&path).await {
        Ok(result) => result
            .bytes()
            .await
            .map_err(store_error("reading", &path))?,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(store_error("reading", &path)(e)),
    };
    let text = std::str::from_utf8(&bytes).map_err(|e| MetadataError::Decode {
        path: path.to_string(),
        what: "latest pointer",
        detail: e.to_string(),
    })?;
    Ok(Some(text.trim().to_string()))
}

/// How often [`advance_latest`] reads the pointer again after another commit moved it between
/// its read and its write, before it gives up (the caller reports the pointer as not moved).
const LATEST_ATTEMPTS: usize = 16;

/// Points `<parent>/latest` at the step directory `prefix` when its name is `step-<digits>` and
/// its step is not older than the current pointer's. Returns whether the pointer was written.
///
/// The pointer is replaced with a compare-and-swap where the store has one (a conditional PUT:
/// `If-Match` on S3 and Azure, a generation precondition on GCS; create-if-absent for the first
/// pointer everywhere), so two commits racing here cannot move it back: the one whose write
/// finds the pointer changed since its read reads it again and decides again. Local disk has no
/// conditional update (object_store's `LocalFileSystem` refuses `PutMode::Update`); there the
/// pointer is overwritten, and a newer step's commit finishing first can still be overwritten by
/// an older one that read the pointer before it (the next save puts it right).
pub(crate) async fn advance_latest(
    store: &dyn ObjectStore,
    prefix: &Path,
) -> Result<bool, MetadataError> {
    let Some(name) = prefix.filename() else {
        return Ok(false);
    };
    let Some(step) = step_from_dir_name(name) else {
        return Ok(false);
    };
    let parent = prefix.parent().unwrap_or_default();
    let path = parent.join(LATEST_FILE);
    let mut conflict = None;
    for _ in 0..LATEST_ATTEMPTS {
        let current = match store.get(&path).await {
            Ok(result) => {
                let version = UpdateVersion {
                    e_tag: result.meta.e_tag.clone(),
                    version: result.meta.version.clone(),
                };
                let bytes = result
                    .bytes()
                    .await
                    .map_err(store_error("reading", &path))?;
                Some((bytes, version))
            }
            Err(object_store::Error::NotFound { .. }) => None,
            Err(e) => return Err(store_error("reading", &path)(e)),
        };
        let mode = match current {
            // A create refused although there is still no pointer to read: what is in the way
            // is no racing commit's pointer (a directory on local disk); the plain write says
            // what it is.
            None if conflict.is_some() => return overwrite(store, &path, name).await,
            None => PutMode::Create,
            Some((bytes, version)) => {
                if let Some(current_step) = std::str::from_utf8(&bytes)
                    .ok()
                    .and_then(|text| step_from_dir_name(text.trim()))
                    && current_step > step
                {
                    return Ok(false);
                }
                if version.e_tag.is_none() && version.version.is_none() {
                    // Nothing to compare against: a store that names no versions.
                    return overwrite(store, &path, name).await;
                }
                PutMode::Update(version)
            }
        };
        let payload = PutPayload::from(name.to_string());
        match store.put_opts(&path, payload, PutOptions::from(mode)).await {
            Ok(_) => return Ok(true),
            // Another commit wrote the pointer after this one read it: read it again.
            Err(
                e @ (object_store::Error::AlreadyExists { .. }
                | object_store::Error::Precondition { .. }),
            ) => conflict = Some(e),
            Err(object_store::Error::NotImplemented { .. }) => {
                return overwrite(store, &path, name).await;
            }
            Err(e) => return Err(store_error("writing", &path)(e)),
        }
    }
    match conflict {
        Some(e) => Err(store_error("moving", &path)(e)),
        None => Ok(false),
    }
}

/// Writes `name` to the pointer at `path` unconditionally.
async fn overwrite(
    store: &dyn ObjectStore,
    path: &Path,
    name: &str,
) -> Result<bool, MetadataError> {
    store
        .put(path, PutPayload::from(name.to_string()))
        .await
        .map_err(store_error("writing", path))?;
    Ok(true)
}
