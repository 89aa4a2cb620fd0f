//! Location strings: what each form opens as (store root and prefix), and the exact messages of
//! the ones that cannot be opened. No network IO: opening never touches the service.

use std::io::Write;

use tessera_storage::{StorageOptions, create, create_with, open, open_with};

/// Options that see nothing of the process environment, plus `vars`.
fn isolated(vars: &[(&str, &str)]) -> StorageOptions {
    StorageOptions {
        env: vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        ignore_process_env: true,
        ..StorageOptions::default()
    }
}

fn s3_credentials() -> StorageOptions {
    isolated(&[
        ("AWS_ACCESS_KEY_ID", "id"),
        ("AWS_SECRET_ACCESS_KEY", "secret"),
        ("AWS_REGION", "eu-west-1"),
    ])
}

#[test]
fn local_paths_and_file_urls_open_at_the_parent_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path().display().to_string();
    let a = create(&format!("{base}/x/../run/step-000001")).expect("create");
    assert_eq!(a.prefix.as_ref(), "step-000001");
    assert!(dir.path().join("run").is_dir());
    let b = open(&format!("file://{base}/run/step-000001")).expect("open");
    assert_eq!(b.prefix.as_ref(), "step-000001");
    assert_eq!(b.display, format!("file://{base}/run/step-000001"));
}

#[test]
fn local_checkpoint_store_reaches_the_run_directory() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(dir.path().join("run/step-000001")).expect("mkdir");
    std::fs::write(dir.path().join("run/latest"), "step-000001").expect("write");
    let loc = open(&format!("{}/run/step-000001", dir.path().display())).expect("open");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    let bytes = runtime.block_on(async {
        object_store::ObjectStoreExt::get(loc.store.as_ref(), &"latest".into())
            .await
            .expect("get latest")
            .bytes()
            .await
            .expect("bytes")
    });
    assert_eq!(bytes.as_ref(), b"step-000001");
}

#[test]
fn missing_local_parent_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path().display().to_string();
    let err = open(&format!("{base}/nope/step-1")).expect_err("missing parent");
    assert_eq!(
        err.to_string(),
        format!("{base}/nope/step-1: directory {base}/nope does not exist")
    );
}

#[test]
fn local_parent_that_is_a_file_is_named() {
    let dir = tempfile::tempdir().expect("tempdir");
    let base = dir.path().display().to_string();
    let mut file = std::fs::File::create(dir.path().join("plain")).expect("file");
    file.write_all(b"not a directory").expect("write");
    let err = open(&format!("{base}/plain/step-1")).expect_err("a file as parent");
    assert_eq!(
        err.to_string(),
        format!("{base}/plain/step-1: {base}/plain is not a directory")
    );
    let err = create(&format!("{base}/plain/step-1")).expect_err("a file as parent");
    assert!(
        err.to_string().starts_with(&format!(
            "{base}/plain/step-1: creating directory {base}/plain: "
        )),
        "{err}"
    );
}

#[cfg(unix)]
#[test]
fn unreadable_local_parent_is_named() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().expect("tempdir");
    let locked = dir.path().join("locked");
    std::fs::create_dir_all(locked.join("run")).expect("mkdir");
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o000)).expect("chmod");
    let location = format!("{}/run/step-1", locked.display());
    let result = open(&location);
    let root_can_read = std::fs::metadata(locked.join("run")).is_ok();
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    if root_can_read {
        // Running as root: permissions do not apply, there is nothing to refuse.
        result.expect("root reads everything");
        return;
    }
    let err = result.expect_err("an unreadable parent");
    assert!(
        err.to_string().starts_with(&format!(
            "{location}: cannot read directory {}/run: ",
            locked.display()
        )),
        "{err}"
    );
}

#[test]
fn unsupported_scheme_is_refused() {
    let err = open("ftp://x").expect_err("ftp");
    assert_eq!(
        err.to_string(),
        "ftp://x: ftp:// storage is not supported; use a local path, file://, s3://, gs://, az://, http:// or https://"
    );
}

#[test]
fn empty_location_is_refused() {
    assert_eq!(
        open("").expect_err("empty").to_string(),
        "\"\": empty checkpoint location"
    );
    assert_eq!(
        open("file://").expect_err("empty").to_string(),
        "file://: empty checkpoint location"
    );
}

