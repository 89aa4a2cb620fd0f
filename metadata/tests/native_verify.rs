//! Corruption is found and located: a flipped data byte is reported as exactly its block, a
//! corrupt metadata or checksum file is a checksum mismatch naming it, missing and truncated data
//! files are reported, and partial reads verify through their covering blocks.
#![allow(clippy::unwrap_used)]

mod native_support;

use std::path::PathBuf;

use native_support::{fixture, local_store};
use object_store::ObjectStore;
use object_store::path::Path;
use tessera_metadata::MetadataError;
use tessera_metadata::formats::native::{
    BadBlock, BadBox, BlockChecksums, FileBlocks, SizeMismatch, WriteOptions, open_checkpoint,
    read_block_checksums, read_manifest, verify_checkpoint,
};

const PREFIX: &str = "run/step-000010";

/// A committed fixture checkpoint on local disk, and the directory of its prefix.
async fn committed() -> (tempfile::TempDir, std::sync::Arc<dyn ObjectStore>, PathBuf) {
    let (dir, store) = local_store();
    fixture()
        .write(store.clone(), &Path::from(PREFIX), WriteOptions::default())
        .await
        .unwrap();
    let root = dir.path().join(PREFIX);
    (dir, store, root)
}

fn flip_byte(file: &std::path::Path, at: usize) {
    let mut bytes = std::fs::read(file).unwrap();
    bytes[at] ^= 0x5a;
    std::fs::write(file, bytes).unwrap();
}

#[tokio::test]
async fn a_clean_checkpoint_verifies() {
    let (_dir, store, root) = committed().await;
    let report = verify_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.files, 2);
    let on_disk: u64 = ["rank0.bin", "rank1.bin"]
        .iter()
        .map(|f| std::fs::metadata(root.join("data").join(f)).unwrap().len())
        .sum();
    assert_eq!(report.bytes_checked, on_disk);
}

#[tokio::test]
async fn one_corrupt_byte_is_reported_as_exactly_its_block() {
    let (_dir, store, root) = committed().await;
    let prefix = Path::from(PREFIX);
    let file = root.join("data/rank1.bin");
    let size = std::fs::metadata(&file).unwrap().len();
    // rank1.bin holds the 75 600-byte fc1 shard at 16 KiB, so it has a second, partial block.
    assert!(size > 65_536 && size < 131_072, "size {size}");
    let original = std::fs::read(&file).unwrap();
    flip_byte(&file, 70_000);
    let corrupted = std::fs::read(&file).unwrap();

    let report = verify_checkpoint(store.as_ref(), &prefix).await.unwrap();
    assert_eq!(
        report.bad_blocks,
        vec![BadBlock {
            file: "data/rank1.bin".to_string(),
            start: 65_536,
            end: size,
            expected: crc32c::crc32c(&original[65_536..]),
            actual: crc32c::crc32c(&corrupted[65_536..]),
        }]
    );
    assert!(report.missing_files.is_empty() && report.size_mismatches.is_empty());
    assert!(!report.is_ok());

    // A partial reader of the fc1 shard verifies its covering blocks and gets the same answer.
    let manifest = read_manifest(store.as_ref(), &prefix).await.unwrap();
    let checksums = read_block_checksums(store.as_ref(), &prefix, &manifest)
        .await
        .unwrap();
    let covering = checksums
        .covering_byte_range("data/rank1.bin", 16_384, 16_384 + 75_600)
        .unwrap();
    assert_eq!(covering, 0..size);
    let err = checksums
        .verify_range("data/rank1.bin", 0, &corrupted)
        .unwrap_err();
    assert!(matches!(err, MetadataError::ChecksumMismatch { .. }));
    assert_eq!(
        err.to_string(),
        format!(
            "checksum mismatch in data/rank1.bin bytes 65536..{size}: expected crc32c {:08x}, found {:08x}",
            crc32c::crc32c(&original[65_536..]),
            crc32c::crc32c(&corrupted[65_536..])
        )
    );
    // The first block is still fine on its own.
    checksums
        .verify_range("data/rank1.bin", 0, &corrupted[..65_536])
        .unwrap();
}

#[tokio::test]
async fn a_corrupt_metadata_file_is_a_checksum_mismatch_naming_it() {
    let (_dir, store, root) = committed().await;
    let file = root.join("metadata.arrow");
    let original = std::fs::read(&file).unwrap();
    flip_byte(&file, original.len() / 2);
    let corrupted = std::fs::read(&file).unwrap();
    let expected = format!(
        "checksum mismatch in run/step-000010/metadata.arrow: expected crc32c {:08x}, found {:08x}",
        crc32c::crc32c(&original),
        crc32c::crc32c(&corrupted)
    );
    let err = open_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap_err();
    assert!(matches!(err, MetadataError::ChecksumMismatch { .. }));
    assert_eq!(err.to_string(), expected);
    let err = verify_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap_err();
    assert_eq!(err.to_string(), expected);
}

