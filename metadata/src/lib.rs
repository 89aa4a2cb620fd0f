//! tessera's checkpoint model: what a checkpoint holds (tensors, their saved boxes, where each
//! box's bytes live, non-tensor objects), validation of that model, and tessera's native on-disk
//! format. Format readers for DCP and safetensors produce the same [`CheckpointMeta`].

mod box_index;
mod checkpoint;
mod dtype;
mod error;
pub mod native;
pub mod safetensors;
pub mod synth;
mod tensor;
mod validate;

pub use box_index::BoxIndex;
pub use checkpoint::{ByteMeta, CheckpointMeta, DataFile, ObjectMeta, SavedChunk};
pub use dtype::DType;
pub use error::MetadataError;
pub use tensor::{Dims, TensorBox, TensorMeta, row_major_strides, shape_to_string};
pub use validate::validate;
