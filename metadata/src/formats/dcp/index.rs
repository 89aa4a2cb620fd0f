//! The per-blob index of a DCP checkpoint: for every tensor chunk, where its storage lies inside
//! its `torch.save` blob ([`TensorBlob`]). Building it reads only zip headers and `data.pkl`s, in
//! batched, bounded-concurrency range reads; it is computed once per checkpoint and kept in an
//! in-memory [`IndexCache`] and, when the caller names one, a cache directory (never the
//! checkpoint's own directory).

use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use bytes::Bytes;
use futures::StreamExt;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};

use crate::MetadataError;
use crate::encoded::{Codec, DecodeFailure, decode_from_store};
use crate::formats::torch::blob::{StreamGuard, TensorBlob, parse_tensor_blob};
use crate::formats::torch::pickle::Limits;
use crate::formats::torch::zip::{Segments, ZipError};

/// Bytes read from the start of every blob: the `data.pkl` local header and pickle (~250 bytes),
/// and the local headers up to `data/0`'s (torch pads member data to 64 bytes, so it starts near
/// byte 600).
pub const HEAD_BYTES: u64 = 1024;
/// Bytes read from the end of every blob: the end records (98 bytes with zip64) and a central
/// directory of 7 members (~600 bytes).
pub const TAIL_BYTES: u64 = 1024;
/// Adjacent header reads (one blob's tail and the next blob's head touch) are merged into one
/// request up to this size, so small blobs cost one request each without reading megabytes at once.
const MAX_MERGED_READ: u64 = 8 << 20;
/// Rounds of follow-up reads for a blob whose structures lie outside the head and tail.
const MAX_ROUNDS: usize = 8;
/// Decoded bytes kept from the start and from the end of an encoded blob while it streams
/// through the decoder: its zip structures, with room for a long `data.pkl` (an encoded blob
/// cannot be read in ranges, so a follow-up costs decoding it again).
const ENCODED_KEEP: u64 = 64 << 10;
/// The most decoded bytes the follow-up rounds keep, all together, for structures of an encoded
/// blob outside its head and tail: the cap on a blob's `data.pkl` (the largest structure a
/// tensor blob has).
const MAX_ENCODED_NEED: u64 = Limits::BLOB.max_input as u64;

/// Where one blob lies.
#[derive(Clone, Debug)]
pub(crate) struct BlobRef {
    /// Object path of its file.
    pub path: Path,
    /// What it holds, for messages: `tensor <fqn> chunk <box>`.
    pub entry: String,
    /// First byte in the file.
    pub offset: u64,
    /// Length in bytes.
    pub length: u64,
    /// Set when the blob is stored encoded (compressed): the zip is the decoded stream, and
    /// the index's offsets are offsets in it.
    pub encoded: Option<Codec>,
}

/// Where an index came from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexSource {
    /// Built now from the blobs' headers.
    #[default]
    Built,
    /// The in-memory cache.
    Memory,
    /// The cache directory.
    Disk,
}

/// How the per-blob index was obtained and what building it cost.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct IndexStats {
    /// Tensor blobs indexed.
    pub blobs: u64,
    /// Of those, blobs stored compressed: indexing decodes each whole (`bytes_read` counts their
    /// compressed bytes).
    #[serde(default)]
    pub compressed_blobs: u64,
    /// Where the index came from.
    pub source: IndexSource,
    /// Range requests made for zip headers (0 when cached).
    pub requests: u64,
    /// Header bytes read (0 when cached).
    pub bytes_read: u64,
    /// Bytes of the `.metadata` file(s) read.
    pub metadata_bytes: u64,
    /// Seconds it took.
    pub seconds: f64,
}

/// Per-checkpoint blob indexes kept in memory, keyed by a digest of the checkpoint's `.metadata`
/// and data file sizes. Bounded: the oldest entry goes when `capacity` is reached.
#[derive(Debug)]
pub struct IndexCache {
    entries: Mutex<VecDeque<(String, Arc<Vec<TensorBlob>>)>>,
    capacity: usize,
}

impl IndexCache {
    /// An empty cache holding up to `capacity` checkpoints' indexes.
    pub fn new(capacity: usize) -> IndexCache {
        IndexCache {
            entries: Mutex::new(VecDeque::new()),
            capacity: capacity.max(1),
        }
    }

