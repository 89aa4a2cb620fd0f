//! Flat-range chunks in the native format: `DataFileWriter::write_flat` stores elements
//! `[start, end)` of a box's row-major flattening contiguously, recorded as the boxes that tile
//! the range, each with its own crc32c. They read back byte for byte, verify, and corruption
//! inside one tile is reported as that tile.
#![allow(clippy::unwrap_used)]

mod native_support;

use std::sync::Arc;

use native_support::local_store;
use object_store::ObjectStore;
use object_store::path::Path;
use tessera_metadata::formats::native::{
    NativeWriter, WriteOptions, WrittenFile, open_checkpoint, verify_checkpoint,
};
use tessera_metadata::{DType, MetadataError, TensorBox, TensorMeta};
use tessera_synth::box_bytes;

const PREFIX: &str = "run/step-000003";

fn tensors() -> Vec<TensorMeta> {
    vec![
        // Rows 0..2 a plain box; rows 2..5 three flat ranges over two files (Megatron's DP split
        // of one TP-local box), cut mid-row.
        TensorMeta::new("optim.state.w.exp_avg", DType::F32, vec![5, 7]),
        // A 3-d tensor saved entirely as flat ranges of the whole tensor (ZeRO-style).
        TensorMeta::new("optim.state.v.exp_avg_sq", DType::Bf16, vec![3, 4, 5]),
    ]
}

/// Elements `[start, end)` of `parent`'s row-major flattening: the box's row-major bytes,
/// sliced, so the expected bytes never depend on the tiling under test.
fn flat_of_box(tensor: &TensorMeta, parent: &TensorBox, start: u64, end: u64) -> Vec<u8> {
    let esize = tensor.dtype.size() as usize;
    box_bytes(tensor, parent).unwrap()[start as usize * esize..end as usize * esize].to_vec()
}

/// (file, tensor, parent, start, end) of every flat range written, and the plain box.
type Plan = Vec<(usize, u32, TensorBox, u64, u64)>;

fn flat_plan() -> Plan {
    let w = TensorBox::new(vec![2, 0], vec![3, 7]);
    let v = TensorBox::whole(&[3, 4, 5]);
    vec![
        (0, 0, w.clone(), 0, 5),
        (0, 0, w.clone(), 5, 13),
        (1, 0, w.clone(), 13, 21),
        (1, 0, w, 21, 21),
        (0, 1, v.clone(), 0, 23),
        (1, 1, v.clone(), 23, 41),
        (1, 1, v, 41, 60),
    ]
}

async fn write(store: Arc<dyn ObjectStore>, metadata_only: bool) -> Vec<WrittenFile> {
    let tensors = tensors();
    let writer = NativeWriter::create(
        store,
        Path::from(PREFIX),
        tensors.clone(),
        WriteOptions {
            metadata_only,
            ..WriteOptions::default()
        },
    )
    .await
    .unwrap();
    let mut files = vec![
        writer.data_file("rank-00000").unwrap(),
        writer.data_file("rank-00001").unwrap(),
    ];
    let plain = TensorBox::new(vec![0, 0], vec![2, 7]);
    if metadata_only {
        files[1].write_box_metadata_only(0, plain).unwrap();
    } else {
        let bytes = box_bytes(&tensors[0], &plain).unwrap();
        files[1].write_box(0, plain, &bytes).await.unwrap();
    }
    for (file, t, parent, start, end) in flat_plan() {
        if metadata_only {
            files[file]
                .write_flat_metadata_only(t, parent, start, end)
                .unwrap();
        } else {
            let bytes = flat_of_box(&tensors[t as usize], &parent, start, end);
            files[file]
                .write_flat(t, parent, start, end, &bytes)
                .await
                .unwrap();
        }
    }
    let mut written = Vec::new();
    for f in files {
        written.push(f.finish().await.unwrap());
    }
    let manifest = writer.commit(written.clone()).await.unwrap();
    assert_eq!(
        manifest.chunks,
        written.iter().map(|f| f.chunks().len() as u64).sum::<u64>()
    );
    written
}

#[tokio::test]
async fn flat_ranges_read_back_byte_for_byte_and_verify() {
    let (dir, store) = local_store();
    write(store.clone(), false).await;
    let checkpoint = open_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap();
    let meta = &checkpoint.meta;
    let tensors = tensors();

    // Every saved box's bytes, read straight from its file, are the formula's values of that box.
    for chunk in meta.chunks() {
        let tensor = &tensors[chunk.tensor as usize];
        let file = &meta.files()[chunk.bytes.file as usize].path;
        let data = std::fs::read(dir.path().join(PREFIX).join(file)).unwrap();
        let at = chunk.bytes.offset as usize;
        assert_eq!(
            &data[at..at + chunk.bytes.length as usize],
            box_bytes(tensor, &chunk.region).unwrap(),
            "{} {} in {file}",
            tensor.fqn,
            chunk.region
        );
        assert!(chunk.crc32c.is_some(), "{} {}", tensor.fqn, chunk.region);
    }
    // And each flat range's bytes lie contiguously from its first tile on: the writer's tiling
    // is the flattening's order.
    let mut firsts = Vec::new();
    for (file, t, parent, start, end) in flat_plan() {
        if start == end {
            continue;
        }
        let tensor = &tensors[t as usize];
        let first = tessera_metadata::flat_range_of_box(&parent, start, end)[0]
            .1
            .clone();
        let chunk = meta
            .chunks_of(t)
            .iter()
            .find(|c| c.region == first)
            .unwrap();
        assert_eq!(
            meta.files()[chunk.bytes.file as usize].path,
            format!("data/rank-{file:05}.bin")
        );
        let data = std::fs::read(
            dir.path()
                .join(PREFIX)
                .join(&meta.files()[chunk.bytes.file as usize].path),
        )
        .unwrap();
        let at = chunk.bytes.offset as usize;
        let expected = flat_of_box(tensor, &parent, start, end);
        assert_eq!(
            &data[at..at + expected.len()],
            expected,
            "{} {start}..{end}",
            tensor.fqn
        );
        assert_eq!(chunk.bytes.offset % 4096, 0, "a flat range starts aligned");
        firsts.push(chunk.bytes.offset);
    }
    // w: the plain box, then rows 2..5 (7 columns) cut at 5 and 13: [row 2 cols 0..5],
    // [row 2 cols 5..7, row 3 cols 0..6], [row 3 col 6, row 4]. v (3-d): at most 2·3 − 1 = 5
    // tiles a range.
    assert_eq!(meta.chunks_of(0).len(), 1 + 1 + 2 + 2);
    assert!(meta.chunks_of(1).len() <= 3 * 5);
    assert_eq!(firsts.len(), 6);

    let report = verify_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.boxes_checked, meta.chunks().len() as u64);
}

