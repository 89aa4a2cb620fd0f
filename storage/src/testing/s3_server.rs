//! An S3-compatible server on 127.0.0.1 backed by a local directory (`s3s-fs`), for tests of
//! the `s3://` path: request signing, range reads, listing, multipart uploads and conditional
//! puts go over real HTTP, as they do against S3, MinIO or Ceph.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use object_store::ObjectStore;
use object_store::aws::AmazonS3Builder;
use s3s::auth::SimpleAuth;
use s3s::service::S3ServiceBuilder;

use super::loopback::LoopbackServer;
use crate::{StorageOptions, install_tls_provider};

/// The access key id the server accepts.
pub const ACCESS_KEY_ID: &str = "tessera-test";
/// The secret access key the server accepts.
pub const SECRET_ACCESS_KEY: &str = "tessera-test-secret";
/// The region clients sign for (the server accepts any).
pub const REGION: &str = "us-east-1";

/// How long shutting down may wait for requests in flight before they are cut off.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// An in-process S3-compatible server: one bucket per directory under `root`, static credentials
/// ([`ACCESS_KEY_ID`], [`SECRET_ACCESS_KEY`]), path-style requests over plain HTTP.
///
/// It runs on its own thread and Tokio runtime, so it serves synchronous tests, any test runtime,
/// and child processes (pass [`env`](Self::env) to them) alike. Dropping it stops accepting,
/// cuts connections after at most a few seconds, and joins the thread.
#[derive(Debug)]
pub struct S3TestServer {
    server: LoopbackServer,
    root: PathBuf,
    served: Arc<ServedCounters>,
}

/// What an [`S3TestServer`] has served to GET requests since it started (or since
/// [`S3TestServer::reset_served`]): counted at the server, so a test can hold a client's own
/// account of its reads against what actually went over the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Served {
    /// GET requests answered (object reads, ranged or whole; listings are GETs too).
    pub get_requests: u64,
    /// Body bytes of those answers, by their `Content-Length`.
    pub get_body_bytes: u64,
}

#[derive(Debug, Default)]
struct ServedCounters {
    /// Every GET answered: its URI path (`/bucket/key`) and body length.
    gets: Mutex<Vec<(String, u64)>>,
}

impl S3TestServer {
    /// Starts a server storing its buckets under `root` (an existing directory).
    ///
    /// # Panics
    /// When `root` is not a usable directory or no port on 127.0.0.1 can be bound: test setup
    /// that cannot go on.
    pub fn start(root: impl AsRef<Path>) -> Self {
        Self::start_with_link(root, None)
    }

    /// [`S3TestServer::start`] with every answer's body sent no faster than `bytes_per_second`,
    /// all answers sharing that one link (`None`: as fast as loopback goes). What benchmarks use
    /// to put a store of a stated bandwidth behind every client alike.
    ///
    /// # Panics
    /// As [`S3TestServer::start`].
    pub fn start_with_link(root: impl AsRef<Path>, bytes_per_second: Option<u64>) -> Self {
        let link = bytes_per_second.map(|rate| Arc::new(Link::new(rate)));
        let root = root.as_ref().to_path_buf();
        index_objects(&root);
        let fs = s3s_fs::FileSystem::new(&root)
            .unwrap_or_else(|e| panic!("S3 test server: cannot serve {}: {e:?}", root.display()));
        let service = {
            let mut builder = S3ServiceBuilder::new(fs);
            builder.set_auth(SimpleAuth::from_single(ACCESS_KEY_ID, SECRET_ACCESS_KEY));
            builder.build()
        };
        let served = Arc::new(ServedCounters::default());
        let counters = Arc::clone(&served);
        let server = LoopbackServer::start("S3 test server", SHUTDOWN_GRACE, move |socket| {
            let service = service.clone();
            let counters = Arc::clone(&counters);
            let link = link.clone();
            // Every answer passes through here on its way out: GETs are counted with the body
            // length the server declares (and sends: hyper refuses to send a body of another
            // length).
            let counted = hyper::service::service_fn(
                move |request: hyper::Request<hyper::body::Incoming>| {
                    let service = service.clone();
                    let counters = Arc::clone(&counters);
                    let link = link.clone();
                    async move {
                        let get = (request.method() == hyper::Method::GET)
                            .then(|| request.uri().path().to_string());
                        let response = hyper::service::Service::call(&service, request).await?;
                        if let Some(path) = get {
                            let length = response
                                .headers()
                                .get(hyper::header::CONTENT_LENGTH)
                                .and_then(|v| v.to_str().ok())
                                .and_then(|v| v.parse::<u64>().ok())
                                .unwrap_or(0);
                            lock(&counters.gets).push((path, length));
                        }
                        let response = response.map(|body| Throttled {
                            inner: Box::pin(body),
                            link,
                            held: None,
                            sleep: None,
                        });
                        Ok::<_, s3s::HttpError>(response)
                    }
                },
            );
            async move {
                // As S3 answers: without TCP_NODELAY a small answer written as headers then body
                // waits for the client's delayed ACK (tens of milliseconds a request on
                // loopback), which made a request look 100x dearer than it is.
                let _ = socket.set_nodelay(true);
                // A client that goes away mid-request is not the server's problem.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(socket), counted)
                    .await;
            }
        });
        Self {
            server,
            root,
            served,
        }
    }

