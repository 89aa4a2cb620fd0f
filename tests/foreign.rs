//! PyTorch DCP and safetensors checkpoints loaded in place through the real binary, against what
//! torch itself gave: for every fixture (written by PyTorch 2.15) and every `reference_<layout>`
//! torch's resharding load produced, `tessera load --layout layout_<layout>.json --dump` gives every
//! rank the same bytes (sha256 per rank per tensor), and `tessera convert --format safetensors`
//! gives every full tensor the sha256 of `expected.json`. Also through S3, over TCP ranks, and
//! with damaged checkpoints (errors naming the file).
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::Value;
use support::reference::{Tensors, check_reference, json, sha256, tensors_of};
use support::served::Served;
use support::{fails, ok, s};

/// The fixtures (`shared/fixtures/dcp` next to the workspace, or `$TESSERA_DCP_FIXTURES`).
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

/// The full-tensor sha256s of a fixture's `expected.json`.
fn expected_shas(fixture: &str) -> HashMap<String, String> {
    let expected = json(&fixtures().join(fixture).join("expected.json"));
    let entries = match expected.get("entries") {
        Some(entries) => entries.clone(),
        None => expected["entries_by_dir"]["."].clone(),
    };
    entries
        .as_object()
        .unwrap()
        .iter()
        .filter(|(_, e)| e["kind"] == "tensor")
        .map(|(k, e)| (k.clone(), e["sha256"].as_str().unwrap().to_string()))
        .collect()
}

/// Loads `fixture` into every reference layout and checks every rank; then consolidates it and
/// checks every full tensor.
fn loads_like_torch(fixture: &str) {
    let dir = fixtures().join(fixture);
    let tmp = tempfile::tempdir().unwrap();
    for layout in ["w3_shard0", "w2_shard1"] {
        let dump = tmp.path().join(layout);
        let report = ok([
            "load",
            s(&dir),
            "--layout",
            s(&dir.join(format!("layout_{layout}.json"))),
            "--dump",
            s(&dump),
        ])
        .text();
        assert!(report.contains("read amplification 1.00"), "{report}");
        let verified = if fixture.starts_with("f_hf") {
            "read in place without verification"
        } else {
            // DCP: every blob's zip CRC-32, parts of a blob checked jointly by their readers.
            "read in place, verified by each blob's zip CRC-32"
        };
        assert!(report.contains(verified), "{report}");
        check_reference(&dump, &json(&dir.join(format!("reference_{layout}.json"))));
    }
    let out = tmp.path().join("consolidated");
    ok([
        "convert",
        s(&dir),
        "--format",
        "safetensors",
        "--out",
        s(&out),
    ]);
    let index = json(&out.join("model.safetensors.index.json"));
    let expected = expected_shas(fixture);
    let weight_map = index["weight_map"].as_object().unwrap();
    assert_eq!(weight_map.len(), expected.len());
    let mut files: HashMap<String, Tensors> = HashMap::new();
    for (fqn, sha) in &expected {
        let file = weight_map[fqn].as_str().unwrap();
        let tensors = files
            .entry(file.to_string())
            .or_insert_with(|| tensors_of(&out.join(file)));
        assert_eq!(
            &sha256(&tensors[fqn].1),
            sha,
            "{fixture} {fqn}: full tensor"
        );
    }
}

#[test]
fn dcp_plain_with_a_transposed_weight_loads_like_torch() {
    loads_like_torch("a_w1_plain");
}

#[test]
fn dcp_fsdp_shard0_with_an_empty_chunk_loads_like_torch() {
    loads_like_torch("b_w4_fsdp_shard0");
}

#[test]
fn dcp_dp2_tp2_with_deduplicated_replicas_loads_like_torch() {
    loads_like_torch("c_w4_dp2_tp2");
}

#[test]
fn dcp_fsdp2_adamw_after_real_training_loads_like_torch() {
    loads_like_torch("e_w2_fsdp2_adamw");
    // The values are not from a formula: compare with the gathered full tensors too.
    let dir = fixtures().join("e_w2_fsdp2_adamw");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("full");
    ok([
        "convert",
        s(&dir),
        "--format",
        "safetensors",
        "--out",
        s(&out),
    ]);
    let full = tensors_of(&dir.join("expected_full.safetensors"));
    let index = json(&out.join("model.safetensors.index.json"));
    for (name, (shape, bytes)) in &full {
        let file = index["weight_map"][name].as_str().unwrap();
        let got = tensors_of(&out.join(file));
        assert_eq!(&got[name].0, shape, "{name}");
        assert!(&got[name].1 == bytes, "{name}: bytes differ");
    }
}

