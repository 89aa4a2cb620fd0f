//! The live routes: the registry's publications, and one publication with its steps.

use axum::Json;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{Path, Query, State};
use serde::Deserialize;
use utoipa::IntoParams;

use super::checkpoints::path_error;
use crate::live::{self, DEFAULT_LIVE_STEPS, LiveListing, LivePublication, MAX_LIVE_STEPS};
use crate::{ApiError, AppState, ErrorBody};

/// Query of the live routes.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub(crate) struct StepsQuery {
    /// Steps of each publication to list, newest first (default 10, at most 1000); the newest
    /// complete step is summarized whatever this says.
    steps: Option<usize>,
}

fn steps_of(query: Result<Query<StepsQuery>, QueryRejection>) -> Result<usize, ApiError> {
    let Query(query) = query.map_err(|e| ApiError::BadRequest {
        detail: format!("invalid query: {}", e.body_text()),
    })?;
    let steps = query.steps.unwrap_or(DEFAULT_LIVE_STEPS);
    if steps > MAX_LIVE_STEPS {
        return Err(ApiError::BadRequest {
            detail: format!("steps {steps} is over the maximum of {MAX_LIVE_STEPS}"),
        });
    }
    Ok(steps)
}

/// The registry's live publications (`tessera.publish`), each with its newest steps.
#[utoipa::path(get, path = "/v1/live", tag = "live",
    params(StepsQuery),
    responses(
        (status = 200, description = "The registry's publications", body = LiveListing),
        (status = 400, description = "Malformed query", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "The server has no registry (`no_registry`)", body = ErrorBody),
        (status = 503, description = "The registry cannot be read", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn list(
    State(state): State<AppState>,
    query: Result<Query<StepsQuery>, QueryRejection>,
) -> Result<Json<LiveListing>, ApiError> {
    let steps = steps_of(query)?;
    let registry = live::registry_of(state.config().registry.as_ref())?;
    Ok(Json(live::list(registry, steps).await?))
}

/// One live publication: its newest complete step (what `live://NAME` loads) and its newest
/// steps with their state, publisher ranks and servers, bytes and times.
#[utoipa::path(get, path = "/v1/live/{name}", tag = "live",
    params(
        ("name" = String, Path, description = "Publication name (`live://NAME`)"),
        StepsQuery,
    ),
    responses(
        (status = 200, description = "The publication", body = LivePublication),
        (status = 400, description = "Malformed name or query", body = ErrorBody),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
        (status = 404, description = "No such publication (`unknown_publication`), or the server has no registry (`no_registry`)", body = ErrorBody),
        (status = 503, description = "The registry cannot be read", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn publication(
    State(state): State<AppState>,
    path: Result<Path<String>, PathRejection>,
    query: Result<Query<StepsQuery>, QueryRejection>,
) -> Result<Json<LivePublication>, ApiError> {
    let Path(name) = path.map_err(path_error)?;
    let steps = steps_of(query)?;
    let registry = live::registry_of(state.config().registry.as_ref())?;
    Ok(Json(live::publication(registry, name, steps).await?))
}
