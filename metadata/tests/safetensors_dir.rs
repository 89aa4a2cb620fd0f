//! safetensors checkpoints read in place: a single file as the location, a directory of files, an
//! HF index (fixture f, written by torch's `HuggingFaceStorageWriter`), and DCP's HF writer layout
//! (`sharded/` files with `DCP_SHARDING_INFO`, an empty chunk included); every tensor has the
//! sha256 torch recorded. Bad headers and indexes fail naming the file: a header over the cap,
//! overlapping ranges, ranges past the end, index entries the files do not have.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::collections::BTreeMap;
use std::path::Path;

use dcp_support::{expected, fixtures, open, read_tensor, sha256};
use tessera_metadata::formats::SafetensorsLayout;
use tessera_metadata::formats::safetensors::{TensorView, serialize};
use tessera_metadata::{DType, Format, TensorBox};

fn error(dir: &Path) -> String {
    open(dir).unwrap_err().to_string()
}

/// sha256 of every tensor of h's expected.json, under its HF name (no `model.` prefix) too.
fn h_shas() -> BTreeMap<String, String> {
    let expected = expected("h_reference_full_safetensors");
    let mut out = BTreeMap::new();
    for (k, v) in expected["entries"].as_object().unwrap() {
        let sha = v["sha256"].as_str().unwrap().to_string();
        if let Some(hf) = k.strip_prefix("model.") {
            out.insert(hf.to_string(), sha.clone());
        }
        out.insert(k.clone(), sha);
    }
    out
}

#[test]
fn a_single_file_location() {
    let file = fixtures().join("h_reference_full_safetensors/model.safetensors");
    let opened = open(&file).unwrap();
    assert_eq!(opened.format, Format::Safetensors);
    assert_eq!(opened.root.as_ref(), "");
    let st = opened.safetensors().unwrap();
    assert_eq!(st.layout, SafetensorsLayout::SingleFile);
    assert_eq!(opened.meta.files()[0].path, "model.safetensors");
    let shas = h_shas();
    let dir = file.parent().unwrap();
    for (t, tensor) in opened.meta.tensors().iter().enumerate() {
        assert_eq!(
            sha256(&read_tensor(dir, &opened.meta, t as u32)),
            shas[&tensor.fqn],
            "{}",
            tensor.fqn
        );
    }
    assert_eq!(opened.meta.tensors().len(), 32);
}

#[test]
fn a_directory_of_files() {
    let dir = fixtures().join("h_reference_full_safetensors");
    let opened = open(&dir).unwrap();
    let st = opened.safetensors().unwrap();
    assert_eq!(st.layout, SafetensorsLayout::Directory);
    assert_eq!(st.files.len(), 2);
    assert_eq!(opened.meta.tensors().len(), 32 + 51);
    let shas = h_shas();
    for (t, tensor) in opened.meta.tensors().iter().enumerate() {
        assert_eq!(
            sha256(&read_tensor(&dir, &opened.meta, t as u32)),
            shas[&tensor.fqn],
            "{}",
            tensor.fqn
        );
    }
}

#[test]
fn an_hf_index_written_by_torch() {
    let dir = fixtures().join("f_hf_w1_full");
    let opened = open(&dir).unwrap();
    let st = opened.safetensors().unwrap();
    assert_eq!(st.layout, SafetensorsLayout::Index);
    assert_eq!(st.files[0].header.metadata["DCP_VERSION"], "1.0");
    let expected = expected("f_hf_w1_full");
    let entries = expected["entries_by_dir"]["."].as_object().unwrap();
    assert_eq!(opened.meta.tensors().len(), entries.len());
    for (t, tensor) in opened.meta.tensors().iter().enumerate() {
        assert_eq!(
            sha256(&read_tensor(&dir, &opened.meta, t as u32)),
            entries[&tensor.fqn]["sha256"].as_str().unwrap(),
            "{}",
            tensor.fqn
        );
    }
    // Headers only: the first 16 KiB of each file (one request each) for 270 KiB of tensors.
    assert_eq!(st.header_bytes, 2 * 16 * 1024);
}

