//! Write a native checkpoint, read it back: metadata, bytes at the recorded offsets, manifest,
//! block checksums, on disk and in memory, with data and metadata-only.
#![allow(clippy::unwrap_used)]

mod native_support;

use std::sync::Arc;

use futures::TryStreamExt;
use native_support::{Fixture, RecordingStore, fixture, local_store, memory_store, pattern};
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use tessera_metadata::formats::native::{
    self, DataPresence, NativeWriter, WriteOptions, decode_metadata, encode_metadata,
    open_checkpoint, read_block_checksums, read_latest, verify_checkpoint,
};
use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, ObjectMeta, SavedChunk, TensorBox, TensorMeta,
};

/// Reads the fixture back from `prefix` and checks every tensor, box, byte and object.
async fn assert_reads_back(store: &Arc<dyn ObjectStore>, prefix: &Path, fx: &Fixture) {
    let checkpoint = open_checkpoint(store.as_ref(), prefix).await.unwrap();
    let (manifest, meta) = (&checkpoint.manifest, &checkpoint.meta);
    assert_eq!(meta.tensors(), fx.tensors.as_slice());
    assert_eq!(meta.chunks().len(), fx.boxes.len());
    let paths: Vec<&str> = meta.files().iter().map(|f| f.path.as_str()).collect();
    assert_eq!(paths, ["data/rank0.bin", "data/rank1.bin"]);

    for fb in &fx.boxes {
        let chunk = meta
            .chunks_of(fb.tensor)
            .iter()
            .find(|c| c.region == fb.region)
            .unwrap_or_else(|| panic!("box {} of tensor {} missing", fb.region, fb.tensor));
        assert_eq!(chunk.bytes.file as usize, fb.file);
        assert_eq!(chunk.bytes.length, fb.bytes.len() as u64);
        assert_eq!(chunk.bytes.strides, None);
        assert_eq!(chunk.crc32c, Some(crc32c::crc32c(&fb.bytes)));
        if fb.bytes.is_empty() {
            continue;
        }
        assert_eq!(
            chunk.bytes.offset % native::ALIGNMENT,
            0,
            "box {}",
            fb.region
        );
        let path = prefix
            .clone()
            .join("data")
            .join(format!("rank{}.bin", fb.file));
        let range = chunk.bytes.offset..chunk.bytes.offset + chunk.bytes.length;
        let read = store.get_range(&path, range).await.unwrap();
        assert_eq!(read.as_ref(), fb.bytes.as_slice(), "box {}", fb.region);
    }
    assert_eq!(meta.objects().len(), fx.objects.len());
    for fo in &fx.objects {
        let object = meta.objects().iter().find(|o| o.key == fo.key).unwrap();
        assert_eq!(object.file as usize, fo.file);
        assert_eq!(object.length, fo.bytes.len() as u64);
        assert_eq!(object.crc32c, Some(crc32c::crc32c(&fo.bytes)));
        if fo.bytes.is_empty() {
            continue; // stores refuse empty range reads
        }
        let path = prefix
            .clone()
            .join("data")
            .join(format!("rank{}.bin", fo.file));
        let read = store
            .get_range(&path, object.offset..object.offset + object.length)
            .await
            .unwrap();
        assert_eq!(read.as_ref(), fo.bytes.as_slice(), "object {}", fo.key);
    }

    // The manifest matches storage and the metadata.
    assert_eq!(manifest.format, "tessera");
    assert_eq!(manifest.format_version, 1);
    assert_eq!(manifest.data, DataPresence::Present);
    assert_eq!(manifest.block_size, native::DEFAULT_BLOCK_SIZE);
    assert_eq!(
        (manifest.tensors, manifest.chunks, manifest.objects),
        (6, 12, 3)
    );
    assert_eq!(manifest.tensor_bytes, fx.tensor_bytes());
    for (file, data_file) in manifest.files.iter().zip(meta.files()) {
        let head = store
            .head(
                &prefix
                    .clone()
                    .join("data")
                    .join(file.path.trim_start_matches("data/")),
            )
            .await
            .unwrap();
        assert_eq!(file.size, head.size, "{}", file.path);
        assert_eq!(data_file.size, Some(head.size));
    }

    // Metadata encodes back to the same thing.
    let again = decode_metadata(&encode_metadata(meta).unwrap(), "again").unwrap();
    let without_sizes: Vec<DataFile> = meta
        .files()
        .iter()
        .map(|f| DataFile {
            path: f.path.clone(),
            size: None,
            encoded: None,
        })
        .collect();
    assert_eq!(again.files(), without_sizes.as_slice());
    assert_eq!(again.tensors(), meta.tensors());
    assert_eq!(again.chunks(), meta.chunks());
    assert_eq!(again.objects(), meta.objects());

    // Every box verifies through its covering blocks, as a partial reader would.
    let checksums = read_block_checksums(store.as_ref(), prefix, manifest)
        .await
        .unwrap();
    for chunk in meta.chunks() {
        let file = &meta.files()[chunk.bytes.file as usize].path;
        let (start, end) = (chunk.bytes.offset, chunk.bytes.offset + chunk.bytes.length);
        let covering = checksums.covering_byte_range(file, start, end).unwrap();
        assert!(covering.start <= start && end <= covering.end);
        let path = prefix
            .clone()
            .join("data")
            .join(file.trim_start_matches("data/"));
        if covering.is_empty() {
            continue;
        }
        let bytes = store.get_range(&path, covering.clone()).await.unwrap();
        checksums
            .verify_range(file, covering.start, &bytes)
            .unwrap();
    }

    let report = verify_checkpoint(store.as_ref(), prefix).await.unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.files, 2);
    assert_eq!(
        report.bytes_checked,
        manifest.files.iter().map(|f| f.size).sum::<u64>()
    );
}

