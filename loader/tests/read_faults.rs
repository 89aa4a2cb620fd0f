//! The read path when storage misbehaves: transient faults are retried, a permanent outage
//! surfaces after the configured attempts, corrupt, truncated and missing data files fail with
//! errors that name the file and byte range, and the in-flight and byte limits hold without
//! deadlock.
#![allow(clippy::unwrap_used)]

mod support_read;

use std::sync::Arc;
use std::time::Duration;

use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use support_read::*;
use tessera_loader::LoaderError;
use tessera_loader::read::ReadOptions;
use tessera_storage::testing::{FaultConfig, FaultyStore};
use tessera_storage::{RetryPolicy, StorageError};

const RANK0: &str = "runs/demo/step-000010/data/rank0.bin";
const RANK1: &str = "runs/demo/step-000010/data/rank1.bin";

/// The fixture checkpoint in `inner`, and a faulty view of it (opened before faults start).
async fn faulty(inner: Arc<dyn ObjectStore>, config: FaultConfig) -> (Arc<FaultyStore>, Written) {
    let written = write_checkpoint(&inner).await;
    (Arc::new(FaultyStore::new(inner, config)), written)
}

async fn replace(store: &Arc<dyn ObjectStore>, path: &str, bytes: Vec<u8>) {
    store
        .put(&path.into(), PutPayload::from(bytes))
        .await
        .unwrap();
}

async fn contents(store: &Arc<dyn ObjectStore>, path: &str) -> Vec<u8> {
    let result = store.get(&path.into()).await.unwrap();
    result.bytes().await.unwrap().to_vec()
}

#[tokio::test]
async fn every_third_request_failing_still_loads() {
    let (_dir, inner) = local_store();
    let (store, written) = faulty(inner, FaultConfig::every_nth(3)).await;
    for (layout, dedup) in [(WHOLE, true), (COLUMNS_TP3, false)] {
        for plan in rank_plans(&written.meta, layout, dedup) {
            let before = store.injected();
            let options = ReadOptions {
                part_size: 4096,
                ..options(true)
            };
            let loaded = load(store.clone(), &plan, Some(&written.checksums), &options)
                .await
                .unwrap();
            check_loaded(&plan, &loaded);
            let injected = store.injected() - before;
            assert!(loaded.stats.retries > 0, "{:?}", loaded.stats);
            // Every retried request was an injected failure; the size checks after a first
            // failure (`head`) may have drawn a fault too.
            assert!(
                injected >= loaded.stats.retries,
                "{injected} {:?}",
                loaded.stats
            );
        }
    }
}

#[tokio::test]
async fn a_seeded_share_of_failures_is_retried_deterministically() {
    let mut retries = Vec::new();
    for _ in 0..2 {
        let (store, written) = faulty(memory_store(), FaultConfig::rate(0.3, 42)).await;
        let plan = &rank_plans(&written.meta, WHOLE, true)[0];
        // One request at a time: request numbers, and so the failures, repeat exactly.
        let options = ReadOptions {
            part_size: 4096,
            max_in_flight: 1,
            retry: RetryPolicy {
                max_attempts: 10,
                ..options(true).retry
            },
            ..options(true)
        };
        let loaded = load(store.clone(), plan, Some(&written.checksums), &options)
            .await
            .unwrap();
        check_loaded(plan, &loaded);
        assert!(loaded.stats.retries > 0);
        retries.push((loaded.stats.retries, store.stats()));
    }
    assert_eq!(retries[0], retries[1]);
}

#[tokio::test]
async fn a_permanent_outage_fails_after_max_attempts() {
    let (store, written) = faulty(memory_store(), FaultConfig::default()).await;
    store.set_outage(true);
    let plan = &rank_plans(&written.meta, WHOLE, true)[0];
    let options = ReadOptions {
        retry: RetryPolicy {
            max_attempts: 3,
            ..options(false).retry
        },
        max_in_flight: 1,
        ..options(false)
    };
    let error = load(store.clone(), plan, Some(&written.checksums), &options)
        .await
        .err()
        .unwrap();
    assert_eq!(
        error.to_string(),
        format!(
            "reading bytes 0..88152 (gave up after 3 attempts) of {RANK0}: Generic FaultyStore error: injected transient fault"
        )
    );
    assert!(matches!(
        &error,
        LoaderError::Storage(e) if matches!(
            **e,
            StorageError::Store {
                source: object_store::Error::Generic { .. },
                ..
            }
        )
    ));
    // One request per range (no gap to span without verification's blocks): three attempts at
    // the first part, one size check after its first failure, nothing else.
    let stats = store.stats();
    assert_eq!((stats.reads, stats.injected), (4, 4));
}

