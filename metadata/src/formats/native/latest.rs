//! `<run>/latest`: a text file naming the newest committed step directory of a run. It is written
//! only after that step's manifest, and only moves forward, so following it never leads to an
//! incomplete checkpoint or back in time when an older step's commit finishes late.

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

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

/// Points `<parent>/latest` at the step directory `prefix` when its name is `step-<digits>` and
/// its step is not older than the current pointer's. Returns whether the pointer was written.
///
/// Two commits racing here can still both read the old pointer; the store offers no portable
/// compare-and-swap (LocalFileSystem has no conditional update), and the later step re-running its
/// commit or the next save puts the pointer right.
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
    if let Some(current) = read_latest(store, &parent).await?
        && let Some(current_step) = step_from_dir_name(&current)
        && current_step > step
    {
        return Ok(false);
    }
    let path = parent.clone().join(LATEST_FILE);
    store
        .put(&path, PutPayload::from(name.to_string()))
        .await
        .map_err(store_error("writing", &path))?;
    Ok(true)
}
