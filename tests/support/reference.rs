//! Checking loads against what another tool's own resharded load gave every rank: the
//! `reference_<layout>.json` files next to the fixtures (mesh, per-tensor placements, sha256 of
//! every rank's local tensor), the `--dump` safetensors files a load writes, and a tessera layout
//! made from a reference's mesh and placements.
#![allow(clippy::unwrap_used)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tessera_metadata::formats::safetensors;

use super::s;

/// The checkpoints other training stacks wrote (`shared/fixtures/interop` next to the
/// workspace, or `$TESSERA_INTEROP_FIXTURES`).
pub fn interop_fixtures() -> PathBuf {
    let dir = std::env::var_os("TESSERA_INTEROP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/interop")
        });
    assert!(
        dir.join("README.md").exists(),
        "interop fixtures not found at {} (set TESSERA_INTEROP_FIXTURES)",
        dir.display()
    );
    dir
}

/// A tessera layout (mesh and one exact-name rule per tensor) that gives every rank the box the
/// reference's mesh and placements give it: `Shard(dim=d)` is `shard(d)`, `Replicate()` is
/// `replicate`. Names are matched literally: none of the references' names holds `*` or `?`.
pub fn layout_from_reference(reference: &Value) -> Value {
    let mesh = &reference["mesh"];
    let names = mesh["dim_names"].as_array().unwrap();
    let sizes = mesh["shape"].as_array().unwrap();
    let mesh: Vec<Value> = names
        .iter()
        .zip(sizes)
        .map(|(name, size)| json!({"name": name, "size": size}))
        .collect();
    let rules: Vec<Value> = reference["tensors"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(fqn, tensor)| {
            assert!(!fqn.contains(['*', '?']), "{fqn}: a glob character");
            let placements: Vec<String> = tensor["placements"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| placement(p.as_str().unwrap()))
                .collect();
            json!({"match": fqn, "placements": placements})
        })
        .collect();
    json!({"mesh": mesh, "rules": rules})
}

fn placement(reference: &str) -> String {
    if reference == "Replicate()" {
        return "replicate".to_string();
    }
    let dim = reference
        .strip_prefix("Shard(dim=")
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("placement {reference} has no tessera equivalent here"));
    format!("shard({dim})")
}

/// Writes [`layout_from_reference`] of `reference` plus a last catch-all rule replicating every
/// tensor the reference does not list, for checkpoints a reader exposes more of than the other
/// tool's loader returns; returns the path as a string.
pub fn write_layout_with_catch_all(reference: &Value, path: &Path) -> String {
    let mut layout = layout_from_reference(reference);
    let dims = layout["mesh"].as_array().unwrap().len();
    layout["rules"]
        .as_array_mut()
        .unwrap()
        .push(json!({"match": "*", "placements": vec!["replicate"; dims]}));
    std::fs::write(path, serde_json::to_vec_pretty(&layout).unwrap()).unwrap();
    s(path).to_string()
}

/// Writes [`layout_from_reference`] of `reference` to `path` and returns the path as a string.
pub fn write_layout(reference: &Value, path: &Path) -> String {
    std::fs::write(
        path,
        serde_json::to_vec_pretty(&layout_from_reference(reference)).unwrap(),
    )
    .unwrap();
    s(path).to_string()
}

pub fn json(path: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

pub fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Tensors by name: (shape, bytes).
pub type Tensors = HashMap<String, (Vec<u64>, Vec<u8>)>;

/// Every tensor of a safetensors file.
pub fn tensors_of(path: &Path) -> Tensors {
    let file = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let header = safetensors::parse(&file, s(path)).unwrap();
    header
        .tensors
        .iter()
        .map(|t| {
            let (a, b) = t.data_offsets;
            let bytes =
                file[(header.data_start + a) as usize..(header.data_start + b) as usize].to_vec();
            (t.name.clone(), (t.shape.clone(), bytes))
        })
        .collect()
}

/// Checks every rank's dump against the reference: each rank holds exactly the reference's
/// tensors, with its local shape and sha256.
pub fn check_reference(dump: &Path, reference: &Value) {
    check_ranks(dump, reference, true);
}

/// Like [`check_reference`], but a rank may hold more tensors than the reference lists (a
/// reader that exposes more of a checkpoint than the other tool's loader returns).
pub fn check_reference_listed(dump: &Path, reference: &Value) {
    check_ranks(dump, reference, false);
}

fn check_ranks(dump: &Path, reference: &Value, exactly: bool) {
    let world = reference["world_size"].as_u64().unwrap();
    let tensors = reference["tensors"].as_object().unwrap();
    for rank in 0..world {
        let got = tensors_of(&dump.join(format!("rank-{rank}.safetensors")));
        if exactly {
            assert_eq!(got.len(), tensors.len(), "rank {rank}: tensor count");
        }
        for (fqn, tensor) in tensors {
            let local = tensor["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["rank"] == rank)
                .unwrap();
            let (shape, bytes) = got
                .get(fqn)
                .unwrap_or_else(|| panic!("rank {rank} has no {fqn}"));
            let want: Vec<u64> = serde_json::from_value(local["local_shape"].clone()).unwrap();
            assert_eq!(shape, &want, "rank {rank} {fqn}: shape");
            assert_eq!(
                sha256(bytes),
                local["sha256"].as_str().unwrap(),
                "rank {rank} {fqn}: bytes differ from the reference's"
            );
        }
    }
}