#[tokio::test]
async fn fixture_round_trips_on_local_disk() {
    let (_dir, store) = local_store();
    let prefix = Path::from("run/step-000010");
    let fx = fixture();
    let manifest = fx
        .write(store.clone(), &prefix, WriteOptions::default())
        .await
        .unwrap();
    assert_eq!(manifest.step, Some(10));
    assert_reads_back(&store, &prefix, &fx).await;
    assert_eq!(
        read_latest(store.as_ref(), &Path::from("run"))
            .await
            .unwrap()
            .as_deref(),
        Some("step-000010")
    );
}

#[tokio::test]
async fn fixture_round_trips_in_memory_with_small_blocks() {
    let store = memory_store();
    let prefix = Path::from("ckpt");
    let fx = fixture();
    let options = WriteOptions {
        block_size: 4096,
        step: Some(7),
        source_layout: Some(serde_json::json!({"mesh": [{"name": "dp", "size": 2}]})),
        metadata_only: false,
    };
    let manifest = fx.write(store.clone(), &prefix, options).await.unwrap();
    assert_eq!(manifest.step, Some(7));
    assert_eq!(manifest.block_size, 4096);
    assert_eq!(
        manifest.source_layout,
        Some(serde_json::json!({"mesh": [{"name": "dp", "size": 2}]}))
    );
    // Not a step directory: no latest pointer anywhere.
    assert_eq!(
        read_latest(store.as_ref(), &Path::from("")).await.unwrap(),
        None
    );
    let checkpoint = open_checkpoint(store.as_ref(), &prefix).await.unwrap();
    let checksums = read_block_checksums(store.as_ref(), &prefix, &checkpoint.manifest)
        .await
        .unwrap();
    for file in checksums.files() {
        assert_eq!(file.crcs.len() as u64, file.size.div_ceil(4096));
    }
    let report = verify_checkpoint(store.as_ref(), &prefix).await.unwrap();
    assert!(report.is_ok(), "{report:?}");
}

