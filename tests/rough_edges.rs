//! Rough edges a transformers eval/SFT job hit loading checkpoints through tessera (issue 44
//! item 5), through the real binary: `convert --include/--exclude` patterns cover a checkpoint's
//! plain (non-tensor) values as they cover tensors; a `convert` that fails leaves nothing it
//! created; `inspect` lists the plain values of every format by name (text) and with their
//! values (`--json`, one shape for every format).
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use support::{fails, fails_verifying, ok, s};

/// The DCP fixtures (`shared/fixtures/dcp` next to the workspace, or `$TESSERA_DCP_FIXTURES`).
fn fixtures() -> PathBuf {
    let dir = std::env::var_os("TESSERA_DCP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/dcp"));
    assert!(
        dir.join("a_w1_plain/.metadata").exists(),
        "DCP fixtures not found at {} (set TESSERA_DCP_FIXTURES)",
        dir.display()
    );
    dir
}

/// `a_w1_plain`: 51 tensors (`model.*`, `optim.state.*`) and 11 plain values (`extra.*`,
/// `optim.param_groups.*`).
fn plain_fixture() -> PathBuf {
    fixtures().join("a_w1_plain")
}

fn inspect_json(ckpt: &Path) -> Value {
    serde_json::from_slice(&ok(["inspect", s(ckpt), "--json"]).stdout).unwrap()
}

/// The `objects` of an `inspect --json` document by key, each entry checked for the fields every
/// format gives.
fn objects_by_key(doc: &Value) -> BTreeMap<String, Value> {
    let objects = doc["objects"].as_array().expect("an objects array");
    objects
        .iter()
        .map(|o| {
            for field in ["key", "file", "byte_offset", "byte_length"] {
                assert!(!o[field].is_null(), "{field} missing in {o}");
            }
            (o["key"].as_str().unwrap().to_string(), o.clone())
        })
        .collect()
}

fn keys(doc: &Value) -> Vec<String> {
    objects_by_key(doc).into_keys().collect()
}

