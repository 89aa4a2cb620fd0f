//! Where checkpoints live. A location string (`run/step-000100`, `file://`, `s3://`, `gs://`,
//! `az://`, `http(s)://`) opens as a configured `Arc<dyn ObjectStore>` plus the checkpoint's
//! prefix inside it ([`open`], [`create`]); every front end and the loader open storage here and
//! nowhere else, so every store gets the same client settings (timeouts, no hidden retries) and
//! the same [`RetryPolicy`]. Writes that must survive transient failures go through
//! [`RetryingStore`], the policy as a store wrapper. A live publication's step
//! (`live+file://`) opens as a [`LiveStore`]: its metadata from the registry directory, its data
//! files from the publishing processes, which serve them with a [`RangeServer`] and, to consumers
//! on the same host, as shared memory ([`shared_file`]).
//!
//! Test support (feature `testing`): [`testing::FaultyStore`] and [`testing::RecordingStore`]
//! wrap any store, [`testing::S3TestServer`] serves an S3-compatible API on 127.0.0.1,
//! [`testing::StallingHttpServer`] serves a directory over plain HTTP and stalls when told to.

mod error;
mod live;
mod local;
mod local_file;
mod location;
mod range_server;
mod retry;
mod retrying;
pub mod shared_file;
#[cfg(feature = "testing")]
pub mod testing;

pub use error::StorageError;
pub use live::{LIVE_SCHEME, LiveStore, PUBLISHERS_FILE, Publisher};
pub use local::{is_staged_upload, local_directory, remove_staged_uploads, staged_uploads};
pub use local_file::local_file_get;
pub use location::{
    Location, LocationKind, StorageOptions, canonical, create, create_with, install_tls_provider,
    local_path, open, open_with,
};
pub use range_server::RangeServer;
pub use retry::{RetryPolicy, is_timeout, is_transient};
pub use retrying::{GaveUp, RETRYING_STORE, RetryingStore};
