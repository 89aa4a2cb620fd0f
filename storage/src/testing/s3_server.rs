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
        let root = root.as_ref().to_path_buf();
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
            // Every answer passes through here on its way out: GETs are counted with the body
            // length the server declares (and sends: hyper refuses to send a body of another
            // length).
            let counted = hyper::service::service_fn(
                move |request: hyper::Request<hyper::body::Incoming>| {
                    let service = service.clone();
                    let counters = Arc::clone(&counters);
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
