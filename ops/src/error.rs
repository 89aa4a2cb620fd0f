//! The operations' one error type: the libraries' errors, with what the operation was doing.

use std::time::Duration;

use tessera_metadata::formats::native::Manifest;
use thiserror::Error;

use crate::save::AfterCommit;

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
    /// Rank 0 did not commit the save; its error as it told this rank (see
    /// [`OpsError::is_permanent`], which it also sent).
    #[error("{detail}")]
    NotCommitted {
        /// Rank 0's error.
        detail: String,
        /// Whether retrying cannot help, as rank 0 judged its error.
        permanent: bool,
    },
    /// Rank 0 was ready to commit only when a rank was about to stop waiting for the outcome (it
    /// was paused, its disk slow): committing then could have committed behind that rank's back,
    /// so it committed nothing.
    #[error(
        "not committed: rank 0 was ready to commit {ready_after:.1?} after rank {rank}'s report, but rank {rank} waits only {waits:?} for the outcome (and rank 0 keeps {margin:?} of that for the messages' way)"
    )]
    TooLateToCommit {
        /// The rank closest to giving up.
        rank: u32,
        /// How long it said it waits after its report.
        waits: Duration,
        /// The safety margin rank 0 keeps before that.
        margin: Duration,
        /// How long after its report arrived rank 0 was ready.
        ready_after: Duration,
    },
    /// A rank other than 0 did not hear how the save ended and found it not committed: either
    /// rank 0 did not say within the rank's wait that it commits (it then never will: it commits
    /// only after telling every rank, while each still waits) and no manifest of this save is
    /// there, or another save's manifest is there (so this one's can no longer be written).
    #[error(
        "checkpoint {checkpoint} is not committed: rank 0 did not answer rank {rank} within {waited:?} ({cause}), and {found}"
    )]
    NoAnswer {
        /// The checkpoint directory.
        checkpoint: String,
        /// This rank.
        rank: u32,
        /// How long it waited.
        waited: Duration,
        /// Why no answer came (the wait ran out, rank 0 is gone).
        cause: String,
        /// What the rank found there (`there is no manifest`).
        found: String,
    },
    /// Rank 0 said it commits, then did not say how that ended within the rank's wait, and the
    /// manifest was not there when the rank looked: rank 0 may still write it. Neither a failure
    /// nor a success; look at the checkpoint before using it or saving there again.
    #[error(
        "checkpoint {checkpoint}: not known whether it is committed: rank 0 began committing but did not answer rank {rank} within {waited:?} ({cause}), and there was no manifest when rank {rank} looked; rank 0 may still write it, so look for {checkpoint}/manifest.json before using or saving over it"
    )]
    OutcomeUnknown {
        /// The checkpoint directory.
        checkpoint: String,
        /// This rank.
        rank: u32,
        /// How long it waited for the outcome after rank 0 said it commits.
        waited: Duration,
        /// Why no outcome came.
        cause: String,
    },
    /// The checkpoint IS committed (its manifest is written: it opens and loads by its path), but
    /// a step after the commit point failed: moving `<run>/latest` to it, or removing the save's
    /// write claim. Not a failed save: saving it again is refused, since it exists.
    #[error("checkpoint {checkpoint} IS committed (its manifest is written), but {after}")]
    CommittedBut {
        /// The checkpoint directory.
        checkpoint: String,
        /// The step that did not happen.
        after: AfterCommit,
        /// The committed manifest.
        manifest: Box<Manifest>,
    },
    /// Another rank of a load job failed, so this one stopped: its error as it told the job's
    /// coordinator (`tessera_ops::job::transport_board`).
    #[error("rank {rank} failed {step}: {detail}")]
    RankFailed {
        /// The rank that failed first.
        rank: u32,
        /// What it was doing (`reading its pieces`).
        step: &'static str,
        /// Its error.
        detail: String,
    },
    /// A live publication the registry does not hold (`tessera live show`, `/v1/live/{name}`).
    #[error("no live publication {name} in registry {registry}")]
    UnknownPublication {
        /// The name asked for.
        name: String,
        /// The registry directory.
        registry: String,
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
            OpsError::Message { .. }
            | OpsError::Invalid { .. }
            | OpsError::Claimed { .. }
            | OpsError::UnknownPublication { .. } => true,
            OpsError::RanksFailed { .. }
            | OpsError::RankFailed { .. }
            | OpsError::TooLateToCommit { .. }
            | OpsError::NoAnswer { .. } => false,
            OpsError::NotCommitted { permanent, .. } => *permanent,
            // Saving again cannot repeat a commit that happened (or may have): the checkpoint is
            // to be looked at, not saved blindly again.
            OpsError::CommittedBut { .. } | OpsError::OutcomeUnknown { .. } => true,
            OpsError::Context { inner, .. } => inner.is_permanent(),
        }
    }

    /// Whether this error comes with a committed checkpoint ([`OpsError::CommittedBut`]): the
    /// save happened, and only a step after its commit point did not.
    pub fn is_committed(&self) -> bool {
        match self {
            OpsError::CommittedBut { .. } => true,
            OpsError::Context { inner, .. } => inner.is_committed(),
            _ => false,
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
