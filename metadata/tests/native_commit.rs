//! The commit protocol: nothing is committed when validation fails, a directory without manifest
//! is not a checkpoint, a committed prefix is not overwritten, `latest` only moves forward, a
//! `latest` that cannot be written after the manifest is reported as such (committed), and the
//! writer refuses bad input with messages that name the tensor and file.
#![allow(clippy::unwrap_used)]

mod native_support;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use native_support::{fixture, local_store, memory_store};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use tessera_metadata::formats::native::{
    NativeWriter, WriteOptions, open_checkpoint, read_latest, read_manifest, step_from_dir_name,
    verify_checkpoint,
};
use tessera_metadata::{DType, MetadataError, TensorBox, TensorMeta};
use tessera_storage::testing::HookedStore;

async fn exists(store: &dyn ObjectStore, path: &str) -> bool {
    match store.head(&Path::from(path)).await {
        Ok(_) => true,
        Err(object_store::Error::NotFound { .. }) => false,
        Err(e) => panic!("head {path}: {e}"),
    }
}

#[tokio::test]
async fn a_commit_that_fails_validation_writes_no_manifest() {
    let (_dir, store) = local_store();
    let fx = fixture();
    // Commit a good step first, so that there is a latest pointer to keep.
    fx.write(
        store.clone(),
        &Path::from("run/step-000001"),
        WriteOptions::default(),
    )
    .await
    .unwrap();

    let prefix = Path::from("run/step-000002");
    let writer = NativeWriter::create(
        store.clone(),
        prefix.clone(),
        fx.tensors.clone(),
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let file0 = fx.write_file(&writer, 0).await.unwrap();
    // The second file misses rows 7..10 of the embedding.
    let mut data1 = writer.data_file("rank1").unwrap();
    for fb in fx.boxes.iter().filter(|fb| fb.file == 1 && fb.tensor != 0) {
        data1
            .write_box(fb.tensor, fb.region.clone(), &fb.bytes)
            .await
            .unwrap();
    }
    let file1 = data1.finish().await.unwrap();
    let err = writer.commit(vec![file0, file1]).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor model.embed.weight: saved boxes cover 42 of 60 elements (a hole)"
    );
    assert!(exists(store.as_ref(), "run/step-000002/data/rank0.bin").await);
    assert!(!exists(store.as_ref(), "run/step-000002/manifest.json").await);
    assert!(!exists(store.as_ref(), "run/step-000002/metadata.arrow").await);
    assert_eq!(
        read_latest(store.as_ref(), &Path::from("run"))
            .await
            .unwrap()
            .as_deref(),
        Some("step-000001")
    );

    for err in [
        read_manifest(store.as_ref(), &prefix).await.unwrap_err(),
        open_checkpoint(store.as_ref(), &prefix)
            .await
            .map(|_| ())
            .unwrap_err(),
        verify_checkpoint(store.as_ref(), &prefix)
            .await
            .map(|_| ())
            .unwrap_err(),
    ] {
        assert!(matches!(err, MetadataError::MissingManifest { .. }));
        assert_eq!(
            err.to_string(),
            "run/step-000002: no manifest.json, so this is not a committed checkpoint (an incomplete save?)"
        );
    }
}

#[tokio::test]
async fn a_tensor_nobody_saved_is_refused_at_commit() {
    let store = memory_store();
    let tensors = vec![
        TensorMeta::new("a", DType::F32, vec![1]),
        TensorMeta::new("nobody", DType::F32, vec![0]),
    ];
    let writer = NativeWriter::create(
        store.clone(),
        Path::from("p"),
        tensors,
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let mut data = writer.data_file("x").unwrap();
    data.write_box(0, TensorBox::new(vec![0], vec![1]), &[0; 4])
        .await
        .unwrap();
    let written = data.finish().await.unwrap();
    let err = writer.commit(vec![written]).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: tensor nobody has no saved box (write an empty box for a tensor nobody holds)"
    );
    assert!(!exists(store.as_ref(), "p/manifest.json").await);
}

#[tokio::test]
async fn overlapping_boxes_from_two_files_fail_the_commit() {
    let store = memory_store();
    let tensors = vec![TensorMeta::new("w", DType::U8, vec![4])];
    let writer = NativeWriter::create(
        store.clone(),
        Path::from("p"),
        tensors,
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let mut a = writer.data_file("a").unwrap();
    let mut b = writer.data_file("b").unwrap();
    a.write_box(0, TensorBox::new(vec![0], vec![3]), &[1, 2, 3])
        .await
        .unwrap();
    b.write_box(0, TensorBox::new(vec![2], vec![2]), &[3, 4])
        .await
        .unwrap();
    let files = vec![a.finish().await.unwrap(), b.finish().await.unwrap()];
    let err = writer.commit(files).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor w: saved boxes [0..3] and [2..4] overlap"
    );
    assert!(!exists(store.as_ref(), "p/manifest.json").await);
}

