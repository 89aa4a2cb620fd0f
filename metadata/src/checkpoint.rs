//! The global metadata of one checkpoint: tensors, their saved boxes, where each box's bytes live,
//! and non-tensor objects. Format readers (native, DCP, safetensors) all produce this.

use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::encoded::EncodedRange;

use crate::{MetadataError, TensorBox, TensorMeta, row_major_strides};

/// Where a saved box's elements live.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ByteMeta {
    /// Index into [`CheckpointMeta::files`].
    pub file: u32,
    /// Byte offset of the box's first element (its origin) in the file.
    pub offset: u64,
    /// Bytes of the stored box.
    pub length: u64,
    /// Element strides of the stored box; `None` means row-major over the box's lengths, which
    /// is what tessera writes. DCP may store non-contiguous views (e.g. a transposed weight).
    pub strides: Option<Vec<u64>>,
}

impl ByteMeta {
    /// Element strides of a stored box with `lengths`, row-major unless said otherwise.
    pub fn strides_for(&self, lengths: &[u64]) -> Vec<u64> {
        match &self.strides {
            Some(strides) => strides.clone(),
            None => row_major_strides(lengths),
        }
    }
}

/// One saved box of one tensor: which part of the tensor, and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SavedChunk {
    /// Index into [`CheckpointMeta::tensors`].
    pub tensor: u32,
    /// The part of the tensor this chunk holds.
    pub region: TensorBox,
    /// Where its bytes are.
    pub bytes: ByteMeta,
    /// crc32c of the chunk's bytes when the format records one.
    pub crc32c: Option<u32>,
    /// CRC-32 (IEEE, zip's) of exactly the chunk's stored bytes when the format records one and
    /// not a crc32c: a DCP blob's zip entry, when its storage is the chunk's bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crc32: Option<u32>,
}

/// The checksum a format records over exactly one saved box's stored bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BoxChecksum {
    /// crc32c (Castagnoli): tessera's native format, ByteCheckpoint.
    Crc32c(u32),
    /// CRC-32 (IEEE): the zip entry of a DCP `torch.save` blob.
    Crc32(u32),
}

impl BoxChecksum {
    /// The recorded value.
    pub fn value(self) -> u32 {
        match self {
            BoxChecksum::Crc32c(v) | BoxChecksum::Crc32(v) => v,
        }
    }

    /// The algorithm's name, as messages show it.
    pub fn algorithm(self) -> &'static str {
        match self {
            BoxChecksum::Crc32c(_) => "crc32c",
            BoxChecksum::Crc32(_) => "CRC-32",
        }
    }
}

impl SavedChunk {
    /// The checksum recorded over exactly this box's stored bytes, if any (crc32c first).
    pub fn checksum(&self) -> Option<BoxChecksum> {
        self.crc32c
            .map(BoxChecksum::Crc32c)
            .or(self.crc32.map(BoxChecksum::Crc32))
    }
}

/// A non-tensor entry (step counters, configs, RNG states): an opaque byte range.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ObjectMeta {
    /// Flattened key, e.g. `extra.config`.
    pub key: String,
    /// Index into [`CheckpointMeta::files`].
    pub file: u32,
    /// Byte offset in the file.
    pub offset: u64,
    /// Byte length.
    pub length: u64,
    /// crc32c of the bytes when the format records one.
    pub crc32c: Option<u32>,
}

/// A data file of the checkpoint, path relative to the checkpoint directory.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct DataFile {
    /// Path relative to the checkpoint root, `/`-separated.
    pub path: String,
    /// Size in bytes; `None` when not known without a listing. For an encoded file, the bytes
    /// of its decoded stream that can be read (see [`EncodedRange::visible`]).
    pub size: Option<u64>,
    /// Set when this "file" is not a file but the decoded bytes of an encoded byte range of
    /// one (a DCP blob saved compressed): `path` is then a name no real file has
    /// ([`EncodedRange::file_name`]), and reads of it go through a decoding view of the store.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoded: Option<EncodedRange>,
}

/// The global metadata of one checkpoint. Chunks are kept grouped by tensor so that a tensor's
/// chunks are one slice.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CheckpointMeta {
    tensors: Vec<TensorMeta>,
    chunks: Vec<SavedChunk>,
    chunk_ranges: Vec<Range<usize>>,
    objects: Vec<ObjectMeta>,
    files: Vec<DataFile>,
    identity: Option<String>,
}

