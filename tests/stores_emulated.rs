//! The CLI against independent emulators of Azure Blob (Azurite) and Google Cloud Storage
//! (fake-gcs-server), configured the way a user configures the real services (environment
//! variables, `az://` and `gs://` URLs): one conformance list per store, and the commit
//! semantics two writers racing for one location rely on.
//!
//! What each store covers here:
//! - Azure (Azurite): a native save (`synth`: data files, then the manifest last), `inspect`,
//!   `plan`, a reshard `load` reading partial ranges (every byte checked against the synthetic
//!   formula; no byte fetched beyond what the plan reads), `verify`, `convert` into the store
//!   (the write claim, the manifest, `<run>/latest`), `serve --root az://...` listing both and
//!   the run's latest; `gc` on the bucket removing what a killed convert left and nothing
//!   committed; a claim held by another writer refusing a save that names it and writes
//!   nothing; two converts racing for one step (one wins, the other fails naming the holder or
//!   the committed checkpoint, nothing half-committed, no claim left); two commits of different
//!   steps racing for `latest` (it names the newer).
//! - GCS (fake-gcs-server): the read side of the same list on a checkpoint the server was
//!   started with (`inspect`, `plan`, the reshard `load`, `verify`, `serve --root gs://...`).
//!   The write side runs only where the server takes object_store's uploads: fake-gcs-server
//!   1.54 answers the GCS XML API's object PUT, which object_store's GCS client sends, with "400
//!   invalid uploadType" (fsouza/fake-gcs-server#1164), so those tests say `skipped:` with the
//!   server's answer rather than pass. The other GCS emulator, PyPI `gcp-storage-emulator`
//!   (2026.7.19), takes the plain PUT but ignores `x-goog-if-generation-match` and answers the
//!   XML multipart upload 501, so it could not stand in for the races either.
#![allow(clippy::unwrap_used, missing_docs)]

#[path = "support/emulators.rs"]
mod emulators;
mod support;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Output, Stdio};

use emulators::Emulator;
use futures::TryStreamExt;
use object_store::ObjectStoreExt;
use serde_json::Value;
use support::{BIN, layout_file, s};
use tessera_ops::claim::{CLAIM_FILE, ClaimHolder};

const BUCKET: &str = "ckpts";

/// `tessera <args>` as a command with the emulator's variables, and none of the cloud
/// configuration this process was given.
fn command(store: &Emulator, args: &[&str]) -> Command {
    let mut command = Command::new(BIN);
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        if ["AZURE_", "AZURITE_", "GOOGLE_"]
            .iter()
            .any(|p| name.starts_with(p))
        {
            command.env_remove(name.as_ref());
        }
    }
    command
        .args(args)
        .env_remove("TESSERA_COALESCE_GAP")
        .envs(store.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::null());
    command
}

/// Runs `tessera <args>` against the emulator.
fn run(store: &Emulator, args: &[&str]) -> Output {
    command(store, args).output().unwrap()
}

/// [`run`], which must succeed; its standard output.
#[track_caller]
fn ok(store: &Emulator, args: &[&str]) -> String {
    let output = run(store, args);
    assert!(
        output.status.success(),
        "tessera {} failed against {}:\n{}\nserver log:\n{}",
        args.join(" "),
        store.name,
        String::from_utf8_lossy(&output.stderr),
        store.log()
    );
    String::from_utf8(output.stdout).unwrap()
}

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// The objects under `key` in the emulator's bucket, relative to `key`.
fn list(store: &Emulator, key: &str) -> Vec<String> {
    let location = tessera_storage::open_with(&store.url(key), &store.options()).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut names: Vec<String> = runtime.block_on(async {
        location
            .store
            .list(Some(&location.prefix))
            .map_ok(|meta| {
                meta.location
                    .as_ref()
                    .strip_prefix(&format!("{key}/"))
                    .unwrap_or(meta.location.as_ref())
                    .to_string()
            })
            .try_collect()
            .await
            .unwrap()
    });
    names.sort();
    names
}

/// Writes `body` to `key` in the emulator's bucket.
fn put(store: &Emulator, key: &str, body: Vec<u8>) {
    let location = tessera_storage::open_with(&store.url(key), &store.options()).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime
        .block_on(location.store.put(&location.prefix, body.into()))
        .unwrap();
}

