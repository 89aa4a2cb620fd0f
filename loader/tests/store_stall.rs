//! Storage that stalls mid-body (an HTTP server that sends the headers and a few bytes, then
//! nothing, the connection left open): a whole load of every rank must end, with a storage error
//! that names the file and says it gave up after the policy's attempts, within a bound set by
//! the one [`RetryPolicy`] (docs/retry.md), never by the peer timeout and never hanging. The
//! checkpoint is real (native, verified), served over `http://127.0.0.1` by
//! [`StallingHttpServer`]: its metadata is served normally, so it opens and plans, and only the
//! reads of its data files stall.
// LoaderError is 128 bytes (object_store::Error is 72 of them), just at clippy's
// `result_large_err` threshold; the closures here return it on the cold path.
#![allow(clippy::unwrap_used, missing_docs, clippy::result_large_err)]

mod support_read;

use std::time::{Duration, Instant};

use support_read::{COLUMNS_TP3, DP2_TP2, PREFIX, expected_destination, rank_plans};
use tessera_loader::LoaderError;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, LoadedRank, load_rank};
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_planner::RankPlan;
use tessera_storage::testing::{Stall, StallingHttpServer};
use tessera_storage::{RetryPolicy, StorageError, StorageOptions};

/// Attempts per request in these tests.
const ATTEMPTS: u32 = 3;

/// Short timeouts, so that a stalled request is cut after 0.3 s of silence.
fn policy() -> RetryPolicy {
    RetryPolicy {
        max_attempts: ATTEMPTS,
        first_backoff: Duration::from_millis(10),
        connect_timeout: Duration::from_millis(300),
        read_timeout: Duration::from_millis(300),
        request_timeout: Duration::from_secs(3),
        ..RetryPolicy::default()
    }
}

/// The bound docs/retry.md gives for one rank's read of a stalled store, with [`policy`]:
/// `(max_attempts + 1) × (connect_timeout + read_timeout) + total_backoff()` plus one size check
/// (`head`) after the first failure; 3.0 s here. The tests allow several times that.
fn stall_bound(policy: &RetryPolicy) -> Duration {
    let attempt = policy.connect_timeout + policy.read_timeout;
    attempt * (policy.max_attempts + 2) + policy.total_backoff()
}

/// The fixture checkpoint written to a directory, served over HTTP, opened through its
/// `http://` location with [`policy`]'s timeouts.
async fn served() -> (tempfile::TempDir, StallingHttpServer, Checkpoint) {
    let (dir, store) = support_read::local_store();
    support_read::write_checkpoint(&store).await;
    let server = StallingHttpServer::start(dir.path());
    let options = StorageOptions {
        retry: policy(),
        ..StorageOptions::default()
    };
    let location =
        tessera_storage::open_with(&format!("{}/{PREFIX}", server.url()), &options).unwrap();
    let checkpoint = Checkpoint::open(location).await.unwrap();
    (dir, server, checkpoint)
}

fn options() -> LoadOptions {
    LoadOptions {
        read: ReadOptions {
            retry: policy(),
            ..ReadOptions::default()
        },
        progress: None,
        ..LoadOptions::default()
    }
}

/// Loads every rank of `plans` at once over an in-process mesh whose peer timeout is
/// `peer_timeout`, the way `tessera load` does; each rank's transport is dropped when its load
/// ends (a failed rank is gone for its peers). Returns each rank's outcome and the time taken;
/// panics when the load has not ended after 60 s.
async fn load_all(
    checkpoint: &Checkpoint,
    plans: &[RankPlan],
    peer_timeout: Duration,
) -> (Vec<Result<LoadedRank, LoaderError>>, Duration) {
    let started = Instant::now();
    let transports = InProcTransport::mesh(
        plans.len() as u32,
        TransportOptions::with_timeout(peer_timeout),
    );
    let tasks: Vec<_> = plans
        .iter()
        .cloned()
        .zip(transports)
        .map(|(plan, transport)| {
            let checkpoint = checkpoint.clone();
            tokio::spawn(async move { load_rank(&checkpoint, plan, &transport, &options()).await })
        })
        .collect();
    let outcomes = tokio::time::timeout(Duration::from_secs(60), async {
        let mut outcomes = Vec::new();
        for task in tasks {
            outcomes.push(task.await.unwrap());
        }
        outcomes
    })
    .await
    .expect("the load of a stalled store was still running after 60 s");
    (outcomes, started.elapsed())
}

/// Every rank failed (none reports success with partial buffers), and those that failed on
/// storage gave up on one of `files` ([`assert_gave_up`]); `why` says why none may succeed.
/// Returns the storage failures, which a stalled read must cause.
fn storage_failures(
    outcomes: &[Result<LoadedRank, LoaderError>],
    files: &[&str],
    why: &str,
) -> usize {
    let mut failures = 0;
    for (rank, outcome) in outcomes.iter().enumerate() {
        let error = outcome
            .as_ref()
            .err()
            .unwrap_or_else(|| panic!("rank {rank} loaded {why}"));
        eprintln!("rank {rank}: {error}");
        if let LoaderError::Storage(_) = error {
            assert_gave_up(error, files);
            failures += 1;
        }
    }
    failures
}

