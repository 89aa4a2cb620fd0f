//! `checksums.arrow`: one crc32c per fixed-size block of every data file. Per-block rather than
//! per-file checksums let a loader that reads a byte range verify exactly what it read (plus at most
//! one partial block on each side), and let `verify` name the corrupt byte range.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use arrow_array::{Array, ArrayRef, BinaryArray, RecordBatch, StringArray, UInt64Array};
use arrow_buffer::{Buffer, OffsetBuffer, ScalarBuffer};
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{DataType, Field, Schema, SchemaRef};
use serde::{Deserialize, Serialize};

use crate::MetadataError;

const WHAT: &str = "block checksums";

/// Accumulates crc32c per block over bytes appended from file offset 0.
#[derive(Clone, Debug)]
pub(crate) struct BlockCrcs {
    block_size: u64,
    /// Bytes of the current (unfinished) block seen so far.
    fill: u64,
    crc: u32,
    done: Vec<u32>,
}

impl BlockCrcs {
    pub(crate) fn new(block_size: u64) -> Self {
        Self {
            block_size,
            fill: 0,
            crc: 0,
            done: Vec::new(),
        }
    }

    pub(crate) fn update(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let room = self.block_size - self.fill;
            let take = data.len().min(usize::try_from(room).unwrap_or(usize::MAX));
            let (head, tail) = data.split_at(take);
            self.crc = crc32c::crc32c_append(self.crc, head);
            self.fill += take as u64;
            data = tail;
            if self.fill == self.block_size {
                self.done.push(self.crc);
                self.crc = 0;
                self.fill = 0;
            }
        }
    }

    /// Finished blocks so far, handed over (the accumulator forgets them).
    pub(crate) fn take_done(&mut self) -> Vec<u32> {
        std::mem::take(&mut self.done)
    }

    /// All block crcs, the last (shorter) block included.
    pub(crate) fn finish(mut self) -> Vec<u32> {
        if self.fill > 0 {
            self.done.push(self.crc);
        }
        self.done
    }
}

/// Number of blocks of `block_size` in a file of `size` bytes.
pub(crate) fn block_count(size: u64, block_size: u64) -> u64 {
    size.div_ceil(block_size)
}

/// The block checksums of one data file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileBlocks {
    /// Path relative to the checkpoint root.
    pub path: String,
    /// File size in bytes.
    pub size: u64,
    /// crc32c of every block, in file order.
    pub crcs: Vec<u32>,
}

/// The block checksums of a checkpoint's data files, with helpers for verifying partial reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockChecksums {
    block_size: u64,
    files: Vec<FileBlocks>,
    index: HashMap<String, usize>,
}

impl BlockChecksums {
    /// Assembles the checksums of `files`; every file's crc count must match its size.
    pub fn new(block_size: u64, files: Vec<FileBlocks>) -> Result<Self, MetadataError> {
        if block_size == 0 {
            return Err(MetadataError::Invalid {
                what: "block size 0".to_string(),
            });
        }
        let mut index = HashMap::with_capacity(files.len());
        for (i, file) in files.iter().enumerate() {
            let blocks = block_count(file.size, block_size);
            if file.crcs.len() as u64 != blocks {
                return Err(MetadataError::Invalid {
                    what: format!(
                        "{}: {} block checksums for {} bytes in blocks of {block_size} ({blocks} blocks)",
                        file.path,
                        file.crcs.len(),
                        file.size
                    ),
                });
            }
            if index.insert(file.path.clone(), i).is_some() {
                return Err(MetadataError::Invalid {
                    what: format!("{} has block checksums twice", file.path),
                });
            }
        }
        Ok(Self {
            block_size,
            files,
            index,
        })
    }

    /// Block size in bytes.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// Every file's checksums.
    pub fn files(&self) -> &[FileBlocks] {
        &self.files
    }

    /// The checksums of the file at `path` (relative to the checkpoint root).
    pub fn file(&self, path: &str) -> Option<&FileBlocks> {
        self.index.get(path).map(|&i| &self.files[i])
    }

    fn known(&self, path: &str) -> Result<&FileBlocks, MetadataError> {
        self.file(path).ok_or_else(|| MetadataError::Invalid {
            what: format!("{path} has no block checksums (not a data file of this checkpoint)"),
        })
    }

