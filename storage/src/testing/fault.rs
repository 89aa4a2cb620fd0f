//! Fault injection: [`FaultyStore`] wraps any [`ObjectStore`] and fails a deterministic share of
//! its read requests with a transient error, or all of them (an outage), and can add latency. It
//! drives the failure tests of the read path, in the manner of neon's fault-injecting remote
//! storage; writes, listings and deletes pass through untouched, so a checkpoint can be written
//! through the same wrapper.
//!
//! Read requests are `get_opts` (which `get`, `get_range` and `head` go through) and
//! `get_ranges`. They are numbered 1, 2, 3, … in the order they reach the wrapper; whether request
//! `n` fails depends on `n` (and the seed) only.

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
};

/// Which read requests fail.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FaultConfig {
    /// Fail every n-th read request (with 3: requests 3, 6, 9, …); 0 fails none this way.
    pub fail_every_nth: u64,
    /// Fail this share of read requests (0.0 to 1.0), decided per request number by a generator
    /// seeded with `seed`.
    pub fail_rate: f64,
    /// Seed of `fail_rate`'s decisions.
    pub seed: u64,
    /// Fail every read request: a permanent outage (can also be switched with
    /// [`FaultyStore::set_outage`]).
    pub outage: bool,
    /// Delay every read request by this much before it reaches the inner store (simulated
    /// latency: makes concurrent requests overlap, so limits on them become observable).
    pub latency: Duration,
}

impl FaultConfig {
    /// Fails requests `n`, `2n`, `3n`, ….
    pub fn every_nth(n: u64) -> Self {
        Self {
            fail_every_nth: n,
            ..Self::default()
        }
    }

    /// Fails a share `rate` of requests, deterministically for `seed`.
    pub fn rate(rate: f64, seed: u64) -> Self {
        Self {
            fail_rate: rate,
            seed,
            ..Self::default()
        }
    }

    /// Fails every request.
    pub fn outage() -> Self {
        Self {
            outage: true,
            ..Self::default()
        }
    }
}

/// What a [`FaultyStore`] has seen.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Read requests received.
    pub reads: u64,
    /// Read requests failed on purpose.
    pub injected: u64,
    /// Most read requests in progress at once.
    pub peak_in_flight: u64,
}

/// The error behind every injected failure (inside [`object_store::Error::Generic`], which the
/// loader treats as transient).
#[derive(Debug)]
pub struct InjectedFault;

impl fmt::Display for InjectedFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("injected transient fault")
    }
}

impl std::error::Error for InjectedFault {}

/// Name of the wrapper in injected errors (`Generic FaultyStore error: injected transient fault`).
pub const FAULTY_STORE: &str = "FaultyStore";

/// An [`ObjectStore`] that fails read requests on purpose (see the module docs).
#[derive(Debug)]
pub struct FaultyStore {
    inner: Arc<dyn ObjectStore>,
    config: FaultConfig,
    outage: AtomicBool,
    reads: AtomicU64,
    injected: AtomicU64,
    in_flight: AtomicU64,
    peak_in_flight: AtomicU64,
}

