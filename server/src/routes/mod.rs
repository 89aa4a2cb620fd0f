//! The router: every API route is a handler annotated with `#[utoipa::path]` and registered
//! through `utoipa_axum::routes!`, so the route table and the OpenAPI document come from one
//! definition and cannot drift apart.
//!
//! | route | answer |
//! |---|---|
//! | `GET /healthz`, `/readyz`, `/metrics`, `/openapi.json`, `/` | liveness, readiness (root readable), Prometheus text, this API, the web UI |
//! | `GET /v1/checkpoints` | catalog: runs, checkpoints (committed, incomplete, invalid), `latest` |
//! | `GET /v1/checkpoints/{run}/{step}` | summary incl. source layout (`step` may be `latest`) |
//! | `GET /v1/checkpoints/{run}/{step}/tensors` | tensor table: `filter` (substring, or glob with `*` `?`), `offset`, `limit` |
//! | `GET /v1/checkpoints/{run}/{step}/tensors/{fqn}` | saved boxes with files and byte ranges |
//! | `POST /v1/plans` | plan a checkpoint for a layout or explicit requests: plan id + summary |
//! | `GET /v1/plans/{plan}` | the same answer for a known plan |
//! | `GET /v1/plans/{plan}/ranks` | every rank's totals in columns (bytes read, sent, received, pieces, rounds) and the mesh |
//! | `GET /v1/plans/{plan}/ranks/{rank}/overview` | one rank's reads by file and ring partners |
//! | `GET /v1/plans/{plan}/ranks/{rank}` | one rank's plan, JSON or (`Accept: application/vnd.apache.arrow.stream`) Arrow IPC |
//! | `GET /v1/live` | live publications of the registry (`--registry`): each one's newest complete step, publisher ranks, bytes, newest steps (`steps`) |
//! | `GET /v1/live/{name}` | one publication and its newest steps: state (complete, incomplete naming missing ranks, retired), publishers, bytes, times |
//!
//! With a token, every `/v1` route and `/metrics` need it; the probes (`/healthz`, `/readyz`),
//! the OpenAPI document and the web UI's files stay open.

mod checkpoints;
mod health;
mod live;
mod plans;
mod ui;

use std::sync::Arc;

use axum::body::Body;
use axum::extract::DefaultBodyLimit;
use axum::http::Request;
use axum::routing::get;
use axum::{Extension, Router, middleware as axum_middleware};
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::cors::{AllowOrigin, CorsLayer};
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::services::ServeDir;
use tower_http::trace::{DefaultOnResponse, TraceLayer};
use tracing::Level;
use utoipa::openapi::OpenApi;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

use crate::AppState;
use crate::middleware::{
    body_deadline, method_not_allowed, not_found, panic_response, record_metrics, require_token,
};

/// The media type of Arrow IPC rank plans.
pub const ARROW_STREAM: &str = "application/vnd.apache.arrow.stream";

/// The OpenAPI document, serialized once.
#[derive(Clone)]
pub(crate) struct OpenApiJson(pub Arc<Vec<u8>>);

fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(health::healthz))
        .routes(routes!(health::readyz))
        .routes(routes!(health::metrics))
        .routes(routes!(health::openapi_json))
        .routes(routes!(checkpoints::list))
        .routes(routes!(checkpoints::summary))
        .routes(routes!(checkpoints::tensors))
        .routes(routes!(checkpoints::tensor))
        .routes(routes!(plans::create))
        .routes(routes!(plans::get_plan))
        .routes(routes!(plans::rank))
        .routes(routes!(plans::ranks))
        .routes(routes!(plans::rank_overview))
        .routes(routes!(live::list))
        .routes(routes!(live::publication))
}

/// Title, version, description and the bearer security scheme.
fn finish(mut api: OpenApi) -> OpenApi {
    api.info.title = "tessera".to_string();
    api.info.version = env!("CARGO_PKG_VERSION").to_string();
    api.info.description = Some(
        "Checkpoint catalog, live publications and load planning. Checkpoint ids are <run>/<step> (two path \
         segments; the step `latest` follows the run's latest pointer). Errors are JSON \
         {\"error\": kind, \"detail\": message}. When the server has a token, every /v1 route \
         and /metrics need Authorization: Bearer <token>."
            .to_string(),
    );
    let components = api.components.get_or_insert_with(Default::default);
    components.add_security_scheme(
        "bearer",
        SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
    );
    api
}

/// The OpenAPI 3.1 document of the API, generated from the route definitions.
pub fn openapi() -> OpenApi {
    finish(api_router().into_openapi())
}

/// The service: every route, its middleware (request ids, tracing, body limit and deadline,
/// metrics, panics answered as 500, the token of `/v1` and `/metrics`, CORS when configured) and
/// JSON errors for unknown routes and methods.
pub fn app(state: AppState) -> Router {
    let (router, api) = api_router().split_for_parts();
    let doc = OpenApiJson(Arc::new(
        serde_json::to_vec(&finish(api)).unwrap_or_else(|_| b"{}".to_vec()),
    ));
    let config = state.config();
    let router = router.method_not_allowed_fallback(method_not_allowed);
    let router = match &config.web_ui {
        Some(dir) => router.fallback_service(
            ServeDir::new(dir)
                .call_fallback_on_method_not_allowed(true)
                .fallback(axum::handler::HandlerWithoutStateExt::into_service(
                    not_found,
                )),
        ),
        None => router
            .route("/", get(ui::index))
            .route("/app.js", get(ui::app_js))
            .route("/style.css", get(ui::style_css))
            .route("/favicon.svg", get(ui::favicon))
            .route("/favicon.ico", get(ui::favicon))
            .fallback(not_found),
    };
    let trace = TraceLayer::new_for_http()
        .make_span_with(|request: &Request<Body>| {
            let id = request
                .headers()
                .get("x-request-id")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("-");
            tracing::info_span!(
                "request",
                method = %request.method(),
                path = %request.uri().path(),
                request_id = %id
            )
        })
        .on_response(DefaultOnResponse::new().level(Level::INFO));
    let mut router = router
        .layer(Extension(doc))
        .layer(axum_middleware::from_fn_with_state(
            state.clone(),
            require_token,
        ))
        .layer(CatchPanicLayer::custom(panic_response))
        .layer(axum_middleware::from_fn_with_state(
            state.clone(),
            record_metrics,
        ))
        .layer(DefaultBodyLimit::max(config.body_limit))
        .layer(axum_middleware::from_fn_with_state(
            state.clone(),
            body_deadline,
        ))
        .layer(trace)
        .layer(PropagateRequestIdLayer::x_request_id())
        .layer(SetRequestIdLayer::x_request_id(MakeRequestUuid));
    if !config.cors_origins.is_empty() {
        router = router.layer(cors(&config.cors_origins));
    }
    router.with_state(state)
}

/// CORS for the configured origins: read-only API plus plan creation, any header a browser
/// client sends (the token travels in `Authorization`).
fn cors(origins: &[String]) -> CorsLayer {
    use axum::http::{HeaderValue, Method, header};
    let allow = if origins.iter().any(|o| o == "*") {
        AllowOrigin::any()
    } else {
        AllowOrigin::list(
            origins
                .iter()
                .filter_map(|o| HeaderValue::from_str(o).ok())
                .collect::<Vec<_>>(),
        )
    };
    CorsLayer::new()
        .allow_origin(allow)
        .allow_methods([Method::GET, Method::POST])
        .allow_headers([header::AUTHORIZATION, header::CONTENT_TYPE, header::ACCEPT])
        .expose_headers([header::HeaderName::from_static("x-request-id")])
}