    /// Indices of the blocks that hold bytes `start..end` of `path`: read these whole to verify
    /// the range. An empty range covers no block.
    pub fn blocks_covering(
        &self,
        path: &str,
        start: u64,
        end: u64,
    ) -> Result<Range<u64>, MetadataError> {
        let file = self.known(path)?;
        if start > end || end > file.size {
            return Err(MetadataError::Invalid {
                what: format!(
                    "byte range {start}..{end} is not inside {path} ({} bytes)",
                    file.size
                ),
            });
        }
        let first = start / self.block_size;
        if start == end {
            return Ok(first..first);
        }
        Ok(first..end.div_ceil(self.block_size))
    }

    /// The byte range of whole blocks that covers `start..end` of `path`: what a verifying reader
    /// fetches instead of `start..end`.
    pub fn covering_byte_range(
        &self,
        path: &str,
        start: u64,
        end: u64,
    ) -> Result<Range<u64>, MetadataError> {
        let blocks = self.blocks_covering(path, start, end)?;
        if blocks.is_empty() {
            return Ok(start..start);
        }
        let size = self.known(path)?.size;
        Ok(blocks.start * self.block_size..(blocks.end * self.block_size).min(size))
    }

    /// Verifies `bytes`, read from `path` at `start`, against the recorded block checksums.
    /// `start` must be a block boundary and `bytes` whole blocks (the file's last block may be
    /// shorter), as [`Self::covering_byte_range`] gives; no bytes verify trivially. A mismatch is a
    /// [`MetadataError::ChecksumMismatch`] naming the file and the block's byte range.
    pub fn verify_range(&self, path: &str, start: u64, bytes: &[u8]) -> Result<(), MetadataError> {
        let file = self.known(path)?;
        if bytes.is_empty() && start <= file.size {
            return Ok(());
        }
        let end = start.checked_add(bytes.len() as u64);
        let bs = self.block_size;
        let whole = match end {
            Some(end) => {
                start.is_multiple_of(bs)
                    && end <= file.size
                    && (end.is_multiple_of(bs) || end == file.size)
            }
            None => false,
        };
        if !whole {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{path}: {} bytes at {start} are not whole blocks of {bs} inside the file ({} bytes)",
                    bytes.len(),
                    file.size
                ),
            });
        }
        let first = start / bs;
        for (i, block) in bytes
            .chunks(usize::try_from(bs).unwrap_or(usize::MAX))
            .enumerate()
        {
            let index = first + i as u64;
            let actual = crc32c::crc32c(block);
            let Some(&expected) = file.crcs.get(index as usize) else {
                return Err(MetadataError::Invalid {
                    what: format!("{path}: block {index} has no checksum"),
                });
            };
            if actual != expected {
                let block_start = index * bs;
                return Err(MetadataError::ChecksumMismatch {
                    path: path.to_string(),
                    range: format!(" bytes {block_start}..{}", block_start + block.len() as u64),
                    expected,
                    actual,
                });
            }
        }
        Ok(())
    }
}

fn schema() -> SchemaRef {
    Arc::new(Schema::new(vec![
        Field::new("file", DataType::Utf8, false),
        Field::new("size", DataType::UInt64, false),
        Field::new("block_size", DataType::UInt64, false),
        Field::new("crc32c", DataType::Binary, false),
    ]))
}

fn encode_error(detail: impl std::fmt::Display) -> MetadataError {
    MetadataError::Invalid {
        what: format!("cannot encode {}: {detail}", super::CHECKSUMS_FILE),
    }
}

/// Encodes `checksums` as the bytes of `checksums.arrow`.
pub fn encode_block_checksums(checksums: &BlockChecksums) -> Result<Vec<u8>, MetadataError> {
    let files = &checksums.files;
    let mut offsets = Vec::with_capacity(files.len() + 1);
    offsets.push(0i32);
    let total: usize = files.iter().map(|f| f.crcs.len() * 4).sum();
    let mut packed = Vec::with_capacity(total);
    for file in files {
        for crc in &file.crcs {
            packed.extend_from_slice(&crc.to_le_bytes());
        }
        let end = i32::try_from(packed.len())
            .map_err(|_| encode_error("more than 2^31 bytes of block checksums"))?;
        offsets.push(end);
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(StringArray::from_iter_values(
            files.iter().map(|f| f.path.as_str()),
        )),
        Arc::new(UInt64Array::from_iter_values(files.iter().map(|f| f.size))),
        Arc::new(UInt64Array::from_iter_values(
            files.iter().map(|_| checksums.block_size),
        )),
        Arc::new(
            BinaryArray::try_new(
                OffsetBuffer::new(ScalarBuffer::from(offsets)),
                Buffer::from_vec(packed),
                None,
            )
            .map_err(encode_error)?,
        ),
    ];
    let schema = schema();
    let batch = RecordBatch::try_new(schema.clone(), columns).map_err(encode_error)?;
    let mut writer = StreamWriter::try_new(Vec::new(), &schema).map_err(encode_error)?;
    writer.write(&batch).map_err(encode_error)?;
    writer.finish().map_err(encode_error)?;
    writer.into_inner().map_err(encode_error)
}

