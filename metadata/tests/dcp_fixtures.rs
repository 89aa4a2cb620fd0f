//! The DCP reader against checkpoints PyTorch 2.15 wrote (plain, FSDP shard(0) with an empty
//! chunk, dp2×tp2 with deduplicated replicas, FSDP2 + AdamW after real training): every saved
//! chunk read through its `ByteMeta` has the sha256 torch recorded, every tensor assembled from its
//! chunks has the full sha256, objects decode to their Python values, and the blob index is
//! built once and then served from memory or a cache directory.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::sync::Arc;

use dcp_support::{
    DCP_FIXTURES, expected, fixtures, open, open_with, read_box, read_tensor, sha256,
};
use serde_json::json;
use tessera_metadata::formats::dcp::{IndexCache, IndexSource, decode_object};
use tessera_metadata::formats::safetensors;
use tessera_metadata::{DType, Format, OpenOptions, TensorBox};

#[test]
fn every_chunk_and_tensor_has_the_bytes_torch_saved() {
    for fixture in DCP_FIXTURES {
        let dir = fixtures().join(fixture);
        let opened = open(&dir).unwrap();
        assert_eq!(opened.format, Format::Dcp, "{fixture}");
        assert!(opened.block_checksums.is_none());
        let meta = &opened.meta;
        let expected = expected(fixture);
        let entries = expected["entries"].as_object().unwrap();
        let tensors: Vec<_> = entries
            .iter()
            .filter(|(_, e)| e["kind"] == "tensor")
            .collect();
        let objects: Vec<_> = entries
            .iter()
            .filter(|(_, e)| e["kind"] == "bytes")
            .collect();
        assert_eq!(meta.tensors().len(), tensors.len(), "{fixture}: tensors");
        assert_eq!(meta.objects().len(), objects.len(), "{fixture}: objects");
        for (fqn, entry) in tensors {
            let t = meta
                .tensor_index(fqn)
                .unwrap_or_else(|| panic!("{fixture}: no {fqn}"));
            let tensor = &meta.tensors()[t as usize];
            assert_eq!(
                tensor.dtype,
                DType::parse(entry["dtype"].as_str().unwrap()).unwrap(),
                "{fixture} {fqn}"
            );
            let shape: Vec<u64> = serde_json::from_value(entry["shape"].clone()).unwrap();
            assert_eq!(tensor.shape, shape, "{fixture} {fqn}");
            let chunks = entry["chunks"].as_array().unwrap();
            assert_eq!(meta.chunks_of(t).len(), chunks.len(), "{fixture} {fqn}");
            let first = meta.first_chunk_index(t);
            for chunk in chunks {
                let offsets: Vec<u64> = serde_json::from_value(chunk["offsets"].clone()).unwrap();
                let sizes: Vec<u64> = serde_json::from_value(chunk["sizes"].clone()).unwrap();
                let k = meta
                    .chunks_of(t)
                    .iter()
                    .position(|c| c.region.offsets.as_slice() == offsets.as_slice())
                    .unwrap();
                let saved = &meta.chunks()[first + k];
                assert_eq!(saved.region, TensorBox::new(offsets, sizes.clone()));
                assert_eq!(
                    meta.files()[saved.bytes.file as usize].path,
                    chunk["file"].as_str().unwrap()
                );
                // The storage lies inside the blob torch wrote.
                let blob_start = chunk["byte_offset"].as_u64().unwrap();
                let blob_end = blob_start + chunk["byte_length"].as_u64().unwrap();
                assert!(
                    saved.bytes.offset >= blob_start
                        && saved.bytes.offset + saved.bytes.length <= blob_end
                );
                let bytes = read_box(&dir, meta, first + k, &saved.region);
                assert_eq!(
                    sha256(&bytes),
                    chunk["chunk_sha256"].as_str().unwrap(),
                    "{fixture} {fqn} chunk {}",
                    saved.region
                );
            }
            assert_eq!(
                sha256(&read_tensor(&dir, meta, t)),
                entry["sha256"].as_str().unwrap(),
                "{fixture} {fqn}: full tensor"
            );
        }
        for (key, entry) in objects {
            let object = meta.objects().iter().find(|o| &o.key == key).unwrap();
            assert_eq!(
                (
                    meta.files()[object.file as usize].path.as_str(),
                    object.offset,
                    object.length
                ),
                (
                    entry["file"].as_str().unwrap(),
                    entry["byte_offset"].as_u64().unwrap(),
                    entry["byte_length"].as_u64().unwrap()
                ),
                "{fixture} {key}"
            );
            let file = std::fs::read(dir.join(&meta.files()[object.file as usize].path)).unwrap();
            let blob = &file[object.offset as usize..(object.offset + object.length) as usize];
            assert_eq!(sha256(blob), entry["blob_sha256"].as_str().unwrap());
        }
    }
}

