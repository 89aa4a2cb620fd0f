//! Full verification of a committed checkpoint: every data file is streamed once and every block's
//! crc32c compared, so a corruption is reported as a file and byte range, not just "bad". The same
//! pass checks every saved box and object against the crc32c of its own metadata row: block
//! checksums only say the file is what was written, not that the metadata points each box at its
//! own bytes (two boxes with swapped offsets pass every block check). Files under the checkpoint
//! that it does not list are reported as stray (what an interrupted writer leaves behind).

use std::collections::{HashMap, HashSet};

use futures::{StreamExt, TryStreamExt};
use object_store::path::{Path, PathPart};
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};

use super::checksums::BlockCrcs;
use super::manifest::DataPresence;
use super::{
    FileBlocks, MANIFEST_FILE, METADATA_FILE, open_checkpoint, read_block_checksums, resolve,
    store_error,
};
use crate::{CheckpointMeta, MetadataError};

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

/// A saved box or object whose bytes do not match the crc32c its metadata row records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadBox {
    /// Data file, relative to the checkpoint root.
    pub file: String,
    /// `tensor <fqn> box <region>` or `object <key>`.
    pub entry: String,
    /// First byte of the box.
    pub start: u64,
    /// One past its last byte.
    pub end: u64,
    /// crc32c recorded in the metadata.
    pub expected: u32,
    /// crc32c of the bytes read.
    pub actual: u32,
}

impl BadBox {
    /// The mismatch as an error (for callers that stop at the first one).
    pub fn to_error(&self) -> MetadataError {
        MetadataError::BoxChecksumMismatch {
            path: self.file.clone(),
            entry: self.entry.clone(),
            start: self.start,
            end: self.end,
            algorithm: "crc32c",
            expected: self.expected,
            actual: self.actual,
        }
    }
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
    /// Boxes and objects whose bytes do not match their metadata row's crc32c, in file and offset
    /// order.
    #[serde(default)]
    pub bad_boxes: Vec<BadBox>,
    /// Boxes and objects checked against their metadata row's crc32c.
    #[serde(default)]
    pub boxes_checked: u64,
    /// Objects under the checkpoint prefix that the checkpoint does not list (temporary or data
    /// files of an interrupted writer, a leftover write claim), relative to the prefix.
    #[serde(default)]
    pub stray_files: Vec<String>,
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
            && self.bad_boxes.is_empty()
            && self.stray_files.is_empty()
            && self.missing_files.is_empty()
            && self.size_mismatches.is_empty()
    }
}

/// Verifies the checkpoint at `prefix`: opens it (manifest, metadata checksum, validation; any
/// failure there is an error), checks the block checksum file against the manifest, then streams
/// every data file and compares every block and every box's and object's own crc32c, and lists
/// the prefix for stray files. Data problems are reported, not returned as errors.
pub async fn verify_checkpoint(
    store: &dyn ObjectStore,
    prefix: &Path,
) -> Result<VerifyReport, MetadataError> {
    let checkpoint = open_checkpoint(store, prefix).await?;
    let manifest = &checkpoint.manifest;
    let mut listed: HashSet<&str> = [MANIFEST_FILE, METADATA_FILE].into_iter().collect();
    if let Some(blob) = &manifest.checksums {
        listed.insert(blob.path.as_str());
    }
    listed.extend(manifest.files.iter().map(|f| f.path.as_str()));
    let stray_files = stray_files(store, prefix, &listed).await?;
    if manifest.data == DataPresence::Absent {
        return Ok(VerifyReport {
            data_absent: true,
            stray_files,
            ..VerifyReport::default()
        });
    }
    let checksums = read_block_checksums(store, prefix, manifest).await?;
    let block_size = checksums.block_size();
    let mut boxes = boxes_by_file(&checkpoint.meta);
    let outcomes: Vec<FileOutcome> = futures::stream::iter(checksums.files())
        .map(|file| {
            let boxes = boxes.remove(file.path.as_str()).unwrap_or_default();
            verify_file(store, prefix, file, block_size, boxes)
        })
        .buffered(FILES_IN_FLIGHT)
        .try_collect()
        .await?;
    let mut report = VerifyReport {
        stray_files,
        ..VerifyReport::default()
    };
    for outcome in outcomes {
        match outcome {
            FileOutcome::Missing(file) => report.missing_files.push(file),
            FileOutcome::Read {
                bytes,
                bad_blocks,
                bad_boxes,
                boxes_checked,
                size_mismatch,
            } => {
                report.files += 1;
                report.bytes_checked += bytes;
                report.bad_blocks.extend(bad_blocks);
                report.bad_boxes.extend(bad_boxes);
                report.boxes_checked += boxes_checked;
                report.size_mismatches.extend(size_mismatch);
            }
        }
    }
    Ok(report)
}

/// Every object under `prefix` (recursively) whose path relative to it is not in `listed`.
async fn stray_files(
    store: &dyn ObjectStore,
    prefix: &Path,
    listed: &HashSet<&str>,
) -> Result<Vec<String>, MetadataError> {
    let objects: Vec<object_store::ObjectMeta> = store
        .list(Some(prefix))
        .try_collect()
        .await
        .map_err(store_error("listing", prefix))?;
    let mut stray: Vec<String> = objects
        .iter()
        .filter_map(|o| {
            let parts: Vec<PathPart<'_>> = o.location.prefix_match(prefix)?.collect();
            let relative = parts
                .iter()
                .map(|p| p.as_ref())
                .collect::<Vec<&str>>()
                .join("/");
            (!listed.contains(relative.as_str())).then_some(relative)
        })
        .collect();
    stray.sort();
    Ok(stray)
}

