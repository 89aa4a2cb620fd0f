//! Where checkpoints live. A location string opens as an object store plus the checkpoint's
//! prefix inside it:
//!
//! | location | store | prefix |
//! |---|---|---|
//! | `run/step-000100`, `/abs/run/step-000100`, `file:///abs/run/step-000100` | the local directory `run` | `step-000100` |
//! | `s3://bucket/run/step-000100` | the bucket | `run/step-000100` |
//! | `gs://bucket/run/step-000100` | the bucket | `run/step-000100` |
//! | `az://container/run/step-000100` | the container | `run/step-000100` |
//! | `https://host/run/step-000100` (read only) | the origin `https://host` | `run/step-000100` |
//! | `live+file:///registry/name/step-000100` (read only) | the registry directory `name`, its data files read from their publishers ([`crate::live`]) | `step-000100` |
//!
//! The store is always wider than the checkpoint (the parent directory, the whole bucket) so that
//! the run's `latest` pointer next to the step directories stays reachable through it, and object
//! paths in messages stay short.
//!
//! Cloud stores are configured the way their own tools are, from the environment: `AWS_*`
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_REGION`, `AWS_ENDPOINT_URL` for
//! S3-compatible servers, `AWS_ALLOW_HTTP=true` for plain-HTTP endpoints), `GOOGLE_*` and
//! `AZURE_*`, with the key names `object_store` documents. [`StorageOptions`] adds or replaces
//! variables without touching the process environment (tests, or callers that resolved
//! credentials themselves).
//!
//! Every cloud store gets [`RetryPolicy`]'s client settings: a connect and a request timeout, and
//! object_store's own retry switched off (see [`RetryPolicy`] for why and for the bound).
//!
//! Opening does no network IO: a bucket that does not exist, or credentials the service refuses,
//! show up at the first read or write.

use std::sync::{Arc, Once};

use object_store::ObjectStore;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::local::LocalFileSystem;
use object_store::path::Path;

use crate::{RetryPolicy, StorageError};

/// The location forms [`open`] understands, for messages.
const SUPPORTED: &str = "use a local path, file://, s3://, gs://, az://, http:// or https://";

/// An opened location: the store and the prefix of the checkpoint (or catalog root) in it.
#[derive(Clone, Debug)]
pub struct Location {
    /// The store.
    pub store: Arc<dyn ObjectStore>,
    /// The prefix inside the store.
    pub prefix: Path,
    /// What the user typed, for messages.
    pub display: String,
    /// For a local location, the directory the store's paths are relative to: the object at
    /// path `p` is the file `local_root/p`. Readers use it for positioned reads straight into
    /// their destinations (no intermediate buffer). `None` for cloud and HTTP stores, and for a
    /// store wrapped in something (a fault injector, a recorder) that every read must pass
    /// through.
    pub local_root: Option<std::path::PathBuf>,
    /// Files of the store that are also open in this process as local files (a live
    /// publication's data files shared by publishers on this host, [`crate::shared_file`]):
    /// store path → a path that opens the same file (`/proc/self/fd/<n>`). Readers read them
    /// by position, as they read a memory tier's copies.
    pub shared_files: std::collections::HashMap<String, std::path::PathBuf>,
}

/// What kind of store a location names: the one place that tells a local path from an object
/// store (front ends and readers ask this instead of looking at the URL themselves).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocationKind {
    /// A local path or `file://` URL.
    Local,
    /// An object store or HTTP server (`s3://`, `gs://`, `az://`, `http(s)://`; any other
    /// `scheme://` counts as remote too, though opening it fails).
    Remote,
}

impl LocationKind {
    /// The kind of `location` (what the user typed).
    pub fn of(location: &str) -> LocationKind {
        match parse(location) {
            Ok(Parsed::Local(_)) => LocationKind::Local,
            Ok(Parsed::Cloud { .. } | Parsed::Live(_)) => LocationKind::Remote,
            Err(_) if location.contains("://") => LocationKind::Remote,
            Err(_) => LocationKind::Local,
        }
    }
}

