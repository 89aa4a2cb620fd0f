//! An S3-compatible server on 127.0.0.1 backed by a local directory (`s3s-fs`), for tests of
//! the `s3://` path: request signing, range reads, listing, multipart uploads and conditional
//! puts go over real HTTP, as they do against S3, MinIO or Ceph.

use std::path::{Path, PathBuf};
use std::sync::Arc;
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
        let server = LoopbackServer::start("S3 test server", SHUTDOWN_GRACE, move |socket| {
            let service = service.clone();
            async move {
                // A client that goes away mid-request is not the server's problem.
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            }
        });
        Self { server, root }
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
