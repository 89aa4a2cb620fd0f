//! `.metadata` as other torch releases and Megatron-Core write it, built around real blobs of
//! fixture a: `TensorProperties` as a 6-tuple (2.15), a 5-tuple in its pre-2.3 module (2.1–2.2),
//! or a dict; protocol 2 text globals; no `storage_meta`/`version`; Megatron's extra keys full of
//! objects of unknown classes; per-rank `__<r>.metadata` files; blobs compressed with DCP's ZStandard extension read through
//! their decoded bytes, other transforms refused.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::path::{Path, PathBuf};

use dcp_support::{
    MetadataStyle, Properties, TensorSpec, dcp_metadata, dcp_metadata_with_objects, expected,
    fixtures, open, read_tensor, runtime, sha256, store_for,
};
use tessera_metadata::formats::dcp::{DcpVerifyReport, verify_dcp};
use tessera_metadata::{DType, Format, OpenedCheckpoint};

/// Blobs of fixture a: (fqn, offset, length) in `a_w1_plain/__0_0.distcp`.
const BLOBS: [(&str, u64, u64); 4] = [
    ("optim.param_groups.0.lr", 0, 1261),
    ("model.final_ln.bias", 307522, 1833),
    ("model.lm_head.weight", 309355, 26153),
    ("train_step", 731889, 1577),
];

/// Writes `<tmp>/ckpt/__0_0.distcp` with the four blobs back to back and a `.metadata` in
/// `style`; returns the directory.
fn checkpoint(tmp: &Path, style: MetadataStyle, transforms: Vec<&'static str>) -> PathBuf {
    let source = std::fs::read(fixtures().join("a_w1_plain/__0_0.distcp")).unwrap();
    let mut data = Vec::new();
    let mut at = Vec::new();
    let mut lengths = Vec::new();
    for (i, (_, offset, length)) in BLOBS.into_iter().enumerate() {
        at.push(data.len() as u64);
        let blob = &source[offset as usize..(offset + length) as usize];
        // The blob DCP's ZStandard extension would have written: one zstd stream of the zip.
        let blob = if i == 1 && transforms == ["stream.zstd/1"] {
            zstd::bulk::compress(blob, 3).unwrap()
        } else {
            blob.to_vec()
        };
        lengths.push(blob.len() as u64);
        data.extend_from_slice(&blob);
    }
    let dir = tmp.join("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("__0_0.distcp"), &data).unwrap();
    let f = "__0_0.distcp";
    let tensors = [
        TensorSpec {
            fqn: "model.final_ln.bias",
            dtype: "float32",
            shape: vec![64],
            chunks: vec![(vec![0], vec![64], f, at[1], lengths[1], transforms)],
        },
        TensorSpec {
            fqn: "model.lm_head.weight",
            dtype: "float32",
            shape: vec![96, 64],
            chunks: vec![(vec![0, 0], vec![96, 64], f, at[2], BLOBS[2].2, vec![])],
        },
        TensorSpec {
            fqn: "train_step",
            dtype: "int64",
            shape: vec![],
            chunks: vec![(vec![], vec![], f, at[3], BLOBS[3].2, vec![])],
        },
    ];
    let objects = [(BLOBS[0].0, f, at[0], BLOBS[0].2)];
    std::fs::write(
        dir.join(".metadata"),
        dcp_metadata(style, &tensors, &objects),
    )
    .unwrap();
    dir
}

fn check(dir: &Path) {
    let opened = open(dir).unwrap();
    assert_eq!(opened.format, Format::Dcp);
    let meta = &opened.meta;
    let names: Vec<_> = meta.tensors().iter().map(|t| t.fqn.as_str()).collect();
    assert_eq!(
        names,
        ["model.final_ln.bias", "model.lm_head.weight", "train_step"]
    );
    assert_eq!(meta.tensors()[2].dtype, DType::I64);
    assert_eq!(meta.objects()[0].key, "optim.param_groups.0.lr");
    let expected = expected("a_w1_plain");
    for t in 0..3u32 {
        let fqn = &meta.tensors()[t as usize].fqn;
        assert_eq!(
            sha256(&read_tensor(dir, meta, t)),
            expected["entries"][fqn]["sha256"].as_str().unwrap(),
            "{fqn}"
        );
    }
    assert_eq!(meta.chunks_of(1)[0].bytes.strides, Some(vec![1, 96]));
}

#[test]
fn torch_2_15_metadata() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), MetadataStyle::TORCH_2_15, vec![]);
    check(&dir);
    let opened = open(&dir).unwrap();
    let dcp = opened.dcp().unwrap();
    assert_eq!(dcp.metadata.checkpoint_id.as_deref(), Some("/ckpt/x"));
    assert_eq!(dcp.metadata.save_id.as_deref(), Some("abc"));
}

