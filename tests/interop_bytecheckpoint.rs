//! A ByteCheckpoint 0.0.2 FSDP save (shared/fixtures/interop) loaded in place through the real
//! binary, against what ByteCheckpoint's own resharded load gave every rank: `ckpt/model` and
//! `ckpt/optimizer` into every `reference_{model,optimizer}_<layout>.json` layout, the save's root
//! as one checkpoint (names `model.*`, `optimizer.*`), `convert` into native and into safetensors
//! byte for byte, and `verify` on the save and on damaged copies.
//!
//! The fixture's optimizer references (and expected.json) give every Adam first moment
//! (`*.exp_avg`) the bytes of its `exp_avg_sq`: the generator's FULL_STATE_DICT optimizer gather
//! aliased them. For those tensors the truth is the saved chunk bytes as Python's decoding of the
//! metadata (`metadata_dump_optimizer.txt`, byte ranges verified with torch) locates them, sliced
//! per rank by the reference's boxes, wherever a reference shows the flaw (a corrected fixture is
//! taken as it is).
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use support::reference::{
    Tensors, check_reference, interop_fixtures, json as read_json, sha256, tensors_of, write_layout,
};
use support::{ok, s};

const FIXTURE: &str = "bytecheckpoint_0.0.2_torch2.5.0_fsdp_w2";
const LAYOUTS: [&str; 4] = ["w1_full", "w3_shard0", "w2_shard1", "w2x2_s0s1"];

fn fixture() -> PathBuf {
    interop_fixtures().join(FIXTURE)
}

/// Full tensors of a component as Python's dump of its `.metadata` locates them (chunks of one
/// tensor split dim 0 only in this fixture, so they concatenate in dim-0 order).
fn dumped_full_tensors(component: &str) -> HashMap<String, Vec<u8>> {
    let dir = fixture();
    let dump = std::fs::read_to_string(dir.join(format!("metadata_dump_{component}.txt"))).unwrap();
    let mut chunks: HashMap<String, Vec<(u64, Vec<u8>)>> = HashMap::new();
    for line in dump.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix("MetadataIndex(fqn='") else {
            continue;
        };
        if !line.contains("-> _StorageInfo") || line.contains("offset=None") {
            continue;
        }
        let fqn = &rest[..rest.find('\'').unwrap()];
        let dims = &line[line.find("Size([").unwrap() + 6..line.find("])").unwrap()];
        let dims: Vec<u64> = dims
            .split(", ")
            .filter(|d| !d.is_empty())
            .map(|d| d.parse().unwrap())
            .collect();
        assert!(dims.iter().skip(1).all(|&d| d == 0), "{line}");
        let field = |name: &str| {
            let at = line.rfind(name).unwrap() + name.len();
            line[at..]
                .split([',', ')', '\''])
                .next()
                .unwrap()
                .to_string()
        };
        let offset: usize = field(", offset=").parse().unwrap();
        let length: usize = field("length=").parse().unwrap();
        let bytes = std::fs::read(
            dir.join("ckpt")
                .join(component)
                .join(field("relative_path='")),
        )
        .unwrap();
        chunks.entry(fqn.to_string()).or_default().push((
            dims.first().copied().unwrap_or(0),
            bytes[offset..offset + length].to_vec(),
        ));
    }
    chunks
        .into_iter()
        .map(|(fqn, mut parts)| {
            parts.sort_by_key(|(at, _)| *at);
            (fqn, parts.into_iter().flat_map(|(_, b)| b).collect())
        })
        .collect()
}

