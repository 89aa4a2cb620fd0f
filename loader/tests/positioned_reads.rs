//! Positioned reads from a local checkpoint directory: pieces whose bytes are one stretch of
//! their file and of their destination are read with `pread` straight into the destination, not
//! through the object store. A synthetic checkpoint saved Shard(0) by 4 ranks (native, box and
//! block checksums) is loaded whole by one rank: every saved box lands as one stretch of its
//! tensor. With the store swapped for an empty one the load still succeeds (so the bytes came
//! from the files), verified box by box; corrupt and truncated files fail, naming what is wrong.
#![allow(clippy::unwrap_used, missing_docs, clippy::result_large_err)]

mod support_read;

use std::sync::Arc;
use std::time::Duration;

use object_store::memory::InMemory;
use support_read::expected_destination;
use tessera_loader::LoaderError;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, LoadedRank, load_rank};
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_planner::{Layout, PlanOptions};

/// One rank holding every tensor whole.
const WHOLE: &str = r#"{"mesh": [{"name": "dp", "size": 1}],
    "rules": [{"match": "*", "placements": ["replicate"]}]}"#;

async fn saved_by_rows() -> (tempfile::TempDir, Checkpoint) {
    support_read::synth_saved_by_rows(4).await
}

/// Every rank of `layout`'s plan loads, in one in-process job.
async fn load_every_rank(
    checkpoint: &Checkpoint,
    layout: &str,
    plan_options: &PlanOptions,
    verify: bool,
) -> Result<Vec<LoadedRank>, LoaderError> {
    let requests = Layout::from_json(layout)
        .unwrap()
        .resolve(checkpoint.meta.tensors())
        .unwrap();
    let plan = checkpoint.plan(&requests, plan_options).unwrap();
    let options = LoadOptions {
        read: ReadOptions {
            verify,
            ..ReadOptions::default()
        },
        progress: None,
        ..LoadOptions::default()
    };
    let transports = InProcTransport::mesh(
        plan.world_size(),
        TransportOptions::with_timeout(Duration::from_secs(10)),
    );
    let loads = transports.iter().enumerate().map(|(rank, transport)| {
        let plan = plan.rank_plan(rank as u32).unwrap();
        load_rank(checkpoint, plan, transport, &options)
    });
    futures::future::join_all(loads).await.into_iter().collect()
}

async fn load_whole(checkpoint: &Checkpoint, verify: bool) -> Result<LoadedRank, LoaderError> {
    let mut ranks = load_every_rank(checkpoint, WHOLE, &PlanOptions::default(), verify).await?;
    Ok(ranks.remove(0))
}