#[tokio::test]
async fn the_manifest_is_written_after_everything_else_and_latest_after_it() {
    let (_dir, local) = local_store();
    let recording = Arc::new(RecordingStore::new(local));
    let store: Arc<dyn ObjectStore> = recording.clone();
    fixture()
        .write(
            store,
            &Path::from("run/step-000003"),
            WriteOptions::default(),
        )
        .await
        .unwrap();
    let writes = recording.writes();
    let tail: Vec<&str> = writes[writes.len() - 4..]
        .iter()
        .map(String::as_str)
        .collect();
    assert_eq!(
        tail,
        [
            "run/step-000003/metadata.arrow",
            "run/step-000003/checksums.arrow",
            "run/step-000003/manifest.json",
            "run/latest",
        ]
    );
    let mut data: Vec<&str> = writes[..writes.len() - 4]
        .iter()
        .map(String::as_str)
        .collect();
    data.sort();
    assert_eq!(
        data,
        [
            "run/step-000003/data/rank0.bin",
            "run/step-000003/data/rank1.bin"
        ]
    );
}

async fn large_box_round_trips(store: Arc<dyn ObjectStore>) {
    // 20 MiB + a bit: three multipart parts of 8 MiB, the last one partial.
    let len = 20 * 1024 * 1024 + 123;
    let tensors = vec![
        TensorMeta::new("big", DType::U8, vec![len as u64]),
        TensorMeta::new("small", DType::F32, vec![2]),
    ];
    let big = pattern(5, len);
    let small = pattern(6, 8);
    let prefix = Path::from("large");
    let writer = NativeWriter::create(
        store.clone(),
        prefix.clone(),
        tensors,
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let mut file = writer.data_file("only").unwrap();
    file.write_box(0, TensorBox::new(vec![0], vec![len as u64]), &big)
        .await
        .unwrap();
    file.write_box(1, TensorBox::new(vec![0], vec![2]), &small)
        .await
        .unwrap();
    let written = file.finish().await.unwrap();
    let small_offset = (len as u64).next_multiple_of(4096);
    assert_eq!(written.size(), small_offset + 8);
    writer.commit(vec![written]).await.unwrap();

    let checkpoint = open_checkpoint(store.as_ref(), &prefix).await.unwrap();
    let chunks = checkpoint.meta.chunks();
    assert_eq!(chunks[0].bytes.offset, 0);
    assert_eq!(chunks[1].bytes.offset, small_offset);
    let path = Path::from("large/data/only.bin");
    let all = store.get(&path).await.unwrap().bytes().await.unwrap();
    assert_eq!(all.len() as u64, small_offset + 8);
    assert!(all[..len] == big[..], "big box bytes differ");
    assert!(
        all[len..small_offset as usize].iter().all(|&b| b == 0),
        "padding is zeros"
    );
    assert_eq!(&all[small_offset as usize..], small.as_slice());
    let report = verify_checkpoint(store.as_ref(), &prefix).await.unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.bytes_checked, small_offset + 8);
}

#[tokio::test]
async fn a_box_larger_than_an_upload_part_round_trips_on_local_disk() {
    let (_dir, store) = local_store();
    large_box_round_trips(store).await;
}

#[tokio::test]
async fn a_box_larger_than_an_upload_part_round_trips_in_memory() {
    large_box_round_trips(memory_store()).await;
}

