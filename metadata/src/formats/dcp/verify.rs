//! Integrity of a DCP checkpoint's data: the zip CRC-32 of every tensor's storage member, streamed
//! from its byte range (bounded memory), and every member of every non-tensor blob. Blobs stored
//! compressed (`stream.zstd/1`) are decoded from their real file as they stream, and checked
//! over their decoded bytes.

use futures::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt};

use super::{ChunkBlob, DcpDetails};
use crate::encoded::{DecodeFailure, EncodedRange, decode_from_store};
use crate::formats::native::{resolve, store_error};
use crate::formats::torch::zip::read_archive;
use crate::{CheckpointMeta, DataFile, MetadataError, ObjectMeta};

/// A blob whose bytes do not match what its zip directory records.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BadBlob {
    /// Data file.
    pub file: String,
    /// `tensor <fqn> chunk <box>` or `object <key>`.
    pub entry: String,
    /// First byte checked.
    pub start: u64,
    /// One past the last byte checked.
    pub end: u64,
    /// What is wrong.
    pub detail: String,
}

/// What [`verify_dcp`] found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DcpVerifyReport {
    /// Tensor storages checked against their CRC-32.
    pub tensors_checked: u64,
    /// Non-tensor blobs checked (every member's CRC-32).
    pub objects_checked: u64,
    /// Bytes read and checked.
    pub bytes_checked: u64,
    /// Safetensors-format blobs, which record no checksum (their structure was checked when
    /// opening).
    pub unchecked: u64,
    /// Everything that did not match.
    pub bad: Vec<BadBlob>,
}

impl DcpVerifyReport {
    /// True when nothing was wrong.
    pub fn is_ok(&self) -> bool {
        self.bad.is_empty()
    }
}

enum Outcome {
    Checked(u64),
    Unchecked,
    Bad(BadBlob, u64),
}

