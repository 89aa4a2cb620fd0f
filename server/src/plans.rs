//! Plans: a job's request (checkpoint + layout or explicit requests + options) is planned once
//! and kept in a cache bounded by bytes, under an id that is a stable hash of what the plan
//! depends on. Concurrent requests for a plan that is not there yet wait on one computation
//! (moka coalesces the inits of one key), which is what thousands of ranks asking at job start
//! need. The request itself is kept in a second, smaller cache, so that an evicted plan is
//! recomputed when a rank asks for it rather than lost.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use moka::future::Cache;
use moka::policy::EvictionPolicy;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tessera_metadata::CheckpointMeta;
use tessera_planner::{
    ExplicitRequests, Layout, Plan, PlanError, PlanEstimate, PlanOptions, PlanSummary, RequestSet,
    plan,
};
use tokio::sync::Semaphore;
use utoipa::ToSchema;

use crate::catalog::{Catalog, OpenedCheckpoint};
use crate::error::unshare;
use crate::metrics::{CacheKind, Metrics};
use crate::plan_views::{MeshDimView, RankColumns};
use crate::{ApiError, CheckpointId, ServerConfig};

/// Most ranks a layout may have: a million ranks is beyond any job today, and a bound keeps a
/// typo (`"size": 100000000`) from making the planner allocate per-rank tables for hours.
pub(crate) const MAX_WORLD: u64 = 1 << 20;

/// Seconds a client is asked to wait (`Retry-After`) when every planning slot and the queue are
/// taken: about the time a large plan takes, so a retry usually finds a slot.
const BUSY_RETRY_AFTER_SECS: u64 = 2;

/// Hex digits of a plan id (128 bits of SHA-256).
const PLAN_ID_LEN: usize = 32;

/// `POST /v1/plans`: what to plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest {
    /// Checkpoint id, `<run>/<step>` or `<run>/latest`.
    pub checkpoint: String,
    /// Target layout (DESIGN.md "Layout contract"): `{"mesh", "rules", "stages"}`. Give exactly
    /// one of `layout` and `requests`.
    #[schema(value_type = Option<Object>)]
    pub layout: Option<serde_json::Value>,
    /// Explicit per-rank requests: `{"ranks": [[{"fqn", "offsets", "lengths"} | {"fqn", "flat":
    /// [start, end]}, ...], ...]}`.
    #[schema(value_type = Option<Object>)]
    pub requests: Option<serde_json::Value>,
    /// Planning options.
    #[serde(default)]
    pub options: PlanRequestOptions,
}

/// Options of a plan request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PlanRequestOptions {
    /// Read each piece several ranks need once and hand it on in ring rounds (default), or have
    /// every rank read everything it needs itself.
    #[serde(default = "default_dedup")]
    pub dedup: bool,
}

fn default_dedup() -> bool {
    true
}

impl Default for PlanRequestOptions {
    fn default() -> Self {
        Self { dedup: true }
    }
}

/// Totals of a plan: the planner's `PlanSummary`, field for field.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PlanSummaryView {
    /// Ranks.
    pub ranks: u32,
    /// Destination buffers over all ranks.
    pub destinations: u64,
    /// Pieces (reads from storage).
    pub pieces: u64,
    /// Groups of more than one rank (exchange rings).
    pub exchange_groups: u64,
    /// Sum over ranks of the bytes each rank ends up with.
    pub bytes_needed: u64,
    /// Distinct bytes needed by the cluster.
    pub unique_bytes_needed: u64,
    /// Bytes read from storage.
    pub bytes_read: u64,
    /// `bytes_read / unique_bytes_needed`.
    pub read_amplification: f64,
    /// Bytes sent between ranks.
    pub bytes_exchanged: u64,
    /// Most bytes one rank reads.
    pub max_read_per_rank: u64,
    /// Mean bytes read per rank.
    pub mean_read_per_rank: f64,
    /// Most ring rounds of any group.
    pub max_rounds: u64,
}

