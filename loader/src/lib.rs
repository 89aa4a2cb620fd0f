//! The rank-side loader: what every rank of a training or eval job runs. It executes a rank plan
//! (from the server or planned locally from the checkpoint): coalesced, split, bounded byte-range
//! reads through `object_store`, checksum verification of what it read, placement into destination
//! buffers, and the plan's ring all-to-all between ranks over a [`transport::Transport`].

mod error;
pub mod exchange;
pub mod fault;
pub mod load;
pub mod place;
pub mod plan_client;
pub mod read;
pub mod rendezvous;
pub mod scheduler;
pub mod storage;
#[cfg(feature = "testing")]
pub mod testing;
pub mod transport;

pub use error::LoaderError;
