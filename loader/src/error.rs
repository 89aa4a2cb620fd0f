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
    /// A saved box read in parts by several ranks (a joint check) whose parts do not add up to
    /// its crc32c: some rank read wrong bytes of it (`crate::verify::joint`). Every rank holding bytes
    /// of the box reports it. Boxed: it would make every loader `Result` carry its size.
    #[error("{0}")]
    JointChecksum(Box<JointMismatch>),
    /// A checkpoint location that cannot be opened, or a store request that failed (after retries
    /// for transient errors): [`StorageError::Store`](tessera_storage::StorageError::Store) names
    /// the action (`reading bytes 0..4096 of`) and the object. Boxed: it would make every loader
    /// `Result` carry its size.
    #[error(transparent)]
    Storage(Box<tessera_storage::StorageError>),
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
    /// The ranks of one job were given different options that change the plan (a read order, a
    /// filter): each would execute a plan that does not fit its peers', so rank 0 calls the job
    /// off at the rendezvous, before anything is read, and every rank fails with this, naming
    /// each option that differs, both values and the rank.
    #[error(
        "rank {rank}: the ranks of this job plan with different options, so their plans would \
         not fit together: {detail}; give every rank the same options"
    )]
    RanksDisagree {
        /// This rank.
        rank: u32,
        /// Each difference: `rank 1 plans with --read-order storage but rank 0 with --read-order auto`.
        detail: String,
    },
    /// Two ranks of one job hold rank plans that describe the bytes they pass each other
    /// differently ([`crate::exchange::agree`]): a piece id that names other bytes on the other
    /// rank, or a share one expects and the other does not send. Their rank plans come from
    /// different plans (a plan server that answered ranks from different plans of the same
    /// requests, ranks that planned other requests or another checkpoint), and exchanging
    /// would place one rank's bytes where the other's plan says other bytes go. Refused on
    /// both ranks before anything is exchanged.
    #[error(
        "rank {rank}: this rank's plan and the plan of {peers} disagree on what they pass each \
         other (a piece id that names other bytes there, or a share one expects and the other \
         does not send): the ranks hold rank plans of different plans (a plan server that \
         answered the ranks from different plans, or ranks that planned other requests or \
         another checkpoint); nothing was exchanged: plan the job again"
    )]
    PlansDisagree {
        /// This rank.
        rank: u32,
        /// The ranks whose plans disagree with this one's, as text (`rank 1`, `ranks 1, 3`).
        peers: String,
    },
    /// A plan that does not fit what the loader was given (wrong rank, sizes that disagree).
    #[error("invalid plan: {detail}")]
    InvalidPlan {
        /// What is wrong.
        detail: String,
    },
    /// A rank plan made for another checkpoint than the one opened here: the checkpoint was
    /// saved again at the same place since the plan was made (a server answering from a stale
    /// cache), or the plan's source names another checkpoint under the same id. Executing it
    /// would read the opened files at the other checkpoint's offsets.
    #[error(
        "rank {rank}: the plan was made for another version of checkpoint {checkpoint}: the plan \
         (a server's plan, when planned on a server) is for identity {plan_identity}, but the \
         checkpoint opened here has identity {checkpoint_identity}; plan it again (and check \
         that the server's checkpoint id names this checkpoint)"
    )]
    PlanForOtherCheckpoint {
        /// The rank.
        rank: u32,
        /// The checkpoint opened (its location as given).
        checkpoint: String,
        /// The identity the plan records.
        plan_identity: String,
        /// The identity of the opened checkpoint.
        checkpoint_identity: String,
    },
    /// A plan that records no checkpoint identity (from a server or a file older than
    /// identities) against a checkpoint that has one: nothing ties the plan's offsets to these
    /// files, so it is refused rather than trusted.
    #[error(
        "rank {rank}: the plan does not say which checkpoint it was made for (it has no \
         checkpoint_identity: a plan from an older tessera server or file), so it cannot be \
         checked against {checkpoint} (identity {checkpoint_identity}); plan it again with this \
         version"
    )]
    PlanWithoutIdentity {
        /// The rank.
        rank: u32,
        /// The checkpoint opened (its location as given).
        checkpoint: String,
        /// The identity of the opened checkpoint.
        checkpoint_identity: String,
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

/// What a failed joint check found ([`LoaderError::JointChecksum`]).
#[derive(Debug, Error)]
#[error(
    "checksum mismatch in {path} bytes {start}..{end} ({entry}), read in parts by ranks \
     {readers:?}: expected {algorithm} {expected:08x}, the parts fold to {actual:08x} over \
     {bytes} bytes (checked on rank {rank})"
)]
pub struct JointMismatch {
    /// The checksum's algorithm (`crc32c`, or `CRC-32` for a DCP blob's zip entry).
    pub algorithm: &'static str,
    /// The rank that checked.
    pub rank: u32,
    /// The box's data file.
    pub path: String,
    /// The tensor and box.
    pub entry: String,
    /// First byte of the box in the file.
    pub start: u64,
    /// End of the box in the file.
    pub end: u64,
    /// The ranks that read its parts.
    pub readers: Vec<u32>,
    /// Bytes the readers' folds cover (the box's length when the plan is sound).
    pub bytes: u64,
    /// The checksum the metadata records.
    pub expected: u32,
    /// What the parts fold to.
    pub actual: u32,
}

impl From<tessera_storage::StorageError> for LoaderError {
    fn from(error: tessera_storage::StorageError) -> Self {
        LoaderError::Storage(Box::new(error))
    }
}