impl FaultyStore {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>, config: FaultConfig) -> Self {
        Self {
            inner,
            outage: AtomicBool::new(config.outage),
            config,
            reads: AtomicU64::new(0),
            injected: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            peak_in_flight: AtomicU64::new(0),
        }
    }

    /// Starts (true) or ends (false) a permanent outage of reads.
    pub fn set_outage(&self, outage: bool) {
        self.outage.store(outage, Ordering::SeqCst);
    }

    /// Read requests failed on purpose so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::SeqCst)
    }

    /// Counters so far.
    pub fn stats(&self) -> FaultStats {
        FaultStats {
            reads: self.reads.load(Ordering::SeqCst),
            injected: self.injected(),
            peak_in_flight: self.peak_in_flight.load(Ordering::SeqCst),
        }
    }

    /// Whether read request number `n` (1-based) fails.
    fn fails(&self, n: u64) -> bool {
        if self.outage.load(Ordering::SeqCst) {
            return true;
        }
        let nth = self.config.fail_every_nth;
        if nth > 0 && n.is_multiple_of(nth) {
            return true;
        }
        let rate = self.config.fail_rate;
        // 53 random bits make a uniform f64 in [0, 1).
        let draw = (splitmix64(self.config.seed ^ n) >> 11) as f64 / (1u64 << 53) as f64;
        rate > 0.0 && draw < rate
    }

    /// Counts a read request, waits the configured latency, and fails it if it is one to fail.
    async fn admit(&self) -> object_store::Result<InFlight<'_>> {
        let n = self.reads.fetch_add(1, Ordering::SeqCst) + 1;
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak_in_flight.fetch_max(now, Ordering::SeqCst);
        let guard = InFlight(&self.in_flight);
        if !self.config.latency.is_zero() {
            tokio::time::sleep(self.config.latency).await;
        }
        if self.fails(n) {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(object_store::Error::Generic {
                store: FAULTY_STORE,
                source: Box::new(InjectedFault),
            });
        }
        Ok(guard)
    }
}

/// Counts a read request as in progress until dropped.
struct InFlight<'a>(&'a AtomicU64);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl fmt::Display for FaultyStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FaultyStore({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for FaultyStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let _in_flight = self.admit().await?;
        self.inner.get_opts(location, options).await
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        let _in_flight = self.admit().await?;
        self.inner.get_ranges(location, ranges).await
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    fn list_with_offset(
        &self,
        prefix: Option<&Path>,
        offset: &Path,
    ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list_with_offset(prefix, offset)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.inner.rename_opts(from, to, options).await
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use object_store::ObjectStoreExt;

    async fn store(config: FaultConfig) -> FaultyStore {
        let inner = Arc::new(object_store::memory::InMemory::new());
        let store = FaultyStore::new(inner, config);
        store
            .put(&Path::from("a"), PutPayload::from_static(b"hello"))
            .await
            .unwrap();
        store
    }

    #[tokio::test]
    async fn every_third_read_fails_and_writes_pass() {
        let store = store(FaultConfig::every_nth(3)).await;
        let mut outcomes = Vec::new();
        for _ in 0..6 {
            outcomes.push(store.get_range(&Path::from("a"), 1..3).await.is_ok());
        }
        assert_eq!(outcomes, vec![true, true, false, true, true, false]);
        let all = store
            .get(&Path::from("a"))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(&all[..], b"hello");
        assert_eq!(
            store.stats(),
            FaultStats {
                reads: 7,
                injected: 2,
                peak_in_flight: 1
            }
        );
    }

    #[tokio::test]
    async fn an_outage_fails_every_read_until_lifted() {
        let store = store(FaultConfig::outage()).await;
        let error = store.get_range(&Path::from("a"), 0..5).await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "Generic FaultyStore error: injected transient fault"
        );
        let ranges = store.get_ranges(&Path::from("a"), &[0..1, 2..3]).await;
        assert!(ranges.is_err());
        store.set_outage(false);
        let bytes = store.get_range(&Path::from("a"), 0..5).await.unwrap();
        assert_eq!(&bytes[..], b"hello");
        assert_eq!(store.injected(), 2);
    }

    #[tokio::test]
    async fn a_rate_is_deterministic_per_seed() {
        let run = |seed| async move {
            let store = store(FaultConfig::rate(0.3, seed)).await;
            let mut failed = Vec::new();
            for _ in 0..200 {
                failed.push(store.get_range(&Path::from("a"), 0..1).await.is_err());
            }
            failed
        };
        let a = run(7).await;
        assert_eq!(a, run(7).await);
        let share = a.iter().filter(|f| **f).count();
        assert!((30..90).contains(&share), "{share} of 200 failed");
    }
}
