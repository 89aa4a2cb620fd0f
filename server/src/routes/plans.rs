//! The plan routes: create a plan (once per checkpoint + target + options), read it back, and
//! hand each rank its own plan as JSON or Arrow IPC; for people, every rank's totals and one
//! rank's plan summed up (`plan_views`).

use std::sync::Arc;

use axum::Json;
use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, PathRejection};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use utoipa::ToSchema;

use super::ARROW_STREAM;
use super::checkpoints::path_error;
use crate::middleware::BodyTimedOut;
use crate::plans::{PlanEntry, check_plan_id, parse_request};
use crate::{
    ApiError, AppState, ErrorBody, PlanCreated, PlanRequest, RankOverview, RankSummaries,
    ServerConfig,
};

/// One rank's plan as JSON (the planner's `RankPlan`): destinations, pieces with their file
/// runs and placements, ring exchanges, totals.
#[derive(ToSchema)]
#[allow(dead_code)] // Only describes the JSON for the OpenAPI document.
pub(crate) struct RankPlanJson {
    /// This rank.
    rank: u32,
    /// World size.
    world: u32,
    /// Data files this rank reads, relative to the checkpoint.
    files: Vec<String>,
    /// Tensors this rank touches (`fqn`, `dtype`, `shape`).
    #[schema(value_type = Vec<Object>)]
    tensors: Vec<()>,
    /// Destination buffers, in request order.
    #[schema(value_type = Vec<Object>)]
    destinations: Vec<()>,
    /// Pieces this rank needs, in piece-id order.
    #[schema(value_type = Vec<Object>)]
    pieces: Vec<()>,
    /// Ring exchanges, by group id.
    #[schema(value_type = Vec<Object>)]
    exchanges: Vec<()>,
    /// Totals (`bytes_needed`, `bytes_read`, `bytes_sent`, `bytes_received`).
    #[schema(value_type = Object)]
    summary: (),
}

/// An Arrow IPC stream (the planner's rank plan encoding).
#[derive(ToSchema)]
#[schema(value_type = String, format = Binary)]
pub(crate) struct ArrowStream(#[allow(dead_code)] Vec<u8>);

fn body_error(rejection: BytesRejection, config: &ServerConfig) -> ApiError {
    if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
        ApiError::BodyTooLarge {
            limit: config.body_limit,
        }
    } else if timed_out(&rejection) {
        ApiError::BodyTimeout {
            seconds: config.body_timeout.as_secs(),
        }
    } else {
        ApiError::BadRequest {
            detail: format!("cannot read the body: {}", rejection.body_text()),
        }
    }
}

