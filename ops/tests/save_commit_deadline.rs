//! The save's commit deadline and its truthful outcomes, with rank 0's writes stalled or failed
//! at one named object (`HookedStore` as its store layer): rank 0 paused past another rank's wait
//! commits nothing and every rank says why (in-process and over TCP on 127.0.0.1); a rank whose
//! wait ends after the commit point reports the save committed, with a warning; one whose wait
//! ends before the manifest lands says the outcome is unknown, not that the save failed; and a
//! `latest` pointer that cannot be written after the manifest is a committed checkpoint on every
//! rank, not a failed save.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::FutureExt;
use object_store::path::Path;
use tessera_loader::transport::{InProcTransport, Transport, TransportOptions};
use tessera_ops::OpsError;
use tessera_ops::claim::CLAIM_FILE;
use tessera_ops::save::{
    AfterCommit, HeldBox, Holdings, SaveOptions, Saved, StoreLayer, commit_margin, save_rank,
};
use tessera_storage::testing::HookedStore;
use tessera_storage::{RetryPolicy, StorageOptions};

/// How long rank 1 waits for rank 0's word: short, so the tests take seconds, yet ample for an
/// unstalled rank 0 on a busy machine (it must be ready within `WAIT` less the margin).
const WAIT: Duration = Duration::from_secs(2);

/// How long the stalled write of rank 0 takes: well past `WAIT`.
const STALL: Duration = Duration::from_secs(4);

/// The transports' own wait for a peer, shorter than `WAIT`: rank 1 keeps listening past it.
const PEER_TIMEOUT: Duration = Duration::from_secs(1);

/// What rank 0's store does to the write of one object.
#[derive(Clone, Copy)]
enum Fault {
    /// Nothing: every write goes through.
    None,
    /// The write of the object whose path ends with the string (as the store names it: relative
    /// to the run directory) takes `STALL` longer.
    Stall(&'static str),
    /// The write of that object fails as on a full disk, every time.
    DiskFull(&'static str),
}

fn world() -> Vec<Holdings> {
    let held = |fqn: &str| HeldBox {
        fqn: fqn.to_string(),
        dtype: "f32".to_string(),
        shape: vec![16],
        offsets: vec![0],
        lengths: vec![16],
    };
    vec![
        Holdings {
            boxes: vec![held("a")],
            objects: vec![],
        },
        Holdings {
            boxes: vec![held("b")],
            objects: vec![],
        },
    ]
}

fn options(fault: Fault) -> SaveOptions {
    let layer = StoreLayer::new(move |inner| {
        Arc::new(HookedStore::new(inner, move |path: &Path| {
            let path = path.to_string();
            async move {
                match fault {
                    Fault::Stall(end) if path.ends_with(end) => tokio::time::sleep(STALL).await,
                    Fault::DiskFull(end) if path.ends_with(end) => {
                        return Err(object_store::Error::Generic {
                            store: "test",
                            source: Box::new(std::io::Error::from(std::io::ErrorKind::StorageFull)),
                        });
                    }
                    _ => {}
                }
                Ok(())
            }
            .boxed()
        }))
    });
    SaveOptions {
        storage: StorageOptions {
            // Quick retries of the failing write: the test waits through every backoff.
            retry: RetryPolicy {
                first_backoff: Duration::from_millis(1),
                ..RetryPolicy::default()
            },
            ..StorageOptions::default()
        },
        store_layer: Some(layer),
        outcome_wait: WAIT,
        ..SaveOptions::default()
    }
}

/// One rank's outcome, and when it returned.
type Outcome = (Result<Saved, OpsError>, Instant);

/// Saves `world()` at `path` from two ranks over `transports`, rank 0 writing with `fault`.
async fn save<T: Transport + 'static>(
    path: &str,
    fault: Fault,
    transports: Vec<T>,
) -> Vec<Outcome> {
    let all = world();
    let tasks: Vec<_> = transports
        .into_iter()
        .map(|transport| {
            let rank = transport.rank() as usize;
            let options = options(if rank == 0 { fault } else { Fault::None });
            let (all, path) = (all.clone(), path.to_string());
            tokio::spawn(async move {
                let data: Vec<u8> = (0..64).map(|i| i as u8 ^ rank as u8).collect();
                let outcome = save_rank(&path, &options, &all, &[&data], &[], &transport).await;
                (outcome, Instant::now())
            })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

fn in_process() -> Vec<InProcTransport> {
    InProcTransport::mesh(2, TransportOptions::with_timeout(PEER_TIMEOUT))
}

/// A two-rank TCP mesh on 127.0.0.1.
async fn over_tcp() -> Vec<tessera_loader::transport::TcpTransport> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let connected = tessera_ops::coord::connect(rank, 2, "127.0.0.1", port, PEER_TIMEOUT);
            tokio::spawn(connected)
        })
        .collect();
    let mut mesh = Vec::new();
    for rank in ranks {
        mesh.push(rank.await.unwrap().unwrap());
    }
    mesh
}

/// A committed step-1 in `run`, so that `latest` has a step to keep.
async fn first_step(run: &std::path::Path) {
    let path = run.join("step-1").display().to_string();
    for (outcome, _) in save(&path, Fault::None, in_process()).await {
        let saved = outcome.unwrap();
        assert_eq!(saved.warning, None);
    }
}

fn latest(run: &std::path::Path) -> String {
    std::fs::read_to_string(run.join("latest")).unwrap()
}

/// Rank 0 stalls writing its data file (a pause, a slow disk) while rank 1, its report sent,
/// waits `WAIT` for the outcome: both fail, each naming the cause, and nothing is committed.
async fn paused_rank_0_commits_nothing<T: Transport + 'static>(transports: Vec<T>) {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    first_step(&run).await;
    let path = run.join("step-2").display().to_string();
    let started = Instant::now();
    let outcomes = save(&path, Fault::Stall("data/rank-0.bin"), transports).await;

