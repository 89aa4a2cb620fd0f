//! PyTorch Distributed Checkpoint (DCP) directories read in place: the `.metadata` pickle (through
//! a pickle VM of our own, [`pickle`]), and for every tensor chunk the `torch.save` zip blob it was
//! written as, taken apart from its headers only ([`zip`], [`blob`]) so that a rank's partial read
//! of a chunk stays partial.
//!
//! ```text
//! <dir>/.metadata        pickle of torch.distributed.checkpoint.metadata.Metadata, written last
//! <dir>/__0_0.distcp     blobs of rank 0, back to back, no header, no padding:
//!
//!   file byte  info.offset                                      info.offset + info.length
//!   ─────┬─────┬────────────────────────────────────────────────────────────┬─────────
//!   ...  │ ... │ torch.save zip: data.pkl … data/0 (raw storage) … directory │ next blob
//!   ─────┴─────┴─────────────────────────▲──────────────────────────────────┴─────────
//!                                        │
//!         element idx of the chunk lies at info.offset + D + esize·(soff + Σ idx_k·stride_k)
//!         D = data start of data/0 inside the blob, soff = storage offset (both from the blob)
//! ```
//!
//! [`open_dcp`] turns that into a [`CheckpointMeta`]: every chunk's [`ByteMeta`] points at its
//! storage bytes inside the `.distcp` file (with the stored strides when they are not row-major,
//! e.g. a transposed weight), and every non-tensor entry is an [`ObjectMeta`] over its whole blob
//! ([`decode_object`] turns simple Python values into JSON). DCP records no checksums of the
//! chunk bytes tessera could check a partial read against, so loads read without verification;
//! [`verify_dcp`] checks the zip CRC-32 of every member.

mod index;
pub mod megatron;
pub mod metadata;
mod object;
mod verify;

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::encoded::{Codec, EncodedRange, decode_from_store};
use crate::formats::native::{read_whole, resolve, store_error};
use crate::formats::{Format, Listing, Writer};
use crate::identity::IdentityHasher;
use crate::{
    ByteMeta, CheckpointMeta, DataFile, MetadataError, ObjectMeta, SavedChunk, TensorBox,
    TensorMeta, flat_range_chunks, row_major_strides, validate,
};

use crate::formats::torch::blob::TensorBlob;
use crate::formats::torch::pickle;
pub use index::{HEAD_BYTES, IndexCache, IndexSource, IndexStats, TAIL_BYTES};
pub use megatron::{MegatronConfig, MegatronDetails, Reformulation};
pub use metadata::{DcpChunk, DcpMetadata, DcpObject, DcpTensor, StorageInfo, parse_metadata};
pub use object::{decode_object, decode_pickle, value_to_json};
pub(crate) use verify::stream_crc32;
pub use verify::{BadBlob, DcpVerifyReport, verify_dcp};

/// Name of the global metadata file.
pub const METADATA_FILE: &str = ".metadata";

/// Options of [`open_dcp`].
#[derive(Clone, Debug)]
pub struct DcpOptions {
    /// In-memory index cache (the process-wide [`IndexCache::global`] by default; `None` builds
    /// the index every time).
    pub cache: Option<Arc<IndexCache>>,
    /// A local directory to keep built indexes in, so other processes (every rank of a job,
    /// the next run) skip the header reads. Never the checkpoint's own directory.
    pub cache_dir: Option<PathBuf>,
    /// Header reads in flight. They are small and latency-bound; 32 keeps an object store's
    /// connection pool busy without tripping request-rate limits.
    pub concurrency: usize,
    /// Caps of the `.metadata` pickle VM.
    pub limits: pickle::Limits,
}

impl Default for DcpOptions {
    fn default() -> Self {
        DcpOptions {
            cache: Some(IndexCache::global()),
            cache_dir: None,
            concurrency: 32,
            limits: pickle::Limits::METADATA,
        }
    }
}

