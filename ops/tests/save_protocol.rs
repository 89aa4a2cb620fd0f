//! The multi-rank save-and-commit protocol (`tessera_ops::save`) with in-process ranks on a local
//! directory: replicas written once by the worst-fit writer, the bytes read back equal, and a
//! failing rank leaves no manifest.
#![allow(clippy::unwrap_used)]

use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_ops::OpsError;
use tessera_ops::save::{
    HeldBox, Holdings, SaveOptions, boxes_to_write, global_tensors, save_rank,
};

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

async fn save_all(
    path: String,
    all: Vec<Holdings>,
    fail_rank: Option<u32>,
) -> Vec<Result<u64, OpsError>> {
    let mesh = InProcTransport::mesh(3, TransportOptions::default());
    let mut tasks = Vec::new();
    for transport in mesh {
        let (path, all) = (path.clone(), all.clone());
        tasks.push(tokio::spawn(async move {
            let rank = transport.rank() as usize;
            let owned: Vec<Vec<u8>> = all[rank].boxes.iter().map(|b| bytes_of(&b.fqn)).collect();
            let mut data: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
            // A rank whose buffers do not match its boxes fails before writing.
            if Some(transport.rank()) == fail_rank {
                data.pop();
            }
            let options = SaveOptions {
                step: Some(7),
                ..SaveOptions::default()
            };
            save_rank(&path, &options, &all, &data, &[], &transport)
                .await
                .map(|m| m.step.unwrap_or(0))
        }));
    }
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

use tessera_loader::transport::Transport;

#[tokio::test]
async fn three_ranks_commit_once_and_the_bytes_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run/step-7").display().to_string();
    let outcomes = save_all(path.clone(), replicated_world(), None).await;
    for outcome in &outcomes {
        assert_eq!(outcome.as_ref().unwrap(), &7);
    }
    let checkpoint = tessera_ops::open::open(&path).await.unwrap();
    assert!(checkpoint.committed);
    let meta = &checkpoint.meta;
    assert_eq!(meta.tensors().len(), 4);
    for (t, tensor) in meta.tensors().iter().enumerate() {
        let chunks = meta.chunks_of(t as u32);
        assert_eq!(chunks.len(), 1, "{} saved once", tensor.fqn);
        let file = &meta.files()[chunks[0].bytes.file as usize].path;
        let raw = std::fs::read(dir.path().join("run/step-7").join(file)).unwrap();
        let at = chunks[0].bytes.offset as usize;
        assert_eq!(&raw[at..at + 64], bytes_of(&tensor.fqn).as_slice());
    }
}

#[tokio::test]
async fn a_failing_rank_commits_nothing_and_every_rank_says_why() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("run/step-7").display().to_string();
    let outcomes = save_all(path.clone(), replicated_world(), Some(1)).await;
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
}
