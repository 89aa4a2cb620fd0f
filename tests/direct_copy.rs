//! Ranks in separate processes on one host copy each other's shares straight out of memory
//! (`process_vm_readv`) instead of passing them through sockets, land the formula's bytes
//! (`--check`), and say so in the report. `TESSERA_CROSS_MEMORY=0` turns it off; a rank that
//! turns it off alone still loads with the others (its pairs exchange bytes).
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use serde_json::Value;
use support::{BIN, layout_file, s};

/// gpt-tiny saved `fsdp --dp 2`, and a layout that replicates it over 3 ranks: with dedup every
/// piece is read by one rank and copied by the two others.
fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let ckpt = support::synth_saved_as(dir, &["fsdp", "--dp", "2"]);
    let target = layout_file(
        dir,
        "dp3.json",
        &[
            "megatron-gpt",
            "--tp",
            "1",
            "--pp",
            "1",
            "--dp",
            "3",
            "--num-layers",
            "4",
        ],
    );
    (ckpt, target)
}

/// `tessera load <ckpt> --layout <target> --transport tcp --check`, its report to `json`, with
/// `TESSERA_CROSS_MEMORY` set to `cross_memory` (callers add the ranks' arguments).
fn load_command(ckpt: &Path, target: &Path, json: &Path, cross_memory: &str) -> Command {
    let mut command = Command::new(BIN);
    command
        .args([
            "load",
            s(ckpt),
            "--layout",
            s(target),
            "--transport",
            "tcp",
            "--check",
            "--peer-timeout",
            "30",
            "--report-json",
            s(json),
        ])
        .env("TESSERA_CROSS_MEMORY", cross_memory)
        .stdin(Stdio::null());
    command
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// `tessera load --transport tcp --check` of all 3 ranks with `TESSERA_CROSS_MEMORY` set to
/// `cross_memory`: (stdout, JSON report).
fn load_all(dir: &Path, cross_memory: &str) -> (String, Value) {
    let (ckpt, target) = setup(dir);
    let json = dir.join("report.json");
    let out = load_command(&ckpt, &target, &json, cross_memory)
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (stdout, report)
}

#[test]
fn tcp_ranks_copy_shares_out_of_each_others_memory() {
    let dir = tempfile::tempdir().unwrap();
    let (text, report) = load_all(dir.path(), "1");
    let ranks = report["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 3);
    for rank in ranks {
        assert!(u(rank, "bytes_received") > 0, "{rank}");
        assert_eq!(
            u(rank, "bytes_received_direct"),
            u(rank, "bytes_received"),
            "{rank}"
        );
    }
    let totals = &report["totals"];
    assert_eq!(
        u(totals, "bytes_exchanged_direct"),
        u(totals, "bytes_exchanged")
    );
    assert!(
        text.contains(", all copied directly between ranks' memory"),
        "{text}"
    );
}

#[test]
fn tessera_cross_memory_0_sends_every_share_over_tcp() {
    let dir = tempfile::tempdir().unwrap();
    let (text, report) = load_all(dir.path(), "0");
    let totals = &report["totals"];
    assert!(u(totals, "bytes_exchanged") > 0);
    assert_eq!(u(totals, "bytes_exchanged_direct"), 0);
    assert!(!text.contains("copied directly"), "{text}");
}

#[test]
fn a_rank_that_declines_exchanges_bytes_with_the_others_and_all_load() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, target) = setup(dir.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
        .to_string();
    let children: Vec<_> = (0..3)
        .map(|rank| {
            let json = dir.path().join(format!("rank-{rank}.json"));
            let cross_memory = if rank == 1 { "0" } else { "1" };
            let child = load_command(&ckpt, &target, &json, cross_memory)
                .args([
                    "--rank",
                    &rank.to_string(),
                    "--world",
                    "3",
                    "--master-addr",
                    "127.0.0.1",
                    "--master-port",
                    &port,
                    "--quiet",
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            (child, json)
        })
        .collect();
    let mut reports = Vec::new();
    for (rank, (child, json)) in children.into_iter().enumerate() {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "rank {rank}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let report: Value = serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
        reports.push(report);
    }
    // Rank 1 copies nothing (it declined) and nobody copies from it; ranks 0 and 2 copy each
    // other's shares and get rank 1's as bytes.
    assert_eq!(u(&reports[1], "bytes_received_direct"), 0);
    for rank in [0, 2] {
        let (received, direct) = (
            u(&reports[rank], "bytes_received"),
            u(&reports[rank], "bytes_received_direct"),
        );
        assert!(
            0 < direct && direct < received,
            "rank {rank}: {direct} of {received} bytes copied directly"
        );
    }
}