/// Where one tensor chunk's blob lies and what is inside.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChunkBlob {
    /// `tensor <fqn> chunk <box>`, for messages.
    pub entry: String,
    /// Index into [`CheckpointMeta::files`].
    pub file: u32,
    /// First byte of the blob in the file.
    pub offset: u64,
    /// Bytes of the blob.
    pub length: u64,
    /// The blob taken apart.
    pub blob: TensorBlob,
}

/// A DCP checkpoint, opened: the checkpoint model and what is DCP-specific about it.
#[derive(Clone, Debug)]
pub struct DcpCheckpoint {
    /// The checkpoint model: tensors, chunks pointing into the `.distcp` files, objects.
    pub meta: CheckpointMeta,
    /// The rest.
    pub details: DcpDetails,
}

/// What is DCP-specific about an opened checkpoint (kept apart from the [`CheckpointMeta`] so
/// that one copy of the model serves both).
#[derive(Clone, Debug)]
pub struct DcpDetails {
    /// What `.metadata` says.
    pub metadata: DcpMetadata,
    /// Every stored tensor chunk's blob, in `.metadata` order: one per [`CheckpointMeta::chunks`]
    /// entry, except that a Megatron reformulated chunk is several there (the boxes tiling its
    /// flat range).
    pub blobs: Vec<ChunkBlob>,
    /// How the blob index was obtained.
    pub stats: IndexStats,
    /// The metadata file(s) read: `.metadata`, or the per-rank `__<r>.metadata` files.
    pub metadata_files: Vec<String>,
    /// What Megatron-Core added, when it wrote the checkpoint (torch_dist backend).
    pub megatron: Option<MegatronDetails>,
}

impl DcpDetails {
    /// Who wrote the checkpoint: Megatron-Core torch_dist (with what the files tell of its
    /// version), or PyTorch DCP with its metadata version.
    pub fn writer(&self) -> Writer {
        match &self.megatron {
            Some(megatron) => megatron.writer(),
            None => Writer::new("PyTorch DCP", self.metadata.version.clone()),
        }
    }
}

/// True when `listing` looks like a DCP directory (a `.metadata`, or per-rank metadata files).
pub fn is_dcp(listing: &Listing) -> bool {
    !metadata_files(listing).is_empty()
}

fn metadata_files(listing: &Listing) -> Vec<String> {
    if listing.files.contains_key(METADATA_FILE) {
        return vec![METADATA_FILE.to_string()];
    }
    // torch ≥2.9 with `use_collectives=False`: every rank writes `__<rank>.metadata`.
    let mut per_rank: Vec<(u64, String)> = listing
        .files
        .keys()
        .filter_map(|name| {
            let rank = name.strip_prefix("__")?.strip_suffix(".metadata")?;
            (!rank.is_empty() && rank.bytes().all(|b| b.is_ascii_digit()))
                .then(|| Some((rank.parse().ok()?, name.clone())))
                .flatten()
        })
        .collect();
    per_rank.sort();
    per_rank.into_iter().map(|(_, name)| name).collect()
}