impl From<&PlanSummary> for PlanSummaryView {
    fn from(s: &PlanSummary) -> Self {
        Self {
            ranks: s.ranks,
            destinations: s.destinations,
            pieces: s.pieces,
            exchange_groups: s.exchange_groups,
            bytes_needed: s.bytes_needed,
            unique_bytes_needed: s.unique_bytes_needed,
            bytes_read: s.bytes_read,
            read_amplification: s.read_amplification,
            bytes_exchanged: s.bytes_exchanged,
            max_read_per_rank: s.max_read_per_rank,
            mean_read_per_rank: s.mean_read_per_rank,
            max_rounds: s.max_rounds,
        }
    }
}

/// `POST /v1/plans` answer.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PlanCreated {
    /// Plan id: 32 hex digits, the same for the same checkpoint, target and options.
    pub plan: String,
    /// The checkpoint planned against (`latest` resolved).
    pub checkpoint: String,
    /// Identity of the checkpoint planned against (`<format>:<hex digest>` of its metadata as
    /// read). Every rank plan carries it, and loaders refuse a plan whose identity is not the one
    /// of the checkpoint they open.
    pub checkpoint_identity: String,
    /// Number of ranks.
    pub world: u32,
    /// Totals.
    pub summary: PlanSummaryView,
    /// Where each rank's plan is: this path with `{rank}` replaced.
    pub rank_url: String,
    /// What in the layout does not fit the checkpoint though it planned (pipeline stages made
    /// for another number of layers): sentences naming the field and the numbers. Absent when
    /// everything fits.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// What a plan is computed for.
#[derive(Clone, Debug)]
pub(crate) enum PlanTarget {
    Layout(Layout),
    Requests(ExplicitRequests),
}

impl PlanTarget {
    fn is_layout(&self) -> bool {
        matches!(self, PlanTarget::Layout(_))
    }

    /// Compact JSON of the parsed target: key order and whitespace of the request do not matter,
    /// defaults are spelled out.
    fn canonical(&self) -> String {
        let text = match self {
            PlanTarget::Layout(layout) => serde_json::to_string(layout),
            PlanTarget::Requests(requests) => serde_json::to_string(requests),
        };
        // Serializing plain structs of strings and numbers cannot fail.
        text.unwrap_or_default()
    }
}

/// A parsed plan request, before the checkpoint is opened.
#[derive(Clone, Debug)]
pub(crate) struct ParsedRequest {
    pub checkpoint: CheckpointId,
    pub target: PlanTarget,
    pub options: PlanOptions,
}

/// Parses and checks a `POST /v1/plans` body (everything that needs no storage).
pub(crate) fn parse_request(body: &[u8]) -> Result<ParsedRequest, ApiError> {
    let not_a_request = |at: String, error: &dyn std::fmt::Display| ApiError::BadRequest {
        detail: format!(
            "the body is not a plan request ({{\"checkpoint\", \"layout\" | \"requests\", \"options\"}}){at}: {error}"
        ),
    };
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let request: PlanRequest =
        serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
            let at = match e.path().to_string() {
                path if path == "." => String::new(),
                path => format!(" at {path}"),
            };
            not_a_request(at, e.inner())
        })?;
    deserializer
        .end()
        .map_err(|e| not_a_request(String::new(), &e))?;
    let checkpoint = CheckpointId::parse(&request.checkpoint)?;
    let target = match (request.layout, request.requests) {
        (Some(layout), None) => {
            let layout: Layout = serde_json::from_value(layout).map_err(|e| {
                ApiError::from_plan(
                    &PlanError::Json {
                        what: "layout",
                        detail: e.to_string(),
                    },
                    true,
                )
            })?;
            check_world(&layout)?;
            layout.check().map_err(|e| ApiError::from_plan(&e, true))?;
            PlanTarget::Layout(layout)
        }
        (None, Some(requests)) => {
            check_explicit(&requests)?;
            let requests: ExplicitRequests = serde_json::from_value(requests).map_err(|e| {
                ApiError::from_plan(
                    &PlanError::Json {
                        what: "requests",
                        detail: e.to_string(),
                    },
                    false,
                )
            })?;
            if requests.ranks.is_empty() {
                return Err(ApiError::InvalidRequests {
                    reason: "no ranks: \"ranks\" needs one list of requests per rank".to_string(),
                });
            }
            PlanTarget::Requests(requests)
        }
        _ => {
            return Err(ApiError::BadRequest {
                detail: "give exactly one of \"layout\" and \"requests\"".to_string(),
            });
        }
    };
    Ok(ParsedRequest {
        checkpoint,
        target,
        options: PlanOptions {
            dedup: request.options.dedup,
            ..PlanOptions::default()
        },
    })
}