    /// What the server has served to GET requests so far (see [`Served`]).
    pub fn served(&self) -> Served {
        self.served_where(|_| true)
    }

    /// What the server has served to GET requests for paths (`/bucket/key`) that `keep` takes:
    /// the data files of a checkpoint, say, without its metadata.
    pub fn served_where(&self, keep: impl Fn(&str) -> bool) -> Served {
        let gets = lock(&self.served.gets);
        let kept = gets.iter().filter(|(path, _)| keep(path));
        Served {
            get_requests: kept.clone().count() as u64,
            get_body_bytes: kept.map(|(_, bytes)| bytes).sum(),
        }
    }

    /// Gives every object placed in a bucket directory by hand (not uploaded through the server)
    /// the stored ETag an upload would have. Without one, s3s-fs computes the MD5 of the *whole*
    /// file on every GET, ranged or not: a 500 MB data file then costs a second of hashing per
    /// request, which made clients that issue many ranged GETs look far slower than clients that
    /// issue few. [`S3TestServer::start`] indexes what `root` holds; call this after copying more.
    pub fn index_objects(&self) {
        index_objects(&self.root);
    }

    /// Starts counting [`Served`] from zero again (after writing a checkpoint, say).
    pub fn reset_served(&self) {
        lock(&self.served.gets).clear();
    }

    /// The endpoint URL, `http://127.0.0.1:<port>`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.server.addr())
    }

    /// The directory the buckets live in.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Creates the bucket `name` (a directory under the root) if it does not exist.
    ///
    /// # Panics
    /// When `name` is not a plain bucket name or the directory cannot be created.
    pub fn create_bucket(&self, name: &str) {
        let valid = !name.is_empty()
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'.'))
            && !name.starts_with('.');
        assert!(valid, "S3 test server: invalid bucket name {name:?}");
        let dir = self.root.join(name);
        std::fs::create_dir_all(&dir)
            .unwrap_or_else(|e| panic!("S3 test server: creating {}: {e}", dir.display()));
    }

    /// The variables a client process needs to reach this server through
    /// [`storage::open`](crate::open): credentials, region, endpoint, plain HTTP.
    pub fn env(&self) -> Vec<(String, String)> {
        [
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID.to_string()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY.to_string()),
            ("AWS_REGION", REGION.to_string()),
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ALLOW_HTTP", "true".to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// Options for [`storage::open_with`](crate::open_with) that reach this server
    /// whatever the process environment holds.
    pub fn options(&self) -> StorageOptions {
        StorageOptions {
            env: self.env(),
            ignore_process_env: true,
            ..StorageOptions::default()
        }
    }

    /// A store for `bucket` on this server, built directly (not through the environment).
    ///
    /// # Panics
    /// When the store cannot be built (it can only be a bug here).
    pub fn store(&self, bucket: &str) -> Arc<dyn ObjectStore> {
        install_tls_provider();
        let store = AmazonS3Builder::new()
            .with_endpoint(self.endpoint())
            .with_allow_http(true)
            .with_region(REGION)
            .with_access_key_id(ACCESS_KEY_ID)
            .with_secret_access_key(SECRET_ACCESS_KEY)
            .with_bucket_name(bucket)
            .build()
            .unwrap_or_else(|e| panic!("S3 test server: building a client: {e}"));
        Arc::new(store)
    }
}

/// The log of GETs, even after a panic elsewhere poisoned it (a list of numbers stays valid).
fn lock(gets: &Mutex<Vec<(String, u64)>>) -> MutexGuard<'_, Vec<(String, u64)>> {
    gets.lock().unwrap_or_else(PoisonError::into_inner)
}

/// See [`S3TestServer::index_objects`]: writes s3s-fs's per-object info file
/// (`.bucket-<b64 bucket>.object-<b64 key>.internal.json` in `root`) with an ETag made from the
/// file's size and modification time (opaque to clients, as ETags are) for every object that has
/// none.
fn index_objects(root: &Path) {
    let Ok(buckets) = std::fs::read_dir(root) else {
        return;
    };
    for bucket in buckets.flatten() {
        let path = bucket.path();
        let name = bucket.file_name().to_string_lossy().to_string();
        if !path.is_dir() || name.starts_with('.') {
            continue;
        }
        let mut stack = vec![path.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries.flatten() {
                let file = entry.path();
                if file.is_dir() {
                    stack.push(file);
                    continue;
                }
                let Ok(relative) = file.strip_prefix(&path) else {
                    continue;
                };
                let key = relative
                    .components()
                    .map(|c| c.as_os_str().to_string_lossy())
                    .collect::<Vec<_>>()
                    .join("/");
                let info = root.join(format!(
                    ".bucket-{}.object-{}.internal.json",
                    base64_url(name.as_bytes()),
                    base64_url(key.as_bytes())
                ));
                if info.exists() {
                    continue;
                }
                let Ok(meta) = entry.metadata() else { continue };
                let modified = meta
                    .modified()
                    .ok()
                    .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
                    .map_or(0, |d| d.as_nanos());
                let e_tag = format!("{:x}-{modified:x}", meta.len());
                let _ = std::fs::write(&info, serde_json::json!({ "e_tag": e_tag }).to_string());
            }
        }
    }
}