#[tokio::test]
async fn a_committed_prefix_is_not_written_again() {
    let store = memory_store();
    let fx = fixture();
    let prefix = Path::from("run/step-000004");
    fx.write(store.clone(), &prefix, WriteOptions::default())
        .await
        .unwrap();
    let err = NativeWriter::create(store, prefix, fx.tensors.clone(), WriteOptions::default())
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "run/step-000004 already holds a committed checkpoint (run/step-000004/manifest.json \
         exists): save to another step directory, or remove this one first"
    );
}

#[tokio::test]
async fn latest_moves_only_forward_and_only_after_a_manifest() {
    let store = memory_store();
    let run = Path::from("runs/gpt");
    assert_eq!(read_latest(store.as_ref(), &run).await.unwrap(), None);
    let fx = fixture();
    let latest = |store: Arc<dyn ObjectStore>| {
        let run = run.clone();
        async move { read_latest(store.as_ref(), &run).await.unwrap() }
    };
    for (step, expected) in [
        ("step-000010", "step-000010"),
        ("step-000005", "step-000010"), // an older step finishing late
        ("step-000010-retry", "step-000010"), // not a step directory name
        ("step-000020", "step-000020"),
    ] {
        fx.write(
            store.clone(),
            &run.clone().join(step),
            WriteOptions::default(),
        )
        .await
        .unwrap();
        assert_eq!(
            latest(store.clone()).await.as_deref(),
            Some(expected),
            "after {step}"
        );
    }
    // A failed commit of a newer step leaves the pointer alone.
    let writer = NativeWriter::create(
        store.clone(),
        run.clone().join("step-000030"),
        fx.tensors.clone(),
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let file0 = fx.write_file(&writer, 0).await.unwrap();
    writer.commit(vec![file0]).await.unwrap_err();
    assert_eq!(latest(store.clone()).await.as_deref(), Some("step-000020"));
    assert_eq!(step_from_dir_name("step-000020"), Some(20));
    assert_eq!(step_from_dir_name("step-"), None);
    assert_eq!(step_from_dir_name("step-12a"), None);
    assert_eq!(step_from_dir_name("checkpoint-12"), None);
}

#[tokio::test]
async fn the_writer_refuses_bad_boxes_naming_tensor_and_file() {
    let store = memory_store();
    let tensors = vec![
        TensorMeta::new("model.w", DType::Bf16, vec![4, 6]),
        TensorMeta::new("dup", DType::F32, vec![1]),
    ];
    let writer = NativeWriter::create(
        store.clone(),
        Path::from("p"),
        tensors.clone(),
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let mut data = writer.data_file("rank0").unwrap();

    let err = data
        .write_box(0, TensorBox::new(vec![0, 0], vec![2, 6]), &[0; 23])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor model.w: chunk [0..2, 0..6] has byte length 23 but 12 elements of bf16 need 24"
    );
    let err = data
        .write_box(0, TensorBox::new(vec![0], vec![4]), &[0; 8])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor model.w: saved box [0..4] does not have the tensor's 2 dimensions"
    );
    let err = data
        .write_box(0, TensorBox::new(vec![3, 0], vec![2, 6]), &[0; 24])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor model.w: saved box [3..5, 0..6] lies outside the shape [4, 6] in dim 0 (3..5 > 4)"
    );
    let err = data
        .write_box(
            0,
            TensorBox {
                offsets: vec![0].into(),
                lengths: vec![2, 6].into(),
            },
            &[0; 24],
        )
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor model.w: saved box offsets [0] lengths [2, 6] does not have the tensor's 2 dimensions"
    );
    let err = data
        .write_box(7, TensorBox::new(vec![], vec![]), &[])
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: data/rank0.bin: box [] refers to tensor #7 but there are 2 tensors"
    );
    let err = data.write_object("", b"x").await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: data/rank0.bin: an object needs a non-empty key"
    );
    // Refused boxes left nothing behind: the file is still empty.
    assert!(data.is_empty());

    let err = writer.data_file("rank0").unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: data file rank0 is already open in this checkpoint"
    );
    for bad in ["", "../x", "a/b", ".hidden", "spa ce"] {
        let err = writer.data_file(bad).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "invalid checkpoint metadata: data file name {bad:?}: use 1 to 200 ASCII letters, digits, '-', '_' or '.', not starting with '.'"
            )
        );
    }
    // An abandoned file frees its name, so a failed file can be written again from the start;
    // a finished one keeps it.
    drop(data);
    let again = writer.data_file("rank0").unwrap();
    again.finish().await.unwrap();
    assert!(writer.data_file("rank0").is_err());

    let mut twice = tensors.clone();
    twice.push(TensorMeta::new("dup", DType::F32, vec![1]));
    let err = NativeWriter::create(store, Path::from("q"), twice, WriteOptions::default())
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: tensor dup is listed twice"
    );
}

