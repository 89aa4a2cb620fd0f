//! Fault injection: [`FaultyStore`] wraps any [`ObjectStore`] and fails a deterministic share of
//! its read requests with a transient error, or all of them (an outage), and can add latency. It
//! drives the failure tests of the read path, in the manner of neon's fault-injecting remote
//! storage. Write requests fail only when [`FaultConfig`]'s `write_*` fields ask for it (the
//! save path's tests); by default writes, listings and deletes pass through untouched, so a
//! checkpoint can be written through the same wrapper that fails its reads.
//!
//! Read requests are `get_opts` (which `get`, `get_range` and `head` go through) and
//! `get_ranges`. They are numbered 1, 2, 3, … in the order they reach the wrapper; whether request
//! `n` fails depends on `n` (and the seed) only. Write requests (`put_opts`, the start of a
//! multipart upload, each of its parts and its completion) are numbered on their own, the same
//! way, so turning write faults on does not move which reads fail.

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
    PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, UploadPart,
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
    /// Fail every n-th write request (with 3: writes 3, 6, 9, …); 0 fails none. A retry is a new
    /// request, so each failure is transient: the next attempt passes.
    pub write_every_nth: u64,
    /// Let the first n write requests pass and fail every later one: a permanent outage that
    /// starts mid-save (`Some(0)`: from the first write). `None`: no write outage.
    pub write_outage_after: Option<u64>,
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

    /// Fails write requests `n`, `2n`, `3n`, … (reads pass).
    pub fn write_every_nth(n: u64) -> Self {
        Self {
            write_every_nth: n,
            ..Self::default()
        }
    }

    /// Fails every write request after the first `n` (reads pass).
    pub fn write_outage_after(n: u64) -> Self {
        Self {
            write_outage_after: Some(n),
            ..Self::default()
        }
    }

    /// Parses a fault specification, the syntax of the Python package's `TESSERA_TEST_FAULTS`:
    /// `write_every_nth:N`, `write_outage` or `write_outage_after:N`.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let spec = spec.trim();
        let (name, arg) = match spec.split_once(':') {
            Some((name, arg)) => (name, Some(arg)),
            None => (spec, None),
        };
        let number = |arg: Option<&str>| -> Result<u64, String> {
            let arg = arg.ok_or_else(|| format!("fault {name:?} needs a number: {name}:N"))?;
            arg.trim()
                .parse()
                .map_err(|_| format!("fault {name:?}: {arg:?} is not a whole number"))
        };
        match name {
            "write_every_nth" => match number(arg)? {
                0 => Err("write_every_nth:0 would fail nothing".to_string()),
                n => Ok(Self::write_every_nth(n)),
            },
            "write_outage" if arg.is_none() => Ok(Self::write_outage_after(0)),
            "write_outage_after" => Ok(Self::write_outage_after(number(arg)?)),
            _ => Err(format!(
                "unknown fault {spec:?}: use write_every_nth:N, write_outage or write_outage_after:N"
            )),
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
    /// Write requests received.
    pub writes: u64,
    /// Write requests failed on purpose.
    pub injected_writes: u64,
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
    /// Shared with the multipart uploads it hands out, whose parts are write requests too.
    writes: Arc<WriteFaults>,
}

/// The write side's rules and counters.
#[derive(Debug)]
struct WriteFaults {
    every_nth: u64,
    outage_after: Option<u64>,
    requests: AtomicU64,
    injected: AtomicU64,
}

impl WriteFaults {
    /// Counts a write request; the injected error when it is one to fail.
    fn admit(&self) -> object_store::Result<()> {
        let n = self.requests.fetch_add(1, Ordering::SeqCst) + 1;
        let fails = (self.every_nth > 0 && n.is_multiple_of(self.every_nth))
            || self.outage_after.is_some_and(|after| n > after);
        if fails {
            self.injected.fetch_add(1, Ordering::SeqCst);
            return Err(injected());
        }
        Ok(())
    }
}

fn injected() -> object_store::Error {
    object_store::Error::Generic {
        store: FAULTY_STORE,
        source: Box::new(InjectedFault),
    }
}

impl FaultyStore {
    /// Wraps `inner`.
    pub fn new(inner: Arc<dyn ObjectStore>, config: FaultConfig) -> Self {
        let writes = Arc::new(WriteFaults {
            every_nth: config.write_every_nth,
            outage_after: config.write_outage_after,
            requests: AtomicU64::new(0),
            injected: AtomicU64::new(0),
        });
        Self {
            inner,
            outage: AtomicBool::new(config.outage),
            config,
            reads: AtomicU64::new(0),
            injected: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            peak_in_flight: AtomicU64::new(0),
            writes,
        }
    }

