//! The DeepSpeed reader against a ZeRO-2 checkpoint DeepSpeed 0.19.8 wrote (2 ranks, AdamW, one
//! step): the fp32 master weights assembled from both ranks' flat partitions equal DeepSpeed's own
//! `zero_to_fp32` export byte for byte (and the engine's parameters in `expected.json`), the
//! optimizer moments sit at the right elements, the module weights are there, objects decode, and
//! damaged copies fail naming the file.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::path::{Path, PathBuf};

use dcp_support::{copy_dir_writable, open, read_tensor, sha256};
use tessera_metadata::{DType, Format, MetadataError};

fn fixture() -> PathBuf {
    let dir = std::env::var_os("TESSERA_INTEROP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/interop")
        })
        .join("deepspeed_0.19.8_zero2_w2");
    assert!(
        dir.join("ckpt/latest").exists(),
        "DeepSpeed fixture not found at {} (set TESSERA_INTEROP_FIXTURES)",
        dir.display()
    );
    dir
}

const PARAMS: [&str; 8] = [
    "emb.weight",
    "l1.weight",
    "l1.bias",
    "l2.weight",
    "l2.bias",
    "norm.weight",
    "norm.bias",
    "head.weight",
];

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// A writable copy of the fixture's `ckpt/`.
fn copy_ckpt(into: &Path) -> PathBuf {
    let to = into.join("ckpt");
    copy_dir_writable(&fixture().join("ckpt"), &to);
    to
}

#[test]
fn fp32_weights_equal_zero_to_fp32_byte_for_byte() {
    let dir = fixture();
    let opened = open(&dir.join("ckpt")).unwrap();
    assert_eq!(opened.format, Format::DeepSpeed);
    assert_eq!(
        opened.writer.as_ref().unwrap().to_string(),
        "DeepSpeed ZeRO-2 (version 0.19.8)"
    );
    assert_eq!(opened.step, Some(1));
    assert!(opened.meta.identity().unwrap().starts_with("deepspeed:"));
    let details = opened.deepspeed().unwrap();
    assert_eq!(
        (details.tag.as_deref(), details.dp_world_size),
        (Some("global_step1"), 2)
    );
    let reference = open(&dir.join("zero_to_fp32_out")).unwrap();
    let expected = serde_json::from_str::<serde_json::Value>(
        &std::fs::read_to_string(dir.join("expected.json")).unwrap(),
    )
    .unwrap();
    let meta = &opened.meta;
    let root = dir.join("ckpt");
    for fqn in PARAMS {
        let t = meta.tensor_index(fqn).unwrap();
        let r = reference.meta.tensor_index(fqn).unwrap();
        let tensor = &meta.tensors()[t as usize];
        assert_eq!(
            tensor.shape,
            reference.meta.tensors()[r as usize].shape,
            "{fqn}"
        );
        assert_eq!(tensor.dtype, DType::F32, "{fqn}");
        let ours = read_tensor(&root, meta, t);
        let theirs = read_tensor(&dir.join("zero_to_fp32_out"), &reference.meta, r);
        assert!(ours == theirs, "{fqn}: bytes differ from zero_to_fp32's");
        assert_eq!(
            sha256(&ours),
            expected["tensors"][fqn]["sha256"].as_str().unwrap(),
            "{fqn}"
        );
        // fp32 training: the module state dict holds the same (updated) parameters.
        let m = meta.tensor_index(&format!("module.{fqn}")).unwrap();
        assert!(read_tensor(&root, meta, m) == ours, "module.{fqn}");
    }
    // l2.weight straddles the two partitions: flat-range chunks from both files.
    let l2 = meta.tensor_index("l2.weight").unwrap();
    let files: std::collections::BTreeSet<u32> =
        meta.chunks_of(l2).iter().map(|c| c.bytes.file).collect();
    assert_eq!(files.len(), 2);
}

#[test]
fn adam_moments_are_at_their_parameters_elements() {
    let dir = fixture();
    let opened = open(&dir.join("ckpt")).unwrap();
    let meta = &opened.meta;
    let root = dir.join("ckpt");
    for fqn in PARAMS {
        let shape = &meta.tensors()[meta.tensor_index(fqn).unwrap() as usize].shape;
        let mut moments = Vec::new();
        for key in ["exp_avg", "exp_avg_sq"] {
            let name = format!("optimizer.state.{fqn}.{key}");
            let t = meta
                .tensor_index(&name)
                .unwrap_or_else(|| panic!("no {name}"));
            let tensor = &meta.tensors()[t as usize];
            assert_eq!((&tensor.shape, tensor.dtype), (shape, DType::F32), "{name}");
            moments.push(f32s(&read_tensor(&root, meta, t)));
        }
        // After one AdamW step m = (1-b1)·g and v = (1-b2)·g², so v = 0.1·m² element by element:
        // a moment taken from the wrong elements breaks it.
        for (i, (m, v)) in moments[0].iter().zip(&moments[1]).enumerate() {
            let want = 0.1 * m * m;
            assert!(
                (v - want).abs() <= 1e-5 * want.abs() + 1e-30,
                "{fqn}[{i}]: exp_avg {m} exp_avg_sq {v}"
            );
        }
    }
    // Embedding rows of tokens not in the batch had no gradient: their moments are zero rows,
    // the others have no zero, so the rows line up with the parameter's rows.
    let t = meta
        .tensor_index("optimizer.state.emb.weight.exp_avg")
        .unwrap();
    let m = f32s(&read_tensor(&root, meta, t));
    let (mut zero, mut live) = (0, 0);
    for row in m.chunks(64) {
        if row.iter().all(|&x| x == 0.0) {
            zero += 1;
        } else {
            assert!(row.iter().all(|&x| x != 0.0), "a partly zero embedding row");
            live += 1;
        }
    }
    assert!(zero > 0 && live > 0, "{zero} zero rows, {live} live rows");
}

