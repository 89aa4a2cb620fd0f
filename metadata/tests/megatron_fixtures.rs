//! Megatron-Core torch_dist checkpoints read by the metadata crate: the two fixtures written by
//! megatron-core 0.15.3 (MCoreMetadata, flattened_range optimizer states, common.pt) and 0.19.2
//! (common state as a DCP bytes entry), every tensor in Megatron's original shape with the bytes
//! of `expected.json`; and hand-made `.metadata` files around real 0.15 blobs for every place
//! `mcore_data` can be (on the Metadata as 0.8–0.14 set it, on MCoreMetadata, on the save plans
//! only) and for what must be refused (shapes and chunks off the reformulation rule, malformed
//! `mcore_data`), each error naming the file and the tensor.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::path::{Path, PathBuf};

use dcp_support::{
    MetadataStyle, PickleWriter, TensorSpec, dcp_metadata, open, read_tensor, sha256,
};
use tessera_metadata::formats::dcp::{decode_object, megatron};
use tessera_metadata::{Format, MetadataError};

const FLAT_015: &str = "megatron_core_0.15.3_tp2dp2_flat";
const PLAIN_019: &str = "megatron_core_0.19.2_tp2dp2";
const M: &str = "torch.distributed.checkpoint.metadata";
const MCORE: &str = "megatron.core.dist_checkpointing.strategies.torch";
const EMBED_AVG: &str = "optimizer.state.exp_avg.embedding.word_embeddings.weight";

fn interop() -> PathBuf {
    let dir = std::env::var_os("TESSERA_INTEROP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/interop")
        });
    assert!(
        dir.join("README.md").exists(),
        "interop fixtures not found at {} (set TESSERA_INTEROP_FIXTURES)",
        dir.display()
    );
    dir
}

