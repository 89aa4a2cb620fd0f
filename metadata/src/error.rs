//! The metadata crate's one error type. Every variant names the file, tensor or field at fault.

use thiserror::Error;

/// Errors of checkpoint metadata: parsing, validation and the native format's IO.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum MetadataError {
    /// A dtype name nobody knows.
    #[error("unknown dtype {name:?}")]
    UnknownDtype {
        /// The name as found.
        name: String,
    },
    /// A saved box reaches outside the tensor's shape.
    #[error(
        "tensor {fqn}: saved box {region} lies outside the shape {shape} in dim {dim} ({start}..{end} > {size})"
    )]
    BoxOutsideShape {
        /// Tensor.
        fqn: String,
        /// The offending box.
        region: String,
        /// The tensor's shape.
        shape: String,
        /// The dimension where it sticks out.
        dim: usize,
        /// Start in that dim.
        start: u64,
        /// End in that dim.
        end: u64,
        /// The tensor's size in that dim.
        size: u64,
    },
    /// A saved box with a different number of dimensions than its tensor.
    #[error("tensor {fqn}: saved box {region} does not have the tensor's {ndim} dimensions")]
    RankMismatch {
        /// Tensor.
        fqn: String,
        /// The offending box.
        region: String,
        /// The tensor's ndim.
        ndim: usize,
    },
    /// Two saved boxes of one tensor share elements.
    #[error("tensor {fqn}: saved boxes {first} and {second} overlap")]
    OverlappingBoxes {
        /// Tensor.
        fqn: String,
        /// One box.
        first: String,
        /// The other.
        second: String,
    },
    /// The saved boxes of a tensor do not cover it.
    #[error("tensor {fqn}: saved boxes cover {covered} of {numel} elements (a hole)")]
    Hole {
        /// Tensor.
        fqn: String,
        /// Elements covered.
        covered: u64,
        /// Elements of the tensor.
        numel: u64,
    },
    /// A byte range that reaches past the end of its file.
    #[error(
        "tensor {fqn}: chunk {region} reads bytes {start}..{end} of {file}, past its end ({size} bytes)"
    )]
    ByteRangePastEnd {
        /// Tensor (or object key).
        fqn: String,
        /// The chunk.
        region: String,
        /// File path.
        file: String,
        /// Start byte.
        start: u64,
        /// End byte.
        end: u64,
        /// File size.
        size: u64,
    },
    /// A chunk whose byte length does not match its element count.
    #[error(
        "tensor {fqn}: chunk {region} has byte length {actual} but {numel} elements of {dtype} need {expected}"
    )]
    ByteLengthMismatch {
        /// Tensor.
        fqn: String,
        /// The chunk.
        region: String,
        /// Elements of the box.
        numel: u64,
        /// Element type.
        dtype: String,
        /// Bytes needed.
        expected: u64,
        /// Bytes recorded.
        actual: u64,
    },
    /// A checksum that does not match the bytes.
    #[error(
        "checksum mismatch in {path}{range}: expected crc32c {expected:08x}, found {actual:08x}"
    )]
    ChecksumMismatch {
        /// File.
        path: String,
        /// `" bytes a..b"` or empty for a whole file.
        range: String,
        /// Recorded checksum.
        expected: u32,
        /// Checksum of what was read.
        actual: u32,
    },
    /// A saved box (or object) whose bytes do not match the checksum its metadata records (a
    /// crc32c, or a DCP blob's zip CRC-32): the block checksums can all be right while the
    /// metadata points a box at another box's bytes.
    #[error(
        "checksum mismatch in {path} bytes {start}..{end} ({entry}): its metadata records {algorithm} {expected:08x}, the bytes have {actual:08x}"
    )]
    BoxChecksumMismatch {
        /// Data file.
        path: String,
        /// `tensor <fqn> box <region>` or `object <key>`.
        entry: String,
        /// First byte of the box.
        start: u64,
        /// One past its last byte.
        end: u64,
        /// The checksum's algorithm: `crc32c`, or `CRC-32` (a DCP blob's zip entry).
        algorithm: &'static str,
        /// The checksum recorded in the metadata.
        expected: u32,
        /// The checksum of the bytes read.
        actual: u32,
    },
    /// A directory that holds no manifest: an incomplete (or no) checkpoint.
    #[error(
        "{path}: no manifest.json, so this is not a committed checkpoint (an incomplete save?)"
    )]
    MissingManifest {
        /// The checkpoint directory.
        path: String,
    },
    /// A location where nothing is stored: a mistyped path or prefix, or an empty directory.
    #[error("{path}: does not exist (nothing is stored there)")]
    NotFound {
        /// The location as the store names it.
        path: String,
    },
    /// A save into a location that already holds a committed checkpoint (its manifest): nothing
    /// is wrong with that checkpoint, the save is pointed at the wrong place.
    #[error(
        "{prefix} already holds a committed checkpoint ({manifest} exists): save to another step \
         directory, or remove this one first"
    )]
    AlreadyCommitted {
        /// The checkpoint directory.
        prefix: String,
        /// Its manifest.
        manifest: String,
    },
    /// A commit whose manifest was written (the checkpoint IS committed and opens by its path)
    /// but whose `<run>/latest` pointer could not be moved to it (a full disk, a failed request).
    /// Saving again is refused (the checkpoint exists); the pointer still names an older step (or
    /// none), and the next committed step moves it on.
    #[error(
        "checkpoint {checkpoint} IS committed (its manifest is written), but {latest} was not moved to it: {source}"
    )]
    LatestNotMoved {
        /// The committed checkpoint directory.
        checkpoint: String,
        /// The run's pointer that still names an older step.
        latest: String,
        /// Why reading or writing the pointer failed.
        #[source]
        source: Box<MetadataError>,
    },
    /// Anything else structurally wrong with metadata, with what and where.
    #[error("invalid checkpoint metadata: {what}")]
    Invalid {
        /// What is wrong.
        what: String,
    },
    /// A metadata file with no bytes at all. No writer leaves one (DCP writes `.metadata` whole,
    /// last), so the save or a copy of it was cut short: a truncated file, not one in a format
    /// the decoder does not know.
    #[error(
        "{path}: the {what} file is empty (0 bytes); the save or copy that wrote it was cut short"
    )]
    EmptyFile {
        /// File.
        path: String,
        /// What it should hold.
        what: &'static str,
    },
    /// A metadata, manifest or checksum file that cannot be decoded.
    #[error("{path}: cannot decode {what}: {detail}")]
    Decode {
        /// File.
        path: String,
        /// What was being decoded.
        what: &'static str,
        /// The decoder's message.
        detail: String,
    },
    /// Something tessera cannot read in place (a compressed DCP blob, an unsupported dtype or
    /// tensor kind), named with where it was found.
    #[error("{path}: {detail}")]
    Unsupported {
        /// File (or checkpoint) where it was found.
        path: String,
        /// What it is, naming the tensor.
        detail: String,
    },
    /// A DCP blob (a `torch.save` zip inside a `.distcp` file) that cannot be taken apart.
    #[error("{path} bytes {start}..{end} ({entry}): {detail}")]
    Blob {
        /// The data file.
        path: String,
        /// First byte of the blob in the file.
        start: u64,
        /// One past its last byte.
        end: u64,
        /// What it holds: `tensor <fqn> chunk <box>` or `object <key>`.
        entry: String,
        /// What is wrong.
        detail: String,
    },
    /// Storage failed.
    #[error("{action} {path}: {source}")]
    Store {
        /// Verb phrase: `reading`, `writing`, `listing`.
        action: &'static str,
        /// Object path.
        path: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
}

impl MetadataError {
    /// Whether retrying cannot help: everything but a transient storage failure (a network error,
    /// a timeout, a 5xx answer: object_store's `Generic`), the classification every tessera error
    /// shares (`tessera_storage::is_transient`). [`LatestNotMoved`](Self::LatestNotMoved) is
    /// permanent whatever its cause: the commit it reports cannot be repeated.
    pub fn is_permanent(&self) -> bool {
        !matches!(
            self,
            MetadataError::Store {
                source: object_store::Error::Generic { .. },
                ..
            }
        )
    }
}