#[test]
fn hf_index_safetensors_loads_like_torch() {
    loads_like_torch("f_hf_w1_full");
}

#[test]
fn tcp_ranks_share_one_blob_index() {
    let dir = fixtures().join("e_w2_fsdp2_adamw");
    let tmp = tempfile::tempdir().unwrap();
    let dump = tmp.path().join("dump");
    let report = ok([
        "load",
        s(&dir),
        "--layout",
        s(&dir.join("layout_w3_shard0.json")),
        "--transport",
        "tcp",
        "--dump",
        s(&dump),
    ])
    .text();
    assert!(report.contains("zip headers "), "{report}");
    check_reference(&dump, &json(&dir.join("reference_w3_shard0.json")));
}

#[test]
fn a_cache_directory_makes_the_second_open_read_no_headers() {
    let dir = fixtures().join("b_w4_fsdp_shard0");
    let tmp = tempfile::tempdir().unwrap();
    let cache = tmp.path().join("cache");
    let run = |what: &str| {
        let output = std::process::Command::new(support::BIN)
            .args(["inspect", s(&dir)])
            .env("TESSERA_CACHE_DIR", &cache)
            .output()
            .unwrap();
        assert!(output.status.success(), "{what}");
        String::from_utf8(output.stdout).unwrap()
    };
    let first = run("first");
    assert!(
        first.contains("blob index: 183 torch.save blobs, ")
            && first.contains("of zip headers read in"),
        "{first}"
    );
    let second = run("second");
    assert!(
        second.contains(
            "blob index: 183 torch.save blobs, from the cache directory (no header reads)"
        ),
        "{second}"
    );
    // The checkpoint directory itself is never written.
    let names: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names.len(), 1);
}

#[test]
fn inspect_json_decodes_dcp_objects() {
    let dir = fixtures().join("a_w1_plain");
    let doc: Value = serde_json::from_slice(&ok(["inspect", s(&dir), "--json"]).stdout).unwrap();
    assert_eq!(doc["format"], "dcp");
    assert_eq!(doc["dcp"]["version"], "1.0.0");
    let objects = doc["objects"].as_array().unwrap();
    let value = |key: &str| objects.iter().find(|o| o["key"] == key).unwrap()["value"].clone();
    assert_eq!(value("extra.config.name"), "tiny-gpt");
    assert_eq!(
        value("optim.param_groups.0.betas"),
        serde_json::json!([0.9, 0.95])
    );
    let lm_head = doc["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["fqn"] == "model.lm_head.weight")
        .unwrap();
    assert_eq!(lm_head["boxes"][0]["strides"], serde_json::json!([1, 96]));
}

#[test]
fn verify_checks_dcp_crcs_and_safetensors_structure() {
    let text = ok(["verify", s(&fixtures().join("c_w4_dp2_tp2"))]).text();
    assert!(
        text.contains(": ok, PyTorch DCP: metadata, 87 blob headers and byte ranges are consistent; 76 tensor storages and 11 objects match their zip CRC-32"),
        "{text}"
    );
    let text = ok(["verify", s(&fixtures().join("f_hf_w1_full"))]).text();
    assert_eq!(
        text,
        format!(
            "{}: ok, safetensors: 2 files, 32 tensors; headers parse and every tensor's byte range lies inside its file with no overlap or hole (safetensors records no checksums: data bytes not verified)\n",
            s(&fixtures().join("f_hf_w1_full"))
        )
    );
}

/// Copies a fixture into `into` (writable) and returns the copy.
fn copy_fixture(fixture: &str, into: &Path) -> PathBuf {
    let to = into.join(fixture);
    support::copy_dir_writable(&fixtures().join(fixture), &to);
    to
}

/// A bit-flipped DCP storage must not come out of `convert` as a native checkpoint that verifies
/// (the conversion would re-checksum the bad bytes): convert fails naming the blob, and leaves no
/// output at all (it left an empty `--out`); the same goes for the safetensors export.
#[test]
fn convert_refuses_a_dcp_blob_that_fails_its_crc() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    let distcp = dir.join("__0_0.distcp");
    let mut bytes = std::fs::read(&distcp).unwrap();
    bytes[309355 + 1000] ^= 0x01;
    std::fs::write(&distcp, &bytes).unwrap();
    let blob = "bad blob in __0_0.distcp bytes 310059..334635 (tensor model.lm_head.weight chunk [0..96, 0..64]): storage crc32 ";

    let out = tmp.path().join("native/step-000001");
    let err = support::fails_verifying([
        "convert",
        s(&dir),
        "--layout",
        s(&dir.join("layout_w2_shard1.json")),
        "--out",
        s(&out),
    ]);
    assert!(
        err.starts_with(&format!(
            "error: verifying {} before converting it (nothing was written to {}): {blob}",
            s(&dir),
            s(&out)
        )),
        "{err}"
    );
    // Nothing the convert created is left: not `--out` (its claim included), nor the parent it
    // made for it.
    assert!(!out.exists(), "{}", out.display());
    assert!(!tmp.path().join("native").exists());

    let hf = tmp.path().join("hf");
    let err = support::fails_verifying([
        "convert",
        s(&dir),
        "--format",
        "safetensors",
        "--out",
        s(&hf),
    ]);
    assert!(err.contains(blob), "{err}");
    assert!(!hf.exists(), "{}", hf.display());
}

