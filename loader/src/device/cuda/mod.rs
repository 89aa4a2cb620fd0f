//! The GPU path (feature `cuda`): CUDA device memory as destinations ([`CudaDevice`],
//! [`DeviceBuffer`]), the pinned staging engine that uploads into it ([`CudaCopyEngine`]), and an
//! NCCL data plane ([`NcclPlane`]) behind the sequenced transport ([`NcclTransport`]) whose
//! grouped ring exchanges pieces device to device.
//!
//! cudarc loads libcuda and libnccl at run time, so this builds on any machine; [`probe`] checks
//! that they are there before anything calls into them (cudarc would panic), and a machine
//! without them gets a [`crate::LoaderError::Cuda`] that says what is missing.
//!
//! Everything that calls the driver or NCCL directly is in this module: raw device pointers,
//! asynchronous copies and communicator calls are `unsafe`, each with its `SAFETY` argument, and
//! what the rest of the loader sees is safe (bounds-checked buffers, engines that never hand out
//! a staging buffer while a copy may still read it).
// Raw CUDA driver and NCCL calls (device pointers, async copies from pinned memory, communicator
// handles) are inherently unsafe; they are confined to this module tree, each block argued.
#![allow(unsafe_code)]

mod device;
mod nccl;
pub mod probe;
mod staging;

pub use device::{CudaDevice, DeviceBuffer};
pub use nccl::{NcclPlane, NcclTransport, connect_nccl};
pub use staging::{CudaCopyEngine, CudaSlot};

use crate::LoaderError;

/// A driver call's failure as a loader error.
pub(crate) fn driver_error(what: &str, error: cudarc::driver::DriverError) -> LoaderError {
    LoaderError::Cuda {
        detail: format!("{what}: {error}"),
    }
}
