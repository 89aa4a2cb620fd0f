//! The planner's memory, measured with a counting allocator: the estimate a service refuses
//! requests by ([`Layout::estimate`], [`RequestSet::estimate`]) stays above the real peak of
//! resolving and planning and within 1.5x of it, and [`Plan::heap_bytes`] (what a plan cache
//! weighs a plan at) is exactly what the plan holds.

#![allow(clippy::unwrap_used, missing_docs)]
// A global allocator is unsafe to implement; this one only forwards to the system allocator.
#![allow(unsafe_code)]

mod common;

use std::alloc::{GlobalAlloc, Layout as AllocLayout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use tessera_planner::{Layout, PlanEstimate, PlanOptions, RequestSet, plan};

use common::{save_layout, small_gpt};

/// Counts live heap bytes and their high-water mark.
struct Counting;

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call goes straight to the system allocator; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: AllocLayout) -> *mut u8 {
        // SAFETY: same contract as the caller's.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            let live =
                LIVE.fetch_add(layout.size() as u64, Ordering::SeqCst) + layout.size() as u64;
            PEAK.fetch_max(live, Ordering::SeqCst);
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: AllocLayout) {
        // SAFETY: same contract as the caller's.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size() as u64, Ordering::SeqCst);
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn layout(text: &str) -> Layout {
    Layout::from_json(text).unwrap()
}

fn mesh(dims: &[(&str, u32)], rules: &[(&str, &[&str])], stages: bool) -> Layout {
    let mesh: Vec<_> = dims
        .iter()
        .map(|(n, s)| serde_json::json!({"name": n, "size": s}))
        .collect();
    let rules: Vec<_> = rules
        .iter()
        .map(|(m, p)| serde_json::json!({"match": m, "placements": p}))
        .collect();
    let mut value = serde_json::json!({"mesh": mesh, "rules": rules});
    if stages {
        value["stages"] = serde_json::json!({"num_layers": 8, "first": ["*embed*"], "last": ["*lm_head*", "*final*", "*norm.weight"]});
    }
    layout(&value.to_string())
}

struct Measured {
    estimate: PlanEstimate,
    peak: u64,
    pieces: u64,
    requests: u64,
}

/// Plans `target` against a checkpoint saved tp=2, measuring the peak of resolve + plan, and
/// checks the plan's own count of its bytes.
fn measure(target: &Layout, options: &PlanOptions, explicit: bool) -> Measured {
    let source = mesh(
        &[("tp", 2)],
        &[("*.norm*", &["replicate"]), ("*", &["shard(0)"])],
        false,
    );
    let saved = save_layout(small_gpt(8, true), &source);
    let meta = &saved.meta;
    let (estimate, peak, pieces, requests) = if explicit {
        let mut requests: RequestSet = target.resolve(meta.tensors()).unwrap();
        requests.disjoint = false;
        let estimate = requests.estimate(meta, options);
        let base = LIVE.load(Ordering::SeqCst);
        PEAK.store(base, Ordering::SeqCst);
        let planned = plan(meta, &requests, options).unwrap();
        let peak = PEAK.load(Ordering::SeqCst) - base;
        check_heap_bytes(&planned);
        let requests_bytes = requests_heap(&requests);
        (
            estimate,
            peak + requests_bytes,
            planned.summary().pieces,
            planned.summary().destinations,
        )
    } else {
        let estimate = target.estimate(meta, options).unwrap();
        let base = LIVE.load(Ordering::SeqCst);
        PEAK.store(base, Ordering::SeqCst);
        let requests = target.resolve(meta.tensors()).unwrap();
        let planned = plan(meta, &requests, options).unwrap();
        let peak = PEAK.load(Ordering::SeqCst) - base;
        drop(requests);
        // With the requests gone, what is still allocated since `base` is the plan.
        let retained = LIVE.load(Ordering::SeqCst) - base;
        assert_eq!(planned.heap_bytes(), retained, "heap_bytes of the plan");
        check_heap_bytes(&planned);
        (
            estimate,
            peak,
            planned.summary().pieces,
            planned.summary().destinations,
        )
    };
    Measured {
        estimate,
        peak,
        pieces,
        requests,
    }
}

/// Heap bytes of a request set, from its capacities (boxes here have at most four dims).
fn requests_heap(requests: &RequestSet) -> u64 {
    (requests.ranks.capacity() * size_of::<Vec<tessera_planner::Request>>()) as u64
        + requests
            .ranks
            .iter()
            .map(|r| (r.capacity() * size_of::<tessera_planner::Request>()) as u64)
            .sum::<u64>()
}

/// A clone of the plan allocates exactly what its `heap_bytes` says.
fn check_heap_bytes(planned: &tessera_planner::Plan) {
    let before = LIVE.load(Ordering::SeqCst);
    let copy = planned.clone();
    let held = LIVE.load(Ordering::SeqCst) - before;
    // A clone allocates exact capacities; the original may hold growth slack, so compare the
    // clone's own count with what it allocated.
    assert_eq!(copy.heap_bytes(), held, "heap_bytes of a cloned plan");
    assert!(planned.heap_bytes() >= held);
}

fn check(name: &str, m: &Measured) {
    eprintln!(
        "{name}: measured peak {} bytes, estimate {} ({:.2}x); requests {} pieces {} (estimate {} / {})",
        m.peak,
        m.estimate.bytes,
        m.estimate.bytes as f64 / m.peak as f64,
        m.requests,
        m.pieces,
        m.estimate.requests,
        m.estimate.pieces
    );
    assert_eq!(m.estimate.requests, m.requests, "{name}: requests");
    assert!(m.estimate.pieces >= m.pieces, "{name}: pieces");
    assert!(
        m.estimate.bytes >= m.peak,
        "{name}: estimate {} below the measured peak {}",
        m.estimate.bytes,
        m.peak
    );
    assert!(
        m.estimate.bytes as f64 <= 1.5 * m.peak as f64,
        "{name}: estimate {} more than 1.5x the measured peak {}",
        m.estimate.bytes,
        m.peak
    );
}

const MEGATRON: &[(&str, &[&str])] = &[
    ("*.norm*", &["stage(layer)", "replicate", "replicate"]),
    ("*qkv*", &["stage(layer)", "replicate", "shard(0)"]),
    ("*fc1*", &["stage(layer)", "replicate", "shard(0)"]),
    ("*proj*", &["stage(layer)", "replicate", "shard(1)"]),
    ("*fc2*", &["stage(layer)", "replicate", "shard(1)"]),
    ("*", &["stage(layer)", "replicate", "shard(0)"]),
];

/// One test runs every case: the counters are global, so nothing else in this binary may
/// allocate while a case is measured.
#[test]
fn estimates_bound_the_measured_peak_and_plans_count_their_bytes() {
    let megatron = mesh(&[("pp", 2), ("dp", 256), ("tp", 4)], MEGATRON, true);
    check(
        "pp2 dp256 tp4",
        &measure(&megatron, &PlanOptions::default(), false),
    );
    let fsdp = mesh(&[("dp", 2048)], &[("*", &["shard(0)"])], false);
    check(
        "fsdp dp2048",
        &measure(&fsdp, &PlanOptions::default(), false),
    );
    let replicated = mesh(&[("dp", 4096)], &[("*", &["replicate"])], false);
    check(
        "replicate dp4096",
        &measure(&replicated, &PlanOptions::default(), false),
    );
    let mixed = mesh(
        &[("dp", 64), ("tp", 8)],
        &[("*", &["replicate", "shard(0)"])],
        false,
    );
    check(
        "no-dedup dp64 tp8",
        &measure(
            &mixed,
            &PlanOptions {
                dedup: false,
                ..PlanOptions::default()
            },
            false,
        ),
    );
    let explicit = mesh(
        &[("dp", 128), ("tp", 4)],
        &[("*", &["replicate", "shard(0)"])],
        false,
    );
    check(
        "explicit dp128 tp4",
        &measure(&explicit, &PlanOptions::default(), true),
    );
}