#[test]
fn damaged_checkpoints_fail_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    let layout = dir.join("layout_w2_shard1.json");
    // Flip a byte of the lm_head storage: verify and every load fail naming the blob (loads
    // fold the blob's zip CRC-32 from the parts each rank reads: column halves, row thirds).
    let distcp = dir.join("__0_0.distcp");
    let mut bytes = std::fs::read(&distcp).unwrap();
    bytes[309355 + 1000] ^= 0x10;
    std::fs::write(&distcp, &bytes).unwrap();
    for target in ["layout_w2_shard1.json", "layout_w3_shard0.json"] {
        let err = support::fails_verifying(["load", s(&dir), "--layout", s(&dir.join(target))]);
        assert!(
            err.contains("checksum mismatch in __0_0.distcp bytes 310059..334635 (tensor model.lm_head.weight box [0..96, 0..64]), read in parts by ranks ")
                && err.contains(": expected CRC-32 "),
            "{target}: {err}"
        );
    }
    let err = support::fails_verifying(["verify", s(&dir)]);
    assert!(
        err.starts_with("error: bad blob in __0_0.distcp bytes 310059..334635 (tensor model.lm_head.weight chunk [0..96, 0..64]): storage crc32 "),
        "{err}"
    );
    assert!(
        err.ends_with(&format!("{}: verification failed\n", s(&dir))),
        "{err}"
    );
    // The fixture holds the synthetic values, so `load --check` catches the flipped byte too
    // (with the CRC check off, which would catch it first): a verification failure (4)
    // in-process and from rank processes alike, each rank named once. Before, a mismatch exited
    // 1 ("rank 0: rank 0: ...").
    for transport in ["inproc", "tcp"] {
        let err = support::fails_verifying([
            "load",
            s(&dir),
            "--layout",
            s(&layout),
            "--no-verify",
            "--check",
            "--transport",
            transport,
        ]);
        assert!(
            err.contains(": tensor model.lm_head.weight (f32): element [")
                && err.contains("expected bytes"),
            "{transport}: {err}"
        );
        assert!(!err.contains("rank 0: rank 0"), "{transport}: {err}");
    }
    // Truncate it: every command names the chunk and file, and a file shorter than its metadata
    // says is a truncated file, a verification failure (4) as a short read while loading is.
    bytes.truncate(700_000);
    std::fs::write(&distcp, &bytes).unwrap();
    let err = support::fails_verifying(["load", s(&dir), "--layout", s(&layout)]);
    assert_eq!(
        err,
        format!(
            "error: opening checkpoint {}: tensor optim.state.layers.1.attn.proj.weight.exp_avg: chunk [0..64, 0..64] reads bytes 689147..707108 of a_w1_plain/__0_0.distcp, past its end (700000 bytes)\n",
            s(&dir)
        )
    );
}

