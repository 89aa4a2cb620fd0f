//! tessera's HTTP service: the catalog of a storage root (runs, committed and incomplete
//! checkpoints, `latest` pointers), checkpoint metadata served from a byte-bounded cache, and the
//! plan API: a job POSTs its layout once and every rank GETs its own rank plan (JSON or Arrow
//! IPC), all answered from one plan computation. With a registry directory (`--registry`), also
//! the live publications there (`tessera.publish`): `/v1/live` and the catalog's `live` section.
//! Also readiness, Prometheus metrics and an OpenAPI document generated from the route
//! definitions.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use tessera_server::{AppState, ServerConfig, app};
//! let state = AppState::new(ServerConfig::new("/data/checkpoints"))?;
//! let listener = tokio::net::TcpListener::bind(tessera_server::DEFAULT_ADDR).await?;
//! tessera_server::serve(listener, state, tessera_server::shutdown_signal()).await?;
//! # Ok(()) }
//! ```
//!
//! Checkpoint ids are `<run>/<step>`: the run directory under the root and the checkpoint
//! directory in it (`gpt/step-000100`). In URLs they are two path segments
//! (`/v1/checkpoints/gpt/step-000100`); `latest` as the step names the run's `latest` pointer.
//! Segments are checked before they touch storage: see [`CheckpointId`].

mod catalog;
mod config;
mod error;
mod id;
mod live;
mod metrics;
mod middleware;
mod plan_views;
mod plans;
mod routes;
mod serve;
mod state;

pub use catalog::{
    CatalogProblem, CatalogResponse, CheckpointEntry, CheckpointStatus, CheckpointSummary,
    Composition, MAX_OBJECTS_LISTED, ObjectEntry, RunEntry, SavedBox, TensorDetail, TensorEntry,
    TensorPage, TensorTotals,
};
pub use config::{
    DEFAULT_ADDR, DEFAULT_BODY_LIMIT, DEFAULT_BODY_TIMEOUT, DEFAULT_CATALOG_TTL,
    DEFAULT_FAILURE_TTL, DEFAULT_HEADER_TIMEOUT, DEFAULT_MAX_CONNECTIONS, DEFAULT_META_CACHE_BYTES,
    DEFAULT_META_TTL, DEFAULT_PLAN_CACHE_BYTES, DEFAULT_PLAN_CONCURRENCY,
    DEFAULT_PLAN_MEMORY_BYTES, DEFAULT_PLAN_QUEUE, DEFAULT_SHUTDOWN_GRACE, ServerConfig, TOKEN_ENV,
};
pub use error::{ApiError, ErrorBody, ServerError};
pub use id::CheckpointId;
pub use live::{
    DEFAULT_LIVE_STEPS, LiveListing, LivePublication, LivePublisher, LiveStep, MAX_LIVE_STEPS,
};
pub use metrics::MetricsSnapshot;
pub use plan_views::{
    ExchangeView, FileReads, MeshDimView, RankColumns, RankOverview, RankSummaries, RoundView,
};
pub use plans::{PlanCreated, PlanRequest, PlanRequestOptions, PlanSummaryView};
pub use routes::{ARROW_STREAM, app, openapi};
pub use serve::{init_logging, serve, shutdown_signal};
pub use state::AppState;