/// One rank's chunk of a tensor in a `sharded/` file.
struct Shard {
    name: String,
    dtype: DType,
    shape: Vec<u64>,
    data: Vec<u8>,
    offsets: Vec<u64>,
}

/// Writes h's model.safetensors as DCP's HF writer does with `save_distributed=True`: two rank
/// files in `sharded/`, every 2-d tensor split by rows (rank 1 gets an empty chunk for
/// `tiny.weight`'s 3 rows split 3/0), with `DCP_SHARDING_INFO`.
fn dcp_sharded(tmp: &Path) -> std::path::PathBuf {
    let dir = tmp.join("hf");
    dcp_sharded_into(&dir.join("sharded"), 2, None);
    dir
}

/// Writes h's tensors into `dir` as a DCP HF save by `ranks` ranks (rows split evenly; 2 ranks
/// give `tiny.weight` to rank 0 whole), every byte set to `fill` when given (a save of other
/// values).
fn dcp_sharded_into(dir: &Path, ranks: u64, fill: Option<u8>) {
    let source =
        std::fs::read(fixtures().join("h_reference_full_safetensors/model.safetensors")).unwrap();
    let header =
        tessera_metadata::formats::safetensors::parse(&source, "model.safetensors").unwrap();
    std::fs::create_dir_all(dir).unwrap();
    for rank in 0..ranks {
        let mut owned: Vec<Shard> = Vec::new();
        for t in &header.tensors {
            let (a, b) = t.data_offsets;
            let bytes = &source[(header.data_start + a) as usize..(header.data_start + b) as usize];
            let filled = fill.map(|f| vec![f; bytes.len()]);
            let bytes = filled.as_deref().unwrap_or(bytes);
            if t.shape.len() == 2 {
                let rows = t.shape[0];
                let per = if t.name == "tiny.weight" && ranks == 2 {
                    rows
                } else {
                    rows.div_ceil(ranks)
                };
                let (start, end) = ((rank * per).min(rows), ((rank + 1) * per).min(rows));
                let row_bytes = (t.shape[1] * t.dtype.size()) as usize;
                owned.push(Shard {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: vec![end - start, t.shape[1]],
                    data: bytes[start as usize * row_bytes..end as usize * row_bytes].to_vec(),
                    offsets: vec![start, 0],
                });
            } else if rank == 0 {
                owned.push(Shard {
                    name: t.name.clone(),
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data: bytes.to_vec(),
                    offsets: vec![0; t.shape.len()],
                });
            }
        }
        let info: serde_json::Map<String, serde_json::Value> = owned
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    serde_json::json!({"saved_offsets": c.offsets}),
                )
            })
            .collect();
        let mut metadata = BTreeMap::new();
        metadata.insert("DCP_VERSION".to_string(), "1.0".to_string());
        metadata.insert(
            "DCP_SHARDING_INFO".to_string(),
            serde_json::Value::Object(info).to_string(),
        );
        let views: Vec<TensorView<'_>> = owned
            .iter()
            .map(|c| TensorView {
                name: &c.name,
                dtype: c.dtype,
                shape: &c.shape,
                data: &c.data,
            })
            .collect();
        std::fs::write(
            dir.join(format!(
                "shard-0000{}-model-00001-of-00001.safetensors",
                rank + 1
            )),
            serialize(&views, Some(&metadata)).unwrap(),
        )
        .unwrap();
    }
}