/// An empty `.metadata` (a save or copy cut short) is a truncated file: every command names it
/// and exits 4, the class of truncated or corrupt files. Before, detection asked the store for
/// the byte range 0..0, which it refused as an invalid range, and that read as storage that did
/// not answer (5, "unreachable").
#[test]
fn an_empty_dcp_metadata_file_is_a_verification_failure() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    std::fs::write(dir.join(".metadata"), b"").unwrap();
    let expected = format!(
        "error: opening checkpoint {}: a_w1_plain/.metadata: the DCP metadata file is empty (0 bytes); the save or copy that wrote it was cut short\n",
        s(&dir)
    );
    let layout = dir.join("layout_w2_shard1.json");
    for args in [
        vec!["inspect", s(&dir)],
        vec!["verify", s(&dir)],
        vec!["load", s(&dir), "--layout", s(&layout)],
    ] {
        assert_eq!(support::fails_verifying(&args), expected, "{args:?}");
    }
    let run = support::run_in(None, ["inspect", s(&dir), "--json"]);
    let doc: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(doc["error"]["kind"], "verification_failed", "{doc}");
    assert_eq!(doc["error"]["code"], 4, "{doc}");
}

#[test]
fn a_safetensors_header_over_the_cap_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("st");
    std::fs::create_dir_all(&dir).unwrap();
    let mut file = (200u64 * 1024 * 1024).to_le_bytes().to_vec();
    file.extend_from_slice(b"{}");
    std::fs::write(dir.join("model.safetensors"), &file).unwrap();
    assert_eq!(
        fails(["inspect", s(&dir)]),
        format!(
            "error: opening checkpoint {}: st/model.safetensors: cannot decode safetensors header: header of 209715200 bytes exceeds the 104857600-byte cap\n",
            s(&dir)
        )
    );
}

#[test]
fn dcp_and_safetensors_load_through_s3() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("s3");
    std::fs::create_dir_all(&root).unwrap();
    let server = tessera_storage::testing::S3TestServer::start(&root);
    server.create_bucket("ckpts");
    let env = server.env();
    for fixture in ["c_w4_dp2_tp2", "f_hf_w1_full"] {
        copy_fixture(fixture, &root.join("ckpts"));
        let url = format!("s3://ckpts/{fixture}");
        let dir = fixtures().join(fixture);
        let dump = tmp.path().join(format!("dump-{fixture}"));
        let output = std::process::Command::new(support::BIN)
            .args([
                "load",
                &url,
                "--layout",
                s(&dir.join("layout_w2_shard1.json")),
                "--dump",
                s(&dump),
            ])
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .unwrap();
        assert!(
            output.status.success(),
            "{fixture}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        check_reference(&dump, &json(&dir.join("reference_w2_shard1.json")));
    }
}

#[test]
fn dcp_converts_to_native_and_loads_back_like_torch() {
    let dir = fixtures().join("c_w4_dp2_tp2");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("native/step-000003");
    let text = ok([
        "convert",
        s(&dir),
        "--layout",
        s(&dir.join("layout_w2_shard1.json")),
        "--out",
        s(&out),
    ])
    .text();
    assert!(text.contains("51 tensors"), "{text}");
    assert!(ok(["verify", s(&out)]).text().contains(": ok, 2 files"));
    // Non-tensor entries ride along as their torch.save blobs.
    let doc: Value = serde_json::from_slice(&ok(["inspect", s(&out), "--json"]).stdout).unwrap();
    assert_eq!(doc["manifest"]["objects"], 11);
    let dump = tmp.path().join("dump");
    ok([
        "load",
        s(&out),
        "--layout",
        s(&dir.join("layout_w3_shard0.json")),
        "--dump",
        s(&dump),
    ]);
    check_reference(&dump, &json(&dir.join("reference_w3_shard0.json")));
}