#[tokio::test]
async fn metadata_only_checkpoints_lay_boxes_out_like_data_ones_without_data_files() {
    let store = memory_store();
    let fx = fixture();
    fx.write(
        store.clone(),
        &Path::from("with-data"),
        WriteOptions::default(),
    )
    .await
    .unwrap();

    let options = WriteOptions {
        metadata_only: true,
        ..WriteOptions::default()
    };
    let prefix = Path::from("no-data");
    let writer = NativeWriter::create(store.clone(), prefix.clone(), fx.tensors.clone(), options)
        .await
        .unwrap();
    let mut files = Vec::new();
    for file in 0..2 {
        let mut data = writer.data_file(native_support::FILE_NAMES[file]).unwrap();
        for (i, fb) in fx.boxes.iter().filter(|fb| fb.file == file).enumerate() {
            if i == 0 {
                // write_box is accepted too: the bytes are checked and dropped.
                data.write_box(fb.tensor, fb.region.clone(), &fb.bytes)
                    .await
                    .unwrap();
            } else {
                data.write_box_metadata_only(fb.tensor, fb.region.clone())
                    .unwrap();
            }
        }
        for fo in fx.objects.iter().filter(|fo| fo.file == file) {
            data.write_object(&fo.key, &fo.bytes).await.unwrap();
        }
        let written = data.finish().await.unwrap();
        assert!(!written.data_written());
        assert!(written.block_crcs().is_empty());
        files.push(written);
    }
    let manifest = writer.commit(files).await.unwrap();
    assert_eq!(manifest.data, DataPresence::Absent);
    assert_eq!(manifest.checksums, None);

    let listed: Vec<String> = store
        .list(Some(&prefix))
        .map_ok(|m| m.location.to_string())
        .try_collect()
        .await
        .unwrap();
    let mut listed = listed;
    listed.sort();
    assert_eq!(listed, ["no-data/manifest.json", "no-data/metadata.arrow"]);

    let with = open_checkpoint(store.as_ref(), &Path::from("with-data"))
        .await
        .unwrap();
    let without = open_checkpoint(store.as_ref(), &prefix).await.unwrap();
    assert_eq!(without.meta.tensors(), with.meta.tensors());
    assert_eq!(without.meta.files(), with.meta.files());
    for (a, b) in without.meta.chunks().iter().zip(with.meta.chunks()) {
        assert_eq!((&a.region, &a.bytes), (&b.region, &b.bytes));
        assert_eq!(a.crc32c, None);
    }
    assert!(without.meta.objects().iter().all(|o| o.crc32c.is_none()));
    assert_eq!(without.manifest.files, with.manifest.files);

    let report = verify_checkpoint(store.as_ref(), &prefix).await.unwrap();
    assert!(report.data_absent && report.is_ok() && report.files == 0);
    let err = read_block_checksums(store.as_ref(), &prefix, &without.manifest)
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: no-data is a metadata-only checkpoint (data absent): no block checksums"
    );
}

#[tokio::test]
async fn write_box_metadata_only_is_refused_when_data_is_stored() {
    let store = memory_store();
    let writer = NativeWriter::create(
        store,
        Path::from("p"),
        vec![TensorMeta::new("w", DType::F32, vec![2])],
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let mut data = writer.data_file("a").unwrap();
    let err = data
        .write_box_metadata_only(0, TensorBox::new(vec![0], vec![2]))
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: data/a.bin: write_box_metadata_only in a checkpoint that stores data (set WriteOptions::metadata_only)"
    );
}