enum Task<'a> {
    Tensor(&'a ChunkBlob),
    Object(&'a ObjectMeta),
}

/// Reads every storage member and object blob of a DCP checkpoint (`meta` and `details` as
/// [`super::open_dcp`] gave them, opened from `prefix` in `store`) and checks it against the
/// CRC-32 its zip directory records, `concurrency` reads at a time. Mismatches are collected in
/// the report; storage failures are errors.
pub async fn verify_dcp(
    store: &dyn ObjectStore,
    prefix: &Path,
    meta: &CheckpointMeta,
    details: &DcpDetails,
    concurrency: usize,
) -> Result<DcpVerifyReport, MetadataError> {
    let files = meta.files();
    let tasks = details
        .blobs
        .iter()
        .map(Task::Tensor)
        .chain(meta.objects().iter().map(Task::Object));
    let outcomes: Vec<Result<(bool, Outcome), MetadataError>> =
        futures::stream::iter(tasks.map(|task| check(store, prefix, files, task)))
            .buffer_unordered(concurrency.max(1))
            .collect()
            .await;
    let mut report = DcpVerifyReport::default();
    for outcome in outcomes {
        let (tensor, outcome) = outcome?;
        match outcome {
            Outcome::Checked(bytes) => {
                report.bytes_checked += bytes;
                if tensor {
                    report.tensors_checked += 1;
                } else {
                    report.objects_checked += 1;
                }
            }
            Outcome::Unchecked => report.unchecked += 1,
            Outcome::Bad(bad, bytes) => {
                report.bytes_checked += bytes;
                report.bad.push(bad);
            }
        }
    }
    report
        .bad
        .sort_by(|a, b| (&a.file, a.start).cmp(&(&b.file, b.start)));
    Ok(report)
}

async fn check(
    store: &dyn ObjectStore,
    prefix: &Path,
    files: &[DataFile],
    task: Task<'_>,
) -> Result<(bool, Outcome), MetadataError> {
    match task {
        Task::Tensor(chunk) => Ok((true, check_tensor(store, prefix, files, chunk).await?)),
        Task::Object(object) => Ok((false, check_object(store, prefix, files, object).await?)),
    }
}

async fn check_tensor(
    store: &dyn ObjectStore,
    prefix: &Path,
    files: &[DataFile],
    chunk: &ChunkBlob,
) -> Result<Outcome, MetadataError> {
    let data_file = &files[chunk.file as usize];
    let Some(expected) = chunk.blob.data_crc32 else {
        return Ok(Outcome::Unchecked);
    };
    if let Some(encoded) = &data_file.encoded {
        return check_encoded_tensor(store, prefix, encoded, chunk, expected).await;
    }
    let file = &data_file.path;
    let path = resolve(prefix, file)?;
    let start = chunk.offset + chunk.blob.data_offset;
    let end = start + chunk.blob.data_len;
    let (read, actual) = stream_crc32(store, &path, start..end).await?;
    if read == end - start && actual == expected {
        return Ok(Outcome::Checked(read));
    }
    let detail = if read != end - start {
        format!("read {read} of {} bytes", end - start)
    } else {
        format!("storage crc32 {actual:08x} but the zip records {expected:08x}")
    };
    Ok(Outcome::Bad(
        BadBlob {
            file: file.clone(),
            entry: chunk.entry.clone(),
            start,
            end,
            detail,
        },
        read,
    ))
}

/// A tensor blob stored compressed: its file in the model ([`DataFile::encoded`]) stands for the
/// decoded bytes and exists nowhere, so the real file's compressed range is decoded (streamed,
/// to its end: the whole stream is checked, and only the storage's bytes are hashed) and the
/// storage's CRC-32 computed over the decoded bytes, as the load checks them. A stream that does
/// not decode is a bad blob like a CRC mismatch, named by the real file and the compressed range.
async fn check_encoded_tensor(
    store: &dyn ObjectStore,
    prefix: &Path,
    encoded: &EncodedRange,
    chunk: &ChunkBlob,
    expected: u32,
) -> Result<Outcome, MetadataError> {
    let path = resolve(prefix, &encoded.source)?;
    let start = chunk.offset + chunk.blob.data_offset;
    let end = start + chunk.blob.data_len;
    let mut hasher = crc32fast::Hasher::new();
    let mut covered = 0u64;
    let mut sink = |offset: u64, bytes: &[u8]| {
        let (lo, hi) = (start.max(offset), end.min(offset + bytes.len() as u64));
        if lo < hi {
            hasher.update(&bytes[(lo - offset) as usize..(hi - offset) as usize]);
            covered += hi - lo;
        }
        true
    };
    let detail = match decode_range(store, &path, encoded, &mut sink).await? {
        Err(detail) => detail,
        Ok(()) if covered != end - start => format!(
            "the stream decodes to fewer bytes than the storage's end (byte {end}): {covered} of \
             its {} bytes (changed since it was opened?)",
            end - start
        ),
        Ok(()) => {
            let actual = hasher.finalize();
            if actual == expected {
                return Ok(Outcome::Checked(covered));
            }
            format!(
                "storage crc32 {actual:08x} but the zip records {expected:08x} (decoded bytes \
                 {start}..{end})"
            )
        }
    };
    Ok(Outcome::Bad(
        encoded_bad(encoded, chunk.entry.clone(), detail),
        covered,
    ))
}

/// Decodes `encoded`'s compressed range of `path` into `sink`. A store that fails is an error of
/// the verification; a stream that does not decode is the blob's fault: `Ok(Err(why))`.
async fn decode_range(
    store: &dyn ObjectStore,
    path: &Path,
    encoded: &EncodedRange,
    sink: &mut (dyn FnMut(u64, &[u8]) -> bool + Send),
) -> Result<Result<(), String>, MetadataError> {
    match decode_from_store(
        store,
        path,
        encoded.offset..encoded.offset + encoded.length,
        encoded.codec,
        sink,
    )
    .await
    {
        Ok(_) => Ok(Ok(())),
        Err(DecodeFailure::Store(source)) => Err(store_error("reading", path)(source)),
        Err(DecodeFailure::Invalid(detail)) => Ok(Err(detail)),
    }
}

/// A bad compressed blob, named by its real file and compressed byte range.
fn encoded_bad(encoded: &EncodedRange, entry: String, detail: String) -> BadBlob {
    BadBlob {
        file: encoded.source.clone(),
        entry,
        start: encoded.offset,
        end: encoded.offset + encoded.length,
        detail: format!("decoded from {}: {detail}", encoded.codec.name()),
    }
}

/// An object blob stored compressed: decoded whole (its length was capped when the checkpoint
/// was opened; a stream that now decodes to more is refused at that length) and every member
/// checked as for a plain object blob.
async fn check_encoded_object(
    store: &dyn ObjectStore,
    prefix: &Path,
    encoded: &EncodedRange,
    object: &ObjectMeta,
) -> Result<Outcome, MetadataError> {
    let path = resolve(prefix, &encoded.source)?;
    let entry = format!("object {}", object.key);
    let want = object.offset + object.length;
    let mut bytes: Vec<u8> = Vec::new();
    let mut longer = false;
    let mut sink = |offset: u64, decoded: &[u8]| {
        let end = offset + decoded.len() as u64;
        if end > want {
            longer = true;
            return false;
        }
        bytes.extend_from_slice(decoded);
        true
    };
    let detail = match decode_range(store, &path, encoded, &mut sink).await? {
        Err(detail) => detail,
        Ok(()) if longer || bytes.len() as u64 != want => format!(
            "the stream decodes to {} bytes, not the {want} it had when opened (changed since?)",
            if longer {
                format!("more than {want}")
            } else {
                bytes.len().to_string()
            }
        ),
        Ok(()) => match read_archive(&bytes[object.offset as usize..]) {
            Ok(_) => return Ok(Outcome::Checked(object.length)),
            Err(e) => e.to_string(),
        },
    };
    Ok(Outcome::Bad(
        encoded_bad(encoded, entry, detail),
        bytes.len() as u64,
    ))
}

async fn check_object(
    store: &dyn ObjectStore,
    prefix: &Path,
    files: &[DataFile],
    object: &ObjectMeta,
) -> Result<Outcome, MetadataError> {
    let data_file = &files[object.file as usize];
    if let Some(encoded) = &data_file.encoded {
        return check_encoded_object(store, prefix, encoded, object).await;
    }
    let file = &data_file.path;
    let path = resolve(prefix, file)?;
    let (start, end) = (object.offset, object.offset + object.length);
    let bytes = store
        .get_range(&path, start..end)
        .await
        .map_err(store_error("reading", &path))?;
    Ok(match read_archive(&bytes) {
        Ok(_) => Outcome::Checked(bytes.len() as u64),
        Err(e) => Outcome::Bad(
            BadBlob {
                file: file.clone(),
                entry: format!("object {}", object.key),
                start,
                end,
                detail: e.to_string(),
            },
            bytes.len() as u64,
        ),
    })
}

/// The zip CRC-32 of bytes `range` of `path`, and how many bytes the store gave. Streamed: a
/// multi-GiB storage is checked in the store's own chunks, never held whole.
pub(crate) async fn stream_crc32(
    store: &dyn ObjectStore,
    path: &Path,
    range: std::ops::Range<u64>,
) -> Result<(u64, u32), MetadataError> {
    let mut hasher = crc32fast::Hasher::new();
    let mut read = 0u64;
    if range.end > range.start {
        let result = store
            .get_opts(
                path,
                GetOptions {
                    range: Some(GetRange::Bounded(range)),
                    ..GetOptions::default()
                },
            )
            .await
            .map_err(store_error("reading", path))?;
        let mut stream = result.into_stream();
        while let Some(part) = stream.next().await {
            let part = part.map_err(store_error("reading", path))?;
            read += part.len() as u64;
            hasher.update(&part);
        }
    }
    Ok((read, hasher.finalize()))
}