/// The layouts of the list: saved FSDP over 2 ranks, loaded as Megatron tp4 (column-parallel
/// weights are slices of every row: many partial ranges), converted to FSDP over 4.
struct Layouts {
    saved: String,
    tp4: String,
    fsdp4: String,
}

fn layouts(dir: &Path) -> Layouts {
    let file = |name, preset: &[&str]| s(&layout_file(dir, name, preset)).to_string();
    Layouts {
        saved: file("saved.json", &["fsdp", "--dp", "2"]),
        tp4: file(
            "tp4.json",
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
        ),
        fsdp4: file("fsdp4.json", &["fsdp", "--dp", "4"]),
    }
}

/// The read side of the list on the committed checkpoint at `url`: `inspect`, `plan`, a reshard
/// `load` with every byte checked (exactly the planned bytes fetched, in partial ranges), a
/// verified load, `verify`.
fn reads(store: &Emulator, url: &str, layouts: &Layouts) {
    let inspected = json(&ok(store, &["inspect", url, "--json"]));
    assert_eq!(inspected["committed"], true, "{inspected}");
    assert_eq!(inspected["format"], "native");
    assert_eq!(u(&inspected["manifest"], "tensors"), 109, "{inspected}");

    let plan = json(&ok(
        store,
        &["plan", url, "--layout", &layouts.tp4, "--format", "json"],
    ));
    assert_eq!(u(&plan, "ranks"), 4);
    let planned = u(&plan, "bytes_read");
    assert!(planned > 0, "{plan}");

    // `--check`: every loaded byte against the synthetic formula. Without verification and
    // coalescing, what comes over the wire is exactly the planned bytes, in more requests than
    // files (column slices are partial ranges).
    let load = json(&ok(
        store,
        &[
            "load",
            url,
            "--layout",
            &layouts.tp4,
            "--check",
            "--no-verify",
            "--coalesce-gap",
            "0",
            "--json",
        ],
    ));
    let totals = &load["totals"];
    assert_eq!(u(totals, "bytes_read"), planned, "{totals}");
    assert_eq!(u(totals, "bytes_transferred"), planned, "{totals}");
    assert!(u(totals, "requests") > 2 * 4, "{totals}");
    // Verified: checksum blocks around the ranges, every box checked.
    let load = json(&ok(
        store,
        &["load", url, "--layout", &layouts.tp4, "--check", "--json"],
    ));
    assert!(u(&load["totals"], "boxes_verified") > 0, "{load}");
    assert_eq!(u(&load["totals"], "bytes_unverified"), 0, "{load}");

    let verified = ok(store, &["verify", url]);
    assert!(verified.contains(": ok, 2 files"), "{verified}");
}

