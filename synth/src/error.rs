//! Errors of the synthetic-checkpoint module, and the report of a value that is not what the
//! formula says.

use std::fmt;

use thiserror::Error;

use tessera_metadata::{DType, MetadataError};
use tessera_planner::PlanError;

/// Errors of this crate: bad requests (unknown model, a box or range outside the tensor, a
/// buffer of the wrong size) and, from the checks, a value that differs from the formula.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum SynthError {
    /// A model name nobody knows.
    #[error("unknown synthetic model {name:?}; valid names: {valid}")]
    UnknownModel {
        /// The name as given.
        name: String,
        /// The valid names, comma separated.
        valid: String,
    },
    /// A box with a different number of dimensions than its tensor.
    #[error("tensor {fqn}: box {region} does not have the tensor's {ndim} dimensions")]
    RegionRank {
        /// Tensor.
        fqn: String,
        /// The box.
        region: String,
        /// The tensor's ndim.
        ndim: usize,
    },
    /// A box that reaches outside the tensor.
    #[error("tensor {fqn}: box {region} lies outside the shape {shape}")]
    RegionOutsideShape {
        /// Tensor.
        fqn: String,
        /// The box.
        region: String,
        /// The tensor's shape.
        shape: String,
    },
    /// A flat range that is reversed or reaches past the last element.
    #[error("tensor {fqn}: flat range {start}..{end} is not within 0..{numel}")]
    FlatRange {
        /// Tensor.
        fqn: String,
        /// Start element.
        start: u64,
        /// End element (exclusive).
        end: u64,
        /// Elements of the tensor.
        numel: u64,
    },
    /// A buffer whose length is not the byte size of what it should hold.
    #[error("tensor {fqn}: {what} needs a buffer of {expected} bytes, got {actual}")]
    BufferLength {
        /// Tensor.
        fqn: String,
        /// The box or flat range the buffer is for.
        what: String,
        /// Bytes needed.
        expected: u64,
        /// Bytes given.
        actual: usize,
    },
    /// A value differs from the formula.
    #[error(transparent)]
    Mismatch(Box<ValueMismatch>),
    /// The save layout does not resolve against the model, or writers cannot be assigned.
    #[error("planning the synthetic save: {0}")]
    Plan(#[from] PlanError),
    /// The save layout cannot be saved the way Megatron's distributed optimizer saves (see
    /// [`crate::SynthOptions::dist_optimizer`]).
    #[error("saving optimizer states as flat ranges over mesh dim {dim:?}: {detail}")]
    DistOptimizer {
        /// The data-parallel mesh dim named.
        dim: String,
        /// What does not fit, naming the tensor and box.
        detail: String,
    },
    /// Writing the checkpoint failed. The message includes the writer's, so that error is not
    /// also this one's `source()` (a chain printer would repeat it).
    #[error("{context}: {inner}")]
    Write {
        /// Verb phrase with the checkpoint or file.
        context: String,
        /// The writer's error.
        inner: Box<MetadataError>,
    },
    /// A value-generation task died.
    #[error("generating box values: {detail}")]
    Task {
        /// What happened.
        detail: String,
    },
}

impl SynthError {
    /// The mismatch, when this error is one.
    pub fn mismatch(&self) -> Option<&ValueMismatch> {
        match self {
            SynthError::Mismatch(m) => Some(m),
            _ => None,
        }
    }
}

/// The first element of a checked buffer whose bytes are not the formula's.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueMismatch {
    /// Tensor.
    pub fqn: String,
    /// Element type.
    pub dtype: DType,
    /// Global row-major flat index of the element in the tensor.
    pub index: u64,
    /// Global coordinates of the element (empty for a 0-dim tensor).
    pub coords: Vec<u64>,
    /// Byte offset of the element in the checked buffer.
    pub byte_offset: usize,
    /// The formula's bytes (little-endian).
    pub expected: Vec<u8>,
    /// The bytes found.
    pub found: Vec<u8>,
}

impl fmt::Display for ValueMismatch {
    /// `tensor model.x (bf16): element [3, 17] (flat index 209, buffer byte 418): expected bytes
    /// [80 3e], found [80 3f]`
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "tensor {} ({}): element {} (flat index {}, buffer byte {}): expected bytes {}, found {}",
            self.fqn,
            self.dtype,
            tessera_metadata::shape_to_string(&self.coords),
            self.index,
            self.byte_offset,
            HexBytes(&self.expected),
            HexBytes(&self.found),
        )
    }
}

impl std::error::Error for ValueMismatch {}

/// Bytes as `[00 80 3f]`, in buffer (little-endian) order.
struct HexBytes<'a>(&'a [u8]);

impl fmt::Display for HexBytes<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (k, b) in self.0.iter().enumerate() {
            if k > 0 {
                f.write_str(" ")?;
            }
            write!(f, "{b:02x}")?;
        }
        f.write_str("]")
    }
}

impl SynthError {
    /// A `map_err` adapter for writer errors: `context` says what was being written.
    pub fn writing(context: String) -> impl FnOnce(MetadataError) -> SynthError {
        move |inner| SynthError::Write {
            context,
            inner: Box::new(inner),
        }
    }

    /// `context` in front of a write error's own (another error passes unchanged).
    pub fn in_context(self, context: String) -> SynthError {
        match self {
            SynthError::Write {
                context: outer,
                inner,
            } => SynthError::Write {
                context: format!("{context}: {outer}"),
                inner,
            },
            other => other,
        }
    }

    /// Whether retrying cannot help: only a write whose storage error may pass is transient.
    pub fn is_permanent(&self) -> bool {
        match self {
            SynthError::Write { inner, .. } => inner.is_permanent(),
            _ => true,
        }
    }
}