#[test]
fn the_transposed_lm_head_keeps_its_strides() {
    let opened = open(&fixtures().join("a_w1_plain")).unwrap();
    let meta = &opened.meta;
    let t = meta.tensor_index("model.lm_head.weight").unwrap();
    let chunk = &meta.chunks_of(t)[0];
    assert_eq!(chunk.bytes.strides, Some(vec![1, 96]));
    assert_eq!(chunk.bytes.length, 96 * 64 * 4);
    // A row slice of the transposed storage: rows 10..13, columns 5..9.
    let region = TensorBox::new(vec![10, 5], vec![3, 4]);
    let bytes = read_box(
        &fixtures().join("a_w1_plain"),
        meta,
        meta.first_chunk_index(t),
        &region,
    );
    let full = read_tensor(&fixtures().join("a_w1_plain"), meta, t);
    let mut want = Vec::new();
    for r in 10..13 {
        want.extend_from_slice(&full[(r * 64 + 5) * 4..(r * 64 + 9) * 4]);
    }
    assert_eq!(bytes, want);
    // Every other chunk of the fixture is row-major.
    let strided = meta
        .chunks()
        .iter()
        .filter(|c| c.bytes.strides.is_some())
        .count();
    assert_eq!(strided, 1);
}

#[test]
fn metadata_fields_and_the_empty_chunk() {
    let opened = open(&fixtures().join("b_w4_fsdp_shard0")).unwrap();
    let dcp = opened.dcp().unwrap();
    assert_eq!(dcp.metadata.version.as_deref(), Some("1.0.0"));
    assert_eq!(
        dcp.metadata.checkpoint_id.as_deref(),
        Some("/ckpt/b_w4_fsdp_shard0")
    );
    assert_eq!(
        dcp.metadata.planner_data["optim.param_groups.0.lr"],
        vec![json!("optim"), json!("param_groups"), json!(0), json!("lr")]
    );
    assert_eq!(dcp.metadata_files, vec![".metadata".to_string()]);
    let meta = &opened.meta;
    let t = meta.tensor_index("model.tiny.weight").unwrap();
    let empty = meta
        .chunks_of(t)
        .iter()
        .find(|c| c.region.is_empty())
        .unwrap();
    assert_eq!(empty.region, TensorBox::new(vec![3, 0], vec![0, 5]));
    assert_eq!(empty.bytes.length, 0);
    assert_eq!(opened.step, None);
}

#[test]
fn objects_decode_to_their_python_values() {
    let dir = fixtures().join("a_w1_plain");
    let opened = open(&dir).unwrap();
    let meta = &opened.meta;
    let file = std::fs::read(dir.join("__0_0.distcp")).unwrap();
    let value = |key: &str| {
        let o = meta.objects().iter().find(|o| o.key == key).unwrap();
        decode_object(&file[o.offset as usize..(o.offset + o.length) as usize]).unwrap()
    };
    assert_eq!(value("optim.param_groups.0.lr"), json!(0.0003));
    assert_eq!(value("optim.param_groups.0.betas"), json!([0.9, 0.95]));
    assert_eq!(value("optim.param_groups.0.eps"), json!(1e-08));
    assert_eq!(value("optim.param_groups.0.weight_decay"), json!(0.1));
    assert_eq!(
        value("optim.param_groups.0.params"),
        json!([
            "tok_emb.weight",
            "pos_emb.weight",
            "layers.0.attn.qkv.weight",
            "layers.0.mlp.fc1.weight",
            "layers.1.attn.proj.weight",
            "layers.1.mlp.fc2.bias"
        ])
    );
    assert_eq!(
        value("extra.note"),
        json!({"__bytes__": "6463702d6669787475726500ff01"})
    );
    assert_eq!(value("extra.config.vocab"), json!(96));
    assert_eq!(value("extra.config.name"), json!("tiny-gpt"));
    assert_eq!(value("extra.milestones"), json!([100, 200, 300]));

    let dir = fixtures().join("e_w2_fsdp2_adamw");
    let opened = open(&dir).unwrap();
    let meta = &opened.meta;
    let file = std::fs::read(dir.join("__1_0.distcp")).unwrap();
    let value = |key: &str| {
        let o = meta.objects().iter().find(|o| o.key == key).unwrap();
        decode_object(&file[o.offset as usize..(o.offset + o.length) as usize]).unwrap()
    };
    assert_eq!(value("optim.param_groups.0.amsgrad"), json!(false));
    assert_eq!(
        value("optim.param_groups.0.decoupled_weight_decay"),
        json!(true)
    );
    assert_eq!(value("optim.param_groups.0.foreach"), json!(null));
    assert_eq!(value("train_state.step"), json!(2));
    assert_eq!(value("train_state.last_loss"), json!(4.565183639526367));
    // A tensor blob is not a simple value.
    let t = meta.tensor_index("model.tok_emb.weight").unwrap();
    let chunk = &opened.dcp().unwrap().blobs[meta.first_chunk_index(t)];
    let blob_file = std::fs::read(dir.join(&meta.files()[chunk.file as usize].path)).unwrap();
    let err =
        decode_object(&blob_file[chunk.offset as usize..(chunk.offset + chunk.length) as usize])
            .unwrap_err();
    assert_eq!(
        err.to_string(),
        "object: a tensor (torch._utils._rebuild_tensor_v2), which has no JSON form"
    );
}