async fn corrupt_byte_is_named_with_its_file_and_block(store: Arc<dyn ObjectStore>) {
    let written = write_checkpoint(&store).await;
    let mut data = contents(&store, RANK1).await;
    // Inside the qkv rows of rank1 (they start at 49152): block 6 of 8 KiB.
    data[50_000] ^= 0x40;
    let block = &data[6 * 8192..7 * 8192];
    let actual = crc32c::crc32c(block);
    let expected = written.checksums.file("data/rank1.bin").unwrap().crcs[6];
    replace(&store, RANK1, data).await;

    let plan = &rank_plans(&written.meta, WHOLE, true)[0];
    let error = load(
        Arc::clone(&store),
        plan,
        Some(&written.checksums),
        &options(true),
    )
    .await
    .err()
    .unwrap();
    assert_eq!(
        error.to_string(),
        format!(
            "checksum mismatch in {RANK1} bytes 49152..57344: expected crc32c {expected:08x}, found {actual:08x}"
        )
    );

    // Small parts: the bad block is found in whichever part holds it.
    let small_parts = ReadOptions {
        part_size: 16384,
        ..options(true)
    };
    let error = load(
        Arc::clone(&store),
        plan,
        Some(&written.checksums),
        &small_parts,
    )
    .await
    .err()
    .unwrap();
    assert!(
        error.to_string().starts_with(&format!(
            "checksum mismatch in {RANK1} bytes 49152..57344: "
        )),
        "{error}"
    );

    // Without verification the corrupt bytes reach the piece (and only the test's own check
    // notices): verification is what catches them.
    let error = load(
        Arc::clone(&store),
        plan,
        Some(&written.checksums),
        &options(false),
    )
    .await
    .err()
    .unwrap();
    assert!(
        error.to_string().ends_with("arrived with the wrong bytes"),
        "{error}"
    );
}

#[tokio::test]
async fn a_corrupt_byte_on_disk() {
    let (_dir, store) = local_store();
    corrupt_byte_is_named_with_its_file_and_block(store).await;
}

#[tokio::test]
async fn a_corrupt_byte_in_memory() {
    corrupt_byte_is_named_with_its_file_and_block(memory_store()).await;
}

async fn truncated_file_is_a_short_read_naming_it(store: Arc<dyn ObjectStore>) {
    let written = write_checkpoint(&store).await;
    let plan = &rank_plans(&written.meta, WHOLE, true)[0];
    let data = contents(&store, RANK1).await;
    assert_eq!(data.len(), 88152);

    // Cut inside the one request for rank1: fewer bytes come back.
    replace(&store, RANK1, data[..50_000].to_vec()).await;
    for verify in [false, true] {
        let error = load(
            Arc::clone(&store),
            plan,
            Some(&written.checksums),
            &options(verify),
        )
        .await
        .err()
        .unwrap();
        assert_eq!(
            error.to_string(),
            format!("{RANK1}: asked for bytes 0..88152 but got 50000 bytes (truncated file?)")
        );
    }

    // Cut at a part boundary: the next part starts past the end, which stores report as a
    // generic error; a size check turns it into a short read at once, without retries.
    replace(&store, RANK1, data[..16384].to_vec()).await;
    let options = ReadOptions {
        part_size: 16384,
        max_in_flight: 1,
        retry: RetryPolicy {
            max_attempts: 5,
            first_backoff: Duration::from_secs(10),
            ..RetryPolicy::default()
        },
        ..options(true)
    };
    let error = load(Arc::clone(&store), plan, Some(&written.checksums), &options)
        .await
        .err()
        .unwrap();
    assert_eq!(
        error.to_string(),
        format!("{RANK1}: asked for bytes 16384..32768 but got 0 bytes (truncated file?)")
    );
}

