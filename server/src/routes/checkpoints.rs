//! The catalog routes: checkpoints, one checkpoint's summary, its tensors, one tensor's boxes.

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use serde::Deserialize;
use tessera_planner::glob_match;
use utoipa::IntoParams;

use crate::{
    ApiError, AppState, CatalogResponse, CheckpointId, CheckpointSummary, ErrorBody, SavedBox,
    TensorDetail, TensorEntry, TensorPage,
};

/// Default and largest page of the tensor table: a 405B checkpoint has ~3000 tensors with
/// optimizer states, so one page of 10000 holds any model, while the default stays light.
const DEFAULT_LIMIT: u64 = 100;
const MAX_LIMIT: u64 = 10_000;

/// Longest filter accepted (a glob is matched against every tensor name).
const MAX_FILTER: usize = 1024;

/// Query of the tensor table.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct TensorQuery {
    /// Keep tensors whose FQN contains this text, or matches it as a glob when it has `*` or `?`.
    filter: Option<String>,
    /// Index of the first matching tensor to return (default 0).
    offset: Option<u64>,
    /// Most tensors to return (default 100, at most 10000).
    limit: Option<u64>,
}

/// Maps a path that does not decode (bad UTF-8 after percent-decoding) to a 400.
pub(crate) fn path_error(rejection: PathRejection) -> ApiError {
    ApiError::bad_id(format!(
        "the path does not decode: {}",
        rejection.body_text()
    ))
}