fn expected(fixture: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(interop().join(fixture).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Every tensor of `expected.json` has its shape, dtype and full bytes.
fn matches_expected(fixture: &str) -> tessera_metadata::OpenedCheckpoint {
    let dir = interop().join(fixture).join("ckpt");
    let opened = open(&dir).unwrap();
    assert_eq!(opened.format, Format::Dcp);
    let expected = expected(fixture);
    let tensors = expected["tensors"].as_object().unwrap();
    let meta = &opened.meta;
    assert_eq!(meta.tensors().len(), tensors.len(), "{fixture}");
    for (fqn, e) in tensors {
        let t = meta.tensor_index(fqn).unwrap();
        let tensor = &meta.tensors()[t as usize];
        let shape: Vec<u64> = serde_json::from_value(e["shape"].clone()).unwrap();
        assert_eq!(tensor.shape, shape, "{fixture} {fqn}");
        assert_eq!(
            tensor.dtype.to_string(),
            match e["dtype"].as_str().unwrap() {
                "float32" => "f32",
                "bfloat16" => "bf16",
                "float16" => "f16",
                other => other,
            },
            "{fixture} {fqn}"
        );
        assert_eq!(
            sha256(&read_tensor(&dir, meta, t)),
            e["sha256"].as_str().unwrap(),
            "{fixture} {fqn}: full tensor"
        );
    }
    opened
}

#[test]
fn megatron_0_15_tensors_in_original_shapes_with_their_bytes() {
    let opened = matches_expected(FLAT_015);
    let meta = &opened.meta;
    // [2, 192, 64] qkv state: 8 stored chunks (2 layers × 2 TP × 2 DP), each a flat range of a
    // [1, 96, 64] TP-local box tiled into at most 2·3−1 boxes.
    let t = meta
        .tensor_index("optimizer.state.exp_avg.decoder.layers.self_attention.linear_qkv.weight")
        .unwrap();
    let chunks = meta.chunks_of(t);
    // Megatron splits each box at a row here ([0, 1984) and [1984, 6144) of 96×64 or so), so
    // each flat range is one box.
    assert_eq!(chunks.len(), 8);
    assert_eq!(
        chunks.iter().map(|c| c.region.numel()).sum::<u64>(),
        2 * 192 * 64
    );
    for c in chunks {
        // Inside one layer and one TP half.
        assert_eq!(c.region.lengths[0], 1, "{}", c.region);
        assert_eq!(
            c.region.offsets[1] / 96,
            (c.region.end(1) - 1) / 96,
            "{}",
            c.region
        );
        assert_eq!(c.bytes.strides, None);
    }
    let dcp = opened.dcp().unwrap();
    assert_eq!(dcp.blobs.len(), 290);
    let megatron = dcp.megatron.as_ref().unwrap();
    assert_eq!(megatron.reformulated.len(), 30);
    assert_eq!(megatron.releases, Some("0.15"));
    assert_eq!(megatron.mcore_data, Some("metadata and plans"));
    assert_eq!(
        megatron.metadata_class.as_deref(),
        Some("megatron.core.dist_checkpointing.strategies.torch.MCoreMetadata")
    );
    assert_eq!(
        opened.writer.as_ref().unwrap().to_string(),
        "Megatron-Core torch_dist (version backend v1, MCoreMetadata, common.pt: megatron-core 0.15)"
    );
    // common.pt is an object over the whole file, decoded.
    let common = meta
        .objects()
        .iter()
        .find(|o| o.key == "common.pt")
        .unwrap();
    let file = &meta.files()[common.file as usize];
    assert_eq!(
        (file.path.as_str(), common.offset, common.length),
        ("common.pt", 0, 1639)
    );
    let bytes = std::fs::read(interop().join(FLAT_015).join("ckpt/common.pt")).unwrap();
    let value = decode_object(&bytes).unwrap();
    assert_eq!(value["iteration"], 100);
    assert_eq!(
        value["optimizer_fs"]["param_state_sharding_type"],
        "fully_sharded_model_space"
    );
}

#[test]
fn megatron_0_19_tensors_and_common_state_entry() {
    let opened = matches_expected(PLAIN_019);
    let megatron = opened.dcp().unwrap().megatron.as_ref().unwrap();
    assert!(megatron.reformulated.is_empty());
    assert_eq!(
        megatron.common_state.as_deref(),
        Some("common_state/shard_0_1")
    );
    assert_eq!(megatron.releases, Some("≥0.19"));
    assert!(
        !opened
            .meta
            .files()
            .iter()
            .any(|f| f.path == megatron::COMMON_FILE)
    );
}

/// The real 0.15 blobs of [`EMBED_AVG`] (stored [2, 1, 3072], four flat-range chunks), copied
/// back to back into `<tmp>/ckpt/__0_0.distcp`; returns the chunk specs.
fn embed_blobs(ckpt: &Path) -> Vec<(Vec<u64>, Vec<u64>, u64, u64)> {
    let src = interop().join(FLAT_015).join("ckpt");
    let opened = open(&src).unwrap();
    let tensor = opened
        .dcp()
        .unwrap()
        .metadata
        .tensors
        .iter()
        .find(|t| t.fqn == EMBED_AVG)
        .unwrap()
        .clone();
    assert_eq!(tensor.shape, vec![2, 1, 3072]);
    let mut data = Vec::new();
    let mut specs = Vec::new();
    for chunk in &tensor.chunks {
        let file = std::fs::read(src.join(&chunk.storage.relative_path)).unwrap();
        let (at, len) = (chunk.storage.offset as usize, chunk.storage.length as usize);
        specs.push((
            chunk.offsets.clone(),
            chunk.sizes.clone(),
            data.len() as u64,
            len as u64,
        ));
        data.extend_from_slice(&file[at..at + len]);
    }
    std::fs::create_dir_all(ckpt).unwrap();
    std::fs::write(ckpt.join("__0_0.distcp"), data).unwrap();
    specs
}

/// A checkpoint holding [`EMBED_AVG`] as Megatron stored it, its `.metadata` root of class
/// `module.name` with `extras` (key/value pairs written into its state).
fn synthetic(
    tmp: &Path,
    class: (&str, &str),
    chunk_edit: impl Fn(&mut Vec<(Vec<u64>, Vec<u64>, u64, u64)>),
    extras: impl FnOnce(&mut PickleWriter),
) -> PathBuf {
    let ckpt = tmp.join("ckpt");
    let mut specs = embed_blobs(&ckpt);
    chunk_edit(&mut specs);
    let spec = TensorSpec {
        fqn: EMBED_AVG,
        dtype: "float32",
        shape: vec![2, 1, 3072],
        chunks: specs
            .into_iter()
            .map(|(o, s, at, len)| (o, s, "__0_0.distcp", at, len, vec![]))
            .collect(),
    };
    let plain = dcp_metadata(MetadataStyle::TORCH_2_15, &[spec], &[]);
    let head = {
        let mut w = PickleWriter::new(4);
        w.global(M, "Metadata");
        let mut b = w.finish();
        b.pop();
        b
    };
    assert!(plain.starts_with(&head) && plain.ends_with(b"ub."));
    let mut out = {
        let mut w = PickleWriter::new(4);
        w.global(class.0, class.1);
        let mut b = w.finish();
        b.pop();
        b
    };
    out.extend_from_slice(&plain[head.len()..plain.len() - 3]);
    let mut w = PickleWriter::new(4);
    extras(&mut w);
    let extra = w.finish();
    out.extend_from_slice(&extra[2..extra.len() - 1]);
    out.extend_from_slice(b"ub.");
    std::fs::write(ckpt.join(".metadata"), out).unwrap();
    ckpt
}

fn orig_shape(w: &mut PickleWriter, shape: &[i64]) {
    w.dict(|w| {
        w.str("nd_reformulated_orig_global_shape").tuple(|w| {
            for &d in shape {
                w.int(d);
            }
        });
    });
}

fn mcore_data(w: &mut PickleWriter, shape: &[i64]) {
    w.str("mcore_data").dict(|w| {
        w.str(EMBED_AVG);
        orig_shape(w, shape);
        // A model tensor, stored as is.
        w.str("embedding.word_embeddings.weight").dict(|_| {});
    });
}

fn plans(w: &mut PickleWriter, shapes: &[Option<&[i64]>]) {
    w.str("all_local_plans").list(|w| {
        for shape in shapes {
            w.object(MCORE, "MCoreSavePlan", |w| {
                w.dict(|w| {
                    w.str("items").list(|_| {});
                    w.str("mcore_data").dict(|w| {
                        if let Some(shape) = shape {
                            w.str(EMBED_AVG);
                            orig_shape(w, shape);
                        }
                    });
                });
            });
        }
    });
}

fn embed_sha() -> String {
    expected(FLAT_015)["tensors"][EMBED_AVG]["sha256"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The tensor comes out as [96, 64] with Megatron's bytes.
fn original(ckpt: &Path) -> tessera_metadata::OpenedCheckpoint {
    let opened = open(ckpt).unwrap();
    let meta = &opened.meta;
    assert_eq!(meta.tensors()[0].shape, vec![96, 64]);
    assert_eq!(sha256(&read_tensor(ckpt, meta, 0)), embed_sha());
    opened
}

#[test]
fn mcore_data_on_mcore_metadata_as_0_15_writes_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synthetic(
        tmp.path(),
        (MCORE, "MCoreMetadata"),
        |_| {},
        |w| {
            mcore_data(w, &[96, 64]);
            plans(w, &[Some(&[96, 64]), None]);
        },
    );
    let opened = original(&ckpt);
    let writer = opened.writer.unwrap().to_string();
    assert!(
        writer.contains("MCoreMetadata") && writer.ends_with("megatron-core 0.15)"),
        "{writer}"
    );
}

#[test]
fn mcore_data_on_a_plain_metadata_as_0_8_to_0_14_set_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synthetic(
        tmp.path(),
        (M, "Metadata"),
        |_| {},
        |w| mcore_data(w, &[96, 64]),
    );
    let opened = original(&ckpt);
    assert_eq!(
        opened.writer.unwrap().to_string(),
        "Megatron-Core torch_dist (version mcore_data: megatron-core 0.8–0.14)"
    );
}

#[test]
fn mcore_data_only_on_the_save_plans() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synthetic(
        tmp.path(),
        (M, "Metadata"),
        |_| {},
        |w| {
            plans(w, &[None, Some(&[96, 64])]);
        },
    );
    let opened = original(&ckpt);
    let megatron = opened.dcp().unwrap().megatron.clone().unwrap();
    assert_eq!(megatron.mcore_data, Some("plans"));
}

#[test]
fn a_subclass_with_any_name_is_read_through_its_metadata_fields() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synthetic(tmp.path(), ("my.stack", "MyMetadata"), |_| {}, |_| {});
    let opened = open(&ckpt).unwrap();
    // No mcore_data: stored as is.
    assert_eq!(opened.meta.tensors()[0].shape, vec![2, 1, 3072]);
    assert_eq!(
        opened.dcp().unwrap().metadata.class.as_deref(),
        Some("my.stack.MyMetadata")
    );
    assert!(opened.dcp().unwrap().megatron.is_none());
}