/// Checks explicit requests before they are parsed: the rank cap layouts have (the body limit
/// alone lets through millions of empty rank lists), and requests that give both a box and a flat
/// range (the parser would take the box and drop `flat` without a word).
fn check_explicit(requests: &serde_json::Value) -> Result<(), ApiError> {
    let Some(ranks) = requests.get("ranks").and_then(serde_json::Value::as_array) else {
        // Not the expected shape: the parser says what is wrong.
        return Ok(());
    };
    if ranks.len() as u64 > MAX_WORLD {
        return Err(ApiError::InvalidRequests {
            reason: format!(
                "\"ranks\" has {} ranks, more than the {MAX_WORLD} this server plans",
                ranks.len()
            ),
        });
    }
    for (rank, list) in ranks.iter().enumerate() {
        let Some(list) = list.as_array() else {
            continue;
        };
        for (i, request) in list.iter().enumerate() {
            let has = |field: &str| request.get(field).is_some();
            if has("flat") && (has("offsets") || has("lengths")) {
                let fqn = request
                    .get("fqn")
                    .and_then(serde_json::Value::as_str)
                    .map_or(String::new(), |f| {
                        format!(" (tensor {:?})", crate::id::truncate(f))
                    });
                return Err(ApiError::InvalidRequests {
                    reason: format!(
                        "ranks[{rank}][{i}]{fqn} gives both \"flat\" and \"offsets\"/\"lengths\": a request is a box or a flat range, not both"
                    ),
                });
            }
        }
    }
    Ok(())
}

fn check_world(layout: &Layout) -> Result<(), ApiError> {
    let world = layout
        .mesh
        .iter()
        .try_fold(1u64, |acc, d| acc.checked_mul(u64::from(d.size)));
    match world {
        Some(w) if w <= MAX_WORLD => Ok(()),
        _ => Err(ApiError::InvalidLayout {
            reason: format!(
                "the mesh has more than {MAX_WORLD} ranks ({}); this server plans at most that many",
                layout
                    .mesh
                    .iter()
                    .map(|d| format!("{}={}", d.name, d.size))
                    .collect::<Vec<_>>()
                    .join(" x ")
            ),
        }),
    }
}

/// A plan request bound to a checkpoint version: everything the plan depends on.
#[derive(Debug)]
pub(crate) struct PlanSpec {
    pub id: String,
    pub checkpoint: CheckpointId,
    pub target: PlanTarget,
    pub options: PlanOptions,
    canonical: String,
}

impl PlanSpec {
    pub(crate) fn new(mut request: ParsedRequest, opened: &OpenedCheckpoint) -> Self {
        // Only native checkpoints have block checksums that reads per request widen to.
        request.options.block_checksums = opened.facts.format == tessera_metadata::Format::Native;
        let canonical = request.target.canonical();
        let id = plan_id(
            &opened.id,
            &opened.facts.identity,
            request.target.is_layout(),
            &canonical,
            &request.options,
        );
        Self {
            id,
            checkpoint: opened.id.clone(),
            target: request.target,
            options: request.options,
            canonical,
        }
    }

    fn weight(&self) -> u32 {
        u32::try_from(256 + 4 * self.canonical.len()).unwrap_or(u32::MAX)
    }
}

/// The stable id of a plan: SHA-256 over the checkpoint id, its identity (which changes when the
/// checkpoint is saved again: the `identity` of its catalog facts), the kind and canonical JSON
/// of the target, and the options; the first 128 bits in hex.
fn plan_id(
    checkpoint: &CheckpointId,
    identity: &str,
    layout: bool,
    canonical: &str,
    options: &PlanOptions,
) -> String {
    let mut hasher = Sha256::new();
    for part in [
        "tessera-plan/1",
        &checkpoint.to_string(),
        identity,
        if layout { "layout" } else { "requests" },
        canonical,
        if options.dedup { "dedup" } else { "no-dedup" },
    ] {
        // Length-prefixed, so no two different part lists hash the same bytes.
        hasher.update((part.len() as u64).to_le_bytes());
        hasher.update(part.as_bytes());
    }
    let digest = hasher.finalize();
    digest[..PLAN_ID_LEN / 2]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Checks the form of a plan id from a URL.
pub(crate) fn check_plan_id(id: &str) -> Result<(), ApiError> {
    let ok = id.len() == PLAN_ID_LEN
        && id
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ApiError::bad_id(format!(
            "plan id {:?} is not 32 lowercase hex digits",
            crate::id::truncate(id)
        )))
    }
}