    /// The process-wide cache [`super::DcpOptions::default`] uses (64 checkpoints).
    pub fn global() -> Arc<IndexCache> {
        static GLOBAL: OnceLock<Arc<IndexCache>> = OnceLock::new();
        Arc::clone(GLOBAL.get_or_init(|| Arc::new(IndexCache::new(64))))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(String, Arc<Vec<TensorBlob>>)>> {
        // A panic while holding the lock cannot leave the deque half-updated.
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The index cached under `key`.
    pub fn get(&self, key: &str) -> Option<Arc<Vec<TensorBlob>>> {
        self.lock()
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| Arc::clone(v))
    }

    /// Caches `index` under `key`.
    pub fn insert(&self, key: &str, index: Arc<Vec<TensorBlob>>) {
        let mut entries = self.lock();
        entries.retain(|(k, _)| k != key);
        while entries.len() >= self.capacity {
            entries.pop_front();
        }
        entries.push_back((key.to_string(), index));
    }

    /// Number of cached indexes.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// True when nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Forgets everything.
    pub fn clear(&self) {
        self.lock().clear();
    }
}

#[derive(Serialize, Deserialize)]
struct DiskIndex {
    format: String,
    key: String,
    blobs: Vec<TensorBlob>,
}

const DISK_FORMAT: &str = "tessera-dcp-index-v1";

/// The cache file for `key` in `dir`.
fn disk_path(dir: &std::path::Path, key: &str) -> PathBuf {
    dir.join(format!("dcp-index-{key}.json"))
}

/// Reads a cached index; `None` when absent, unreadable, or not for `key` and `blobs` entries
/// (then it is rebuilt and overwritten).
pub(crate) fn read_disk(dir: &std::path::Path, key: &str, blobs: usize) -> Option<Vec<TensorBlob>> {
    let bytes = std::fs::read(disk_path(dir, key)).ok()?;
    let index: DiskIndex = serde_json::from_slice(&bytes).ok()?;
    (index.format == DISK_FORMAT && index.key == key && index.blobs.len() == blobs)
        .then_some(index.blobs)
}

/// Writes an index to the cache directory, atomically (temporary file, then rename). A cache that
/// cannot be written is not an error: the index is simply rebuilt next time.
pub(crate) fn write_disk(dir: &std::path::Path, key: &str, blobs: &[TensorBlob]) {
    let index = DiskIndex {
        format: DISK_FORMAT.to_string(),
        key: key.to_string(),
        blobs: blobs.to_vec(),
    };
    let Ok(bytes) = serde_json::to_vec(&index) else {
        return;
    };
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let path = disk_path(dir, key);
    let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, &path).is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
}

/// A failure to decode the encoded `blob` as a [`MetadataError`] naming it: the store's error
/// with the byte range read, or what is wrong with the stream.
pub(crate) fn decode_error(blob: &BlobRef, codec: Codec, failure: DecodeFailure) -> MetadataError {
    match failure {
        DecodeFailure::Store(source) => MetadataError::Store {
            action: "reading",
            path: format!(
                "{} bytes {}..{}",
                blob.path,
                blob.offset,
                blob.offset + blob.length
            ),
            source,
        },
        DecodeFailure::Invalid(detail) => {
            blob_error(blob, format!("{} stream: {detail}", codec.name()))
        }
    }
}

pub(crate) fn blob_error(blob: &BlobRef, detail: impl Into<String>) -> MetadataError {
    MetadataError::Blob {
        path: blob.path.to_string(),
        start: blob.offset,
        end: blob.offset + blob.length,
        entry: blob.entry.clone(),
        detail: detail.into(),
    }
}

struct Read {
    path: Path,
    range: Range<u64>,
}

async fn fetch(store: &dyn ObjectStore, read: &Read) -> Result<Bytes, MetadataError> {
    let bytes = store
        .get_range(&read.path, read.range.clone())
        .await
        .map_err(|source| MetadataError::Store {
            action: "reading",
            path: format!(
                "{} bytes {}..{}",
                read.path, read.range.start, read.range.end
            ),
            source,
        })?;
    if bytes.len() as u64 != read.range.end - read.range.start {
        return Err(MetadataError::Invalid {
            what: format!(
                "{}: asked for bytes {}..{} but got {} bytes (truncated file?)",
                read.path,
                read.range.start,
                read.range.end,
                bytes.len()
            ),
        });
    }
    Ok(bytes)
}

