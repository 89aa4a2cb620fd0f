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

/// Opens the checkpoint at `location` for loading (block checksums included for native ones),
/// its DCP blob index cached in `cache_dir` when given (else where [`CACHE_DIR_ENV`] says). A
/// metadata-only checkpoint is refused here, for every front end that loads: it has no data.
pub async fn open_for_load(
    location: &str,
    storage_options: &StorageOptions,
    cache_dir: Option<&std::path::Path>,
) -> Result<Checkpoint, OpsError> {
    let loc = tessera_storage::open_with(location, storage_options)?;
    check_local(location).with_context(|| format!("opening checkpoint {location}"))?;
    let mut options = open_options();
    if let Some(dir) = cache_dir {
        options.dcp.cache_dir = Some(dir.to_path_buf());
    }
    let checkpoint = Checkpoint::open_with(loc, &options)
        .await
        .with_context(|| format!("opening checkpoint {location}"))?;
    if !checkpoint.has_data {
        return Err(OpsError::invalid(format!(
            "{location}: a metadata-only checkpoint has no data to load"
        )));
    }
    Ok(checkpoint)
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// A gpt-tiny checkpoint saved as fsdp dp2 under `dir`, with its data unless `metadata_only`.
    async fn synth(dir: &std::path::Path, metadata_only: bool) -> String {
        let location = dir.join("ckpt").display().to_string();
        let loc = tessera_storage::open(&location).unwrap();
        tessera_synth::synthesize(
            loc.store.clone(),
            &loc.prefix,
            &location,
            &tessera_planner::presets::fsdp(2).unwrap(),
            &tessera_synth::SynthOptions {
                model: tessera_synth::Model::GptTiny,
                optimizer: false,
                metadata_only,
                dist_optimizer: None,
                step: None,
                progress: None,
            },
        )
        .await
        .unwrap();
        location
    }

    #[tokio::test]
    async fn a_metadata_only_checkpoint_is_refused_for_loading_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let location = synth(dir.path(), true).await;
        let err = open_for_load(&location, &StorageOptions::default(), None)
            .await
            .unwrap_err();
        assert!(matches!(err, OpsError::Invalid { .. }), "{err:?}");
        assert_eq!(
            err.to_string(),
            format!("{location}: a metadata-only checkpoint has no data to load")
        );
        // Described, it still opens: only loading needs the data.
        assert!(!open(&location).await.unwrap().has_data);

        let dir = tempfile::tempdir().unwrap();
        let location = synth(dir.path(), false).await;
        let opened = open_for_load(&location, &StorageOptions::default(), None)
            .await
            .unwrap();
        assert!(opened.has_data);
    }
}