#[tokio::test]
async fn a_truncated_metadata_file_is_refused_before_decoding() {
    let (_dir, store, root) = committed().await;
    let file = root.join("metadata.arrow");
    let original = std::fs::read(&file).unwrap();
    std::fs::write(&file, &original[..original.len() - 8]).unwrap();
    let err = open_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "invalid checkpoint metadata: run/step-000010/metadata.arrow is {} bytes but the manifest says {}",
            original.len() - 8,
            original.len()
        )
    );
}

#[tokio::test]
async fn a_corrupt_checksum_file_is_a_checksum_mismatch_naming_it() {
    let (_dir, store, root) = committed().await;
    let file = root.join("checksums.arrow");
    let original = std::fs::read(&file).unwrap();
    flip_byte(&file, original.len() - 20);
    let err = verify_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap_err();
    assert!(matches!(err, MetadataError::ChecksumMismatch { .. }));
    assert!(
        err.to_string()
            .starts_with("checksum mismatch in run/step-000010/checksums.arrow: expected crc32c "),
        "{err}"
    );
}

#[tokio::test]
async fn missing_and_truncated_data_files_are_reported() {
    let (_dir, store, root) = committed().await;
    let rank0 = root.join("data/rank0.bin");
    let rank0_size = std::fs::metadata(&rank0).unwrap().len();
    std::fs::remove_file(root.join("data/rank1.bin")).unwrap();
    let original = std::fs::read(&rank0).unwrap();
    std::fs::write(&rank0, &original[..original.len() - 1]).unwrap();

    let report = verify_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap();
    assert_eq!(report.missing_files, vec!["data/rank1.bin".to_string()]);
    assert_eq!(
        report.size_mismatches,
        vec![SizeMismatch {
            file: "data/rank0.bin".to_string(),
            expected: rank0_size,
            actual: rank0_size - 1,
        }]
    );
    // The shortened last block no longer matches either.
    let last = (rank0_size - 1) / 65_536 * 65_536;
    assert_eq!(report.bad_blocks.len(), 1);
    assert_eq!(
        (report.bad_blocks[0].start, report.bad_blocks[0].end),
        (last, rank0_size - 1)
    );
    assert_eq!(report.files, 1);
}

#[test]
fn covering_blocks_and_byte_ranges() {
    let data: Vec<u8> = (0..95u8).collect();
    let crcs = data.chunks(10).map(crc32c::crc32c).collect();
    let checksums = BlockChecksums::new(
        10,
        vec![FileBlocks {
            path: "data/a.bin".to_string(),
            size: 95,
            crcs,
        }],
    )
    .unwrap();
    let f = "data/a.bin";
    assert_eq!(checksums.blocks_covering(f, 0, 1).unwrap(), 0..1);
    assert_eq!(checksums.blocks_covering(f, 10, 20).unwrap(), 1..2);
    assert_eq!(checksums.blocks_covering(f, 9, 11).unwrap(), 0..2);
    assert_eq!(checksums.blocks_covering(f, 90, 95).unwrap(), 9..10);
    assert_eq!(checksums.blocks_covering(f, 95, 95).unwrap(), 9..9);
    assert_eq!(checksums.covering_byte_range(f, 9, 11).unwrap(), 0..20);
    assert_eq!(checksums.covering_byte_range(f, 91, 95).unwrap(), 90..95);
    assert_eq!(checksums.covering_byte_range(f, 33, 33).unwrap(), 33..33);

    checksums.verify_range(f, 0, &data).unwrap();
    checksums.verify_range(f, 90, &data[90..]).unwrap();
    checksums.verify_range(f, 20, &data[20..40]).unwrap();

    let err = checksums.blocks_covering(f, 90, 96).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: byte range 90..96 is not inside data/a.bin (95 bytes)"
    );
    let err = checksums.blocks_covering("data/b.bin", 0, 1).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: data/b.bin has no block checksums (not a data file of this checkpoint)"
    );
    let err = checksums.verify_range(f, 5, &data[5..15]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: data/a.bin: 10 bytes at 5 are not whole blocks of 10 inside the file (95 bytes)"
    );
    let err = checksums.verify_range(f, 10, &data[10..25]).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: data/a.bin: 15 bytes at 10 are not whole blocks of 10 inside the file (95 bytes)"
    );
    let mut bad = data[30..50].to_vec();
    bad[12] ^= 1;
    let err = checksums.verify_range(f, 30, &bad).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "checksum mismatch in data/a.bin bytes 40..50: expected crc32c {:08x}, found {:08x}",
            crc32c::crc32c(&data[40..50]),
            crc32c::crc32c(&bad[10..])
        )
    );
}

#[test]
fn block_checksums_must_match_the_file_size() {
    let err = BlockChecksums::new(
        10,
        vec![FileBlocks {
            path: "data/a.bin".to_string(),
            size: 95,
            crcs: vec![0; 9],
        }],
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: data/a.bin: 9 block checksums for 95 bytes in blocks of 10 (10 blocks)"
    );
}