#[test]
fn torch_2_1_metadata_five_tuple_properties_in_the_old_module() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), MetadataStyle::TORCH_2_1, vec![]);
    check(&dir);
    let opened = open(&dir).unwrap();
    let dcp = opened.dcp().unwrap();
    assert_eq!(
        (
            dcp.metadata.version.as_ref(),
            dcp.metadata.checkpoint_id.as_ref()
        ),
        (None, None)
    );
}

#[test]
fn protocol_2_text_globals_and_dict_properties() {
    let tmp = tempfile::tempdir().unwrap();
    let style = MetadataStyle {
        proto: 2,
        properties: Properties::Dict,
        ..MetadataStyle::TORCH_2_1
    };
    check(&checkpoint(tmp.path(), style, vec![]));
}

#[test]
fn megatron_extras_with_unknown_classes_are_tolerated() {
    let tmp = tempfile::tempdir().unwrap();
    let style = MetadataStyle {
        megatron: true,
        ..MetadataStyle::TORCH_2_15
    };
    check(&checkpoint(tmp.path(), style, vec![]));
}

#[test]
fn per_rank_metadata_files_are_merged() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), MetadataStyle::TORCH_2_15, vec![]);
    std::fs::rename(dir.join(".metadata"), dir.join("__0.metadata")).unwrap();
    check(&dir);
    let opened = open(&dir).unwrap();
    assert_eq!(
        opened.dcp().unwrap().metadata_files,
        vec!["__0.metadata".to_string()]
    );
}

#[test]
fn zstd_blobs_are_read_through_their_decoded_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), MetadataStyle::TORCH_2_15, vec!["stream.zstd/1"]);
    check(&dir);
    let opened = open(&dir).unwrap();
    let chunk = &opened.meta.chunks_of(0)[0];
    let file = &opened.meta.files()[chunk.bytes.file as usize];
    let encoded = file.encoded.as_ref().expect("an encoded file");
    assert_eq!(encoded.source, "__0_0.distcp");
    assert_eq!(file.path, encoded.file_name());
    // The zip's CRC-32 still covers the decoded storage.
    assert!(chunk.crc32.is_some());
}

