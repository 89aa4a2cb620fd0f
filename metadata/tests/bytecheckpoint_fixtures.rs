//! ByteCheckpoint saves read in place: the real ByteCheckpoint 0.0.2 FSDP save (shared/fixtures/
//! interop) opened as a whole and per component, every tensor's bytes against ByteCheckpoint's
//! own full values (expected.json), its objects decoded, and the errors a damaged copy gives.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::path::{Path, PathBuf};

use dcp_support::{copy_dir_writable, open, read_tensor, sha256};
use serde_json::{Value, json};
use tessera_metadata::formats::dcp::decode_object;
use tessera_metadata::{Format, MetadataError, OpenedCheckpoint};

const FIXTURE: &str = "bytecheckpoint_0.0.2_torch2.5.0_fsdp_w2";

fn fixture() -> PathBuf {
    let dir = std::env::var_os("TESSERA_INTEROP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/interop")
        })
        .join(FIXTURE);
    assert!(
        dir.join("ckpt/model/.metadata").exists(),
        "ByteCheckpoint fixture not found at {} (set TESSERA_INTEROP_FIXTURES)",
        dir.display()
    );
    dir
}

/// expected.json's sha256 of every full tensor, except the Adam first moments (`*.exp_avg`):
/// for those, the fixture's expected.json (and references) hold the bytes of `exp_avg_sq` (an
/// aliasing in the generator's FULL_STATE_DICT optimizer gather on gloo), so where it shows
/// their truth is taken from the files as Python's own decoding of `storage_data`
/// (metadata_dump_optimizer.txt, whose byte ranges torch verified) gives them.
fn expected() -> serde_json::Map<String, Value> {
    let text = std::fs::read_to_string(fixture().join("expected.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let mut tensors = doc["tensors"].as_object().unwrap().clone();
    let truth = dumped_full_tensors("optimizer");
    for (key, entry) in tensors.iter_mut() {
        let Some(name) = key.strip_prefix("optimizer.") else {
            continue;
        };
        if !name.ends_with(".exp_avg") {
            continue;
        }
        // Only where the fixture has the flaw: a corrected expected.json is the truth.
        let sq = doc["tensors"][format!("{key}_sq")]["sha256"].clone();
        if entry["sha256"] != sq {
            continue;
        }
        assert_ne!(sha256(&truth[name]), sq.as_str().unwrap());
        entry["sha256"] = json!(sha256(&truth[name]));
    }
    tensors
}

/// Full tensors of a component as Python's dump of its `.metadata` locates them: every chunk's
/// `storage_data` byte range (raw storage bytes, as the dump verified with torch), chunks of
/// one tensor in order of their dim-0 offset (the fixture's FSDP chunks split dim 0 only).
fn dumped_full_tensors(component: &str) -> std::collections::HashMap<String, Vec<u8>> {
    let dir = fixture();
    let dump = std::fs::read_to_string(dir.join(format!("metadata_dump_{component}.txt"))).unwrap();
    let mut chunks: std::collections::HashMap<String, Vec<(u64, Vec<u8>)>> = Default::default();
    for line in dump.lines() {
        let line = line.trim();
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
        assert!(
            dims.iter().skip(1).all(|&d| d == 0),
            "{line}: not a dim-0 split"
        );
        let field = |name: &str| {
            let at = line.rfind(name).unwrap() + name.len();
            line[at..]
                .split([',', ')', '\''])
                .next()
                .unwrap()
                .to_string()
        };
        let file = field("relative_path='");
        let offset: usize = field(", offset=").parse().unwrap();
        let length: usize = field("length=").parse().unwrap();
        let bytes = std::fs::read(dir.join("ckpt").join(component).join(&file)).unwrap();
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

#[test]
fn every_chunk_lies_where_pythons_decoding_of_storage_data_puts_it() {
    // Independent of expected.json: tessera's assembly of every tensor equals the bytes Python's
    // own decoding of the metadata locates.
    let dir = fixture().join("ckpt");
    for component in ["model", "optimizer"] {
        let truth = dumped_full_tensors(component);
        let opened = open(&dir.join(component)).unwrap();
        assert_eq!(truth.len(), opened.meta.tensors().len(), "{component}");
        for (t, tensor) in opened.meta.tensors().iter().enumerate() {
            let bytes = read_tensor(&dir.join(component), &opened.meta, t as u32);
            assert!(bytes == truth[&tensor.fqn], "{component} {}", tensor.fqn);
        }
    }
}

/// Every tensor of `opened` (at `dir`), assembled from its chunks, equals expected.json's entry
/// `<prefix><fqn>` (shape, dtype and sha256); returns how many were checked.
fn check_tensors(dir: &Path, opened: &OpenedCheckpoint, prefix: &str) -> usize {
    let expected = expected();
    let meta = &opened.meta;
    for (t, tensor) in meta.tensors().iter().enumerate() {
        let want = &expected[&format!("{prefix}{}", tensor.fqn)];
        assert_eq!(want["shape"], json!(tensor.shape), "{}", tensor.fqn);
        assert_eq!(want["dtype"], json!("float32"), "{}", tensor.fqn);
        let bytes = read_tensor(dir, meta, t as u32);
        assert_eq!(
            sha256(&bytes),
            want["sha256"].as_str().unwrap(),
            "{}: bytes differ from ByteCheckpoint's own full value",
            tensor.fqn
        );
    }
    meta.tensors().len()
}

#[test]
fn each_component_opens_on_its_own_with_bytecheckpoints_names() {
    let dir = fixture().join("ckpt");
    let model = open(&dir.join("model")).unwrap();
    assert_eq!(model.format, Format::ByteCheckpoint);
    assert_eq!(
        model.writer.as_ref().unwrap().to_string(),
        "ByteCheckpoint (version 0.0.2)"
    );
    assert!(
        model
            .meta
            .identity()
            .unwrap()
            .starts_with("bytecheckpoint:"),
        "{:?}",
        model.meta.identity()
    );
    assert_eq!(check_tensors(&dir.join("model"), &model, "model."), 8);
    // FSDP1: even dim-0 halves, one per rank, each in its writer's file.
    let t = model.meta.tensor_index("emb.weight").unwrap();
    let chunks = model.meta.chunks_of(t);
    assert_eq!(chunks.len(), 2);
    assert_eq!(
        model.meta.files()[chunks[1].bytes.file as usize].path,
        "__1_0.distcp"
    );
    assert_eq!((chunks[0].bytes.offset, chunks[0].bytes.length), (0, 12288));

    let optimizer = open(&dir.join("optimizer")).unwrap();
    assert_eq!(
        check_tensors(&dir.join("optimizer"), &optimizer, "optimizer."),
        24
    );
    // The 0-dim step is one 4-byte chunk after the param_groups zip.
    let step = optimizer
        .meta
        .tensor_index("state.emb.weight.step")
        .unwrap();
    let chunk = &optimizer.meta.chunks_of(step)[0];
    assert_eq!((chunk.bytes.offset, chunk.bytes.length), (1184, 4));
    let keys: Vec<&str> = optimizer
        .meta
        .objects()
        .iter()
        .map(|o| o.key.as_str())
        .collect();
    assert_eq!(keys, ["param_groups"]);
    let object = &optimizer.meta.objects()[0];
    let file = std::fs::read(dir.join("optimizer/__0_0.distcp")).unwrap();
    let groups =
        decode_object(&file[object.offset as usize..(object.offset + object.length) as usize])
            .unwrap();
    assert_eq!(groups[0]["lr"], json!(0.01), "{groups}");
    assert_eq!(groups[0]["params"].as_array().unwrap().len(), 8, "{groups}");

    let extra = open(&dir.join("extra_state")).unwrap();
    assert_eq!(extra.meta.tensors().len(), 0);
    let keys: Vec<&str> = extra
        .meta
        .objects()
        .iter()
        .map(|o| o.key.as_str())
        .collect();
    assert_eq!(keys, ["rank_0", "rank_1"]);
}

#[test]
fn the_root_opens_as_one_checkpoint_with_namespaced_names() {
    let dir = fixture().join("ckpt");
    let opened = open(&dir).unwrap();
    assert_eq!(opened.format, Format::ByteCheckpoint);
    assert_eq!(check_tensors(&dir, &opened, ""), 32);
    assert_eq!(
        expected().len(),
        32,
        "every tensor ByteCheckpoint saved is exposed"
    );
    let files: Vec<&str> = opened
        .meta
        .files()
        .iter()
        .map(|f| f.path.as_str())
        .collect();
    assert!(files.contains(&"model/__0_0.distcp"), "{files:?}");
    assert!(
        files.contains(&"extra_state/extra_state_rank_1.pt"),
        "{files:?}"
    );
    let keys: Vec<&str> = opened
        .meta
        .objects()
        .iter()
        .map(|o| o.key.as_str())
        .collect();
    assert_eq!(
        keys,
        [
            "optimizer.param_groups",
            "extra_state.rank_0",
            "extra_state.rank_1"
        ]
    );
    // extra_state files are plain torch.save zips of each rank's dict.
    for (rank, object) in opened.meta.objects()[1..].iter().enumerate() {
        let file = &opened.meta.files()[object.file as usize].path;
        let bytes = std::fs::read(dir.join(file)).unwrap();
        assert_eq!(object.length, bytes.len() as u64);
        assert_eq!(
            decode_object(&bytes).unwrap(),
            json!({"step": 1, "rank": rank})
        );
    }
    let details = opened.bytecheckpoint().unwrap();
    let names: Vec<&str> = details.components.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["model", "optimizer", "extra_state"]);
    assert_eq!(details.version.as_deref(), Some("0.0.2"));
    // The identity covers every component: it differs from the model's alone.
    let model = open(&dir.join("model")).unwrap();
    assert_ne!(opened.meta.identity(), model.meta.identity());
}

/// Copies the fixture's `ckpt/` to `into/<name>` (writable), returning the copy.
fn copy_ckpt(into: &Path, name: &str) -> PathBuf {
    let to = into.join(name);
    copy_dir_writable(&fixture().join("ckpt"), &to);
    to
}

#[test]
fn a_root_of_global_step_saves_follows_the_tracker() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("run");
    copy_ckpt(&root, "global_step_3");
    copy_ckpt(&root, "global_step_7");
    // Step 7's optimizer is gone: had 7 been picked, the checkpoint would lack optimizer names.
    std::fs::remove_dir_all(root.join("global_step_7/optimizer")).unwrap();
    std::fs::write(root.join("latest_checkpointed_iteration.txt"), "3").unwrap();
    let opened = open(&root).unwrap();
    assert_eq!(opened.step, Some(3));
    assert_eq!(
        opened.bytecheckpoint().unwrap().followed.as_deref(),
        Some("global_step_3")
    );
    assert!(
        opened
            .meta
            .tensor_index("optimizer.state.l1.bias.exp_avg")
            .is_some()
    );
    assert_eq!(check_tensors(&root.join("global_step_3"), &opened, ""), 32);
    // No tracker: the highest step.
    std::fs::remove_file(root.join("latest_checkpointed_iteration.txt")).unwrap();
    let opened = open(&root).unwrap();
    assert_eq!(opened.step, Some(7));
    assert!(
        opened
            .meta
            .tensor_index("optimizer.state.l1.bias.exp_avg")
            .is_none()
    );
    // A tracker naming a step that is not there.
    std::fs::write(root.join("latest_checkpointed_iteration.txt"), "9\n").unwrap();
    let err = open(&root).unwrap_err().to_string();
    assert!(
        err.contains("latest_checkpointed_iteration.txt names step 9")
            && err.contains("global_step_9"),
        "{err}"
    );
}

#[test]
fn a_truncated_data_file_is_refused_naming_the_file_tensor_and_chunk() {
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = copy_ckpt(tmp.path(), "ckpt");
    let data = ckpt.join("model/__1_0.distcp");
    let bytes = std::fs::read(&data).unwrap();
    std::fs::write(&data, &bytes[..bytes.len() - 100]).unwrap();
    let err = open(&ckpt).unwrap_err();
    assert!(
        matches!(err, MetadataError::ByteRangePastEnd { .. }),
        "{err:?}"
    );
    let text = err.to_string();
    assert!(
        text.contains("model.head.weight")
            && text.contains("[48..96, 0..64]")
            && text.contains("model/__1_0.distcp"),
        "{text}"
    );
}

/// Replaces the first occurrence of `from` in the file with `to` (same length: the pickle's
/// frames stay valid).
fn patch(path: &Path, from: &[u8], to: &[u8]) {
    assert_eq!(from.len(), to.len());
    let mut bytes = std::fs::read(path).unwrap();
    let at = bytes
        .windows(from.len())
        .position(|w| w == from)
        .unwrap_or_else(|| panic!("{from:?} not in {}", path.display()));
    bytes[at..at + to.len()].copy_from_slice(to);
    std::fs::write(path, bytes).unwrap();
}

#[test]
fn a_descriptor_that_disagrees_with_its_storage_info_is_refused() {
    // emb.weight's first chunk: storage of 3072 floats (BININT2 0x0c00) = its 12288 bytes.
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = copy_ckpt(tmp.path(), "ckpt");
    patch(
        &ckpt.join("model/.metadata"),
        b"cpuq\x04M\x00\x0c",
        b"cpuq\x04M\xff\x0b",
    );
    let err = open(&ckpt.join("model")).unwrap_err();
    assert!(matches!(err, MetadataError::Blob { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("__0_0.distcp bytes 0..12288")
            && text.contains("tensor emb.weight chunk [0..48, 0..64]")
            && text.contains("storage_data gives it 12288 bytes but its descriptor's storage is 3071 elements of f32"),
        "{text}"
    );

    // A storage class tessera does not know.
    let ckpt = copy_ckpt(tmp.path(), "ckpt2");
    patch(
        &ckpt.join("model/.metadata"),
        b"torch\nFloatStorage",
        b"torch\nQuintStorage",
    );
    let text = open(&ckpt.join("model")).unwrap_err().to_string();
    assert!(
        text.contains("tensor emb.weight chunk [0..48, 0..64]")
            && text.contains("model/.metadata")
            && text.contains("storage type QuintStorage is not supported"),
        "{text}"
    );

    // A size that is not the chunk's.
    let ckpt = copy_ckpt(tmp.path(), "ckpt3");
    patch(
        &ckpt.join("model/.metadata"),
        b"QK\x00K0K@\x86",
        b"QK\x00K/K@\x86",
    );
    let text = open(&ckpt.join("model")).unwrap_err().to_string();
    assert!(
        text.contains("tensor emb.weight chunk [0..48, 0..64]")
            && text.contains(
                "its descriptor has size [47, 64] but .metadata says the chunk has sizes [48, 64]"
            ),
        "{text}"
    );
}

#[test]
fn a_torch_dcp_save_under_model_is_not_taken_for_bytecheckpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().join("job");
    std::fs::create_dir_all(&root).unwrap();
    dcp_support::copy_fixture("a_w1_plain", &root);
    std::fs::rename(root.join("a_w1_plain"), root.join("model")).unwrap();
    let err = open(&root).unwrap_err().to_string();
    assert!(err.contains("not a checkpoint tessera can read"), "{err}");
    // ... and opens as torch DCP on its own.
    assert_eq!(open(&root.join("model")).unwrap().format, Format::Dcp);
}

#[test]
fn a_descriptor_with_strides_and_a_storage_offset_is_read_as_torch_would_rebuild_it() {
    // emb.weight's first chunk, rebuilt by the descriptor as storage[16 + 32·i + j] (stride
    // (32, 1), storage offset 16): what `_rebuild_tensor_v2` makes of the same 3072 floats.
    let tmp = tempfile::tempdir().unwrap();
    let ckpt = copy_ckpt(tmp.path(), "ckpt");
    patch(
        &ckpt.join("model/.metadata"),
        b"QK\x00K0K@\x86q\x06K@K\x01\x86",
        b"QK\x10K0K@\x86q\x06K K\x01\x86",
    );
    let dir = ckpt.join("model");
    let opened = open(&dir).unwrap();
    let t = opened.meta.tensor_index("emb.weight").unwrap();
    let chunk = &opened.meta.chunks_of(t)[0];
    assert_eq!(chunk.bytes.strides.as_deref(), Some(&[32u64, 1][..]));
    assert_eq!(chunk.bytes.offset, 16 * 4);
    let storage = std::fs::read(dir.join("__0_0.distcp")).unwrap();
    let mut want = Vec::new();
    for i in 0..48 {
        for j in 0..64 {
            let at = (16 + 32 * i + j) * 4;
            want.extend_from_slice(&storage[at..at + 4]);
        }
    }
    let first = opened.meta.first_chunk_index(t);
    let got = dcp_support::read_box(&dir, &opened.meta, first, &chunk.region);
    assert!(got == want, "the strided chunk's bytes");

    // Strides that reach past the storage are refused, naming the chunk.
    let ckpt = copy_ckpt(tmp.path(), "ckpt4");
    patch(
        &ckpt.join("model/.metadata"),
        b"QK\x00K0K@\x86q\x06K@K\x01\x86",
        b"QK\x00K0K@\x86q\x06KAK\x01\x86",
    );
    let text = open(&ckpt.join("model")).unwrap_err().to_string();
    assert!(
        text.contains("tensor emb.weight chunk [0..48, 0..64]")
            && text.contains(
                "strides [65, 1] from storage offset 0 reaches byte 12476 of a 12288-byte storage"
            ),
        "{text}"
    );
}