impl LoaderError {
    /// Whether retrying cannot help. tessera retries the transient ones itself (storage reads,
    /// plan requests, peer connects, each under its [`RetryPolicy`](tessera_storage::RetryPolicy)),
    /// so a transient error that reaches the caller means those retries were used up: a caller
    /// may retry the whole load later (another replica, a restarted job); a permanent error will
    /// fail the same way again.
    ///
    /// - Storage errors follow [`tessera_storage::is_transient`]: [`Storage`](Self::Storage) and
    ///   [`Metadata`](Self::Metadata) delegate to their own `is_permanent` (a store request is
    ///   transient when its source is: a network error, a timeout, a 5xx answer).
    /// - Peer trouble is not permanent: [`Transport`](Self::Transport),
    ///   [`PeerTimeout`](Self::PeerTimeout) and [`Rendezvous`](Self::Rendezvous) come from a rank
    ///   that died, hung or started late, which a restarted job may not repeat.
    /// - Everything else is permanent: a missing or truncated file and a checksum mismatch are
    ///   what is stored; an invalid plan, a planning error or ranks given different options
    ///   ([`RanksDisagree`](Self::RanksDisagree)) are in the inputs; CUDA and device
    ///   errors are the machine's; local file system errors ([`Io`](Self::Io)) are a missing
    ///   path, a permission or a full disk, none of which a retry cures.
    pub fn is_permanent(&self) -> bool {
        match self {
            LoaderError::Metadata(e) => e.is_permanent(),
            LoaderError::Storage(e) => e.is_permanent(),
            LoaderError::Transport { .. }
            | LoaderError::PeerTimeout { .. }
            | LoaderError::Rendezvous { .. } => false,
            LoaderError::Plan(_)
            | LoaderError::MissingFile { .. }
            | LoaderError::ShortRead { .. }
            | LoaderError::Checksum { .. }
            | LoaderError::JointChecksum(_)
            | LoaderError::RanksDisagree { .. }
            | LoaderError::PlansDisagree { .. }
            | LoaderError::InvalidPlan { .. }
            | LoaderError::PlanForOtherCheckpoint { .. }
            | LoaderError::PlanWithoutIdentity { .. }
            | LoaderError::Cuda { .. }
            | LoaderError::Device { .. }
            | LoaderError::Io { .. } => true,
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_metadata::MetadataError;
    use tessera_planner::PlanError;
    use tessera_storage::StorageError;

    fn generic() -> object_store::Error {
        object_store::Error::Generic {
            store: "S3",
            source: "503 Service Unavailable".into(),
        }
    }

    fn not_found() -> object_store::Error {
        object_store::Error::NotFound {
            path: "a".to_string(),
            source: "404".into(),
        }
    }

    fn store(source: object_store::Error) -> LoaderError {
        LoaderError::from(StorageError::Store {
            action: "reading bytes 0..1 of".to_string(),
            path: "a".to_string(),
            source,
        })
    }

    #[test]
    fn storage_errors_follow_is_transient() {
        assert!(!store(generic()).is_permanent());
        assert!(store(not_found()).is_permanent());
        let storage = |source| {
            LoaderError::from(StorageError::Store {
                action: "opening".to_string(),
                path: "a".to_string(),
                source,
            })
        };
        assert!(!storage(generic()).is_permanent());
        assert!(storage(not_found()).is_permanent());
        let location = LoaderError::from(StorageError::Location {
            location: "ftp://x".to_string(),
            detail: "unknown scheme".to_string(),
        });
        assert!(location.is_permanent());
    }

    #[test]
    fn metadata_errors_delegate() {
        let metadata = |source| {
            LoaderError::Metadata(MetadataError::Store {
                action: "reading",
                path: "a".to_string(),
                source,
            })
        };
        assert!(!metadata(generic()).is_permanent());
        assert!(metadata(not_found()).is_permanent());
    }

    #[test]
    fn peer_trouble_is_not_permanent() {
        let errors = [
            LoaderError::Transport {
                rank: 0,
                peer: 1,
                detail: "reset".to_string(),
            },
            LoaderError::PeerTimeout {
                rank: 0,
                peer: 1,
                what: "group 0 round 1".to_string(),
                waited: Duration::from_secs(1),
            },
            LoaderError::Rendezvous {
                detail: "master unreachable".to_string(),
            },
        ];
        for error in errors {
            assert!(!error.is_permanent(), "{error}");
        }
    }

    #[test]
    fn data_plan_and_device_errors_are_permanent() {
        let path = "ckpt/data/rank0.bin".to_string();
        let errors = [
            LoaderError::Plan(PlanError::NoMatchingRule {
                fqn: "w".to_string(),
            }),
            LoaderError::MissingFile { path: path.clone() },
            LoaderError::ShortRead {
                path: path.clone(),
                start: 0,
                end: 10,
                got: 5,
            },
            LoaderError::Checksum {
                path,
                start: 0,
                end: 8192,
                expected: 1,
                actual: 2,
            },
            LoaderError::InvalidPlan {
                detail: "wrong rank".to_string(),
            },
            LoaderError::Cuda {
                detail: "no driver".to_string(),
            },
            LoaderError::Device {
                device: "cuda:0".to_string(),
                detail: "copy past the end".to_string(),
            },
            LoaderError::Io {
                action: "writing",
                path: "out".to_string(),
                source: std::io::Error::other("disk full"),
            },
        ];
        for error in errors {
            assert!(error.is_permanent(), "{error}");
        }
    }
}
