//! A store that stops answering: the read path gives up after the [`RetryPolicy`]'s attempts,
//! with an error that names the file and says it may pass (`!is_permanent()`), and never hangs.
//! Once against the fault-injecting wrapper (the request count is exact), once against a real S3
//! server that goes away (connection refused over HTTP, object_store's own retry off).
// LoaderError is 128 bytes (object_store::Error is 72 of them), just at clippy's
// `result_large_err` threshold; the closures here return it on the cold path.
#![allow(clippy::unwrap_used, clippy::result_large_err)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};
use tessera_loader::LoaderError;
use tessera_loader::read::ReadOptions;
use tessera_loader::read::scheduler::{FileRange, RangeScheduler, SourceFile};
use tessera_storage::testing::{FaultConfig, FaultyStore, S3TestServer};
use tessera_storage::{RetryPolicy, StorageError};

const SIZE: usize = 10_000;

fn bytes() -> Vec<u8> {
    (0..SIZE).map(|i| (i * 31 % 251) as u8).collect()
}

/// Reads all of `path` (one part, one request per attempt) with the default read options, as a
/// load would (without block checksums: the outage is the subject, not verification).
async fn read_all(store: Arc<dyn ObjectStore>, path: &Path) -> Result<Vec<u8>, LoaderError> {
    let files = vec![SourceFile {
        path: path.clone(),
        key: "data/rank0.bin".to_string(),
    }];
    let options = ReadOptions {
        verify: false,
        ..ReadOptions::default()
    };
    let scheduler = RangeScheduler::new(store, files, None, &options);
    let schedule = scheduler.schedule(vec![FileRange {
        file: 0,
        start: 0,
        end: SIZE as u64,
    }])?;
    assert_eq!(schedule.parts.len(), 1);
    let mut out = vec![0u8; SIZE];
    scheduler
        .fetch(&schedule.parts, |part, bytes| {
            out[part.start as usize..part.end as usize].copy_from_slice(bytes);
            Ok(())
        })
        .await?;
    Ok(out)
}

#[tokio::test]
async fn an_outage_gives_up_after_max_attempts() {
    let path = Path::from("ckpt/data/rank0.bin");
    let inner: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
    inner.put(&path, PutPayload::from(bytes())).await.unwrap();
    let store = Arc::new(FaultyStore::new(inner, FaultConfig::outage()));

    let error = read_all(store.clone(), &path).await.unwrap_err();
    let policy = RetryPolicy::default();
    assert_eq!(ReadOptions::default().retry, policy);
    assert_eq!(
        error.to_string(),
        format!(
            "reading bytes 0..{SIZE} (gave up after {} attempts) of {path}: Generic FaultyStore error: injected transient fault",
            policy.max_attempts
        )
    );
    assert!(matches!(&error, LoaderError::Storage(e) if matches!(**e, StorageError::Store { .. })));
    assert!(!error.is_permanent(), "{error}");
    // `max_attempts` range reads and nothing more, plus the one size check (`head`) after the
    // first failure, which tells a truncated file from an outage; it fails too.
    let stats = store.stats();
    let attempts = u64::from(policy.max_attempts);
    assert_eq!(stats.reads, attempts + 1, "{stats:?}");
    assert_eq!(stats.injected, stats.reads, "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_s3_server_fails_the_read_instead_of_hanging() {
    let started = Instant::now();
    let outcome = tokio::time::timeout(Duration::from_secs(60), async {
        let dir = tempfile::tempdir().unwrap();
        let server = S3TestServer::start(dir.path());
        server.create_bucket("ckpt");
        let location =
            tessera_storage::create_with("s3://ckpt/runs/demo/step-000010", &server.options())
                .unwrap();
        let path = location.prefix.clone().join("data").join("rank0.bin");
        location
            .store
            .put(&path, PutPayload::from(bytes()))
            .await
            .unwrap();
        assert_eq!(
            read_all(location.store.clone(), &path).await.unwrap(),
            bytes()
        );

        // Dropping the server stops it (joining its thread: off the runtime's workers).
        tokio::task::spawn_blocking(move || drop(server))
            .await
            .unwrap();
        let gone = Instant::now();
        let error = read_all(location.store.clone(), &path).await.unwrap_err();
        eprintln!(
            "read against the stopped server failed after {:?}: {error}",
            gone.elapsed()
        );
        (error, path)
    })
    .await;
    eprintln!("whole test: {:?}", started.elapsed());
    let Ok((error, path)) = outcome else {
        panic!("the read hung for over 60 s after the server stopped");
    };
    assert!(
        matches!(&error, LoaderError::Storage(e) if matches!(**e, StorageError::Store { .. })),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(message.contains(path.as_ref()), "{message}");
    assert!(
        message.contains(&format!(
            "(gave up after {} attempts)",
            RetryPolicy::default().max_attempts
        )),
        "{message}"
    );
    assert!(!error.is_permanent(), "{error}");
}