/// A computed plan.
#[derive(Debug)]
pub(crate) struct PlanEntry {
    pub id: String,
    pub checkpoint: CheckpointId,
    /// The identity of the checkpoint planned against.
    pub identity: String,
    pub plan: Plan,
    /// [`Layout::warnings`](tessera_planner::Layout::warnings) of the layout planned for.
    pub warnings: Vec<String>,
    /// The mesh of the layout planned for (none for explicit requests).
    pub mesh: Option<Vec<MeshDimView>>,
    /// Every rank's totals, computed on first ask (loaders never need them).
    rank_columns: OnceLock<Arc<RankColumns>>,
    weight: u32,
}

impl PlanEntry {
    /// Every rank's totals: computed once, then shared.
    pub(crate) fn rank_columns(&self) -> Arc<RankColumns> {
        Arc::clone(
            self.rank_columns
                .get_or_init(|| Arc::new(RankColumns::of_plan(&self.plan))),
        )
    }

    pub(crate) fn created(&self) -> PlanCreated {
        PlanCreated {
            plan: self.id.clone(),
            checkpoint: self.checkpoint.to_string(),
            checkpoint_identity: self.identity.clone(),
            world: self.plan.world_size(),
            summary: self.plan.summary().into(),
            rank_url: format!("/v1/plans/{}/ranks/{{rank}}", self.id),
            warnings: self.warnings.clone(),
        }
    }
}

/// What a cached plan holds: the plan's own tables (counted from their capacities by the
/// planner; the checkpoint metadata it points to is the metadata cache's) and its entry. Moka
/// weighs in `u32`, so a plan over 4 GiB weighs 4 GiB; `plan_memory_bytes` keeps plans smaller.
fn plan_weight(plan: &Plan, id: &str, checkpoint: &CheckpointId) -> u32 {
    let bytes = plan.heap_bytes()
        + std::mem::size_of::<PlanEntry>() as u64
        + id.len() as u64
        + checkpoint.to_string().len() as u64;
    u32::try_from(bytes).unwrap_or(u32::MAX)
}

/// Bounds plan computations: `concurrency` run at once, `queue` more wait, and any further one
/// is refused at once (503 `busy`) rather than piling up memory and threads.
pub(crate) struct PlanGate {
    /// Computations running or waiting: a permit is taken without waiting, or refused.
    admitted: Arc<Semaphore>,
    /// Computations running.
    running: Arc<Semaphore>,
    concurrency: usize,
    queue: usize,
}

/// A computation's place: while held, it counts against the gate.
pub(crate) struct GateSlot {
    _admitted: tokio::sync::OwnedSemaphorePermit,
    _running: tokio::sync::OwnedSemaphorePermit,
}

impl PlanGate {
    pub(crate) fn new(concurrency: usize, queue: usize) -> Self {
        Self {
            admitted: Arc::new(Semaphore::new(concurrency.saturating_add(queue))),
            running: Arc::new(Semaphore::new(concurrency)),
            concurrency,
            queue,
        }
    }

    /// Waits for a running slot if there is room in the queue; refuses as busy if not.
    pub(crate) async fn enter(&self) -> Result<GateSlot, ApiError> {
        let Ok(admitted) = Arc::clone(&self.admitted).try_acquire_owned() else {
            return Err(ApiError::Busy {
                running: self.concurrency,
                queued: self.queue,
                retry_after: BUSY_RETRY_AFTER_SECS,
            });
        };
        let running = Arc::clone(&self.running)
            .acquire_owned()
            .await
            .map_err(|e| ApiError::Internal {
                detail: format!("the planning slots are closed: {e}"),
            })?;
        Ok(GateSlot {
            _admitted: admitted,
            _running: running,
        })
    }
}