    let rank1 = outcomes[1].0.as_ref().unwrap_err();
    assert!(
        matches!(rank1, OpsError::NoAnswer { rank: 1, .. }),
        "{rank1}"
    );
    let text = rank1.to_string();
    assert!(
        text.starts_with(&format!(
            "checkpoint {path} is not committed: rank 0 did not answer rank 1 within {WAIT:?} ("
        )) && text.ends_with("), and there is no manifest"),
        "{text}"
    );
    assert!(!rank1.is_permanent() && !rank1.is_committed());
    // Rank 1 gave up at its deadline, not when rank 0 finally spoke.
    let gave_up = outcomes[1].1 - started;
    assert!(gave_up >= WAIT && gave_up < STALL, "{gave_up:?}");

    let rank0 = outcomes[0].0.as_ref().unwrap_err();
    let OpsError::TooLateToCommit {
        rank,
        waits,
        margin,
        ready_after,
    } = rank0
    else {
        panic!("rank 0: {rank0}");
    };
    assert_eq!((*rank, *waits, *margin), (1, WAIT, commit_margin(WAIT)));
    assert!(*ready_after + *margin >= WAIT, "{ready_after:?}");
    assert!(!rank0.is_permanent() && !rank0.is_committed());
    assert!(
        rank0
            .to_string()
            .starts_with("not committed: rank 0 was ready to commit ")
            && rank0.to_string().contains(&format!(
                "after rank 1's report, but rank 1 waits only {WAIT:?} for the outcome"
            )),
        "{rank0}"
    );

    let step = run.join("step-2");
    assert!(!step.join("manifest.json").exists());
    assert!(!step.join(CLAIM_FILE).exists(), "the claim is released");
    assert_eq!(latest(&run), "step-1");
}