/// The path a local location names as typed, `file://` stripped; `None` for a remote one.
pub fn local_path(location: &str) -> Option<&str> {
    match LocationKind::of(location) {
        LocationKind::Local => Some(location.strip_prefix("file://").unwrap_or(location)),
        LocationKind::Remote => None,
    }
}

/// `location` written one way for every way of naming the same place, for comparing what two
/// processes were given (the ranks of one job): a local path made absolute against the current
/// directory, `.` and `..` resolved and symbolic links followed where it exists, as a `file://`
/// URL; a remote one with its key's empty segments and surrounding slashes dropped (object
/// stores read `a//b/` as `a/b`, see [`open_with`]) and an HTTP host in lower case.
pub fn canonical(location: &str) -> Result<String, StorageError> {
    match parse(location)? {
        Parsed::Local(raw) => {
            let (root, name) = local_parts(location, raw)?;
            let lexical = root.join(name);
            // A location that does not exist (yet) keeps its lexical form: nothing to follow.
            let path = std::fs::canonicalize(&lexical).unwrap_or(lexical);
            Ok(format!("file://{}", path.display()))
        }
        Parsed::Live(raw) => {
            let (root, name) = local_parts(location, raw)?;
            let lexical = root.join(name);
            let path = std::fs::canonicalize(&lexical).unwrap_or(lexical);
            Ok(format!("{}://{}", crate::live::LIVE_SCHEME, path.display()))
        }
        Parsed::Cloud { kind, bucket, key } => {
            let (scheme, bucket) = match kind {
                Cloud::S3 => ("s3", bucket.to_string()),
                Cloud::Gcs => ("gs", bucket.to_string()),
                Cloud::Azure => ("az", bucket.to_string()),
                Cloud::Http { https } => (
                    if https { "https" } else { "http" },
                    bucket.to_ascii_lowercase(),
                ),
            };
            let key: Vec<&str> = key.split('/').filter(|part| !part.is_empty()).collect();
            Ok(format!("{scheme}://{bucket}/{}", key.join("/")))
        }
    }
}

impl Location {
    /// The kind of store this location is in (as the user named it).
    pub fn kind(&self) -> LocationKind {
        LocationKind::of(&self.display)
    }
}

/// How cloud stores are configured, on top of (or instead of) the process environment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StorageOptions {
    /// Environment-style variables (`AWS_ACCESS_KEY_ID`, `GOOGLE_SERVICE_ACCOUNT`,
    /// `AZURE_STORAGE_ACCOUNT_NAME`, ...) that take precedence over the process environment; a
    /// later entry wins over an earlier one. Names the backend does not know are ignored, as they
    /// are in the environment.
    pub env: Vec<(String, String)>,
    /// Configure stores from [`env`](Self::env) only, not from the process environment.
    pub ignore_process_env: bool,
    /// The timeouts every request of a cloud or HTTP store gets (connect, read silence, whole
    /// request) and object_store's retry (off). The default policy unless a caller (a test with
    /// short timeouts) needs another.
    pub retry: RetryPolicy,
}

/// Opens `location` for reading, configured from the process environment. See the module
/// documentation for the location forms.
pub fn open(location: &str) -> Result<Location, StorageError> {
    open_with(location, &StorageOptions::default())
}

/// Opens `location` for writing a checkpoint, configured from the process environment. A local
/// location gets its parent directories created; buckets and containers must exist already.
pub fn create(location: &str) -> Result<Location, StorageError> {
    create_with(location, &StorageOptions::default())
}