#[tokio::test]
async fn files_from_different_checkpoint_settings_do_not_mix() {
    let store = memory_store();
    let tensors = vec![TensorMeta::new("w", DType::U8, vec![1])];
    let small_blocks = WriteOptions {
        block_size: 4096,
        ..WriteOptions::default()
    };
    let other = NativeWriter::create(
        store.clone(),
        Path::from("other"),
        tensors.clone(),
        small_blocks,
    )
    .await
    .unwrap();
    let mut data = other.data_file("a").unwrap();
    data.write_box(0, TensorBox::new(vec![0], vec![1]), &[9])
        .await
        .unwrap();
    let foreign = data.finish().await.unwrap();

    let writer = NativeWriter::create(store, Path::from("p"), tensors, WriteOptions::default())
        .await
        .unwrap();
    let err = writer.commit(vec![foreign]).await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: data file data/a.bin was written with block size 4096, the checkpoint uses 65536"
    );
}

#[tokio::test]
async fn a_written_file_survives_serialization_to_the_committing_host() {
    let store = memory_store();
    let fx = fixture();
    let prefix = Path::from("run/step-000042");
    let writer = NativeWriter::create(
        store.clone(),
        prefix.clone(),
        fx.tensors.clone(),
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let mut files = Vec::new();
    for file in 0..2 {
        let written = fx.write_file(&writer, file).await.unwrap();
        let json = serde_json::to_string(&written).unwrap();
        files.push(serde_json::from_str(&json).unwrap());
    }
    let manifest = writer.commit(files).await.unwrap();
    assert_eq!(manifest.step, Some(42));
    let report = verify_checkpoint(store.as_ref(), &prefix).await.unwrap();
    assert!(report.is_ok(), "{report:?}");
}

#[tokio::test]
async fn a_commit_whose_latest_cannot_be_written_says_the_checkpoint_is_committed() {
    let (dir, store) = local_store();
    let fx = fixture();
    // A directory where the pointer should be: reading it finds no pointer, writing it fails as
    // a full disk would, after the manifest is in place.
    std::fs::create_dir_all(dir.path().join("run/latest/in-the-way")).unwrap();
    let prefix = Path::from("run/step-000003");
    let err = fx
        .write(store.clone(), &prefix, WriteOptions::default())
        .await
        .unwrap_err();
    let MetadataError::LatestNotMoved {
        checkpoint, latest, ..
    } = &err
    else {
        panic!("not LatestNotMoved: {err}");
    };
    assert_eq!(
        (checkpoint.as_str(), latest.as_str()),
        ("run/step-000003", "run/latest")
    );
    let message = err.to_string();
    assert!(
        message.starts_with(
            "checkpoint run/step-000003 IS committed (its manifest is written), but run/latest was not moved to it: writing run/latest"
        ),
        "{message}"
    );
    assert!(err.is_permanent());
    // Committed indeed: it opens and verifies, and a second commit into it is refused.
    let manifest = read_manifest(store.as_ref(), &prefix).await.unwrap();
    assert_eq!(manifest.step, Some(3));
    let report = verify_checkpoint(store.as_ref(), &prefix).await.unwrap();
    assert!(report.is_ok(), "{report:?}");
    let again = fx
        .write(store.clone(), &prefix, WriteOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(again, MetadataError::AlreadyCommitted { .. }),
        "{again}"
    );
}

#[tokio::test]
async fn a_commit_that_finds_latest_moved_since_it_read_it_does_not_move_it_back() {
    let memory = memory_store();
    // Armed, the hook plays another commit of a newer step: it moves the pointer to step 20
    // between this commit's read of the pointer and its write.
    let armed = Arc::new(AtomicBool::new(false));
    let (inner, hook_armed) = (memory.clone(), armed.clone());
    let store: Arc<dyn ObjectStore> = Arc::new(HookedStore::new(memory.clone(), move |path| {
        let (store, armed, path) = (inner.clone(), hook_armed.clone(), path.clone());
        Box::pin(async move {
            if path.as_ref() == "run/latest" && armed.swap(false, Ordering::SeqCst) {
                store
                    .put(&path, PutPayload::from_static(b"step-000020"))
                    .await?;
            }
            Ok(())
        })
    }));
    let fx = fixture();
    fx.write(
        store.clone(),
        &Path::from("run/step-000005"),
        WriteOptions::default(),
    )
    .await
    .unwrap();
    armed.store(true, Ordering::SeqCst);
    fx.write(
        store.clone(),
        &Path::from("run/step-000010"),
        WriteOptions::default(),
    )
    .await
    .unwrap();
    assert!(!armed.load(Ordering::SeqCst), "the racing commit never ran");
    assert_eq!(
        read_latest(memory.as_ref(), &Path::from("run"))
            .await
            .unwrap()
            .as_deref(),
        Some("step-000020"),
        "an older step's commit moved latest back"
    );
}
