//! Prometheus metrics, kept by hand (the text exposition format is a few lines, a client library
//! would be a dependency tree): request counts and latency histograms per route, method and
//! status; cache hits and misses; metadata loads; plan computations and their time.
//!
//! Routes are labelled with their template (`/v1/plans/{plan}/ranks/{rank}`), never the raw
//! path, so that the number of series stays bounded whatever clients send.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Upper bounds (seconds) of the request latency buckets: from a cached answer (sub-millisecond)
/// to a cold plan of a 405B layout (seconds).
const REQUEST_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Upper bounds (seconds) of the plan computation buckets.
const PLAN_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The caches whose hits and misses are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum CacheKind {
    /// Catalog listings.
    Catalog,
    /// Runs' `latest` pointers.
    Latest,
    /// Opened checkpoint metadata.
    Metadata,
    /// Computed plans.
    Plan,
}

impl CacheKind {
    const ALL: [CacheKind; 4] = [
        CacheKind::Catalog,
        CacheKind::Latest,
        CacheKind::Metadata,
        CacheKind::Plan,
    ];

    fn name(self) -> &'static str {
        match self {
            CacheKind::Catalog => "catalog",
            CacheKind::Latest => "latest",
            CacheKind::Metadata => "metadata",
            CacheKind::Plan => "plan",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

#[derive(Clone, Debug)]
struct Histogram {
    /// Non-cumulative counts per bucket, plus one for +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(buckets: usize) -> Self {
        Self {
            counts: vec![0; buckets + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, bounds: &[f64], seconds: f64) {
        let slot = bounds
            .iter()
            .position(|&b| seconds <= b)
            .unwrap_or(bounds.len());
        self.counts[slot] += 1;
        self.sum += seconds;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, labels: &str, bounds: &[f64]) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut cumulative = 0;
        for (i, count) in self.counts.iter().enumerate() {
            cumulative += count;
            let le = bounds
                .get(i)
                .map_or_else(|| "+Inf".to_string(), |b| b.to_string());
            let _ = writeln!(
                out,
                "{name}_bucket{{{labels}{sep}le=\"{le}\"}} {cumulative}"
            );
        }
        let braces = if labels.is_empty() {
            String::new()
        } else {
            format!("{{{labels}}}")
        };
        let _ = writeln!(out, "{name}_sum{braces} {}", self.sum);
        let _ = writeln!(out, "{name}_count{braces} {}", self.count);
    }
}

/// Counters and histograms of one server.
#[derive(Debug)]
pub(crate) struct Metrics {
    /// Per (route, method, status): latency histogram (its count is the request count).
    requests: Mutex<BTreeMap<(String, String, u16), Histogram>>,
    hits: [AtomicU64; 4],
    misses: [AtomicU64; 4],
    metadata_loads: AtomicU64,
    plan_computations: AtomicU64,
    plan_failures: AtomicU64,
    plan_seconds: Mutex<Histogram>,
}

/// A copy of the counters a test or benchmark asserts on.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Requests answered.
    pub requests: u64,
    /// Plans computed (successfully or not).
    pub plan_computations: u64,
    /// Plan computations that failed (invalid layouts and requests).
    pub plan_failures: u64,
    /// Checkpoint metadata reads from storage.
    pub metadata_loads: u64,
    /// Plan cache hits.
    pub plan_cache_hits: u64,
    /// Plan cache misses.
    pub plan_cache_misses: u64,
    /// Metadata cache hits.
    pub metadata_cache_hits: u64,
    /// Metadata cache misses.
    pub metadata_cache_misses: u64,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        Self {
            requests: Mutex::new(BTreeMap::new()),
            hits: Default::default(),
            misses: Default::default(),
            metadata_loads: AtomicU64::new(0),
            plan_computations: AtomicU64::new(0),
            plan_failures: AtomicU64::new(0),
            plan_seconds: Mutex::new(Histogram::new(PLAN_BUCKETS.len())),
        }
    }

    /// Records one answered request.
    pub(crate) fn request(&self, route: &str, method: &str, status: u16, elapsed: Duration) {
        // A poisoned lock only means another request panicked mid-update of a counter.
        let mut requests = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        requests
            .entry((route.to_string(), method.to_string(), status))
            .or_insert_with(|| Histogram::new(REQUEST_BUCKETS.len()))
            .observe(&REQUEST_BUCKETS, elapsed.as_secs_f64());
    }