/// [`open`] with explicit configuration.
pub fn open_with(location: &str, options: &StorageOptions) -> Result<Location, StorageError> {
    match parse(location)? {
        Parsed::Local(raw) => {
            let (root, name) = local_parts(location, raw)?;
            match std::fs::metadata(&root) {
                Ok(meta) if meta.is_dir() => {}
                Ok(_) => {
                    return Err(invalid(
                        location,
                        format!("{} is not a directory", root.display()),
                    ));
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    return Err(invalid(
                        location,
                        format!("directory {} does not exist", root.display()),
                    ));
                }
                Err(e) => {
                    return Err(invalid(
                        location,
                        format!("cannot read directory {}: {e}", root.display()),
                    ));
                }
            }
            local(location, &root, &name)
        }
        Parsed::Live(raw) => {
            let (root, name) = local_parts(location, raw)?;
            crate::live::open_live(location, &root, &name, options)
        }
        Parsed::Cloud { kind, bucket, key } => cloud(location, kind, bucket, key, options),
    }
}

/// [`create`] with explicit configuration.
pub fn create_with(location: &str, options: &StorageOptions) -> Result<Location, StorageError> {
    match parse(location)? {
        Parsed::Local(raw) => {
            let (root, name) = local_parts(location, raw)?;
            std::fs::create_dir_all(&root).map_err(|e| {
                invalid(
                    location,
                    format!("creating directory {}: {e}", root.display()),
                )
            })?;
            local(location, &root, &name)
        }
        Parsed::Live(_) => Err(invalid(
            location,
            "a live publication is read-only; tessera.publish writes it".to_string(),
        )),
        Parsed::Cloud {
            kind: Cloud::Http { .. },
            ..
        } => Err(invalid(
            location,
            "http:// and https:// locations are read-only; write to a local path, s3://, gs:// or az://"
                .to_string(),
        )),
        Parsed::Cloud { kind, bucket, key } => cloud(location, kind, bucket, key, options),
    }
}

/// Installs ring as the process-wide rustls crypto provider, once. The HTTP client of the cloud
/// stores is built with rustls but no bundled provider (so that neither aws-lc-rs nor OpenSSL
/// is compiled in) and panics when none is installed. A provider installed earlier by someone
/// else is kept. [`open`] and [`create`] call this; call it yourself before building a cloud
/// store through `object_store` directly.
pub fn install_tls_provider() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        // An error means another provider is installed already, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cloud {
    S3,
    Gcs,
    Azure,
    Http { https: bool },
}

pub(crate) enum Parsed<'a> {
    /// A local path, `file://` stripped.
    Local(&'a str),
    /// A live publication's step directory, `live+file://` stripped ([`crate::live`]).
    Live(&'a str),
    /// `bucket` is the bucket, container or (for HTTP) `host[:port]`; `key` the rest.
    Cloud {
        kind: Cloud,
        bucket: &'a str,
        key: &'a str,
    },
}

fn invalid(location: &str, detail: String) -> StorageError {
    StorageError::Location {
        location: location.to_string(),
        detail,
    }
}

pub(crate) fn parse(location: &str) -> Result<Parsed<'_>, StorageError> {
    if location.is_empty() {
        return Err(invalid("\"\"", "empty checkpoint location".to_string()));
    }
    let Some((scheme, rest)) = location.split_once("://") else {
        return Ok(Parsed::Local(location));
    };
    let (kind, what, example) = match scheme {
        "file" => return Ok(Parsed::Local(rest)),
        crate::live::LIVE_SCHEME => return Ok(Parsed::Live(rest)),
        "s3" => (Cloud::S3, "bucket", "s3://<bucket>/<prefix>"),
        "gs" => (Cloud::Gcs, "bucket", "gs://<bucket>/<prefix>"),
        "az" => (Cloud::Azure, "container", "az://<container>/<prefix>"),
        "http" => (
            Cloud::Http { https: false },
            "host",
            "http://<host>[:<port>]/<prefix>",
        ),
        "https" => (
            Cloud::Http { https: true },
            "host",
            "https://<host>[:<port>]/<prefix>",
        ),
        _ => {
            return Err(invalid(
                location,
                format!("{scheme}:// storage is not supported; {SUPPORTED}"),
            ));
        }
    };
    let (bucket, key) = rest.split_once('/').unwrap_or((rest, ""));
    if bucket.is_empty() {
        return Err(invalid(location, format!("no {what}: use {example}")));
    }
    Ok(Parsed::Cloud { kind, bucket, key })
}

