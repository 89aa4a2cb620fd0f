//! Opening checkpoints the way every front end does: any format, any location, and the DCP blob
//! index cache directory from [`CACHE_DIR_ENV`].

use std::sync::Arc;

use object_store::ObjectStore;
use tessera_loader::load::Checkpoint;
use tessera_metadata::{OpenOptions, OpenedCheckpoint, open_any};
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
    Checkpoint::open_with(loc, &open_options())
        .await
        .with_context(|| format!("opening checkpoint {location}"))
}
