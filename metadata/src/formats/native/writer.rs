//! Writing a native checkpoint: [`NativeWriter`] owns the tensor list and the commit,
//! [`DataFileWriter`]s stream boxes into data files (several at once, from different tasks), and
//! [`NativeWriter::commit`] validates everything, writes the metadata files and then the manifest.

use std::any::Any;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, WriteMultipart};
use serde::{Deserialize, Serialize};

use super::checksums::{BlockCrcs, block_count};
use super::latest::advance_latest;
use super::manifest::{Created, DataPresence, Manifest, ManifestBlob, ManifestFile};
use super::{
    ALIGNMENT, CHECKSUMS_FILE, DATA_DIR, DEFAULT_BLOCK_SIZE, FORMAT_NAME, FORMAT_VERSION,
    LATEST_FILE, MANIFEST_FILE, METADATA_FILE, store_error,
};
use super::{BlockChecksums, FileBlocks, encode_block_checksums, encode_metadata, resolve};
use crate::{
    ByteMeta, CheckpointMeta, DataFile, MetadataError, ObjectMeta, SavedChunk, TensorBox,
    TensorMeta, shape_to_string, validate,
};

/// Size of one multipart upload part. S3 wants at least 5 MiB per part and at most 10 000 parts
/// (so 8 MiB parts allow files up to ~80 GB there), and some stores want every part but the last
/// of equal size, which fixed-size parts give.
const PART_SIZE: usize = 8 * 1024 * 1024;

/// Parts of one file uploading at once. Memory per data file stays below
/// `(PARTS_IN_FLIGHT + 1) * PART_SIZE` (32 MiB), whatever the file's size, while two or three
/// requests in flight are enough to keep one file's upload busy.
const PARTS_IN_FLIGHT: usize = 3;

const ZEROS: [u8; ALIGNMENT as usize] = [0; ALIGNMENT as usize];

/// Options of a checkpoint save.
#[derive(Clone, Debug, PartialEq)]
pub struct WriteOptions {
    /// Checksum block size in bytes ([`DEFAULT_BLOCK_SIZE`] by default).
    pub block_size: u64,
    /// Training step recorded in the manifest. When `None` and the prefix's last component is
    /// `step-<digits>`, that step is recorded.
    pub step: Option<u64>,
    /// The layout the checkpoint was saved with (layout JSON), recorded in the manifest.
    pub source_layout: Option<serde_json::Value>,
    /// Record where every box would lie without uploading any data (manifest `"data": "absent"`).
    pub metadata_only: bool,
}

impl Default for WriteOptions {
    fn default() -> Self {
        Self {
            block_size: DEFAULT_BLOCK_SIZE,
            step: None,
            source_layout: None,
            metadata_only: false,
        }
    }
}

/// What every data file writer of one checkpoint shares.
#[derive(Debug)]
struct Shared {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    tensors: Vec<TensorMeta>,
    options: WriteOptions,
    names: Mutex<HashSet<String>>,
}

/// Writes one checkpoint under a prefix: hands out [`DataFileWriter`]s, then commits.
///
/// One writer per prefix: two processes committing the same prefix at once are not supported
/// (the manifest is created exclusively, but the metadata files before it are not).
#[derive(Debug)]
pub struct NativeWriter {
    shared: Arc<Shared>,
}

impl NativeWriter {
    /// Starts a checkpoint of `tensors` at `prefix`. Refuses a prefix that already holds a
    /// committed checkpoint (a manifest), duplicate FQNs, and tensors whose byte size overflows.
    pub async fn create(
        store: Arc<dyn ObjectStore>,
        prefix: Path,
        tensors: Vec<TensorMeta>,
        options: WriteOptions,
    ) -> Result<Self, MetadataError> {
        if options.block_size == 0 {
            return Err(MetadataError::Invalid {
                what: "block size 0".to_string(),
            });
        }
        if u32::try_from(tensors.len()).is_err() {
            return Err(MetadataError::Invalid {
                what: format!("{} tensors, more than 2^32", tensors.len()),
            });
        }
        let mut fqns = HashSet::with_capacity(tensors.len());
        for tensor in &tensors {
            if !fqns.insert(tensor.fqn.as_str()) {
                return Err(MetadataError::Invalid {
                    what: format!("tensor {} is listed twice", tensor.fqn),
                });
            }
            let bytes = tensor
                .shape
                .iter()
                .try_fold(tensor.dtype.size(), |acc, &d| acc.checked_mul(d));
            if bytes.is_none() {
                return Err(MetadataError::Invalid {
                    what: format!(
                        "tensor {}: {} elements of {} overflow 64-bit byte counts",
                        tensor.fqn,
                        shape_to_string(&tensor.shape),
                        tensor.dtype
                    ),
                });
            }
        }
        refuse_committed(store.as_ref(), &prefix).await?;
        Ok(Self {
            shared: Arc::new(Shared {
                store,
                prefix,
                tensors,
                options,
                names: Mutex::new(HashSet::new()),
            }),
        })
    }

