//! The storage crate's one error type.

use thiserror::Error;

/// Errors of opening a location or of a storage request.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum StorageError {
    /// A location that cannot be opened: unknown scheme, missing bucket or credentials, a local
    /// directory that does not exist.
    #[error("{location}: {detail}")]
    Location {
        /// What the user gave.
        location: String,
        /// What is wrong, and what to do about it.
        detail: String,
    },
    /// A store request failed (after the retries of [`RetryPolicy`](crate::RetryPolicy) for
    /// transient errors).
    #[error("{action} {path}: {source}")]
    Store {
        /// Verb phrase: `opening`, `reading bytes 0..4096 of`.
        action: String,
        /// Object path or directory.
        path: String,
        /// The store's error.
        #[source]
        source: object_store::Error,
    },
}

impl StorageError {
    /// Whether retrying cannot help: a bad location always; a store error unless
    /// [`is_transient`](crate::is_transient) says it may pass.
    pub fn is_permanent(&self) -> bool {
        match self {
            StorageError::Location { .. } => true,
            StorageError::Store { source, .. } => !crate::is_transient(source),
        }
    }
}
