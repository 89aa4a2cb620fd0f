//! Opening a committed native checkpoint: manifest first, then the metadata and checksum files,
//! each checked against the size and crc32c the manifest recorded before it is decoded.

use std::collections::HashMap;

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use super::arrow_meta::decode_metadata_with_sizes;
use super::manifest::{Manifest, ManifestBlob, read_manifest_identified};
use super::{BlockChecksums, decode_block_checksums, resolve, store_error};
use crate::{CheckpointMeta, MetadataError, validate};

/// A committed native checkpoint, opened and validated.
#[derive(Clone, Debug)]
pub struct NativeCheckpoint {
    /// Its manifest.
    pub manifest: Manifest,
    /// Its global metadata, with data file sizes from the manifest.
    pub meta: CheckpointMeta,
}

/// Opens the checkpoint at `prefix`: reads the manifest ([`MetadataError::MissingManifest`] when
/// there is none), checks `metadata.arrow` against the manifest's size and crc32c
/// ([`MetadataError::ChecksumMismatch`] naming the file), decodes it, checks the counts the
/// manifest recorded, and runs [`validate`]. The metadata carries the checkpoint's identity (a
/// digest of the manifest bytes as read).
pub async fn open_checkpoint(
    store: &dyn ObjectStore,
    prefix: &Path,
) -> Result<NativeCheckpoint, MetadataError> {
    let (manifest, identity) = read_manifest_identified(store, prefix).await?;
    let (path, bytes) = read_blob(store, prefix, &manifest.metadata).await?;
    let sizes: HashMap<&str, u64> = manifest
        .files
        .iter()
        .map(|f| (f.path.as_str(), f.size))
        .collect();
    let meta =
        decode_metadata_with_sizes(&bytes, path.as_ref(), Some(&sizes))?.with_identity(identity);
    let counts = [
        ("tensors", manifest.tensors, meta.tensors().len() as u64),
        ("saved boxes", manifest.chunks, meta.chunks().len() as u64),
        ("objects", manifest.objects, meta.objects().len() as u64),
        ("tensor bytes", manifest.tensor_bytes, meta.tensor_bytes()),
        (
            "data files",
            manifest.files.len() as u64,
            meta.files().len() as u64,
        ),
    ];
    for (what, in_manifest, in_metadata) in counts {
        if in_manifest != in_metadata {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{prefix}: the manifest counts {in_manifest} {what} but {path} holds {in_metadata}"
                ),
            });
        }
    }
    validate(&meta)?;
    Ok(NativeCheckpoint { manifest, meta })
}

/// Reads `checksums.arrow` of the checkpoint at `prefix`, checked against `manifest` (size,
/// crc32c, block size, and one entry per data file with the manifest's size). A metadata-only
/// checkpoint has none: that is an error.
pub async fn read_block_checksums(
    store: &dyn ObjectStore,
    prefix: &Path,
    manifest: &Manifest,
) -> Result<BlockChecksums, MetadataError> {
    let Some(blob) = &manifest.checksums else {
        return Err(MetadataError::Invalid {
            what: format!(
                "{prefix} is a metadata-only checkpoint (data absent): no block checksums"
            ),
        });
    };
    let (path, bytes) = read_blob(store, prefix, blob).await?;
    let checksums = decode_block_checksums(&bytes, path.as_ref())?;
    let mismatch = |detail: String| MetadataError::Invalid {
        what: format!("{path} does not match the manifest: {detail}"),
    };
    if checksums.block_size() != manifest.block_size && !checksums.files().is_empty() {
        return Err(mismatch(format!(
            "block size {} but the manifest says {}",
            checksums.block_size(),
            manifest.block_size
        )));
    }
    if checksums.files().len() != manifest.files.len() {
        return Err(mismatch(format!(
            "{} files but the manifest lists {}",
            checksums.files().len(),
            manifest.files.len()
        )));
    }
    for file in &manifest.files {
        match checksums.file(&file.path) {
            Some(blocks) if blocks.size == file.size => {}
            Some(blocks) => {
                return Err(mismatch(format!(
                    "{} is {} bytes there but {} in the manifest",
                    file.path, blocks.size, file.size
                )));
            }
            None => return Err(mismatch(format!("no entry for {}", file.path))),
        }
    }
    Ok(checksums)
}

/// Reads a manifest-listed file whole and checks its size and crc32c.
pub(crate) async fn read_blob(
    store: &dyn ObjectStore,
    prefix: &Path,
    blob: &ManifestBlob,
) -> Result<(Path, bytes::Bytes), MetadataError> {
    let path = resolve(prefix, &blob.path)?;
    let result = store
        .get(&path)
        .await
        .map_err(store_error("reading", &path))?;
    // Checked before reading the body: the manifest is the authority on how much to read.
    if result.meta.size != blob.size {
        return Err(MetadataError::Invalid {
            what: format!(
                "{path} is {} bytes but the manifest says {}",
                result.meta.size, blob.size
            ),
        });
    }
    let bytes = result
        .bytes()
        .await
        .map_err(store_error("reading", &path))?;
    let actual = crc32c::crc32c(&bytes);
    if bytes.len() as u64 != blob.size || actual != blob.crc32c {
        return Err(MetadataError::ChecksumMismatch {
            path: path.to_string(),
            range: String::new(),
            expected: blob.crc32c,
            actual,
        });
    }
    Ok((path, bytes))
}
