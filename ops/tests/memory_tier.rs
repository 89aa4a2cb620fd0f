//! The save side of the memory tier: four in-process ranks on two "nodes" (two tier
//! directories) save three steps with the tier; each node's tier then holds exactly its ranks'
//! files of the newest two steps, every copy verifies against the committed checkpoint, and a
//! copy left by a save that never committed is neither found nor kept.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::tier::find_copies;
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_ops::memory_tier::{MemoryTier, prune};
use tessera_ops::save::{HeldBox, Holdings, SaveOptions, save_rank};

/// Rank r holds rows [4r, 4r+4) of `w` (16×8 f32) and all of `b` (8 f32, replicated).
fn holdings() -> Vec<Holdings> {
    (0..4u64)
        .map(|r| Holdings {
            boxes: vec![
                HeldBox {
                    fqn: "w".into(),
                    dtype: "f32".into(),
                    shape: vec![16, 8],
                    offsets: vec![4 * r, 0],
                    lengths: vec![4, 8],
                },
                HeldBox {
                    fqn: "b".into(),
                    dtype: "f32".into(),
                    shape: vec![8],
                    offsets: vec![0],
                    lengths: vec![8],
                },
            ],
            objects: vec![],
        })
        .collect()
}

async fn save_step(root: &Path, step: u64, tiers: &[&Path; 2]) -> Vec<Option<u64>> {
    try_save_step(root, step, tiers)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// [`save_step`], each rank's outcome as it is.
async fn try_save_step(
    root: &Path,
    step: u64,
    tiers: &[&Path; 2],
) -> Vec<Result<Option<u64>, String>> {
    let path = root.join(format!("step-{step}")).display().to_string();
    let all = holdings();
    let mesh = InProcTransport::mesh(
        4,
        TransportOptions::with_timeout(std::time::Duration::from_secs(10)),
    );
    let mut tasks = Vec::new();
    for (rank, transport) in mesh.into_iter().enumerate() {
        let (path, all) = (path.clone(), all.clone());
        let options = SaveOptions {
            step: Some(step),
            memory_tier: Some(MemoryTier::new(tiers[rank / 2])),
            ..SaveOptions::default()
        };
        tasks.push(tokio::spawn(async move {
            let w: Vec<u8> = (0..128u32)
                .map(|i| (i as u8) ^ (rank as u8) ^ (step as u8))
                .collect();
            let b: Vec<u8> = (0..32u8).map(|i| i.wrapping_mul(step as u8)).collect();
            let saved = save_rank(&path, &options, &all, &[&w, &b], &[], &transport)
                .await
                .map_err(|e| e.to_string())?;
            Ok(saved.memory_tier.unwrap()?.path.map(|_| rank as u64))
        }));
    }
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_node_keeps_its_ranks_files_of_the_newest_steps() {
    let root = tempfile::tempdir().unwrap();
    let (node_a, node_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let tiers = [node_a.path(), node_b.path()];
    for step in 1..=3 {
        let left = save_step(root.path(), step, &tiers).await;
        // `b` is replicated: one rank writes it, but every rank writes its rows of `w`.
        assert!(left.iter().all(Option::is_some), "{left:?}");
    }
    let step3 = Checkpoint::open(
        tessera_storage::open(&root.path().join("step-3").display().to_string()).unwrap(),
    )
    .await
    .unwrap();
    let identity = step3.meta.identity().unwrap();
    let on_a = find_copies(node_a.path(), &step3.meta, identity);
    let on_b = find_copies(node_b.path(), &step3.meta, identity);
    let names = |found: &tessera_loader::tier::TierCopies| -> Vec<String> {
        let mut names: Vec<String> = found
            .file_indices()
            .iter()
            .map(|&f| step3.meta.files()[f as usize].path.clone())
            .collect();
        names.sort();
        names
    };
    assert_eq!(names(&on_a), ["data/rank-0.bin", "data/rank-1.bin"]);
    assert_eq!(names(&on_b), ["data/rank-2.bin", "data/rank-3.bin"]);
    assert!(on_a.ignored.is_empty() && on_b.ignored.is_empty());
    // The default budget keeps two steps: step 1's copies are gone.
    let mut copies: Vec<String> = std::fs::read_dir(node_a.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    copies.sort();
    assert_eq!(copies.len(), 2, "{copies:?}");
    assert!(
        copies
            .iter()
            .all(|c| c.starts_with("step-2-") || c.starts_with("step-3-")),
        "{copies:?}"
    );

    // Step 2's copies are not step 3's.
    let step2 = Checkpoint::open(
        tessera_storage::open(&root.path().join("step-2").display().to_string()).unwrap(),
    )
    .await
    .unwrap();
    assert_ne!(step2.meta.identity(), step3.meta.identity());
    assert_eq!(
        find_copies(node_a.path(), &step2.meta, step2.meta.identity().unwrap())
            .file_indices()
            .len(),
        2
    );
}

#[test]
fn prune_keeps_the_newest_copies_within_the_budget_and_drops_what_died_saves_left() {
    let tier = tempfile::tempdir().unwrap();
    let copy = |name: &str, saved: u64, bytes: usize, record: bool| {
        let dir = tier.path().join(name).join("data");
        std::fs::create_dir_all(&dir).unwrap();
        // What makes a folder a copy tessera may remove (`write_copy` writes it first).
        let marker = serde_json::json!({
            "format": "tessera-memory-tier", "version": 1, "copy": name,
        });
        std::fs::write(
            tier.path().join(name).join(".tessera-tier-copy.json"),
            marker.to_string(),
        )
        .unwrap();
        std::fs::write(dir.join("rank-0.bin"), vec![7u8; bytes]).unwrap();
        if record {
            let json = serde_json::json!({
                "format": "tessera-memory-tier", "version": 1, "checkpoint": "x",
                "identity": format!("native:{name}"), "step": null, "file": "data/rank-0.bin",
                "size": bytes, "entries": [], "saved_unix_ms": saved,
            });
            std::fs::write(dir.join("rank-0.bin.tier.json"), json.to_string()).unwrap();
        }
    };
    copy("step-1-0ld", 1, 1000, true);
    copy("step-2-m1d", 2, 1000, true);
    copy("step-3-new", 3, 1000, true);
    // A save that died before its record: older (by mtime) than every kept copy once they are
    // rewritten below.
    copy("step-9-dead", 0, 500, false);
    std::thread::sleep(std::time::Duration::from_millis(20));
    copy("step-2-m1d", u64::MAX / 2, 1000, true);
    copy("step-3-new", u64::MAX / 2 + 1, 1000, true);

    let dry = prune(tier.path(), 2, None, None, true).unwrap();
    let names = |paths: &[std::path::PathBuf]| -> Vec<String> {
        let mut n: Vec<String> = paths
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    };
    assert_eq!(names(&dry.kept), ["step-2-m1d", "step-3-new"]);
    assert_eq!(names(&dry.removed), ["step-1-0ld", "step-9-dead"]);
    assert!(
        tier.path().join("step-1-0ld").exists(),
        "a dry run removes nothing"
    );

    // A byte budget below two copies keeps the newest (and never the protected one's loss).
    let done = prune(tier.path(), 2, Some(1500), Some("step-2-m1d"), false).unwrap();
    assert_eq!(names(&done.kept), ["step-2-m1d"]);
    assert_eq!(
        names(&done.removed),
        ["step-1-0ld", "step-3-new", "step-9-dead"]
    );
    assert!(!tier.path().join("step-1-0ld").exists() && !tier.path().join("step-9-dead").exists());
    assert!(tier.path().join("step-2-m1d").exists());
    // A missing tier is empty.
    assert_eq!(
        prune(&tier.path().join("absent"), 2, None, None, false).unwrap(),
        Default::default()
    );
}

/// The two tier rounds of a load, by hand for three ranks (two on node A, one on node B): the
/// ranks of a node split its copies (each verified once), every rank of the node then reads
/// all of them, and a damaged copy is named on every rank of its node and read from storage.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ranks_of_a_node_split_the_verification_and_share_the_copies() {
    use tessera_ops::memory_tier::TierLoad;

    let root = tempfile::tempdir().unwrap();
    let (node_a, node_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    save_step(root.path(), 1, &[node_a.path(), node_b.path()]).await;
    let ckpt = Checkpoint::open(
        tessera_storage::open(&root.path().join("step-1").display().to_string()).unwrap(),
    )
    .await
    .unwrap();
    let dirs = [node_a.path(), node_a.path(), node_b.path()];
    let run = |ckpt: &Checkpoint| {
        let loads: Vec<TierLoad> = dirs.iter().map(|d| TierLoad::find(ckpt, Some(d))).collect();
        let offers: Vec<_> = loads.iter().map(|l| l.offer().clone()).collect();
        let verified: Vec<_> = loads
            .iter()
            .enumerate()
            .map(|(r, l)| l.verify_share(&ckpt.meta, &offers, r as u32))
            .collect();
        let settled: Vec<_> = loads
            .iter()
            .map(|l| l.settle(ckpt, &offers, &verified).unwrap())
            .collect();
        (offers, verified, settled)
    };
    let (offers, verified, settled) = run(&ckpt);
    assert_eq!(offers[0], offers[1]);
    assert_eq!(offers[0].files.len(), 2);
    assert_ne!(offers[0].node, offers[2].node);
    // Node A's two copies: one verified by each of its ranks; node B's both by rank 2.
    assert_eq!((verified[0].files.len(), verified[1].files.len()), (1, 1));
    assert_ne!(verified[0].files, verified[1].files);
    assert_eq!(verified[2].files.len(), 2);
    for (r, (_, sources, copies)) in settled.iter().enumerate() {
        assert_eq!(copies.files.len(), 2, "rank {r}");
        for f in 0..4u32 {
            let (_, readers) = sources.cheapest(f).unwrap();
            let on_a = offers[0].files.contains(&f);
            assert_eq!(
                readers,
                if on_a { &[0, 1][..] } else { &[2][..] },
                "file {f}"
            );
        }
    }

    // A flipped byte in one of node A's copies: named on both of A's ranks, not offered.
    let (_, _, a) = &settled[0];
    let (&damaged, path) = a.files.iter().next().unwrap();
    let mut bytes = std::fs::read(path).unwrap();
    bytes[0] ^= 1;
    std::fs::write(path, &bytes).unwrap();
    let (_, _, settled) = run(&ckpt);
    for r in [0, 1] {
        let (_, sources, copies) = &settled[r];
        assert_eq!(copies.ignored.len(), 1, "rank {r}: {:?}", copies.ignored);
        assert!(copies.ignored[0].contains("does not match the checkpoint's checksum"));
        assert!(!copies.files.contains_key(&damaged));
        assert!(sources.cheapest(damaged).is_none());
    }
    assert!(settled[2].2.ignored.is_empty());
}

/// Issue 41 item 6: a tier given the checkpoints' root (or a folder inside a checkpoint) is
/// refused when the save starts, before anything is written, and the committed steps there stay
/// whole; the prune would have taken every step folder without a record for a dead save's copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_that_holds_or_is_inside_checkpoints_is_refused_before_the_save_writes() {
    let root = tempfile::tempdir().unwrap();
    let (node_a, node_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    for step in 1..=2 {
        save_step(root.path(), step, &[node_a.path(), node_b.path()]).await;
    }
    let manifests = |root: &Path| -> Vec<bool> {
        (1..=3)
            .map(|s| root.join(format!("step-{s}/manifest.json")).is_file())
            .collect()
    };
    assert_eq!(manifests(root.path()), [true, true, false]);
    for tier in [
        root.path().to_path_buf(),
        root.path().join("step-1").join("data"),
    ] {
        let outcomes = try_save_step(root.path(), 3, &[&tier, &tier]).await;
        for (rank, outcome) in outcomes.iter().enumerate() {
            let Err(e) = outcome else {
                panic!(
                    "rank {rank}: a save with the tier {} succeeded",
                    tier.display()
                );
            };
            assert!(
                e.contains("memory tier") && e.contains(&tier.display().to_string()),
                "rank {rank}: {e}"
            );
        }
        assert_eq!(
            manifests(root.path()),
            [true, true, false],
            "{}",
            tier.display()
        );
        assert!(
            !root.path().join("step-3").join("data").exists(),
            "nothing of step 3 is written"
        );
        for step in 1..=2 {
            Checkpoint::open(
                tessera_storage::open(
                    &root
                        .path()
                        .join(format!("step-{step}"))
                        .display()
                        .to_string(),
                )
                .unwrap(),
            )
            .await
            .unwrap();
        }
    }
    // The refusal names what it found.
    let e = &try_save_step(root.path(), 3, &[root.path(), root.path()]).await[0];
    let e = e.as_ref().unwrap_err();
    assert!(e.contains("step-1") || e.contains("step-3"), "{e}");
}

/// Issue 41 item 6: a shared tier (`/dev/shm`) holds another program's folders; the prune of
/// every save leaves them (and what they hold) alone, however old, and lists only copies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prune_removes_only_copies_tessera_made() {
    let root = tempfile::tempdir().unwrap();
    let (node_a, node_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    // Older than every copy: what the prune took for the copy of a save that died.
    let foreign = node_a.path().join("another-program");
    std::fs::create_dir_all(foreign.join("data")).unwrap();
    std::fs::write(foreign.join("data").join("rank-0.bin"), b"not ours").unwrap();
    // A folder named as a copy would be, without the marker: not ours either.
    let lookalike = node_a.path().join("step-1-0123456789ab");
    std::fs::create_dir_all(&lookalike).unwrap();
    std::fs::write(lookalike.join("notes.txt"), b"kept").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    for step in 1..=3 {
        save_step(root.path(), step, &[node_a.path(), node_b.path()]).await;
    }
    assert_eq!(
        std::fs::read(foreign.join("data").join("rank-0.bin")).unwrap(),
        b"not ours"
    );
    assert_eq!(std::fs::read(lookalike.join("notes.txt")).unwrap(), b"kept");
    let dry = prune(node_a.path(), 1, None, None, true).unwrap();
    for path in dry.removed.iter().chain(&dry.kept) {
        let name = path.file_name().unwrap().to_string_lossy();
        assert!(
            name.starts_with("step-2-") || name.starts_with("step-3-"),
            "{name} is listed as a copy"
        );
        assert_ne!(path, &lookalike);
    }
    assert_eq!((dry.kept.len(), dry.removed.len()), (1, 1), "{dry:?}");
    // A budget of nothing removes every copy, and still nothing else.
    let done = prune(node_a.path(), 1, Some(0), None, false).unwrap();
    assert_eq!((done.kept.len(), done.removed.len()), (0, 2), "{done:?}");
    assert!(foreign.join("data").join("rank-0.bin").is_file());
    assert!(lookalike.join("notes.txt").is_file());
}
