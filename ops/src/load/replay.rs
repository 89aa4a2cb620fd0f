//! Plan once, replay: the plans this process made for live steps (`live+file://`), kept so
//! that a consumer loading the next step of a publication with the same requests skips
//! planning. A publication's steps keep one layout by design (the same tensors, boxes and byte
//! positions in the same publisher ranks' files; only the bytes and their checksums change), so
//! its next step's plan is the last one's, bound to the new step ([`Plan::rebind`]).
//!
//! An entry is taken only when everything the planner reads is the same: the requests (every
//! rank's), the options as the checkpoint plans with them, the read sources, and the layout
//! ([`tessera_planner::layout_change`]: tensors, saved boxes, files; not checksums, identity or
//! the publishers' URLs, which are not in the metadata). The replayed plan carries the new
//! step's identity, so the loader checks each rank plan piece by piece against the new step's
//! metadata before it reads ([`tessera_loader::checkpoint::Checkpoint::check_plan`]) and
//! verifies every read against the new step's checksums. A checkpoint on storage is planned
//! each time: a process loads it once, and its plan would be kept in memory for nothing.
//!
//! At most [`CAPACITY`] plans are kept, least recently used dropped first. The cache is this
//! process's: over a process group only the coordinator plans (`crate::job`), so every rank of
//! the job loads the one plan it made or replayed, and reports which.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

use tessera_loader::checkpoint::Checkpoint;
use tessera_planner::{Plan, PlanOptions, ReadSources, RequestSet};

use crate::OpsError;

/// Plans kept per process: a consumer alternating between a few publications (or a few
/// request sets) keeps each warm, and a plan of a large job (every rank's pieces) is not kept
/// many times over.
pub const CAPACITY: usize = 4;

/// One plan kept, with everything besides the layout it was made from.
struct Entry {
    plan: Plan,
    requests: RequestSet,
    options: PlanOptions,
    sources: ReadSources,
}

fn cache() -> &'static Mutex<VecDeque<Entry>> {
    static CACHE: OnceLock<Mutex<VecDeque<Entry>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

/// Whether plans of `checkpoint` are kept and replayed: a live publication's step.
pub fn replays(checkpoint: &Checkpoint) -> bool {
    checkpoint
        .location
        .display
        .strip_prefix(tessera_storage::LIVE_SCHEME)
        .is_some_and(|rest| rest.starts_with("://"))
}

/// Plans `requests` against `checkpoint` with `options` and `sources`, or replays the plan this
/// process made for another step of the same layout with the same requests, options and
/// sources (its summary then says `replayed`). Only for [`replays`] checkpoints; others are
/// planned.
pub fn plan_or_replay(
    checkpoint: &Checkpoint,
    requests: &RequestSet,
    options: &PlanOptions,
    sources: &ReadSources,
) -> Result<Plan, OpsError> {
    if !replays(checkpoint) {
        return Ok(checkpoint.plan_with_sources(requests, options, sources)?);
    }
    // As the checkpoint plans with them (its checksum blocks, its store's kind).
    let effective = checkpoint.plan_options(options);
    {
        let mut kept = cache().lock().unwrap_or_else(PoisonError::into_inner);
        let hit = kept.iter().position(|e| {
            e.requests == *requests
                && e.options == effective
                && e.sources == *sources
                && tessera_planner::layout_change(e.plan.checkpoint(), &checkpoint.meta).is_none()
        });
        if let Some(i) = hit
            && let Some(entry) = kept.remove(i)
        {
            let replayed = entry.plan.rebind(Arc::clone(&checkpoint.meta));
            // Most recently used first.
            kept.push_front(entry);
            return Ok(replayed?);
        }
    }
    // The rank plans cut from it are kept with it: its clone below shares them.
    let plan = checkpoint
        .plan_with_sources(requests, options, sources)?
        .keeping_rank_plans();
    let mut kept = cache().lock().unwrap_or_else(PoisonError::into_inner);
    kept.push_front(Entry {
        plan: plan.clone(),
        requests: requests.clone(),
        options: effective,
        sources: sources.clone(),
    });
    kept.truncate(CAPACITY);
    Ok(plan)
}