    /// Records a cache lookup.
    pub(crate) fn cache(&self, kind: CacheKind, hit: bool) {
        let counters = if hit { &self.hits } else { &self.misses };
        counters[kind.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Records a read of checkpoint metadata from storage.
    pub(crate) fn metadata_load(&self) {
        self.metadata_loads.fetch_add(1, Ordering::Relaxed);
    }

    /// Records a plan computation.
    pub(crate) fn plan_computed(&self, elapsed: Duration, ok: bool) {
        self.plan_computations.fetch_add(1, Ordering::Relaxed);
        if !ok {
            self.plan_failures.fetch_add(1, Ordering::Relaxed);
        }
        self.plan_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .observe(&PLAN_BUCKETS, elapsed.as_secs_f64());
    }

    pub(crate) fn snapshot(&self) -> MetricsSnapshot {
        let requests = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values()
            .map(|h| h.count)
            .sum();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            requests,
            plan_computations: load(&self.plan_computations),
            plan_failures: load(&self.plan_failures),
            metadata_loads: load(&self.metadata_loads),
            plan_cache_hits: load(&self.hits[CacheKind::Plan.index()]),
            plan_cache_misses: load(&self.misses[CacheKind::Plan.index()]),
            metadata_cache_hits: load(&self.hits[CacheKind::Metadata.index()]),
            metadata_cache_misses: load(&self.misses[CacheKind::Metadata.index()]),
        }
    }

    /// The text exposition (format 0.0.4). `caches` are (name, entries, weighted bytes).
    pub(crate) fn render(&self, caches: &[(&str, u64, u64)]) -> String {
        let mut out = String::with_capacity(8192);
        out.push_str(
            "# HELP tessera_http_requests_total Requests answered, by route template, method and status.\n\
             # TYPE tessera_http_requests_total counter\n",
        );
        let requests = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        for ((route, method, status), h) in &requests {
            let _ = writeln!(
                out,
                "tessera_http_requests_total{{route=\"{}\",method=\"{}\",status=\"{status}\"}} {}",
                escape(route),
                escape(method),
                h.count
            );
        }
        out.push_str(
            "# HELP tessera_http_request_duration_seconds Time to answer a request (until the response head).\n\
             # TYPE tessera_http_request_duration_seconds histogram\n",
        );
        for ((route, method, status), h) in &requests {
            let labels = format!(
                "route=\"{}\",method=\"{}\",status=\"{status}\"",
                escape(route),
                escape(method)
            );
            h.render(
                &mut out,
                "tessera_http_request_duration_seconds",
                &labels,
                &REQUEST_BUCKETS,
            );
        }
        for (name, help, counters) in [
            (
                "tessera_cache_hits_total",
                "Lookups answered from a cache (including waits on a computation another request started).",
                &self.hits,
            ),
            (
                "tessera_cache_misses_total",
                "Lookups that had to compute or read the value.",
                &self.misses,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for kind in CacheKind::ALL {
                let _ = writeln!(
                    out,
                    "{name}{{cache=\"{}\"}} {}",
                    kind.name(),
                    counters[kind.index()].load(Ordering::Relaxed)
                );
            }
        }
        let _ = writeln!(
            out,
            "# HELP tessera_cache_entries Entries held by a cache.\n# TYPE tessera_cache_entries gauge"
        );
        for (name, entries, _) in caches {
            let _ = writeln!(out, "tessera_cache_entries{{cache=\"{name}\"}} {entries}");
        }
        let _ = writeln!(
            out,
            "# HELP tessera_cache_bytes Estimated bytes held by a cache.\n# TYPE tessera_cache_bytes gauge"
        );
        for (name, _, bytes) in caches {
            let _ = writeln!(out, "tessera_cache_bytes{{cache=\"{name}\"}} {bytes}");
        }
        let _ = writeln!(
            out,
            "# HELP tessera_metadata_loads_total Checkpoint metadata reads from storage.\n\
             # TYPE tessera_metadata_loads_total counter\n\
             tessera_metadata_loads_total {}",
            self.metadata_loads.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP tessera_plan_computations_total Plans computed (each distinct plan once while cached).\n\
             # TYPE tessera_plan_computations_total counter\n\
             tessera_plan_computations_total {}",
            self.plan_computations.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP tessera_plan_failures_total Plan computations the planner refused.\n\
             # TYPE tessera_plan_failures_total counter\n\
             tessera_plan_failures_total {}",
            self.plan_failures.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP tessera_plan_compute_seconds Time to compute a plan.\n\
             # TYPE tessera_plan_compute_seconds histogram"
        );
        self.plan_seconds
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .render(&mut out, "tessera_plan_compute_seconds", "", &PLAN_BUCKETS);
        out
    }
}

/// Escapes a label value (backslash, quote, newline).
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let metrics = Metrics::new();
        metrics.request("/healthz", "GET", 200, Duration::from_micros(100));
        metrics.request("/healthz", "GET", 200, Duration::from_millis(30));
        metrics.request("/healthz", "GET", 200, Duration::from_secs(60));
        let text = metrics.render(&[]);
        assert!(text.contains(
            "tessera_http_requests_total{route=\"/healthz\",method=\"GET\",status=\"200\"} 3"
        ));
        assert!(text.contains("le=\"0.0005\"} 1\n"));
        assert!(text.contains("le=\"0.05\"} 2\n"));
        assert!(text.contains("le=\"+Inf\"} 3\n"));
        assert_eq!(metrics.snapshot().requests, 3);
    }
}