/// Base64 with the URL-safe alphabet and no padding, as s3s-fs names its info files.
fn base64_url(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..=chunk.len() {
            out.push(char::from(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize]));
        }
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn base64_url_matches_the_alphabet_s3s_fs_names_its_files_with() {
        assert_eq!(base64_url(b"ckpts"), "Y2twdHM");
        assert_eq!(base64_url(b"a/b"), "YS9i");
        assert_eq!(base64_url(b"c/__0_0.distcp"), "Yy9fXzBfMC5kaXN0Y3A");
        assert_eq!(base64_url(&[0xfb, 0xff]), "-_8");
        assert_eq!(base64_url(b""), "");
    }

    #[test]
    fn objects_copied_in_by_hand_get_an_info_file_once() {
        let root = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(root.path().join("ckpts").join("c")).unwrap();
        std::fs::write(root.path().join("ckpts").join("c").join("x.bin"), b"abc").unwrap();
        index_objects(root.path());
        let info = root
            .path()
            .join(".bucket-Y2twdHM.object-Yy94LmJpbg.internal.json");
        let text = std::fs::read_to_string(&info).unwrap();
        assert!(text.starts_with("{\"e_tag\":\"3-"), "{text}");
        std::fs::write(&info, "{\"e_tag\":\"kept\"}").unwrap();
        index_objects(root.path());
        assert_eq!(
            std::fs::read_to_string(&info).unwrap(),
            "{\"e_tag\":\"kept\"}"
        );
    }
}

/// How far a throttled server's link may run behind before an answer waits for it.
const LINK_SLACK: Duration = Duration::from_millis(5);

/// The one link every answer of a throttled server shares: when it is free again.
#[derive(Debug)]
struct Link {
    bytes_per_second: f64,
    free_at: Mutex<std::time::Instant>,
}

impl Link {
    fn new(bytes_per_second: u64) -> Self {
        Self {
            bytes_per_second: bytes_per_second.max(1) as f64,
            free_at: Mutex::new(std::time::Instant::now()),
        }
    }

    /// Books `bytes` on the link; returns when they are through.
    fn reserve(&self, bytes: usize) -> std::time::Instant {
        let mut free_at = self.free_at.lock().unwrap_or_else(PoisonError::into_inner);
        let start = (*free_at).max(std::time::Instant::now());
        *free_at = start + Duration::from_secs_f64(bytes as f64 / self.bytes_per_second);
        *free_at
    }
}

/// An answer's body, each data frame held until the server's [`Link`] has carried it (passed
/// straight through without a link).
struct Throttled<B> {
    inner: std::pin::Pin<Box<B>>,
    link: Option<Arc<Link>>,
    held: Option<hyper::body::Frame<bytes::Bytes>>,
    sleep: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl<B> hyper::body::Body for Throttled<B>
where
    B: hyper::body::Body<Data = bytes::Bytes>,
{
    type Data = bytes::Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        use std::future::Future;
        use std::task::Poll;
        if let Some(sleep) = self.sleep.as_mut() {
            if sleep.as_mut().poll(cx).is_pending() {
                return Poll::Pending;
            }
            self.sleep = None;
            if let Some(frame) = self.held.take() {
                return Poll::Ready(Some(Ok(frame)));
            }
        }
        let frame = match self.inner.as_mut().poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => return other,
        };
        let bytes = frame.data_ref().map_or(0, bytes::Bytes::len);
        let Some(link) = self.link.as_ref().filter(|_| bytes > 0) else {
            return Poll::Ready(Some(Ok(frame)));
        };
        // A frame goes out at once while the link is less than LINK_SLACK behind: sleeping per
        // frame (a few KiB each) would cap every answer at a frame per timer tick (1 ms), far
        // below the link. The bookings still add up, so the rate holds over any longer span.
        let through = link.reserve(bytes);
        let release = through.checked_sub(LINK_SLACK).unwrap_or(through);
        if release <= std::time::Instant::now() {
            return Poll::Ready(Some(Ok(frame)));
        }
        let mut sleep = Box::pin(tokio::time::sleep_until(release.into()));
        if sleep.as_mut().poll(cx).is_ready() {
            return Poll::Ready(Some(Ok(frame)));
        }
        self.held = Some(frame);
        self.sleep = Some(sleep);
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.held.is_none() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}