#[tokio::test]
async fn a_truncated_file_on_disk() {
    let (_dir, store) = local_store();
    truncated_file_is_a_short_read_naming_it(store).await;
}

#[tokio::test]
async fn a_truncated_file_in_memory() {
    truncated_file_is_a_short_read_naming_it(memory_store()).await;
}

async fn missing_file_is_named(store: Arc<dyn ObjectStore>) {
    let written = write_checkpoint(&store).await;
    store.delete(&RANK1.into()).await.unwrap();
    let plan = &rank_plans(&written.meta, WHOLE, true)[0];
    let options = ReadOptions {
        retry: RetryPolicy {
            first_backoff: Duration::from_secs(10),
            ..RetryPolicy::default()
        },
        ..options(true)
    };
    let error = load(Arc::clone(&store), plan, Some(&written.checksums), &options)
        .await
        .err()
        .unwrap();
    assert_eq!(error.to_string(), format!("data file {RANK1} is missing"));
    assert!(matches!(error, LoaderError::MissingFile { .. }));
}

#[tokio::test]
async fn a_missing_file_on_disk() {
    let (_dir, store) = local_store();
    missing_file_is_named(store).await;
}

#[tokio::test]
async fn a_missing_file_in_memory() {
    missing_file_is_named(memory_store()).await;
}

/// Loads the whole fixture through a store that delays every request by 2 ms (so that requests
/// overlap) and returns the most requests that were in progress at once.
async fn peak_in_flight(options: ReadOptions) -> u64 {
    let config = FaultConfig {
        latency: Duration::from_millis(2),
        ..FaultConfig::default()
    };
    let (store, written) = faulty(memory_store(), config).await;
    let plan = &rank_plans(&written.meta, WHOLE, true)[0];
    let loaded = load(store.clone(), plan, Some(&written.checksums), &options)
        .await
        .unwrap();
    check_loaded(plan, &loaded);
    assert_eq!(store.stats().reads, loaded.stats.requests);
    store.stats().peak_in_flight
}

#[tokio::test]
async fn in_flight_requests_stay_within_the_limit() {
    let small_parts = ReadOptions {
        part_size: 8192,
        ..options(true)
    };
    let three = peak_in_flight(ReadOptions {
        max_in_flight: 3,
        ..small_parts.clone()
    })
    .await;
    assert_eq!(three, 3);
    let one = peak_in_flight(ReadOptions {
        max_in_flight: 1,
        ..small_parts
    })
    .await;
    assert_eq!(one, 1);
}

#[tokio::test]
async fn a_byte_budget_below_one_part_still_completes_one_part_at_a_time() {
    // Every 8 KiB part is larger than the whole 1 KiB budget: each goes alone.
    let peak = peak_in_flight(ReadOptions {
        part_size: 8192,
        max_in_flight: 8,
        max_buffered_bytes: 1024,
        ..options(true)
    })
    .await;
    assert_eq!(peak, 1);
    // A budget of two parts lets two (and no more than two) 8 KiB blocks fly at once.
    let peak = peak_in_flight(ReadOptions {
        part_size: 8192,
        max_in_flight: 8,
        max_buffered_bytes: 2 * 8192,
        ..options(true)
    })
    .await;
    assert_eq!(peak, 2);
}

