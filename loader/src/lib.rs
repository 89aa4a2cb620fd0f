//! The rank-side loader: what every rank of a training or eval job runs. It executes a rank plan
//! (from the server or planned locally from the checkpoint): coalesced, split, bounded byte-range
//! reads through `object_store`, checksum verification of what it read, placement into destination
//! buffers, and the plan's ring all-to-all between ranks over a [`transport::Transport`].
//!
//! Destinations may also live in device memory ([`device_load`]): the host pipeline, then an
//! upload through a bounded pool of pinned staging buffers ([`staging`]), with the exchange on the
//! host or device to device on a data plane with NCCL's semantics ([`plane`]). The CUDA and NCCL
//! implementations are behind the `cuda` feature ([`cuda`] when enabled); host emulations of the
//! same traits (feature `testing`) run the whole pipeline in CPU tests.

pub mod crc_fold;
pub mod cross_memory;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod device_load;
mod error;
pub mod exchange;
pub mod host_memory;
pub mod joint;
pub mod load;
pub mod place;
pub mod plan_client;
pub mod plane;
mod positioned;
pub mod read;
pub mod relay;
pub mod rendezvous;
pub mod scheduler;
pub mod staging;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;

pub use error::{JointMismatch, LoaderError};