    /// The checkpoint's tensors; `write_box` refers to them by index.
    pub fn tensors(&self) -> &[TensorMeta] {
        &self.shared.tensors
    }

    /// The checkpoint prefix.
    pub fn prefix(&self) -> &Path {
        &self.shared.prefix
    }

    /// Opens the data file `data/<name>.bin`. `name` is ASCII letters, digits, `-`, `_` and `.`
    /// (not first), and each name is open at most once at a time per writer: a name is free again
    /// when its [`DataFileWriter`] is dropped or aborted without finishing, so a caller that holds
    /// the bytes can write a failed file again from the start. The returned writer owns what it
    /// needs, so several can be written concurrently from different tasks.
    pub fn data_file(&self, name: &str) -> Result<DataFileWriter, MetadataError> {
        let valid = !name.is_empty()
            && name.len() <= 200
            && !name.starts_with('.')
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
        if !valid {
            return Err(MetadataError::Invalid {
                what: format!(
                    "data file name {name:?}: use 1 to 200 ASCII letters, digits, '-', '_' or '.', not starting with '.'"
                ),
            });
        }
        {
            let mut names = self
                .shared
                .names
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            if !names.insert(name.to_string()) {
                return Err(MetadataError::Invalid {
                    what: format!("data file {name} is already open in this checkpoint"),
                });
            }
        }
        let relative = format!("{DATA_DIR}/{name}.bin");
        let path = resolve(&self.shared.prefix, &relative)?;
        Ok(DataFileWriter {
            shared: self.shared.clone(),
            relative,
            path,
            len: 0,
            blocks: BlockCrcs::new(self.shared.options.block_size),
            buf: Vec::new(),
            upload: None,
            memory: None,
            chunks: Vec::new(),
            objects: Vec::new(),
            failed: false,
            finished: false,
        })
    }

    /// [`Self::data_file`] laid out in memory instead of the store (a live publication serves
    /// it from there): the bytes are copied once, into a buffer of `capacity` bytes reserved up
    /// front (the file grows past it if needed), and [`DataFileWriter::finish_in_memory`] hands
    /// them back with what the commit needs.
    pub fn data_file_in_memory(
        &self,
        name: &str,
        capacity: usize,
    ) -> Result<DataFileWriter, MetadataError> {
        self.data_file_into(name, Box::new(Vec::<u8>::with_capacity(capacity)))
    }

    /// [`Self::data_file`] laid out into `sink` instead of the store (a live publication's
    /// shared memory): every byte is appended to it once, in order, and
    /// [`DataFileWriter::finish_into`] hands it back with what the commit needs.
    pub fn data_file_into(
        &self,
        name: &str,
        sink: Box<dyn MemorySink>,
    ) -> Result<DataFileWriter, MetadataError> {
        let mut file = self.data_file(name)?;
        file.memory = Some(sink);
        Ok(file)
    }

    /// Commits the checkpoint made of `files` (from [`DataFileWriter::finish`], possibly of
    /// writers on other hosts): assembles and validates the metadata, writes `metadata.arrow`,
    /// `checksums.arrow`, then `manifest.json` last, then moves `<run>/latest` forward when the
    /// prefix is a `step-<digits>` directory. When validation fails nothing is committed (the data
    /// files stay behind as garbage of an incomplete save). [`Self::prepare`] and
    /// [`PreparedCommit::commit`] are the two halves, for a caller that decides between them.
    pub async fn commit(self, files: Vec<WrittenFile>) -> Result<Manifest, MetadataError> {
        self.prepare(files).await?.commit().await
    }