/// Opens the DCP checkpoint at `prefix` whose directory `listing` is: parses `.metadata`,
/// indexes every tensor blob (or takes the index from a cache), builds and validates the
/// [`CheckpointMeta`]. Errors name the file: [`MetadataError::Decode`] for a damaged
/// `.metadata`, [`MetadataError::Blob`] for a damaged blob, [`MetadataError::ByteRangePastEnd`]
/// for a truncated `.distcp`, [`MetadataError::Unsupported`] for blobs stored with a transform
/// other than DCP's `stream.zstd/1`. Blobs stored compressed are decoded once here to be
/// indexed; their chunks lie in files of the model that stand for the decoded bytes
/// ([`DataFile::encoded`]).
pub async fn open_dcp(
    store: &dyn ObjectStore,
    prefix: &Path,
    listing: &Listing,
    options: &DcpOptions,
) -> Result<DcpCheckpoint, MetadataError> {
    let started = Instant::now();
    let names = metadata_files(listing);
    if names.is_empty() {
        return Err(MetadataError::Invalid {
            what: format!("{prefix}: no {METADATA_FILE}, so this is not a DCP checkpoint"),
        });
    }
    // The checkpoint's identity: the metadata files as read, and (below) the data files' sizes.
    let mut identity = IdentityHasher::new(Format::Dcp);
    let read = read_metadata(store, prefix, listing, &names, options, &mut identity).await?;
    let metadata = merge(read.parts, prefix)?;
    let metadata_path = resolve(prefix, &names[0])?.to_string();
    let reformulations = megatron::reformulations(&metadata, &metadata_path)?;
    let config = read_megatron_config(store, prefix, listing, &mut identity).await?;
    let megatron = MegatronDetails::detect(listing, config, &metadata, &reformulations);
    // Megatron ≤0.18 keeps the common state in common.pt next to the DCP files.
    let common_file = megatron
        .as_ref()
        .and_then(|m| m.common_state.as_deref())
        .filter(|c| *c == megatron::COMMON_FILE);

    let (mut files, file_index) =
        data_files(store, prefix, listing, &names, &metadata, common_file).await?;
    let mut size_digest = 0u32;
    for file in &files {
        identity
            .part(file.path.as_bytes())
            .part(&file.size.unwrap_or(0).to_le_bytes());
        size_digest = crc32c::crc32c_append(
            size_digest,
            format!("{}\t{}\n", file.path, file.size.unwrap_or(0)).as_bytes(),
        );
    }

    let refs = blob_refs(prefix, &metadata, &file_index, &files)?;
    check_blobs_apart(&refs)?;
    let mut objects = Vec::with_capacity(metadata.objects.len());
    for object in &metadata.objects {
        objects.push(object_meta(store, prefix, object, &file_index, &mut files, options).await?);
    }
    if let Some(common) = common_file {
        let file = file_index[common];
        objects.push(ObjectMeta {
            key: common.to_string(),
            file,
            offset: 0,
            length: files[file as usize].size.unwrap_or(0),
            crc32c: None,
        });
    }

    let key = format!(
        "{:x}-{:08x}-{:08x}-{size_digest:08x}",
        read.bytes, read.crc32, read.crc32c
    );
    let mut stats = IndexStats {
        blobs: refs.len() as u64,
        compressed_blobs: refs.iter().filter(|(_, r)| r.encoded.is_some()).count() as u64,
        metadata_bytes: read.bytes,
        ..IndexStats::default()
    };
    let index = blob_index(store, options, &key, &refs, &mut stats).await?;

    // The checkpoint model.
    let mut model = ModelBuilder {
        tensors: Vec::with_capacity(metadata.tensors.len()),
        chunks: Vec::with_capacity(refs.len()),
        blobs: Vec::with_capacity(refs.len()),
        files,
    };
    let mut k = 0usize;
    for (t, tensor) in metadata.tensors.iter().enumerate() {
        let reformulation = reformulations.get(t).and_then(Option::as_ref);
        model.tensors.push(TensorMeta::new(
            tensor.fqn.clone(),
            tensor.dtype,
            reformulation.map_or_else(|| tensor.shape.clone(), |r| r.shape.clone()),
        ));
        for chunk in &tensor.chunks {
            let (file, blob_ref) = &refs[k];
            let Some(blob) = index.get(k) else {
                return Err(MetadataError::Invalid {
                    what: format!("{prefix}: the blob index is shorter than the chunk list"),
                });
            };
            k += 1;
            model.add_chunk(
                t as u32,
                tensor,
                chunk,
                reformulation,
                (*file, blob_ref),
                blob,
            )?;
        }
    }
    let ModelBuilder {
        tensors,
        chunks,
        blobs,
        files,
    } = model;
    let meta =
        CheckpointMeta::new(tensors, chunks, objects, files)?.with_identity(identity.finish());
    validate(&meta)?;
    stats.seconds = started.elapsed().as_secs_f64();
    Ok(DcpCheckpoint {
        meta,
        details: DcpDetails {
            metadata,
            blobs,
            stats,
            metadata_files: names,
            megatron,
        },
    })
}

/// The metadata files as read: each parsed, and their bytes' size, CRC-32 and crc32c (all files
/// in order), which with the data files' sizes key the blob index caches.
struct MetadataRead {
    parts: Vec<DcpMetadata>,
    bytes: u64,
    crc32: u32,
    crc32c: u32,
}