fn strided_meta() -> CheckpointMeta {
    let tensors = vec![
        TensorMeta::new("w", DType::F16, vec![4, 6]),
        TensorMeta::new("s", DType::F64, vec![]),
        TensorMeta::new("e", DType::F8E4m3fn, vec![0]),
    ];
    let chunks = vec![
        SavedChunk {
            tensor: 0,
            region: TensorBox::new(vec![0, 0], vec![4, 3]),
            // A transposed (column-major) view.
            bytes: ByteMeta {
                file: 1,
                offset: 64,
                length: 24,
                strides: Some(vec![1, 4]),
            },
            crc32c: None,
            crc32: None,
        },
        SavedChunk {
            tensor: 0,
            region: TensorBox::new(vec![0, 3], vec![4, 3]),
            bytes: ByteMeta {
                file: 0,
                offset: 0,
                length: 24,
                strides: None,
            },
            crc32c: Some(0xdead_beef),
            crc32: None,
        },
        SavedChunk {
            tensor: 1,
            region: TensorBox::new(vec![], vec![]),
            bytes: ByteMeta {
                file: 0,
                offset: 4096,
                length: 8,
                strides: Some(vec![]),
            },
            crc32c: Some(7),
            crc32: None,
        },
        SavedChunk {
            tensor: 2,
            region: TensorBox::new(vec![0], vec![0]),
            bytes: ByteMeta {
                file: 2,
                offset: 0,
                length: 0,
                strides: None,
            },
            crc32c: None,
            crc32: None,
        },
    ];
    let objects = vec![
        ObjectMeta {
            key: "extra.a".to_string(),
            file: 2,
            offset: 0,
            length: 10,
            crc32c: None,
        },
        ObjectMeta {
            key: "w".to_string(), // may share a tensor's name: rows carry their kind
            file: 0,
            offset: 8192,
            length: 3,
            crc32c: Some(1),
        },
    ];
    let files = vec![
        DataFile {
            path: "data/a.bin".to_string(),
            size: None,
            encoded: None,
        },
        DataFile {
            path: "data/b.bin".to_string(),
            size: None,
            encoded: None,
        },
        DataFile {
            path: "data/c.bin".to_string(),
            size: None,
            encoded: None,
        },
    ];
    CheckpointMeta::new(tensors, chunks, objects, files).unwrap()
}

#[test]
fn metadata_with_strides_and_null_checksums_round_trips() {
    let meta = strided_meta();
    let bytes = encode_metadata(&meta).unwrap();
    let decoded = decode_metadata(&bytes, "metadata.arrow").unwrap();
    assert_eq!(decoded, meta);
}

#[test]
fn a_file_without_rows_keeps_its_place() {
    let tensors = vec![TensorMeta::new("w", DType::U8, vec![1])];
    let chunks = vec![SavedChunk {
        tensor: 0,
        region: TensorBox::new(vec![0], vec![1]),
        bytes: ByteMeta {
            file: 1,
            offset: 0,
            length: 1,
            strides: None,
        },
        crc32c: None,
        crc32: None,
    }];
    let files = ["data/unused.bin", "data/used.bin"]
        .map(|p| DataFile {
            path: p.to_string(),
            size: None,
            encoded: None,
        })
        .to_vec();
    let meta = CheckpointMeta::new(tensors, chunks, vec![], files).unwrap();
    let decoded = decode_metadata(&encode_metadata(&meta).unwrap(), "m").unwrap();
    assert_eq!(decoded, meta);
}

#[test]
fn an_empty_checkpoint_round_trips() {
    let meta = CheckpointMeta::new(vec![], vec![], vec![], vec![]).unwrap();
    let decoded = decode_metadata(&encode_metadata(&meta).unwrap(), "m").unwrap();
    assert_eq!(decoded, meta);
}

#[test]
fn a_tensor_without_rows_cannot_be_encoded() {
    let meta = CheckpointMeta::new(
        vec![TensorMeta::new("lonely", DType::F32, vec![0])],
        vec![],
        vec![],
        vec![],
    )
    .unwrap();
    let err = encode_metadata(&meta).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: cannot encode metadata.arrow: tensor lonely has no saved box; the native format needs at least one (possibly empty) box per tensor"
    );
}