/// Writes `<tmp>/ckpt` with every blob of [`BLOBS`] (the object too) compressed as DCP's
/// ZStandard extension writes it, `edit` applied to each decoded blob first (by its index).
fn all_zstd(tmp: &Path, edit: impl Fn(usize, &mut Vec<u8>)) -> PathBuf {
    let source = std::fs::read(fixtures().join("a_w1_plain/__0_0.distcp")).unwrap();
    let mut data = Vec::new();
    let mut at = Vec::new();
    for (i, (_, offset, length)) in BLOBS.into_iter().enumerate() {
        let mut blob = source[offset as usize..(offset + length) as usize].to_vec();
        edit(i, &mut blob);
        let packed = zstd::bulk::compress(&blob, 3).unwrap();
        at.push((data.len() as u64, packed.len() as u64));
        data.extend_from_slice(&packed);
    }
    let dir = tmp.join("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("__0_0.distcp"), &data).unwrap();
    let (f, z) = ("__0_0.distcp", vec!["stream.zstd/1"]);
    let tensors = [
        TensorSpec {
            fqn: "model.final_ln.bias",
            dtype: "float32",
            shape: vec![64],
            chunks: vec![(vec![0], vec![64], f, at[1].0, at[1].1, z.clone())],
        },
        TensorSpec {
            fqn: "model.lm_head.weight",
            dtype: "float32",
            shape: vec![96, 64],
            chunks: vec![(vec![0, 0], vec![96, 64], f, at[2].0, at[2].1, z.clone())],
        },
        TensorSpec {
            fqn: "train_step",
            dtype: "int64",
            shape: vec![],
            chunks: vec![(vec![], vec![], f, at[3].0, at[3].1, z.clone())],
        },
    ];
    let objects = [(BLOBS[0].0, f, at[0].0, at[0].1, z)];
    std::fs::write(
        dir.join(".metadata"),
        dcp_metadata_with_objects(MetadataStyle::TORCH_2_15, &tensors, &objects),
    )
    .unwrap();
    dir
}

fn verify(dir: &Path, opened: &OpenedCheckpoint) -> DcpVerifyReport {
    let (store, prefix) = store_for(dir);
    runtime()
        .block_on(verify_dcp(
            store.as_ref(),
            &prefix,
            &opened.meta,
            opened.dcp().unwrap(),
            4,
        ))
        .unwrap()
}

/// `verify_dcp` checks a compressed blob's storage CRC-32 over its decoded bytes, and every
/// member of a compressed object blob, reading the real file (not the decoded file's name).
#[test]
fn zstd_blobs_verify_over_their_decoded_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = all_zstd(tmp.path(), |_, _| {});
    check(&dir);
    let opened = open(&dir).unwrap();
    let report = verify(&dir, &opened);
    assert!(report.is_ok(), "{report:?}");
    assert_eq!((report.tensors_checked, report.objects_checked), (3, 1));
    // The decoded storages: 64 + 96 * 64 floats and one int64, and the object's blob.
    assert!(report.bytes_checked >= (64 + 96 * 64) * 4 + 8, "{report:?}");
}

/// A storage byte changed before compression decodes cleanly, and is found by its CRC-32; a byte
/// flipped in the compressed stream is found too. Each names the real file and the blob's
/// compressed range in it.
#[test]
fn zstd_blobs_that_changed_fail_verification_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    // lm_head's storage starts at byte 704 of its blob (fixture a's blob_format_examples.txt).
    let dir = all_zstd(&tmp.path().join("stored"), |i, blob| {
        if i == 2 {
            blob[704 + 100] ^= 0x01;
        }
    });
    let opened = open(&dir).unwrap();
    let report = verify(&dir, &opened);
    let [bad] = report.bad.as_slice() else {
        panic!("{report:?}");
    };
    let range = &opened.meta.files()[opened.meta.chunks_of(1)[0].bytes.file as usize]
        .encoded
        .clone()
        .unwrap();
    assert_eq!(bad.file, "__0_0.distcp");
    assert_eq!(
        (bad.start, bad.end),
        (range.offset, range.offset + range.length)
    );
    assert_eq!(
        bad.entry,
        "tensor model.lm_head.weight chunk [0..96, 0..64]"
    );
    assert!(
        bad.detail.starts_with("decoded from zstd: storage crc32 "),
        "{}",
        bad.detail
    );

    // A flipped bit in the middle of the compressed object blob (opened before the flip).
    let dir = all_zstd(&tmp.path().join("flipped"), |_, _| {});
    let opened = open(&dir).unwrap();
    let object = &opened.meta.files()[opened.meta.objects()[0].file as usize]
        .encoded
        .clone()
        .unwrap();
    let path = dir.join("__0_0.distcp");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(object.offset + object.length / 2) as usize] ^= 0x10;
    std::fs::write(&path, bytes).unwrap();
    let report = verify(&dir, &opened);
    let [bad] = report.bad.as_slice() else {
        panic!("{report:?}");
    };
    assert_eq!(
        (bad.file.as_str(), bad.entry.as_str()),
        ("__0_0.distcp", "object optim.param_groups.0.lr")
    );
    assert_eq!(
        (bad.start, bad.end),
        (object.offset, object.offset + object.length)
    );
    assert!(
        bad.detail.starts_with("decoded from zstd: "),
        "{}",
        bad.detail
    );
}