/// Reads and parses every metadata file `names` lists (each within the input cap), adding each
/// to the checkpoint's `identity`.
async fn read_metadata(
    store: &dyn ObjectStore,
    prefix: &Path,
    listing: &Listing,
    names: &[String],
    options: &DcpOptions,
    identity: &mut IdentityHasher,
) -> Result<MetadataRead, MetadataError> {
    let mut digest = crc32fast::Hasher::new();
    let mut digest_c = 0u32;
    let mut metadata_bytes = 0u64;
    let mut parts = Vec::with_capacity(names.len());
    for name in names {
        let path = resolve(prefix, name)?;
        let size = listing.files.get(name).copied();
        if size == Some(0) {
            return Err(MetadataError::EmptyFile {
                path: path.to_string(),
                what: "DCP metadata",
            });
        }
        if let Some(size) = size
            && size > options.limits.max_input as u64
        {
            return Err(MetadataError::Decode {
                path: path.to_string(),
                what: "DCP metadata",
                detail: format!(
                    "{size} bytes exceed the {}-byte cap",
                    options.limits.max_input
                ),
            });
        }
        let bytes = read_whole(store, &path).await?;
        digest.update(&bytes);
        digest_c = crc32c::crc32c_append(digest_c, &bytes);
        identity.part(name.as_bytes()).part(&bytes);
        metadata_bytes += bytes.len() as u64;
        parts.push(parse_metadata(&bytes, path.as_ref(), &options.limits)?);
    }
    Ok(MetadataRead {
        parts,
        bytes: metadata_bytes,
        crc32: digest.finalize(),
        crc32c: digest_c,
    })
}

/// The data files every tensor chunk and object (and Megatron's `common.pt`) lies in, in name
/// order, with their index by name: sizes from the listing, or a HEAD for files in
/// subdirectories. A file `names` (the metadata files) point at that does not exist is refused.
async fn data_files<'m>(
    store: &dyn ObjectStore,
    prefix: &Path,
    listing: &Listing,
    names: &[String],
    metadata: &'m DcpMetadata,
    common_file: Option<&'m str>,
) -> Result<(Vec<DataFile>, HashMap<&'m str, u32>), MetadataError> {
    let mut file_names: BTreeSet<&str> = BTreeSet::new();
    for tensor in &metadata.tensors {
        for chunk in &tensor.chunks {
            file_names.insert(&chunk.storage.relative_path);
        }
    }
    for object in &metadata.objects {
        file_names.insert(&object.storage.relative_path);
    }
    if let Some(common) = common_file {
        file_names.insert(common);
    }
    let mut files = Vec::with_capacity(file_names.len());
    let mut file_index: HashMap<&str, u32> = HashMap::with_capacity(file_names.len());
    for name in file_names {
        let size = match listing.files.get(name) {
            Some(&size) => size,
            None => {
                let path = resolve(prefix, name)?;
                match store.head(&path).await {
                    Ok(meta) => meta.size,
                    Err(object_store::Error::NotFound { .. }) => {
                        return Err(MetadataError::Invalid {
                            what: format!(
                                "data file {path} (named in {}) does not exist",
                                names.join(", ")
                            ),
                        });
                    }
                    Err(e) => return Err(store_error("reading", &path)(e)),
                }
            }
        };
        file_index.insert(name, files.len() as u32);
        files.push(DataFile {
            path: name.to_string(),
            size: Some(size),
            encoded: None,
        });
    }
    Ok((files, file_index))
}