#[test]
fn plan_reads_each_dcp_byte_once() {
    let dir = fixtures().join("b_w4_fsdp_shard0");
    let text = ok([
        "plan",
        s(&dir),
        "--layout",
        s(&dir.join("layout_w3_shard0.json")),
    ])
    .text();
    assert!(text.contains("ranks                3\n"), "{text}");
    assert!(text.contains("read amplification   1.00\n"), "{text}");
    let rank: Value = serde_json::from_slice(
        &ok([
            "plan",
            s(&dir),
            "--layout",
            s(&dir.join("layout_w3_shard0.json")),
            "--rank",
            "2",
            "--format",
            "json",
        ])
        .stdout,
    )
    .unwrap();
    let files: Vec<&str> = rank["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert!(files.iter().all(|f| f.ends_with(".distcp")), "{files:?}");
}

#[test]
fn dcp_and_safetensors_checkpoints_are_served_planned_and_loaded_like_torch() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("catalog");
    let dcp = copy_fixture("c_w4_dp2_tp2", &root.join("fixtures"));
    let hf = copy_fixture("f_hf_w1_full", &root.join("fixtures"));
    let served = Served::start(&root);
    let catalog = served.get("/v1/checkpoints");
    let entries = catalog["checkpoints"].as_array().unwrap();
    let entry = |id: &str| {
        entries
            .iter()
            .find(|e| e["id"] == id)
            .unwrap_or_else(|| panic!("{id} not listed: {catalog}"))
    };
    assert_eq!(entry("fixtures/c_w4_dp2_tp2")["format"], "dcp");
    assert_eq!(entry("fixtures/c_w4_dp2_tp2")["committed"], true);
    assert_eq!(entry("fixtures/f_hf_w1_full")["format"], "safetensors");
    let summary = served.get("/v1/checkpoints/fixtures/c_w4_dp2_tp2");
    assert_eq!(
        summary["tensors"].as_u64(),
        Some(expected_shas("c_w4_dp2_tp2").len() as u64)
    );
    let tensors = served.get("/v1/checkpoints/fixtures/c_w4_dp2_tp2/tensors?limit=1000");
    assert_eq!(
        tensors["total"].as_u64(),
        Some(expected_shas("c_w4_dp2_tp2").len() as u64)
    );
    let server = format!("http://{}", served.addr);
    for (dir, layout) in [(&dcp, "w3_shard0"), (&hf, "w2_shard1")] {
        let dump = tmp.path().join(format!(
            "dump-{}-{layout}",
            dir.file_name().unwrap().to_str().unwrap()
        ));
        let report = ok([
            "load",
            s(dir),
            "--layout",
            s(&dir.join(format!("layout_{layout}.json"))),
            "--server",
            &server,
            "--dump",
            s(&dump),
        ])
        .text();
        assert!(report.contains("read amplification 1.00"), "{report}");
        check_reference(&dump, &json(&dir.join(format!("reference_{layout}.json"))));
    }
}

/// A one-rank DCP checkpoint torch 2.15 saved with DCP's ZStandard extension (every blob, tensors
/// and objects, one zstd stream): `tests/fixtures/dcp_zstd_w1`, written by its `make.py`.
fn zstd_fixture(into: &Path) -> PathBuf {
    let to = into.join("ckpt");
    support::copy_dir_writable(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/dcp_zstd_w1/ckpt"),
        &to,
    );
    to
}