impl CheckpointMeta {
    /// Assembles metadata, checking that every index points somewhere. Chunks are sorted by
    /// tensor (stable, so the order of a tensor's chunks is kept). Use [`crate::validate`] for the
    /// geometric checks (bounds, overlaps, holes, byte lengths).
    pub fn new(
        tensors: Vec<TensorMeta>,
        mut chunks: Vec<SavedChunk>,
        objects: Vec<ObjectMeta>,
        files: Vec<DataFile>,
    ) -> Result<Self, MetadataError> {
        for chunk in &chunks {
            let Some(tensor) = tensors.get(chunk.tensor as usize) else {
                return Err(MetadataError::Invalid {
                    what: format!(
                        "saved chunk {} refers to tensor #{} but there are {} tensors",
                        chunk.region,
                        chunk.tensor,
                        tensors.len()
                    ),
                });
            };
            if chunk.region.ndim() != tensor.shape.len() {
                return Err(MetadataError::RankMismatch {
                    fqn: tensor.fqn.clone(),
                    region: chunk.region.to_string(),
                    ndim: tensor.shape.len(),
                });
            }
            if chunk.bytes.file as usize >= files.len() {
                return Err(MetadataError::Invalid {
                    what: format!(
                        "tensor {}: chunk {} refers to file #{} but there are {} files",
                        tensor.fqn,
                        chunk.region,
                        chunk.bytes.file,
                        files.len()
                    ),
                });
            }
        }
        for object in &objects {
            if object.file as usize >= files.len() {
                return Err(MetadataError::Invalid {
                    what: format!(
                        "object {} refers to file #{} but there are {} files",
                        object.key,
                        object.file,
                        files.len()
                    ),
                });
            }
        }
        chunks.sort_by_key(|c| c.tensor);
        let mut chunk_ranges = vec![0..0; tensors.len()];
        let mut start = 0;
        while start < chunks.len() {
            let tensor = chunks[start].tensor;
            let end = start + chunks[start..].partition_point(|c| c.tensor == tensor);
            chunk_ranges[tensor as usize] = start..end;
            start = end;
        }
        Ok(Self {
            tensors,
            chunks,
            chunk_ranges,
            objects,
            files,
            identity: None,
        })
    }

    /// The same metadata stamped with the identity of the checkpoint it was read from (format
    /// readers call this; see [`Self::identity`]).
    pub fn with_identity(mut self, identity: String) -> Self {
        self.identity = Some(identity);
        self
    }

    /// The identity of the checkpoint this metadata was read from: `<format>:<hex digest>` of
    /// the metadata bytes as read (the native manifest; DCP `.metadata` and data file sizes;
    /// safetensors headers, index and file sizes). Another save at the same place has another
    /// identity; plans record it so that a plan is never executed against another checkpoint.
    /// `None` for metadata assembled in memory (tests, synthetic models).
    pub fn identity(&self) -> Option<&str> {
        self.identity.as_deref()
    }

    /// All tensors.
    pub fn tensors(&self) -> &[TensorMeta] {
        &self.tensors
    }

    /// All saved chunks, grouped by tensor.
    pub fn chunks(&self) -> &[SavedChunk] {
        &self.chunks
    }

    /// The saved chunks of tensor `tensor`.
    pub fn chunks_of(&self, tensor: u32) -> &[SavedChunk] {
        &self.chunks[self.chunk_ranges[tensor as usize].clone()]
    }

    /// Index of the first chunk of tensor `tensor` in [`Self::chunks`].
    pub fn first_chunk_index(&self, tensor: u32) -> usize {
        self.chunk_ranges[tensor as usize].start
    }

    /// Non-tensor objects.
    pub fn objects(&self) -> &[ObjectMeta] {
        &self.objects
    }

    /// Data files.
    pub fn files(&self) -> &[DataFile] {
        &self.files
    }

    /// Looks a tensor up by FQN (linear; build a map for repeated lookups).
    pub fn tensor_index(&self, fqn: &str) -> Option<u32> {
        self.tensors
            .iter()
            .position(|t| t.fqn == fqn)
            .map(|i| i as u32)
    }

    /// Bytes of all tensors (each element counted once).
    pub fn tensor_bytes(&self) -> u64 {
        self.tensors.iter().map(TensorMeta::nbytes).sum()
    }
}