/// The tensor blobs to index, in chunk order, each checked against its file first (its range
/// within the file, its transforms one that is read).
fn blob_refs(
    prefix: &Path,
    metadata: &DcpMetadata,
    file_index: &HashMap<&str, u32>,
    files: &[DataFile],
) -> Result<Vec<(u32, index::BlobRef)>, MetadataError> {
    let mut refs = Vec::new();
    for tensor in &metadata.tensors {
        for chunk in &tensor.chunks {
            let region = TensorBox::new(chunk.offsets.clone(), chunk.sizes.clone());
            let info = &chunk.storage;
            let file = file_index[info.relative_path.as_str()];
            let path = resolve(prefix, &info.relative_path)?;
            let encoded = transform_codec(&info.transforms, &path, || {
                format!("tensor {} chunk {region}", tensor.fqn)
            })?;
            let size = files[file as usize].size.unwrap_or(0);
            check_range(&tensor.fqn, &region.to_string(), &path, info, size)?;
            refs.push((
                file,
                index::BlobRef {
                    path,
                    entry: format!("tensor {} chunk {region}", tensor.fqn),
                    offset: info.offset,
                    length: info.length,
                    encoded,
                },
            ));
        }
    }
    Ok(refs)
}

/// An object's entry in the model, its range checked against its file. A compressed object
/// lies in a file of its decoded bytes, added to `files`.
async fn object_meta(
    store: &dyn ObjectStore,
    prefix: &Path,
    object: &DcpObject,
    file_index: &HashMap<&str, u32>,
    files: &mut Vec<DataFile>,
    options: &DcpOptions,
) -> Result<ObjectMeta, MetadataError> {
    let info = &object.storage;
    let file = file_index[info.relative_path.as_str()];
    let path = resolve(prefix, &info.relative_path)?;
    check_range(
        &object.fqn,
        "(object)",
        &path,
        info,
        files[file as usize].size.unwrap_or(0),
    )?;
    let encoded = transform_codec(&info.transforms, &path, || format!("object {}", object.fqn))?;
    let (file, offset, length) = match encoded {
        None => (file, info.offset, info.length),
        // Objects are small pickles: decoded once here for their length, again when read.
        Some(codec) => {
            let length =
                decoded_length(store, &path, info, codec, &object.fqn, &options.limits).await?;
            let range = EncodedRange {
                source: info.relative_path.clone(),
                offset: info.offset,
                length: info.length,
                codec,
            };
            (decoded_file(files, range, length), 0, length)
        }
    };
    Ok(ObjectMeta {
        key: object.fqn.clone(),
        file,
        offset,
        length,
        crc32c: None,
    })
}

/// The blob index under `key`: from the memory cache, the cache directory, or built by reading
/// every blob's zip headers (then stored in both caches). Says in `stats` where it came from
/// and what building it read.
async fn blob_index(
    store: &dyn ObjectStore,
    options: &DcpOptions,
    key: &str,
    refs: &[(u32, index::BlobRef)],
    stats: &mut IndexStats,
) -> Result<Arc<Vec<TensorBlob>>, MetadataError> {
    let cached = options.cache.as_ref().and_then(|c| c.get(key));
    if let Some(index) = cached
        && index.len() == refs.len()
    {
        stats.source = IndexSource::Memory;
        return Ok(index);
    }
    let from_disk = options
        .cache_dir
        .as_deref()
        .and_then(|dir| index::read_disk(dir, key, refs.len()));
    let index = match from_disk {
        Some(blobs) => {
            stats.source = IndexSource::Disk;
            Arc::new(blobs)
        }
        None => {
            let just_refs: Vec<index::BlobRef> = refs.iter().map(|(_, r)| r.clone()).collect();
            let (blobs, fetched) =
                index::index_blobs(store, &just_refs, options.concurrency).await?;
            stats.requests = fetched.requests;
            stats.bytes_read = fetched.bytes;
            if let Some(dir) = &options.cache_dir {
                index::write_disk(dir, key, &blobs);
            }
            Arc::new(blobs)
        }
    };
    if let Some(cache) = &options.cache {
        cache.insert(key, Arc::clone(&index));
    }
    Ok(index)
}

/// The checkpoint model being built from the indexed blobs: tensors, their saved chunks, each
/// chunk's blob, and the data files (to which compressed blobs add files of their decoded
/// bytes).
struct ModelBuilder {
    tensors: Vec<TensorMeta>,
    chunks: Vec<SavedChunk>,
    blobs: Vec<ChunkBlob>,
    files: Vec<DataFile>,
}