/// Rewrites `metadata.arrow` with `edit` applied to the saved boxes and records the new file's
/// size and crc32c in the manifest: metadata that opens cleanly but points boxes elsewhere.
async fn rewrite_boxes(
    store: &dyn ObjectStore,
    root: &std::path::Path,
    edit: impl FnOnce(&mut Vec<tessera_metadata::SavedChunk>),
) {
    use tessera_metadata::CheckpointMeta;
    use tessera_metadata::formats::native::encode_metadata;
    let meta = open_checkpoint(store, &Path::from(PREFIX))
        .await
        .unwrap()
        .meta;
    let mut chunks = meta.chunks().to_vec();
    edit(&mut chunks);
    let edited = CheckpointMeta::new(
        meta.tensors().to_vec(),
        chunks,
        meta.objects().to_vec(),
        meta.files().to_vec(),
    )
    .unwrap();
    let bytes = encode_metadata(&edited).unwrap();
    let mut manifest = read_manifest(store, &Path::from(PREFIX)).await.unwrap();
    manifest.metadata.size = bytes.len() as u64;
    manifest.metadata.crc32c = crc32c::crc32c(&bytes);
    std::fs::write(root.join("metadata.arrow"), &bytes).unwrap();
    std::fs::write(root.join("manifest.json"), manifest.to_json().unwrap()).unwrap();
}

#[tokio::test]
async fn boxes_with_swapped_offsets_are_reported_with_both_crcs() {
    let (_dir, store, root) = committed().await;
    let qkv = |offsets: [u64; 2], lengths: [u64; 2]| {
        tessera_metadata::TensorBox::new(offsets.to_vec(), lengths.to_vec())
    };
    // Two qkv boxes in rank0.bin (24 and 12 bytes): each row now points at the other's bytes.
    let (a_region, b_region) = (qkv([0, 0], [3, 2]), qkv([3, 2], [1, 3]));
    let mut moved = Vec::new();
    rewrite_boxes(store.as_ref(), &root, |chunks| {
        let a = chunks.iter().position(|c| c.region == a_region).unwrap();
        let b = chunks.iter().position(|c| c.region == b_region).unwrap();
        let (oa, ob) = (chunks[a].bytes.offset, chunks[b].bytes.offset);
        chunks[a].bytes.offset = ob;
        chunks[b].bytes.offset = oa;
        moved = vec![
            (a_region.clone(), ob, 24, chunks[a].crc32c.unwrap()),
            (b_region.clone(), oa, 12, chunks[b].crc32c.unwrap()),
        ];
    })
    .await;
    // The metadata itself is consistent: it opens and validates.
    open_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap();

    let report = verify_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap();
    assert!(report.bad_blocks.is_empty(), "{report:?}");
    assert!(!report.is_ok());
    let data = std::fs::read(root.join("data/rank0.bin")).unwrap();
    let mut expected: Vec<BadBox> = moved
        .into_iter()
        .map(|(region, start, len, crc)| BadBox {
            file: "data/rank0.bin".to_string(),
            entry: format!("tensor model.layers.0.attn.qkv.weight box {region}"),
            start,
            end: start + len,
            expected: crc,
            actual: crc32c::crc32c(&data[start as usize..(start + len) as usize]),
        })
        .collect();
    expected.sort_by_key(|b| b.start);
    assert_eq!(report.bad_boxes, expected);
    assert!(expected.iter().all(|b| b.expected != b.actual));
    assert_eq!(
        report.bad_boxes[0].to_error().to_string(),
        format!(
            "checksum mismatch in data/rank0.bin bytes {}..{} ({}): its metadata records crc32c {:08x}, the bytes have {:08x}",
            expected[0].start,
            expected[0].end,
            expected[0].entry,
            expected[0].expected,
            expected[0].actual
        )
    );
}

#[tokio::test]
async fn every_box_and_object_of_a_clean_checkpoint_is_checked() {
    let (_dir, store, _root) = committed().await;
    let report = verify_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap();
    assert!(report.is_ok(), "{report:?}");
    // 12 boxes of which 2 are empty, 3 objects of which 1 is empty: empty ones hold nothing.
    assert_eq!(report.boxes_checked, 10 + 2);
}

#[tokio::test]
async fn stray_files_under_the_checkpoint_are_reported() {
    let (_dir, store, root) = committed().await;
    std::fs::write(root.join("data/rank7.bin"), b"left over").unwrap();
    std::fs::write(root.join("notes.txt"), b"hand made").unwrap();
    let report = verify_checkpoint(store.as_ref(), &Path::from(PREFIX))
        .await
        .unwrap();
    assert_eq!(
        report.stray_files,
        vec!["data/rank7.bin".to_string(), "notes.txt".to_string()]
    );
    assert!(!report.is_ok());
    assert!(report.bad_blocks.is_empty() && report.bad_boxes.is_empty());
}