/// The row-major bytes of the box (`offsets`, `lengths`) of a full f32 tensor of `shape`.
fn slice(full: &[u8], shape: &[u64], offsets: &[u64], lengths: &[u64]) -> Vec<u8> {
    let strides = tessera_metadata::row_major_strides(shape);
    let n: u64 = lengths.iter().product();
    let mut out = Vec::new();
    let mut idx = vec![0u64; lengths.len()];
    for _ in 0..n {
        let at: u64 = idx
            .iter()
            .zip(offsets)
            .zip(&strides)
            .map(|((i, o), s)| (i + o) * s)
            .sum();
        out.extend_from_slice(&full[at as usize * 4..at as usize * 4 + 4]);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < lengths[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// `reference_<component>_<layout>.json` with the `*.exp_avg` entries' per-rank sha256 taken from
/// the saved bytes where the fixture has the flaw (see the module docs).
fn reference(component: &str, layout: &str) -> Value {
    let mut reference = read_json(&fixture().join(format!("reference_{component}_{layout}.json")));
    if component != "optimizer" {
        return reference;
    }
    let truth = dumped_full_tensors(component);
    let tensors = reference["tensors"].as_object_mut().unwrap();
    let names: Vec<String> = tensors
        .keys()
        .filter(|k| k.ends_with(".exp_avg"))
        .cloned()
        .collect();
    assert!(!names.is_empty());
    for name in names {
        let sq = tensors[&format!("{name}_sq")]["full_sha256"].clone();
        let entry = tensors.get_mut(&name).unwrap();
        if entry["full_sha256"] != sq {
            // A corrected fixture: its reference is the truth.
            continue;
        }
        let full = &truth[&name];
        assert_ne!(json!(sha256(full)), sq);
        entry["full_sha256"] = json!(sha256(full));
        let shape: Vec<u64> = serde_json::from_value(entry["global_shape"].clone()).unwrap();
        for rank in entry["ranks"].as_array_mut().unwrap() {
            let offsets: Vec<u64> = serde_json::from_value(rank["global_offset"].clone()).unwrap();
            let lengths: Vec<u64> = serde_json::from_value(rank["local_shape"].clone()).unwrap();
            rank["sha256"] = json!(sha256(&slice(full, &shape, &offsets, &lengths)));
        }
    }
    reference
}

fn load_and_check(checkpoint: &Path, reference: &Value, tmp: &Path, name: &str) {
    let layout = write_layout(reference, &tmp.join(format!("{name}.layout.json")));
    let dump = tmp.join(name);
    let report = ok([
        "load",
        s(checkpoint),
        "--layout",
        layout.as_str(),
        "--dump",
        s(&dump),
    ])
    .text();
    assert!(report.contains("read amplification 1.00"), "{report}");
    assert!(
        report.contains("ByteCheckpoint, read in place without verification"),
        "{report}"
    );
    check_reference(&dump, reference);
}

#[test]
fn each_component_loads_into_every_reference_layout_like_bytecheckpoint() {
    let ckpt = fixture().join("ckpt");
    let tmp = tempfile::tempdir().unwrap();
    for component in ["model", "optimizer"] {
        for layout in LAYOUTS {
            load_and_check(
                &ckpt.join(component),
                &reference(component, layout),
                tmp.path(),
                &format!("{component}-{layout}"),
            );
        }
    }
}

#[test]
fn the_root_loads_as_one_checkpoint_with_namespaced_names() {
    let ckpt = fixture().join("ckpt");
    let tmp = tempfile::tempdir().unwrap();
    for layout in ["w3_shard0", "w2x2_s0s1"] {
        // One reference for both components, names prefixed as the root exposes them.
        let mut combined = reference("model", layout);
        let mut tensors = serde_json::Map::new();
        for component in ["model", "optimizer"] {
            for (fqn, tensor) in reference(component, layout)["tensors"].as_object().unwrap() {
                tensors.insert(format!("{component}.{fqn}"), tensor.clone());
            }
        }
        combined["tensors"] = Value::Object(tensors);
        load_and_check(&ckpt, &combined, tmp.path(), &format!("root-{layout}"));
    }
    let inspect = ok(["inspect", s(&ckpt)]).text();
    assert!(
        inspect.contains("ByteCheckpoint (version 0.0.2)")
            && inspect.contains("(model, optimizer, extra_state)")
            && inspect.contains("optimizer.state.l1.weight.exp_avg_sq"),
        "{inspect}"
    );
    let doc: Value = serde_json::from_str(&ok(["inspect", "--json", s(&ckpt)]).text()).unwrap();
    assert_eq!(doc["format"], "bytecheckpoint");
    assert_eq!(doc["writer"], "ByteCheckpoint (version 0.0.2)");
    let objects = doc["objects"].as_array().unwrap();
    let rank1 = objects
        .iter()
        .find(|o| o["key"] == "extra_state.rank_1")
        .unwrap();
    assert_eq!(rank1["value"], json!({"step": 1, "rank": 1}), "{rank1}");
    let groups = objects
        .iter()
        .find(|o| o["key"] == "optimizer.param_groups")
        .unwrap();
    assert_eq!(groups["value"][0]["lr"], json!(0.01), "{groups}");
}

/// Every full tensor of a consolidated safetensors export at `out`, by name.
fn consolidated(out: &Path) -> Tensors {
    let index = read_json(&out.join("model.safetensors.index.json"));
    let mut all = Tensors::new();
    let files: std::collections::BTreeSet<&str> = index["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|v| v.as_str().unwrap())
        .collect();
    for file in files {
        all.extend(tensors_of(&out.join(file)));
    }
    all
}

/// What every full tensor must be: expected.json, with the `*.exp_avg` truth from the saved bytes.
fn expected_full() -> HashMap<String, (Vec<u64>, String)> {
    let expected = read_json(&fixture().join("expected.json"));
    let truth = dumped_full_tensors("optimizer");
    expected["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(name, entry)| {
            let shape: Vec<u64> = serde_json::from_value(entry["shape"].clone()).unwrap();
            let sha = match name.strip_prefix("optimizer.") {
                Some(fqn) if fqn.ends_with(".exp_avg") => sha256(&truth[fqn]),
                _ => entry["sha256"].as_str().unwrap().to_string(),
            };
            (name.clone(), (shape, sha))
        })
        .collect()
}

fn check_full(got: &Tensors) {
    let expected = expected_full();
    assert_eq!(got.len(), expected.len(), "tensor count");
    for (name, (shape, sha)) in &expected {
        let (got_shape, bytes) = got
            .get(name)
            .unwrap_or_else(|| panic!("{name} missing from the export"));
        assert_eq!(got_shape, shape, "{name}: shape");
        assert_eq!(&sha256(bytes), sha, "{name}: full tensor bytes");
    }
}

#[test]
fn convert_into_safetensors_and_native_round_trips_byte_for_byte() {
    let ckpt = fixture().join("ckpt");
    let tmp = tempfile::tempdir().unwrap();
    let direct = tmp.path().join("direct");
    ok([
        "convert",
        s(&ckpt),
        "--format",
        "safetensors",
        "--out",
        s(&direct),
    ]);
    check_full(&consolidated(&direct));

    // Into native, resharded over 3 ranks, then out again: the same bytes.
    let mut combined = reference("model", "w3_shard0");
    let mut tensors = serde_json::Map::new();
    for component in ["model", "optimizer"] {
        for (fqn, tensor) in reference(component, "w3_shard0")["tensors"]
            .as_object()
            .unwrap()
        {
            tensors.insert(format!("{component}.{fqn}"), tensor.clone());
        }
    }
    combined["tensors"] = Value::Object(tensors);
    let layout = write_layout(&combined, &tmp.path().join("w3.json"));
    let native = tmp.path().join("native");
    ok([
        "convert",
        s(&ckpt),
        "--layout",
        layout.as_str(),
        "--out",
        s(&native),
    ]);
    ok(["verify", s(&native)]);
    let back = tmp.path().join("back");
    ok([
        "convert",
        s(&native),
        "--format",
        "safetensors",
        "--out",
        s(&back),
    ]);
    check_full(&consolidated(&back));
}

/// Copies the fixture's `ckpt/` to `into/ckpt` (writable).
fn copy_ckpt(into: &Path) -> PathBuf {
    let to = into.join("ckpt");
    support::copy_dir_writable(&fixture().join("ckpt"), &to);
    to
}

#[test]
fn verify_passes_on_the_save_and_names_the_file_of_a_damaged_copy() {
    let ckpt = fixture().join("ckpt");
    let text = ok(["verify", s(&ckpt)]).text();
    assert!(
        text.contains("ok, ByteCheckpoint")
            && text.contains("56 rebuild descriptors")
            && text.contains("3 torch.save objects match their zip CRC-32"),
        "{text}"
    );

    // A flipped byte inside extra_state's pickle: its zip CRC-32 no longer matches.
    let tmp = tempfile::tempdir().unwrap();
    let copy = copy_ckpt(tmp.path());
    let file = copy.join("extra_state/extra_state_rank_1.pt");
    let mut bytes = std::fs::read(&file).unwrap();
    let at = bytes.windows(4).position(|w| w == b"rank").unwrap();
    bytes[at] = b'R';
    std::fs::write(&file, bytes).unwrap();
    let err = support::fails_verifying(["verify", s(&copy)]);
    assert!(
        err.contains("extra_state/extra_state_rank_1.pt")
            && err.contains("object extra_state.rank_1")
            && err.contains("verification failed"),
        "{err}"
    );

    // A truncated optimizer data file: refused at open, naming the file and the tensor.
    let copy = copy_ckpt(&tmp.path().join("second"));
    let data = copy.join("optimizer/__1_0.distcp");
    let bytes = std::fs::read(&data).unwrap();
    std::fs::write(&data, &bytes[..bytes.len() - 4]).unwrap();
    let err = support::fails_verifying(["verify", s(&copy)]);
    assert!(
        err.contains("optimizer/__1_0.distcp") && err.contains("tensor optimizer.state."),
        "{err}"
    );
}
