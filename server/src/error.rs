//! Errors of the API, each with its status and a stable `error` kind, answered as JSON
//! `{"error": <kind>, "detail": <message>}`. Internal and storage detail is logged where the
//! error is answered; the client gets a clear message, never a backtrace or a store's raw error.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use tessera_metadata::MetadataError;
use tessera_planner::PlanError;
use thiserror::Error;
use utoipa::ToSchema;

/// The JSON body of every error answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ErrorBody {
    /// Stable machine-readable kind: `bad_id`, `bad_request`, `unauthorized`,
    /// `unknown_checkpoint`, `incomplete_checkpoint`, `unknown_tensor`, `unknown_plan`,
    /// `unknown_rank`, `unknown_publication`, `no_registry`, `not_found`, `method_not_allowed`, `body_too_large`, `body_timeout`, `invalid_layout`,
    /// `invalid_requests`, `plan_too_large`, `invalid_checkpoint`, `storage_unavailable`,
    /// `busy`, `internal`.
    pub error: String,
    /// What went wrong, for people.
    ///
    /// Checkpoints that cannot be read answer 409 Conflict, with the reason here:
    /// `incomplete_checkpoint` (no manifest: the save did not commit) and `invalid_checkpoint`
    /// (corrupt or inconsistent metadata, or a run's `latest` pointer that names no valid
    /// checkpoint). 422 is kept for what the client sent (`invalid_layout`, `invalid_requests`).
    pub detail: String,
}

/// An error answered to a client.
#[derive(Clone, Debug, Error)]
#[non_exhaustive]
pub enum ApiError {
    /// A checkpoint id, plan id or rank that is not well formed (400).
    #[error("{detail}")]
    BadId {
        /// What is wrong.
        detail: String,
    },
    /// A request body or query that does not parse (400).
    #[error("{detail}")]
    BadRequest {
        /// What is wrong.
        detail: String,
    },
    /// Missing or wrong bearer token (401).
    #[error("this route needs the header Authorization: Bearer <token> with the server's token")]
    Unauthorized,
    /// No checkpoint (committed or not) with this id (404).
    #[error("no checkpoint {id} in the catalog")]
    UnknownCheckpoint {
        /// The id asked for.
        id: String,
    },
    /// A checkpoint directory without a manifest: an incomplete save, never loadable (409).
    #[error(
        "checkpoint {id} is incomplete (no manifest: the save did not commit), so it cannot be read or planned"
    )]
    IncompleteCheckpoint {
        /// The id asked for.
        id: String,
    },
    /// A tensor the checkpoint does not hold (404).
    #[error("checkpoint {id} has no tensor {fqn:?}")]
    UnknownTensor {
        /// Checkpoint id.
        id: String,
        /// The FQN asked for.
        fqn: String,
    },
    /// A plan id this server does not know (404).
    #[error("no plan {plan}: {why}")]
    UnknownPlan {
        /// The plan id.
        plan: String,
        /// Why, and what to do.
        why: String,
    },
    /// A rank at or past the plan's world size (404).
    #[error("plan {plan} has ranks 0..{world}; there is no rank {rank}")]
    UnknownRank {
        /// The plan id.
        plan: String,
        /// The rank asked for.
        rank: u32,
        /// The plan's world size.
        world: u32,
    },
    /// A live publication the registry does not hold (404).
    #[error("no live publication {name} in registry {registry}")]
    UnknownPublication {
        /// The name asked for.
        name: String,
        /// The registry directory.
        registry: String,
    },
    /// A live route on a server started without a registry (404).
    #[error(
        "this server lists no live publications: start it with --registry DIR (the directory publishers were given as registry=)"
    )]
    NoRegistry,
    /// No route for this path (404).
    #[error("no route {path}; see /openapi.json")]
    NotFound {
        /// The path asked for.
        path: String,
    },
    /// The route exists but not for this method (405).
    #[error("method not allowed on this route; see /openapi.json")]
    MethodNotAllowed,
    /// A request body over the limit (413).
    #[error("request body larger than the server's limit of {limit} bytes")]
    BodyTooLarge {
        /// The limit in bytes.
        limit: usize,
    },
    /// The request body did not arrive within the server's body timeout (408).
    #[error(
        "the request body did not arrive within {seconds} s (the server's body timeout); a stalled client is cut off"
    )]
    BodyTimeout {
        /// The timeout, in seconds.
        seconds: u64,
    },
    /// A layout the planner refuses (422), with the planner's reason.
    #[error("invalid layout: {reason}")]
    InvalidLayout {
        /// The planner's message.
        reason: String,
    },
    /// Explicit requests the planner refuses (422), with the planner's reason.
    #[error("invalid requests: {reason}")]
    InvalidRequests {
        /// The planner's message.
        reason: String,
    },
    /// A plan whose computation would take more memory than the server allows one plan (422).
    #[error(
        "planning this would take {estimate}, over this server's bound of {limit} bytes for one plan computation; plan fewer ranks or fewer tensors, or raise the bound (--plan-memory-mib)"
    )]
    PlanTooLarge {
        /// The planner's estimate, with its counts.
        estimate: String,
        /// The estimated bytes.
        bytes: u64,
        /// The server's bound.
        limit: u64,
    },
    /// Every plan computation slot is busy and the queue is full (503 with `Retry-After`).
    #[error(
        "the server is computing {running} plans with {queued} more waiting, its limit; retry in {retry_after} s"
    )]
    Busy {
        /// Computations running.
        running: usize,
        /// Computations waiting.
        queued: usize,
        /// Seconds to wait before retrying (the `Retry-After` header).
        retry_after: u64,
    },
    /// A checkpoint whose metadata fails its checks, or a run whose `latest` pointer is bad (409,
    /// like an incomplete checkpoint: the request is fine, the checkpoint on storage is not in a
    /// state that can be read; `detail` says why). Not a 500: nothing is wrong with the server.
    #[error("checkpoint {id} cannot be read: {reason}")]
    InvalidCheckpoint {
        /// Checkpoint id.
        id: String,
        /// The metadata reader's message.
        reason: String,
    },
    /// Storage did not answer or refused (503). `detail` is logged, not sent.
    #[error("storage unavailable while {action}")]
    StorageUnavailable {
        /// Verb phrase with the object, sent to the client.
        action: String,
        /// The store's error, logged only.
        detail: String,
    },
    /// A bug or an unexpected failure (500). `detail` is logged, not sent.
    #[error("internal error")]
    Internal {
        /// What happened, logged only.
        detail: String,
    },
}

