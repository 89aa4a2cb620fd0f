//! The operations' one error type: the libraries' errors, with what the operation was doing.

use thiserror::Error;

/// Errors of an operation.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum OpsError {
    /// A location that cannot be opened, or a store request that failed.
    #[error(transparent)]
    Storage(#[from] tessera_storage::StorageError),
    /// Checkpoint metadata that cannot be read or written.
    #[error(transparent)]
    Metadata(#[from] tessera_metadata::MetadataError),
    /// Planning failed.
    #[error(transparent)]
    Plan(#[from] tessera_planner::PlanError),
    /// Loading or a transport between ranks failed (boxed: the loader's error is large, and
    /// every `Result` of this crate would carry its size).
    #[error(transparent)]
    Loader(Box<tessera_loader::LoaderError>),
    /// The plan server could not be reached or refused a request.
    #[error(transparent)]
    PlanClient(#[from] tessera_loader::plan_client::PlanClientError),
    /// A message between ranks that does not decode.
    #[error("decoding {what}: {source}")]
    Message {
        /// What the message was (`rank 2's boxes`).
        what: String,
        /// The decoder's error.
        #[source]
        source: serde_json::Error,
    },
    /// Input that cannot work (disagreeing ranks, a missing rendezvous).
    #[error("{detail}")]
    Invalid {
        /// What is wrong, naming the tensor, rank or field.
        detail: String,
    },
    /// Another writer holds the output location's claim.
    #[error(
        "{location} is being written by another writer: {claim} is held by {holder}. If that writer is dead (killed, its host gone), {how_to_break} to remove its claim and write anyway"
    )]
    Claimed {
        /// The output location.
        location: String,
        /// The claim object.
        claim: String,
        /// Who holds it (pid, host, since when, command).
        holder: String,
        /// What the user does to break a stale claim in the front end that was refused
        /// (`rerun with --break-claim`).
        how_to_break: String,
    },
    /// Other ranks failed, so nothing was committed.
    #[error("not committed, ranks failed: {}", failures.join("; "))]
    RanksFailed {
        /// `rank R: why`, one per failed rank.
        failures: Vec<String>,
    },
    /// An error with what the operation was doing when it happened. The message includes the
    /// inner error's, so the inner error is not also this one's `source()` (a chain printer would
    /// repeat it).
    #[error("{context}: {inner}")]
    Context {
        /// Verb phrase with the object: `opening checkpoint run/step-1`.
        context: String,
        /// What went wrong.
        inner: Box<OpsError>,
    },
}

impl OpsError {
    /// An [`OpsError::Invalid`].
    pub fn invalid(detail: impl Into<String>) -> Self {
        OpsError::Invalid {
            detail: detail.into(),
        }
    }

    /// Whether retrying the same operation cannot help. Storage and transport failures that may
    /// pass are transient; bad input and bad data are permanent.
    pub fn is_permanent(&self) -> bool {
        match self {
            OpsError::Storage(e) => e.is_permanent(),
            OpsError::Metadata(e) => e.is_permanent(),
            OpsError::Plan(_) => true,
            OpsError::Loader(e) => e.is_permanent(),
            OpsError::PlanClient(e) => e.is_permanent(),
            OpsError::Message { .. } | OpsError::Invalid { .. } | OpsError::Claimed { .. } => true,
            OpsError::RanksFailed { .. } => false,
            OpsError::Context { inner, .. } => inner.is_permanent(),
        }
    }
}

impl From<tessera_loader::LoaderError> for OpsError {
    fn from(error: tessera_loader::LoaderError) -> Self {
        OpsError::Loader(Box::new(error))
    }
}

/// `.context("verb phrase")` for results whose error converts into an [`OpsError`].
pub trait ResultExt<T> {
    /// Wraps the error with `context`.
    fn context(self, context: impl Into<String>) -> Result<T, OpsError>;
    /// Wraps the error with the context `f` makes (only on error).
    fn with_context<S: Into<String>>(self, f: impl FnOnce() -> S) -> Result<T, OpsError>;
}

impl<T, E: Into<OpsError>> ResultExt<T> for Result<T, E> {
    fn context(self, context: impl Into<String>) -> Result<T, OpsError> {
        self.map_err(|e| OpsError::Context {
            context: context.into(),
            inner: Box::new(e.into()),
        })
    }

    fn with_context<S: Into<String>>(self, f: impl FnOnce() -> S) -> Result<T, OpsError> {
        self.map_err(|e| OpsError::Context {
            context: f().into(),
            inner: Box::new(e.into()),
        })
    }
}