/// Whether reading the body failed because its deadline passed: the error sits somewhere down
/// the rejection's source chain (axum wraps it in its own error types).
fn timed_out(rejection: &BytesRejection) -> bool {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(rejection);
    while let Some(error) = source {
        if error.is::<BodyTimedOut>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// Plans a checkpoint for a layout or explicit requests. The same request gets the same plan
/// id, and is computed once however many ranks send it at once.
#[utoipa::path(post, path = "/v1/plans", tag = "plans",
    request_body = PlanRequest,
    responses(
        (status = 200, description = "The plan id and totals", body = PlanCreated),
        (status = 400, description = "Malformed body or checkpoint id", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such checkpoint", body = ErrorBody),
        (status = 409, description = "The checkpoint is incomplete (`incomplete_checkpoint`) or its metadata is invalid (`invalid_checkpoint`), or the run's `latest` pointer is bad; `detail` says why", body = ErrorBody),
        (status = 408, description = "The body did not arrive within the server's body timeout (`body_timeout`)", body = ErrorBody),
        (status = 413, description = "Body over the limit", body = ErrorBody),
        (status = 422, description = "The planner refuses the layout or requests (its reason in detail): also more ranks than the server plans, a request with both a box (`offsets`/`lengths`) and `flat`, or planning them would take more memory than the server's bound (`plan_too_large`, the estimate in detail)", body = ErrorBody),
        (status = 503, description = "Storage is unavailable, or every planning slot and the queue are taken (`busy`, with Retry-After)", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn create(
    State(state): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<PlanCreated>, ApiError> {
    let body = body.map_err(|e| body_error(e, state.config()))?;
    let mut request = parse_request(&body)?;
    let inner = &state.inner;
    // The ranks read what this catalog holds: local files when its root is local, so the read
    // order's cost model prices a request as a loader planning from the same files would.
    request.options.local_reads = inner.local_root.is_some();
    let entry = inner.plans.create(&inner.catalog, request).await?;
    Ok(Json(entry.created()))
}

/// A plan's id and totals.
#[utoipa::path(get, path = "/v1/plans/{plan}", tag = "plans",
    params(("plan" = String, Path, description = "Plan id (32 hex digits)")),
    responses(
        (status = 200, description = "The plan id and totals", body = PlanCreated),
        (status = 400, description = "Malformed plan id", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "Unknown plan, or one made for a version of the checkpoint that was saved again since", body = ErrorBody),
        (status = 409, description = "The plan's checkpoint cannot be read now (incomplete or invalid)", body = ErrorBody),
        (status = 503, description = "Storage is unavailable", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn get_plan(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<PlanCreated>, ApiError> {
    let Path(plan) = path.map_err(path_error)?;
    let entry = plan_entry(&state, &plan).await?;
    Ok(Json(entry.created()))
}

/// One rank's plan: JSON, or Arrow IPC with `Accept: application/vnd.apache.arrow.stream`.
#[utoipa::path(get, path = "/v1/plans/{plan}/ranks/{rank}", tag = "plans",
    params(
        ("plan" = String, Path, description = "Plan id (32 hex digits)"),
        ("rank" = u32, Path, description = "Rank, 0 to world - 1"),
    ),
    responses(
        (status = 200, description = "The rank's plan", content(
            (RankPlanJson = "application/json"),
            (ArrowStream = "application/vnd.apache.arrow.stream"),
        )),
        (status = 400, description = "Malformed plan id or rank", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "Unknown plan or rank, or a plan made for a version of the checkpoint that was saved again since", body = ErrorBody),
        (status = 409, description = "The plan's checkpoint cannot be read now (incomplete or invalid)", body = ErrorBody),
        (status = 503, description = "Storage is unavailable", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn rank(
    State(state): State<AppState>,
    headers: HeaderMap,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Response, ApiError> {
    let Path((plan, rank)) = path.map_err(path_error)?;
    let (entry, rank) = rank_entry(&state, plan, &rank).await?;
    let arrow = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|v| {
            v.split(';')
                .next()
                .is_some_and(|t| t.trim() == ARROW_STREAM)
        });
    // Extracting and encoding a rank's plan walks its pieces: off the async workers.
    let encoded = off_workers("the rank plan task", move || {
        let rank_plan = entry
            .plan
            .rank_plan(rank)
            .map_err(|e| ApiError::from_plan(&e, true))?;
        if arrow {
            rank_plan
                .to_arrow_ipc()
                .map_err(|e| ApiError::from_plan(&e, true))
        } else {
            serde_json::to_vec(&rank_plan).map_err(|e| ApiError::Internal {
                detail: format!("encoding rank {rank}'s plan as JSON: {e}"),
            })
        }
    })
    .await??;
    let content_type = if arrow {
        ARROW_STREAM
    } else {
        "application/json"
    };
    Ok(([(header::CONTENT_TYPE, content_type)], encoded).into_response())
}

/// Every rank's totals in one small answer (columns: entry `r` of each list is rank `r`'s), and
/// the layout's mesh: what a preview of thousands of ranks draws from.
#[utoipa::path(get, path = "/v1/plans/{plan}/ranks", tag = "plans",
    params(("plan" = String, Path, description = "Plan id (32 hex digits)")),
    responses(
        (status = 200, description = "Per-rank totals", body = RankSummaries),
        (status = 400, description = "Malformed plan id", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "Unknown plan, or one made for a version of the checkpoint that was saved again since", body = ErrorBody),
        (status = 409, description = "The plan's checkpoint cannot be read now (incomplete or invalid)", body = ErrorBody),
        (status = 503, description = "Storage is unavailable", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn ranks(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
) -> Result<Json<RankSummaries>, ApiError> {
    let Path(plan) = path.map_err(path_error)?;
    let entry = plan_entry(&state, &plan).await?;
    // One pass over every piece of the plan: off the async workers.
    let task_entry = Arc::clone(&entry);
    let columns = off_workers("the rank totals task", move || task_entry.rank_columns()).await?;
    Ok(Json(RankSummaries {
        plan: entry.id.clone(),
        world: entry.plan.world_size(),
        mesh: entry.mesh.clone(),
        ranks: columns.as_ref().clone(),
    }))
}

/// One rank's plan summed up: totals, reads by data file, and its exchange rings with the
/// partner of every round. Small whatever the plan's size, unlike the full rank plan.
#[utoipa::path(get, path = "/v1/plans/{plan}/ranks/{rank}/overview", tag = "plans",
    params(
        ("plan" = String, Path, description = "Plan id (32 hex digits)"),
        ("rank" = u32, Path, description = "Rank, 0 to world - 1"),
    ),
    responses(
        (status = 200, description = "The rank's plan, summed up", body = RankOverview),
        (status = 400, description = "Malformed plan id or rank", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "Unknown plan or rank, or a plan made for a version of the checkpoint that was saved again since", body = ErrorBody),
        (status = 409, description = "The plan's checkpoint cannot be read now (incomplete or invalid)", body = ErrorBody),
        (status = 503, description = "Storage is unavailable", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn rank_overview(
    State(state): State<AppState>,
    path: Result<Path<(String, String)>, PathRejection>,
) -> Result<Json<RankOverview>, ApiError> {
    let Path((plan, rank)) = path.map_err(path_error)?;
    let (entry, rank) = rank_entry(&state, plan, &rank).await?;
    off_workers("the rank overview task", move || {
        let rank_plan = entry
            .plan
            .rank_plan(rank)
            .map_err(|e| ApiError::from_plan(&e, true))?;
        Ok(Json(RankOverview::new(&entry.id, &rank_plan)))
    })
    .await?
}

/// The plan `plan` names, after checking the id's form (a malformed id is 400, not 404).
async fn plan_entry(state: &AppState, plan: &str) -> Result<Arc<PlanEntry>, ApiError> {
    check_plan_id(plan)?;
    let inner = &state.inner;
    inner.plans.get(&inner.catalog, plan).await
}

/// The plan and the rank a `/v1/plans/{plan}/ranks/{rank}…` path names: the rank parsed (400)
/// and checked against the plan's world (404) once the plan is known.
async fn rank_entry(
    state: &AppState,
    plan: String,
    rank: &str,
) -> Result<(Arc<PlanEntry>, u32), ApiError> {
    check_plan_id(&plan)?;
    let rank = parse_rank(rank)?;
    let inner = &state.inner;
    let entry = inner.plans.get(&inner.catalog, &plan).await?;
    let world = entry.plan.world_size();
    if rank >= world {
        return Err(ApiError::UnknownRank { plan, rank, world });
    }
    Ok((entry, rank))
}

/// Runs `work` (a walk over a plan's pieces) on the blocking pool, off the async workers; a task
/// that did not finish is an internal error naming `what`.
async fn off_workers<T: Send + 'static>(
    what: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(work)
        .await
        .map_err(|e| ApiError::Internal {
            detail: format!("{what} failed: {e}"),
        })
}

fn parse_rank(rank: &str) -> Result<u32, ApiError> {
    rank.parse().map_err(|_| {
        ApiError::bad_id(format!(
            "rank {:?} is not a number",
            crate::id::truncate(rank)
        ))
    })
}