impl ModelBuilder {
    /// Adds the saved chunk(s) of one `.metadata` chunk of tensor `t` from its indexed `blob`,
    /// after checking the blob holds what `.metadata` says: a plain chunk, or the flat ranges of
    /// a Megatron `reformulation`.
    fn add_chunk(
        &mut self,
        t: u32,
        tensor: &DcpTensor,
        chunk: &DcpChunk,
        reformulation: Option<&Reformulation>,
        (file, blob_ref): (u32, &index::BlobRef),
        blob: &TensorBlob,
    ) -> Result<(), MetadataError> {
        let bad = |detail: String| MetadataError::Blob {
            path: blob_ref.path.to_string(),
            start: blob_ref.offset,
            end: blob_ref.offset + blob_ref.length,
            entry: blob_ref.entry.clone(),
            detail,
        };
        if blob.dtype != tensor.dtype {
            return Err(bad(format!(
                "holds {} but .metadata says {}",
                blob.dtype, tensor.dtype
            )));
        }
        if blob.size != chunk.sizes {
            return Err(bad(format!(
                "holds a tensor of size {:?} but .metadata says the chunk has sizes {:?}",
                blob.size, chunk.sizes
            )));
        }
        // Parsing guarantees this; an index from the cache directory is checked again.
        if blob
            .data_offset
            .checked_add(blob.data_len)
            .is_none_or(|end| blob_ref.encoded.is_none() && end > blob_ref.length)
        {
            return Err(bad(format!(
                "its storage at bytes {}..+{} lies outside the {}-byte blob (a stale cache?)",
                blob.data_offset, blob.data_len, blob_ref.length
            )));
        }
        let span = blob.span_bytes().map_err(&bad)?;
        let esize = tensor.dtype.size();
        let strides = stored_strides(blob, &chunk.sizes);
        // An encoded blob's chunk lies in the blob's decoded bytes, a file of its own that
        // can be read up to the end of the storage.
        let (file, blob_start) = match blob_ref.encoded {
            None => (file, blob_ref.offset),
            Some(codec) => {
                let info = &chunk.storage;
                let range = EncodedRange {
                    source: info.relative_path.clone(),
                    offset: info.offset,
                    length: info.length,
                    codec,
                };
                let visible = blob.data_offset.saturating_add(blob.data_len);
                (decoded_file(&mut self.files, range, visible), 0)
            }
        };
        let offset = blob_start
            .checked_add(blob.data_offset)
            .and_then(|o| o.checked_add(blob.storage_offset.checked_mul(esize)?))
            .ok_or_else(|| bad("storage offset overflows".to_string()))?;
        match reformulation {
            None => self.chunks.push(SavedChunk {
                tensor: t,
                region: TensorBox::new(chunk.offsets.clone(), chunk.sizes.clone()),
                bytes: ByteMeta {
                    file,
                    offset,
                    length: span,
                    strides,
                },
                crc32c: None,
                // The zip's CRC-32 covers the blob's whole storage: a check of this box
                // exactly when the storage is the box's bytes, each once (torch.save of
                // DCP's clones: no storage offset, no gaps, no element stored twice).
                crc32: blob.data_crc32.filter(|_| {
                    blob.storage_offset == 0
                        && span == blob.data_len
                        && region_numel(&chunk.sizes).checked_mul(esize) == Some(span)
                }),
            }),
            Some(r) => {
                // A flat range of one TP-local box: its elements lie back to back.
                if strides.is_some() {
                    return Err(bad(format!(
                        "a Megatron flattened chunk stored with strides {:?}, not contiguous",
                        blob.stride
                    )));
                }
                let (parent, start, end) = r.chunk(&chunk.offsets, &chunk.sizes).map_err(&bad)?;
                self.chunks.extend(flat_range_chunks(
                    t, &parent, start, end, file, offset, esize,
                ));
            }
        }
        self.blobs.push(ChunkBlob {
            entry: blob_ref.entry.clone(),
            file,
            offset: blob_start,
            length: match blob_ref.encoded {
                None => blob_ref.length,
                Some(_) => blob.data_offset.saturating_add(blob.data_len),
            },
            blob: blob.clone(),
        });
        Ok(())
    }
}