    /// Everything of [`Self::commit`] before its commit point: assembles and validates the
    /// metadata, writes `metadata.arrow` and `checksums.arrow`, and builds the manifest. Nothing
    /// is committed yet: dropping the result leaves the directory without a manifest, an
    /// incomplete save that no reader opens.
    pub async fn prepare(self, files: Vec<WrittenFile>) -> Result<PreparedCommit, MetadataError> {
        let shared = &self.shared;
        let options = &shared.options;
        let meta = assemble(&shared.tensors, options, &files)?;
        validate(&meta)?;
        let store = shared.store.as_ref();
        let prefix = &shared.prefix;
        refuse_committed(store, prefix).await?;

        let metadata = encode_metadata(&meta)?;
        let metadata_blob = put_blob(store, prefix, METADATA_FILE, metadata).await?;
        let checksums_blob = if options.metadata_only {
            None
        } else {
            let blocks = files
                .iter()
                .map(|f| FileBlocks {
                    path: f.path.clone(),
                    size: f.size,
                    crcs: f.block_crcs.clone(),
                })
                .collect();
            let checksums = BlockChecksums::new(options.block_size, blocks)?;
            let bytes = encode_block_checksums(&checksums)?;
            Some(put_blob(store, prefix, CHECKSUMS_FILE, bytes).await?)
        };
        let step = options.step.or_else(|| {
            prefix
                .filename()
                .and_then(super::latest::step_from_dir_name)
        });
        let manifest = Manifest {
            format: FORMAT_NAME.to_string(),
            format_version: FORMAT_VERSION,
            step,
            created: Created::now(),
            source_layout: options.source_layout.clone(),
            data: if options.metadata_only {
                DataPresence::Absent
            } else {
                DataPresence::Present
            },
            block_size: options.block_size,
            files: files
                .iter()
                .map(|f| ManifestFile {
                    path: f.path.clone(),
                    size: f.size,
                })
                .collect(),
            metadata: metadata_blob,
            checksums: checksums_blob,
            tensors: meta.tensors().len() as u64,
            chunks: meta.chunks().len() as u64,
            objects: meta.objects().len() as u64,
            tensor_bytes: meta.tensor_bytes(),
        };
        let json = manifest.to_json()?;
        Ok(PreparedCommit {
            store: shared.store.clone(),
            prefix: prefix.clone(),
            manifest,
            json,
        })
    }
}

/// A checkpoint whose data and metadata files are written, one step from committed: what
/// [`NativeWriter::prepare`] returns. [`Self::commit`] writes the manifest (the commit point);
/// dropping it commits nothing.
#[derive(Debug)]
pub struct PreparedCommit {
    store: Arc<dyn ObjectStore>,
    prefix: Path,
    manifest: Manifest,
    /// The manifest as it will be written, encoded before the commit point so that an encoding
    /// failure cannot come after it.
    json: Vec<u8>,
}

impl PreparedCommit {
    /// The manifest [`Self::commit`] writes.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The commit point: writes `manifest.json` (created exclusively), then moves `<run>/latest`
    /// forward when the prefix is a `step-<digits>` directory. When the manifest is written but
    /// `latest` is not, the error is [`MetadataError::LatestNotMoved`]: the checkpoint is
    /// committed all the same, and a caller must not take it for a failed save.
    pub async fn commit(self) -> Result<Manifest, MetadataError> {
        let store = self.store.as_ref();
        let path = self.prefix.clone().join(MANIFEST_FILE);
        // Created exclusively: of two commits racing for one prefix, only one manifest wins.
        store
            .put_opts(
                &path,
                PutPayload::from(self.json),
                PutOptions::from(PutMode::Create),
            )
            .await
            .map_err(store_error("committing", &path))?;
        if let Err(source) = advance_latest(store, &self.prefix).await {
            let parent = self.prefix.parent().unwrap_or_default();
            return Err(MetadataError::LatestNotMoved {
                checkpoint: self.prefix.to_string(),
                latest: parent.join(LATEST_FILE).to_string(),
                source: Box::new(source),
            });
        }
        Ok(self.manifest)
    }
}

/// Errors when `prefix` already holds a manifest.
async fn refuse_committed(store: &dyn ObjectStore, prefix: &Path) -> Result<(), MetadataError> {
    let path = prefix.clone().join(MANIFEST_FILE);
    match store.head(&path).await {
        Ok(_) => Err(MetadataError::AlreadyCommitted {
            prefix: prefix.to_string(),
            manifest: path.to_string(),
        }),
        Err(object_store::Error::NotFound { .. }) => Ok(()),
        Err(e) => Err(store_error("checking", &path)(e)),
    }
}

