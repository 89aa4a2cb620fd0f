//! Live publications (`tessera.publish`) in the registry directory the server was given
//! (`--registry`): the API types of `/v1/live`, `/v1/live/{name}` and the catalog's `live`
//! section, built from `tessera_ops::publish::listing` (which reads the registry and says each
//! step's state). Listing reads small files on the local file system, so it runs on the
//! blocking pool; nothing is cached, so a step shows the moment its manifest is written.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use tessera_ops::OpsError;
use tessera_ops::publish::listing::{
    self, ListOptions, PublicationEntry, PublisherEntry, RegistryListing, StepEntry,
};
use utoipa::ToSchema;

use crate::ApiError;

/// Steps of each publication `/v1/live/{name}` and `/v1/live` list unless `?steps=` says.
pub const DEFAULT_LIVE_STEPS: usize = listing::DEFAULT_LISTED_STEPS;
/// Most steps of each publication one answer lists: each step read is a few small files, so
/// this bounds an answer's reads to thousands of files however long a job has published.
pub const MAX_LIVE_STEPS: usize = 1000;

/// One publisher rank of a step: where it serves its data file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LivePublisher {
    /// The publisher rank.
    pub rank: u32,
    /// Its server's origin, `http://host:port`.
    pub url: String,
    /// The data file's path on that server.
    pub path: String,
    /// Bytes of its data file, as its part says.
    pub bytes: Option<u64>,
}

/// One step of a live publication.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LiveStep {
    /// The step.
    pub step: u64,
    /// `complete` (loadable as `live://NAME@STEP`), `incomplete` (a rank's part is missing, or
    /// rank 0 has not committed it) or `retired` (committed, then superseded or retired).
    pub state: String,
    /// Why it is not complete, in words.
    pub detail: Option<String>,
    /// The publishing job's ranks, as its parts say.
    pub world: Option<u32>,
    /// Ranks whose parts are there.
    pub ranks: Vec<u32>,
    /// Ranks whose parts are missing (or do not read: see `problems`).
    pub missing_ranks: Vec<u32>,
    /// Each rank's server.
    pub publishers: Vec<LivePublisher>,
    /// Bytes the publishers serve.
    pub bytes: Option<u64>,
    /// Bytes of all tensors, each element once (committed steps).
    pub tensor_bytes: Option<u64>,
    /// Tensors.
    pub tensors: Option<u64>,
    /// When the last part was written, RFC 3339.
    pub published: Option<String>,
    /// When rank 0 committed it, RFC 3339.
    pub committed: Option<String>,
    /// Consumers' lease files on it.
    pub leases: u64,
    /// Files of the step that could not be read, each naming the file.
    pub problems: Vec<String>,
}

/// A live publication: its newest complete step in brief, and its newest steps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LivePublication {
    /// The name (`live://NAME`).
    pub name: String,
    /// The step `live://NAME` loads now.
    pub newest_complete: Option<u64>,
    /// The newest step of any state.
    pub newest: Option<u64>,
    /// Steps of any state.
    pub steps_total: u64,
    /// Of the newest complete step: the publishing job's ranks.
    pub world: Option<u32>,
    /// Of the newest complete step: its publishers.
    pub publishers: Vec<LivePublisher>,
    /// Of the newest complete step: bytes served.
    pub bytes: Option<u64>,
    /// Of the newest complete step: tensors.
    pub tensors: Option<u64>,
    /// The newest steps, newest first (`?steps=`; none in the catalog's section).
    pub steps: Vec<LiveStep>,
    /// Whether older steps were left out of `steps`.
    pub steps_truncated: bool,
}

/// `GET /v1/live`, and the catalog's `live` section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct LiveListing {
    /// The registry directory.
    pub registry: String,
    /// Publications, by name.
    pub publications: Vec<LivePublication>,
    /// Registry entries that could not be read, each naming the entry.
    pub problems: Vec<String>,
}

impl From<PublisherEntry> for LivePublisher {
    fn from(p: PublisherEntry) -> Self {
        Self {
            rank: p.rank,
            url: p.url,
            path: p.path,
            bytes: p.bytes,
        }
    }
}

impl From<StepEntry> for LiveStep {
    fn from(s: StepEntry) -> Self {
        Self {
            step: s.step,
            state: s.state.as_str().to_string(),
            detail: s.detail,
            world: s.world,
            ranks: s.ranks,
            missing_ranks: s.missing_ranks,
            publishers: s.publishers.into_iter().map(Into::into).collect(),
            bytes: s.bytes,
            tensor_bytes: s.tensor_bytes,
            tensors: s.tensors,
            published: s.published,
            committed: s.committed,
            leases: s.leases,
            problems: s.problems,
        }
    }
}

impl From<PublicationEntry> for LivePublication {
    fn from(p: PublicationEntry) -> Self {
        Self {
            name: p.name,
            newest_complete: p.newest_complete,
            newest: p.newest,
            steps_total: p.steps_total,
            world: p.world,
            publishers: p.publishers.into_iter().map(Into::into).collect(),
            bytes: p.bytes,
            tensors: p.tensors,
            steps: p.steps.into_iter().map(Into::into).collect(),
            steps_truncated: p.steps_truncated,
        }
    }
}

impl From<RegistryListing> for LiveListing {
    fn from(l: RegistryListing) -> Self {
        Self {
            registry: l.registry,
            publications: l.publications.into_iter().map(Into::into).collect(),
            problems: l.problems,
        }
    }
}

/// The registry this server lists, or the 404 saying it has none.
pub(crate) fn registry_of(registry: Option<&PathBuf>) -> Result<PathBuf, ApiError> {
    registry.cloned().ok_or(ApiError::NoRegistry)
}

/// Maps a listing error: an unknown publication is 404, an unreadable registry the storage's
/// (503).
fn api_error(registry: &Path, error: OpsError) -> ApiError {
    match error {
        OpsError::UnknownPublication { name, registry } => {
            ApiError::UnknownPublication { name, registry }
        }
        other => ApiError::StorageUnavailable {
            action: format!("listing the registry {}", registry.display()),
            detail: other.to_string(),
        },
    }
}

/// Every publication of `registry`, `steps` steps each.
pub(crate) async fn list(registry: PathBuf, steps: usize) -> Result<LiveListing, ApiError> {
    let options = ListOptions { steps };
    tokio::task::spawn_blocking(move || {
        listing::list_registry(&registry, &options)
            .map(LiveListing::from)
            .map_err(|e| api_error(&registry, e))
    })
    .await
    .map_err(|e| ApiError::Internal {
        detail: format!("listing the registry: {e}"),
    })?
}

/// The publication `name` of `registry`, `steps` steps.
pub(crate) async fn publication(
    registry: PathBuf,
    name: String,
    steps: usize,
) -> Result<LivePublication, ApiError> {
    // A name that is not one (`..`, a slash) is the client's mistake, and never touches the
    // file system.
    listing::check_name(&name).map_err(|e| ApiError::bad_id(e.to_string()))?;
    let options = ListOptions { steps };
    tokio::task::spawn_blocking(move || {
        listing::list_publication(&registry, &name, &options)
            .map(LivePublication::from)
            .map_err(|e| api_error(&registry, e))
    })
    .await
    .map_err(|e| ApiError::Internal {
        detail: format!("listing a publication: {e}"),
    })?
}
