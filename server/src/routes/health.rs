//! Liveness, readiness, metrics and the OpenAPI document.

use axum::Extension;
use axum::Json;
use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::OpenApiJson;
use crate::metrics::{CacheKind, OPENMETRICS_TEXT, PROMETHEUS_TEXT};
use crate::{ApiError, AppState, ErrorBody};

/// `{"status": ...}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Status {
    /// `ok` (alive) or `ready`.
    pub status: String,
}

/// Liveness: the process answers.
#[utoipa::path(get, path = "/healthz", tag = "ops",
    responses((status = 200, description = "The server is alive", body = Status)))]
pub(crate) async fn healthz() -> Json<Status> {
    Json(Status {
        status: "ok".to_string(),
    })
}

/// Readiness: the catalog root can be listed.
#[utoipa::path(get, path = "/readyz", tag = "ops",
    responses(
        (status = 200, description = "The catalog root is readable", body = Status),
        (status = 503, description = "Storage is unavailable", body = ErrorBody),
    ))]
pub(crate) async fn readyz(State(state): State<AppState>) -> Result<Json<Status>, ApiError> {
    // LocalFileSystem lists a missing directory as empty, so check that it is there.
    if let Some(dir) = &state.inner.local_root {
        match tokio::fs::metadata(dir).await {
            Ok(meta) if meta.is_dir() => {}
            Ok(_) => {
                return Err(ApiError::StorageUnavailable {
                    action: "opening the catalog root (not a directory)".to_string(),
                    detail: dir.display().to_string(),
                });
            }
            Err(e) => {
                return Err(ApiError::StorageUnavailable {
                    action: "opening the catalog root".to_string(),
                    detail: format!("{}: {e}", dir.display()),
                });
            }
        }
    }
    let catalog = &state.inner.catalog;
    catalog
        .store()
        .list_with_delimiter(Some(catalog.root()))
        .await
        .map_err(|e| ApiError::storage("listing the catalog root", &e))?;
    Ok(Json(Status {
        status: "ready".to_string(),
    }))
}

/// Prometheus metrics in the OpenMetrics text format: typed `application/openmetrics-text` for
/// scrapers that ask for it (Prometheus does), `text/plain; version=0.0.4` for everyone else.
/// Needs the token when the server has one (a scraper sends it as a bearer token).
#[utoipa::path(get, path = "/metrics", tag = "ops",
    responses(
        (status = 200, description = "Metrics", content(
            (String = "text/plain; version=0.0.4"),
            (String = "application/openmetrics-text; version=1.0.0"),
        )),
        (status = 401, description = "Missing or wrong token", body = ErrorBody),
    ),
    security(("bearer" = [])))]
pub(crate) async fn metrics(State(state): State<AppState>, headers: HeaderMap) -> Response {
    let inner = &state.inner;
    let (meta_entries, meta_bytes) = inner.catalog.meta_usage().await;
    let (plan_entries, plan_bytes) = inner.plans.usage().await;
    let text = inner.metrics.render(&[
        (CacheKind::Metadata, meta_entries, meta_bytes),
        (CacheKind::Plan, plan_entries, plan_bytes),
    ]);
    let openmetrics = headers
        .get_all(header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"));
    let content_type = if openmetrics {
        OPENMETRICS_TEXT
    } else {
        PROMETHEUS_TEXT
    };
    ([(header::CONTENT_TYPE, content_type)], text).into_response()
}

/// This API's OpenAPI document.
#[utoipa::path(get, path = "/openapi.json", tag = "ops",
    responses((status = 200, description = "OpenAPI 3.1 document", body = Object)))]
pub(crate) async fn openapi_json(Extension(doc): Extension<OpenApiJson>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        doc.0.as_ref().clone(),
    )
        .into_response()
}
