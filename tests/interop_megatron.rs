//! Megatron-Core torch_dist checkpoints (written by megatron-core 0.15.3 with flattened_range
//! optimizer states, and by 0.19.2) loaded in place through the real binary, against what
//! Megatron's own resharded `dist_checkpointing.load` gave every rank: for every
//! `reference_<layout>.json` next to the fixtures, `tessera load --layout (from the reference)
//! --dump` gives every rank the reference's bytes, also over TCP ranks; `convert` into
//! safetensors gives every full tensor the sha256 of `expected.json` (Megatron's original
//! shapes), and `convert` into native loads back to the same bytes.
//!
//! `reference_torchdcp_raw_*` is torch's raw `dcp.load` of the same files: for 0.19 it equals
//! Megatron's view and is checked like the others; for 0.15 it is in the reformulated (stored)
//! shapes, which tessera does not expose, so it is only checked to differ from Megatron's view
//! in exactly the reformulated tensors.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use serde_json::Value;
use support::reference::{
    Tensors, check_reference, interop_fixtures, json, sha256, tensors_of, write_layout,
};
use support::{ok, s};

const FLAT_015: &str = "megatron_core_0.15.3_tp2dp2_flat";
const PLAIN_019: &str = "megatron_core_0.19.2_tp2dp2";

fn fixture(name: &str) -> PathBuf {
    interop_fixtures().join(name)
}

/// The `reference_<layout>.json` files of a fixture that are Megatron's own view, by layout.
fn megatron_references(dir: &Path) -> Vec<(String, PathBuf)> {
    let mut out: Vec<(String, PathBuf)> = std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| {
            let name = e.unwrap().file_name().into_string().unwrap();
            let layout = name.strip_prefix("reference_")?.strip_suffix(".json")?;
            (!layout.starts_with("torchdcp_raw_")).then(|| (layout.to_string(), dir.join(&name)))
        })
        .collect();
    out.sort();
    out
}

/// Full-tensor shape and sha256 by name from `expected.json`.
fn expected_shas(dir: &Path) -> HashMap<String, (Vec<u64>, String)> {
    json(&dir.join("expected.json"))["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, e)| {
            let shape: Vec<u64> = serde_json::from_value(e["shape"].clone()).unwrap();
            (
                k.clone(),
                (shape, e["sha256"].as_str().unwrap().to_string()),
            )
        })
        .collect()
}

/// Loads `ckpt` into the layout of `reference` and checks every rank's bytes.
fn load_like_megatron(ckpt: &Path, reference: &Path, tmp: &Path, extra: &[&str]) -> String {
    let reference = json(reference);
    let name = reference["layout"].as_str().unwrap().to_string();
    let layout = write_layout(&reference, &tmp.join(format!("layout_{name}.json")));
    let dump = tmp.join(format!("dump_{name}"));
    let mut args = vec!["load", s(ckpt), "--layout", &layout, "--dump", s(&dump)];
    args.extend_from_slice(extra);
    let report = ok(args).text();
    assert!(report.contains("read amplification 1.00"), "{report}");
    check_reference(&dump, &reference);
    report
}

fn loads_every_reference(name: &str) {
    let dir = fixture(name);
    let references = megatron_references(&dir);
    assert_eq!(
        references
            .iter()
            .map(|(l, _)| l.as_str())
            .collect::<Vec<_>>(),
        ["tp4", "w1_full", "w2x2_s0s1", "w3_shard0"],
        "{name}: the references this test knows"
    );
    let tmp = tempfile::tempdir().unwrap();
    for (_, reference) in references {
        load_like_megatron(&dir.join("ckpt"), &reference, tmp.path(), &[]);
    }
}

#[test]
fn megatron_0_15_flattened_states_load_like_megatron_into_every_reference_layout() {
    loads_every_reference(FLAT_015);
}

#[test]
fn megatron_0_19_loads_like_megatron_into_every_reference_layout() {
    loads_every_reference(PLAIN_019);
}

#[test]
fn megatron_0_19_loads_like_torch_raw_dcp_too() {
    // Without reformulated tensors, torch's raw view is Megatron's.
    let dir = fixture(PLAIN_019);
    let tmp = tempfile::tempdir().unwrap();
    load_like_megatron(
        &dir.join("ckpt"),
        &dir.join("reference_torchdcp_raw_w2x2_s0s1.json"),
        tmp.path(),
        &[],
    );
}