#[test]
fn dcp_hf_writer_sharded_files() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = dcp_sharded(tmp.path());
    let opened = open(&dir).unwrap();
    let st = opened.safetensors().unwrap();
    assert_eq!(st.layout, SafetensorsLayout::DcpSharded);
    assert_eq!(
        opened.meta.files()[1].path,
        "sharded/shard-00002-model-00001-of-00001.safetensors"
    );
    let meta = &opened.meta;
    let shas = h_shas();
    for (t, tensor) in meta.tensors().iter().enumerate() {
        assert_eq!(
            sha256(&read_tensor(&dir, meta, t as u32)),
            shas[&tensor.fqn],
            "{}",
            tensor.fqn
        );
    }
    let t = meta.tensor_index("tiny.weight").unwrap();
    assert_eq!(meta.tensors()[t as usize].shape, vec![3, 5]);
    let regions: Vec<_> = meta.chunks_of(t).iter().map(|c| c.region.clone()).collect();
    assert_eq!(
        regions,
        vec![
            TensorBox::new(vec![0, 0], vec![3, 5]),
            TensorBox::new(vec![3, 0], vec![0, 5])
        ]
    );
    let t = meta.tensor_index("pos_emb.weight").unwrap();
    assert_eq!(meta.tensors()[t as usize].shape, vec![98, 64]);
    assert_eq!(meta.chunks_of(t).len(), 2);
}

/// Sets the modification time of `dir/name` to `seconds_ago` before a fixed moment (the same
/// for every call, so equal ages are equal times).
fn age(dir: &Path, name: &str, seconds_ago: u64) {
    static BASE: std::sync::OnceLock<std::time::SystemTime> = std::sync::OnceLock::new();
    let base = *BASE.get_or_init(std::time::SystemTime::now);
    let when = base - std::time::Duration::from_secs(seconds_ago);
    std::fs::File::options()
        .write(true)
        .open(dir.join(name))
        .unwrap()
        .set_modified(when)
        .unwrap();
}

fn shard_file(s: u64) -> String {
    format!("shard-0000{s}-model-00001-of-00001.safetensors")
}

/// Every tensor of `dir` has h's bytes (not the earlier save's fill).
fn holds_h(dir: &Path, opened: &tessera_metadata::OpenedCheckpoint) {
    let shas = h_shas();
    for (t, tensor) in opened.meta.tensors().iter().enumerate() {
        assert_eq!(
            sha256(&read_tensor(dir, &opened.meta, t as u32)),
            shas[&tensor.fqn],
            "{}",
            tensor.fqn
        );
    }
}

/// A directory DCP's HF writer saved into twice: by 3 ranks (other values), then by 2, which
/// overwrote shards 1 and 2. Shard 3 of the first save is left behind, older, and overlaps
/// shard 2: the checkpoint is the second save's two files, the stray is named in a warning, and
/// every tensor has the second save's bytes.
#[test]
fn files_an_earlier_save_left_in_a_reused_directory_are_ignored_and_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    dcp_sharded_into(&dir, 3, Some(0x7f));
    age(&dir, &shard_file(3), 60);
    dcp_sharded_into(&dir, 2, None);
    let opened = open(&dir).unwrap();
    let names: Vec<&str> = opened
        .meta
        .files()
        .iter()
        .map(|f| f.path.as_str())
        .collect();
    assert_eq!(names, [shard_file(1), shard_file(2)]);
    assert_eq!(opened.safetensors().unwrap().ignored, [shard_file(3)]);
    let warnings = opened.warnings();
    assert_eq!(warnings.len(), 1);
    assert!(
        warnings[0].contains(&format!(
            "ignored 1 file(s) of an earlier DCP save into the same directory: {}",
            shard_file(3)
        )),
        "{warnings:?}"
    );
    holds_h(&dir, &opened);
    // The identity is the newest save's alone: removing the stray changes nothing.
    std::fs::remove_file(dir.join(shard_file(3))).unwrap();
    let clean = open(&dir).unwrap();
    assert_eq!(clean.meta.identity(), opened.meta.identity());
    assert!(clean.warnings().is_empty());
}

