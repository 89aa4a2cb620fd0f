//! [`OverlayStore`]: a view of a store that serves some paths itself and passes everything else
//! to the store beneath, refusing writes to the paths it serves. The loader reads through two
//! such views, each an [`Overlay`]: encoded files as their decoded bytes
//! ([`crate::read::decoded::DecodedStore`]) and data files from a node's memory-tier copies
//! ([`crate::tier::TierStore`]). `object_store` has no delegating base, so the forwarding is
//! written once here.

use std::fmt;
use std::sync::Arc;

use futures::stream::BoxStream;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

/// What a view serves itself, over which store.
#[async_trait::async_trait]
pub trait Overlay: fmt::Debug + fmt::Display + Send + Sync + 'static {
    /// The store beneath: every path the view does not serve.
    fn inner(&self) -> &Arc<dyn ObjectStore>;

    /// Whether the view serves `location` itself.
    fn serves(&self, location: &Path) -> bool;

    /// A read of `location`, a path the view serves.
    async fn get_served(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult>;

    /// The error of a write to `location`, a path the view serves.
    fn refuse_write(&self, location: &Path) -> object_store::Error;
}

/// The [`ObjectStore`] of an [`Overlay`].
#[derive(Debug)]
pub struct OverlayStore<O>(pub O);

impl<O: Overlay> fmt::Display for OverlayStore<O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl<O: Overlay> OverlayStore<O> {
    fn writable(&self, location: &Path) -> object_store::Result<()> {
        match self.0.serves(location) {
            true => Err(self.0.refuse_write(location)),
            false => Ok(()),
        }
    }
}

#[async_trait::async_trait]
impl<O: Overlay> ObjectStore for OverlayStore<O> {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.writable(location)?;
        self.0.inner().put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.writable(location)?;
        self.0.inner().put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        if self.0.serves(location) {
            self.0.get_served(location, options).await
        } else {
            self.0.inner().get_opts(location, options).await
        }
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.0.inner().delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.0.inner().list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.0.inner().list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.writable(to)?;
        self.0.inner().copy_opts(from, to, options).await
    }
}
