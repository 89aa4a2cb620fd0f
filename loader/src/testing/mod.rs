//! Test support for this crate's and other crates' tests (cargo feature `testing`, off by
//! default): host emulations of the device traits, so the whole device pipeline and the NCCL
//! protocol run in CPU tests. Storage test support (fault-injecting stores, the S3 test server)
//! is the storage crate's `testing` feature.

pub mod emulated;
pub use emulated::{EmulatedPlane, HostCopyEngine, HostEngineStats, HostMemory};