fn local(location: &str, root: &std::path::Path, name: &str) -> Result<Location, StorageError> {
    let store = LocalFileSystem::new_with_prefix(root).map_err(|source| StorageError::Store {
        action: "opening".to_string(),
        path: root.display().to_string(),
        source,
    })?;
    Ok(Location {
        store: Arc::new(store),
        prefix: Path::from(name),
        display: location.to_string(),
        local_root: Some(root.to_path_buf()),
        shared_files: Default::default(),
    })
}

/// Splits a local location into its absolute parent directory and last component.
pub(crate) fn local_parts(
    location: &str,
    raw: &str,
) -> Result<(std::path::PathBuf, String), StorageError> {
    if raw.is_empty() {
        return Err(invalid(location, "empty checkpoint location".to_string()));
    }
    let joined = if std::path::Path::new(raw).is_absolute() {
        std::path::PathBuf::from(raw)
    } else {
        std::env::current_dir()
            .map_err(|e| invalid(location, format!("reading the current directory: {e}")))?
            .join(raw)
    };
    // Normalize `.` and `..` without touching the file system (the path may not exist yet).
    let mut absolute = std::path::PathBuf::from("/");
    for component in joined.components() {
        match component {
            std::path::Component::Normal(part) => absolute.push(part),
            std::path::Component::ParentDir => {
                absolute.pop();
            }
            _ => {}
        }
    }
    let Some(name) = absolute
        .file_name()
        .and_then(|n| n.to_str())
        .map(str::to_string)
    else {
        return Err(invalid(
            location,
            "needs a directory name (not the file system root), in UTF-8".to_string(),
        ));
    };
    let root = absolute
        .parent()
        .map(std::path::Path::to_path_buf)
        .unwrap_or_else(|| "/".into());
    Ok((root, name))
}

/// A cloud builder with [`RetryPolicy`]'s timeouts ([`RetryPolicy::client_config`], set as the
/// builder's client configuration keys so what the environment set for the client,
/// `AWS_ALLOW_HTTP` and the like, is kept) and retry.
macro_rules! with_policy {
    ($builder:expr, $key:path, $policy:expr) => {{
        let policy: &RetryPolicy = $policy;
        policy
            .client_config()
            .into_iter()
            .fold($builder, |builder, (key, value)| {
                builder.with_config($key(key), value)
            })
            .with_retry(policy.object_store_retry())
    }};
}