/// The newest save need not be a prefix of shard indices: with replicas only some ranks write
/// (here shards 1 and 3 hold the new save whole), and the earlier save's shards 2 and 4 stay.
#[test]
fn the_newest_save_is_told_by_modification_time_not_by_shard_index() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    dcp_sharded_into(&dir, 4, Some(0x11));
    for s in 1..=4 {
        age(&dir, &shard_file(s), 120);
    }
    // The new save: 2 ranks' worth of data in the files of shards 1 and 3.
    let new = tmp.path().join("new");
    dcp_sharded_into(&new, 2, None);
    std::fs::copy(new.join(shard_file(1)), dir.join(shard_file(1))).unwrap();
    std::fs::copy(new.join(shard_file(2)), dir.join(shard_file(3))).unwrap();
    let opened = open(&dir).unwrap();
    assert_eq!(
        opened.safetensors().unwrap().ignored,
        [shard_file(2), shard_file(4)]
    );
    holds_h(&dir, &opened);
}

/// Overlapping files written at the same moment say nothing about which is newer: not guessed
/// at, the overlap is refused as before.
#[test]
fn overlapping_files_of_the_same_age_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    dcp_sharded_into(&dir, 3, Some(0x7f));
    dcp_sharded_into(&dir, 2, None);
    for s in 1..=3 {
        age(&dir, &shard_file(s), 30);
    }
    let err = error(&dir);
    assert!(err.contains("overlap"), "{err}");
}

/// A directory with one safetensors file: `header` JSON and `data` bytes.
fn raw_file(tmp: &Path, header: &str, data: &[u8]) -> std::path::PathBuf {
    let dir = tmp.join("st");
    std::fs::create_dir_all(&dir).unwrap();
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(header.as_bytes());
    file.extend_from_slice(data);
    std::fs::write(dir.join("model.safetensors"), file).unwrap();
    dir
}

#[test]
fn bad_headers_name_the_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("st");
    std::fs::create_dir_all(&dir).unwrap();
    let mut big = (100u64 * 1024 * 1024 + 1).to_le_bytes().to_vec();
    big.extend_from_slice(b"{}");
    std::fs::write(dir.join("model.safetensors"), &big).unwrap();
    assert_eq!(
        error(&dir),
        "st/model.safetensors: cannot decode safetensors header: header of 104857601 bytes exceeds the 104857600-byte cap"
    );

    let dir = raw_file(
        tmp.path(),
        r#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#,
        &[0; 4],
    );
    assert_eq!(
        error(&dir),
        "st/model.safetensors: cannot decode safetensors header: tensor b: bytes 2..4 overlap the previous tensor (ending at 4)"
    );

    let dir = raw_file(
        tmp.path(),
        r#"{"a":{"dtype":"F32","shape":[100],"data_offsets":[0,400]}}"#,
        &[0; 100],
    );
    assert_eq!(
        error(&dir),
        "st/model.safetensors: cannot decode safetensors header: tensor a: bytes 0..400 reach past the end of the 166-byte file"
    );

    let dir = raw_file(
        tmp.path(),
        r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#,
        &[0; 6],
    );
    assert_eq!(
        error(&dir),
        "st/model.safetensors: cannot decode safetensors header: bytes 2..4 before tensor b belong to no tensor (a hole)"
    );

    // A header length past the end of the file (a truncated file).
    let mut short = 4096u64.to_le_bytes().to_vec();
    short.extend_from_slice(b"{\"a\":");
    std::fs::write(dir.join("model.safetensors"), &short).unwrap();
    assert_eq!(
        error(&dir),
        "st/model.safetensors: cannot decode safetensors header: header of 4096 bytes but the file has 5 bytes after the length"
    );
}