/// Two same-sized boxes whose metadata rows point at each other's bytes (the manifest's record of
/// `metadata.arrow` recomputed, so the metadata opens cleanly and every block checksum still
/// matches): a load must fail naming the file, tensor, box and both crcs, never hand back the
/// other box's bytes.
#[tokio::test]
async fn swapped_box_locations_fail_the_load_naming_the_box() {
    use tessera_loader::checkpoint::Checkpoint;
    use tessera_loader::load::{LoadOptions, load_rank};
    use tessera_loader::transport::{InProcTransport, TransportOptions};
    use tessera_metadata::TensorBox;

    let store = memory_store();
    let written = write_checkpoint(&store).await;
    // The embed boxes are rows 0..128 in rank0.bin and rows 128..256 in rank1.bin, both at
    // offset 0 and 49 152 bytes long: swap where they live.
    let rows = |start: u64| TensorBox::new(vec![start, 0], vec![128, 96]);
    rewrite_boxes(&store, |chunks| {
        let a = chunks
            .iter()
            .position(|c| c.tensor == 0 && c.region == rows(0))
            .unwrap();
        let b = chunks
            .iter()
            .position(|c| c.tensor == 0 && c.region == rows(128))
            .unwrap();
        let (fa, fb) = (chunks[a].bytes.clone(), chunks[b].bytes.clone());
        assert_eq!((fa.offset, fa.length), (fb.offset, fb.length));
        chunks[a].bytes = fb;
        chunks[b].bytes = fa;
    })
    .await;
    let expected = written.meta.chunks()[0].crc32c.unwrap();
    let rank1 = contents(&store, RANK1).await;
    let actual = crc32c::crc32c(&rank1[..49_152]);
    assert_ne!(expected, actual);

    let checkpoint = Checkpoint::open(tessera_storage::Location {
        store: Arc::clone(&store),
        prefix: prefix(),
        display: PREFIX.to_string(),
        local_root: None,
        shared_files: Default::default(),
    })
    .await
    .unwrap();
    let plan = rank_plans(&checkpoint.meta, WHOLE, true).remove(0);
    let transport = InProcTransport::mesh(1, TransportOptions::default()).remove(0);
    let err = load_rank(&checkpoint, plan, &transport, &LoadOptions::default())
        .await
        .unwrap_err();
    let message = err.to_string();
    // Which of the two boxes completes first depends on request timing; either names itself.
    let first = format!(
        "checksum mismatch in {RANK1} bytes 0..49152 (tensor model.embed.weight box [0..128, 0..96]): \
         its metadata records crc32c {expected:08x}, the bytes have {actual:08x}"
    );
    let rank0 = contents(&store, RANK0).await;
    let second = format!(
        "checksum mismatch in {RANK0} bytes 0..49152 (tensor model.embed.weight box [128..256, 0..96]): \
         its metadata records crc32c {:08x}, the bytes have {:08x}",
        crc32c::crc32c(&rank1[..49_152]),
        crc32c::crc32c(&rank0[..49_152]),
    );
    assert!(message == first || message == second, "{message}");
}

/// A plan that records no checkpoint identity (from a server or a plan file older than
/// identities) is refused against a checkpoint that has one, naming the rank and the checkpoint:
/// nothing ties its offsets to these files. The same plan with its identity loads.
#[tokio::test]
async fn a_plan_without_an_identity_is_refused_naming_the_checkpoint() {
    use tessera_loader::checkpoint::Checkpoint;
    use tessera_loader::load::{LoadOptions, load_rank};
    use tessera_loader::transport::{InProcTransport, TransportOptions};

    let store = memory_store();
    write_checkpoint(&store).await;
    let checkpoint = Checkpoint::open(tessera_storage::Location {
        store: Arc::clone(&store),
        prefix: prefix(),
        display: PREFIX.to_string(),
        local_root: None,
        shared_files: Default::default(),
    })
    .await
    .unwrap();
    let identity = checkpoint.meta.identity().unwrap().to_string();
    let plan = rank_plans(&checkpoint.meta, WHOLE, true).remove(0);
    assert_eq!(plan.checkpoint_identity.as_deref(), Some(identity.as_str()));
    let mut anonymous = plan.clone();
    anonymous.checkpoint_identity = None;
    let transport = InProcTransport::mesh(1, TransportOptions::default()).remove(0);
    let err = load_rank(&checkpoint, anonymous, &transport, &LoadOptions::default())
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            tessera_loader::LoaderError::PlanWithoutIdentity { rank: 0, .. }
        ),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("does not say which checkpoint it was made for")
            && message.contains(PREFIX)
            && message.contains(&identity),
        "{message}"
    );
    let transport = InProcTransport::mesh(1, TransportOptions::default()).remove(0);
    load_rank(&checkpoint, plan, &transport, &LoadOptions::default())
        .await
        .unwrap();
}