/// Decodes the bytes of `checksums.arrow`; `path_for_errors` names the file in errors.
pub fn decode_block_checksums(
    bytes: &[u8],
    path_for_errors: &str,
) -> Result<BlockChecksums, MetadataError> {
    let error = |detail: String| MetadataError::Decode {
        path: path_for_errors.to_string(),
        what: WHAT,
        detail,
    };
    let reader = StreamReader::try_new(bytes, None).map_err(|e| error(e.to_string()))?;
    let expected = schema();
    for field in expected.fields() {
        match reader.schema().field_with_name(field.name()) {
            Ok(f) if f.data_type() == field.data_type() => {}
            Ok(f) => {
                return Err(error(format!(
                    "column {} has type {}, expected {}",
                    field.name(),
                    f.data_type(),
                    field.data_type()
                )));
            }
            Err(_) => return Err(error(format!("no column {}", field.name()))),
        }
    }
    // Before any batch is decoded: arrow-ipc trusts the buffer descriptors it finds.
    super::ipc::check_stream(bytes, &reader.schema()).map_err(error)?;
    let mut block_size = None;
    let mut files = Vec::new();
    for batch in reader {
        let batch = batch.map_err(|e| error(e.to_string()))?;
        let column = |name: &str| {
            batch
                .column_by_name(name)
                .ok_or_else(|| error(format!("no column {name}")))
        };
        let (file_col, size_col, bs_col, crc_col) = (
            column("file")?,
            column("size")?,
            column("block_size")?,
            column("crc32c")?,
        );
        let (Some(paths), Some(sizes), Some(block_sizes), Some(crcs)) = (
            file_col.as_any().downcast_ref::<StringArray>(),
            size_col.as_any().downcast_ref::<UInt64Array>(),
            bs_col.as_any().downcast_ref::<UInt64Array>(),
            crc_col.as_any().downcast_ref::<BinaryArray>(),
        ) else {
            return Err(error("unexpected column types".to_string()));
        };
        for (name, column) in [
            ("file", file_col),
            ("size", size_col),
            ("block_size", bs_col),
            ("crc32c", crc_col),
        ] {
            if column.null_count() > 0 {
                return Err(error(format!("null in column {name}")));
            }
        }
        for row in 0..batch.num_rows() {
            let path = paths.value(row);
            let bs = block_sizes.value(row);
            match block_size {
                None => block_size = Some(bs),
                Some(b) if b != bs => {
                    return Err(error(format!(
                        "row {row} ({path}): block size {bs}, other files have {b}"
                    )));
                }
                Some(_) => {}
            }
            let packed = crcs.value(row);
            if packed.len() % 4 != 0 {
                return Err(error(format!(
                    "row {row} ({path}): {} checksum bytes is not a multiple of 4",
                    packed.len()
                )));
            }
            let crcs = packed
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            files.push(FileBlocks {
                path: path.to_string(),
                size: sizes.value(row),
                crcs,
            });
        }
    }
    BlockChecksums::new(block_size.unwrap_or(super::DEFAULT_BLOCK_SIZE), files).map_err(|e| match e
    {
        MetadataError::Invalid { what } => error(what),
        other => other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_cut_at_block_size_from_offset_zero() {
        let data: Vec<u8> = (0..10u8).collect();
        let mut acc = BlockCrcs::new(4);
        acc.update(&data[..3]);
        acc.update(&data[3..9]);
        acc.update(&data[9..]);
        let crcs = acc.finish();
        assert_eq!(
            crcs,
            vec![
                crc32c::crc32c(&data[0..4]),
                crc32c::crc32c(&data[4..8]),
                crc32c::crc32c(&data[8..10]),
            ]
        );
    }
}