/// The codec of a blob stored with DCP `transform_descriptors` (`None` without any), or
/// [`MetadataError::Unsupported`] naming the file, the entry and the descriptors.
fn transform_codec(
    transforms: &[String],
    path: &Path,
    entry: impl FnOnce() -> String,
) -> Result<Option<Codec>, MetadataError> {
    if transforms.is_empty() {
        return Ok(None);
    }
    Codec::from_dcp_descriptors(transforms)
        .map(Some)
        .map_err(|why| MetadataError::Unsupported {
            path: path.to_string(),
            detail: format!("{} is stored with {why}", entry()),
        })
}

/// The file of the checkpoint model that stands for the decoded bytes of `range`, `visible`
/// bytes of them readable, appended to `files` (every blob is one chunk's or one object's).
fn decoded_file(files: &mut Vec<DataFile>, range: EncodedRange, visible: u64) -> u32 {
    files.push(DataFile {
        path: range.file_name(),
        size: Some(visible),
        encoded: Some(range),
    });
    (files.len() - 1) as u32
}

/// Decodes the encoded object blob `info` of `path` whole and returns its length, refusing one
/// that decodes to more than the metadata cap (objects are small pickles).
async fn decoded_length(
    store: &dyn ObjectStore,
    path: &Path,
    info: &StorageInfo,
    codec: Codec,
    key: &str,
    limits: &pickle::Limits,
) -> Result<u64, MetadataError> {
    let cap = limits.max_input as u64;
    let mut too_long = false;
    let mut sink = |offset: u64, bytes: &[u8]| {
        too_long = offset + bytes.len() as u64 > cap;
        !too_long
    };
    let blob = index::BlobRef {
        path: path.clone(),
        entry: format!("object {key}"),
        offset: info.offset,
        length: info.length,
        encoded: Some(codec),
    };
    let decoded = decode_from_store(
        store,
        path,
        info.offset..info.offset + info.length,
        codec,
        &mut sink,
    )
    .await
    .map_err(|failure| index::decode_error(&blob, codec, failure))?;
    match decoded {
        Some(length) if !too_long => Ok(length),
        _ => Err(index::blob_error(
            &blob,
            format!("decodes to more than the {cap}-byte cap for an object"),
        )),
    }
}

/// Megatron's `metadata.json`, when the listing has one (capped at
/// [`megatron::MAX_CONFIG_BYTES`]); its bytes become part of the checkpoint's identity.
async fn read_megatron_config(
    store: &dyn ObjectStore,
    prefix: &Path,
    listing: &Listing,
    identity: &mut IdentityHasher,
) -> Result<Option<MegatronConfig>, MetadataError> {
    let Some(&size) = listing.files.get(megatron::CONFIG_FILE) else {
        return Ok(None);
    };
    let path = resolve(prefix, megatron::CONFIG_FILE)?;
    if size > megatron::MAX_CONFIG_BYTES {
        return Err(MetadataError::Decode {
            path: path.to_string(),
            what: "Megatron-Core metadata.json",
            detail: format!(
                "{size} bytes exceed the {}-byte cap",
                megatron::MAX_CONFIG_BYTES
            ),
        });
    }
    let bytes = read_whole(store, &path).await?;
    identity.part(megatron::CONFIG_FILE.as_bytes()).part(&bytes);
    megatron::parse_config(&bytes, path.as_ref())
}

/// The stored strides when they are not row-major over `sizes` (dims of extent 1 do not count:
/// their stride never multiplies anything).
fn stored_strides(blob: &TensorBlob, sizes: &[u64]) -> Option<Vec<u64>> {
    if sizes.contains(&0) {
        return None;
    }
    let row_major = row_major_strides(sizes);
    let same = sizes
        .iter()
        .zip(&blob.stride)
        .zip(&row_major)
        .all(|((&n, s), r)| n <= 1 || s == r);
    (!same).then(|| blob.stride.clone())
}