#[test]
fn an_empty_mcore_entry_keeps_the_stored_shape() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synthetic(
        tmp.path(),
        (MCORE, "MCoreMetadata"),
        |_| {},
        |w| {
            w.str("mcore_data").dict(|w| {
                w.str(EMBED_AVG).dict(|_| {});
            });
        },
    );
    let opened = open(&ckpt).unwrap();
    assert_eq!(opened.meta.tensors()[0].shape, vec![2, 1, 3072]);
}

fn refused(
    class: (&str, &str),
    chunk_edit: impl Fn(&mut Vec<(Vec<u64>, Vec<u64>, u64, u64)>),
    extras: impl FnOnce(&mut PickleWriter),
) -> String {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synthetic(tmp.path(), class, chunk_edit, extras);
    let err = open(&ckpt).unwrap_err();
    assert!(matches!(err, MetadataError::Decode { .. }), "{err:?}");
    let text = err.to_string();
    assert!(text.starts_with("ckpt/.metadata: cannot decode "), "{text}");
    text
}

#[test]
fn an_original_shape_the_stored_shape_cannot_come_from_is_refused() {
    for shape in [&[96, 65][..], &[96][..], &[2, 48, 64][..], &[95, 64][..]] {
        let text = refused((MCORE, "MCoreMetadata"), |_| {}, |w| mcore_data(w, shape));
        assert!(
            text.contains(&format!(
                "tensor {EMBED_AVG}: the stored shape [2, 1, 3072] is not the reformulation"
            )),
            "{text}"
        );
    }
}