/// What [`index_blobs`] read.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Fetched {
    pub requests: u64,
    pub bytes: u64,
}

/// Takes every blob apart: reads its head and tail (merged with its neighbours' where they
/// touch), parses, and follows up on the few blobs whose structures lie elsewhere. Results are in
/// the order of `blobs`. Fails on the first damaged blob, naming it.
pub(crate) async fn index_blobs(
    store: &dyn ObjectStore,
    blobs: &[BlobRef],
    concurrency: usize,
) -> Result<(Vec<TensorBlob>, Fetched), MetadataError> {
    let concurrency = concurrency.max(1);
    if blobs.iter().any(|b| b.encoded.is_some()) {
        return index_mixed(store, blobs, concurrency).await;
    }
    // Wanted ranges in file order.
    let mut order: Vec<usize> = (0..blobs.len()).collect();
    order.sort_by(|&a, &b| {
        (blobs[a].path.as_ref(), blobs[a].offset).cmp(&(blobs[b].path.as_ref(), blobs[b].offset))
    });
    let mut wants: Vec<(usize, Range<u64>)> = Vec::with_capacity(2 * blobs.len());
    for &b in &order {
        let (start, len) = (blobs[b].offset, blobs[b].length);
        if len == 0 {
            return Err(blob_error(
                &blobs[b],
                "the blob is empty (0 bytes), not a torch.save zip",
            ));
        }
        let end = start + len;
        if len <= HEAD_BYTES + TAIL_BYTES {
            wants.push((b, start..end));
        } else {
            wants.push((b, start..start + HEAD_BYTES));
            wants.push((b, end - TAIL_BYTES..end));
        }
    }
    wants.sort_by(|a, b| {
        (blobs[a.0].path.as_ref(), a.1.start).cmp(&(blobs[b.0].path.as_ref(), b.1.start))
    });
    let mut reads: Vec<Read> = Vec::new();
    let mut blob_reads: Vec<Vec<usize>> = vec![Vec::new(); blobs.len()];
    for (b, range) in wants {
        let merge = reads.last().is_some_and(|last| {
            last.path == blobs[b].path
                && range.start <= last.range.end
                && range.end.max(last.range.end) - last.range.start <= MAX_MERGED_READ
        });
        match reads.last_mut() {
            Some(last) if merge => last.range.end = last.range.end.max(range.end),
            _ => reads.push(Read {
                path: blobs[b].path.clone(),
                range,
            }),
        }
        let r = reads.len() - 1;
        if blob_reads[b].last() != Some(&r) {
            blob_reads[b].push(r);
        }
    }
    let mut refs = vec![0usize; reads.len()];
    let mut complete_at: Vec<Vec<usize>> = vec![Vec::new(); reads.len()];
    for (b, rs) in blob_reads.iter().enumerate() {
        for &r in rs {
            refs[r] += 1;
        }
        if let Some(&last) = rs.iter().max() {
            complete_at[last].push(b);
        }
    }
    let fetched = Fetched {
        requests: reads.len() as u64,
        bytes: reads.iter().map(|r| r.range.end - r.range.start).sum(),
    };

    let mut results: Vec<Option<TensorBlob>> = vec![None; blobs.len()];
    let mut follow_up: Vec<(usize, Segments, Range<u64>)> = Vec::new();
    let mut held: HashMap<usize, Bytes> = HashMap::new();
    // Ordered delivery: a blob is complete when its last read arrives, and a read's bytes are
    // dropped when its last blob is parsed, so memory stays at the window of reads in flight.
    let mut stream = futures::stream::iter(
        reads
            .iter()
            .enumerate()
            .map(|(i, read)| async move { fetch(store, read).await.map(|bytes| (i, bytes)) }),
    )
    .buffered(concurrency);
    while let Some(next) = stream.next().await {
        let (i, bytes) = next?;
        held.insert(i, bytes);
        for &b in &complete_at[i] {
            let blob = &blobs[b];
            let mut seg = Segments::new(blob.length);
            for &r in &blob_reads[b] {
                let Some(bytes) = held.get(&r) else {
                    continue;
                };
                let read = &reads[r].range;
                let lo = read.start.max(blob.offset);
                let hi = read.end.min(blob.offset + blob.length);
                if lo < hi {
                    let slice = bytes.slice((lo - read.start) as usize..(hi - read.start) as usize);
                    seg.add(lo - blob.offset, slice);
                }
                refs[r] -= 1;
                if refs[r] == 0 {
                    held.remove(&r);
                }
            }
            match parse_tensor_blob(&seg) {
                Ok(parsed) => results[b] = Some(parsed),
                Err(ZipError::Need(range)) => follow_up.push((b, seg, range)),
                Err(ZipError::Bad(detail)) => return Err(blob_error(blob, detail)),
            }
        }
    }
    drop(stream);

    let finished: Vec<Result<(usize, TensorBlob, Fetched), MetadataError>> = futures::stream::iter(
        follow_up
            .into_iter()
            .map(|(b, mut seg, mut need)| async move {
                let blob = &blobs[b];
                let mut cost = Fetched::default();
                for _ in 0..MAX_ROUNDS {
                    let read = Read {
                        path: blob.path.clone(),
                        range: blob.offset + need.start..blob.offset + need.end,
                    };
                    let bytes = fetch(store, &read).await?;
                    cost.requests += 1;
                    cost.bytes += bytes.len() as u64;
                    seg.add(need.start, bytes);
                    match parse_tensor_blob(&seg) {
                        Ok(parsed) => return Ok((b, parsed, cost)),
                        Err(ZipError::Need(range)) => need = range,
                        Err(ZipError::Bad(detail)) => return Err(blob_error(blob, detail)),
                    }
                }
                Err(blob_error(
                    blob,
                    format!("still incomplete after {MAX_ROUNDS} follow-up reads"),
                ))
            }),
    )
    .buffer_unordered(concurrency)
    .collect()
    .await;
    finish(blobs, results, finished, fetched)
}