impl ApiError {
    /// The HTTP status of this error.
    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::BadId { .. } | ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::UnknownCheckpoint { .. }
            | ApiError::UnknownTensor { .. }
            | ApiError::UnknownPlan { .. }
            | ApiError::UnknownRank { .. }
            | ApiError::UnknownPublication { .. }
            | ApiError::NoRegistry
            | ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::IncompleteCheckpoint { .. } | ApiError::InvalidCheckpoint { .. } => {
                StatusCode::CONFLICT
            }
            ApiError::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::BodyTimeout { .. } => StatusCode::REQUEST_TIMEOUT,
            ApiError::InvalidLayout { .. }
            | ApiError::InvalidRequests { .. }
            | ApiError::PlanTooLarge { .. } => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::StorageUnavailable { .. } | ApiError::Busy { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
        }
    }

    /// The stable `error` kind of the JSON body.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::BadId { .. } => "bad_id",
            ApiError::BadRequest { .. } => "bad_request",
            ApiError::Unauthorized => "unauthorized",
            ApiError::UnknownCheckpoint { .. } => "unknown_checkpoint",
            ApiError::IncompleteCheckpoint { .. } => "incomplete_checkpoint",
            ApiError::UnknownTensor { .. } => "unknown_tensor",
            ApiError::UnknownPlan { .. } => "unknown_plan",
            ApiError::UnknownRank { .. } => "unknown_rank",
            ApiError::UnknownPublication { .. } => "unknown_publication",
            ApiError::NoRegistry => "no_registry",
            ApiError::NotFound { .. } => "not_found",
            ApiError::MethodNotAllowed => "method_not_allowed",
            ApiError::BodyTooLarge { .. } => "body_too_large",
            ApiError::BodyTimeout { .. } => "body_timeout",
            ApiError::InvalidLayout { .. } => "invalid_layout",
            ApiError::InvalidRequests { .. } => "invalid_requests",
            ApiError::PlanTooLarge { .. } => "plan_too_large",
            ApiError::Busy { .. } => "busy",
            ApiError::InvalidCheckpoint { .. } => "invalid_checkpoint",
            ApiError::StorageUnavailable { .. } => "storage_unavailable",
            ApiError::Internal { .. } => "internal",
        }
    }

    /// A bad checkpoint, plan or rank id.
    pub(crate) fn bad_id(detail: impl Into<String>) -> Self {
        ApiError::BadId {
            detail: detail.into(),
        }
    }

    /// Maps an error of reading checkpoint `id`'s metadata.
    pub(crate) fn from_metadata(id: &str, error: &MetadataError) -> Self {
        match error {
            MetadataError::MissingManifest { .. } => {
                ApiError::IncompleteCheckpoint { id: id.to_string() }
            }
            MetadataError::Store {
                action,
                path,
                source,
            } => match source {
                object_store::Error::NotFound { .. } => ApiError::InvalidCheckpoint {
                    id: id.to_string(),
                    reason: format!("{path} is missing"),
                },
                _ => ApiError::StorageUnavailable {
                    action: format!("{action} {path}"),
                    detail: source.to_string(),
                },
            },
            other => ApiError::InvalidCheckpoint {
                id: id.to_string(),
                reason: other.to_string(),
            },
        }
    }

    /// Maps a planner error; `layout` says whether the job sent a layout or explicit requests.
    pub(crate) fn from_plan(error: &PlanError, layout: bool) -> Self {
        match error {
            PlanError::Arrow { detail } => ApiError::Internal {
                detail: format!("encoding a rank plan: {detail}"),
            },
            PlanError::TooLarge { estimate, limit } => ApiError::PlanTooLarge {
                estimate: estimate.to_string(),
                bytes: estimate.bytes,
                limit: *limit,
            },
            other if layout => ApiError::InvalidLayout {
                reason: other.to_string(),
            },
            other => ApiError::InvalidRequests {
                reason: other.to_string(),
            },
        }
    }

    /// Maps a storage error of `action` (a verb phrase naming the object).
    pub(crate) fn storage(action: impl Into<String>, error: &object_store::Error) -> Self {
        ApiError::StorageUnavailable {
            action: action.into(),
            detail: error.to_string(),
        }
    }
}