/// Many rows: several record batches sharing their dictionaries, and tensor order by first
/// appearance across them.
#[test]
fn metadata_of_more_than_one_batch_round_trips() {
    // 1000 tensors of 1100 one-element boxes: 1.1 M rows, more than one batch of 2^20.
    let per = 1100u64;
    let rows = 1000 * per;
    let tensors: Vec<TensorMeta> = (0..1000)
        .map(|i| TensorMeta::new(format!("layers.{i}.w"), DType::Bf16, vec![per]))
        .collect();
    let chunks: Vec<SavedChunk> = (0..rows)
        .map(|r| SavedChunk {
            tensor: (r / per) as u32,
            region: TensorBox::new(vec![r % per], vec![1]),
            bytes: ByteMeta {
                file: (r % 3) as u32,
                offset: r * 4096,
                length: 2,
                strides: None,
            },
            crc32c: (r % 2 == 0).then_some(r as u32),
            crc32: None,
        })
        .collect();
    let files = (0..3)
        .map(|i| DataFile {
            path: format!("data/{i}.bin"),
            size: None,
            encoded: None,
        })
        .collect();
    let meta = CheckpointMeta::new(tensors, chunks, vec![], files).unwrap();
    let bytes = encode_metadata(&meta).unwrap();
    let decoded = decode_metadata(&bytes, "m").unwrap();
    assert_eq!(decoded, meta);
}

/// A data file laid out in memory (`data_file_in_memory`, what a live publication serves) is
/// byte for byte the file the store gets, with the same layout and checksums for the commit,
/// past the multipart part size and past the capacity reserved; `finish` refuses it (its bytes
/// would go nowhere).
#[tokio::test]
async fn a_data_file_laid_out_in_memory_is_the_file_the_store_gets() {
    let tensors = vec![
        TensorMeta::new("w", DType::F32, vec![2, 3 << 20]),
        TensorMeta::new("b", DType::Bf16, vec![7]),
    ];
    let w = pattern(1, 3 << 22); // row 0 of w: 12 MiB
    let b = pattern(2, 14);
    let object = pattern(3, 100);
    let mut written = Vec::new();
    for in_memory in [false, true] {
        let store = memory_store();
        let prefix = Path::from("c");
        let writer = NativeWriter::create(
            store.clone(),
            prefix.clone(),
            tensors.clone(),
            WriteOptions::default(),
        )
        .await
        .unwrap();
        let mut file = if in_memory {
            writer.data_file_in_memory("rank0", 4096).unwrap()
        } else {
            writer.data_file("rank0").unwrap()
        };
        file.write_box(0, TensorBox::new(vec![0, 0], vec![1, 3 << 20]), &w)
            .await
            .unwrap();
        file.write_box(1, TensorBox::new(vec![0], vec![7]), &b)
            .await
            .unwrap();
        file.write_object("step", &object).await.unwrap();
        written.push(if in_memory {
            file.finish_in_memory().unwrap()
        } else {
            let meta = file.finish().await.unwrap();
            let path = prefix.join("data").join("rank0.bin");
            let bytes = store.get(&path).await.unwrap().bytes().await.unwrap();
            (bytes, meta)
        });
    }
    assert_eq!(written[0].1, written[1].1);
    assert_eq!(written[0].0, written[1].0);
    assert_eq!(written[1].0.len() as u64, written[1].1.size());

    let writer = NativeWriter::create(
        memory_store(),
        Path::from("d"),
        tensors,
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let file = writer.data_file_in_memory("rank0", 0).unwrap();
    let err = file.finish().await.unwrap_err().to_string();
    assert!(err.contains("data/rank0.bin: laid out in memory"), "{err}");

    // Finished as another kind of memory than it was laid out into: refused, naming the file.
    #[derive(Debug)]
    struct Elsewhere;
    impl tessera_metadata::formats::native::MemorySink for Elsewhere {
        fn append(&mut self, _data: &[u8]) -> std::io::Result<()> {
            Ok(())
        }
        fn into_any(self: Box<Self>) -> Box<dyn std::any::Any> {
            self
        }
    }
    let file = writer.data_file_in_memory("rank1", 0).unwrap();
    let err = file.finish_into::<Elsewhere>().unwrap_err().to_string();
    assert!(
        err.contains("data/rank1.bin: laid out into another kind of memory"),
        "{err}"
    );
}
