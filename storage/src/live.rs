//! A live publication's step opened as a checkpoint: the location `live+file:///<registry>/<name>/step-<N>`.
//!
//! A step of a publication (`tessera.publish`) is a native checkpoint whose metadata
//! (`metadata.arrow`, `checksums.arrow`, `manifest.json`, written last) lies in the registry
//! directory and whose data files stay in the publishing processes' memory, each served over
//! HTTP by the rank that holds it ([`crate::RangeServer`]). `publishers.json` next to the
//! manifest says which rank serves which data file, and where:
//!
//! ```text
//! {"publishers": [{"rank": 0, "file": "data/publisher-rank-0.bin",
//!                  "url": "http://10.0.0.7:40123", "path": "llama/step-000100/data/publisher-rank-0.bin"}]}
//! ```
//!
//! [`LiveStore`] is the local registry store with those files routed to their publishers'
//! HTTP servers, so the ordinary open, plan, verified reads and exchange run unchanged. Every
//! error of a routed read names the publisher rank and its URL (a publisher that died shows as
//! a refused connection naming it, within the [`RetryPolicy`](crate::RetryPolicy)'s bound).

use std::collections::HashMap;
use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use bytes::Bytes;
use futures::stream::BoxStream;
use object_store::http::HttpBuilder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use crate::shared_file::SharedHandle;
use crate::{Location, StorageError, StorageOptions};

/// The scheme of a live step's location.
pub const LIVE_SCHEME: &str = "live+file";
/// The file of a step that routes its data files to their publishers.
pub const PUBLISHERS_FILE: &str = "publishers.json";
/// Largest `publishers.json` read (a few hundred bytes per publisher rank).
const MAX_PUBLISHERS_BYTES: u64 = 16 * 1024 * 1024;

/// Where one data file of a step is served.
#[derive(Clone, Debug)]
pub struct Publisher {
    /// The publishing job's rank that holds the file.
    pub rank: u32,
    /// Its server's origin, `http://host:port`.
    pub url: String,
    /// The file's path on that server.
    pub path: Path,
    store: Arc<dyn ObjectStore>,
    /// The file opened as shared memory (its publisher is on this host), read instead of HTTP.
    pub shared: Option<Arc<std::fs::File>>,
}

/// The registry's local store with each publisher's data file read from its HTTP server.
#[derive(Debug)]
pub struct LiveStore {
    local: Arc<dyn ObjectStore>,
    /// By the file's path in the local store (`<step>/data/publisher-rank-<r>.bin`).
    routes: HashMap<Path, Publisher>,
}

impl fmt::Display for LiveStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LiveStore({}, {} publisher files)",
            self.local,
            self.routes.len()
        )
    }
}

/// The error a publisher's read failed with, naming the publisher.
#[derive(Debug)]
struct PublisherFailed {
    rank: u32,
    url: String,
    source: object_store::Error,
}

impl fmt::Display for PublisherFailed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "publisher rank {} at {}: {}",
            self.rank, self.url, self.source
        )
    }
}

impl std::error::Error for PublisherFailed {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.source)
    }
}

impl LiveStore {
    /// The publisher serving `path`, if it is a routed data file.
    pub fn publisher(&self, path: &Path) -> Option<&Publisher> {
        self.routes.get(path)
    }

    fn failed(
        publisher: &Publisher,
        path: &Path,
        source: object_store::Error,
    ) -> object_store::Error {
        let failed = PublisherFailed {
            rank: publisher.rank,
            url: publisher.url.clone(),
            source,
        };
        match &failed.source {
            // Retired (superseded past `keep`) or never served: not a transient failure.
            object_store::Error::NotFound { .. } => object_store::Error::NotFound {
                path: path.to_string(),
                source: Box::new(failed),
            },
            // Refused connections, resets and timeouts stay transient (Generic), so the
            // retry policy's bound applies before the read fails naming the publisher.
            _ => object_store::Error::Generic {
                store: "live",
                source: Box::new(failed),
            },
        }
    }

    /// The bytes `options` asks of `file`, publisher `p`'s file shared on this host.
    fn get_shared(
        p: &Publisher,
        file: &std::fs::File,
        location: &Path,
        options: &GetOptions,
    ) -> object_store::Result<GetResult> {
        let failed = |what: String| {
            Self::failed(
                p,
                location,
                object_store::Error::Generic {
                    store: "live",
                    source: format!("its shared memory: {what}").into(),
                },
            )
        };
        let file = file
            .try_clone()
            .map_err(|e| failed(format!("cannot duplicate its descriptor: {e}")))?;
        let path = std::path::PathBuf::from(crate::shared_file::own_fd_path(&file));
        crate::local_file_get(location, file, path, options, "file").map_err(failed)
    }

