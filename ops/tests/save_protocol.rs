//! The multi-rank save-and-commit protocol (`tessera_ops::save`) with in-process ranks on a local
//! directory: replicas written once by the worst-fit writer, the bytes read back equal, a
//! failing rank leaves no manifest, and the write claim: a second job saving into the same
//! directory fails on every rank naming the holder while the first commits intact, a stale claim
//! refuses a save until `break_claim`, and the claim is gone after a commit and after a failure.
#![allow(clippy::unwrap_used)]

use tessera_loader::transport::{InProcTransport, Transport, TransportOptions};
use tessera_metadata::formats::native::verify_checkpoint;
use tessera_ops::OpsError;
use tessera_ops::claim::CLAIM_FILE;
use tessera_ops::save::{
    HeldBox, Holdings, SaveOptions, boxes_to_write, global_tensors, save_rank,
};
use tessera_storage::StorageOptions;

fn held(fqn: &str, shape: &[u64], offsets: &[u64], lengths: &[u64]) -> HeldBox {
    HeldBox {
        fqn: fqn.to_string(),
        dtype: "f32".to_string(),
        shape: shape.to_vec(),
        offsets: offsets.to_vec(),
        lengths: lengths.to_vec(),
    }
}

/// Three ranks: `big` (4×4 f32) replicated on every rank, `a`, `b`, `c` (each 4×4) replicated on
/// every rank too. Four equal boxes over three ranks: worst-fit gives one rank two, the others one.
fn replicated_world() -> Vec<Holdings> {
    let boxes: Vec<HeldBox> = ["a", "b", "big", "c"]
        .iter()
        .map(|f| held(f, &[4, 4], &[0, 0], &[4, 4]))
        .collect();
    (0..3)
        .map(|_| Holdings {
            boxes: boxes.clone(),
            objects: vec![],
        })
        .collect()
}

fn bytes_of(fqn: &str) -> Vec<u8> {
    (0..64u8)
        .map(|i| i ^ fqn.len() as u8 ^ fqn.as_bytes()[0])
        .collect()
}

#[test]
fn replicas_are_written_once_and_balanced() {
    let all = replicated_world();
    let tensors = global_tensors(&all).unwrap();
    let per_rank: Vec<Vec<usize>> = (0..3)
        .map(|r| boxes_to_write(&tensors, &all, r).unwrap())
        .collect();
    let mut written: Vec<usize> = per_rank.iter().flatten().copied().collect();
    written.sort_unstable();
    assert_eq!(
        written,
        vec![0, 1, 2, 3],
        "every box exactly once: {per_rank:?}"
    );
    let counts: Vec<usize> = per_rank.iter().map(Vec::len).collect();
    assert_eq!(counts.iter().max(), Some(&2), "{counts:?}");
    assert_eq!(counts.iter().min(), Some(&1), "{counts:?}");
}

#[test]
fn disagreeing_ranks_are_refused_by_name() {
    let mut all = replicated_world();
    all[2].boxes[1].shape = vec![4, 5];
    let error = global_tensors(&all).unwrap_err();
    assert_eq!(
        error.to_string(),
        "tensor b: rank 0 saves it as f32 of shape [4, 4] but rank 2 as f32 of shape [4, 5]"
    );
}

/// The bytes a job with `seed` saves for `fqn`: two jobs with different seeds save different
/// bytes, so a mix of their files shows.
fn job_bytes(fqn: &str, seed: u8) -> Vec<u8> {
    bytes_of(fqn).into_iter().map(|b| b ^ seed).collect()
}

/// One rank of a job: saves its boxes (bytes from `seed`); `short` drops its last data buffer
/// so that it fails before writing.
fn spawn_rank(
    transport: InProcTransport,
    path: String,
    all: Vec<Holdings>,
    seed: u8,
    options: SaveOptions,
    short: bool,
) -> tokio::task::JoinHandle<Result<u64, OpsError>> {
    tokio::spawn(async move {
        let rank = transport.rank() as usize;
        let owned: Vec<Vec<u8>> = all[rank]
            .boxes
            .iter()
            .map(|b| job_bytes(&b.fqn, seed))
            .collect();
        let mut data: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
        if short {
            data.pop();
        }
        save_rank(&path, &options, &all, &data, &[], &transport)
            .await
            .map(|saved| saved.manifest.step.unwrap_or(0))
    })
}