#[test]
fn index_entries_must_resolve() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = raw_file(
        tmp.path(),
        r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
        &[1, 2],
    );
    let index = |map: &str| {
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            format!(r#"{{"metadata": {{"total_size": 2}}, "weight_map": {map}}}"#),
        )
        .unwrap();
    };
    index(r#"{"a": "model.safetensors", "b": "model.safetensors"}"#);
    assert_eq!(
        error(&dir),
        "invalid checkpoint metadata: st/model.safetensors.index.json maps tensor b to model.safetensors, but model.safetensors has no tensor b"
    );
    index(r#"{"a": "model.safetensors", "c": "model-2.safetensors"}"#);
    assert_eq!(
        error(&dir),
        "invalid checkpoint metadata: safetensors file st/model-2.safetensors does not exist (model.safetensors.index.json names it)"
    );
    index(r#"{"a": "model.safetensors"}"#);
    let opened = open(&dir).unwrap();
    assert_eq!(opened.meta.tensors()[0].fqn, "a");
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        b"{\"weight_map\": 3}",
    )
    .unwrap();
    assert_eq!(
        error(&dir),
        "st/model.safetensors.index.json: cannot decode safetensors index: no weight_map object"
    );
}

#[test]
fn a_tensor_in_two_files_without_sharding_info_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = raw_file(
        tmp.path(),
        r#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}"#,
        &[1, 2],
    );
    std::fs::copy(dir.join("model.safetensors"), dir.join("other.safetensors")).unwrap();
    assert_eq!(
        error(&dir),
        "invalid checkpoint metadata: st: tensor a is in both model.safetensors and other.safetensors (and neither says how it is sharded)"
    );
}

#[test]
fn a_directory_with_nothing_readable_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("empty");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("notes.txt"), b"hi").unwrap();
    assert_eq!(
        error(&dir),
        "empty: not a checkpoint tessera can read: no manifest.json (tessera), .metadata (PyTorch DCP), model.safetensors.index.json or *.safetensors files"
    );
}

/// Writes `<dir>/<name>` as a safetensors file holding one f32 tensor `t<k>` of 4 elements.
fn write_shard(dir: &Path, name: &str, k: u32) {
    let data: Vec<u8> = (0..16u8).map(|b| b.wrapping_add(k as u8)).collect();
    let tensor = format!("t{k}");
    let views = [TensorView {
        name: &tensor,
        dtype: DType::F32,
        shape: &[4],
        data: &data,
    }];
    std::fs::write(dir.join(name), serialize(&views, None).unwrap()).unwrap();
}

/// An export killed after two of its three shards (before its index): the directory of shards is
/// refused naming the missing one, never read as a model with a third of its tensors absent.
#[test]
fn an_incomplete_shard_set_without_index_is_refused_naming_the_missing_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("hf");
    std::fs::create_dir_all(&dir).unwrap();
    write_shard(&dir, "model-00001-of-00003.safetensors", 1);
    write_shard(&dir, "model-00003-of-00003.safetensors", 3);
    assert_eq!(
        error(&dir),
        "invalid checkpoint metadata: hf: incomplete safetensors shard set: model-00002-of-00003.safetensors missing (2 of 3 shards of model-*-of-00003.safetensors present), and there is no model.safetensors.index.json (an interrupted export or a partial copy?)"
    );
    // The complete set opens (an export killed between its last shard and its index lost
    // nothing), and so do files that are not named as shards.
    write_shard(&dir, "model-00002-of-00003.safetensors", 2);
    let opened = open(&dir).unwrap();
    assert_eq!(opened.meta.tensors().len(), 3);
    write_shard(&dir, "extra.safetensors", 4);
    assert_eq!(open(&dir).unwrap().meta.tensors().len(), 4);
    // A shard number past the count is as wrong as a missing one.
    write_shard(&dir, "model-00004-of-00003.safetensors", 5);
    assert_eq!(
        error(&dir),
        "invalid checkpoint metadata: hf: incomplete safetensors shard set: model-00004-of-00003.safetensors is not one of 3 shards, and there is no model.safetensors.index.json (an interrupted export or a partial copy?)"
    );
}
