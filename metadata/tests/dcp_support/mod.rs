//! Shared helpers of the DCP and safetensors reader tests: where the real torch-written fixtures
//! are, opening a location with the metadata crate, reading a saved chunk's bytes the way its
//! [`ByteMeta`] says (strides included), and sha256 in hex.
#![allow(clippy::unwrap_used, dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use object_store::local::LocalFileSystem;
use object_store::path::Path as ObjectPath;
use sha2::{Digest, Sha256};
use tessera_metadata::{
    CheckpointMeta, MetadataError, OpenOptions, OpenedCheckpoint, TensorBox, open_any,
};

/// The fixtures written by PyTorch 2.15 (`shared/fixtures/dcp` next to the workspace, or
/// `$TESSERA_DCP_FIXTURES`).
pub fn fixtures() -> PathBuf {
    let dir = std::env::var_os("TESSERA_DCP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/dcp"));
    assert!(
        dir.join("a_w1_plain/.metadata").exists(),
        "DCP fixtures not found at {} (set TESSERA_DCP_FIXTURES)",
        dir.display()
    );
    dir
}

/// The DCP fixtures (pickled `.metadata` + `.distcp`).
pub const DCP_FIXTURES: [&str; 4] = [
    "a_w1_plain",
    "b_w4_fsdp_shard0",
    "c_w4_dp2_tp2",
    "e_w2_fsdp2_adamw",
];

/// A current-thread runtime.
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Opens `dir` (a checkpoint directory or a file) with [`open_any`].
pub fn open_with(dir: &Path, options: &OpenOptions) -> Result<OpenedCheckpoint, MetadataError> {
    let (store, prefix) = store_for(dir);
    runtime().block_on(open_any(store.as_ref(), &prefix, options))
}

/// Opens `dir` with default options but no shared in-memory cache (every test sees a cold open).
pub fn open(dir: &Path) -> Result<OpenedCheckpoint, MetadataError> {
    let mut options = OpenOptions::default();
    options.dcp.cache = None;
    open_with(dir, &options)
}

/// A local store rooted at `dir`'s parent and `dir`'s name as the prefix (as the CLI opens
/// local locations).
pub fn store_for(dir: &Path) -> (Arc<LocalFileSystem>, ObjectPath) {
    let parent = dir.parent().unwrap();
    let store = Arc::new(LocalFileSystem::new_with_prefix(parent).unwrap());
    let prefix = ObjectPath::from(dir.file_name().unwrap().to_str().unwrap());
    (store, prefix)
}