/// The row-major bytes `make.py` saved for each tensor of the zstd fixture.
fn zstd_fixture_tensors() -> HashMap<&'static str, (Vec<u64>, Vec<u8>)> {
    let f32s = |v: Vec<f32>| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    // bfloat16 of small integers: the top half of their float32.
    let bf16s = |v: Vec<f32>| {
        v.iter()
            .flat_map(|x| ((x.to_bits() >> 16) as u16).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    let w = (0..64 * 32).map(|i| i as f32 * 0.25).collect();
    let e = (0..48).map(|i| i as f32 - 7.0).collect();
    // The transpose of a [16, 24] arange: element (r, c) is c * 24 + r.
    let t = (0..24)
        .flat_map(|r| (0..16).map(move |c| (c * 24 + r) as f32))
        .collect();
    HashMap::from([
        ("w", (vec![64, 32], f32s(w))),
        ("e", (vec![12, 4], bf16s(e))),
        ("t", (vec![24, 16], f32s(t))),
        ("zeros", (vec![256, 256], vec![0u8; 256 * 256 * 4])),
    ])
}

/// `verify` and `convert` read a compressed DCP checkpoint through its decoded bytes, as `load`
/// does: every storage's and object's zip CRC-32 checked over the decoded bytes, the conversions
/// give back what torch saved.
#[test]
fn zstd_dcp_checkpoints_verify_and_convert() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = zstd_fixture(tmp.path());
    let text = ok(["verify", s(&dir)]).text();
    assert!(
        text.contains(": ok, PyTorch DCP: metadata, 6 blob headers and byte ranges are consistent; 4 tensor storages and 2 objects match their zip CRC-32"),
        "{text}"
    );

    let expected = zstd_fixture_tensors();
    let hf = tmp.path().join("hf");
    ok([
        "convert",
        s(&dir),
        "--format",
        "safetensors",
        "--out",
        s(&hf),
    ]);
    let got = tensors_of(&hf.join("model-00001-of-00001.safetensors"));
    assert_eq!(got.len(), expected.len());
    for (fqn, (shape, bytes)) in &expected {
        assert_eq!(&got[*fqn].0, shape, "{fqn}");
        support::assert_same_bytes(&got[*fqn].1, bytes, fqn);
    }

    // A resharding conversion to native, verified, loaded back whole.
    let layout = tmp.path().join("layout.json");
    std::fs::write(
        &layout,
        r#"{"mesh": [{"name": "dp", "size": 2}], "rules": [{"match": "*", "placements": ["shard(0)"]}]}"#,
    )
    .unwrap();
    let native = tmp.path().join("native/step-000011");
    ok([
        "convert",
        s(&dir),
        "--layout",
        s(&layout),
        "--out",
        s(&native),
    ]);
    assert!(ok(["verify", s(&native)]).text().contains(": ok"));
    let back = tmp.path().join("back");
    ok([
        "convert",
        s(&native),
        "--format",
        "safetensors",
        "--out",
        s(&back),
    ]);
    let got = tensors_of(&back.join("model-00001-of-00001.safetensors"));
    for (fqn, (_, bytes)) in &expected {
        support::assert_same_bytes(&got[*fqn].1, bytes, fqn);
    }
}

/// `inspect --json` decodes a compressed DCP checkpoint's objects through their decoded bytes.
#[test]
fn inspect_json_decodes_zstd_dcp_objects() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = zstd_fixture(tmp.path());
    let doc: Value = serde_json::from_slice(&ok(["inspect", s(&dir), "--json"]).stdout).unwrap();
    let objects = doc["objects"].as_array().unwrap();
    let value = |key: &str| objects.iter().find(|o| o["key"] == key).unwrap()["value"].clone();
    assert_eq!(value("step"), 11);
    assert_eq!(value("lr"), 0.5);
    assert_eq!(doc["dcp"]["index"]["compressed_blobs"], 4, "{}", doc["dcp"]);
}

/// A byte flipped inside a compressed blob's stream is found by `verify` (and stops `convert`),
/// naming the real file, the blob's byte range in it and the tensor.
#[test]
fn a_flipped_byte_in_a_zstd_dcp_blob_fails_verification_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = zstd_fixture(tmp.path());
    // Tensor w's blob is bytes 914..6470 of __0_0.distcp (5556 compressed bytes of 8 KiB of
    // storage); its middle holds the storage's literals, past the zip headers.
    let distcp = dir.join("__0_0.distcp");
    let mut bytes = std::fs::read(&distcp).unwrap();
    bytes[914 + 2778] ^= 0x01;
    std::fs::write(&distcp, &bytes).unwrap();
    let blob = "bad blob in __0_0.distcp bytes 914..6470 (tensor w chunk [0..64, 0..32]): decoded from zstd: ";
    let err = support::fails_verifying(["verify", s(&dir)]);
    assert!(err.contains(blob), "{err}");
    let hf = tmp.path().join("hf");
    let err = support::fails_verifying([
        "convert",
        s(&dir),
        "--format",
        "safetensors",
        "--out",
        s(&hf),
    ]);
    assert!(
        err.contains("before converting it (nothing was written"),
        "{err}"
    );
    assert!(err.contains(blob), "{err}");
    assert!(!hf.join("model.safetensors.index.json").exists());
}
