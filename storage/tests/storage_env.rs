//! `storage::open` configured from the process environment alone (`AWS_*`), the way the `tessera`
//! binary and the ranks use it. Tests run as threads of one process, and changing its environment
//! would race the others, so the environment is given to a child: this test binary run again for
//! the one ignored test below.

use std::process::Command;

use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};
use tessera_storage::testing::S3TestServer;

/// Set for the child run; without it the child test has nothing to do.
const CHILD: &str = "TESSERA_STORAGE_ENV_CHILD";

#[tokio::test]
async fn open_reads_aws_variables_from_the_environment() {
    let dir = tempfile::tempdir().expect("tempdir");
    let server = S3TestServer::start(dir.path());
    server.create_bucket("envbucket");
    server
        .store("envbucket")
        .put(
            &Path::from("run/step-000007/hello.txt"),
            PutPayload::from_static(b"hello from s3"),
        )
        .await
        .expect("put");

    let exe = std::env::current_exe().expect("current exe");
    let output = tokio::task::spawn_blocking(move || {
        Command::new(exe)
            .args([
                "--exact",
                "child_opens_s3_from_env",
                "--ignored",
                "--nocapture",
            ])
            .env_remove("AWS_PROFILE")
            .env_remove("AWS_SESSION_TOKEN")
            .env_remove("AWS_ENDPOINT_URL_S3")
            .env_remove("AWS_SKIP_SIGNATURE")
            .envs(server.env())
            .env(CHILD, "1")
            .output()
            .map(|output| (output, server))
    })
    .await
    .expect("join")
    .expect("run the child");
    let (output, _server) = output;
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "child failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        stdout.contains("1 passed"),
        "the child test did not run:\n{stdout}"
    );
}

#[tokio::test]
#[ignore = "run by open_reads_aws_variables_from_the_environment with its environment"]
async fn child_opens_s3_from_env() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    let loc = tessera_storage::open("s3://envbucket/run/step-000007").expect("open");
    assert_eq!(loc.prefix.as_ref(), "run/step-000007");
    let bytes = loc
        .store
        .get(&loc.prefix.clone().join("hello.txt"))
        .await
        .expect("get")
        .bytes()
        .await
        .expect("bytes");
    assert_eq!(bytes.as_ref(), b"hello from s3");
}