async fn put_blob(
    store: &dyn ObjectStore,
    prefix: &Path,
    name: &str,
    bytes: Vec<u8>,
) -> Result<ManifestBlob, MetadataError> {
    let path = prefix.clone().join(name);
    let blob = ManifestBlob {
        path: name.to_string(),
        size: bytes.len() as u64,
        crc32c: crc32c::crc32c(&bytes),
    };
    store
        .put(&path, PutPayload::from(bytes))
        .await
        .map_err(store_error("writing", &path))?;
    Ok(blob)
}

/// Builds the checkpoint's metadata from the written files, checking that they belong together.
fn assemble(
    tensors: &[TensorMeta],
    options: &WriteOptions,
    files: &[WrittenFile],
) -> Result<CheckpointMeta, MetadataError> {
    let invalid = |what: String| MetadataError::Invalid { what };
    if u32::try_from(files.len()).is_err() {
        return Err(invalid(format!(
            "{} data files, more than 2^32",
            files.len()
        )));
    }
    let mut paths = HashSet::with_capacity(files.len());
    let mut keys = HashSet::new();
    let mut data_files = Vec::with_capacity(files.len());
    let mut chunks = Vec::with_capacity(files.iter().map(|f| f.chunks.len()).sum());
    let mut objects = Vec::new();
    for (i, file) in files.iter().enumerate() {
        let path = &file.path;
        if !paths.insert(path.as_str()) {
            return Err(invalid(format!("data file {path} is committed twice")));
        }
        if file.block_size != options.block_size {
            return Err(invalid(format!(
                "data file {path} was written with block size {}, the checkpoint uses {}",
                file.block_size, options.block_size
            )));
        }
        if file.data_written == options.metadata_only {
            return Err(invalid(format!(
                "data file {path}: {} in a {} checkpoint",
                if file.data_written {
                    "written"
                } else {
                    "metadata only"
                },
                if options.metadata_only {
                    "metadata-only"
                } else {
                    "data"
                }
            )));
        }
        if file.data_written
            && file.block_crcs.len() as u64 != block_count(file.size, file.block_size)
        {
            return Err(invalid(format!(
                "data file {path}: {} block checksums for {} bytes",
                file.block_crcs.len(),
                file.size
            )));
        }
        let index = i as u32;
        data_files.push(DataFile {
            path: path.clone(),
            size: Some(file.size),
            encoded: None,
        });
        chunks.extend(file.chunks.iter().map(|c| SavedChunk {
            bytes: ByteMeta {
                file: index,
                ..c.bytes.clone()
            },
            ..c.clone()
        }));
        for object in &file.objects {
            if !keys.insert(object.key.as_str()) {
                return Err(invalid(format!("object {} is written twice", object.key)));
            }
            objects.push(ObjectMeta {
                file: index,
                ..object.clone()
            });
        }
    }
    let meta = CheckpointMeta::new(tensors.to_vec(), chunks, objects, data_files)?;
    for (t, tensor) in tensors.iter().enumerate() {
        if meta.chunks_of(t as u32).is_empty() {
            return Err(invalid(format!(
                "tensor {} has no saved box (write an empty box for a tensor nobody holds)",
                tensor.fqn
            )));
        }
    }
    Ok(meta)
}

/// A data file of a checkpoint that has been written (or, for metadata-only checkpoints, laid
/// out): what [`NativeWriter::commit`] needs from it. Serializable so that writers on other hosts
/// can send it to the committing one.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WrittenFile {
    path: String,
    size: u64,
    block_size: u64,
    data_written: bool,
    block_crcs: Vec<u32>,
    chunks: Vec<SavedChunk>,
    objects: Vec<ObjectMeta>,
}

impl WrittenFile {
    /// Path relative to the checkpoint root (`data/<name>.bin`).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Whether bytes were uploaded (false for metadata-only checkpoints).
    pub fn data_written(&self) -> bool {
        self.data_written
    }

    /// Renumbers the chunks' tensors for a commit whose tensor list differs from the writer's
    /// that wrote this file (a live publication's ranks each write theirs with the tensors they
    /// hold; the step lists every rank's): `to` gives a chunk's new tensor index, or `None` to
    /// leave the chunk out (a replica another rank's file holds too). The bytes, and so the
    /// block checksums, stay as written.
    pub fn reindex_chunks(&mut self, mut to: impl FnMut(&SavedChunk) -> Option<u32>) {
        self.chunks = std::mem::take(&mut self.chunks)
            .into_iter()
            .filter_map(|mut chunk| {
                chunk.tensor = to(&chunk)?;
                Some(chunk)
            })
            .collect();
    }

