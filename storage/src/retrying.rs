//! [`RetryingStore`]: the write side of tessera's retry policy, as a wrapper over any store.
//!
//! The read path retries in its scheduler (per range, with a `head` to tell a truncated file from
//! an outage); writes have no scheduler, so the save path writes through this wrapper instead. It
//! retries a write request that failed transiently ([`is_transient`]) with [`RetryPolicy`]'s
//! backoff and attempts, and counts the retries so that a save can report them.
//!
//! What it retries: `put_opts` (one-request files: claims, small data files, metadata,
//! checksums, the manifest, `latest`) and the start of a multipart upload. What it cannot: the
//! parts and the completion of a multipart upload. object_store's `MultipartUpload` numbers a
//! part by the order of `put_part` calls (S3's part index, the local store's file offset), so
//! calling it again for a failed part would upload a different part, and completing twice is
//! undefined. A caller that holds a large file's bytes retries the whole file instead (the save
//! path does: `tessera_ops::save`).

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use backon::Retryable;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    ObjectStoreExt, PutMode, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions,
};

use crate::{RetryPolicy, is_transient};

/// Name of the wrapper in the error of a request given up on.
pub const RETRYING_STORE: &str = "RetryingStore";

/// A transient error that outlasted every attempt (inside [`object_store::Error::Generic`], so
/// it stays transient: a later save may pass).
#[derive(Debug)]
pub struct GaveUp {
    /// Attempts made.
    pub attempts: u32,
    /// The last attempt's error.
    pub source: object_store::Error,
}

impl fmt::Display for GaveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "gave up after {} attempts: {}",
            self.attempts, self.source
        )
    }
}

impl std::error::Error for GaveUp {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

/// An [`ObjectStore`] that retries transient write failures (see the module docs). Reads,
/// listings and deletes pass through: their callers retry them (or need not).
#[derive(Debug)]
pub struct RetryingStore {
    inner: Arc<dyn ObjectStore>,
    policy: RetryPolicy,
    retries: AtomicU64,
}

impl RetryingStore {
    /// Wraps `inner`, retrying as `policy` says.
    pub fn new(inner: Arc<dyn ObjectStore>, policy: RetryPolicy) -> Self {
        Self {
            inner,
            policy,
            retries: AtomicU64::new(0),
        }
    }

    /// Write requests retried so far (attempts after the first, over every request).
    pub fn retries(&self) -> u64 {
        self.retries.load(Ordering::SeqCst)
    }

    /// Runs `request` until it succeeds, fails permanently, or the policy's attempts are spent.
    /// `request` gets the attempt number (1-based).
    async fn retry<T, F, Fut>(&self, request: F) -> object_store::Result<T>
    where
        F: Fn(u32) -> Fut,
        Fut: Future<Output = object_store::Result<T>>,
    {
        let attempts = AtomicU32::new(0);
        let outcome = (|| request(attempts.fetch_add(1, Ordering::SeqCst) + 1))
            .retry(self.policy.backoff())
            .when(is_transient)
            .notify(|_, _| {
                self.retries.fetch_add(1, Ordering::SeqCst);
            })
            .await;
        let attempts = attempts.load(Ordering::SeqCst);
        match outcome {
            Err(source) if attempts > 1 && is_transient(&source) => {
                Err(object_store::Error::Generic {
                    store: RETRYING_STORE,
                    source: Box::new(GaveUp { attempts, source }),
                })
            }
            outcome => outcome,
        }
    }
}

impl RetryingStore {
    /// Attempt `attempt` (1-based) of a `put_opts`.
    async fn put_attempt(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
        attempt: u32,
    ) -> object_store::Result<PutResult> {
        let create = matches!(opts.mode, PutMode::Create);
        match self.inner.put_opts(location, payload.clone(), opts).await {
            // An exclusive create retried after a transient failure may find the object its own
            // earlier attempt made (the request landed, the answer was lost). Only an object with
            // exactly these bytes counts as ours: claims and manifests carry a time and a
            // process, so another writer's differ.
            Err(e @ object_store::Error::AlreadyExists { .. }) if create && attempt > 1 => {
                let Ok(found) = self.inner.get(location).await else {
                    return Err(e);
                };
                let meta = found.meta.clone();
                let bytes = found.bytes().await?;
                let ours: Vec<u8> = payload.iter().flatten().copied().collect();
                if bytes.as_ref() == ours.as_slice() {
                    Ok(PutResult {
                        e_tag: meta.e_tag,
                        version: meta.version,
                        extensions: Default::default(),
                    })
                } else {
                    Err(e)
                }
            }
            outcome => outcome,
        }
    }
}

impl fmt::Display for RetryingStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "RetryingStore({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for RetryingStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.retry(|attempt| self.put_attempt(location, payload.clone(), opts.clone(), attempt))
            .await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.retry(|_| self.inner.put_multipart_opts(location, opts.clone()))
            .await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
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

#[cfg(all(test, feature = "testing"))]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::testing::{FaultConfig, FaultyStore};