    /// Starts (true) or ends (false) a permanent outage of reads.
    pub fn set_outage(&self, outage: bool) {
        self.outage.store(outage, Ordering::SeqCst);
    }

    /// Write requests failed on purpose so far.
    pub fn injected_writes(&self) -> u64 {
        self.writes.injected.load(Ordering::SeqCst)
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
            writes: self.writes.requests.load(Ordering::SeqCst),
            injected_writes: self.injected_writes(),
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
            return Err(injected());
        }
        Ok(guard)
    }
}

/// A multipart upload whose parts and completion are write requests of its [`FaultyStore`].
#[derive(Debug)]
struct FaultyUpload {
    inner: Box<dyn MultipartUpload>,
    writes: Arc<WriteFaults>,
}

#[async_trait::async_trait]
impl MultipartUpload for FaultyUpload {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        // Decided before the inner upload sees the part: a failed part never reaches it, as a
        // request refused by the server would not.
        match self.writes.admit() {
            Ok(()) => self.inner.put_part(data),
            Err(e) => Box::pin(async move { Err(e) }),
        }
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        self.writes.admit()?;
        self.inner.complete().await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.inner.abort().await
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
        self.writes.admit()?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.writes.admit()?;
        let inner = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(FaultyUpload {
            inner,
            writes: self.writes.clone(),
        }))
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
                peak_in_flight: 1,
                writes: 1,
                injected_writes: 0,
            }
        );
    }

    #[tokio::test]
    async fn every_third_write_fails_once_and_reads_pass() {
        let store = FaultyStore::new(
            Arc::new(object_store::memory::InMemory::new()),
            FaultConfig::write_every_nth(3),
        );
        let mut outcomes = Vec::new();
        for i in 0..5 {
            let path = Path::from(format!("f{i}"));
            outcomes.push(
                store
                    .put(&path, PutPayload::from_static(b"x"))
                    .await
                    .is_ok(),
            );
        }
        assert_eq!(outcomes, vec![true, true, false, true, true]);
        // A multipart upload's start, parts and completion are write requests too: 6 fails,
        // then 7 (start) and 8 (part) pass, 9 (part) fails, 10 and 11 (completion) pass.
        let error = store.put_multipart(&Path::from("big")).await.unwrap_err();
        assert_eq!(
            error.to_string(),
            "Generic FaultyStore error: injected transient fault"
        );
        let mut upload = store.put_multipart(&Path::from("big")).await.unwrap();
        assert!(upload.put_part(PutPayload::from_static(b"a")).await.is_ok());
        assert!(
            upload
                .put_part(PutPayload::from_static(b"b"))
                .await
                .is_err()
        );
        assert!(upload.put_part(PutPayload::from_static(b"c")).await.is_ok());
        assert!(upload.complete().await.is_ok());
        assert!(store.get(&Path::from("f0")).await.is_ok());
        let stats = store.stats();
        assert_eq!((stats.writes, stats.injected_writes), (11, 3));
        assert_eq!((stats.reads, stats.injected), (1, 0));
    }

    #[tokio::test]
    async fn a_write_outage_starts_after_the_first_writes() {
        let store = FaultyStore::new(
            Arc::new(object_store::memory::InMemory::new()),
            FaultConfig::parse("write_outage_after:2").unwrap(),
        );
        let mut outcomes = Vec::new();
        for i in 0..4 {
            let path = Path::from(format!("f{i}"));
            outcomes.push(
                store
                    .put(&path, PutPayload::from_static(b"x"))
                    .await
                    .is_ok(),
            );
        }
        assert_eq!(outcomes, vec![true, true, false, false]);
        assert_eq!(store.injected_writes(), 2);
    }

    #[test]
    fn fault_specs_parse_or_say_what_is_accepted() {
        assert_eq!(
            FaultConfig::parse("write_every_nth:3"),
            Ok(FaultConfig::write_every_nth(3))
        );
        assert_eq!(
            FaultConfig::parse("write_outage"),
            Ok(FaultConfig::write_outage_after(0))
        );
        assert!(FaultConfig::parse("write_every_nth:0").is_err());
        assert!(FaultConfig::parse("write_every_nth").is_err());
        let unknown = FaultConfig::parse("every_nth:3").unwrap_err();
        assert!(unknown.contains("use write_every_nth:N"), "{unknown}");
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
