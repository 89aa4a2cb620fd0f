//! One `torch.save` file read in place: its zip directory (from a read of the file's tail), its
//! `data.pkl` (one ranged read, capped), and where every storage record `data/<key>` lies (one
//! read of each local header). The records' bytes themselves are never read here.

use std::collections::HashMap;
use std::ops::Range;

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use super::states::LIMITS;
use crate::MetadataError;
use crate::formats::native::store_error;
use crate::formats::torch::zip::{self, Segments, ZipError};

/// Bytes read from the end of a file first: the central directory of about 200 records (an
/// optimizer states file has a handful; a model states file one per module tensor) fits, larger
/// ones take one more read.
const TAIL: u64 = 16 << 10;
/// Largest central directory accepted (46+ bytes a record: over a million records).
const MAX_DIRECTORY: u64 = 64 << 20;
/// Local-header reads in flight.
const CONCURRENCY: usize = 32;

/// A storage record of the archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    /// Member name (`archive/data/0`).
    pub member: String,
    /// Its bytes in the file.
    pub range: Range<u64>,
    /// CRC-32 the zip directory records.
    pub crc32: u32,
}

/// A torch.save file taken apart from its headers.
#[derive(Clone, Debug)]
pub struct TorchFile {
    /// Path relative to the checkpoint root.
    pub name: String,
    /// Full path in the store.
    pub path: Path,
    /// File size.
    pub size: u64,
    /// The pickle.
    pub pkl: Bytes,
    /// Where the pickle lies in the file, and its CRC-32.
    pub pkl_record: Record,
    /// Storage records by key (`0` for `archive/data/0`).
    pub records: HashMap<String, Record>,
    /// Requests made and bytes read to take it apart.
    pub requests: u64,
    /// Bytes read.
    pub bytes_read: u64,
}

impl TorchFile {
    /// An error about this file.
    pub fn error(&self, detail: impl Into<String>) -> MetadataError {
        MetadataError::Blob {
            path: self.path.to_string(),
            start: 0,
            end: self.size,
            entry: "torch.save file".to_string(),
            detail: detail.into(),
        }
    }
}

fn file_error(path: &Path, size: u64, detail: impl Into<String>) -> MetadataError {
    MetadataError::Blob {
        path: path.to_string(),
        start: 0,
        end: size,
        entry: "torch.save file".to_string(),
        detail: detail.into(),
    }
}

async fn fetch(
    store: &dyn ObjectStore,
    path: &Path,
    range: Range<u64>,
) -> Result<Bytes, MetadataError> {
    let bytes = store
        .get_range(path, range.clone())
        .await
        .map_err(store_error("reading", path))?;
    if bytes.len() as u64 != range.end - range.start {
        return Err(MetadataError::Invalid {
            what: format!(
                "{path}: asked for bytes {}..{} but got {} bytes (truncated file?)",
                range.start,
                range.end,
                bytes.len()
            ),
        });
    }
    Ok(bytes)
}

/// Reads `name` (at `path`, `size` bytes) as a torch.save archive.
pub async fn read(
    store: &dyn ObjectStore,
    path: Path,
    name: String,
    size: u64,
) -> Result<TorchFile, MetadataError> {
    let mut archive = Archive {
        store,
        path,
        size,
        seg: Segments::new(size),
        requests: 0,
        bytes_read: 0,
    };
    let tail = size.saturating_sub(TAIL)..size;
    archive.read_into(tail).await?;
    let dir = archive.directory().await?;
    let Some((pkl, prefix)) = dir.torch_data_pkl() else {
        return Err(archive.error("no data.pkl member: not a torch.save file"));
    };
    let prefix = prefix.to_string();
    if pkl.size > LIMITS.max_input as u64 {
        return Err(archive.error(format!(
            "{} is {} bytes, over the {}-byte cap",
            pkl.name, pkl.size, LIMITS.max_input
        )));
    }
    if let Some(order) = dir.find(&format!("{prefix}byteorder"))
        && order.size > 16
    {
        return Err(archive.error("a byteorder member over 16 bytes"));
    }
    // Local headers of data.pkl, byteorder and every storage record, read concurrently.
    let wanted: Vec<&zip::Entry> = dir
        .entries
        .iter()
        .filter(|e| {
            e.name == pkl.name
                || e.name == format!("{prefix}byteorder")
                || e.name
                    .strip_prefix(&prefix)
                    .is_some_and(|rest| rest.starts_with("data/"))
        })
        .collect();
    archive.read_local_headers(&wanted).await?;
    let mut records = HashMap::new();
    let mut pkl_record = None;
    let mut byteorder = None;
    for entry in wanted {
        let range = zip::data_range(&archive.seg, &dir, entry)
            .and_then(|r| zip::check_stored(entry).map(|()| r))
            .map_err(|e| archive.error(e.to_string()))?;
        let record = Record {
            member: entry.name.clone(),
            range,
            crc32: entry.crc32,
        };
        if entry.name == pkl.name {
            pkl_record = Some(record);
        } else if entry.name == format!("{prefix}byteorder") {
            byteorder = Some(record);
        } else if let Some(key) = entry.name.strip_prefix(&format!("{prefix}data/")) {
            records.insert(key.to_string(), record);
        }
    }
    let Some(pkl_record) = pkl_record else {
        return Err(archive.error("data.pkl has no readable local header"));
    };
    if let Some(order) = byteorder {
        archive.check_byteorder(&order).await?;
    }
    let pkl_bytes = archive.read_pickle(&pkl_record).await?;
    Ok(TorchFile {
        name,
        path: archive.path,
        size,
        pkl: pkl_bytes,
        pkl_record,
        records,
        requests: archive.requests,
        bytes_read: archive.bytes_read,
    })
}

