//! The loader's one error type. Variants carry the file, byte range, rank or peer a user needs.

use std::time::Duration;

use thiserror::Error;

/// Errors of loading: storage, verification, transport, rendezvous.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum LoaderError {
    /// Checkpoint metadata could not be read or is invalid.
    #[error(transparent)]
    Metadata(#[from] tessera_metadata::MetadataError),
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] tessera_planner::PlanError),
    /// Storage failed (after retries for transient errors).
    #[error("{action} {path}: {source}")]
    Store {
        /// Verb phrase: `reading bytes 0..4096 of`.
        action: String,
        /// Object path.
        path: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
    /// A data file the plan reads does not exist.
    #[error("data file {path} is missing")]
    MissingFile {
        /// Object path.
        path: String,
    },
    /// Fewer bytes than asked for came back (a truncated file).
    #[error("{path}: asked for bytes {start}..{end} but got {got} bytes (truncated file?)")]
    ShortRead {
        /// Object path.
        path: String,
        /// Start byte.
        start: u64,
        /// End byte.
        end: u64,
        /// Bytes received.
        got: u64,
    },
    /// Bytes whose checksum does not match.
    #[error(
        "checksum mismatch in {path} bytes {start}..{end}: expected crc32c {expected:08x}, found {actual:08x}"
    )]
    Checksum {
        /// Object path.
        path: String,
        /// Start byte of the bad block.
        start: u64,
        /// End byte of the bad block.
        end: u64,
        /// Recorded checksum.
        expected: u32,
        /// Checksum of what was read.
        actual: u32,
    },
    /// A checkpoint location that cannot be opened.
    #[error(transparent)]
    Storage(#[from] tessera_storage::StorageError),
    /// A peer connection failed or sent something unexpected.
    #[error("rank {rank}: transport to rank {peer} failed: {detail}")]
    Transport {
        /// This rank.
        rank: u32,
        /// The peer.
        peer: u32,
        /// What happened.
        detail: String,
    },
    /// A peer sent nothing within the timeout (it died or hangs).
    #[error("rank {rank}: nothing from rank {peer} for {what} within {waited:?}; it may have died")]
    PeerTimeout {
        /// This rank.
        rank: u32,
        /// The peer.
        peer: u32,
        /// What was awaited (`group 3 round 2`).
        what: String,
        /// How long.
        waited: Duration,
    },
    /// Ranks could not find each other.
    #[error("rendezvous failed: {detail}")]
    Rendezvous {
        /// What went wrong.
        detail: String,
    },
    /// A plan that does not fit what the loader was given (wrong rank, sizes that disagree).
    #[error("invalid plan: {detail}")]
    InvalidPlan {
        /// What is wrong.
        detail: String,
    },
    /// CUDA or NCCL is unavailable (no driver or library, a build without the `cuda` feature, a
    /// device that does not exist) or one of their calls failed. Never a panic: the libraries are
    /// probed before first use.
    #[error("CUDA: {detail}")]
    Cuda {
        /// What is missing or what failed, and what to do about it.
        detail: String,
    },
    /// Device memory or a device's data plane was misused or failed (a copy past the end of a
    /// buffer, a destination of the wrong size, the data plane thread gone).
    #[error("{device}: {detail}")]
    Device {
        /// The device (`cuda:0`, `emulated`).
        device: String,
        /// What is wrong.
        detail: String,
    },
    /// Local file system IO.
    #[error("{action} {path}: {source}")]
    Io {
        /// Verb phrase.
        action: &'static str,
        /// Path.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

impl LoaderError {
    /// Says where a peer or device error happened, which the transport or data plane that raised
    /// it cannot know (a ring round, a tagged transfer): `context` goes in front of a transport or
    /// device error's detail, `timeout_context` in front of what a timed-out wait was for. Other
    /// errors pass unchanged.
    pub fn in_context(self, context: &str, timeout_context: &str) -> LoaderError {
        match self {
            LoaderError::Transport { rank, peer, detail } => LoaderError::Transport {
                rank,
                peer,
                detail: format!("{context}: {detail}"),
            },
            LoaderError::PeerTimeout {
                rank,
                peer,
                what,
                waited,
            } => LoaderError::PeerTimeout {
                rank,
                peer,
                what: format!("{timeout_context}: {what}"),
                waited,
            },
            LoaderError::Device { device, detail } => LoaderError::Device {
                device,
                detail: format!("{context}: {detail}"),
            },
            other => other,
        }
    }
}