/// The plan caches.
pub(crate) struct Plans {
    capacity: u64,
    /// Most bytes one computation may take (by the planner's estimate).
    memory_limit: u64,
    gate: PlanGate,
    plans: Cache<String, Arc<PlanEntry>>,
    specs: Cache<String, Arc<PlanSpec>>,
    metrics: Arc<Metrics>,
}

impl Plans {
    pub(crate) fn new(config: &ServerConfig, metrics: Arc<Metrics>) -> Self {
        Self {
            capacity: config.plan_cache_bytes,
            memory_limit: config.plan_memory_bytes,
            gate: PlanGate::new(config.plan_concurrency, config.plan_queue),
            // LRU rather than moka's default TinyLFU admission: a plan just computed is the one
            // a job's ranks are about to ask for, and TinyLFU could refuse it in favour of older,
            // often-read plans, making every rank's request compute it again.
            plans: Cache::builder()
                .max_capacity(config.plan_cache_bytes)
                .weigher(|_, v: &Arc<PlanEntry>| v.weight)
                .eviction_policy(EvictionPolicy::lru())
                .build(),
            specs: Cache::builder()
                .max_capacity((config.plan_cache_bytes / 8).max(1024 * 1024))
                .weigher(|_, v: &Arc<PlanSpec>| v.weight())
                .eviction_policy(EvictionPolicy::lru())
                .build(),
            metrics,
        }
    }

    /// Entries and estimated bytes of the plan cache (after pending evictions).
    pub(crate) async fn usage(&self) -> (u64, u64) {
        self.plans.run_pending_tasks().await;
        (self.plans.entry_count(), self.plans.weighted_size())
    }

    pub(crate) fn invalidate_all(&self) {
        self.plans.invalidate_all();
        self.specs.invalidate_all();
    }

    pub(crate) fn evict_computed(&self) {
        self.plans.invalidate_all();
    }

    /// `POST /v1/plans`: the plan of `request`, computed once.
    pub(crate) async fn create(
        &self,
        catalog: &Catalog,
        request: ParsedRequest,
    ) -> Result<Arc<PlanEntry>, ApiError> {
        let opened = catalog.open(&request.checkpoint).await?;
        let spec = Arc::new(PlanSpec::new(request, &opened));
        let spec = self
            .specs
            .entry(spec.id.clone())
            .or_insert_with(async { spec })
            .await
            .into_value();
        self.get_or_compute(spec, opened).await
    }

    /// A plan by id: from the cache, or recomputed from its request if it was evicted.
    pub(crate) async fn get(
        &self,
        catalog: &Catalog,
        id: &str,
    ) -> Result<Arc<PlanEntry>, ApiError> {
        if let Some(entry) = self.plans.get(id).await {
            self.metrics.cache(CacheKind::Plan, true);
            // The checkpoint may have been saved again since: checked against its stamp (one
            // `head`), never answered blind.
            let opened = catalog.open(&entry.checkpoint).await?;
            return still_current(id, &entry.checkpoint, &entry.identity, &opened).map(|()| entry);
        }
        let Some(spec) = self.specs.get(id).await else {
            return Err(ApiError::UnknownPlan {
                plan: id.to_string(),
                why:
                    "this server did not make it (or has forgotten it since); POST /v1/plans again"
                        .to_string(),
            });
        };
        let opened = catalog.open(&spec.checkpoint).await?;
        let current = plan_id(
            &opened.id,
            &opened.facts.identity,
            spec.target.is_layout(),
            &spec.canonical,
            &spec.options,
        );
        if current != spec.id {
            return Err(saved_again(id, &spec.checkpoint));
        }
        self.get_or_compute(spec, opened).await
    }