#[test]
fn s3_without_bucket_is_refused() {
    for location in ["s3://", "s3:///run/step-1"] {
        let err = open_with(location, &s3_credentials()).expect_err("no bucket");
        assert_eq!(
            err.to_string(),
            format!("{location}: no bucket: use s3://<bucket>/<prefix>")
        );
    }
    let err = open("az:///x").expect_err("no container");
    assert_eq!(
        err.to_string(),
        "az:///x: no container: use az://<container>/<prefix>"
    );
}

#[test]
fn s3_without_credentials_says_what_to_set() {
    let err = open_with("s3://bucket/run/step-1", &isolated(&[])).expect_err("no credentials");
    assert_eq!(
        err.to_string(),
        "s3://bucket/run/step-1: no AWS credentials: set AWS_ACCESS_KEY_ID and \
         AWS_SECRET_ACCESS_KEY, or AWS_WEB_IDENTITY_TOKEN_FILE and AWS_ROLE_ARN, or \
         AWS_SKIP_SIGNATURE=true for a public bucket (on EC2, \
         AWS_METADATA_ENDPOINT=http://169.254.169.254 uses the instance role)"
    );
    let err = open_with("s3://bucket/x", &isolated(&[("AWS_ACCESS_KEY_ID", "id")]))
        .expect_err("half the credentials");
    assert_eq!(
        err.to_string(),
        "s3://bucket/x: AWS_ACCESS_KEY_ID is set but AWS_SECRET_ACCESS_KEY is not"
    );
}

#[test]
fn s3_credential_sources_other_than_keys_are_accepted() {
    for vars in [
        &[("AWS_SKIP_SIGNATURE", "true")][..],
        &[
            ("AWS_WEB_IDENTITY_TOKEN_FILE", "/var/run/token"),
            ("AWS_ROLE_ARN", "arn:aws:iam::1:role/r"),
        ][..],
        &[("AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "/v2/credentials")][..],
        &[("AWS_METADATA_ENDPOINT", "http://169.254.169.254")][..],
    ] {
        open_with("s3://bucket/run", &isolated(vars)).unwrap_or_else(|e| panic!("{vars:?}: {e}"));
    }
}

#[test]
fn object_store_urls_open_the_whole_bucket() {
    let options = s3_credentials();
    for (location, prefix) in [
        ("s3://bucket", ""),
        ("s3://bucket/", ""),
        ("s3://bucket/run/step-000001", "run/step-000001"),
        ("s3://bucket/run/step-000001/", "run/step-000001"),
    ] {
        let loc = open_with(location, &options).expect(location);
        assert_eq!(loc.prefix.as_ref(), prefix, "{location}");
        assert_eq!(loc.display, location);
        let loc = create_with(location, &options).expect(location);
        assert_eq!(loc.prefix.as_ref(), prefix, "{location}");
    }
    let gs = open_with(
        "gs://bucket/run/step-2",
        &isolated(&[("GOOGLE_SKIP_SIGNATURE", "true")]),
    )
    .expect("gs");
    assert_eq!(gs.prefix.as_ref(), "run/step-2");
    let az = open_with(
        "az://container/run/step-3",
        &isolated(&[
            ("AZURE_STORAGE_ACCOUNT_NAME", "account"),
            ("AZURE_SKIP_SIGNATURE", "true"),
        ]),
    )
    .expect("az");
    assert_eq!(az.prefix.as_ref(), "run/step-3");
    let http = open("http://127.0.0.1:9/run/step-4").expect("http");
    assert_eq!(http.prefix.as_ref(), "run/step-4");
    let https = open("https://example.com/ckpt/run/step-5").expect("https");
    assert_eq!(https.prefix.as_ref(), "ckpt/run/step-5");
}

#[test]
fn invalid_object_paths_are_refused() {
    let err = open_with("s3://bucket/run//step-1", &s3_credentials()).expect_err("empty segment");
    assert!(
        err.to_string()
            .starts_with("s3://bucket/run//step-1: invalid object path \"run//step-1\": "),
        "{err}"
    );
}

#[test]
fn http_locations_are_read_only() {
    let err = create("https://example.com/run/step-1").expect_err("read-only");
    assert_eq!(
        err.to_string(),
        "https://example.com/run/step-1: http:// and https:// locations are read-only; write to a local path, s3://, gs:// or az://"
    );
}

#[test]
fn azure_without_account_says_what_to_set() {
    let err = open_with("az://container/run", &isolated(&[])).expect_err("no account");
    assert_eq!(
        err.to_string(),
        "az://container/run: no Azure storage account: set AZURE_STORAGE_ACCOUNT_NAME (and \
         credentials: AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_KEY, AZURE_STORAGE_TOKEN, a \
         client secret or a managed identity)"
    );
}