    fn read_only(path: &Path) -> object_store::Error {
        object_store::Error::NotSupported {
            source: format!("{path}: a live publication is read-only").into(),
        }
    }
}

#[async_trait::async_trait]
impl ObjectStore for LiveStore {
    async fn put_opts(
        &self,
        location: &Path,
        _payload: PutPayload,
        _opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        Err(Self::read_only(location))
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        _opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        Err(Self::read_only(location))
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        match self.routes.get(location) {
            None => self.local.get_opts(location, options).await,
            Some(
                p @ Publisher {
                    shared: Some(file), ..
                },
            ) => Self::get_shared(p, file, location, &options),
            Some(p) => {
                let mut result = p
                    .store
                    .get_opts(&p.path, options)
                    .await
                    .map_err(|e| Self::failed(p, location, e))?;
                // Readers see the file under its path in this store, as listed in the manifest.
                result.meta.location = location.clone();
                Ok(result)
            }
        }
    }

    async fn get_ranges(
        &self,
        location: &Path,
        ranges: &[Range<u64>],
    ) -> object_store::Result<Vec<Bytes>> {
        match self.routes.get(location) {
            None => self.local.get_ranges(location, ranges).await,
            Some(
                p @ Publisher {
                    shared: Some(file), ..
                },
            ) => {
                let mut out = Vec::with_capacity(ranges.len());
                for range in ranges {
                    let result = Self::get_shared(
                        p,
                        file,
                        location,
                        &GetOptions {
                            range: Some(range.clone().into()),
                            ..GetOptions::default()
                        },
                    )?;
                    out.push(result.bytes().await?);
                }
                Ok(out)
            }
            Some(p) => p
                .store
                .get_ranges(&p.path, ranges)
                .await
                .map_err(|e| Self::failed(p, location, e)),
        }
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        use futures::StreamExt;
        locations
            .map(|p| p.and_then(|p| Err(Self::read_only(&p))))
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.local.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.local.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        _from: &Path,
        to: &Path,
        _options: CopyOptions,
    ) -> object_store::Result<()> {
        Err(Self::read_only(to))
    }
}

fn invalid(location: &str, detail: String) -> StorageError {
    StorageError::Location {
        location: location.to_string(),
        detail,
    }
}

