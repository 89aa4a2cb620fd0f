//! ByteCheckpoint's decomposed FSDP saves (`save_decomposed_model_optimizer=True`): the model is
//! saved as FSDP flat parameters (`<module>._flat_param`, 1-D, even splits over ranks) with the
//! slot layout in `user_defined_dict`, and the optimizer as per-parameter pieces of flat states
//! (`state.<module>._flat_param.exp_avg`, padding and frozen parameters not saved). tessera splits
//! them into the original parameters as flat-range chunks. The saves here are written byte for
//! byte the way ByteCheckpoint 0.0.x writes them (its `.metadata` pickle, raw storage bytes),
//! with a known value at every element.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::path::Path;

use dcp_support::{PickleWriter, open, read_tensor};
use tessera_metadata::Format;

const M: &str = "torch.distributed.checkpoint.metadata";

/// A 1-D flat tensor of a `.metadata`: fqn, numel, chunks (offset, length, file, byte offset).
struct Flat {
    fqn: &'static str,
    numel: u64,
    chunks: Vec<(u64, u64, &'static str, u64)>,
}

fn bytes(w: &mut PickleWriter, b: &[u8]) {
    w.raw(b"B").raw(&(b.len() as u32).to_le_bytes()).raw(b);
}

/// `_rebuild_tensor_v2` of a contiguous 1-D f32 tensor of `n` elements over its own storage.
fn descriptor(n: u64) -> Vec<u8> {
    let mut w = PickleWriter::new(2);
    w.global("torch._utils", "_rebuild_tensor_v2").tuple(|w| {
        w.tuple(|w| {
            w.str("storage")
                .global("torch", "FloatStorage")
                .str("0")
                .str("cpu")
                .int(n as i64);
        });
        w.raw(b"Q").int(0);
        w.tuple(|w| {
            w.int(n as i64);
        });
        w.tuple(|w| {
            w.int(1);
        });
        w.bool(false);
        w.call("collections", "OrderedDict", |_| {});
    });
    w.raw(b"R");
    w.finish()
}

fn index(w: &mut PickleWriter, fqn: &str, offset: u64, rank: i64) {
    w.object(M, "MetadataIndex", |w| {
        w.dict(|w| {
            w.str("fqn").str(fqn);
            w.str("offset").size(&[offset]);
            w.str("index").int(rank);
        });
    });
}

/// ByteCheckpoint's `.metadata` for `tensors`, with `user` writing `user_defined_dict`'s items.
fn bc_metadata(tensors: &[Flat], user: impl FnOnce(&mut PickleWriter)) -> Vec<u8> {
    let mut w = PickleWriter::new(4);
    w.object("bytecheckpoint.checkpointer.meta_type", "Metadata", |w| {
        w.dict(|w| {
            w.str("state_dict_metadata").dict(|w| {
                for t in tensors {
                    w.str(t.fqn).object(M, "TensorStorageMetadata", |w| {
                        w.dict(|w| {
                            w.str("properties").object(M, "TensorProperties", |w| {
                                w.dict(|w| {
                                    w.str("dtype").global("torch", "float32");
                                });
                            });
                            w.str("size").size(&[t.numel]);
                            w.str("chunks").list(|w| {
                                for c in &t.chunks {
                                    w.object(M, "ChunkStorageMetadata", |w| {
                                        w.dict(|w| {
                                            w.str("offsets").size(&[c.0]);
                                            w.str("sizes").size(&[c.1]);
                                        });
                                    });
                                }
                            });
                        });
                    });
                }
            });
            w.str("planner_data").none();
            w.str("storage_data").dict(|w| {
                for t in tensors {
                    for (k, c) in t.chunks.iter().enumerate() {
                        index(w, t.fqn, c.0, k as i64);
                        w.object(
                            "bytecheckpoint.checkpointer.meta_type",
                            "_StorageInfo",
                            |w| {
                                w.dict(|w| {
                                    w.str("relative_path").str(c.2);
                                    w.str("offset").int(c.3 as i64);
                                    w.str("length").int((c.1 * 4) as i64);
                                });
                            },
                        );
                    }
                }
            });
            w.str("all_tensor_metadata").dict(|w| {
                for t in tensors {
                    for (k, c) in t.chunks.iter().enumerate() {
                        index(w, t.fqn, c.0, k as i64);
                        bytes(w, &descriptor(c.1));
                    }
                }
            });
            w.str("bytecheckpoint_version").str("0.0.2");
            w.str("user_defined_dict").dict(user);
        });
    });
    w.finish()
}

fn f32s(values: impl Iterator<Item = u32>) -> Vec<u8> {
    values.flat_map(|v| (v as f32).to_le_bytes()).collect()
}

/// One FSDP unit `layers.0` on 2 ranks: slots a.weight [3,5] (15), padding (1), b.bias [4],
/// c.weight [2,3] → 26 flat elements, 13 per rank. Model element i holds i; optimizer element i
/// holds 100 + i, saved for a.weight and b.bias only (c.weight is frozen).
fn write_save(root: &Path) {
    std::fs::create_dir_all(root.join("model")).unwrap();
    std::fs::create_dir_all(root.join("optimizer")).unwrap();
    let key = "layers.0._flat_param";
    let model = bc_metadata(
        &[Flat {
            fqn: key,
            numel: 26,
            chunks: vec![(0, 13, "__0_0.distcp", 0), (13, 13, "__1_0.distcp", 0)],
        }],
        |w| {
            w.str("fsdp_flat_param_to_fqns").dict(|w| {
                w.str(key).list(|w| {
                    w.str("a.weight").str("b.bias").str("c.weight");
                });
            });
            w.str("fsdp_is_padding_mask").dict(|w| {
                w.str(key).list(|w| {
                    w.bool(false).bool(true).bool(false).bool(false);
                });
            });
            w.str("fsdp_numels_with_padding").dict(|w| {
                w.str(key).tuple(|w| {
                    w.int(15).int(1).int(4).int(6);
                });
            });
            w.str("fsdp_shapes").dict(|w| {
                w.str(key).tuple(|w| {
                    w.size(&[3, 5]).size(&[4]).size(&[2, 3]);
                });
            });
        },
    );
    std::fs::write(root.join("model/.metadata"), model).unwrap();
    std::fs::write(root.join("model/__0_0.distcp"), f32s(0..13)).unwrap();
    std::fs::write(root.join("model/__1_0.distcp"), f32s(13..26)).unwrap();
    // Rank 0 holds flat [0, 13): all a.weight's; rank 1 [13, 26): a.weight's tail, the padding
    // (not saved), b.bias, c.weight (frozen: no state).
    let optimizer = bc_metadata(
        &[Flat {
            fqn: "state.layers.0._flat_param.exp_avg",
            numel: 26,
            chunks: vec![
                (0, 13, "__0_0.distcp", 0),
                (13, 2, "__1_0.distcp", 0),
                (16, 4, "__1_0.distcp", 8),
            ],
        }],
        |_| {},
    );
    std::fs::write(root.join("optimizer/.metadata"), optimizer).unwrap();
    std::fs::write(root.join("optimizer/__0_0.distcp"), f32s(100..113)).unwrap();
    let mut rank1 = f32s(113..115);
    rank1.extend(f32s(116..120));
    std::fs::write(root.join("optimizer/__1_0.distcp"), rank1).unwrap();
}

#[test]
fn flat_parameters_split_into_the_original_parameters() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ckpt");
    write_save(&root);
    let opened = open(&root).unwrap();
    assert_eq!(opened.format, Format::ByteCheckpoint);
    let meta = &opened.meta;
    let names: Vec<(&str, &[u64])> = meta
        .tensors()
        .iter()
        .map(|t| (t.fqn.as_str(), t.shape.as_slice()))
        .collect();
    assert_eq!(
        names,
        [
            ("model.layers.0.a.weight", &[3u64, 5][..]),
            ("model.layers.0.b.bias", &[4][..]),
            ("model.layers.0.c.weight", &[2, 3][..]),
            ("optimizer.state.layers.0.a.weight.exp_avg", &[3, 5][..]),
            ("optimizer.state.layers.0.b.bias.exp_avg", &[4][..]),
        ]
    );
    let want = |t: &str, range: std::ops::Range<u32>| {
        let i = meta.tensor_index(t).unwrap();
        assert_eq!(read_tensor(&root, meta, i), f32s(range), "{t}");
    };
    want("model.layers.0.a.weight", 0..15);
    want("model.layers.0.b.bias", 16..20);
    want("model.layers.0.c.weight", 20..26);
    want("optimizer.state.layers.0.a.weight.exp_avg", 100..115);
    want("optimizer.state.layers.0.b.bias.exp_avg", 116..120);
    // a.weight [3, 5] straddles the ranks at flat 13 = row 2, column 3: rank 0's part is rows
    // 0..2 and the head of row 2, rank 1's the tail of row 2 — flat ranges tiled into boxes.
    let a = meta.tensor_index("model.layers.0.a.weight").unwrap();
    let boxes: Vec<String> = meta
        .chunks_of(a)
        .iter()
        .map(|c| {
            format!(
                "{} @{}:{}",
                c.region,
                meta.files()[c.bytes.file as usize].path,
                c.bytes.offset
            )
        })
        .collect();
    assert_eq!(
        boxes,
        [
            "[0..2, 0..5] @model/__0_0.distcp:0",
            "[2..3, 0..3] @model/__0_0.distcp:40",
            "[2..3, 3..5] @model/__1_0.distcp:0"
        ]
    );
}

#[test]
fn a_slot_layout_that_does_not_fit_the_flat_parameter_is_refused_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("ckpt");
    write_save(&root);
    // The model says the flat parameter has 26 elements; slots of 15+1+4+7 do not add up.
    let path = root.join("model/.metadata");
    let mut bytes = std::fs::read(&path).unwrap();
    let at = bytes.windows(4).position(|w| w == b"K\x04K\x06").unwrap();
    bytes[at + 3] = 7;
    std::fs::write(&path, bytes).unwrap();
    let err = open(&root).unwrap_err().to_string();
    assert!(
        err.contains("layers.0._flat_param")
            && err.contains("c.weight has shape [2, 3] but a 7-element slot"),
        "{err}"
    );
}