/// A saved box or object to check against its metadata row's crc32c while its file streams by.
#[derive(Debug)]
struct BoxCheck {
    entry: String,
    start: u64,
    end: u64,
    expected: u32,
    crc: u32,
}

/// The non-empty boxes and objects that record a crc32c, by data file path, in offset order.
fn boxes_by_file(meta: &CheckpointMeta) -> HashMap<&str, Vec<BoxCheck>> {
    let files = meta.files();
    let mut by_file: HashMap<&str, Vec<BoxCheck>> = HashMap::new();
    let tensors = meta.tensors();
    let boxes = meta.chunks().iter().filter_map(|c| {
        let expected = c.crc32c?;
        let fqn = tensors
            .get(c.tensor as usize)
            .map_or("?", |t| t.fqn.as_str());
        Some((
            c.bytes.file,
            c.bytes.offset,
            c.bytes.length,
            expected,
            format!("tensor {fqn} box {}", c.region),
        ))
    });
    let objects = meta.objects().iter().filter_map(|o| {
        let expected = o.crc32c?;
        Some((
            o.file,
            o.offset,
            o.length,
            expected,
            format!("object {}", o.key),
        ))
    });
    for (file, start, length, expected, entry) in boxes.chain(objects) {
        let Some(file) = files.get(file as usize) else {
            continue;
        };
        // Empty boxes hold no byte to check; validation bounded every range by the file size.
        if length == 0 {
            continue;
        }
        by_file
            .entry(file.path.as_str())
            .or_default()
            .push(BoxCheck {
                entry,
                start,
                end: start.saturating_add(length),
                expected,
                crc: 0,
            });
    }
    for list in by_file.values_mut() {
        list.sort_by_key(|b| (b.start, b.end));
    }
    by_file
}

/// Folds streamed file bytes into the crc32c of every box they overlap and reports each box
/// whose crc differs once its last byte has gone by. Boxes are in offset order, so the ones a
/// chunk touches are a window that only moves forward (overlapping boxes, which validation
/// refuses for boxes of one tensor but not across tensors, simply share bytes).
struct BoxCrcs {
    boxes: Vec<BoxCheck>,
    /// Boxes before this index have started.
    next: usize,
    /// Started and not yet finished, by index.
    active: Vec<usize>,
    bad: Vec<BadBox>,
    checked: u64,
}

impl BoxCrcs {
    fn new(boxes: Vec<BoxCheck>) -> Self {
        Self {
            boxes,
            next: 0,
            active: Vec::new(),
            bad: Vec::new(),
            checked: 0,
        }
    }

    /// `chunk` holds file bytes from `pos` on.
    fn update(&mut self, file: &str, pos: u64, chunk: &[u8]) {
        let end = pos + chunk.len() as u64;
        while self.next < self.boxes.len() && self.boxes[self.next].start < end {
            self.active.push(self.next);
            self.next += 1;
        }
        let boxes = &mut self.boxes;
        let (bad, checked) = (&mut self.bad, &mut self.checked);
        self.active.retain(|&i| {
            let b = &mut boxes[i];
            let from = b.start.max(pos);
            let to = b.end.min(end);
            if from < to {
                let slice = &chunk[(from - pos) as usize..(to - pos) as usize];
                b.crc = crc32c::crc32c_append(b.crc, slice);
            }
            if b.end > end {
                return true;
            }
            *checked += 1;
            if b.crc != b.expected {
                bad.push(BadBox {
                    file: file.to_string(),
                    entry: std::mem::take(&mut b.entry),
                    start: b.start,
                    end: b.end,
                    expected: b.expected,
                    actual: b.crc,
                });
            }
            false
        });
    }
}

enum FileOutcome {
    Missing(String),
    Read {
        bytes: u64,
        bad_blocks: Vec<BadBlock>,
        bad_boxes: Vec<BadBox>,
        boxes_checked: u64,
        size_mismatch: Option<SizeMismatch>,
    },
}

async fn verify_file(
    store: &dyn ObjectStore,
    prefix: &Path,
    file: &FileBlocks,
    block_size: u64,
    boxes: Vec<BoxCheck>,
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
    let mut box_crcs = BoxCrcs::new(boxes);
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
        box_crcs.update(&file.path, read, &chunk[..keep]);
        read += keep as u64;
        compare(acc.take_done(), read, &mut next_block);
        if keep < chunk.len() {
            break;
        }
    }
    compare(acc.finish(), read, &mut next_block);
    // Boxes a short file never finished are not reported here: the size mismatch is.
    box_crcs.bad.sort_by_key(|b| (b.start, b.end));
    Ok(FileOutcome::Read {
        bytes: read,
        bad_blocks,
        bad_boxes: box_crcs.bad,
        boxes_checked: box_crcs.checked,
        size_mismatch,
    })
}