/// A torch.save archive being taken apart: the bytes of it read so far, and what reading them
/// cost.
struct Archive<'s> {
    store: &'s dyn ObjectStore,
    path: Path,
    size: u64,
    seg: Segments,
    requests: u64,
    bytes_read: u64,
}

impl Archive<'_> {
    fn error(&self, detail: impl Into<String>) -> MetadataError {
        file_error(&self.path, self.size, detail)
    }

    /// Reads `range` into the bytes known.
    async fn read_into(&mut self, range: Range<u64>) -> Result<(), MetadataError> {
        let bytes = fetch(self.store, &self.path, range.clone()).await?;
        self.requests += 1;
        self.bytes_read += range.end - range.start;
        self.seg.add(range.start, bytes);
        Ok(())
    }

    /// The zip directory, from the tail read and at most one more read (a directory larger
    /// than the tail), capped at [`MAX_DIRECTORY`] bytes.
    async fn directory(&mut self) -> Result<zip::Directory, MetadataError> {
        for _ in 0..3 {
            match zip::read_directory(&self.seg) {
                Ok(d) => return Ok(d),
                Err(ZipError::Bad(detail)) => return Err(self.error(detail)),
                Err(ZipError::Need(range)) => {
                    if range.end - range.start > MAX_DIRECTORY {
                        return Err(self.error(format!(
                            "its zip directory needs bytes {}..{}, over the {MAX_DIRECTORY}-byte cap",
                            range.start, range.end
                        )));
                    }
                    self.read_into(range).await?;
                }
            }
        }
        Err(self.error("its zip directory cannot be located"))
    }

    /// Reads the local headers of `entries`, [`CONCURRENCY`] at a time.
    async fn read_local_headers(&mut self, entries: &[&zip::Entry]) -> Result<(), MetadataError> {
        let size = self.size;
        let headers: Vec<Range<u64>> = entries
            .iter()
            .map(|e| {
                let start = e.local_header_offset.min(size);
                start..start.saturating_add(30 + e.name.len() as u64).min(size)
            })
            .collect();
        let (store, path) = (self.store, &self.path);
        let fetched: Vec<Result<(u64, Bytes), MetadataError>> =
            futures::stream::iter(headers.iter().cloned().map(|range| async move {
                let bytes = fetch(store, path, range.clone()).await?;
                Ok((range.start, bytes))
            }))
            .buffer_unordered(CONCURRENCY)
            .collect()
            .await;
        for part in fetched {
            let (start, bytes) = part?;
            self.requests += 1;
            self.bytes_read += bytes.len() as u64;
            self.seg.add(start, bytes);
        }
        Ok(())
    }

    /// Refuses storages that are not little-endian (the `byteorder` member says).
    async fn check_byteorder(&mut self, order: &Record) -> Result<(), MetadataError> {
        let bytes = fetch(self.store, &self.path, order.range.clone()).await?;
        self.requests += 1;
        if &bytes[..] != b"little" {
            return Err(self.error(format!(
                "byteorder is {:?}; only little-endian storages are read",
                String::from_utf8_lossy(&bytes)
            )));
        }
        Ok(())
    }

    /// Reads the pickle and checks it against the CRC-32 of the zip directory.
    async fn read_pickle(&mut self, pkl_record: &Record) -> Result<Bytes, MetadataError> {
        let pkl_bytes = fetch(self.store, &self.path, pkl_record.range.clone()).await?;
        self.requests += 1;
        self.bytes_read += pkl_bytes.len() as u64;
        if crc32fast::hash(&pkl_bytes) != pkl_record.crc32 {
            return Err(self.error(format!(
                "{} does not match the CRC-32 its zip directory records (a damaged file)",
                pkl_record.member
            )));
        }
        Ok(pkl_bytes)
    }
}
