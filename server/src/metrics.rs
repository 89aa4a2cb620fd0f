//! Prometheus metrics, kept in a `prometheus-client` registry and encoded in its OpenMetrics text
//! format: request counts and latency histograms per route, method and status; cache hits and
//! misses, entries and bytes; metadata loads; plan computations and their time.
//!
//! Routes are labelled with their template (`/v1/plans/{plan}/ranks/{rank}`), never the raw
//! path, so that the number of series stays bounded whatever clients send.

use std::fmt::Write as _;
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, LabelValueEncoder};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Upper bounds (seconds) of the request latency buckets: from a cached answer (sub-millisecond)
/// to a cold plan of a 405B layout (seconds).
const REQUEST_BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Upper bounds (seconds) of the plan computation buckets.
const PLAN_BUCKETS: [f64; 12] = [
    0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// The media type of the OpenMetrics text format, which `prometheus-client` writes.
pub(crate) const OPENMETRICS_TEXT: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The media type answered to clients that do not ask for OpenMetrics (browsers, `curl`, older
/// scrapers). The body is the same: the Prometheus text parser reads OpenMetrics text as it is
/// (`# EOF` is a comment to it), and a browser shows `text/plain` where it would download
/// `application/openmetrics-text`.
pub(crate) const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The caches whose hits and misses are counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
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
}

impl EncodeLabelValue for CacheKind {
    fn encode(&self, encoder: &mut LabelValueEncoder) -> Result<(), std::fmt::Error> {
        encoder.write_str(self.name())
    }
}

/// Labels of the request series.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct RequestLabels {
    route: String,
    method: String,
    status: u16,
}

/// Labels of the cache series.
#[derive(Clone, Debug, PartialEq, Eq, Hash, EncodeLabelSet)]
struct CacheLabels {
    cache: CacheKind,
}

fn request_histogram() -> Histogram {
    Histogram::new(REQUEST_BUCKETS)
}