/// `tessera serve --root <scheme>://<bucket>` until dropped.
struct Served(std::process::Child, String);

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(store: &Emulator) -> Served {
    let root = format!("{}://{}", store.scheme, store.bucket);
    let mut child = command(store, &["serve", "--root", &root, "--addr", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let mut served = Served(child, String::new());
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("listening on http://") {
            served.1 = rest.split(' ').next().unwrap().to_string();
            return served;
        }
    }
    panic!("tessera serve --root {root} never listened");
}

/// The catalog `serve` lists: checkpoint id -> its entry, and the run's latest.
fn catalog(served: &Served) -> (Value, Value) {
    let (status, body) = emulators::http_get(&served.1, "/v1/checkpoints");
    assert_eq!(status, 200, "{body}");
    let catalog = json(&body);
    let run = catalog["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["run"] == "run")
        .cloned()
        .unwrap_or_else(|| panic!("no run `run` in {catalog}"));
    (catalog, run)
}

fn entry<'a>(catalog: &'a Value, id: &str) -> &'a Value {
    catalog["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap_or_else(|| panic!("{id} not listed in {catalog}"))
}

/// The write side: a native save into the store, the list's reads on it, a convert (claim,
/// manifest, `latest`), and the catalog served from the store.
fn writes(store: &Emulator, layouts: &Layouts) {
    let step1 = store.url("run/step-000001");
    let step2 = store.url("run/step-000002");
    ok(
        store,
        &[
            "synth",
            "--model",
            "gpt-tiny",
            "--layout",
            &layouts.saved,
            "--out",
            &step1,
            "--step",
            "1",
        ],
    );
    assert!(list(store, "run/step-000001").contains(&"manifest.json".to_string()));
    reads(store, &step1, layouts);

    let converted = ok(
        store,
        &[
            "convert",
            &step1,
            "--layout",
            &layouts.fsdp4,
            "--out",
            &step2,
        ],
    );
    assert!(converted.contains("109 tensors"), "{converted}");
    let objects = list(store, "run/step-000002");
    assert!(
        objects.contains(&"manifest.json".to_string()),
        "{objects:?}"
    );
    assert!(
        !objects.contains(&CLAIM_FILE.to_string()),
        "the claim outlived the save: {objects:?}"
    );
    let verified = ok(store, &["verify", &step2]);
    assert!(verified.contains(": ok, 4 files"), "{verified}");
    let load = json(&ok(
        store,
        &[
            "load",
            &step2,
            "--layout",
            &layouts.tp4,
            "--check",
            "--json",
        ],
    ));
    assert_eq!(u(&load["totals"], "bytes_unverified"), 0, "{load}");

    // A convert killed after its first data file (as `kill -9` would) leaves its claim and that
    // file; `gc` on the bucket removes them (the claim's pid on this host is gone) and nothing
    // committed.
    let killed = store.url("run/step-000006");
    let output = command(
        store,
        &[
            "convert",
            &step1,
            "--layout",
            &layouts.fsdp4,
            "--out",
            &killed,
        ],
    )
    .env("TESSERA_FAULT_ABORT_AFTER_FILES", "1")
    .output()
    .unwrap();
    assert!(!output.status.success());
    let left = list(store, "run/step-000006");
    assert!(
        left.contains(&CLAIM_FILE.to_string())
            && left.contains(&"data/rank-00000.bin".to_string())
            && !left.contains(&"manifest.json".to_string()),
        "{left:?}"
    );
    let committed = (
        list(store, "run/step-000001"),
        list(store, "run/step-000002"),
    );
    let root = format!("{}://{}", store.scheme, store.bucket);
    let gc = json(&ok(store, &["gc", &root, "--json"]));
    let removed: Vec<&str> = gc["removed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["path"].as_str().unwrap())
        .collect();
    assert_eq!(removed, ["run/step-000006"], "{gc}");
    assert!(u(&gc, "bytes_removed") > 0, "{gc}");
    assert!(list(store, "run/step-000006").is_empty());
    assert_eq!(
        (
            list(store, "run/step-000001"),
            list(store, "run/step-000002")
        ),
        committed
    );

    let served = serve(store);
    let (catalog, run) = catalog(&served);
    // The killed save never moved it.
    assert_eq!(run["latest"], "run/step-000002", "{run}");
    for id in ["run/step-000001", "run/step-000002"] {
        let listed = entry(&catalog, id);
        assert_eq!(listed["committed"], true, "{listed}");
        assert_eq!(listed["tensors"], 109, "{listed}");
    }
}

/// Another writer's claim refuses a save naming it, and the refused save writes nothing; two
/// converts racing for one step: one commits, the other fails naming the claim's holder (or,
/// when the winner finished first, the committed checkpoint), and what is there is whole; two
/// commits of different steps racing for `latest`: it names the newer.
fn races(store: &Emulator, layouts: &Layouts) {
    if let Err(reason) = store.conditional_create() {
        println!("skipped: {reason}");
        return;
    }
    let source = store.url("src/step-000001");
    ok(
        store,
        &[
            "synth",
            "--model",
            "gpt-tiny",
            "--layout",
            &layouts.saved,
            "--out",
            &source,
        ],
    );

    // A claim held by a writer on another host.
    let holder = ClaimHolder {
        pid: 4242,
        host: "trainer-7".to_string(),
        ..ClaimHolder::this_process("tessera convert")
    };
    put(
        store,
        &format!("held/step-000001/{CLAIM_FILE}"),
        serde_json::to_vec(&holder).unwrap(),
    );
    let held = store.url("held/step-000001");
    let output = run(
        store,
        &[
            "convert",
            &source,
            "--layout",
            &layouts.fsdp4,
            "--out",
            &held,
        ],
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("{held} is being written by another writer"))
            && stderr.contains("tessera convert pid 4242 on host trainer-7"),
        "{stderr}"
    );
    assert_eq!(
        list(store, "held/step-000001"),
        [CLAIM_FILE],
        "the refused save wrote"
    );

    // Two converts for one step at once.
    let target = store.url("race/step-000003");
    let args = [
        "convert",
        &source,
        "--layout",
        &layouts.fsdp4,
        "--out",
        &target,
    ];
    let (a, b) = std::thread::scope(|scope| {
        let a = scope.spawn(|| run(store, &args));
        let b = scope.spawn(|| run(store, &args));
        (a.join().unwrap(), b.join().unwrap())
    });
    let (won, lost) = match (a.status.success(), b.status.success()) {
        (true, false) => (a, b),
        (false, true) => (b, a),
        (a_ok, b_ok) => panic!(
            "of two writers racing for {target}, {} succeeded:\n{}\n{}",
            u8::from(a_ok) + u8::from(b_ok),
            String::from_utf8_lossy(&a.stderr),
            String::from_utf8_lossy(&b.stderr)
        ),
    };
    let lost = String::from_utf8_lossy(&lost.stderr);
    let claimed = lost.contains(&format!("{target} is being written by another writer"))
        && lost.contains("tessera convert pid ");
    let committed = lost.contains("race/step-000003 already holds a committed checkpoint");
    assert!(claimed || committed, "the loser's error: {lost}");
    assert!(String::from_utf8_lossy(&won.stdout).contains("converted"));
    let objects = list(store, "race/step-000003");
    assert!(!objects.contains(&CLAIM_FILE.to_string()), "{objects:?}");
    let files: Vec<_> = objects.iter().filter(|o| o.starts_with("data/")).collect();
    assert_eq!(files.len(), 4, "only the winner's data files: {objects:?}");
    assert!(ok(store, &["verify", &target]).contains(": ok, 4 files"));
    let load = json(&ok(
        store,
        &[
            "load",
            &target,
            "--layout",
            &layouts.tp4,
            "--check",
            "--json",
        ],
    ));
    assert_eq!(u(&load["totals"], "bytes_unverified"), 0, "{load}");

    // Two commits of different steps of one run at once: `latest` ends at the newer, whichever
    // commit finishes last.
    let (older, newer) = (store.url("pair/step-000004"), store.url("pair/step-000005"));
    std::thread::scope(|scope| {
        let a = scope.spawn(|| {
            ok(
                store,
                &[
                    "convert",
                    &source,
                    "--layout",
                    &layouts.fsdp4,
                    "--out",
                    &older,
                ],
            )
        });
        let b = scope.spawn(|| {
            ok(
                store,
                &[
                    "convert",
                    &source,
                    "--layout",
                    &layouts.fsdp4,
                    "--out",
                    &newer,
                ],
            )
        });
        a.join().unwrap();
        b.join().unwrap();
    });
    let location = tessera_storage::open_with(&store.url("pair"), &store.options()).unwrap();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let latest = runtime
        .block_on(tessera_metadata::formats::native::read_latest(
            location.store.as_ref(),
            &location.prefix,
        ))
        .unwrap();
    assert_eq!(latest.as_deref(), Some("step-000005"));
}

#[test]
fn azurite_runs_the_conformance_list() {
    let store = match emulators::azurite(BUCKET) {
        Ok(store) => store,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    writes(&store, &layouts(dir.path()));
}

#[test]
fn azurite_two_writers_exclude_each_other() {
    let store = match emulators::azurite(BUCKET) {
        Ok(store) => store,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    races(&store, &layouts(dir.path()));
}

/// fake-gcs-server started with a checkpoint written locally (`-data`), read through gs://.
#[test]
fn fake_gcs_serves_the_read_side_of_the_list() {
    let dir = tempfile::tempdir().unwrap();
    let layouts = layouts(dir.path());
    let seed = dir.path().join("seed");
    support::ok([
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        &layouts.saved,
        "--out",
        s(&seed.join("run/step-000001")),
        "--step",
        "1",
    ]);
    let store = match emulators::fake_gcs(BUCKET, &seed) {
        Ok(store) => store,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    let url = store.url("run/step-000001");
    reads(&store, &url, &layouts);
    let served = serve(&store);
    let (catalog, run) = catalog(&served);
    assert_eq!(run["latest"], "run/step-000001", "{run}");
    assert_eq!(entry(&catalog, "run/step-000001")["committed"], true);
}

#[test]
fn fake_gcs_runs_the_write_side_of_the_list() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("empty")).unwrap();
    let store = match emulators::fake_gcs(BUCKET, &dir.path().join("empty")) {
        Ok(store) => store,
        Err(reason) => {
            println!("skipped: {reason}");
            return;
        }
    };
    if let Err(reason) = store.conditional_create() {
        println!("skipped: {reason}");
        return;
    }
    let layouts = layouts(dir.path());
    writes(&store, &layouts);
    races(&store, &layouts);
}