/// The index in `blobs` order: `results` so far plus the blobs parsed `finished` later, with
/// their cost added to `fetched`; fails on the first error, or naming a blob never parsed.
fn finish(
    blobs: &[BlobRef],
    mut results: Vec<Option<TensorBlob>>,
    finished: Vec<Result<(usize, TensorBlob, Fetched), MetadataError>>,
    mut fetched: Fetched,
) -> Result<(Vec<TensorBlob>, Fetched), MetadataError> {
    for item in finished {
        let (b, parsed, cost) = item?;
        results[b] = Some(parsed);
        fetched.requests += cost.requests;
        fetched.bytes += cost.bytes;
    }
    let mut out = Vec::with_capacity(blobs.len());
    for (b, result) in results.into_iter().enumerate() {
        match result {
            Some(parsed) => out.push(parsed),
            None => return Err(blob_error(&blobs[b], "was never read")),
        }
    }
    Ok((out, fetched))
}

/// [`index_blobs`] for a checkpoint some of whose blobs are encoded: the plain ones as always,
/// each encoded one decoded whole as it streams in (its zip's end lies at the end of the
/// decoded stream), keeping only its head and tail.
async fn index_mixed(
    store: &dyn ObjectStore,
    blobs: &[BlobRef],
    concurrency: usize,
) -> Result<(Vec<TensorBlob>, Fetched), MetadataError> {
    let (encoded, plain): (Vec<usize>, Vec<usize>) =
        (0..blobs.len()).partition(|&b| blobs[b].encoded.is_some());
    let plain_refs: Vec<BlobRef> = plain.iter().map(|&b| blobs[b].clone()).collect();
    let (plain_index, fetched) = Box::pin(index_blobs(store, &plain_refs, concurrency)).await?;
    let mut results: Vec<Option<TensorBlob>> = vec![None; blobs.len()];
    for (b, parsed) in plain.into_iter().zip(plain_index) {
        results[b] = Some(parsed);
    }
    let decoded: Vec<Result<(usize, TensorBlob, Fetched), MetadataError>> =
        futures::stream::iter(encoded.into_iter().map(|b| async move {
            let (parsed, cost) = index_encoded(store, &blobs[b]).await?;
            Ok((b, parsed, cost))
        }))
        .buffer_unordered(concurrency)
        .collect()
        .await;
    finish(blobs, results, decoded, fetched)
}