fn step_7() -> SaveOptions {
    SaveOptions {
        step: Some(7),
        ..SaveOptions::default()
    }
}

async fn join(
    tasks: Vec<tokio::task::JoinHandle<Result<u64, OpsError>>>,
) -> Vec<Result<u64, OpsError>> {
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

/// A three-rank job saving `seed`'s bytes into `path`.
async fn save_job(
    path: &str,
    seed: u8,
    options: SaveOptions,
    fail_rank: Option<u32>,
) -> Vec<Result<u64, OpsError>> {
    let all = replicated_world();
    let tasks = InProcTransport::mesh(3, TransportOptions::default())
        .into_iter()
        .map(|t| {
            let short = Some(t.rank()) == fail_rank;
            spawn_rank(
                t,
                path.to_string(),
                all.clone(),
                seed,
                options.clone(),
                short,
            )
        })
        .collect();
    join(tasks).await
}

async fn assert_committed_intact(dir: &std::path::Path, seed: u8) {
    let root = dir.join("run/step-7");
    let path = root.display().to_string();
    let checkpoint = tessera_ops::open::open(&path).await.unwrap();
    assert!(checkpoint.committed);
    let meta = &checkpoint.meta;
    assert_eq!(meta.tensors().len(), 4);
    for (t, tensor) in meta.tensors().iter().enumerate() {
        let chunks = meta.chunks_of(t as u32);
        assert_eq!(chunks.len(), 1, "{} saved once", tensor.fqn);
        let file = &meta.files()[chunks[0].bytes.file as usize].path;
        let raw = std::fs::read(root.join(file)).unwrap();
        let at = chunks[0].bytes.offset as usize;
        assert_eq!(
            &raw[at..at + 64],
            job_bytes(&tensor.fqn, seed).as_slice(),
            "{} in {file}",
            tensor.fqn
        );
    }
    let location = tessera_storage::create_with(&path, &StorageOptions::default()).unwrap();
    let report = verify_checkpoint(location.store.as_ref(), &location.prefix)
        .await
        .unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert!(!root.join(CLAIM_FILE).exists(), "the claim is released");
}

#[tokio::test]
async fn three_ranks_commit_once_and_the_bytes_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run/step-7").display().to_string();
    let outcomes = save_job(&path, 0, step_7(), None).await;
    for outcome in &outcomes {
        assert_eq!(outcome.as_ref().unwrap(), &7);
    }
    assert_committed_intact(dir.path(), 0).await;
}

#[tokio::test]
async fn a_failing_rank_commits_nothing_and_every_rank_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run/step-7").display().to_string();
    let outcomes = save_job(&path, 0, step_7(), Some(1)).await;
    let rank1 = outcomes[1].as_ref().unwrap_err().to_string();
    assert_eq!(rank1, "rank 1: 4 boxes but 3 data buffers");
    let rank0 = outcomes[0].as_ref().unwrap_err().to_string();
    assert_eq!(
        rank0,
        "not committed, ranks failed: rank 1: rank 1: 4 boxes but 3 data buffers"
    );
    assert!(
        outcomes[2]
            .as_ref()
            .unwrap_err()
            .to_string()
            .contains("rank 1: 4 boxes but 3 data buffers")
    );
    assert!(!dir.path().join("run/step-7/manifest.json").exists());
    assert!(
        !dir.path().join("run/step-7").join(CLAIM_FILE).exists(),
        "a failed save releases its claim"
    );
    // So the job can save again at once.
    let again = save_job(&path, 0, step_7(), None).await;
    assert!(again.iter().all(Result::is_ok), "{again:?}");
    assert_committed_intact(dir.path(), 0).await;
}

