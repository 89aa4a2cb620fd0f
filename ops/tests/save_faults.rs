//! The save protocol under injected write faults (`FaultyStore` as the save's store layer): a
//! write that fails once is retried (a one-request file by the store, a multipart file by writing
//! it again) and the save commits with every byte; an outage that outlasts the retries commits
//! nothing, names the file, and leaves `latest` where it was.
#![allow(clippy::unwrap_used)]

use std::sync::{Arc, Mutex};

use tessera_loader::transport::{InProcTransport, Transport, TransportOptions};
use tessera_metadata::formats::native::verify_checkpoint;
use tessera_ops::OpsError;
use tessera_ops::claim::CLAIM_FILE;
use tessera_ops::save::{HeldBox, Holdings, SaveOptions, Saved, StoreLayer, save_rank};
use tessera_storage::testing::{FaultConfig, FaultyStore};
use tessera_storage::{RetryPolicy, StorageOptions};

/// 12 MiB of f32 on rank 0 (over the writer's 8 MiB part size: a multipart upload of start, two
/// parts and a completion), 64 bytes on rank 1 (one request).
const BIG: u64 = 3 * 1024 * 1024;

fn world() -> Vec<Holdings> {
    let held = |fqn: &str, n: u64| HeldBox {
        fqn: fqn.to_string(),
        dtype: "f32".to_string(),
        shape: vec![n],
        offsets: vec![0],
        lengths: vec![n],
    };
    vec![
        Holdings {
            boxes: vec![held("big", BIG)],
            objects: vec![],
        },
        Holdings {
            boxes: vec![held("small", 16)],
            objects: vec![],
        },
    ]
}

fn bytes(rank: usize) -> Vec<u8> {
    let n = if rank == 0 { BIG * 4 } else { 64 };
    (0..n).map(|i| (i % 251) as u8 ^ rank as u8).collect()
}

/// Saves `world()` at `path` from two in-process ranks, each writing through its own
/// `FaultyStore` with `faults[rank]`; every rank's outcome and store.
async fn save(
    path: &str,
    faults: [FaultConfig; 2],
) -> Vec<(Result<Saved, OpsError>, Arc<FaultyStore>)> {
    let all = world();
    let mut tasks = Vec::new();
    for transport in InProcTransport::mesh(2, TransportOptions::default()) {
        let rank = transport.rank() as usize;
        let made: Arc<Mutex<Option<Arc<FaultyStore>>>> = Arc::default();
        let config = faults[rank].clone();
        let slot = made.clone();
        let options = SaveOptions {
            storage: StorageOptions {
                // Quick retries: the test waits through every backoff.
                retry: RetryPolicy {
                    first_backoff: std::time::Duration::from_millis(1),
                    ..RetryPolicy::default()
                },
                ..StorageOptions::default()
            },
            store_layer: Some(StoreLayer::new(move |inner| {
                let faulty = Arc::new(FaultyStore::new(inner, config.clone()));
                *slot.lock().unwrap() = Some(faulty.clone());
                faulty
            })),
            ..SaveOptions::default()
        };
        let (all, path) = (all.clone(), path.to_string());
        tasks.push(tokio::spawn(async move {
            let data = bytes(rank);
            let outcome = save_rank(&path, &options, &all, &[&data], &[], &transport).await;
            let store = made.lock().unwrap().clone().unwrap();
            (outcome, store)
        }));
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

#[tokio::test]
async fn writes_that_fail_once_are_retried_and_the_save_commits_every_byte() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run/step-3");
    let path = root.display().to_string();
    // Every 5th write request of rank 0 fails: its multipart file (start, two parts, completion)
    // fails once mid-upload and is written again, and a one-request put of the commit fails
    // once and is retried by the store. Rank 1 makes one write request and fails none.
    let outcomes = save(
        &path,
        [FaultConfig::write_every_nth(5), FaultConfig::default()],
    )
    .await;
    for (rank, (outcome, store)) in outcomes.iter().enumerate() {
        let saved = outcome.as_ref().unwrap();
        assert_eq!(saved.manifest.step, Some(3));
        // Each injected fault cost exactly one retry (of the request, or of the whole file).
        assert_eq!(saved.write_retries, store.injected_writes(), "rank {rank}");
    }
    assert!(
        outcomes[0].1.injected_writes() >= 2,
        "rank 0: faults were injected"
    );
    let location = tessera_storage::create_with(&path, &StorageOptions::default()).unwrap();
    let report = verify_checkpoint(location.store.as_ref(), &location.prefix)
        .await
        .unwrap();
    assert!(report.is_ok(), "{report:?}");
    let checkpoint = tessera_ops::open::open(&path).await.unwrap();
    let meta = &checkpoint.meta;
    for (t, tensor) in meta.tensors().iter().enumerate() {
        let chunk = &meta.chunks_of(t as u32)[0];
        let raw = std::fs::read(root.join(&meta.files()[chunk.bytes.file as usize].path)).unwrap();
        let at = chunk.bytes.offset as usize;
        let want = bytes(usize::from(tensor.fqn == "small"));
        assert!(raw[at..at + want.len()] == want[..], "{}", tensor.fqn);
    }
    assert_eq!(
        std::fs::read_to_string(dir.path().join("run/latest")).unwrap(),
        "step-3"
    );
    assert!(!root.join(CLAIM_FILE).exists());
}

#[tokio::test]
async fn an_outage_that_outlasts_the_retries_commits_nothing_and_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let none = || [FaultConfig::default(), FaultConfig::default()];
    let first = save(&run.join("step-1").display().to_string(), none()).await;
    assert!(first.iter().all(|(o, _)| o.is_ok()));

    // Rank 1's storage is down for writes: its data file never lands.
    let path = run.join("step-2").display().to_string();
    let outcomes = save(
        &path,
        [FaultConfig::default(), FaultConfig::write_outage_after(0)],
    )
    .await;
    let rank1 = outcomes[1].0.as_ref().unwrap_err().to_string();
    assert!(rank1.contains("step-2/data/rank-1.bin"), "{rank1}");
    assert!(rank1.contains("gave up after 5 attempts"), "{rank1}");
    assert!(!outcomes[1].0.as_ref().unwrap_err().is_permanent());
    assert_eq!(outcomes[1].1.injected_writes(), 5);
    let rank0 = outcomes[0].0.as_ref().unwrap_err().to_string();
    assert!(
        rank0.contains("rank 1: ") && rank0.contains("data/rank-1.bin"),
        "{rank0}"
    );
    assert!(!run.join("step-2/manifest.json").exists());
    assert!(!run.join("step-2").join(CLAIM_FILE).exists());
    assert_eq!(
        std::fs::read_to_string(run.join("latest")).unwrap(),
        "step-1"
    );
}
