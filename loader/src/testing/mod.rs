//! Test support for this crate's and other crates' tests (cargo feature `testing`, off by
//! default): services that real deployments reach over the network, run in-process on
//! 127.0.0.1 so that tests need nothing outside the machine.

mod s3_server;

pub use s3_server::{ACCESS_KEY_ID, REGION, S3TestServer, SECRET_ACCESS_KEY};

pub mod emulated;
pub use emulated::{EmulatedPlane, HostCopyEngine, HostEngineStats, HostMemory};
