//! [`HookedStore`]: a wrapper that runs a test's hook before every write request reaches the
//! inner store, so a test can stall or fail the write of one named object (the manifest, the
//! run's `latest` pointer) at the moment a protocol reaches it, which counting requests
//! ([`FaultyStore`](super::FaultyStore)) cannot aim at.

use std::fmt;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

/// What a [`HookedStore`] runs before a write of the path it is given: the write goes on when the
/// future returns `Ok`, and fails with its error (reaching nothing) otherwise.
pub type WriteHook = dyn Fn(&Path) -> BoxFuture<'static, object_store::Result<()>> + Send + Sync;

/// An [`ObjectStore`] that awaits a [`WriteHook`] before every put and every multipart upload it
/// starts; reads, listings, deletes and copies pass straight through.
pub struct HookedStore {
    inner: Arc<dyn ObjectStore>,
    hook: Arc<WriteHook>,
}

impl HookedStore {
    /// Wraps `inner`, running `hook` before each write.
    pub fn new(
        inner: Arc<dyn ObjectStore>,
        hook: impl Fn(&Path) -> BoxFuture<'static, object_store::Result<()>> + Send + Sync + 'static,
    ) -> Self {
        Self {
            inner,
            hook: Arc::new(hook),
        }
    }
}

impl fmt::Debug for HookedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HookedStore")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

impl fmt::Display for HookedStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Hooked({})", self.inner)
    }
}

#[async_trait::async_trait]
impl ObjectStore for HookedStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        (self.hook)(location).await?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        (self.hook)(location).await?;
        self.inner.put_multipart_opts(location, opts).await
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
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::{Duration, Instant};

    use futures::FutureExt;
    use object_store::ObjectStoreExt;
    use object_store::memory::InMemory;

    use super::*;

    #[tokio::test]
    async fn the_hook_stalls_or_fails_only_the_writes_it_aims_at() {
        let store = HookedStore::new(Arc::new(InMemory::new()), |path| {
            let name = path.filename().unwrap_or_default().to_string();
            async move {
                match name.as_str() {
                    "slow" => tokio::time::sleep(Duration::from_millis(200)).await,
                    "full" => {
                        return Err(object_store::Error::Generic {
                            store: "test",
                            source: Box::new(std::io::Error::from(std::io::ErrorKind::StorageFull)),
                        });
                    }
                    _ => {}
                }
                Ok(())
            }
            .boxed()
        });
        let started = Instant::now();
        store.put(&Path::from("a/fast"), "x".into()).await.unwrap();
        assert!(started.elapsed() < Duration::from_millis(200));
        store.put(&Path::from("a/slow"), "y".into()).await.unwrap();
        assert!(started.elapsed() >= Duration::from_millis(200));
        let err = store.put(&Path::from("a/full"), "z".into()).await;
        assert!(err.is_err());
        // The failed write reached nothing; the others did.
        assert!(store.head(&Path::from("a/full")).await.is_err());
        let slow = store.get(&Path::from("a/slow")).await.unwrap();
        assert_eq!(slow.bytes().await.unwrap(), "y");
    }
}
