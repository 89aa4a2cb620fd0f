//! Full verification of a committed checkpoint: every data file is streamed once and every block's
//! crc32c compared, so a corruption is reported as a file and byte range, not just "bad".

use futures::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};

use super::checksums::BlockCrcs;
use super::manifest::DataPresence;
use super::{FileBlocks, open_checkpoint, read_block_checksums, resolve, store_error};
use crate::MetadataError;

/// Files streamed at once: enough to overlap request latency on object stores, few enough that a
/// verify running next to a training job does not take all of its bandwidth.
const FILES_IN_FLIGHT: usize = 4;

/// A block whose bytes do not match its recorded crc32c.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadBlock {
    /// Data file, relative to the checkpoint root.
    pub file: String,
    /// First byte of the block.
    pub start: u64,
    /// End (exclusive) of the block's bytes that were read.
    pub end: u64,
    /// Recorded crc32c.
    pub expected: u32,
    /// crc32c of the bytes read.
    pub actual: u32,
}

/// A data file whose size differs from the manifest's.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SizeMismatch {
    /// Data file, relative to the checkpoint root.
    pub file: String,
    /// Size in the manifest.
    pub expected: u64,
    /// Size on storage.
    pub actual: u64,
}

/// The outcome of [`verify_checkpoint`].
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VerifyReport {
    /// Data files read.
    pub files: usize,
    /// Bytes read and checked.
    pub bytes_checked: u64,
    /// Corrupt blocks, by file and byte range, in file and offset order.
    pub bad_blocks: Vec<BadBlock>,
    /// Data files the manifest lists that are not on storage.
    pub missing_files: Vec<String>,
    /// Data files whose size differs from the manifest's.
    pub size_mismatches: Vec<SizeMismatch>,
    /// True for a metadata-only checkpoint: there was no data to check.
    pub data_absent: bool,
}

impl VerifyReport {
    /// True when nothing is wrong.
    pub fn is_ok(&self) -> bool {
        self.bad_blocks.is_empty()
            && self.missing_files.is_empty()
            && self.size_mismatches.is_empty()
    }
}

/// Verifies the checkpoint at `prefix`: opens it (manifest, metadata checksum, validation; any
/// failure there is an error), checks the block checksum file against the manifest, then streams
/// every data file and compares every block. Data problems are reported, not returned as errors.
pub async fn verify_checkpoint(
    store: &dyn ObjectStore,
    prefix: &Path,
) -> Result<VerifyReport, MetadataError> {
    let checkpoint = open_checkpoint(store, prefix).await?;
    let manifest = &checkpoint.manifest;
    if manifest.data == DataPresence::Absent {
        return Ok(VerifyReport {
            data_absent: true,
            ..VerifyReport::default()
        });
    }
    let checksums = read_block_checksums(store, prefix, manifest).await?;
    let block_size = checksums.block_size();
    let outcomes: Vec<FileOutcome> = futures::stream::iter(checksums.files())
        .map(|file| verify_file(store, prefix, file, block_size))
        .buffered(FILES_IN_FLIGHT)
        .try_collect()
        .await?;
    let mut report = VerifyReport::default();
    for outcome in outcomes {
        match outcome {
            FileOutcome::Missing(file) => report.missing_files.push(file),
            FileOutcome::Read {
                bytes,
                bad_blocks,
                size_mismatch,
            } => {
                report.files += 1;
                report.bytes_checked += bytes;
                report.bad_blocks.extend(bad_blocks);
                report.size_mismatches.extend(size_mismatch);
            }
        }
    }
    Ok(report)
}

enum FileOutcome {
    Missing(String),
    Read {
        bytes: u64,
        bad_blocks: Vec<BadBlock>,
        size_mismatch: Option<SizeMismatch>,
    },
}

async fn verify_file(
    store: &dyn ObjectStore,
    prefix: &Path,
    file: &FileBlocks,
    block_size: u64,
) -> Result<FileOutcome, MetadataError> {
    let path = resolve(prefix, &file.path)?;
    let result = match store.get(&path).await {
        Ok(result) => result,
        Err(object_store::Error::NotFound { .. }) => {
            return Ok(FileOutcome::Missing(file.path.clone()));
        }
        Err(e) => return Err(store_error("reading", &path)(e)),
    };
    let size_mismatch = (result.meta.size != file.size).then(|| SizeMismatch {
        file: file.path.clone(),
        expected: file.size,
        actual: result.meta.size,
    });
    let mut stream = result.into_stream();
    let mut acc = BlockCrcs::new(block_size);
    let mut read = 0u64;
    let mut next_block = 0u64;
    let mut bad_blocks = Vec::new();
    let mut compare = |crcs: Vec<u32>, read: u64, next_block: &mut u64| {
        for actual in crcs {
            let index = *next_block;
            *next_block += 1;
            // Blocks past the recorded size have no checksum; the size mismatch reports them.
            let Some(&expected) = file.crcs.get(index as usize) else {
                continue;
            };
            if actual != expected {
                let start = index * block_size;
                bad_blocks.push(BadBlock {
                    file: file.path.clone(),
                    start,
                    end: (start + block_size).min(read),
                    expected,
                    actual,
                });
            }
        }
    };
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(store_error("reading", &path))?;
        // Bytes past the recorded size have no checksum: the size mismatch reports them, and
        // folding them into the last block would flag intact bytes as corrupt.
        let keep = chunk.len().min(file.size.saturating_sub(read) as usize);
        acc.update(&chunk[..keep]);
        read += keep as u64;
        compare(acc.take_done(), read, &mut next_block);
        if keep < chunk.len() {
            break;
        }
    }
    compare(acc.finish(), read, &mut next_block);
    Ok(FileOutcome::Read {
        bytes: read,
        bad_blocks,
        size_mismatch,
    })
}