/// Moka hands an init error to every caller that waited on it, shared.
pub(crate) fn unshare(error: std::sync::Arc<ApiError>) -> ApiError {
    std::sync::Arc::try_unwrap(error).unwrap_or_else(|shared| (*shared).clone())
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = self.status();
        match &self {
            ApiError::StorageUnavailable { action, detail } => {
                tracing::warn!(%action, %detail, "storage unavailable");
            }
            ApiError::Internal { detail } => tracing::error!(%detail, "internal error"),
            ApiError::InvalidCheckpoint { id, reason } => {
                tracing::warn!(%id, %reason, "checkpoint metadata is invalid");
            }
            _ => tracing::debug!(status = status.as_u16(), error = %self, "request refused"),
        }
        let body = ErrorBody {
            error: self.kind().to_string(),
            detail: self.to_string(),
        };
        let mut response = (status, Json(body)).into_response();
        if let ApiError::Busy { retry_after, .. } = &self {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(*retry_after));
        }
        if status == StatusCode::UNAUTHORIZED {
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"tessera\""),
            );
        }
        response
    }
}

/// Errors of starting a server.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ServerError {
    /// The catalog root cannot be opened.
    #[error("catalog root: {0}")]
    Root(#[from] tessera_storage::StorageError),
    /// A configuration value that cannot work.
    #[error("invalid server configuration: {detail}")]
    Config {
        /// What is wrong.
        detail: String,
    },
    /// Serving failed (the listener broke).
    #[error("serving HTTP: {0}")]
    Io(#[from] std::io::Error),
}