#[test]
fn a_chunk_off_the_rule_is_refused_naming_it() {
    // A chunk reaching past its TP-local box.
    let text = refused(
        (MCORE, "MCoreMetadata"),
        |specs| {
            let at = specs.iter().position(|c| c.0 == [0, 0, 1536]).unwrap();
            specs[at].1[2] += 1;
        },
        |w| mcore_data(w, &[96, 64]),
    );
    assert!(
        text.contains(&format!("tensor {EMBED_AVG}: chunk at offsets [0, 0, 1536] sizes [1, 1, 1537] holds elements 1536..3073")),
        "{text}"
    );
    // A chunk spanning two fragments.
    let text = refused(
        (MCORE, "MCoreMetadata"),
        |specs| {
            let at = specs.iter().position(|c| c.0 == [0, 0, 0]).unwrap();
            specs[at].1[0] = 2;
        },
        |w| mcore_data(w, &[96, 64]),
    );
    assert!(
        text.contains(
            "chunk at offsets [0, 0, 0] sizes [2, 1, 1536] is not a flat range of one TP-local box"
        ),
        "{text}"
    );
}

#[test]
fn malformed_mcore_data_is_refused_naming_the_tensor() {
    let text = refused(
        (MCORE, "MCoreMetadata"),
        |_| {},
        |w| {
            w.str("mcore_data").dict(|w| {
                w.str(EMBED_AVG).dict(|w| {
                    w.str("nd_reformulated_orig_global_shape").str("96x64");
                });
            });
        },
    );
    assert!(
        text.contains(&format!("tensor {EMBED_AVG}: mcore_data[\"{EMBED_AVG}\"][\"nd_reformulated_orig_global_shape\"] is a str \"96x64\", not a tuple of non-negative ints")),
        "{text}"
    );
    let text = refused(
        (MCORE, "MCoreMetadata"),
        |_| {},
        |w| {
            w.str("mcore_data").dict(|w| {
                w.str(EMBED_AVG).int(3);
            });
        },
    );
    assert!(text.contains("is a int 3, not a dict"), "{text}");
    let text = refused(
        (MCORE, "MCoreMetadata"),
        |_| {},
        |w| {
            w.str("mcore_data").list(|_| {});
        },
    );
    assert!(
        text.contains("mcore_data is a list of 0, not a dict"),
        "{text}"
    );
    let text = refused(
        (MCORE, "MCoreMetadata"),
        |_| {},
        |w| {
            w.str("mcore_data").dict(|w| {
                w.str(EMBED_AVG);
                orig_shape(w, &[96, -64]);
            });
        },
    );
    assert!(text.contains("not a tuple of non-negative ints"), "{text}");
}