    /// crc32c of every checksum block (empty when no data was written).
    pub fn block_crcs(&self) -> &[u32] {
        &self.block_crcs
    }

    /// The boxes in this file. Their `bytes.file` is 0 until commit numbers the files.
    pub fn chunks(&self) -> &[SavedChunk] {
        &self.chunks
    }

    /// The objects in this file. Their `file` is 0 until commit numbers the files.
    pub fn objects(&self) -> &[ObjectMeta] {
        &self.objects
    }
}

/// Memory a data file is laid out into instead of the store ([`NativeWriter::data_file_into`]):
/// appended to in order, then handed back whole ([`DataFileWriter::finish_into`]).
pub trait MemorySink: Send + Sync + std::fmt::Debug + 'static {
    /// Appends `data` at the end.
    fn append(&mut self, data: &[u8]) -> std::io::Result<()>;
    /// Itself, for [`DataFileWriter::finish_into`] to hand back as its own type.
    fn into_any(self: Box<Self>) -> Box<dyn Any>;
}

impl MemorySink for Vec<u8> {
    fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.extend_from_slice(data);
        Ok(())
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}

/// Streams boxes and objects into one data file, `data/<name>.bin`, 4 KiB aligned, computing box
/// and block checksums on the way. Bytes go to the store in multipart parts as they accumulate, so
/// memory stays bounded for files of any size; a file that stays below one part is put in one
/// request. Drop without [`Self::finish`] (or call [`Self::abort`]) to abandon the file.
#[derive(Debug)]
pub struct DataFileWriter {
    shared: Arc<Shared>,
    relative: String,
    path: Path,
    len: u64,
    blocks: BlockCrcs,
    buf: Vec<u8>,
    upload: Option<WriteMultipart>,
    /// The file is laid out here whole and handed back by [`DataFileWriter::finish_into`],
    /// never sent to the store.
    memory: Option<Box<dyn MemorySink>>,
    chunks: Vec<SavedChunk>,
    objects: Vec<ObjectMeta>,
    /// A store error happened mid-file; the file's content is unknown, so it cannot be finished.
    failed: bool,
    /// `finish` succeeded: the name stays taken (the file is part of the checkpoint).
    finished: bool,
}

impl Drop for DataFileWriter {
    fn drop(&mut self) {
        // An abandoned file frees its name: writing it again overwrites what this one uploaded
        // (a new upload to the same path), and only a finished file reaches the commit.
        if !self.finished {
            let name = self
                .relative
                .strip_prefix(&format!("{DATA_DIR}/"))
                .and_then(|n| n.strip_suffix(".bin"))
                .unwrap_or(&self.relative);
            self.shared
                .names
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .remove(name);
        }
    }
}

impl DataFileWriter {
    /// Path of the file relative to the checkpoint root.
    pub fn path(&self) -> &str {
        &self.relative
    }

    /// Bytes written (or laid out) so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True when nothing has been written yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends the box `region` of tensor `tensor` (an index into [`NativeWriter::tensors`]).
    /// `bytes` are the box's elements, row-major, little-endian, exactly `numel * dtype size` of
    /// them. In a metadata-only checkpoint the bytes are checked and dropped.
    pub async fn write_box(
        &mut self,
        tensor: u32,
        region: TensorBox,
        bytes: &[u8],
    ) -> Result<(), MetadataError> {
        self.usable()?;
        let expected = self.box_bytes(tensor, &region)?;
        if bytes.len() as u64 != expected {
            let meta = &self.shared.tensors[tensor as usize];
            return Err(MetadataError::ByteLengthMismatch {
                fqn: meta.fqn.clone(),
                region: region.to_string(),
                numel: region.numel(),
                dtype: meta.dtype.to_string(),
                expected,
                actual: bytes.len() as u64,
            });
        }
        let (offset, crc32c) = self.place(bytes).await?;
        self.record_box(tensor, region, offset, expected, crc32c);
        Ok(())
    }