fn cloud(
    location: &str,
    kind: Cloud,
    bucket: &str,
    key: &str,
    options: &StorageOptions,
) -> Result<Location, StorageError> {
    let key = key.trim_matches('/');
    let prefix = Path::parse(key)
        .map_err(|e| invalid(location, format!("invalid object path {key:?}: {e}")))?;
    install_tls_provider();
    let store: Arc<dyn ObjectStore> = match kind {
        Cloud::S3 => Arc::new(
            with_policy!(
                s3_builder(location, bucket, options)?,
                AmazonS3ConfigKey::Client,
                &options.retry
            )
            .build()
            .map_err(|e| invalid(location, format!("configuring S3: {e}")))?,
        ),
        Cloud::Gcs => {
            let builder = overrides(
                if options.ignore_process_env {
                    GoogleCloudStorageBuilder::new()
                } else {
                    GoogleCloudStorageBuilder::from_env()
                },
                options,
                "GOOGLE_",
                |b, k: GoogleConfigKey, v| b.with_config(k, v),
            );
            Arc::new(
                with_policy!(
                    builder.with_bucket_name(bucket),
                    GoogleConfigKey::Client,
                    &options.retry
                )
                .build()
                .map_err(|e| invalid(location, format!("configuring Google Cloud Storage: {e}")))?,
            )
        }
        Cloud::Azure => {
            let builder = overrides(
                if options.ignore_process_env {
                    MicrosoftAzureBuilder::new()
                } else {
                    MicrosoftAzureBuilder::from_env()
                },
                options,
                "AZURE_",
                |b, k: AzureConfigKey, v| b.with_config(k, v),
            );
            let emulator = builder
                .get_config_value(&AzureConfigKey::UseEmulator)
                .is_some_and(|v| truthy(&v));
            if builder
                .get_config_value(&AzureConfigKey::AccountName)
                .is_none()
                && !emulator
            {
                return Err(invalid(
                    location,
                    "no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME (and credentials: \
                     AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_KEY, AZURE_STORAGE_TOKEN, a \
                     client secret or a managed identity)"
                        .to_string(),
                ));
            }
            Arc::new(
                with_policy!(
                    builder.with_container_name(bucket),
                    AzureConfigKey::Client,
                    &options.retry
                )
                .build()
                .map_err(|e| invalid(location, format!("configuring Azure: {e}")))?,
            )
        }
        Cloud::Http { https } => {
            let scheme = if https { "https" } else { "http" };
            let policy = &options.retry;
            let client = policy.client_options().with_allow_http(!https);
            Arc::new(
                HttpBuilder::new()
                    .with_url(format!("{scheme}://{bucket}"))
                    .with_client_options(client)
                    .with_retry(policy.object_store_retry())
                    .build()
                    .map_err(|e| invalid(location, format!("configuring HTTP: {e}")))?,
            )
        }
    };
    Ok(Location {
        store,
        prefix,
        display: location.to_string(),
        local_root: None,
        shared_files: Default::default(),
    })
}