    async fn get_or_compute(
        &self,
        spec: Arc<PlanSpec>,
        opened: Arc<OpenedCheckpoint>,
    ) -> Result<Arc<PlanEntry>, ApiError> {
        let metrics = &self.metrics;
        let capacity = self.capacity;
        let entry = self
            .plans
            .entry(spec.id.clone())
            .or_try_insert_with(async {
                let started = Instant::now();
                let meta = Arc::clone(&opened.meta);
                let task_spec = Arc::clone(&spec);
                // 1. The estimate, before any per-rank table exists: milliseconds even for a
                // mesh whose plan would not fit in memory.
                let prepared = tokio::task::spawn_blocking(move || prepare(&meta, &task_spec))
                    .await
                    .map_err(|e| ApiError::Internal {
                        detail: format!("the plan estimate task failed: {e}"),
                    })
                    .and_then(|r| r);
                // A layout or requests the planner refuses count as failed computations,
                // whether the estimate or the planner found it.
                let (estimate, requests) = prepared.inspect_err(|_| {
                    metrics.plan_computed(started.elapsed(), false);
                })?;
                let estimate = estimate.within(self.memory_limit).map_err(|e| {
                    metrics.plan_computed(started.elapsed(), false);
                    tracing::warn!(plan = %spec.id, error = %e, "plan refused: over the memory bound");
                    ApiError::from_plan(&e, spec.target.is_layout())
                })?;
                // 2. A place among the computations running or waiting, or 503 at once.
                let _slot = self.gate.enter().await?;
                let meta = Arc::clone(&opened.meta);
                let task_spec = Arc::clone(&spec);
                // Planning is CPU-bound (seconds for a 405B layout): off the async workers.
                let computed =
                    tokio::task::spawn_blocking(move || compute(&meta, &task_spec, requests))
                        .await
                        .map_err(|e| ApiError::Internal {
                            detail: format!("the planning task failed: {e}"),
                        })
                        .and_then(|r| r);
                metrics.plan_computed(started.elapsed(), computed.is_ok());
                let plan = computed?;
                // Not counted: the per-rank totals a preview may ask for later (64 bytes a rank,
                // about 1% of the smallest plan's tables per rank, and absent for loaders).
                let weight = plan_weight(&plan, &spec.id, &spec.checkpoint);
                if u64::from(weight) > capacity {
                    tracing::warn!(
                        plan = %spec.id,
                        bytes = weight,
                        capacity,
                        "plan larger than the whole plan cache: it is computed again for every request (raise the plan cache size)"
                    );
                }
                tracing::info!(
                    plan = %spec.id,
                    checkpoint = %spec.checkpoint,
                    ranks = plan.world_size(),
                    pieces = plan.summary().pieces,
                    estimated_bytes = estimate.bytes,
                    held_bytes = weight,
                    seconds = started.elapsed().as_secs_f64(),
                    "plan computed"
                );
                let warnings = match &spec.target {
                    PlanTarget::Layout(layout) => layout.warnings(opened.meta.tensors()),
                    PlanTarget::Requests(_) => Vec::new(),
                };
                Ok::<_, ApiError>(Arc::new(PlanEntry {
                    id: spec.id.clone(),
                    checkpoint: spec.checkpoint.clone(),
                    identity: opened.facts.identity.clone(),
                    weight,
                    mesh: match &spec.target {
                        PlanTarget::Layout(layout) => Some(
                            layout
                                .mesh
                                .iter()
                                .map(|d| MeshDimView {
                                    name: d.name.clone(),
                                    size: d.size,
                                })
                                .collect(),
                        ),
                        PlanTarget::Requests(_) => None,
                    },
                    rank_columns: OnceLock::new(),
                    plan,
                    warnings,
                }))
            })
            .await
            .map_err(unshare)?;
        metrics.cache(CacheKind::Plan, !entry.is_fresh());
        Ok(entry.into_value())
    }
}

/// Whether a cached plan made for `checkpoint` with `identity` still fits the checkpoint as it is
/// on storage now.
fn still_current(
    plan: &str,
    checkpoint: &CheckpointId,
    identity: &str,
    opened: &OpenedCheckpoint,
) -> Result<(), ApiError> {
    if opened.facts.identity == identity {
        Ok(())
    } else {
        Err(saved_again(plan, checkpoint))
    }
}

fn saved_again(plan: &str, checkpoint: &CheckpointId) -> ApiError {
    ApiError::UnknownPlan {
        plan: plan.to_string(),
        why: format!(
            "it was made for another version of checkpoint {checkpoint}, which was saved again since; POST /v1/plans again"
        ),
    }
}