    /// Appends elements `[start, end)` of the row-major flattening of the box `parent` of tensor
    /// `tensor`: a flat-range chunk, the way Megatron's distributed optimizer or ZeRO save a
    /// rank's share of a parameter. `bytes` are those elements in flat order, little-endian,
    /// exactly `(end - start) * dtype size` of them; they are written contiguously (one 4 KiB
    /// aligned entry) and recorded as the at most 2·ndim − 1 boxes that tile the range
    /// ([`crate::flat_range_of_box`]), each with the crc32c of its own bytes. So readers, the
    /// planner, the loader and `verify` see ordinary boxes, and a load that wants only part of
    /// the range reads only that part. An empty range records nothing.
    pub async fn write_flat(
        &mut self,
        tensor: u32,
        parent: TensorBox,
        start: u64,
        end: u64,
        bytes: &[u8],
    ) -> Result<(), MetadataError> {
        self.usable()?;
        let tiles = self.flat_tiles(tensor, &parent, start, end)?;
        let meta = &self.shared.tensors[tensor as usize];
        let esize = meta.dtype.size();
        // Inside the parent box, which lies inside the tensor: no overflow.
        let expected = (end - start) * esize;
        if bytes.len() as u64 != expected {
            return Err(MetadataError::ByteLengthMismatch {
                fqn: meta.fqn.clone(),
                region: format!("{parent} flat {start}..{end}"),
                numel: end - start,
                dtype: meta.dtype.to_string(),
                expected,
                actual: bytes.len() as u64,
            });
        }
        if tiles.is_empty() {
            return Ok(());
        }
        let offset = self.place_bytes(bytes).await?;
        let with_data = !self.shared.options.metadata_only;
        for (at, region) in tiles {
            let (lo, length) = (at * esize, region.numel() * esize);
            // Each tile is its own row (box) in the metadata, so each gets its own checksum: a
            // partial load checks the tiles it reads whole.
            let crc32c =
                with_data.then(|| crc32c::crc32c(&bytes[lo as usize..(lo + length) as usize]));
            self.record_box(tensor, region, offset + lo, length, crc32c);
        }
        Ok(())
    }

    /// Records the flat range `[start, end)` of the box `parent` of tensor `tensor` (see
    /// [`Self::write_flat`]) at the place its bytes would have, without bytes: for
    /// metadata-only checkpoints.
    pub fn write_flat_metadata_only(
        &mut self,
        tensor: u32,
        parent: TensorBox,
        start: u64,
        end: u64,
    ) -> Result<(), MetadataError> {
        self.usable()?;
        self.require_metadata_only("write_flat_metadata_only")?;
        let tiles = self.flat_tiles(tensor, &parent, start, end)?;
        if tiles.is_empty() {
            return Ok(());
        }
        let esize = self.shared.tensors[tensor as usize].dtype.size();
        let offset = self.lay_out((end - start) * esize);
        for (at, region) in tiles {
            let length = region.numel() * esize;
            self.record_box(tensor, region, offset + at * esize, length, None);
        }
        Ok(())
    }