#[test]
fn fsdp2_adamw_tensors_equal_the_gathered_full_values() {
    let dir = fixtures().join("e_w2_fsdp2_adamw");
    let opened = open(&dir).unwrap();
    let meta = &opened.meta;
    let full = std::fs::read(dir.join("expected_full.safetensors")).unwrap();
    let header = safetensors::parse(&full, "expected_full.safetensors").unwrap();
    assert_eq!(header.tensors.len(), meta.tensors().len());
    for entry in &header.tensors {
        let t = meta.tensor_index(&entry.name).unwrap();
        let (a, b) = entry.data_offsets;
        let want = &full[(header.data_start + a) as usize..(header.data_start + b) as usize];
        assert!(read_tensor(&dir, meta, t) == want, "{}", entry.name);
        // FSDP2 splits ffn=97 rows 49/48.
        if entry.name == "model.blocks.0.fc1.weight" {
            let regions: Vec<_> = meta
                .chunks_of(t)
                .iter()
                .map(|c| c.region.to_string())
                .collect();
            assert_eq!(regions, ["[0..49, 0..64]", "[49..97, 0..64]"]);
        }
    }
}

#[test]
fn the_blob_index_is_built_once_then_cached_in_memory_and_on_disk() {
    let dir = fixtures().join("c_w4_dp2_tp2");
    let cache_dir = tempfile::tempdir().unwrap();
    let cache = Arc::new(IndexCache::new(4));
    let mut options = OpenOptions::default();
    options.dcp.cache = Some(Arc::clone(&cache));
    options.dcp.cache_dir = Some(cache_dir.path().to_path_buf());

    let first = open_with(&dir, &options).unwrap();
    let stats = first.dcp().unwrap().stats.clone();
    let blobs = first.meta.chunks().len() as u64;
    assert_eq!(stats.source, IndexSource::Built);
    assert_eq!(stats.blobs, blobs);
    // Each blob costs its head and tail (1 KiB each) or the whole blob when smaller; adjacent
    // reads merge, so no more requests than blobs plus files.
    assert!(stats.bytes_read <= blobs * 2048, "{stats:?}");
    assert!(stats.requests <= blobs + 4, "{stats:?}");
    assert_eq!(cache.len(), 1);
    assert_eq!(std::fs::read_dir(cache_dir.path()).unwrap().count(), 1);

    let second = open_with(&dir, &options).unwrap();
    let stats = &second.dcp().unwrap().stats;
    assert_eq!(
        (stats.source, stats.requests, stats.bytes_read),
        (IndexSource::Memory, 0, 0)
    );
    assert_eq!(second.meta, first.meta);

    // Another process: nothing in memory, the cache directory has it.
    options.dcp.cache = Some(Arc::new(IndexCache::new(4)));
    let third = open_with(&dir, &options).unwrap();
    let stats = &third.dcp().unwrap().stats;
    assert_eq!((stats.source, stats.requests), (IndexSource::Disk, 0));
    assert_eq!(third.meta, first.meta);

    // A damaged cache file is rebuilt, not trusted.
    let cached = std::fs::read_dir(cache_dir.path())
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::write(&cached, b"{\"format\": \"nonsense\"}").unwrap();
    options.dcp.cache = None;
    let fourth = open_with(&dir, &options).unwrap();
    assert_eq!(fourth.dcp().unwrap().stats.source, IndexSource::Built);
    assert_eq!(fourth.meta, first.meta);
}