#[test]
fn metadata_and_plans_that_disagree_are_refused() {
    let text = refused(
        (MCORE, "MCoreMetadata"),
        |_| {},
        |w| {
            mcore_data(w, &[96, 64]);
            plans(w, &[Some(&[48, 128])]);
        },
    );
    assert!(
        text.contains(&format!("tensor {EMBED_AVG}: mcore_data of the metadata says original shape [96, 64] but the save plans say original shape [48, 128]")),
        "{text}"
    );
}

#[test]
fn a_root_without_metadata_fields_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synthetic(tmp.path(), (M, "Metadata"), |_| {}, |_| {});
    let bytes = std::fs::read(ckpt.join(".metadata")).unwrap();
    // Another class without a `storage_data` field.
    let mut patched = bytes.clone();
    for at in 0..bytes.len().saturating_sub(12) {
        if &bytes[at..at + 12] == b"storage_data" {
            patched[at + 11] = b'_';
        }
    }
    let mut w = PickleWriter::new(4);
    w.global(M, "Metadata");
    let head_len = w.finish().len() - 1;
    let mut other = {
        let mut w = PickleWriter::new(4);
        w.global("x", "Other");
        let mut b = w.finish();
        b.pop();
        b
    };
    other.extend_from_slice(&patched[head_len..]);
    std::fs::write(ckpt.join(".metadata"), other).unwrap();
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(
        err.contains("the pickled object is a Other, not a Metadata"),
        "{err}"
    );
}

#[test]
fn a_metadata_json_that_is_not_json_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = synthetic(
        tmp.path(),
        (M, "Metadata"),
        |_| {},
        |w| mcore_data(w, &[96, 64]),
    );
    std::fs::write(ckpt.join("metadata.json"), b"{\"sharded_backend\": ").unwrap();
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(
        err.starts_with("ckpt/metadata.json: cannot decode Megatron-Core metadata.json"),
        "{err}"
    );
    std::fs::write(ckpt.join("metadata.json"), vec![b' '; 70_000]).unwrap();
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(
        err.contains("70000 bytes exceed the 65536-byte cap"),
        "{err}"
    );
}