#[test]
fn objects_are_the_model_states_simple_values() {
    let opened = open(&fixture().join("ckpt")).unwrap();
    let details = opened.deepspeed().unwrap();
    let value = |key: &str| {
        details
            .objects
            .iter()
            .find(|(k, _)| k == key)
            .unwrap_or_else(|| panic!("no object {key}"))
            .1
            .clone()
            .unwrap()
    };
    assert_eq!(value("ds_version"), "0.19.8");
    assert_eq!(value("global_steps"), 1);
    assert_eq!(value("note"), "interop");
    assert_eq!(value("ds_config")["zero_optimization"]["stage"], 2);
    assert_eq!(value("optimizer.param_groups")[0]["lr"], 0.01);
    let keys: Vec<&str> = opened
        .meta
        .objects()
        .iter()
        .map(|o| o.key.as_str())
        .collect();
    assert_eq!(keys.len(), details.objects.len());
    assert!(!keys.contains(&"module") && !keys.contains(&"param_shapes"));
}

#[test]
fn the_tag_directory_opens_on_its_own() {
    let opened = open(&fixture().join("ckpt/global_step1")).unwrap();
    assert_eq!(opened.format, Format::DeepSpeed);
    assert_eq!(opened.step, Some(1));
    assert_eq!(opened.deepspeed().unwrap().tag, None);
    assert!(opened.meta.tensor_index("l2.weight").is_some());
}

#[test]
fn a_truncated_partition_file_fails_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = copy_ckpt(tmp.path());
    let file = ckpt.join("global_step1/zero_pp_rank_1_mp_rank_00_optim_states.pt");
    let bytes = std::fs::read(&file).unwrap();
    std::fs::write(&file, &bytes[..bytes.len() / 2]).unwrap();
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(
        err.contains("global_step1/zero_pp_rank_1_mp_rank_00_optim_states.pt"),
        "{err}"
    );
    assert!(err.contains("end of central directory"), "{err}");
}

#[test]
fn a_partition_of_another_rank_fails_naming_the_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = copy_ckpt(tmp.path());
    let dir = ckpt.join("global_step1");
    std::fs::copy(
        dir.join("zero_pp_rank_0_mp_rank_00_optim_states.pt"),
        dir.join("zero_pp_rank_1_mp_rank_00_optim_states.pt"),
    )
    .unwrap();
    let err = open(&ckpt).unwrap_err();
    assert!(matches!(err, MetadataError::Blob { .. }), "{err:?}");
    let err = err.to_string();
    assert!(
        err.contains("zero_pp_rank_1_mp_rank_00_optim_states.pt")
            && err.contains("tensor emb.weight: param_slice_mappings[0] puts 6144 elements at 0"),
        "{err}"
    );
}

#[test]
fn a_missing_rank_fails_naming_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = copy_ckpt(tmp.path());
    std::fs::remove_file(ckpt.join("global_step1/zero_pp_rank_1_mp_rank_00_optim_states.pt"))
        .unwrap();
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(
        err.contains("zero_pp_rank_0_mp_rank_00_optim_states.pt")
            && err.contains("partition_count is 2, but there are 1 optimizer states files"),
        "{err}"
    );
}

#[test]
fn a_storage_record_shorter_than_its_tensor_fails_naming_file_and_partition() {
    // A copy whose central directory says rank 0's flat fp32 partition (record data/3 of this
    // file, after the step and the two moments) is 4 bytes shorter than data.pkl's tensor.
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = copy_ckpt(tmp.path());
    let file = ckpt.join("global_step1/zero_pp_rank_0_mp_rank_00_optim_states.pt");
    let mut bytes = std::fs::read(&file).unwrap();
    // The central directory entry of the first data record: signature PK\1\2, name ".../data/0".
    let name = b"/data/3";
    let at = (0..bytes.len() - 46)
        .find(|&i| {
            bytes[i..i + 4] == [0x50, 0x4b, 0x01, 0x02] && {
                let n = u16::from_le_bytes([bytes[i + 28], bytes[i + 29]]) as usize;
                bytes[i + 46..i + 46 + n].ends_with(name)
            }
        })
        .unwrap();
    for off in [20, 24] {
        let v = u32::from_le_bytes(bytes[at + off..at + off + 4].try_into().unwrap());
        bytes[at + off..at + off + 4].copy_from_slice(&(v - 4).to_le_bytes());
    }
    std::fs::write(&file, &bytes).unwrap();
    let err = open(&ckpt).unwrap_err().to_string();
    assert!(
        err.contains("zero_pp_rank_0_mp_rank_00_optim_states.pt")
            && err.contains("rank 0 flat fp32 group 0")
            && err.contains("holds 66236 bytes but data.pkl says 66240"),
        "{err}"
    );
}
