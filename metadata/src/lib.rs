//! tessera's checkpoint model: what a checkpoint holds (tensors, their saved boxes, where each
//! box's bytes live, non-tensor objects), validation of that model, and tessera's native on-disk
//! format. Readers for PyTorch DCP ([`dcp`]) and safetensors ([`foreign::hf`]) produce the same
//! [`CheckpointMeta`], read in place; [`open_any`] opens a checkpoint in whichever format it is.

mod box_index;
mod checkpoint;
pub mod dcp;
mod dtype;
mod error;
pub mod foreign;
pub mod native;
pub mod safetensors;
pub mod synth;
mod tensor;
mod validate;

pub use box_index::BoxIndex;
pub use checkpoint::{ByteMeta, CheckpointMeta, DataFile, ObjectMeta, SavedChunk};
pub use dtype::DType;
pub use error::MetadataError;
pub use foreign::{Format, FormatDetails, OpenOptions, OpenedCheckpoint, open_any};
pub use tensor::{Dims, TensorBox, TensorMeta, row_major_strides, shape_to_string};
pub use validate::validate;
