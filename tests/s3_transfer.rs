//! What a load from S3 transfers, counted at the server (the loopback S3 test server logs the
//! body length of every GET): the load's report names exactly the requests and bytes the server
//! served for the data files, and a column reshard (gpt-tiny saved FSDP Shard(0), loaded as
//! Megatron tp4, whose column-parallel weights are slices of every row) stays within the bound
//! `--coalesce-gap` documents. Issue 19: object_store's `get_ranges` merged ranges under 1 MiB
//! apart, so the server sent several times what the report counted.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::path::Path;

use serde_json::Value;
use support::{layout_file, s};
use tessera_storage::testing::{S3TestServer, Served};

const URL: &str = "s3://ckpts/run/step-000001";

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn ok_with_env(env: &[(String, String)], args: &[&str]) -> String {
    let output = std::process::Command::new(support::BIN)
        .args(args)
        .env_remove("TESSERA_COALESCE_GAP")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "tessera {} failed:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

/// A server holding gpt-tiny saved FSDP over 4 ranks, and the tp4 target layout.
fn setup(dir: &Path) -> (S3TestServer, String) {
    std::fs::create_dir_all(dir.join("s3")).unwrap();
    let server = S3TestServer::start(dir.join("s3"));
    server.create_bucket("ckpts");
    let saved = layout_file(dir, "saved.json", &["fsdp", "--dp", "4"]);
    let target = layout_file(
        dir,
        "target.json",
        &[
            "megatron-gpt",
            "--tp",
            "4",
            "--pp",
            "1",
            "--dp",
            "1",
            "--num-layers",
            "4",
        ],
    );
    ok_with_env(
        &server.env(),
        &[
            "synth",
            "--model",
            "gpt-tiny",
            "--layout",
            s(&saved),
            "--out",
            URL,
        ],
    );
    (server, s(&target).to_string())
}

/// Loads the checkpoint into the tp4 layout with `extra` flags (`--json`) and returns the
/// report's totals and what the server served for the data files during the load.
fn load(server: &S3TestServer, target: &str, extra: &[&str]) -> (Value, Served) {
    server.reset_served();
    let mut args = vec!["load", URL, "--layout", target, "--check", "--json"];
    args.extend_from_slice(extra);
    let out = ok_with_env(&server.env(), &args);
    let report: Value = serde_json::from_str(&out).unwrap();
    let served = server.served_where(|path| path.contains("/data/"));
    (report["totals"].clone(), served)
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

#[test]
fn a_column_reshard_from_s3_transfers_what_the_report_says_within_the_gap_bound() {
    let dir = tempdir();
    let (server, target) = setup(dir.path());

    // No gap: every request carries only bytes the ranks need, and the server agrees.
    let (totals, served) = load(&server, &target, &["--no-verify", "--coalesce-gap", "0"]);
    let read = u(&totals, "bytes_read");
    assert!(read > 0);
    assert_eq!(u(&totals, "bytes_fetched"), read, "{totals}");
    assert_eq!(served.get_body_bytes, read, "{totals} {served:?}");
    assert_eq!(u(&totals, "bytes_transferred"), read, "{totals}");
    assert_eq!(served.get_requests, u(&totals, "requests"), "{totals}");
    let exact_requests = served.get_requests;
    // A column slice is one range per row: far more requests than files.
    assert!(exact_requests > 100, "{served:?}");

    // The object-store default (64 KiB): the report's bytes and requests are the server's, the
    // gaps spanned are at most 64 KiB per request saved, and the requests are fewer.
    let (totals, served) = load(&server, &target, &["--no-verify"]);
    assert_eq!(u(&totals, "bytes_read"), read);
    assert_eq!(
        served.get_body_bytes,
        u(&totals, "bytes_transferred"),
        "{totals}"
    );
    assert_eq!(served.get_requests, u(&totals, "requests"), "{totals}");
    assert!(served.get_requests < exact_requests, "{served:?}");
    let gaps = served.get_body_bytes - read;
    assert!(
        gaps <= (exact_requests - served.get_requests) * 64 * 1024,
        "{gaps} gap bytes for {} fewer requests",
        exact_requests - served.get_requests
    );

    // The text report says the same, with the gap from the environment.
    let mut env = server.env();
    env.push(("TESSERA_COALESCE_GAP".to_string(), "0".to_string()));
    server.reset_served();
    let text = ok_with_env(&env, &["load", URL, "--layout", &target, "--no-verify"]);
    let line = text
        .lines()
        .find(|l| l.starts_with("bytes transferred"))
        .unwrap_or_else(|| panic!("no transfer line in\n{text}"));
    assert!(
        line.contains(&format!(
            "in {exact_requests} requests = 1.00 x needed (0 B of gaps"
        )),
        "{line}"
    );
    assert_eq!(
        server.served_where(|p| p.contains("/data/")).get_requests,
        exact_requests
    );

    // Verified (the default): checksum blocks around the rows, and still the server's count.
    let (totals, served) = load(&server, &target, &[]);
    assert_eq!(
        served.get_body_bytes,
        u(&totals, "bytes_transferred"),
        "{totals}"
    );
    assert_eq!(served.get_requests, u(&totals, "requests"), "{totals}");
    assert!(u(&totals, "bytes_transferred") >= u(&totals, "bytes_fetched"));
}