    fn quick() -> RetryPolicy {
        RetryPolicy {
            first_backoff: Duration::from_millis(1),
            ..RetryPolicy::default()
        }
    }

    fn stores(config: FaultConfig) -> (Arc<FaultyStore>, RetryingStore) {
        let faulty = Arc::new(FaultyStore::new(
            Arc::new(object_store::memory::InMemory::new()),
            config,
        ));
        (faulty.clone(), RetryingStore::new(faulty, quick()))
    }

    #[tokio::test]
    async fn transient_write_failures_are_retried_and_counted() {
        let (faulty, store) = stores(FaultConfig::write_every_nth(2));
        for i in 0..3 {
            let path = Path::from(format!("f{i}"));
            store
                .put(&path, PutPayload::from_static(b"data"))
                .await
                .unwrap();
        }
        // Writes 2 and 4 failed and were tried again.
        assert_eq!(faulty.injected_writes(), 2);
        assert_eq!(store.retries(), 2);
        let upload = store.put_multipart(&Path::from("big")).await;
        assert!(upload.is_ok(), "the start of an upload is retried too");
    }

    #[tokio::test]
    async fn an_exclusive_create_that_landed_before_its_error_is_ours_on_a_retry() {
        let (_, store) = stores(FaultConfig::default());
        let path = Path::from("manifest.json");
        let create = || PutOptions::from(PutMode::Create);
        // What an earlier attempt whose answer was lost left behind.
        store
            .inner
            .put(&path, PutPayload::from_static(b"mine"))
            .await
            .unwrap();
        let mine = || PutPayload::from_static(b"mine");
        assert!(store.put_attempt(&path, mine(), create(), 2).await.is_ok());
        // On the first attempt the object cannot be ours; on a retry, other bytes are not.
        for (payload, attempt) in [(mine(), 1), (PutPayload::from_static(b"theirs"), 2)] {
            let outcome = store.put_attempt(&path, payload, create(), attempt).await;
            assert!(
                matches!(outcome, Err(object_store::Error::AlreadyExists { .. })),
                "attempt {attempt}: {outcome:?}"
            );
        }
    }

    #[tokio::test]
    async fn an_outage_is_given_up_after_the_policys_attempts() {
        let (faulty, store) = stores(FaultConfig::write_outage_after(0));
        let error = store
            .put(&Path::from("f"), PutPayload::from_static(b"data"))
            .await
            .unwrap_err();
        assert!(is_transient(&error), "{error}");
        assert_eq!(
            error.to_string(),
            "Generic RetryingStore error: gave up after 5 attempts: Generic FaultyStore error: injected transient fault"
        );
        assert_eq!(faulty.injected_writes(), 5);
        assert_eq!(store.retries(), 4);
    }

    #[tokio::test]
    async fn permanent_errors_are_not_retried() {
        let (_, store) = stores(FaultConfig::default());
        let path = Path::from("taken");
        let create = || PutOptions::from(PutMode::Create);
        store
            .put_opts(&path, PutPayload::from_static(b"a"), create())
            .await
            .unwrap();
        let error = store
            .put_opts(&path, PutPayload::from_static(b"b"), create())
            .await
            .unwrap_err();
        assert!(matches!(error, object_store::Error::AlreadyExists { .. }));
        assert_eq!(store.retries(), 0);
    }
}