/// The load ended within a few times the policy's bound (far below the 60 s peer timeout).
fn assert_within_bound(took: Duration, what: &str) {
    let bound = stall_bound(&policy());
    eprintln!("{what} ended after {took:?} (bound {bound:?})");
    assert!(took < 4 * bound, "took {took:?}, bound {bound:?}");
}

/// The storage error a rank whose read stalled must fail with: the file, the byte range, the
/// attempts, and a transient (not permanent) cause.
fn assert_gave_up(error: &LoaderError, files: &[&str]) {
    let message = error.to_string();
    assert!(
        matches!(error, LoaderError::Storage(e) if matches!(**e, StorageError::Store { .. })),
        "{message}"
    );
    assert!(
        message.contains(&format!(
            "(gave up after {ATTEMPTS} attempts, the last one timed out) of {PREFIX}/data/"
        )),
        "{message}"
    );
    assert!(
        files
            .iter()
            .any(|f| message.contains(&format!("{PREFIX}/data/{f}.bin"))),
        "{message}"
    );
    assert!(!error.is_permanent(), "{message}");
}

/// The same checkpoint over the same server loads byte for byte when nothing stalls: the
/// failures below are the stall's, not the server's.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_over_http_is_byte_exact_when_nothing_stalls() {
    let (_dir, server, checkpoint) = served().await;
    let plans = rank_plans(&checkpoint.meta, DP2_TP2, true);
    let (outcomes, _) = load_all(&checkpoint, &plans, Duration::from_secs(60)).await;
    for (outcome, plan) in outcomes.into_iter().zip(&plans) {
        let loaded = outcome.unwrap_or_else(|e| panic!("rank {}: {e}", plan.rank));
        for (d, buffer) in loaded.buffers.iter().enumerate() {
            assert!(
                *buffer == expected_destination(plan, d),
                "rank {} destination {d}",
                plan.rank
            );
        }
        assert_eq!(loaded.report.retries, 0);
    }
    assert_eq!(server.stalled(), 0);
    assert!(
        server
            .requests()
            .iter()
            .any(|r| r.starts_with(&format!("GET /{PREFIX}/data/rank1.bin bytes="))),
        "{:?}",
        server.requests()
    );
}

/// Every data file stalls after 100 bytes of every answer: every rank fails (none succeeds with
/// partial buffers), each with the storage error of a stalled file, or (a rank whose own reads
/// are done or absent) with a transport error naming a rank that failed; and the load ends
/// within a few times the policy's bound, far below the 60 s peer timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_load_from_a_store_that_stalls_mid_body_fails_within_the_bound() {
    let (_dir, server, checkpoint) = served().await;
    let plans = rank_plans(&checkpoint.meta, DP2_TP2, true);
    server.stall(Stall::AfterBytes(100), |path| path.contains("/data/"));
    let (outcomes, took) = load_all(&checkpoint, &plans, Duration::from_secs(60)).await;
    let storage_failures =
        storage_failures(&outcomes, &["rank0", "rank1"], "from a store that stalls");
    // The others fail on their transport, naming a rank that failed.
    for (rank, outcome) in outcomes.iter().enumerate() {
        match outcome {
            Err(LoaderError::Storage(_)) => {}
            Err(error @ LoaderError::Transport { peer, detail, .. }) => assert!(
                outcomes[*peer as usize].is_err() && detail.contains("exited"),
                "rank {rank}: {error}"
            ),
            other => panic!("rank {rank}: unexpected {other:?}"),
        }
    }
    assert!(storage_failures > 0);
    assert!(
        server.stalled() >= u64::from(ATTEMPTS),
        "{}",
        server.stalled()
    );
    assert_within_bound(took, "load of a stalled store");
}

/// Only `rank1.bin` stalls: the ranks that read `rank0.bin` finish reading and wait for the
/// pieces their peers read from `rank1.bin`. They must fail as soon as those peers give up (their
/// transport is gone), not after the 60 s peer timeout, and the peers that read the stalled file
/// fail with its storage error.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ranks_waiting_on_a_peer_whose_read_stalls_fail_when_it_gives_up() {
    let (_dir, server, checkpoint) = served().await;
    let plans = rank_plans(&checkpoint.meta, DP2_TP2, true);
    server.stall(Stall::AfterBytes(100), |path| {
        path.ends_with("/data/rank1.bin")
    });
    let (outcomes, took) = load_all(&checkpoint, &plans, Duration::from_secs(60)).await;
    assert!(storage_failures(&outcomes, &["rank1"], "although a peer's read stalled") > 0);
    assert_within_bound(took, "load with one stalled file");
}

/// A server that never answers the data files (not even headers, HEAD included), with a layout
/// whose reads are strided (one small range per row, fetched together with `get_ranges`, then
/// one by one after a failure, with the size check in between): every extra request the read
/// path makes on failure is cut by the same timeout, and the load still ends within the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn strided_reads_from_a_server_that_never_answers_fail_within_the_bound() {
    let (_dir, server, checkpoint) = served().await;
    let plans = rank_plans(&checkpoint.meta, COLUMNS_TP3, true);
    server.stall(Stall::BeforeHeaders, |path| path.contains("/data/"));
    let (outcomes, took) = load_all(&checkpoint, &plans, Duration::from_secs(60)).await;
    let failures = storage_failures(
        &outcomes,
        &["rank0", "rank1"],
        "from a server that never answers",
    );
    assert!(failures > 0);
    assert_within_bound(took, "strided load of a silent store");
}
