//! DeepSpeed ZeRO checkpoints read in place through the real binary, against what DeepSpeed
//! itself gives: the ZeRO-2 save of `shared/fixtures/interop/deepspeed_0.19.8_zero2_w2` (opened
//! through its `latest`) loaded into every `reference_zero_to_fp32_out_<layout>.json` layout gives
//! every rank the bytes DeepSpeed's `get_fp32_state_dict_from_zero_checkpoint` gave it; `convert`
//! into native and into consolidated safetensors round-trips; `verify` checks every record's zip
//! CRC-32 and names the damaged file.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::path::{Path, PathBuf};

use serde_json::Value;
use support::reference::{
    check_reference_listed, interop_fixtures, json, sha256, tensors_of, write_layout_with_catch_all,
};
use support::{ok, s};

const LAYOUTS: [&str; 4] = ["w1_full", "w3_shard0", "w2_shard1", "w2x2_s0s1"];

fn fixture() -> PathBuf {
    interop_fixtures().join("deepspeed_0.19.8_zero2_w2")
}

#[test]
fn inspect_names_the_writer_and_follows_latest() {
    let ckpt = fixture().join("ckpt");
    let text = ok(["inspect", s(&ckpt)]).text();
    assert!(
        text.contains(": DeepSpeed ZeRO-2 (version 0.19.8), step 1, tag global_step1 (from latest), 2 data-parallel ranks, read in place"),
        "{text}"
    );
    assert!(
        text.contains("optimizer.state.l2.weight.exp_avg_sq"),
        "{text}"
    );
    let doc: Value = serde_json::from_slice(&ok(["inspect", s(&ckpt), "--json"]).stdout).unwrap();
    assert_eq!(doc["format"], "deepspeed");
    assert_eq!(doc["writer"], "DeepSpeed ZeRO-2 (version 0.19.8)");
    assert_eq!(doc["deepspeed"]["zero_stage"], 2);
    let objects = doc["objects"].as_array().unwrap();
    let config = objects.iter().find(|o| o["key"] == "ds_config").unwrap();
    assert_eq!(config["value"]["zero_optimization"]["stage"], 2);
    assert_eq!(config["file"], "global_step1/mp_rank_00_model_states.pt");
}

#[test]
fn every_layout_gives_every_rank_deepspeeds_bytes() {
    let dir = fixture();
    let tmp = tempfile::tempdir().unwrap();
    for layout in LAYOUTS {
        let reference = json(&dir.join(format!("reference_zero_to_fp32_out_{layout}.json")));
        let layout_path =
            write_layout_with_catch_all(&reference, &tmp.path().join(format!("{layout}.json")));
        let dump = tmp.path().join(layout);
        let report = ok([
            "load",
            s(&dir.join("ckpt")),
            "--layout",
            &layout_path,
            "--dump",
            s(&dump),
        ])
        .text();
        assert!(
            report.contains("read amplification 1.00"),
            "{layout}: {report}"
        );
        assert!(
            report.contains("format               DeepSpeed ZeRO"),
            "{report}"
        );
        check_reference_listed(&dump, &reference);
    }
}

#[test]
fn converts_to_safetensors_like_zero_to_fp32_and_to_native_and_back() {
    let dir = fixture();
    let tmp = tempfile::tempdir().unwrap();
    let expected = json(&dir.join("expected.json"));
    let zero_to_fp32 = json(&dir.join("zero_to_fp32_out/model.safetensors.index.json"));
    let check = |out: &Path| {
        let index = json(&out.join("model.safetensors.index.json"));
        for (fqn, want) in expected["tensors"].as_object().unwrap() {
            let file = index["weight_map"][fqn].as_str().unwrap();
            let got = tensors_of(&out.join(file));
            let theirs = tensors_of(
                &dir.join("zero_to_fp32_out")
                    .join(zero_to_fp32["weight_map"][fqn].as_str().unwrap()),
            );
            assert_eq!(
                sha256(&got[fqn].1),
                want["sha256"].as_str().unwrap(),
                "{fqn}"
            );
            assert!(
                got[fqn] == theirs[fqn],
                "{fqn}: differs from zero_to_fp32's"
            );
        }
    };
    let st = tmp.path().join("consolidated");
    ok([
        "convert",
        s(&dir.join("ckpt")),
        "--format",
        "safetensors",
        "--out",
        s(&st),
    ]);
    check(&st);

    // Into native (sharded over 2 ranks), verified, and back out to safetensors.
    let reference = json(&dir.join("reference_zero_to_fp32_out_w2_shard1.json"));
    let layout = write_layout_with_catch_all(&reference, &tmp.path().join("w2.json"));
    let native = tmp.path().join("native/step-000001");
    ok([
        "convert",
        s(&dir.join("ckpt")),
        "--layout",
        &layout,
        "--out",
        s(&native),
    ]);
    assert!(ok(["verify", s(&native)]).text().contains(": ok, "));
    let back = tmp.path().join("back");
    ok([
        "convert",
        s(&native),
        "--format",
        "safetensors",
        "--out",
        s(&back),
    ]);
    check(&back);
    // The objects ride along.
    let doc: Value = serde_json::from_slice(&ok(["inspect", s(&native), "--json"]).stdout).unwrap();
    assert_eq!(doc["manifest"]["objects"], 15);
}

#[test]
fn verify_checks_every_record_and_names_a_damaged_file() {
    let dir = fixture();
    let text = ok(["verify", s(&dir.join("ckpt"))]).text();
    assert!(
        text.contains(": ok, DeepSpeed ZeRO: 3 torch.save files parse and their layout is consistent; 12 records (storages and pickles) match their zip CRC-32"),
        "{text}"
    );
    // A copy with one flipped byte inside rank 1's flat fp32 partition: opening still works (the
    // structure is intact), verify names the file and the record.
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = tmp.path().join("ckpt");
    std::fs::create_dir_all(ckpt.join("global_step1")).unwrap();
    std::fs::write(ckpt.join("latest"), "global_step1").unwrap();
    for entry in std::fs::read_dir(dir.join("ckpt/global_step1")).unwrap() {
        let entry = entry.unwrap();
        let mut bytes = std::fs::read(entry.path()).unwrap();
        if entry.file_name() == "zero_pp_rank_1_mp_rank_00_optim_states.pt" {
            bytes[150_000] ^= 0x40;
        }
        std::fs::write(ckpt.join("global_step1").join(entry.file_name()), bytes).unwrap();
    }
    let err = support::fails_verifying(["verify", s(&ckpt)]);
    assert!(
        err.contains("bad record in global_step1/zero_pp_rank_1_mp_rank_00_optim_states.pt bytes 135104..201344 (zero_pp_rank_1_mp_rank_00_optim_states/data/3): crc32 "),
        "{err}"
    );
    assert!(err.contains("verification failed"), "{err}");
}