/// The row-major bytes of `region` (inside saved chunk `chunk` of tensor `t`) read from the
/// checkpoint's files under `root` the way the chunk's `ByteMeta` says.
pub fn read_box(root: &Path, meta: &CheckpointMeta, chunk: usize, region: &TensorBox) -> Vec<u8> {
    let c = &meta.chunks()[chunk];
    let tensor = &meta.tensors()[c.tensor as usize];
    let esize = tensor.dtype.size() as usize;
    let data_file = &meta.files()[c.bytes.file as usize];
    let file = match &data_file.encoded {
        None => std::fs::read(root.join(&data_file.path)).unwrap(),
        // The decoded bytes of a compressed blob.
        Some(encoded) => {
            let source = std::fs::read(root.join(&encoded.source)).unwrap();
            let start = encoded.offset as usize;
            zstd::stream::decode_all(&source[start..start + encoded.length as usize]).unwrap()
        }
    };
    let strides = c.bytes.strides_for(&c.region.lengths);
    let rel = c.region.relative_offsets(region);
    let n = region.numel() as usize;
    let mut out = Vec::with_capacity(n * esize);
    let mut idx = vec![0u64; region.ndim()];
    for _ in 0..n {
        let elem: u64 = idx
            .iter()
            .zip(&rel)
            .zip(&strides)
            .map(|((i, r), s)| (i + r) * s)
            .sum();
        let at = c.bytes.offset as usize + elem as usize * esize;
        out.extend_from_slice(&file[at..at + esize]);
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < region.lengths[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// The whole tensor `t`, assembled from its saved chunks.
pub fn read_tensor(root: &Path, meta: &CheckpointMeta, t: u32) -> Vec<u8> {
    let tensor = &meta.tensors()[t as usize];
    let esize = tensor.dtype.size() as usize;
    let full = tensor.full_box();
    let mut out = vec![0u8; tensor.nbytes() as usize];
    let strides = tessera_metadata::row_major_strides(&tensor.shape);
    let first = meta.first_chunk_index(t);
    for (k, c) in meta.chunks_of(t).iter().enumerate() {
        if c.region.is_empty() {
            continue;
        }
        let bytes = read_box(root, meta, first + k, &c.region);
        let mut idx = vec![0u64; c.region.ndim()];
        for e in 0..c.region.numel() as usize {
            let at: u64 = idx
                .iter()
                .zip(&c.region.offsets)
                .zip(&strides)
                .map(|((i, o), s)| (i + o) * s)
                .sum();
            let at = at as usize * esize;
            out[at..at + esize].copy_from_slice(&bytes[e * esize..(e + 1) * esize]);
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < c.region.lengths[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
    assert_eq!(full.numel() as usize * esize, out.len());
    out
}

/// sha256 in lower-case hex.
pub fn sha256(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A fixture's `expected.json`.
pub fn expected(fixture: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join(fixture).join("expected.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// Copies a fixture directory into `into` (to damage it) and returns the copy's path.
pub fn copy_fixture(fixture: &str, into: &Path) -> PathBuf {
    let to = into.join(fixture);
    copy_dir_writable(&fixtures().join(fixture), &to);
    to
}

/// Copies directory `from` into `to` recursively, every file writable (the fixtures are
/// read-only; tests damage their copies).
pub fn copy_dir_writable(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_dir_writable(&entry.path(), &target);
        } else {
            // Written anew rather than `fs::copy`d: a copy keeps the read-only permission.
            std::fs::write(&target, std::fs::read(entry.path()).unwrap()).unwrap();
        }
    }
}

/// A minimal pickle writer for building `.metadata` files the way other torch versions (and
/// Megatron) write them. No memo: every object is written where it is used.
pub struct PickleWriter {
    out: Vec<u8>,
    proto: u8,
}

impl PickleWriter {
    /// Starts a pickle of protocol `proto` (2 or 4).
    pub fn new(proto: u8) -> PickleWriter {
        PickleWriter {
            out: vec![0x80, proto],
            proto,
        }
    }

    /// The finished pickle.
    pub fn finish(mut self) -> Vec<u8> {
        self.out.push(b'.');
        self.out
    }

    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.out.extend_from_slice(bytes);
        self
    }

    pub fn global(&mut self, module: &str, name: &str) -> &mut Self {
        if self.proto >= 4 {
            self.str(module).str(name).raw(&[0x93])
        } else {
            self.raw(b"c")
                .raw(module.as_bytes())
                .raw(b"\n")
                .raw(name.as_bytes())
                .raw(b"\n")
        }
    }

    pub fn str(&mut self, s: &str) -> &mut Self {
        if self.proto >= 4 && s.len() < 256 {
            self.raw(&[0x8c, s.len() as u8]).raw(s.as_bytes())
        } else {
            self.raw(b"X")
                .raw(&(s.len() as u32).to_le_bytes())
                .raw(s.as_bytes())
        }
    }

    pub fn int(&mut self, i: i64) -> &mut Self {
        if (0..256).contains(&i) {
            self.raw(&[b'K', i as u8])
        } else if (0..65536).contains(&i) {
            self.raw(b"M").raw(&(i as u16).to_le_bytes())
        } else if i32::try_from(i).is_ok() {
            self.raw(b"J").raw(&(i as i32).to_le_bytes())
        } else {
            self.raw(&[0x8a, 8]).raw(&i.to_le_bytes())
        }
    }

    pub fn none(&mut self) -> &mut Self {
        self.raw(b"N")
    }

    pub fn bool(&mut self, b: bool) -> &mut Self {
        self.raw(&[if b { 0x88 } else { 0x89 }])
    }

    pub fn mark(&mut self) -> &mut Self {
        self.raw(b"(")
    }

    /// `MARK items TUPLE`.
    pub fn tuple(&mut self, items: impl FnOnce(&mut Self)) -> &mut Self {
        self.mark();
        items(self);
        self.raw(b"t")
    }

    /// `EMPTY_LIST MARK items APPENDS`.
    pub fn list(&mut self, items: impl FnOnce(&mut Self)) -> &mut Self {
        self.raw(b"]").mark();
        items(self);
        self.raw(b"e")
    }

    /// `EMPTY_DICT MARK key value ... SETITEMS`.
    pub fn dict(&mut self, pairs: impl FnOnce(&mut Self)) -> &mut Self {
        self.raw(b"}").mark();
        pairs(self);
        self.raw(b"u")
    }

    /// A dataclass instance: `GLOBAL EMPTY_TUPLE NEWOBJ state BUILD`.
    pub fn object(&mut self, module: &str, name: &str, state: impl FnOnce(&mut Self)) -> &mut Self {
        self.global(module, name).raw(b")").raw(&[0x81]);
        state(self);
        self.raw(b"b")
    }

    /// A call: `GLOBAL (args) REDUCE`.
    pub fn call(&mut self, module: &str, name: &str, args: impl FnOnce(&mut Self)) -> &mut Self {
        self.global(module, name).tuple(args).raw(b"R")
    }

    /// `torch.Size((...))`.
    pub fn size(&mut self, dims: &[u64]) -> &mut Self {
        self.call("torch", "Size", |w| {
            w.tuple(|w| {
                for &d in dims {
                    w.int(d as i64);
                }
            });
        })
    }
}

/// How a `.metadata` is written: what differs between torch releases and Megatron.
#[derive(Clone, Copy, Debug)]
pub struct MetadataStyle {
    /// Pickle protocol.
    pub proto: u8,
    /// Module of `TensorProperties` (moved in torch 2.3).
    pub properties_module: &'static str,
    /// `TensorProperties` state: 6-tuple with strides (2.15), 5-tuple (2.1–2.14), or a dict.
    pub properties: Properties,
    /// `storage_meta` (≥2.4) and `version` (≥2.9).
    pub storage_meta: bool,
    pub version: bool,
    /// Megatron-Core's extra keys with objects of unknown classes.
    pub megatron: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Properties {
    Six,
    Five,
    Dict,
}

impl MetadataStyle {
    pub const TORCH_2_15: MetadataStyle = MetadataStyle {
        proto: 4,
        properties_module: "torch.distributed.checkpoint.metadata",
        properties: Properties::Six,
        storage_meta: true,
        version: true,
        megatron: false,
    };
    pub const TORCH_2_1: MetadataStyle = MetadataStyle {
        proto: 4,
        properties_module: "torch.distributed._shard.sharded_tensor.metadata",
        properties: Properties::Five,
        storage_meta: false,
        version: false,
        megatron: false,
    };
}

/// One tensor of a hand-written `.metadata`: (fqn, torch dtype name, shape, chunks as
/// (offsets, sizes, file, byte offset, byte length, transforms)).
pub struct TensorSpec {
    pub fqn: &'static str,
    pub dtype: &'static str,
    pub shape: Vec<u64>,
    pub chunks: Vec<ChunkSpec>,
}

/// A chunk of a [`TensorSpec`]: (offsets, sizes, file, byte offset, byte length, transforms).
pub type ChunkSpec = (
    Vec<u64>,
    Vec<u64>,
    &'static str,
    u64,
    u64,
    Vec<&'static str>,
);

/// A `.metadata` pickle with `tensors` and bytes entries `objects` (fqn, file, offset, length).
pub fn dcp_metadata(
    style: MetadataStyle,
    tensors: &[TensorSpec],
    objects: &[(&str, &str, u64, u64)],
) -> Vec<u8> {
    let objects: Vec<ObjectSpec> = objects
        .iter()
        .map(|&(fqn, file, offset, length)| (fqn, file, offset, length, vec![]))
        .collect();
    dcp_metadata_with_objects(style, tensors, &objects)
}

/// A bytes entry of a hand-written `.metadata`: (fqn, file, byte offset, byte length,
/// transforms).
pub type ObjectSpec<'a> = (&'a str, &'a str, u64, u64, Vec<&'static str>);

/// [`dcp_metadata`] with bytes entries that may be stored with transforms.
pub fn dcp_metadata_with_objects(
    style: MetadataStyle,
    tensors: &[TensorSpec],
    objects: &[ObjectSpec],
) -> Vec<u8> {
    const M: &str = "torch.distributed.checkpoint.metadata";
    let mut w = PickleWriter::new(style.proto);
    w.object(M, "Metadata", |w| {
        w.dict(|w| {
            w.str("state_dict_metadata").dict(|w| {
                for t in tensors {
                    w.str(t.fqn).object(M, "TensorStorageMetadata", |w| {
                        w.dict(|w| {
                            w.str("properties").object(
                                style.properties_module,
                                "TensorProperties",
                                |w| {
                                    let dtype = |w: &mut PickleWriter| {
                                        w.global("torch", t.dtype);
                                    };
                                    let layout = |w: &mut PickleWriter| {
                                        w.call("torch.serialization", "_get_layout", |w| {
                                            w.str("torch.strided");
                                        });
                                    };
                                    let memory = |w: &mut PickleWriter| {
                                        w.call(
                                            style.properties_module,
                                            "_MEM_FORMAT_ENCODING",
                                            |w| {
                                                w.int(0);
                                            },
                                        );
                                    };
                                    match style.properties {
                                        Properties::Dict => {
                                            w.dict(|w| {
                                                w.str("dtype");
                                                dtype(w);
                                                w.str("layout");
                                                layout(w);
                                                w.str("requires_grad").bool(false);
                                            });
                                        }
                                        p => {
                                            w.tuple(|w| {
                                                dtype(w);
                                                layout(w);
                                                w.bool(false);
                                                memory(w);
                                                w.bool(false);
                                                if p == Properties::Six {
                                                    w.tuple(|_| {});
                                                }
                                            });
                                        }
                                    }
                                },
                            );
                            w.str("size").size(&t.shape);
                            w.str("chunks").list(|w| {
                                for c in &t.chunks {
                                    w.object(M, "ChunkStorageMetadata", |w| {
                                        w.dict(|w| {
                                            w.str("offsets").size(&c.0);
                                            w.str("sizes").size(&c.1);
                                        });
                                    });
                                }
                            });
                        });
                    });
                }
                for (fqn, ..) in objects {
                    // An empty `__dict__`: no BUILD.
                    w.str(fqn)
                        .global(M, "BytesStorageMetadata")
                        .raw(b")")
                        .raw(&[0x81]);
                }
            });
            w.str("planner_data").none();
            w.str("storage_data").dict(|w| {
                let info = |w: &mut PickleWriter,
                            file: &str,
                            offset: u64,
                            length: u64,
                            transforms: &[&str]| {
                    w.object(
                        "torch.distributed.checkpoint.filesystem",
                        "_StorageInfo",
                        |w| {
                            w.dict(|w| {
                                w.str("relative_path").str(file);
                                w.str("offset").int(offset as i64);
                                w.str("length").int(length as i64);
                                if !transforms.is_empty() {
                                    w.str("transform_descriptors").list(|w| {
                                        for t in transforms {
                                            w.str(t);
                                        }
                                    });
                                }
                            });
                        },
                    );
                };
                for t in tensors {
                    for (k, c) in t.chunks.iter().enumerate() {
                        w.object(M, "MetadataIndex", |w| {
                            w.dict(|w| {
                                w.str("fqn").str(t.fqn);
                                w.str("offset").size(&c.0);
                                w.str("index").int(k as i64);
                            });
                        });
                        info(w, c.2, c.3, c.4, &c.5);
                    }
                }
                for (fqn, file, offset, length, transforms) in objects {
                    w.object(M, "MetadataIndex", |w| {
                        w.dict(|w| {
                            w.str("fqn").str(fqn);
                            w.str("index").none();
                        });
                    });
                    info(w, file, *offset, *length, transforms);
                }
            });
            if style.storage_meta {
                w.str("storage_meta").object(M, "StorageMeta", |w| {
                    w.dict(|w| {
                        w.str("checkpoint_id").call("pathlib", "PosixPath", |w| {
                            w.str("/").str("ckpt").str("x");
                        });
                        w.str("save_id").str("abc");
                        w.str("load_id").none();
                    });
                });
            }
            if style.version {
                w.str("version").str("1.0.0");
            }
            if style.megatron {
                w.str("mcore_data").dict(|w| {
                    w.str("decoder.layers.mlp.linear_fc1.weight").dict(|w| {
                        w.str("nd_reformulated_orig_global_shape").tuple(|w| {
                            w.int(2).int(64);
                        });
                    });
                });
                w.str("all_local_plans").list(|w| {
                    w.object("torch.distributed.checkpoint.planner", "SavePlan", |w| {
                        w.dict(|w| {
                            w.str("items").list(|w| {
                                w.object(
                                    "torch.distributed.checkpoint.planner",
                                    "WriteItem",
                                    |w| {
                                        w.dict(|w| {
                                            w.str("type").call(
                                                "torch.distributed.checkpoint.planner",
                                                "WriteItemType",
                                                |w| {
                                                    w.int(1);
                                                },
                                            );
                                        });
                                    },
                                );
                            });
                            w.str("storage_data").none();
                            w.str("planner_data").none();
                        });
                    });
                });
            }
        });
    });
    w.finish()
}

/// A stored zip laid out as torch.save lays it out: members in order, each member's data 64-byte
/// aligned through an `FB` padding extra field, flag bit 3 (sizes only in the central
/// directory), a classic end record.
pub fn torch_zip(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for (name, data) in members {
        let offset = out.len() as u32;
        let unpadded = out.len() + 30 + name.len() + 4;
        let pad = (64 - unpadded % 64) % 64;
        let crc = crc32fast::hash(data);
        out.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        out.extend_from_slice(&20u16.to_le_bytes());
        out.extend_from_slice(&0x0808u16.to_le_bytes());
        // method, time, date, crc, compressed and uncompressed size (in the directory only)
        out.extend_from_slice(&[0; 2 + 2 + 2 + 4 + 4 + 4]);
        out.extend_from_slice(&(name.len() as u16).to_le_bytes());
        out.extend_from_slice(&((4 + pad) as u16).to_le_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&0x4246u16.to_le_bytes());
        out.extend_from_slice(&(pad as u16).to_le_bytes());
        out.extend(std::iter::repeat_n(b'Z', pad));
        assert_eq!(out.len() % 64, 0);
        out.extend_from_slice(data);
        central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
        central.extend_from_slice(&[0x1e, 0x03, 20, 0]);
        central.extend_from_slice(&0x0808u16.to_le_bytes());
        central.extend_from_slice(&[0; 2 + 2 + 2]); // method, time, date
        central.extend_from_slice(&crc.to_le_bytes());
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(data.len() as u32).to_le_bytes());
        central.extend_from_slice(&(name.len() as u16).to_le_bytes());
        central.extend_from_slice(&[0; 2 + 2 + 2 + 2 + 4]); // extra, comment, disk, attrs
        central.extend_from_slice(&offset.to_le_bytes());
        central.extend_from_slice(name.as_bytes());
    }
    let cd_offset = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&cd_offset.to_le_bytes());
    out.extend_from_slice(&[0; 2]);
    out
}