/// Opens a live step (`raw`: the step directory's path, the scheme stripped): the local
/// registry store with every data file `publishers.json` lists routed to its publisher.
pub(crate) fn open_live(
    location: &str,
    root: &std::path::Path,
    name: &str,
    options: &StorageOptions,
) -> Result<Location, StorageError> {
    let step = root.join(name);
    let file = step.join(PUBLISHERS_FILE);
    let text = match std::fs::metadata(&file) {
        Ok(meta) if meta.len() > MAX_PUBLISHERS_BYTES => {
            return Err(invalid(
                location,
                format!(
                    "{} is {} bytes, over the cap of {MAX_PUBLISHERS_BYTES}",
                    file.display(),
                    meta.len()
                ),
            ));
        }
        Ok(_) => std::fs::read_to_string(&file)
            .map_err(|e| invalid(location, format!("reading {}: {e}", file.display())))?,
        Err(e) => {
            return Err(invalid(
                location,
                format!(
                    "{} cannot be read ({e}): not a complete step of a live publication",
                    file.display()
                ),
            ));
        }
    };
    let bad = |detail: String| invalid(location, format!("{}: {detail}", file.display()));
    let value: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let Some(entries) = value.get("publishers").and_then(|p| p.as_array()) else {
        return Err(bad("no \"publishers\" list".to_string()));
    };
    let local: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new_with_prefix(root).map_err(
        |source| StorageError::Store {
            action: "opening".to_string(),
            path: root.display().to_string(),
            source,
        },
    )?);
    crate::install_tls_provider();
    let mut stores: HashMap<String, Arc<dyn ObjectStore>> = HashMap::new();
    let mut routes = HashMap::with_capacity(entries.len());
    let mut shared_files = HashMap::new();
    for (i, entry) in entries.iter().enumerate() {
        let field = |key: &str| entry.get(key).and_then(|v| v.as_str());
        let (Some(rank), Some(file), Some(url), Some(path)) = (
            entry.get("rank").and_then(|v| v.as_u64()),
            field("file"),
            field("url"),
            field("path"),
        ) else {
            return Err(bad(format!(
                "publisher {i}: needs rank, file, url and path"
            )));
        };
        let rank = u32::try_from(rank).map_err(|_| bad(format!("publisher {i}: rank {rank}")))?;
        if !url.starts_with("http://") {
            return Err(bad(format!(
                "publisher rank {rank}: url {url:?} is not http://"
            )));
        }
        let store = match stores.get(url) {
            Some(store) => store.clone(),
            None => {
                let policy = &options.retry;
                let store: Arc<dyn ObjectStore> = Arc::new(
                    HttpBuilder::new()
                        .with_url(url)
                        .with_client_options(policy.client_options().with_allow_http(true))
                        .with_retry(policy.object_store_retry())
                        .build()
                        .map_err(|e| bad(format!("publisher rank {rank} at {url}: {e}")))?,
                );
                stores.insert(url.to_string(), store.clone());
                store
            }
        };
        let local_path = Path::parse(format!("{name}/{file}"))
            .map_err(|e| bad(format!("publisher rank {rank}: file {file:?}: {e}")))?;
        let remote = Path::parse(path)
            .map_err(|e| bad(format!("publisher rank {rank}: path {path:?}: {e}")))?;
        // Shared on this host: opened now, once, so the load reads the step it opened even if
        // the publisher retires it or dies meanwhile. Anything else (another host, a refusal)
        // reads over HTTP.
        let shared = entry
            .get("shared")
            .and_then(|h| serde_json::from_value::<SharedHandle>(h.clone()).ok())
            .and_then(|handle| crate::shared_file::open_shared(&handle).ok())
            .map(Arc::new);
        if let Some(file) = &shared {
            shared_files.insert(
                local_path.to_string(),
                std::path::PathBuf::from(crate::shared_file::own_fd_path(file)),
            );
        }
        routes.insert(
            local_path,
            Publisher {
                rank,
                url: url.to_string(),
                path: remote,
                store,
                shared,
            },
        );
    }
    Ok(Location {
        store: Arc::new(LiveStore { local, routes }),
        prefix: Path::from(name),
        display: location.to_string(),
        // Every read of a data file must go to its publisher (over HTTP, or its shared memory
        // on this host), never to a file of the registry directory.
        local_root: None,
        shared_files,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::RangeServer;
    use object_store::ObjectStoreExt;

    #[tokio::test]
    async fn data_files_are_read_from_their_publishers_and_metadata_locally() {
        let server = RangeServer::start("127.0.0.1").unwrap();
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        server.serve(
            "m/step-000002/data/publisher-rank-1.bin",
            Bytes::from(data.clone()),
        );
        let dir = tempfile::tempdir().unwrap();
        let step = dir.path().join("step-000002");
        std::fs::create_dir_all(&step).unwrap();
        std::fs::write(step.join("manifest.json"), b"{}").unwrap();
        let publishers = serde_json::json!({"publishers": [{
            "rank": 1, "file": "data/publisher-rank-1.bin", "url": server.url(),
            "path": "m/step-000002/data/publisher-rank-1.bin"}]});
        std::fs::write(step.join(PUBLISHERS_FILE), publishers.to_string()).unwrap();
        let location = format!("{LIVE_SCHEME}://{}", step.display());
        let opened = crate::open_with(&location, &StorageOptions::default()).unwrap();
        assert!(opened.local_root.is_none());
        let file = Path::from("step-000002/data/publisher-rank-1.bin");
        let got = opened.store.get_range(&file, 100..4200).await.unwrap();
        assert_eq!(got.as_ref(), &data[100..4200]);
        assert_eq!(opened.store.head(&file).await.unwrap().size, 5000);
        let manifest = opened
            .store
            .get(&Path::from("step-000002/manifest.json"))
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(manifest.as_ref(), b"{}");

        // Retired: not found, naming the publisher.
        server.remove("m/step-000002/data/publisher-rank-1.bin");
        let err = opened.store.get_range(&file, 0..10).await.unwrap_err();
        let text = format!(
            "{err} {:?}",
            std::error::Error::source(&err).map(|s| s.to_string())
        );
        assert!(
            matches!(err, object_store::Error::NotFound { .. }),
            "{text}"
        );
        assert!(text.contains("publisher rank 1"), "{text}");
        assert!(text.contains(&server.url()), "{text}");
    }

    #[cfg(target_os = "linux")]
    #[tokio::test]
    async fn a_file_shared_on_this_host_is_read_from_its_memory_after_the_publisher_let_go() {
        let data: Vec<u8> = (0..9000u32).map(|i| (i % 241) as u8).collect();
        let server = RangeServer::start("127.0.0.1").unwrap();
        let shared = crate::shared_file::SharedFile::create("tessera-live-test", &data).unwrap();
        let served = "m/step-000004/data/publisher-rank-0.bin";
        server.serve(served, shared.bytes());
        let dir = tempfile::tempdir().unwrap();
        let step = dir.path().join("step-000004");
        std::fs::create_dir_all(&step).unwrap();
        // One file shared on this host, one whose handle names another host (read over HTTP).
        let mut elsewhere = shared.handle().clone();
        elsewhere.boot_id = "another-host".to_string();
        server.serve(
            "m/step-000004/data/publisher-rank-1.bin",
            Bytes::from(data.clone()),
        );
        let publishers = serde_json::json!({"publishers": [
            {"rank": 0, "file": "data/publisher-rank-0.bin", "url": server.url(), "path": served,
             "shared": shared.handle()},
            {"rank": 1, "file": "data/publisher-rank-1.bin", "url": server.url(),
             "path": "m/step-000004/data/publisher-rank-1.bin", "shared": elsewhere}]});
        std::fs::write(step.join(PUBLISHERS_FILE), publishers.to_string()).unwrap();
        let location = format!("{LIVE_SCHEME}://{}", step.display());
        let opened = crate::open_with(&location, &StorageOptions::default()).unwrap();
        let file = Path::from("step-000004/data/publisher-rank-0.bin");
        let other = Path::from("step-000004/data/publisher-rank-1.bin");
        assert!(opened.shared_files.contains_key(file.as_ref()));
        assert!(!opened.shared_files.contains_key(other.as_ref()));
        // The publisher stops serving and drops its file: what the consumer opened stays.
        server.remove(served);
        drop(shared);
        drop(server);
        let got = opened.store.get_range(&file, 100..8100).await.unwrap();
        assert_eq!(got.as_ref(), &data[100..8100]);
        let ranges = opened
            .store
            .get_ranges(&file, &[0..10, 8990..9000])
            .await
            .unwrap();
        assert_eq!(ranges[1].as_ref(), &data[8990..9000]);
        assert_eq!(opened.store.head(&file).await.unwrap().size, 9000);
        // By the path readers open for positioned reads, too.
        let local = &opened.shared_files[file.as_ref()];
        let mut piece = [0u8; 4];
        std::os::unix::fs::FileExt::read_exact_at(
            &std::fs::File::open(local).unwrap(),
            &mut piece,
            4000,
        )
        .unwrap();
        assert_eq!(&piece, &data[4000..4004]);
        // The file of another host went over HTTP, and the server is gone.
        let err = opened.store.get_range(&other, 0..10).await.unwrap_err();
        assert!(err.to_string().contains("publisher rank 1"), "{err}");
    }

    #[tokio::test]
    async fn a_dead_publisher_fails_the_read_naming_it() {
        let server = RangeServer::start("127.0.0.1").unwrap();
        let url = server.url();
        drop(server);
        let dir = tempfile::tempdir().unwrap();
        let step = dir.path().join("step-000001");
        std::fs::create_dir_all(&step).unwrap();
        let publishers = serde_json::json!({"publishers": [{
            "rank": 3, "file": "data/publisher-rank-3.bin", "url": url,
            "path": "m/step-000001/data/publisher-rank-3.bin"}]});
        std::fs::write(step.join(PUBLISHERS_FILE), publishers.to_string()).unwrap();
        let location = format!("{LIVE_SCHEME}://{}", step.display());
        let opened = crate::open_with(&location, &StorageOptions::default()).unwrap();
        let file = Path::from("step-000001/data/publisher-rank-3.bin");
        let err = opened.store.get_range(&file, 0..10).await.unwrap_err();
        assert!(err.to_string().contains("publisher rank 3"), "{err}");
    }

    #[test]
    fn a_step_without_publishers_is_refused_naming_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let step = dir.path().join("step-000001");
        std::fs::create_dir_all(&step).unwrap();
        let location = format!("{LIVE_SCHEME}://{}", step.display());
        let err = crate::open_with(&location, &StorageOptions::default()).unwrap_err();
        assert!(err.to_string().contains(PUBLISHERS_FILE), "{err}");
    }
}