/// Refuses a storage range `info` of `path` (of `size` bytes) that ends past the file, naming the
/// tensor and chunk.
/// Refuses chunks whose blobs share bytes: torch writes every chunk's own `torch.save` blob, so
/// a `.metadata` that points two chunks at one blob (or overlapping ranges) is damaged or forged,
/// and the second chunk would load the first one's values with a valid zip CRC.
fn check_blobs_apart(refs: &[(u32, index::BlobRef)]) -> Result<(), MetadataError> {
    let mut spans: Vec<(u32, u64, u64, usize)> = refs
        .iter()
        .enumerate()
        .map(|(i, (file, r))| (*file, r.offset, r.offset.saturating_add(r.length), i))
        .collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let ((file_a, _, end_a, a), (file_b, start_b, _, b)) = (pair[0], pair[1]);
        if file_a == file_b && start_b < end_a {
            let (first, second) = (&refs[a].1, &refs[b].1);
            return Err(MetadataError::Invalid {
                what: format!(
                    "{}: {} (bytes {}..{}) and {} (bytes {}..{}) point at the same bytes; torch \
                     writes each chunk its own blob, so .metadata is damaged",
                    first.path,
                    first.entry,
                    first.offset,
                    first.offset.saturating_add(first.length),
                    second.entry,
                    second.offset,
                    second.offset.saturating_add(second.length)
                ),
            });
        }
    }
    Ok(())
}

pub(crate) fn check_range(
    fqn: &str,
    region: &str,
    path: &Path,
    info: &StorageInfo,
    size: u64,
) -> Result<(), MetadataError> {
    match info.offset.checked_add(info.length) {
        Some(end) if end <= size => Ok(()),
        end => Err(MetadataError::ByteRangePastEnd {
            fqn: fqn.to_string(),
            region: region.to_string(),
            file: path.to_string(),
            start: info.offset,
            end: end.unwrap_or(u64::MAX),
            size,
        }),
    }
}

/// Combines per-rank metadata files: chunks of a tensor are united (a chunk listed twice counts
/// once), the first listing of an object wins.
fn merge(mut parts: Vec<DcpMetadata>, prefix: &Path) -> Result<DcpMetadata, MetadataError> {
    if parts.len() == 1 {
        return Ok(parts.remove(0));
    }
    let mut out = DcpMetadata::default();
    let mut tensors: HashMap<String, usize> = HashMap::new();
    let mut objects: BTreeSet<String> = BTreeSet::new();
    for part in parts {
        out.version = out.version.or(part.version);
        out.checkpoint_id = out.checkpoint_id.or(part.checkpoint_id);
        out.save_id = out.save_id.or(part.save_id);
        out.pickle_objects += part.pickle_objects;
        out.class = out.class.or(part.class);
        out.mcore = out.mcore.or(part.mcore);
        out.planner_data.extend(part.planner_data);
        for tensor in part.tensors {
            match tensors.get(&tensor.fqn) {
                Some(&t) => {
                    let existing = &mut out.tensors[t];
                    if existing.dtype != tensor.dtype || existing.shape != tensor.shape {
                        return Err(MetadataError::Invalid {
                            what: format!(
                                "{prefix}: the per-rank metadata files disagree on tensor {}: {} {:?} and {} {:?}",
                                tensor.fqn,
                                existing.dtype,
                                existing.shape,
                                tensor.dtype,
                                tensor.shape
                            ),
                        });
                    }
                    for chunk in tensor.chunks {
                        if !existing.chunks.iter().any(|c| c.offsets == chunk.offsets) {
                            existing.chunks.push(chunk);
                        }
                    }
                }
                None => {
                    tensors.insert(tensor.fqn.clone(), out.tensors.len());
                    out.tensors.push(tensor);
                }
            }
        }
        for object in part.objects {
            if objects.insert(object.fqn.clone()) {
                out.objects.push(object);
            }
        }
    }
    Ok(out)
}

/// Elements of a box of `sizes` (saturating: only compared with a byte count).
fn region_numel(sizes: &[u64]) -> u64 {
    sizes.iter().fold(1u64, |n, &s| n.saturating_mul(s))
}