/// Takes one encoded blob apart: decodes it as it streams in, keeping its first and last
/// [`ENCODED_KEEP`] decoded bytes (and any range a previous round asked for), and parses the zip
/// in them. Offsets in the result are offsets in the decoded stream.
async fn index_encoded(
    store: &dyn ObjectStore,
    blob: &BlobRef,
) -> Result<(TensorBlob, Fetched), MetadataError> {
    let Some(codec) = blob.encoded else {
        return Err(blob_error(blob, "is not encoded"));
    };
    let mut wanted: Vec<Range<u64>> = Vec::new();
    let mut cost = Fetched::default();
    for _ in 0..MAX_ROUNDS {
        let mut head: Vec<u8> = Vec::new();
        let mut tail: Vec<u8> = Vec::new();
        let mut tail_start = 0u64;
        let mut kept: Vec<Vec<u8>> = vec![Vec::new(); wanted.len()];
        let mut guard = StreamGuard::new();
        let mut stopped: Option<String> = None;
        let mut sink = |offset: u64, bytes: &[u8]| {
            if let Err(why) = guard.feed(bytes) {
                stopped = Some(why);
                return false;
            }
            let end = offset + bytes.len() as u64;
            if offset < ENCODED_KEEP {
                let take = (ENCODED_KEEP.min(end) - offset) as usize;
                head.extend_from_slice(&bytes[..take]);
            }
            tail.extend_from_slice(bytes);
            if tail.len() as u64 > 2 * ENCODED_KEEP {
                let drop = tail.len() - ENCODED_KEEP as usize;
                tail.drain(..drop);
                tail_start += drop as u64;
            }
            for (range, keep) in wanted.iter().zip(kept.iter_mut()) {
                let (lo, hi) = (range.start.max(offset), range.end.min(end));
                if lo < hi {
                    keep.extend_from_slice(&bytes[(lo - offset) as usize..(hi - offset) as usize]);
                }
            }
            true
        };
        let total = decode_from_store(
            store,
            &blob.path,
            blob.offset..blob.offset + blob.length,
            codec,
            &mut sink,
        )
        .await
        .map_err(|failure| decode_error(blob, codec, failure))?
        .unwrap_or(0);
        if let Some(why) = stopped {
            return Err(blob_error(
                blob,
                format!("decoded from {}: {why}", codec.name()),
            ));
        }
        cost.requests += 1;
        cost.bytes += blob.length;
        let mut seg = Segments::new(total);
        seg.add(0, Bytes::from(head));
        seg.add(tail_start, Bytes::from(tail));
        for (range, keep) in wanted.iter().zip(kept) {
            seg.add(range.start, Bytes::from(keep));
        }
        match parse_tensor_blob(&seg) {
            Ok(parsed) => return Ok((parsed, cost)),
            // Kept bytes are held whole: a structure larger than any torch.save writes (the
            // parser checks member sizes first; this bounds whatever else a forged directory
            // may point at) is refused rather than collected.
            Err(ZipError::Need(range))
                if wanted
                    .iter()
                    .chain([&range])
                    .map(|r| r.end - r.start)
                    .sum::<u64>()
                    > MAX_ENCODED_NEED =>
            {
                return Err(blob_error(
                    blob,
                    format!(
                        "decoded from {}: its zip structures need decoded bytes {}..{}, more \
                         than the {MAX_ENCODED_NEED}-byte cap on what is kept of a compressed blob",
                        codec.name(),
                        range.start,
                        range.end
                    ),
                ));
            }
            Err(ZipError::Need(range)) => wanted.push(range),
            Err(ZipError::Bad(detail)) => {
                return Err(blob_error(
                    blob,
                    format!("decoded from {}: {detail}", codec.name()),
                ));
            }
        }
    }
    Err(blob_error(
        blob,
        format!("still incomplete after decoding it {MAX_ROUNDS} times"),
    ))
}
