//! [`ThrottledStore`]: a wrapper that delivers what it reads no faster than a set bandwidth, so a
//! benchmark on a machine whose page cache serves tens of GB/s can show what a load costs where
//! storage is the limit (a network file system or an object store at 1 GB/s per process).

use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};
use std::sync::Arc;

/// An [`ObjectStore`] whose reads share one link of `bytes_per_second`: every read's body is
/// fetched from the inner store, then released when the link would have finished carrying it
/// (reads in flight at once queue on the link, as they would on one process's share of a
/// network). Writes and listings pass through unthrottled.
#[derive(Debug)]
pub struct ThrottledStore {
    inner: Arc<dyn ObjectStore>,
    bytes_per_second: f64,
    /// When the link is free again.
    free_at: Mutex<Instant>,
    /// Bytes carried so far.
    carried: Mutex<u64>,
}

impl ThrottledStore {
    /// Wraps `inner` behind a link of `bytes_per_second` (at least 1).
    pub fn new(inner: Arc<dyn ObjectStore>, bytes_per_second: u64) -> Self {
        Self {
            inner,
            bytes_per_second: bytes_per_second.max(1) as f64,
            free_at: Mutex::new(Instant::now()),
            carried: Mutex::new(0),
        }
    }

    /// Bytes read through this store so far.
    pub fn bytes_carried(&self) -> u64 {
        *self.carried.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Reserves the link for `bytes` and returns when they would have arrived.
    fn reserve(&self, bytes: u64) -> Instant {
        *self.carried.lock().unwrap_or_else(PoisonError::into_inner) += bytes;
        let mut free_at = self.free_at.lock().unwrap_or_else(PoisonError::into_inner);
        let start = (*free_at).max(Instant::now());
        *free_at = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_second);
        *free_at
    }
}

impl fmt::Display for ThrottledStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Throttled({}, {:.0} MB/s)",
            self.inner,
            self.bytes_per_second / 1e6
        )
    }
}

#[async_trait::async_trait]
impl ObjectStore for ThrottledStore {
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
        let head = options.head;
        let result = self.inner.get_opts(location, options).await?;
        if head {
            return Ok(result);
        }
        let (meta, range, attributes, extensions) = (
            result.meta.clone(),
            result.range.clone(),
            result.attributes.clone(),
            result.extensions.clone(),
        );
        let bytes = result.bytes().await?;
        let arrives = self.reserve(bytes.len() as u64);
        tokio::time::sleep_until(arrives.into()).await;
        Ok(GetResult {
            payload: GetResultPayload::Stream(
                futures::stream::once(async move { Ok(bytes) }).boxed(),
            ),
            meta,
            range,
            attributes,
            extensions,
        })
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
    use super::*;
    use object_store::ObjectStoreExt;
    use object_store::memory::InMemory;

    #[tokio::test]
    async fn reads_arrive_at_the_links_pace_and_intact() {
        let inner: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let data: Vec<u8> = (0..200_000u32).map(|i| i as u8).collect();
        inner
            .put(&Path::from("a"), data.clone().into())
            .await
            .unwrap();
        // 1 MB/s: two reads of 100 kB in flight at once share the link, 0.2 s in all.
        let store = ThrottledStore::new(inner, 1_000_000);
        let path = Path::from("a");
        let started = Instant::now();
        let (first, second) = tokio::join!(
            store.get_range(&path, 0..100_000),
            store.get_range(&path, 100_000..200_000)
        );
        let elapsed = started.elapsed();
        assert_eq!(&first.unwrap()[..], &data[..100_000]);
        assert_eq!(&second.unwrap()[..], &data[100_000..]);
        assert_eq!(store.bytes_carried(), 200_000);
        assert!(elapsed >= Duration::from_millis(195), "{elapsed:?}");
    }
}
