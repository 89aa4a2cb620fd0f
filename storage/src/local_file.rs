//! Reads of a store path served from an open local file instead of the store: a memory tier's
//! copy of a data file (`tessera_loader::tier::TierStore`) or a live publisher's shared memory on
//! this host ([`crate::LiveStore`]). One answer for both, so they serve ranges alike.

use std::path::PathBuf;

/// The answer to a read of store path `location` served from `file`, an open local file (at
/// `path`) standing for it: the range `options` asks, all of it by default. The error says what
/// failed (`cannot stat it: …`, or the bad range and `(the <noun> has N bytes)`) for the caller
/// to name the file it stands for.
pub fn local_file_get(
    location: &object_store::path::Path,
    file: std::fs::File,
    path: PathBuf,
    options: &object_store::GetOptions,
    noun: &str,
) -> Result<object_store::GetResult, String> {
    let size = file
        .metadata()
        .map_err(|e| format!("cannot stat it: {e}"))?
        .len();
    let range = match &options.range {
        Some(range) => range
            .as_range(size)
            .map_err(|e| format!("{e} (the {noun} has {size} bytes)"))?,
        None => 0..size,
    };
    Ok(object_store::GetResult {
        payload: object_store::GetResultPayload::File(file, path),
        meta: object_store::ObjectMeta {
            location: location.clone(),
            last_modified: Default::default(),
            size,
            e_tag: None,
            version: None,
        },
        range,
        attributes: Default::default(),
        extensions: Default::default(),
    })
}
