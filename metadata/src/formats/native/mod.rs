//! tessera's native checkpoint format: raw tensor bytes in data files, columnar global metadata
//! (Arrow IPC), per-block checksums, and a JSON manifest written last as the atomic commit.
//!
//! ```text
//! <run>/latest                   "step-000100": moved forward only after that step's manifest
//! <run>/step-000100/             one checkpoint (any prefix works; `step-<digits>` feeds `latest`)
//! ├── data/<name>.bin            raw bytes, one or more files per writing rank
//! │
//! │     byte 0         4096           8192                       12288
//! │     ┌─────────────┬──────┬────────────────────────┬─────────┬──────────┐
//! │     │ box A       │ 0000 │ box B                  │ 0000    │ object   │
//! │     └─────────────┴──────┴────────────────────────┴─────────┴──────────┘
//! │     every non-empty box (and object) starts on a 4 KiB boundary, zero padding between;
//! │     a box is contiguous, row-major, little-endian; an empty box takes no byte
//! │
//! │     ├──────── block 0 ────────┼──────── block 1 ────────┼── block 2 ──┤
//! │     crc32c per `block_size` bytes (64 KiB by default) from offset 0, last block shorter
//! │
//! ├── metadata.arrow             Arrow IPC stream, one row per saved box and per object
//! │     kind u8 (0 box, 1 object) │ fqn dict<i32,utf8> (object key for objects)
//! │     dtype dict<i8,utf8>?      │ shape, offsets, lengths list<u64>
//! │     file dict<i32,utf8>       │ byte_offset u64 │ byte_length u64
//! │     strides list<u64>? (null: row-major) │ crc32c u32? (null: not recorded)
//! │
//! ├── checksums.arrow            Arrow IPC stream, one row per data file
//! │     file utf8 │ size u64 │ block_size u64 │ crc32c binary (packed little-endian u32 per block)
//! │
//! └── manifest.json              written LAST: format, version, step, files and sizes, crc32c of
//!                                metadata.arrow and checksums.arrow, counts
//! ```
//!
//! A commit writes, in this order: the data files (streamed while saving), `metadata.arrow`,
//! `checksums.arrow`, `manifest.json`, then `<run>/latest`. A directory without a manifest is not a
//! checkpoint (an incomplete save); readers ([`open_checkpoint`]) refuse it with
//! [`MetadataError::MissingManifest`].
//!
//! Tensors are described once per row (dtype and shape repeat in every row of a tensor), so a
//! single row is self-describing; the tensor order of [`CheckpointMeta`](crate::CheckpointMeta) is
//! the order of first appearance, and every tensor has at least one (possibly empty) row. The data
//! files of the metadata are the `file` dictionary's values, in dictionary order.
//!
//! A metadata-only checkpoint (`"data": "absent"`) records where every box would lie without
//! uploading any data file; it is for planning against the layout of a huge model.

mod arrow_meta;
mod checksums;
mod ipc;
mod latest;
mod manifest;
mod reader;
mod verify;
mod writer;

use object_store::path::{Path, PathPart};

use crate::MetadataError;

pub use arrow_meta::{decode_metadata, encode_metadata};
pub use checksums::{BlockChecksums, FileBlocks, decode_block_checksums, encode_block_checksums};
pub use latest::{read_latest, step_from_dir_name};
pub use manifest::{
    Created, DataPresence, Manifest, ManifestBlob, ManifestFile, read_manifest,
    read_manifest_identified,
};
pub use reader::{NativeCheckpoint, open_checkpoint, read_block_checksums};
pub use verify::{BadBlock, BadBox, SizeMismatch, VerifyReport, verify_checkpoint};
pub use writer::{
    DataFileWriter, MemorySink, NativeWriter, PreparedCommit, WriteOptions, WrittenFile,
};

/// The `format` field of every native manifest.
pub const FORMAT_NAME: &str = "tessera";
/// The format version this code writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Name of the manifest, relative to the checkpoint prefix.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Name of the global metadata file, relative to the checkpoint prefix.
pub const METADATA_FILE: &str = "metadata.arrow";
/// Name of the block checksum file, relative to the checkpoint prefix.
pub const CHECKSUMS_FILE: &str = "checksums.arrow";
/// Folder of the data files, relative to the checkpoint prefix.
pub const DATA_DIR: &str = "data";
/// Name of the run's pointer to its newest committed step, next to the step directories.
pub const LATEST_FILE: &str = "latest";
/// Every non-empty box starts at a multiple of this: the page size, which O_DIRECT reads and
/// page-cache friendly loaders want.
pub const ALIGNMENT: u64 = 4096;
/// Default checksum block size. A partial read has to fetch whole blocks to verify them, so the
/// block bounds read amplification (at most one block on each side of a range) while keeping the
/// checksum table small (16 K entries per GiB).
pub const DEFAULT_BLOCK_SIZE: u64 = 64 * 1024;

/// The object path of `relative` (a `/`-separated path from the metadata or manifest) under
/// `prefix`. Paths come from files on storage, so `.`, `..`, empty segments and control
/// characters are refused rather than allowed to point outside the checkpoint.
pub(crate) fn resolve(prefix: &Path, relative: &str) -> Result<Path, MetadataError> {
    let mut path = prefix.clone();
    for segment in relative.split('/') {
        if segment.is_empty() {
            return Err(bad_relative_path(relative, "an empty segment"));
        }
        let part = PathPart::parse(segment)
            .map_err(|e| bad_relative_path(relative, &format!("segment {segment:?}: {e}")))?;
        path = path.join(part);
    }
    Ok(path)
}

fn bad_relative_path(relative: &str, why: &str) -> MetadataError {
    MetadataError::Invalid {
        what: format!(
            "file path {relative:?} is not a relative path inside the checkpoint ({why})"
        ),
    }
}

/// Reads the whole object at `path` (callers check its size against their cap first, from a
/// listing or a head, so that no reader fetches an unbounded object).
pub(crate) async fn read_whole(
    store: &dyn object_store::ObjectStore,
    path: &Path,
) -> Result<bytes::Bytes, MetadataError> {
    use object_store::ObjectStoreExt;
    store
        .get(path)
        .await
        .map_err(store_error("reading", path))?
        .bytes()
        .await
        .map_err(store_error("reading", path))
}

/// Maps a storage error to [`MetadataError::Store`] with the verb phrase and path.
pub(crate) fn store_error(
    action: &'static str,
    path: &Path,
) -> impl FnOnce(object_store::Error) -> MetadataError {
    let path = path.to_string();
    move |source| MetadataError::Store {
        action,
        path,
        source,
    }
}