/// Waits (bounded) until `file` exists.
async fn wait_for(file: &std::path::Path) {
    for _ in 0..1000 {
        if file.exists() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("{} never appeared", file.display());
}

#[tokio::test]
async fn a_second_job_fails_on_every_rank_naming_the_holder_and_the_first_commits_intact() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run/step-7");
    let path = root.display().to_string();
    let all = replicated_world();
    // Job A: ranks 0 and 2 start, rank 1 is held back, so A holds the claim (and rank 2 has
    // written its file) but cannot commit while job B runs.
    let mut first = InProcTransport::mesh(3, TransportOptions::default());
    let held_back = first.remove(1);
    let mut a_tasks: Vec<_> = first
        .into_iter()
        .map(|t| spawn_rank(t, path.clone(), all.clone(), 1, step_7(), false))
        .collect();
    wait_for(&root.join(CLAIM_FILE)).await;

    let b = save_job(&path, 2, step_7(), None).await;
    let holder = format!(
        "is held by tessera.save pid {} on host ",
        std::process::id()
    );
    for (rank, outcome) in b.iter().enumerate() {
        let error = outcome.as_ref().unwrap_err();
        let text = error.to_string();
        assert!(
            matches!(error, OpsError::Context { inner, .. } if matches!(**inner, OpsError::Claimed { .. })),
            "rank {rank}: {error:?}"
        );
        assert!(
            text.starts_with(&format!(
                "rank 0 claiming {path} for writing: {path} is being written by another writer: step-7/.tessera-claim.json {holder}"
            )),
            "rank {rank}: {text}"
        );
        assert!(
            text.ends_with(
                "If that writer is dead (killed, its host gone), rerun the save with break_claim=True to remove its claim and write anyway"
            ),
            "rank {rank}: {text}"
        );
    }

    a_tasks.insert(
        1,
        spawn_rank(held_back, path.clone(), all.clone(), 1, step_7(), false),
    );
    for outcome in join(a_tasks).await {
        assert_eq!(outcome.unwrap(), 7);
    }
    assert_committed_intact(dir.path(), 1).await;
}

#[tokio::test]
async fn two_racing_jobs_commit_exactly_one_intact_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run/step-7").display().to_string();
    let (a, b) = tokio::join!(
        save_job(&path, 1, step_7(), None),
        save_job(&path, 2, step_7(), None)
    );
    let committed = |job: &[Result<u64, OpsError>]| job.iter().all(Result::is_ok);
    let (winner, loser) = match (committed(&a), committed(&b)) {
        (true, false) => (1, &b),
        (false, true) => (2, &a),
        _ => panic!("exactly one job commits: {a:?} {b:?}"),
    };
    for outcome in loser {
        let text = outcome.as_ref().unwrap_err().to_string();
        // Refused by the claim while the winner wrote, or, if the winner had already finished,
        // by its manifest before writing anything.
        assert!(
            text.contains("is being written by another writer: step-7/.tessera-claim.json is held by tessera.save pid")
                || text.contains("holds a committed checkpoint"),
            "{text}"
        );
    }
    assert_committed_intact(dir.path(), winner).await;
}

#[tokio::test]
async fn a_stale_claim_refuses_the_save_and_break_claim_lets_it_through() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("run/step-7");
    let path = root.display().to_string();
    std::fs::create_dir_all(root.join("data")).unwrap();
    std::fs::write(
        root.join(CLAIM_FILE),
        r#"{"pid": 4242, "host": "trainer-7", "created": "2026-01-02T03:04:05Z", "command": "tessera.save"}"#,
    )
    .unwrap();
    // What object_store's local store leaves of an upload in flight when its writer is killed.
    std::fs::write(root.join("data/rank-0.bin#3"), b"half an upload").unwrap();

    let refused = save_job(&path, 1, step_7(), None).await;
    let expected = format!(
        "rank 0 claiming {path} for writing: {path} is being written by another writer: step-7/.tessera-claim.json is held by tessera.save pid 4242 on host trainer-7 since 2026-01-02T03:04:05Z. If that writer is dead (killed, its host gone), rerun the save with break_claim=True to remove its claim and write anyway"
    );
    for outcome in &refused {
        assert_eq!(outcome.as_ref().unwrap_err().to_string(), expected);
    }
    let mut left: Vec<String> = std::fs::read_dir(root.join("data"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, vec!["rank-0.bin#3"], "a refused save writes nothing");

    let options = SaveOptions {
        break_claim: true,
        ..step_7()
    };
    let broke = save_job(&path, 1, options, None).await;
    for outcome in broke {
        assert_eq!(outcome.unwrap(), 7);
    }
    assert!(!root.join("data/rank-0.bin#3").exists());
    assert_committed_intact(dir.path(), 1).await;
}
