//! `tessera gc` as a real process on a temporary root: leftovers of failed and killed saves are
//! removed, committed checkpoints, foreign-format directories and saves whose claim a live writer
//! holds are kept (until `--break-claims`), `--dry-run` removes nothing.

#![allow(clippy::unwrap_used)]

mod support;

use std::fs;
use std::path::Path;

use serde_json::Value;
use support::{fails, fails_not_found, ok, s, synth_tiny};

fn host() -> String {
    fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_string()
}

fn claim(dir: &Path, pid: u32, host: &str) {
    fs::create_dir_all(dir).unwrap();
    fs::write(
        dir.join(".tessera-claim.json"),
        format!(
            r#"{{"pid": {pid}, "host": "{host}", "created": "2026-01-02T03:04:05Z", "command": "tessera.save"}}"#
        ),
    )
    .unwrap();
}

fn data_file(dir: &Path, name: &str, len: usize) {
    fs::create_dir_all(dir.join("data")).unwrap();
    fs::write(dir.join("data").join(name), vec![7u8; len]).unwrap();
}

/// A pid that surely ran on this host and is gone: a child that has exited and been reaped.
fn dead_pid() -> u32 {
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    pid
}

fn json(args: &[&str]) -> Value {
    serde_json::from_slice(&ok(args).stdout).unwrap()
}