    /// Checks a flat range of a box of a tensor and returns the boxes that tile it, each with its
    /// first element's position in the range.
    fn flat_tiles(
        &self,
        tensor: u32,
        parent: &TensorBox,
        start: u64,
        end: u64,
    ) -> Result<Vec<(u64, TensorBox)>, MetadataError> {
        self.box_bytes(tensor, parent)?;
        let numel = parent.numel();
        if start > end || end > numel {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{}: tensor {}: flat range {start}..{end} of box {parent} does not lie in its {numel} elements",
                    self.relative, self.shared.tensors[tensor as usize].fqn
                ),
            });
        }
        Ok(crate::flat_range_of_box(parent, start, end))
    }

    /// Puts `bytes` at the next aligned offset (in a metadata-only checkpoint only reserves their
    /// length); returns where they start and their crc32c (none without data).
    async fn place(&mut self, bytes: &[u8]) -> Result<(u64, Option<u32>), MetadataError> {
        let offset = self.place_bytes(bytes).await?;
        let crc32c = (!self.shared.options.metadata_only).then(|| crc32c::crc32c(bytes));
        Ok((offset, crc32c))
    }

    /// Puts `bytes` at the next aligned offset (in a metadata-only checkpoint only reserves their
    /// length); returns where they start.
    async fn place_bytes(&mut self, bytes: &[u8]) -> Result<u64, MetadataError> {
        let length = bytes.len() as u64;
        if self.shared.options.metadata_only {
            return Ok(self.lay_out(length));
        }
        // An empty entry takes no byte, so it needs no alignment (and adds no padding).
        let offset = if length == 0 {
            self.len
        } else {
            self.align().await?
        };
        self.append(bytes).await?;
        Ok(offset)
    }

    fn record_box(
        &mut self,
        tensor: u32,
        region: TensorBox,
        offset: u64,
        length: u64,
        crc32c: Option<u32>,
    ) {
        self.chunks.push(SavedChunk {
            tensor,
            region,
            bytes: ByteMeta {
                file: 0,
                offset,
                length,
                strides: None,
            },
            crc32c,
            crc32: None,
        });
    }

    /// Records the box `region` of tensor `tensor` at the place its bytes would have, without
    /// bytes: for metadata-only checkpoints (see [`WriteOptions::metadata_only`]).
    pub fn write_box_metadata_only(
        &mut self,
        tensor: u32,
        region: TensorBox,
    ) -> Result<(), MetadataError> {
        self.usable()?;
        self.require_metadata_only("write_box_metadata_only")?;
        let length = self.box_bytes(tensor, &region)?;
        let offset = self.lay_out(length);
        self.record_box(tensor, region, offset, length, None);
        Ok(())
    }

    fn require_metadata_only(&self, call: &str) -> Result<(), MetadataError> {
        if !self.shared.options.metadata_only {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{}: {call} in a checkpoint that stores data (set WriteOptions::metadata_only)",
                    self.relative
                ),
            });
        }
        Ok(())
    }

    /// Appends a non-tensor object (config, RNG state, step counter) under `key`.
    pub async fn write_object(&mut self, key: &str, bytes: &[u8]) -> Result<(), MetadataError> {
        self.usable()?;
        if key.is_empty() {
            return Err(MetadataError::Invalid {
                what: format!("{}: an object needs a non-empty key", self.relative),
            });
        }
        let length = bytes.len() as u64;
        let (offset, crc32c) = self.place(bytes).await?;
        self.objects.push(ObjectMeta {
            key: key.to_string(),
            file: 0,
            offset,
            length,
            crc32c,
        });
        Ok(())
    }

    /// The whole file of a writer from [`NativeWriter::data_file_in_memory`] and what the commit
    /// needs.
    pub fn finish_in_memory(self) -> Result<(Bytes, WrittenFile), MetadataError> {
        let (buffer, written) = self.finish_into::<Vec<u8>>()?;
        Ok((Bytes::from(buffer), written))
    }

    /// The sink of a writer from [`NativeWriter::data_file_into`] (of type `S`), holding the
    /// whole file, and what the commit needs.
    pub fn finish_into<S: MemorySink>(mut self) -> Result<(S, WrittenFile), MetadataError> {
        self.usable()?;
        let Some(sink) = self.memory.take() else {
            return Err(MetadataError::Invalid {
                what: format!("{}: not laid out in memory", self.relative),
            });
        };
        let Ok(sink) = sink.into_any().downcast::<S>() else {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{}: laid out into another kind of memory than asked for",
                    self.relative
                ),
            });
        };
        let data_written = !self.shared.options.metadata_only;
        Ok((*sink, self.written(data_written)))
    }

    /// Completes the upload and returns what the commit needs.
    pub async fn finish(mut self) -> Result<WrittenFile, MetadataError> {
        self.usable()?;
        if self.memory.is_some() {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{}: laid out in memory; finish it with finish_in_memory",
                    self.relative
                ),
            });
        }
        let data_written = !self.shared.options.metadata_only;
        if data_written {
            let buf = Bytes::from(std::mem::take(&mut self.buf));
            match self.upload.take() {
                None => {
                    self.shared
                        .store
                        .put(&self.path, PutPayload::from(buf))
                        .await
                        .map_err(store_error("writing", &self.path))?;
                }
                Some(mut upload) => {
                    upload.put(buf);
                    upload
                        .finish()
                        .await
                        .map_err(store_error("completing the upload of", &self.path))?;
                }
            }
        }
        Ok(self.written(data_written))
    }

    /// What the commit needs of the finished file; marks it finished.
    fn written(&mut self, data_written: bool) -> WrittenFile {
        let block_size = self.shared.options.block_size;
        let block_crcs = if data_written {
            std::mem::replace(&mut self.blocks, BlockCrcs::new(block_size)).finish()
        } else {
            Vec::new()
        };
        self.finished = true;
        WrittenFile {
            path: self.relative.clone(),
            size: self.len,
            block_size,
            data_written,
            block_crcs,
            chunks: std::mem::take(&mut self.chunks),
            objects: std::mem::take(&mut self.objects),
        }
    }

    /// Abandons the file, cleaning up uploaded parts where the store supports it.
    pub async fn abort(mut self) -> Result<(), MetadataError> {
        if let Some(upload) = self.upload.take() {
            upload
                .abort()
                .await
                .map_err(store_error("aborting the upload of", &self.path))?;
        }
        Ok(())
    }

    fn usable(&self) -> Result<(), MetadataError> {
        if self.failed {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{}: an earlier write failed, so the file cannot be continued",
                    self.relative
                ),
            });
        }
        Ok(())
    }

    /// Checks `region` against tensor `tensor` and returns its byte length.
    fn box_bytes(&self, tensor: u32, region: &TensorBox) -> Result<u64, MetadataError> {
        let tensors = &self.shared.tensors;
        let Some(meta) = tensors.get(tensor as usize) else {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{}: box {region} refers to tensor #{tensor} but there are {} tensors",
                    self.relative,
                    tensors.len()
                ),
            });
        };
        if region.offsets.len() != meta.shape.len() || region.lengths.len() != meta.shape.len() {
            return Err(MetadataError::RankMismatch {
                fqn: meta.fqn.clone(),
                // Display needs as many offsets as lengths; say what was given otherwise.
                region: if region.offsets.len() == region.lengths.len() {
                    region.to_string()
                } else {
                    format!("offsets {:?} lengths {:?}", region.offsets, region.lengths)
                },
                ndim: meta.shape.len(),
            });
        }
        for (dim, &size) in meta.shape.iter().enumerate() {
            let start = region.offsets[dim];
            let end = start.checked_add(region.lengths[dim]);
            if end.is_none_or(|end| end > size) {
                return Err(MetadataError::BoxOutsideShape {
                    fqn: meta.fqn.clone(),
                    region: region.to_string(),
                    shape: shape_to_string(&meta.shape),
                    dim,
                    start,
                    end: end.unwrap_or(u64::MAX),
                    size,
                });
            }
        }
        // Inside the shape, whose byte size was checked at create: no overflow.
        Ok(region.numel() * meta.dtype.size())
    }

    /// Offset for `length` bytes laid out without data (metadata-only): aligned like real data.
    fn lay_out(&mut self, length: u64) -> u64 {
        if length > 0 {
            self.len = self.len.next_multiple_of(ALIGNMENT);
        }
        let offset = self.len;
        self.len += length;
        offset
    }

    /// Pads with zeros to the next 4 KiB boundary and returns it.
    async fn align(&mut self) -> Result<u64, MetadataError> {
        let pad = (self.len.next_multiple_of(ALIGNMENT) - self.len) as usize;
        self.append(&ZEROS[..pad]).await?;
        Ok(self.len)
    }

    async fn append(&mut self, data: &[u8]) -> Result<(), MetadataError> {
        self.blocks.update(data);
        self.len += data.len() as u64;
        if let Some(sink) = &mut self.memory {
            if let Err(e) = sink.append(data) {
                self.failed = true;
                return Err(MetadataError::Invalid {
                    what: format!("{}: laying it out in memory: {e}", self.relative),
                });
            }
            return Ok(());
        }
        let mut rest = data;
        while !rest.is_empty() {
            let take = rest.len().min(PART_SIZE - self.buf.len());
            let (head, tail) = rest.split_at(take);
            self.buf.extend_from_slice(head);
            rest = tail;
            if self.buf.len() == PART_SIZE
                && let Err(e) = self.flush_part().await
            {
                self.failed = true;
                return Err(e);
            }
        }
        Ok(())
    }

    /// Hands one full part to the multipart upload (starting it on the first part), after
    /// waiting until fewer than [`PARTS_IN_FLIGHT`] parts are uploading.
    async fn flush_part(&mut self) -> Result<(), MetadataError> {
        let upload = match &mut self.upload {
            Some(upload) => upload,
            None => {
                let upload = self
                    .shared
                    .store
                    .put_multipart(&self.path)
                    .await
                    .map_err(store_error("starting the upload of", &self.path))?;
                self.upload
                    .insert(WriteMultipart::new_with_chunk_size(upload, PART_SIZE))
            }
        };
        upload
            .wait_for_capacity(PARTS_IN_FLIGHT)
            .await
            .map_err(store_error("uploading", &self.path))?;
        let part = std::mem::replace(&mut self.buf, Vec::with_capacity(PART_SIZE));
        upload.put(Bytes::from(part));
        Ok(())
    }
}
