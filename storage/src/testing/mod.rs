//! Test support for this and other crates' tests (cargo feature `testing`, off by default):
//! wrappers that inject faults into or record the writes of any store, an S3-compatible server
//! and a plain HTTP file server that can be told to stall mid-body, both on 127.0.0.1, so that
//! tests need nothing outside the machine.

mod fault;
mod hooked;
mod http_server;
mod loopback;
mod recording;
mod s3_server;
mod throttled;

pub use fault::{FAULTY_STORE, FaultConfig, FaultStats, FaultyStore, InjectedFault};
pub use hooked::{HookedStore, WriteHook};
pub use http_server::{Stall, StallingHttpServer};
pub use recording::RecordingStore;
pub use s3_server::{ACCESS_KEY_ID, REGION, S3TestServer, SECRET_ACCESS_KEY, Served};
pub use throttled::ThrottledStore;