/// The largest data file of the checkpoint on disk.
fn largest_data_file(dir: &std::path::Path) -> std::path::PathBuf {
    let mut files = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for entry in std::fs::read_dir(d).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "bin") {
                files.push(path);
            }
        }
    }
    files
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_boxes_come_from_the_files_verified_not_through_the_store() {
    let (_dir, mut checkpoint) = saved_by_rows().await;
    checkpoint.location.store = Arc::new(InMemory::new());
    let loaded = load_whole(&checkpoint, true).await.unwrap();
    for d in 0..loaded.plan.destinations.len() {
        assert!(
            loaded.buffers[d] == expected_destination(&loaded.plan, d),
            "destination {d} holds the wrong bytes"
        );
    }
    let report = &loaded.report;
    let pieces = loaded.plan.pieces.iter().filter(|p| p.bytes > 0).count() as u64;
    assert_eq!(
        report.boxes_verified, pieces,
        "every box checked by its crc32c"
    );
    assert_eq!(report.bytes_fetched, report.bytes_needed);
    assert_eq!(report.bytes_transferred, report.bytes_needed);
    assert!(report.requests >= pieces);

    // Without the local root every byte goes through the (empty) store, and the load fails.
    checkpoint.location.local_root = None;
    let error = load_whole(&checkpoint, true).await.unwrap_err();
    assert!(
        matches!(&error, LoaderError::MissingFile { path } if path.ends_with(".bin")),
        "{error}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_byte_read_by_position_fails_its_box_check() {
    let (dir, checkpoint) = saved_by_rows().await;
    let data = largest_data_file(dir.path());
    let mut bytes = std::fs::read(&data).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xFF;
    std::fs::write(&data, bytes).unwrap();

    let error = load_whole(&checkpoint, true).await.unwrap_err();
    let message = error.to_string();
    assert!(
        message.contains("tensor ") && message.contains(".bin"),
        "the error names the tensor's box and the file: {message}"
    );
    assert!(
        matches!(
            error,
            LoaderError::Metadata(tessera_metadata::MetadataError::BoxChecksumMismatch { .. })
        ),
        "{message}"
    );
    // With verification off the same read succeeds: the check is what caught it.
    let loaded = load_whole(&checkpoint, false).await.unwrap();
    let wrong = (0..loaded.plan.destinations.len())
        .filter(|&d| loaded.buffers[d] != expected_destination(&loaded.plan, d))
        .count();
    assert_eq!(wrong, 1, "exactly the corrupted tensor differs");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_truncated_file_is_a_short_read_naming_it() {
    let (dir, checkpoint) = saved_by_rows().await;
    let data = largest_data_file(dir.path());
    let len = std::fs::metadata(&data).unwrap().len();
    let file = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
    file.set_len(len / 2).unwrap();
    drop(file);
    let name = data.file_name().unwrap().to_str().unwrap().to_string();
    match load_whole(&checkpoint, false).await.unwrap_err() {
        LoaderError::ShortRead {
            path, start, end, ..
        } => {
            assert!(path.ends_with(&name), "{path} names {name}");
            assert!(
                end > len / 2 && start < end,
                "{start}..{end} of a {len}-byte file"
            );
        }
        other => panic!("expected a short read, got {other}"),
    }
}

/// Two ranks, each holding a column half of every matrix (Shard(1)): every saved row box gives
/// each rank one run per row, a column slice. Vectors and scalars whole.
const COLUMNS: &str = r#"{"mesh": [{"name": "tp", "size": 2}],
    "rules": [{"match": "*norm*", "placements": ["replicate"]},
              {"match": "*.weight", "placements": ["shard(1)"]},
              {"match": "*", "placements": ["replicate"]}]}"#;

async fn load_columns(
    checkpoint: &Checkpoint,
    verify: bool,
) -> Result<Vec<LoadedRank>, LoaderError> {
    // Each rank reads its own columns: per request, no exchange.
    let own_columns = PlanOptions {
        dedup: false,
        ..PlanOptions::default()
    };
    load_every_rank(checkpoint, COLUMNS, &own_columns, verify).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn column_slices_come_from_the_files_checked_jointly_or_not_at_all() {
    let (dir, mut checkpoint) = saved_by_rows().await;
    checkpoint.location.store = Arc::new(InMemory::new());
    // Every column slice is read by position (strided), none through the (empty) store, and
    // the bytes are the checkpoint's: unverified, and verified by joint checks (each rank folds
    // the runs it reads; the folds of a box's readers add up to its crc32c).
    for verify in [false, true] {
        let loaded = load_columns(&checkpoint, verify).await.unwrap();
        for rank in &loaded {
            let strided = rank
                .plan
                .pieces
                .iter()
                .filter(|p| {
                    p.read
                        .as_ref()
                        .is_some_and(|r| r.runs.counts.iter().any(|&c| c > 1))
                })
                .count();
            assert!(strided > 0, "rank {} reads column slices", rank.plan.rank);
            assert!(!rank.plan.joint_checks.is_empty(), "boxes checked jointly");
            for d in 0..rank.plan.destinations.len() {
                assert!(
                    rank.buffers[d] == expected_destination(&rank.plan, d),
                    "rank {} destination {d} holds the wrong bytes (verify {verify})",
                    rank.plan.rank
                );
            }
            assert_eq!(rank.report.bytes_fetched, rank.report.bytes_needed);
            assert_eq!(rank.report.bytes_unverified, 0);
        }
    }
    // A flipped byte in a column one rank reads by position fails the box's joint check,
    // naming the box; without verification the same load succeeds (the check caught it).
    let data = largest_data_file(dir.path());
    let original = std::fs::read(&data).unwrap();
    let mut bytes = original.clone();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xFF;
    std::fs::write(&data, &bytes).unwrap();
    let error = load_columns(&checkpoint, true).await.unwrap_err();
    assert!(
        matches!(error, LoaderError::JointChecksum(_)),
        "expected a joint checksum mismatch, got {error}"
    );
    assert!(error.to_string().contains("tensor "), "{error}");
    load_columns(&checkpoint, false).await.unwrap();
    std::fs::write(&data, &original).unwrap();
    // A file cut short under a strided read is a short read naming it.
    let len = original.len() as u64;
    let file = std::fs::OpenOptions::new().write(true).open(&data).unwrap();
    file.set_len(len / 2).unwrap();
    drop(file);
    let name = data.file_name().unwrap().to_str().unwrap().to_string();
    match load_columns(&checkpoint, false).await.unwrap_err() {
        LoaderError::ShortRead { path, end, .. } => {
            assert!(path.ends_with(&name), "{path} names {name}");
            assert!(end > len / 2, "the read reaches past the cut: {end}");
        }
        other => panic!("expected a short read, got {other}"),
    }
}