fn checkpoint_id(
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<CheckpointId, ApiError> {
    let Path((run, step)) = path.map_err(path_error)?;
    CheckpointId::from_parts(&run, &step)
}

/// The catalog: runs, their `latest` pointers, and every checkpoint with its status; with a
/// registry, its live publications next to them (`live`).
#[utoipa::path(get, path = "/v1/checkpoints", tag = "catalog",
    responses(
        (status = 200, description = "The catalog", body = CatalogResponse),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 503, description = "Storage is unavailable", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn list(State(state): State<AppState>) -> Result<Json<CatalogResponse>, ApiError> {
    let listing = state.inner.catalog.list().await?;
    let mut listing = listing.as_ref().clone();
    if let Some(registry) = state.config().registry.clone() {
        // The checkpoints stay listed when the registry cannot be read; the section says why.
        listing.live = Some(match crate::live::list(registry.clone(), 0).await {
            Ok(live) => live,
            Err(e) => crate::LiveListing {
                registry: registry.display().to_string(),
                publications: Vec::new(),
                problems: vec![e.to_string()],
            },
        });
    }
    Ok(Json(listing))
}

/// One checkpoint: catalog entry, counts and the layout it was saved with. An incomplete
/// checkpoint answers 200 with `"status": "incomplete"`.
#[utoipa::path(get, path = "/v1/checkpoints/{run}/{step}", tag = "catalog",
    params(
        ("run" = String, Path, description = "Run name"),
        ("step" = String, Path, description = "Checkpoint directory name (e.g. step-000100), or `latest`"),
    ),
    responses(
        (status = 200, description = "The checkpoint", body = CheckpointSummary),
        (status = 400, description = "Malformed id", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such checkpoint", body = ErrorBody),
        (status = 409, description = "The checkpoint's metadata is invalid (`invalid_checkpoint`), or the run's `latest` pointer is bad; `detail` says why", body = ErrorBody),
        (status = 503, description = "Storage is unavailable", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn summary(
    State(state): State<AppState>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<CheckpointSummary>, ApiError> {
    let id = checkpoint_id(path)?;
    Ok(Json(state.inner.catalog.summary(&id).await?))
}

/// The tensor table of a committed checkpoint, filtered and paged.
#[utoipa::path(get, path = "/v1/checkpoints/{run}/{step}/tensors", tag = "catalog",
    params(
        ("run" = String, Path, description = "Run name"),
        ("step" = String, Path, description = "Checkpoint directory name, or `latest`"),
        TensorQuery,
    ),
    responses(
        (status = 200, description = "A page of tensors", body = TensorPage),
        (status = 400, description = "Malformed id or query", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such checkpoint", body = ErrorBody),
        (status = 409, description = "The checkpoint is incomplete (`incomplete_checkpoint`) or its metadata is invalid (`invalid_checkpoint`), or the run's `latest` pointer is bad; `detail` says why", body = ErrorBody),
        (status = 503, description = "Storage is unavailable", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn tensors(
    State(state): State<AppState>,
    path: Result<Path<(String, String)>, PathRejection>,
    query: Result<Query<TensorQuery>, QueryRejection>,
) -> Result<Json<TensorPage>, ApiError> {
    let id = checkpoint_id(path)?;
    let Query(query) = query.map_err(|e| ApiError::BadRequest {
        detail: format!("invalid query: {}", e.body_text()),
    })?;
    let offset = query.offset.unwrap_or(0);
    let limit = query.limit.unwrap_or(DEFAULT_LIMIT);
    if limit > MAX_LIMIT {
        return Err(ApiError::BadRequest {
            detail: format!("limit {limit} is over the maximum of {MAX_LIMIT}"),
        });
    }
    let filter = query.filter.unwrap_or_default();
    if filter.len() > MAX_FILTER {
        return Err(ApiError::BadRequest {
            detail: format!("filter is longer than {MAX_FILTER} bytes"),
        });
    }
    let glob = filter.contains(['*', '?']);
    let opened = state.inner.catalog.open(&id).await?;
    let meta = &opened.meta;
    let matching = meta.tensors().iter().enumerate().filter(|(_, t)| {
        filter.is_empty()
            || if glob {
                glob_match(&filter, &t.fqn)
            } else {
                t.fqn.contains(filter.as_str())
            }
    });
    let mut total = 0u64;
    let mut page = Vec::new();
    for (index, _) in matching {
        if total >= offset && (page.len() as u64) < limit {
            page.push(TensorEntry::new(meta, index as u32));
        }
        total += 1;
    }
    Ok(Json(TensorPage {
        checkpoint: opened.id.to_string(),
        total,
        offset,
        limit,
        tensors: page,
    }))
}

/// One tensor: dtype, shape and every saved box with its file and byte range.
#[utoipa::path(get, path = "/v1/checkpoints/{run}/{step}/tensors/{fqn}", tag = "catalog",
    params(
        ("run" = String, Path, description = "Run name"),
        ("step" = String, Path, description = "Checkpoint directory name, or `latest`"),
        ("fqn" = String, Path, description = "Tensor FQN (percent-encode any `/`)"),
    ),
    responses(
        (status = 200, description = "The tensor's saved boxes", body = TensorDetail),
        (status = 400, description = "Malformed id", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such checkpoint or tensor", body = ErrorBody),
        (status = 409, description = "The checkpoint is incomplete (`incomplete_checkpoint`) or its metadata is invalid (`invalid_checkpoint`), or the run's `latest` pointer is bad; `detail` says why", body = ErrorBody),
        (status = 503, description = "Storage is unavailable", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn tensor(
    State(state): State<AppState>,
    path: Result<Path<(String, String, String)>, PathRejection>,
) -> Result<Json<TensorDetail>, ApiError> {
    let Path((run, step, fqn)) = path.map_err(path_error)?;
    let id = CheckpointId::from_parts(&run, &step)?;
    let opened = state.inner.catalog.open(&id).await?;
    let meta = &opened.meta;
    let Some(index) = meta.tensor_index(&fqn) else {
        return Err(ApiError::UnknownTensor {
            id: opened.id.to_string(),
            fqn: crate::id::truncate(&fqn),
        });
    };
    Ok(Json(TensorDetail {
        checkpoint: opened.id.to_string(),
        tensor: TensorEntry::new(meta, index),
        saved: SavedBox::of_tensor(meta, index),
    }))
}