#[tokio::test]
async fn a_corrupt_byte_inside_a_flat_range_names_its_tile() {
    let (dir, store) = local_store();
    write(store.clone(), false).await;
    let meta = open_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap()
        .meta;
    // The second tile of w's 5..13 range: row 3, columns 0..6.
    let tile = TensorBox::new(vec![3, 0], vec![1, 6]);
    let chunk = meta
        .chunks_of(0)
        .iter()
        .find(|c| c.region == tile)
        .unwrap()
        .clone();
    let file = dir
        .path()
        .join(PREFIX)
        .join(&meta.files()[chunk.bytes.file as usize].path);
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[chunk.bytes.offset as usize + 5] ^= 0x5a;
    std::fs::write(&file, bytes).unwrap();

    let report = verify_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap();
    assert_eq!(report.bad_boxes.len(), 1, "{report:?}");
    let bad = &report.bad_boxes[0];
    assert_eq!(
        bad.entry,
        format!("tensor optim.state.w.exp_avg box {tile}")
    );
    assert_eq!(
        (bad.start, bad.end),
        (chunk.bytes.offset, chunk.bytes.offset + chunk.bytes.length)
    );
}

#[tokio::test]
async fn metadata_only_flat_ranges_lie_where_the_data_would() {
    let (_dir, store) = local_store();
    let with_data = write(store, false).await;
    let (_dir2, store2) = local_store();
    let laid_out = write(store2, true).await;
    for (a, b) in with_data.iter().zip(&laid_out) {
        assert_eq!(a.size(), b.size(), "{}", a.path());
        let strip = |f: &WrittenFile| {
            f.chunks()
                .iter()
                .map(|c| (c.tensor, c.region.clone(), c.bytes.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(a), strip(b), "{}", a.path());
        assert!(b.chunks().iter().all(|c| c.crc32c.is_none()));
    }
}

#[tokio::test]
async fn bad_flat_ranges_are_refused_naming_file_tensor_and_box() {
    let (_dir, store) = local_store();
    let tensors = tensors();
    let writer = NativeWriter::create(
        store,
        Path::from(PREFIX),
        tensors.clone(),
        WriteOptions::default(),
    )
    .await
    .unwrap();
    let mut file = writer.data_file("rank-00000").unwrap();
    let parent = TensorBox::new(vec![2, 0], vec![3, 7]);

    // Past the box's 21 elements.
    let err = file
        .write_flat(0, parent.clone(), 15, 22, &[0; 28])
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, MetadataError::Invalid { .. }), "{err:?}");
    for part in [
        "data/rank-00000.bin",
        "optim.state.w.exp_avg",
        "15..22",
        "21 elements",
    ] {
        assert!(text.contains(part), "{text}");
    }
    // start after end.
    let err = file
        .write_flat(0, parent.clone(), 9, 4, &[])
        .await
        .unwrap_err();
    assert!(err.to_string().contains("9..4"), "{err}");
    // Wrong byte count for 4 f32 elements.
    let err = file
        .write_flat(0, parent.clone(), 0, 4, &[0; 15])
        .await
        .unwrap_err();
    let MetadataError::ByteLengthMismatch {
        fqn,
        expected,
        actual,
        region,
        ..
    } = &err
    else {
        panic!("{err:?}");
    };
    assert_eq!(
        (fqn.as_str(), *expected, *actual),
        ("optim.state.w.exp_avg", 16, 15)
    );
    assert!(region.contains("flat 0..4"), "{region}");
    // A parent box outside the tensor.
    let err = file
        .write_flat(0, TensorBox::new(vec![4, 0], vec![2, 7]), 0, 1, &[0; 4])
        .await
        .unwrap_err();
    assert!(
        matches!(err, MetadataError::BoxOutsideShape { dim: 0, .. }),
        "{err:?}"
    );
    // Metadata-only calls in a checkpoint with data.
    let err = file.write_flat_metadata_only(0, parent, 0, 1).unwrap_err();
    assert!(
        err.to_string().contains("write_flat_metadata_only"),
        "{err}"
    );
    // None of the refused calls left anything behind.
    let written = file.finish().await.unwrap();
    assert!(written.chunks().is_empty());
    assert_eq!(written.size(), 0);
}
