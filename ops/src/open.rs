//! Opening checkpoints the way every front end does: any format, any location, and the DCP blob
//! index cache directory from [`CACHE_DIR_ENV`].

use std::sync::Arc;

use object_store::ObjectStore;
use tessera_loader::checkpoint::Checkpoint;
use tessera_metadata::{MetadataError, OpenOptions, OpenedCheckpoint, open_any};
use tessera_storage::StorageOptions;

use crate::{OpsError, ResultExt};

/// Environment variable naming a local directory where DCP blob indexes are cached between runs
/// (every rank process of `load --transport tcp` shares it). Never the checkpoint's directory.
pub const CACHE_DIR_ENV: &str = "TESSERA_CACHE_DIR";

/// Open options of every front end: the DCP index cache directory from [`CACHE_DIR_ENV`].
pub fn open_options() -> OpenOptions {
    let mut options = OpenOptions::default();
    options.dcp.cache_dir = std::env::var_os(CACHE_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from);
    options
}

/// Opens the checkpoint at `location` in whatever format it is (native, PyTorch DCP,
/// safetensors), without reading native block checksums (describing and planning do not need
/// them).
pub async fn open(location: &str) -> Result<OpenedCheckpoint, OpsError> {
    Ok(open_at_with(location, &StorageOptions::default()).await?.1)
}

/// [`open`] with storage options (credentials and endpoints on top of the environment), also
/// returning the store the checkpoint is in.
pub async fn open_at_with(
    location: &str,
    storage_options: &StorageOptions,
) -> Result<(Arc<dyn ObjectStore>, OpenedCheckpoint), OpsError> {
    let loc = tessera_storage::open_with(location, storage_options)?;
    check_local(location).with_context(|| format!("opening checkpoint {location}"))?;
    let mut options = open_options();
    options.block_checksums = false;
    let opened = open_any(loc.store.as_ref(), &loc.prefix, &options)
        .await
        .with_context(|| format!("opening checkpoint {location}"))?;
    Ok((loc.store, opened))
}

/// Opens the checkpoint at `location` for loading (block checksums included for native ones).
pub async fn open_for_load(
    location: &str,
    storage_options: &StorageOptions,
) -> Result<Checkpoint, OpsError> {
    let loc = tessera_storage::open_with(location, storage_options)?;
    check_local(location).with_context(|| format!("opening checkpoint {location}"))?;
    Checkpoint::open_with(loc, &open_options())
        .await
        .with_context(|| format!("opening checkpoint {location}"))
}

/// A local location that is missing or an empty directory, said as such with the path as given.
/// (The reader sees only an empty listing in both cases, as an object store shows a prefix that
/// does not exist; it says [`MetadataError::NotFound`] for that, which would call an empty
/// directory missing.)
pub fn check_local(location: &str) -> Result<(), OpsError> {
    let Some(path) = tessera_storage::local_path(location) else {
        return Ok(());
    };
    let path = std::path::Path::new(path);
    match std::fs::read_dir(path).map(|mut entries| entries.next().is_none()) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(MetadataError::NotFound {
            path: path.display().to_string(),
        }
        .into()),
        Ok(true) => Err(MetadataError::Unsupported {
            path: path.display().to_string(),
            detail: "an empty directory, not a checkpoint".to_string(),
        }
        .into()),
        // A file (a single .safetensors), a full directory, or one that cannot be listed: the
        // reader decides and says why.
        _ => Ok(()),
    }
}
