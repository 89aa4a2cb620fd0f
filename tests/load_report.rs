//! What a load reports and what verification costs: the report names read amplification (data
//! read / needed) and I/O amplification (everything fetched, checksum blocks included / needed) in
//! text and `--report-json`; whole saved boxes and small boxes are verified by their own crc32c
//! without checksum blocks; a corrupted byte is caught by either check.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::path::{Path, PathBuf};

use serde_json::Value;
use support::{fails_verifying, layout_file, ok, s};

const BLOCK: u64 = 64 * 1024;

/// gpt-tiny saved as Megatron tp2 pp2 (4 files, 181 boxes, 3.38 MiB: most boxes far smaller than
/// a 64 KiB checksum block).
fn synth(dir: &Path) -> PathBuf {
    support::synth_saved_as(
        dir,
        &[
            "megatron-gpt",
            "--tp",
            "2",
            "--pp",
            "2",
            "--dp",
            "1",
            "--num-layers",
            "4",
        ],
    )
}

/// Runs `tessera load <ckpt> <extra...> --report-json` and returns (stdout, JSON report).
fn load(dir: &Path, ckpt: &Path, extra: &[&str]) -> (String, Value) {
    let json = dir.join("report.json");
    let mut args = vec!["load", s(ckpt)];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--report-json", s(&json)]);
    let stdout = ok(args).text();
    let report = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (stdout, report)
}

fn u(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

fn f(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key} missing in {v}"))
}

/// One saved box: (fqn, data file, byte offset, byte length).
fn boxes(ckpt: &Path) -> Vec<(String, String, u64, u64)> {
    let info: Value = serde_json::from_slice(&ok(["inspect", s(ckpt), "--json"]).stdout).unwrap();
    let mut out = Vec::new();
    for t in info["tensors"].as_array().unwrap() {
        for b in t["boxes"].as_array().unwrap() {
            out.push((
                t["fqn"].as_str().unwrap().to_string(),
                b["file"].as_str().unwrap().to_string(),
                u(b, "byte_offset"),
                u(b, "byte_length"),
            ));
        }
    }
    out
}

/// The first box of `fqn` (rows 0.. of a row-sharded 2-d tensor).
fn first_box(ckpt: &Path, fqn: &str) -> (String, u64, u64) {
    let (_, file, offset, length) = boxes(ckpt).into_iter().find(|b| b.0 == fqn).unwrap();
    (file, offset, length)
}

/// Requests file asking rank 0 for rows 0..rows of `fqn` (all 64 columns).
fn rows_request(dir: &Path, fqn: &str, rows: u64) -> PathBuf {
    let path = dir.join("req.json");
    let json = format!(
        r#"{{"ranks": [[{{"fqn": "{fqn}", "offsets": [0, 0], "lengths": [{rows}, 64]}}]]}}"#
    );
    std::fs::write(&path, json).unwrap();
    path
}

fn flip(path: &Path, at: u64) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[at as usize] ^= 0x40;
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn report_names_read_and_io_amplification_where_checksum_blocks_dominate() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = synth(dir.path());
    // FSDP over 3 ranks cuts every small box into three flat slices, each rank its own.
    let target = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);
    let (text, report) = load(dir.path(), &ckpt, &["--layout", s(&target)]);
    let totals = &report["totals"];
    assert_eq!(u(totals, "ranks"), 3);
    assert_eq!(report["ranks"].as_array().unwrap().len(), 3);
    let (read, fetched, unique) = (
        u(totals, "bytes_read"),
        u(totals, "bytes_fetched"),
        u(totals, "unique_needed"),
    );
    let extra = u(totals, "verify_extra_bytes");
    assert_eq!(read, unique, "nothing is read twice");
    assert_eq!(fetched, read + extra);
    // Verification bytes outweigh the data: the I/O figure must say so.
    assert!(extra > read, "{totals}");
    assert_eq!(f(totals, "read_amplification"), 1.0);
    let io = f(totals, "io_amplification");
    assert_eq!(io, fetched as f64 / unique as f64);
    assert!(io > 2.0, "{totals}");
    assert!(
        text.contains("read amplification 1.00 = data read / needed"),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "\ntotal I/O            {} = {io:.2} x needed (I/O amplification = bytes fetched, verification included / needed)\n",
            human(fetched)
        )),
        "{text}"
    );
    // Every rank's report names both figures too.
    for rank in report["ranks"].as_array().unwrap() {
        let (read, fetched) = (u(rank, "bytes_read"), u(rank, "bytes_fetched"));
        assert_eq!(f(rank, "io_amplification"), fetched as f64 / read as f64);
        assert_eq!(f(rank, "read_amplification"), 1.0);
    }

    // Ranks as processes: each writes its own report (the per-rank JSON, both figures named) and
    // the totals add up to the same.
    let (_, tcp) = load(
        dir.path(),
        &ckpt,
        &["--layout", s(&target), "--transport", "tcp"],
    );
    for key in [
        "bytes_read",
        "bytes_fetched",
        "verify_extra_bytes",
        "boxes_verified",
    ] {
        assert_eq!(u(&tcp["totals"], key), u(totals, key), "{key}");
    }
    assert_eq!(f(&tcp["totals"], "io_amplification"), io);
    for (a, b) in tcp["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .zip(report["ranks"].as_array().unwrap())
    {
        assert_eq!(f(a, "io_amplification"), f(b, "io_amplification"));
    }

    // Without verification both figures are the same.
    let (text, report) = load(dir.path(), &ckpt, &["--layout", s(&target), "--no-verify"]);
    assert_eq!(u(&report["totals"], "verify_extra_bytes"), 0);
    assert_eq!(f(&report["totals"], "io_amplification"), 1.0);
    assert!(
        text.contains(" = 1.00 x needed (I/O amplification"),
        "{text}"
    );
    assert!(!text.contains("only to verify"), "{text}");
}