/// Every file and directory under `dir`, relative, sorted.
fn tree(dir: &Path) -> Vec<String> {
    fn walk(root: &Path, dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            out.push(
                path.strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .into_owned(),
            );
            if path.is_dir() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(dir, dir, &mut out);
    out.sort();
    out
}

/// `--exclude 'extra.*'` matches only plain values: it failed "matches no tensor"; now it drops
/// them and converts every tensor. `--include` of plain values alone makes a native checkpoint of
/// plain values only.
#[test]
fn convert_patterns_take_and_leave_plain_values() {
    let src = plain_fixture();
    let layout = src.join("layout_w2_shard1.json");
    let tmp = tempfile::tempdir().unwrap();

    let out = tmp.path().join("no_extra");
    let text = ok([
        "convert",
        s(&src),
        "--layout",
        s(&layout),
        "--out",
        s(&out),
        "--exclude",
        "extra.*",
    ])
    .text();
    assert!(text.contains(": 51 tensors"), "{text}");
    let doc = inspect_json(&out);
    assert_eq!(doc["manifest"]["tensors"], 51);
    assert_eq!(doc["manifest"]["objects"], 5);
    assert_eq!(
        keys(&doc),
        [
            "optim.param_groups.0.betas",
            "optim.param_groups.0.eps",
            "optim.param_groups.0.lr",
            "optim.param_groups.0.params",
            "optim.param_groups.0.weight_decay",
        ]
    );
    assert!(ok(["verify", s(&out)]).text().contains(": ok"));

    // One pattern for tensors, one for plain values.
    let out = tmp.path().join("model_and_config");
    ok([
        "convert",
        s(&src),
        "--layout",
        s(&layout),
        "--out",
        s(&out),
        "--include",
        "model.*",
        "--include",
        "extra.config.*",
    ]);
    let doc = inspect_json(&out);
    let fqns: Vec<&str> = doc["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["fqn"].as_str().unwrap())
        .collect();
    assert!(
        !fqns.is_empty() && fqns.iter().all(|f| f.starts_with("model.")),
        "{fqns:?}"
    );
    assert_eq!(
        keys(&doc),
        [
            "extra.config.hidden",
            "extra.config.n_layers",
            "extra.config.name",
            "extra.config.vocab"
        ]
    );

    // Plain values only: a native checkpoint of no tensor.
    let out = tmp.path().join("state_only");
    let text = ok([
        "convert",
        s(&src),
        "--layout",
        s(&layout),
        "--out",
        s(&out),
        "--include",
        "extra.*",
    ])
    .text();
    assert!(text.contains(": 0 tensors"), "{text}");
    let doc = inspect_json(&out);
    assert_eq!(doc["manifest"]["objects"], 6);
    assert_eq!(
        objects_by_key(&doc)["extra.config.name"]["value"],
        "tiny-gpt"
    );

    // A safetensors export holds tensors only: plain values named by a pattern are left out
    // as they always are, and a filter that leaves no tensor is refused naming it.
    let hf = tmp.path().join("hf");
    ok([
        "convert",
        s(&src),
        "--format",
        "safetensors",
        "--out",
        s(&hf),
        "--exclude",
        "extra.*",
    ]);
    assert!(hf.join("model.safetensors.index.json").exists());
    let hf_none = tmp.path().join("hf_none");
    let err = fails([
        "convert",
        s(&src),
        "--format",
        "safetensors",
        "--out",
        s(&hf_none),
        "--include",
        "extra.*",
    ]);
    assert!(
        err.contains(&format!(
            "no tensor of {} is left by --include extra.*, and a safetensors export holds only tensors",
            s(&src)
        )),
        "{err}"
    );
    assert!(!hf_none.exists(), "{:?}", tree(tmp.path()));
}

/// A pattern that matches neither a tensor nor a plain value is still an error naming it, and the
/// failed convert leaves nothing it created: not `--out`, not the parents it made for it.
#[test]
fn a_pattern_matching_nothing_fails_and_leaves_nothing() {
    let src = plain_fixture();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("runs/new/step-1");
    let err = fails([
        "convert",
        s(&src),
        "--layout",
        s(&src.join("layout_w2_shard1.json")),
        "--out",
        s(&out),
        "--exclude",
        "train_state.*",
    ]);
    assert!(
        err.contains(&format!(
            "--exclude \"train_state.*\" matches no tensor of {src} and no plain value (51 \
             tensors, 11 plain values; `tessera inspect {src}` lists them)",
            src = s(&src)
        )),
        "{err}"
    );
    assert_eq!(tree(tmp.path()), Vec::<String>::new());
}

/// A convert that fails on a corrupt source (before writing) or part-way through writing (a data
/// file it cannot write) removes what it created, and keeps what was there before: an `--out`
/// that existed, and the files in it that it did not write.
#[test]
fn a_failed_convert_removes_what_it_created_and_keeps_what_was_there() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    support::copy_dir_writable(&plain_fixture(), &src);
    let layout = src.join("layout_w2_shard1.json");

    // 1. A corrupt source: verification fails before anything is written.
    let bad = tmp.path().join("bad");
    support::copy_dir_writable(&src, &bad);
    let distcp = bad.join("__0_0.distcp");
    let mut bytes = std::fs::read(&distcp).unwrap();
    bytes[309355 + 1000] ^= 0x01;
    std::fs::write(&distcp, &bytes).unwrap();
    let out = tmp.path().join("out/step-1");
    let err = fails_verifying(["convert", s(&bad), "--layout", s(&layout), "--out", s(&out)]);
    assert!(
        err.contains("before converting it (nothing was written"),
        "{err}"
    );
    assert!(!tmp.path().join("out").exists(), "{:?}", tree(tmp.path()));

    // 2. An --out that exists, holding a file of its own and, where the second data file goes,
    // a directory: the first data file is written, the second fails.
    let out = tmp.path().join("existing");
    std::fs::create_dir_all(out.join("data/rank-00001.bin")).unwrap();
    std::fs::write(out.join("data/rank-00001.bin/x"), b"in the way").unwrap();
    std::fs::write(out.join("notes.txt"), b"mine").unwrap();
    let before = tree(&out);
    let run = support::run_in(
        None,
        ["convert", s(&src), "--layout", s(&layout), "--out", s(&out)],
    );
    assert_ne!(run.code, Some(0), "{}", run.stderr);
    assert!(run.stderr.contains("rank-00001"), "{}", run.stderr);
    assert_eq!(tree(&out), before, "{}", run.stderr);
    assert_eq!(std::fs::read(out.join("notes.txt")).unwrap(), b"mine");

    // 3. The same into a new directory succeeds (nothing stale was left in the way).
    let fresh = tmp.path().join("fresh");
    ok([
        "convert",
        s(&src),
        "--layout",
        s(&layout),
        "--out",
        s(&fresh),
    ]);
    assert!(ok(["verify", s(&fresh)]).text().contains(": ok"));
}

/// `inspect` on a native checkpoint gave only a count of its plain values where a DCP checkpoint
/// listed them: now every format lists them, in text by name and in `--json` with their values,
/// in one shape (a safetensors checkpoint has an empty list).
#[test]
fn inspect_lists_plain_values_of_every_format_alike() {
    let src = plain_fixture();
    let tmp = tempfile::tempdir().unwrap();
    let native = tmp.path().join("native");
    ok([
        "convert",
        s(&src),
        "--layout",
        s(&src.join("layout_w2_shard1.json")),
        "--out",
        s(&native),
    ]);
    let dcp = objects_by_key(&inspect_json(&src));
    let ours = objects_by_key(&inspect_json(&native));
    assert_eq!(dcp.len(), 11);
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        dcp.keys().collect::<Vec<_>>()
    );
    for (key, entry) in &dcp {
        assert!(!entry["value"].is_null(), "{key}: {entry}");
        assert_eq!(ours[key]["value"], entry["value"], "{key}");
        assert_eq!(ours[key]["byte_length"], entry["byte_length"], "{key}");
        assert_eq!(ours[key]["file"], "data/rank-00000.bin", "{key}");
    }
    assert_eq!(ours["extra.config.name"]["value"], "tiny-gpt");
    assert_eq!(
        ours["optim.param_groups.0.betas"]["value"],
        serde_json::json!([0.9, 0.95])
    );

    // Text: the OBJECT table names every plain value, for both formats.
    for ckpt in [&src, &native] {
        let text = ok(["inspect", s(ckpt)]).text();
        let table = text
            .split("\n\n")
            .find(|section| section.starts_with("OBJECT "))
            .unwrap_or_else(|| panic!("no OBJECT table:\n{text}"));
        let listed: Vec<&str> = table
            .lines()
            .skip(1)
            .map(|l| l.split_whitespace().next().unwrap())
            .collect();
        assert_eq!(listed, dcp.keys().map(String::as_str).collect::<Vec<_>>());
    }

    let safetensors = inspect_json(&fixtures().join("f_hf_w1_full"));
    assert_eq!(safetensors["objects"], serde_json::json!([]));
}
