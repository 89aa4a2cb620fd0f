//! The rank-side loader: what every rank of a training or eval job runs. It executes a rank plan
//! (from the server or planned locally from the checkpoint). Its folders follow the data path:
//!
//! ```text
//! checkpoint ──▶ read/ ──────────▶ verify/ ──────────▶ exchange/ ──────────────▶ device/
//! (opened,       (scheduler:       (block checks,      (protocol, its async      (staging and
//!  plan checked)  coalesced,        box crc32c,         driver; messages; direct   upload into
//!                 bounded range     joint checks of     copies; place; relays)     CUDA memory)
//!                 reads; local      boxes read in            │
//!                 positioned reads) parts, crc_fold)    transport/ (in-process, TCP, sequenced
//!                                                        data plane, rendezvous, conformance)
//! ```
//!
//! [`load`] drives one rank's load over those steps: the reads ([`read`]) verified as they arrive
//! ([`verify`]), the ring exchange ([`exchange::protocol`]) overlapped with them over a
//! [`transport::Transport`], then the joint checks. Destinations may also live in device memory
//! ([`device`]): the same host pipeline, then an upload through a bounded pool of pinned staging
//! buffers ([`device::staging`]), or the ring device to device on a data plane with NCCL's
//! semantics ([`transport::plane`]). The CUDA and NCCL implementations are behind the `cuda`
//! feature (`device::cuda`); host emulations of the same traits (feature `testing`) run the
//! whole pipeline in CPU tests. The library reads no environment: front ends build its options.

pub mod checkpoint;
pub mod device;
mod error;
pub mod exchange;
pub mod load;
pub mod plan_client;
pub mod read;
#[cfg(feature = "testing")]
pub mod testing;
pub mod tier;
pub mod transport;
pub mod verify;

pub use error::{JointMismatch, LoaderError};