#[tokio::test]
async fn rank_0_paused_past_a_ranks_wait_commits_nothing_and_every_rank_says_why() {
    paused_rank_0_commits_nothing(in_process()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_tcp_rank_0_paused_past_a_ranks_wait_commits_nothing() {
    paused_rank_0_commits_nothing(over_tcp().await).await;
}

#[tokio::test]
async fn a_rank_whose_wait_ends_after_the_commit_point_reports_the_save_committed() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    first_step(&run).await;
    let path = run.join("step-2").display().to_string();
    // The manifest is written at once; moving `latest` after it stalls past rank 1's wait.
    let outcomes = save(&path, Fault::Stall("latest"), in_process()).await;

    let rank0 = outcomes[0].0.as_ref().unwrap();
    assert_eq!(rank0.warning, None);
    let rank1 = outcomes[1].0.as_ref().unwrap();
    assert_eq!(rank1.manifest, rank0.manifest);
    let warning = rank1.warning.as_deref().unwrap();
    assert!(
        warning.starts_with(&format!(
            "checkpoint {path} is committed, but rank 0 did not answer rank 1 within {WAIT:?} ("
        )) && warning.ends_with("rank 1 found this save's manifest there itself"),
        "{warning}"
    );
    // Rank 1 said so before rank 0 was done: it did not wait for the late answer.
    assert!(outcomes[1].1 < outcomes[0].1);
    let checkpoint = tessera_ops::open::open(&path).await.unwrap();
    assert!(checkpoint.committed);
    assert_eq!(latest(&run), "step-2");
}

#[tokio::test]
async fn a_manifest_slower_than_a_ranks_wait_is_an_unknown_outcome_not_a_failure() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run/step-2").display().to_string();
    // Rank 0 decided to commit and told rank 1; the manifest itself then takes past rank 1's wait.
    let outcomes = save(&path, Fault::Stall("step-2/manifest.json"), in_process()).await;

    let rank1 = outcomes[1].0.as_ref().unwrap_err();
    assert!(
        matches!(rank1, OpsError::OutcomeUnknown { rank: 1, .. }),
        "{rank1}"
    );
    let text = rank1.to_string();
    assert!(
        text.starts_with(&format!(
            "checkpoint {path}: not known whether it is committed: rank 0 began committing but did not answer rank 1 within {WAIT:?} ("
        )),
        "{text}"
    );
    assert!(!text.contains("not committed"), "{text}");
    assert!(outcomes[1].1 < outcomes[0].1);
    // And indeed it was committed after rank 1 looked.
    let rank0 = outcomes[0].0.as_ref().unwrap();
    let checkpoint = tessera_ops::open::open(&path).await.unwrap();
    assert!(checkpoint.committed);
    assert_eq!(rank0.manifest.step, Some(2));
}

#[tokio::test]
async fn latest_that_cannot_be_written_after_the_manifest_is_a_committed_save_on_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    first_step(&run).await;
    let path = run.join("step-2").display().to_string();
    let outcomes = save(&path, Fault::DiskFull("latest"), in_process()).await;

    let mut manifests = Vec::new();
    for (rank, (outcome, _)) in outcomes.iter().enumerate() {
        let error = outcome.as_ref().unwrap_err();
        let OpsError::CommittedBut {
            checkpoint,
            after: AfterCommit::LatestNotMoved { latest, detail },
            manifest,
        } = error
        else {
            panic!("rank {rank}: {error}");
        };
        assert_eq!(checkpoint, &path);
        assert_eq!(latest, &run.join("latest").display().to_string());
        assert!(detail.starts_with("writing latest: "), "{detail}");
        let text = error.to_string();
        assert!(
            text.starts_with(&format!(
                "checkpoint {path} IS committed (its manifest is written), but "
            )) && text.contains(&format!("{latest} was not moved to it: writing latest: ")),
            "rank {rank}: {text}"
        );
        assert!(error.is_committed() && error.is_permanent(), "rank {rank}");
        manifests.push(manifest.clone());
    }
    assert_eq!(manifests[0], manifests[1]);
    let checkpoint = tessera_ops::open::open(&path).await.unwrap();
    assert!(checkpoint.committed);
    assert_eq!(manifests[0].step, Some(2));
    assert!(!run.join("step-2").join(CLAIM_FILE).exists());
    assert_eq!(latest(&run), "step-1");
}