#[test]
fn other_transforms_are_refused_naming_the_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), MetadataStyle::TORCH_2_15, vec!["stream.aes/1"]);
    let err = open(&dir).unwrap_err();
    assert_eq!(
        err.to_string(),
        "ckpt/__0_0.distcp: tensor model.final_ln.bias chunk [0..64] is stored with transform \
         stream.aes/1 is not one DCP ships (tessera reads stream.zstd/1)"
    );
}

/// A float8 tensor as torch ≥2.1 saves it (`_rebuild_tensor_v3` over an `UntypedStorage`, with a
/// storage offset), and a safetensors-format blob (torch ≥2.8 `SerializationFormat.SAFETENSORS`),
/// in one `.distcp`.
#[test]
fn rebuild_tensor_v3_float8_and_safetensors_blobs() {
    use dcp_support::{PickleWriter, torch_zip};
    use tessera_metadata::formats::safetensors::{TensorView, serialize};

    // float8 [4, 8] starting 8 elements into a 40-byte storage.
    let storage: Vec<u8> = (0..40u8).collect();
    let mut w = PickleWriter::new(2);
    w.call("torch._utils", "_rebuild_tensor_v3", |w| {
        w.tuple(|w| {
            w.str("storage")
                .global("torch.storage", "UntypedStorage")
                .str("0")
                .str("cpu")
                .int(40);
        })
        .raw(b"Q");
        w.int(8);
        w.tuple(|w| {
            w.int(4).int(8);
        });
        w.tuple(|w| {
            w.int(8).int(1);
        });
        w.bool(false);
        w.call("collections", "OrderedDict", |_| {});
        w.global("torch", "float8_e4m3fn");
    });
    let pkl = w.finish();
    let f8_blob = torch_zip(&[
        ("archive/data.pkl", &pkl),
        ("archive/byteorder", b"little"),
        ("archive/data/0", &storage),
        ("archive/version", b"3\n"),
    ]);
    let values: Vec<u8> = (100..160u8).collect();
    let st_blob = serialize(
        &[TensorView {
            name: "st.weight",
            dtype: DType::F32,
            shape: &[3, 5],
            data: &values,
        }],
        None,
    )
    .unwrap();

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    let mut data = f8_blob.clone();
    data.extend_from_slice(&st_blob);
    std::fs::write(dir.join("__0_0.distcp"), &data).unwrap();
    let f = "__0_0.distcp";
    let (a, b) = (f8_blob.len() as u64, st_blob.len() as u64);
    let tensors = [
        TensorSpec {
            fqn: "f8.weight",
            dtype: "float8_e4m3fn",
            shape: vec![4, 8],
            chunks: vec![(vec![0, 0], vec![4, 8], f, 0, a, vec![])],
        },
        TensorSpec {
            fqn: "st.weight",
            dtype: "float32",
            shape: vec![3, 5],
            chunks: vec![(vec![0, 0], vec![3, 5], f, a, b, vec![])],
        },
    ];
    std::fs::write(
        dir.join(".metadata"),
        dcp_metadata(MetadataStyle::TORCH_2_15, &tensors, &[]),
    )
    .unwrap();
    let opened = open(&dir).unwrap();
    let meta = &opened.meta;
    assert_eq!(meta.tensors()[0].dtype, DType::F8E4m3fn);
    assert_eq!(read_tensor(&dir, meta, 0), storage[8..40].to_vec());
    assert_eq!(read_tensor(&dir, meta, 1), values);
    let blobs = &opened.dcp().unwrap().blobs;
    assert_eq!(blobs[0].blob.storage_offset, 8);
    assert_eq!(blobs[1].blob.data_crc32, None);
}