/// The S3 builder for `bucket`: the environment, then `options`, then checks that some source of
/// credentials is configured.
fn s3_builder(
    location: &str,
    bucket: &str,
    options: &StorageOptions,
) -> Result<AmazonS3Builder, StorageError> {
    let mut builder = overrides(
        if options.ignore_process_env {
            AmazonS3Builder::new()
        } else {
            AmazonS3Builder::from_env()
        },
        options,
        "AWS_",
        |b, k: AmazonS3ConfigKey, v| b.with_config(k, v),
    )
    .with_bucket_name(bucket);
    let set = |key: AmazonS3ConfigKey| {
        builder
            .get_config_value(&key)
            .is_some_and(|v| !v.is_empty())
    };
    let key_id = set(AmazonS3ConfigKey::AccessKeyId);
    let secret = set(AmazonS3ConfigKey::SecretAccessKey);
    match (key_id, secret) {
        (true, false) => {
            return Err(invalid(
                location,
                "AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not".to_string(),
            ));
        }
        (false, true) => {
            return Err(invalid(
                location,
                "AWS_SECRET_ACCESS_KEY is set but AWS_ACCESS_KEY_ID is not".to_string(),
            ));
        }
        _ => {}
    }
    // Without any of these, object_store falls back to the EC2 instance metadata service, which
    // off EC2 means minutes of retries before a vague error. So it is used only when asked for
    // (AWS_METADATA_ENDPOINT), and everyone else gets told what is missing right away.
    let credentials = (key_id && secret)
        || (set(AmazonS3ConfigKey::WebIdentityTokenFile) && set(AmazonS3ConfigKey::RoleArn))
        || set(AmazonS3ConfigKey::ContainerCredentialsRelativeUri)
        || set(AmazonS3ConfigKey::ContainerCredentialsFullUri)
        || set(AmazonS3ConfigKey::MetadataEndpoint)
        || builder
            .get_config_value(&AmazonS3ConfigKey::SkipSignature)
            .is_some_and(|v| truthy(&v));
    if !credentials {
        return Err(invalid(
            location,
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or \
             AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN, or AWS_SKIP_SIGNATURE=true for a public \
             bucket (on EC2, AWS_METADATA_ENDPOINT=http://169.254.169.254 uses the instance role)"
                .to_string(),
        ));
    }
    // A custom endpoint serves every bucket under one host (MinIO, Ceph, R2, a test server):
    // path-style requests, `<endpoint>/<bucket>/<key>`.
    if set(AmazonS3ConfigKey::Endpoint) || set(AmazonS3ConfigKey::S3Endpoint) {
        builder = builder.with_virtual_hosted_style_request(false);
    }
    Ok(builder)
}

/// Applies the `prefix`ed variables of `options.env` to `builder`, parsed the way the builders'
/// `from_env` parses the process environment.
fn overrides<B, K: std::str::FromStr>(
    mut builder: B,
    options: &StorageOptions,
    prefix: &str,
    apply: impl Fn(B, K, &str) -> B,
) -> B {
    for (name, value) in &options.env {
        if name.starts_with(prefix)
            && let Ok(key) = name.to_ascii_lowercase().parse::<K>()
        {
            builder = apply(builder, key, value);
        }
    }
    builder
}

/// object_store's spelling of a true boolean configuration value.
fn truthy(value: &str) -> bool {
    matches!(
        value.to_ascii_lowercase().as_str(),
        "1" | "true" | "on" | "yes" | "y"
    )
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn local_paths_and_file_urls_are_local_every_scheme_else_remote() {
        for local in ["/ckpt/step-1", "run/step-1", "file:///ckpt/x", "./a:b"] {
            assert_eq!(LocationKind::of(local), LocationKind::Local, "{local}");
        }
        for remote in [
            "s3://b/run",
            "gs://b/x",
            "az://c/x",
            "https://h/x",
            "ftp://h/x",
        ] {
            assert_eq!(LocationKind::of(remote), LocationKind::Remote, "{remote}");
        }
        assert_eq!(local_path("file:///ckpt/x"), Some("/ckpt/x"));
        assert_eq!(local_path("run/step-1"), Some("run/step-1"));
        assert_eq!(local_path("s3://b/run"), None);
    }

    #[test]
    fn one_place_named_differently_is_one_canonical_location() {
        let dir = tempfile::tempdir().unwrap();
        let real = dir.path().join("run").join("step-1");
        std::fs::create_dir_all(&real).unwrap();
        let real = std::fs::canonicalize(&real).unwrap();
        let expected = format!("file://{}", real.display());
        let link = dir.path().join("latest");
        std::os::unix::fs::symlink(&real, &link).unwrap();
        let dotted = format!("{}/run/./x/../step-1/", dir.path().display());
        for name in [
            real.display().to_string(),
            format!("file://{}", real.display()),
            dotted,
            link.display().to_string(),
        ] {
            assert_eq!(canonical(&name).unwrap(), expected, "{name}");
        }
        // Relative to the current directory (which tests share, so only read here).
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(
            canonical("no-such-dir/step-1").unwrap(),
            format!("file://{}", cwd.join("no-such-dir/step-1").display())
        );
        assert_ne!(
            canonical(&real.display().to_string()).unwrap(),
            canonical(&dir.path().join("run").display().to_string()).unwrap()
        );

        assert_eq!(
            canonical("s3://b//run/step-1/").unwrap(),
            "s3://b/run/step-1"
        );
        assert_eq!(canonical("gs://b/run/step-1").unwrap(), "gs://b/run/step-1");
        assert_eq!(
            canonical("https://Host:8080/run//step-1").unwrap(),
            "https://host:8080/run/step-1"
        );
        assert_ne!(
            canonical("s3://b/run/step-1").unwrap(),
            canonical("s3://c/run/step-1").unwrap()
        );
        assert!(canonical("ftp://h/x").is_err());
    }
}