/// `human::bytes` as the report prints it (binary units, two decimals).
fn human(n: u64) -> String {
    let units = ["B", "KiB", "MiB", "GiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < units.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{v:.2} {}", units[unit])
    }
}

#[test]
fn loading_the_saved_layout_fetches_no_checksum_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = synth(dir.path());
    let saved = dir.path().join("saved.json");
    let (text, report) = load(dir.path(), &ckpt, &["--layout", s(&saved), "--check"]);
    let totals = &report["totals"];
    // Every piece is a whole saved box, checked by its own crc32c: not a byte more is fetched.
    assert_eq!(u(totals, "boxes_verified"), boxes(&ckpt).len() as u64);
    assert_eq!(u(totals, "verify_extra_bytes"), 0);
    assert_eq!(u(totals, "bytes_fetched"), u(totals, "bytes_read"));
    assert_eq!(f(totals, "io_amplification"), 1.0);
    assert!(
        text.contains("(0 B only to verify: checksum blocks, boxes read whole; 181 boxes checked by their own checksum;"),
        "{text}"
    );
}

#[test]
fn part_of_a_small_box_fetches_the_box_and_part_of_a_large_one_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = synth(dir.path());

    // 10 of 98 rows of an 12,544-byte box: the box is smaller than a checksum block.
    let (_, _, small_len) = first_box(&ckpt, "model.layers.0.mlp.fc1.weight");
    assert!(small_len < BLOCK);
    let req = rows_request(dir.path(), "model.layers.0.mlp.fc1.weight", 10);
    let (_, report) = load(dir.path(), &ckpt, &["--requests", s(&req), "--check"]);
    let totals = &report["totals"];
    assert_eq!(u(totals, "bytes_read"), 10 * 64 * 2);
    assert_eq!(
        u(totals, "bytes_fetched"),
        small_len,
        "the box, not a block"
    );
    assert_eq!(u(totals, "boxes_verified"), 1);

    // 10 of 500 rows of a 128,000-byte fp32 box: the block around them is cheaper.
    let fqn = "optim.state.model.lm_head.weight.master";
    let (file, offset, len) = first_box(&ckpt, fqn);
    assert!(len > BLOCK);
    let req = rows_request(dir.path(), fqn, 10);
    let (_, report) = load(dir.path(), &ckpt, &["--requests", s(&req), "--check"]);
    let totals = &report["totals"];
    let needed = 10 * 64 * 4;
    let file_len = std::fs::metadata(ckpt.join(&file)).unwrap().len();
    let start = offset / BLOCK * BLOCK;
    let end = ((offset + needed).div_ceil(BLOCK) * BLOCK).min(file_len);
    assert_eq!(u(totals, "bytes_read"), needed);
    assert_eq!(u(totals, "bytes_fetched"), end - start);
    assert_eq!(u(totals, "boxes_verified"), 0);
}

#[test]
fn a_corrupted_byte_is_caught_by_the_box_check_and_by_the_block_check() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = synth(dir.path());

    // In a small box read in part: its crc32c catches it and the error names file, bytes, tensor.
    let fqn = "model.layers.0.mlp.fc1.weight";
    let (file, offset, len) = first_box(&ckpt, fqn);
    flip(&ckpt.join(&file), offset + 100);
    let req = rows_request(dir.path(), fqn, 10);
    let err = fails_verifying(["load", s(&ckpt), "--requests", s(&req)]);
    assert!(
        err.contains(&format!(
            "checksum mismatch in {}/{file} bytes {offset}..{} (tensor {fqn} box [0..98, 0..64]): its metadata records crc32c",
            ckpt.file_name().unwrap().to_str().unwrap(),
            offset + len
        )),
        "{err}"
    );
    // Loading the saved layout reads it as a whole box: caught the same way.
    let saved = dir.path().join("saved.json");
    let err = fails_verifying(["load", s(&ckpt), "--layout", s(&saved)]);
    assert!(
        err.contains(&format!(
            "{file} bytes {offset}..{} (tensor {fqn} box [0..98, 0..64])",
            offset + len
        )),
        "{err}"
    );
    flip(&ckpt.join(&file), offset + 100);

    // In a large box read in part: its checksum block catches it.
    let fqn = "optim.state.model.lm_head.weight.master";
    let (file, offset, _) = first_box(&ckpt, fqn);
    flip(&ckpt.join(&file), offset + 100);
    let req = rows_request(dir.path(), fqn, 10);
    let err = fails_verifying(["load", s(&ckpt), "--requests", s(&req)]);
    let block = (offset + 100) / BLOCK * BLOCK;
    assert!(
        err.contains(&format!(
            "checksum mismatch in {}/{file} bytes {block}..{}: expected crc32c",
            ckpt.file_name().unwrap().to_str().unwrap(),
            block + BLOCK
        )),
        "{err}"
    );
}