/// The memory estimate of a plan, and for explicit requests the resolved requests (bounded by
/// the body size, so resolving them first costs little and they are not resolved twice).
fn prepare(
    meta: &Arc<CheckpointMeta>,
    spec: &PlanSpec,
) -> Result<(PlanEstimate, Option<RequestSet>), ApiError> {
    match &spec.target {
        PlanTarget::Layout(layout) => layout
            .estimate(meta, &spec.options)
            .map(|estimate| (estimate, None))
            .map_err(|e| ApiError::from_plan(&e, true)),
        PlanTarget::Requests(requests) => {
            let requests = requests
                .resolve(meta.tensors())
                .map_err(|e| ApiError::from_plan(&e, false))?;
            Ok((requests.estimate(meta, &spec.options), Some(requests)))
        }
    }
}

fn compute(
    meta: &Arc<CheckpointMeta>,
    spec: &PlanSpec,
    resolved: Option<RequestSet>,
) -> Result<Plan, ApiError> {
    let layout = spec.target.is_layout();
    let requests = match (resolved, &spec.target) {
        (Some(requests), _) => requests,
        (None, PlanTarget::Layout(l)) => l
            .resolve(meta.tensors())
            .map_err(|e| ApiError::from_plan(&e, true))?,
        (None, PlanTarget::Requests(r)) => r
            .resolve(meta.tensors())
            .map_err(|e| ApiError::from_plan(&e, false))?,
    };
    plan(meta, &requests, &spec.options).map_err(|e| ApiError::from_plan(&e, layout))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn plan_ids_ignore_formatting_and_key_order() {
        let a = br#"{"checkpoint": "r/s", "layout": {"mesh": [{"name": "dp", "size": 2}], "rules": [{"match": "*", "placements": ["shard(0)"]}]}}"#;
        let b = br#"{"layout":{"rules":[{"placements":["shard(0)"],"match":"*"}],"mesh":[{"size":2,"name":"dp"}]},"checkpoint":"r/s","options":{"dedup":true}}"#;
        let (a, b) = match (parse_request(a), parse_request(b)) {
            (Ok(a), Ok(b)) => (a, b),
            other => panic!("{other:?}"),
        };
        assert_eq!(a.target.canonical(), b.target.canonical());
    }

    #[test]
    fn huge_meshes_are_refused() {
        let body = br#"{"checkpoint": "r/s", "layout": {"mesh": [{"name": "a", "size": 65536}, {"name": "b", "size": 65536}], "rules": [{"match": "*", "placements": ["replicate", "replicate"]}]}}"#;
        assert!(matches!(
            parse_request(body),
            Err(ApiError::InvalidLayout { .. })
        ));
    }

    #[tokio::test]
    async fn the_gate_queues_then_refuses_with_retry_after() {
        let gate = Arc::new(PlanGate::new(1, 1));
        let first = gate.enter().await.unwrap();
        // The second waits for the running slot (its queue place is taken at once).
        let waiting = {
            let gate = Arc::clone(&gate);
            tokio::spawn(async move { gate.enter().await.map(|_| ()) })
        };
        while gate.admitted.available_permits() > 0 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished());
        // The third finds the running slot and the queue full.
        let refused = match gate.enter().await {
            Err(e) => e,
            Ok(_) => panic!("a third computation was admitted past concurrency 1 + queue 1"),
        };
        assert_eq!(refused.kind(), "busy");
        let response = axum::response::IntoResponse::into_response(refused);
        assert_eq!(
            response.status(),
            axum::http::StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            response
                .headers()
                .get(axum::http::header::RETRY_AFTER)
                .unwrap(),
            &BUSY_RETRY_AFTER_SECS.to_string()
        );
        drop(first);
        waiting.await.unwrap().unwrap();
        // Everything released: room again.
        assert!(gate.enter().await.is_ok());
    }

    #[test]
    fn plan_ids_are_checked() {
        assert!(check_plan_id("0123456789abcdef0123456789abcdef").is_ok());
        for bad in ["", "0123456789ABCDEF0123456789abcdef", "../etc", "0123"] {
            assert!(check_plan_id(bad).is_err(), "{bad}");
        }
    }
}