#[test]
fn megatron_0_15_raw_dcp_reference_differs_exactly_in_the_reformulated_tensors() {
    let dir = fixture(FLAT_015);
    let doc: Value =
        serde_json::from_slice(&ok(["inspect", s(&dir.join("ckpt")), "--json"]).stdout).unwrap();
    let reformulated: BTreeSet<String> =
        serde_json::from_value(doc["megatron"]["reformulated"].clone()).unwrap();
    let ours: HashMap<String, Value> = doc["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| (t["fqn"].as_str().unwrap().to_string(), t["shape"].clone()))
        .collect();
    let raw = json(&dir.join("reference_torchdcp_raw_w2x2_s0s1.json"));
    let differing: BTreeSet<String> = raw["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(fqn, t)| ours[fqn.as_str()] != t["global_shape"])
        .map(|(fqn, _)| fqn.clone())
        .collect();
    assert_eq!(reformulated.len(), 30);
    assert_eq!(differing, reformulated);
    let megatron = json(&dir.join("reference_w2x2_s0s1.json"));
    for fqn in &reformulated {
        assert_eq!(
            ours[fqn.as_str()],
            megatron["tensors"][fqn]["global_shape"],
            "{fqn}"
        );
    }
}

#[test]
fn megatron_0_15_loads_over_tcp_ranks() {
    let dir = fixture(FLAT_015);
    let tmp = tempfile::tempdir().unwrap();
    let report = load_like_megatron(
        &dir.join("ckpt"),
        &dir.join("reference_w2x2_s0s1.json"),
        tmp.path(),
        &["--transport", "tcp"],
    );
    assert!(report.contains("zip headers "), "{report}");
}

#[test]
fn inspect_says_megatron_and_decodes_the_common_state() {
    for (name, writer, common, objects) in [
        (
            FLAT_015,
            "Megatron-Core torch_dist (version backend v1, MCoreMetadata, common.pt: megatron-core 0.15)",
            "common.pt",
            9,
        ),
        (
            PLAIN_019,
            "Megatron-Core torch_dist (version backend v1, common_state in DCP: megatron-core ≥0.19)",
            "common_state/shard_0_1",
            9,
        ),
    ] {
        let ckpt = fixture(name).join("ckpt");
        let text = ok(["inspect", s(&ckpt)]).text();
        assert!(text.contains(&format!("written by {writer}")), "{text}");
        let doc: Value =
            serde_json::from_slice(&ok(["inspect", s(&ckpt), "--json"]).stdout).unwrap();
        assert_eq!(doc["writer"], writer);
        let objects_json = doc["objects"].as_array().unwrap();
        assert_eq!(objects_json.len(), objects, "{name}");
        let entry = objects_json.iter().find(|o| o["key"] == common).unwrap();
        // 0.19 pickles the common state as a one-element list.
        let value = match entry["value"].as_array() {
            Some(list) => list[0].clone(),
            None => entry["value"].clone(),
        };
        assert_eq!(value["iteration"], 100, "{name}: {entry}");
        assert_eq!(value["checkpoint_version"], 3.0, "{name}");
        // What has no JSON form is listed with its byte range.
        let rng = objects_json
            .iter()
            .find(|o| o["key"].as_str().unwrap().starts_with("rng_state/"))
            .unwrap();
        assert!(
            rng["value_error"].as_str().unwrap().contains("tensor"),
            "{rng}"
        );
        assert!(rng["byte_length"].as_u64().unwrap() > 0);
    }
}

#[test]
fn verify_checks_the_megatron_blobs_and_common_pt() {
    let ckpt = fixture(FLAT_015).join("ckpt");
    let text = ok(["verify", s(&ckpt)]).text();
    assert!(text.contains("ok"), "{text}");
    // A flipped byte inside common.pt's pickle fails its zip CRC-32, naming the object.
    let tmp = tempfile::tempdir().unwrap();
    let copy = tmp.path().join("ckpt");
    std::fs::create_dir_all(&copy).unwrap();
    for entry in std::fs::read_dir(&ckpt).unwrap() {
        let entry = entry.unwrap();
        std::fs::write(
            copy.join(entry.file_name()),
            std::fs::read(entry.path()).unwrap(),
        )
        .unwrap();
    }
    let mut common = std::fs::read(copy.join("common.pt")).unwrap();
    let at = common.windows(9).position(|w| w == b"iteration").unwrap();
    common[at] ^= 0x20;
    std::fs::write(copy.join("common.pt"), common).unwrap();
    let run = support::run_in(None, ["verify", s(&copy)]);
    assert_ne!(run.code, Some(0), "{}", run.text());
    let all = format!("{}{}", run.text(), run.stderr);
    assert!(all.contains("common.pt"), "{all}");
}

fn converts_to_safetensors_like_megatron(name: &str) {
    let dir = fixture(name);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("consolidated");
    ok([
        "convert",
        s(&dir.join("ckpt")),
        "--format",
        "safetensors",
        "--out",
        s(&out),
    ]);
    let index = json(&out.join("model.safetensors.index.json"));
    let expected = expected_shas(&dir);
    let weight_map = index["weight_map"].as_object().unwrap();
    assert_eq!(weight_map.len(), expected.len(), "{name}");
    let mut files: HashMap<String, Tensors> = HashMap::new();
    for (fqn, (shape, sha)) in &expected {
        let file = weight_map[fqn].as_str().unwrap();
        let tensors = files
            .entry(file.to_string())
            .or_insert_with(|| tensors_of(&out.join(file)));
        assert_eq!(&tensors[fqn].0, shape, "{name} {fqn}: shape");
        assert_eq!(&sha256(&tensors[fqn].1), sha, "{name} {fqn}: full tensor");
    }
}

#[test]
fn megatron_0_15_converts_to_safetensors_in_original_shapes() {
    converts_to_safetensors_like_megatron(FLAT_015);
}

#[test]
fn megatron_0_19_converts_to_safetensors() {
    converts_to_safetensors_like_megatron(PLAIN_019);
}

#[test]
fn megatron_converts_to_native_and_loads_back_like_megatron() {
    for name in [FLAT_015, PLAIN_019] {
        let dir = fixture(name);
        let tmp = tempfile::tempdir().unwrap();
        let tp4 = json(&dir.join("reference_tp4.json"));
        let layout = write_layout(&tp4, &tmp.path().join("layout_tp4.json"));
        let out = tmp.path().join("native/step-000100");
        ok([
            "convert",
            s(&dir.join("ckpt")),
            "--layout",
            &layout,
            "--out",
            s(&out),
        ]);
        assert!(ok(["verify", s(&out)]).text().contains(": ok"));
        // The objects (common.pt included) ride along as their torch.save blobs.
        let doc: Value =
            serde_json::from_slice(&ok(["inspect", s(&out), "--json"]).stdout).unwrap();
        assert_eq!(doc["manifest"]["objects"], 9, "{name}");
        for layout in ["w3_shard0", "w2x2_s0s1"] {
            load_like_megatron(
                &out,
                &dir.join(format!("reference_{layout}.json")),
                tmp.path(),
                &[],
            );
        }
    }
}