fn paths(doc: &Value, list: &str) -> Vec<String> {
    doc[list]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["path"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn gc_removes_failed_and_killed_saves_and_keeps_live_ones() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path();
    let committed = synth_tiny(root); // run/step-000005, a real committed checkpoint
    let run = root.join("run");
    // Killed save: stale claim of a dead pid on this host, a finished data file and a staging one.
    let killed = run.join("step-000006");
    claim(&killed, dead_pid(), &host());
    data_file(&killed, "rank-0.bin", 8192);
    data_file(&killed, "rank-1.bin#3", 100);
    // Failed save: rank 0 released the claim, data files stay.
    let failed = run.join("step-000007");
    data_file(&failed, "rank-2.bin", 4096);
    // In progress: this test process holds the claim.
    let live = run.join("step-000008");
    claim(&live, std::process::id(), &host());
    data_file(&live, "rank-0.bin", 10);
    // Held on another host: gc cannot check that pid.
    let remote = root.join("other").join("step-1");
    claim(&remote, 1, "a-host-that-is-not-this-one");
    // A DCP checkpoint (no manifest.json, no claim): not a leftover of ours.
    let dcp = root.join("dcp").join("step-1");
    fs::create_dir_all(&dcp).unwrap();
    fs::write(dcp.join(".metadata"), b"x").unwrap();
    fs::write(dcp.join("__0_0.distcp"), b"y").unwrap();

    let dry = json(&["gc", s(root), "--dry-run", "--json"]);
    assert_eq!(dry["dry_run"], true);
    assert_eq!(
        paths(&dry, "removed"),
        ["run/step-000006", "run/step-000007"]
    );
    assert_eq!(paths(&dry, "kept"), ["other/step-1", "run/step-000008"]);
    let claim_len = fs::metadata(killed.join(".tessera-claim.json"))
        .unwrap()
        .len();
    assert_eq!(dry["bytes_removed"], 8192 + 100 + 4096 + claim_len);
    assert!(
        killed.exists() && failed.exists(),
        "--dry-run removed something"
    );

    let done = ok(["gc", s(root)]);
    let text = String::from_utf8(done.stdout).unwrap();
    assert!(
        text.contains("removed run/step-000006: 3 files")
            && text.contains("its claim is stale: pid"),
        "{text}"
    );
    assert!(
        text.contains("removed run/step-000007: 1 files, 4.00 KiB (no manifest and no write claim: a failed save)"),
        "{text}"
    );
    assert!(
        text.contains("kept run/step-000008")
            && text.contains("a live writer holds its claim")
            && text.contains("--break-claims removes it"),
        "{text}"
    );
    assert!(
        text.contains("kept other/step-1") && text.contains("a-host-that-is-not-this-one"),
        "{text}"
    );
    assert!(!killed.exists() && !failed.exists());
    assert!(live.join("data/rank-0.bin").exists() && remote.exists());
    assert!(committed.join("manifest.json").exists() && dcp.join(".metadata").exists());
    // The committed checkpoint is whole: verify passes (no file of it was touched).
    ok(["verify", s(&committed)]);

    let broken = json(&["gc", s(root), "--break-claims", "--json"]);
    assert_eq!(
        paths(&broken, "removed"),
        ["other/step-1", "run/step-000008"]
    );
    assert!(broken["kept"].as_array().unwrap().is_empty());
    assert!(!live.exists() && !remote.exists());
    assert!(committed.join("manifest.json").exists() && dcp.join("__0_0.distcp").exists());

    // Nothing left: a clean run says so.
    let again = json(&["gc", s(root), "--json"]);
    assert!(again["removed"].as_array().unwrap().is_empty());
}

#[test]
fn gc_refuses_what_it_cannot_clean() {
    let tmp = tempfile::tempdir().unwrap();
    let missing = tmp.path().join("nope");
    let message = fails_not_found(["gc", s(&missing)]);
    assert!(
        message.contains("nope: No such file or directory"),
        "{message}"
    );
    // Object stores are cleaned (python/tests/test_store_conformance.py, against moto); an
    // http(s):// store cannot delete anything.
    let message = fails(["gc", "https://example.com/runs"]);
    assert!(
        message.contains("http:// and https:// locations are read-only"),
        "{message}"
    );
}

/// Issue 41 item 6: `gc ROOT --memory-tier` on a durable root (or a run inside it) refuses,
/// `--dry-run` included, and removes nothing: it took every step folder without a tier record
/// for the copy of a dead save. In a real tier, only the copies tessera made are listed and
/// removed; another program's folder stays.
#[test]
fn gc_memory_tier_refuses_a_checkpoint_root_and_touches_only_copies() {
    let dir = tempfile::tempdir().unwrap();
    let committed = synth_tiny(dir.path()); // <dir>/run/step-000005
    let run = committed.parent().unwrap();
    let second = run.join("step-000006");
    fs::create_dir_all(&second).unwrap();
    for entry in fs::read_dir(&committed).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            fs::copy(entry.path(), second.join(entry.file_name())).unwrap();
        }
    }
    for root in [dir.path(), run] {
        for extra in [&["--dry-run"][..], &[]] {
            let mut args = vec!["gc", s(root), "--memory-tier", "--keep", "1"];
            args.extend_from_slice(extra);
            let err = fails(&args);
            assert!(
                err.contains(&format!("memory tier {}: it ", s(root)))
                    && (err.contains("the run of checkpoints") || err.contains("the checkpoint")),
                "{args:?}: {err}"
            );
        }
        assert!(committed.join("manifest.json").is_file());
        assert!(second.join("manifest.json").is_file());
    }

    // A tier shared with another program: its folder is neither listed nor removed.
    let tier = dir.path().join("shm");
    let foreign = tier.join("step-1-abcdef012345");
    fs::create_dir_all(foreign.join("data")).unwrap();
    fs::write(foreign.join("data").join("rank-0.bin"), b"someone's").unwrap();
    let dry = json(&[
        "gc",
        s(&tier),
        "--memory-tier",
        "--max-bytes",
        "0",
        "--dry-run",
        "--json",
    ]);
    assert_eq!(dry["removed"].as_array().unwrap().len(), 0, "{dry}");
    assert_eq!(dry["kept"].as_array().unwrap().len(), 0, "{dry}");
    ok(["gc", s(&tier), "--memory-tier", "--max-bytes", "0"]);
    assert!(foreign.join("data").join("rank-0.bin").is_file());
}
