//! tessera's checkpoint model: what a checkpoint holds (tensors, their saved boxes, where each
//! box's bytes live, non-tensor objects) and validation of that model, plus every on-disk format
//! tessera reads, one module each under [`formats`]: its own native format (reader and writer),
//! PyTorch DCP and safetensors (read in place). Every format produces the same
//! [`CheckpointMeta`]; [`open_any`] opens a checkpoint in whichever format it is.

mod box_index;
mod checkpoint;
mod dtype;
pub mod encoded;
mod error;
mod flat;
pub mod formats;
mod identity;
mod tensor;
mod validate;

pub use box_index::BoxIndex;
pub use checkpoint::{BoxChecksum, ByteMeta, CheckpointMeta, DataFile, ObjectMeta, SavedChunk};
pub use dtype::DType;
pub use error::MetadataError;
pub use flat::{flat_range_chunks, flat_range_of_box, flat_range_to_boxes};
pub use formats::{Format, FormatDetails, OpenOptions, OpenedCheckpoint, Writer, open_any};
pub use identity::native_identity;
pub use tensor::{Dims, TensorBox, TensorMeta, row_major_strides, shape_to_string};
pub use validate::validate;