/// Counters and histograms of one server, registered in its own registry (not a global one, so
/// that servers in one process, as in tests, count apart).
#[derive(Debug)]
pub(crate) struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    request_seconds: Family<RequestLabels, Histogram, fn() -> Histogram>,
    /// All requests, for [`MetricsSnapshot`] (a family cannot be summed without encoding it).
    requests_answered: Counter,
    hits: Family<CacheLabels, Counter>,
    misses: Family<CacheLabels, Counter>,
    cache_entries: Family<CacheLabels, Gauge>,
    cache_bytes: Family<CacheLabels, Gauge>,
    metadata_loads: Counter,
    plan_computations: Counter,
    plan_failures: Counter,
    plan_seconds: Histogram,
    connections_refused: Counter,
    connections_closed_idle: Counter,
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
        let requests = Family::<RequestLabels, Counter>::default();
        let request_seconds =
            Family::<RequestLabels, Histogram, fn() -> Histogram>::new_with_constructor(
                request_histogram,
            );
        let hits = Family::<CacheLabels, Counter>::default();
        let misses = Family::<CacheLabels, Counter>::default();
        // Every cache's series from the start, at zero: a rate over a series that appears
        // only with its first hit misses that hit.
        for cache in CacheKind::ALL {
            drop(hits.get_or_create(&CacheLabels { cache }));
            drop(misses.get_or_create(&CacheLabels { cache }));
        }
        let cache_entries = Family::<CacheLabels, Gauge>::default();
        let cache_bytes = Family::<CacheLabels, Gauge>::default();
        let metadata_loads = Counter::default();
        let plan_computations = Counter::default();
        let plan_failures = Counter::default();
        let plan_seconds = Histogram::new(PLAN_BUCKETS);
        let connections_refused = Counter::default();
        let connections_closed_idle = Counter::default();

        // Help texts without a final full stop: the registry appends one. Counter names without
        // `_total`: the encoder appends it to the samples.
        let mut registry = Registry::default();
        registry.register(
            "tessera_http_requests",
            "Requests answered, by route template, method and status",
            requests.clone(),
        );
        registry.register(
            "tessera_http_request_duration_seconds",
            "Time to answer a request (until the response head)",
            request_seconds.clone(),
        );
        registry.register(
            "tessera_cache_hits",
            "Lookups answered from a cache (including waits on a computation another request started)",
            hits.clone(),
        );
        registry.register(
            "tessera_cache_misses",
            "Lookups that had to compute or read the value",
            misses.clone(),
        );
        registry.register(
            "tessera_cache_entries",
            "Entries held by a cache",
            cache_entries.clone(),
        );
        registry.register(
            "tessera_cache_bytes",
            "Estimated bytes held by a cache",
            cache_bytes.clone(),
        );
        registry.register(
            "tessera_metadata_loads",
            "Checkpoint metadata reads from storage",
            metadata_loads.clone(),
        );
        registry.register(
            "tessera_plan_computations",
            "Plans computed (each distinct plan once while cached)",
            plan_computations.clone(),
        );
        registry.register(
            "tessera_plan_failures",
            "Plan computations the planner refused",
            plan_failures.clone(),
        );
        registry.register(
            "tessera_plan_compute_seconds",
            "Time to compute a plan",
            plan_seconds.clone(),
        );
        registry.register(
            "tessera_connections_refused",
            "Connections closed on arrival because the server held its limit of connections, each with a request in flight",
            connections_refused.clone(),
        );
        registry.register(
            "tessera_connections_closed_idle",
            "Idle connections (no request in flight) closed at the connection limit to make room for a new one",
            connections_closed_idle.clone(),
        );
        Self {
            registry,
            requests,
            request_seconds,
            requests_answered: Counter::default(),
            hits,
            misses,
            cache_entries,
            cache_bytes,
            metadata_loads,
            plan_computations,
            plan_failures,
            plan_seconds,
            connections_refused,
            connections_closed_idle,
        }
    }

    /// Records one answered request.
    pub(crate) fn request(&self, route: &str, method: &str, status: u16, elapsed: Duration) {
        let labels = RequestLabels {
            route: route.to_string(),
            method: method.to_string(),
            status,
        };
        self.requests.get_or_create(&labels).inc();
        self.request_seconds
            .get_or_create(&labels)
            .observe(elapsed.as_secs_f64());
        self.requests_answered.inc();
    }

    /// Records a cache lookup.
    pub(crate) fn cache(&self, cache: CacheKind, hit: bool) {
        let family = if hit { &self.hits } else { &self.misses };
        family.get_or_create(&CacheLabels { cache }).inc();
    }

    /// Records a read of checkpoint metadata from storage.
    pub(crate) fn metadata_load(&self) {
        self.metadata_loads.inc();
    }

    /// Records a connection closed on arrival at the connection limit.
    pub(crate) fn connection_refused(&self) {
        self.connections_refused.inc();
    }

    /// Records an idle connection closed at the connection limit to make room for a new one.
    pub(crate) fn connection_closed_idle(&self) {
        self.connections_closed_idle.inc();
    }

    /// Records a plan computation.
    pub(crate) fn plan_computed(&self, elapsed: Duration, ok: bool) {
        self.plan_computations.inc();
        if !ok {
            self.plan_failures.inc();
        }
        self.plan_seconds.observe(elapsed.as_secs_f64());
    }

    pub(crate) fn snapshot(&self) -> MetricsSnapshot {
        let count = |family: &Family<CacheLabels, Counter>, cache| {
            family.get_or_create(&CacheLabels { cache }).get()
        };
        MetricsSnapshot {
            requests: self.requests_answered.get(),
            plan_computations: self.plan_computations.get(),
            plan_failures: self.plan_failures.get(),
            metadata_loads: self.metadata_loads.get(),
            plan_cache_hits: count(&self.hits, CacheKind::Plan),
            plan_cache_misses: count(&self.misses, CacheKind::Plan),
            metadata_cache_hits: count(&self.hits, CacheKind::Metadata),
            metadata_cache_misses: count(&self.misses, CacheKind::Metadata),
        }
    }

    /// The OpenMetrics text exposition, with the cache sizes as of now: (cache, entries,
    /// estimated bytes).
    pub(crate) fn render(&self, caches: &[(CacheKind, u64, u64)]) -> String {
        for &(cache, entries, bytes) in caches {
            let labels = CacheLabels { cache };
            let gauge = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
            self.cache_entries
                .get_or_create(&labels)
                .set(gauge(entries));
            self.cache_bytes.get_or_create(&labels).set(gauge(bytes));
        }
        let mut out = String::with_capacity(8192);
        // Writing into a String cannot fail; an error would come from an encoder bug, and a
        // partial exposition is still more use to a scraper than none.
        if let Err(error) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(%error, "encoding metrics");
        }
        out
    }
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
            "tessera_http_requests_total{route=\"/healthz\",method=\"GET\",status=\"200\"} 3\n"
        ));
        // prometheus-client writes `le` first; label order means nothing to Prometheus.
        let bucket = |le: &str, count: u64| {
            format!(
                "tessera_http_request_duration_seconds_bucket{{le=\"{le}\",route=\"/healthz\",method=\"GET\",status=\"200\"}} {count}\n"
            )
        };
        assert!(text.contains(&bucket("0.0005", 1)), "{text}");
        assert!(text.contains(&bucket("0.05", 2)), "{text}");
        assert!(text.contains(&bucket("+Inf", 3)), "{text}");
        assert!(text.ends_with("# EOF\n"));
        assert_eq!(metrics.snapshot().requests, 3);
    }

    #[test]
    fn every_cache_counts_from_zero() {
        let metrics = Metrics::new();
        metrics.cache(CacheKind::Plan, true);
        let text = metrics.render(&[(CacheKind::Metadata, 2, 4096)]);
        assert!(
            text.contains("tessera_cache_hits_total{cache=\"plan\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("tessera_cache_misses_total{cache=\"latest\"} 0\n"),
            "{text}"
        );
        assert!(
            text.contains("tessera_cache_entries{cache=\"metadata\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("tessera_cache_bytes{cache=\"metadata\"} 4096\n"),
            "{text}"
        );
        let snapshot = metrics.snapshot();
        assert_eq!(
            (snapshot.plan_cache_hits, snapshot.plan_cache_misses),
            (1, 0)
        );
    }
}