#[test]
fn metrics_file_has_every_ranks_requested_and_transferred_bytes_as_the_json_report() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = synth(dir.path());
    let saved = dir.path().join("saved.json");
    let metrics = dir.path().join("load.prom");
    let (_text, report) = load(
        dir.path(),
        &ckpt,
        &["--layout", s(&saved), "--metrics-file", s(&metrics)],
    );
    let text = std::fs::read_to_string(&metrics).unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    let ranks = report["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    for rank in ranks {
        let r = u(rank, "rank");
        for (series, field) in [
            ("tessera_load_bytes_needed_total", "bytes_needed"),
            ("tessera_load_bytes_requested_total", "bytes_fetched"),
            ("tessera_load_bytes_transferred_total", "bytes_transferred"),
            ("tessera_load_storage_requests_total", "requests"),
        ] {
            let line = format!("{series}{{rank=\"{r}\"}} {}\n", u(rank, field));
            assert!(text.contains(&line), "{line} not in {text}");
        }
        assert!(u(rank, "bytes_transferred") > 0);
    }
    assert!(
        !dir.path().read_dir().unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains(".tmp-"))
    );
}

/// `--read-order` reaches every rank process of `--transport tcp` (they plan on their own and must
/// agree): forced storage order relays parts of the row-sharded chunks a column layout cuts
/// across, request order relays nothing; both land the formula's bytes (`--check`).
#[test]
fn read_order_reaches_every_tcp_rank_and_changes_what_is_relayed() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = support::synth_saved_as(dir.path(), &["fsdp", "--dp", "2"]);
    let target = layout_file(
        dir.path(),
        "tp2.json",
        &[
            "megatron-gpt",
            "--tp",
            "2",
            "--pp",
            "1",
            "--dp",
            "1",
            "--num-layers",
            "4",
        ],
    );
    let exchanged = |order: &str| {
        let (_text, report) = load(
            dir.path(),
            &ckpt,
            &[
                "--layout",
                s(&target),
                "--transport",
                "tcp",
                "--read-order",
                order,
                "--check",
            ],
        );
        u(&report["totals"], "bytes_exchanged")
    };
    let storage = exchanged("storage");
    let request = exchanged("request");
    assert!(
        storage > request,
        "storage order relayed {storage}, request order {request}"
    );
}

/// The rank processes of `--transport tcp` take the job's arguments whole: a filter and a
/// coalescing gap given once reach every rank, so the spawned job needs, fetches and transfers
/// what the same job in one process does (flags that were forwarded by hand before, one by one).
#[test]
fn spawned_ranks_honour_include_and_coalesce_gap_as_in_process_ranks_do() {
    let dir = tempfile::tempdir().unwrap();
    let ckpt = synth(dir.path());
    let target = layout_file(dir.path(), "dp2.json", &["fsdp", "--dp", "2"]);
    let job = |transport: &str, extra: &[&str]| {
        let mut args = vec!["--layout", s(&target), "--transport", transport, "--check"];
        args.extend_from_slice(extra);
        load(dir.path(), &ckpt, &args).1
    };
    let whole = job("tcp", &[]);
    let filter = ["--include", "*layers.1.*", "--coalesce-gap", "1048576"];
    let inproc = job("inproc", &filter);
    let tcp = job("tcp", &filter);
    for key in [
        "bytes_needed",
        "bytes_read",
        "bytes_fetched",
        "bytes_transferred",
        "requests",
    ] {
        assert_eq!(u(&tcp["totals"], key), u(&inproc["totals"], key), "{key}");
    }
    let totals = &tcp["totals"];
    // The filter reached the ranks: they needed part of what the whole job needs.
    assert!(u(totals, "bytes_needed") < u(&whole["totals"], "bytes_needed"));
    // The gap reached them: requests spanned gaps (local files default to none).
    assert!(
        u(totals, "bytes_transferred") > u(totals, "bytes_fetched"),
        "{totals}"
    );
    assert_eq!(
        u(&whole["totals"], "bytes_transferred"),
        u(&whole["totals"], "bytes_fetched")
    );
}
