//! The memory tier on the read side: copies left in node-local directories are found only for
//! the checkpoint they were saved as and only when every box verifies; a job of another world
//! size plans with them as sources and reads each held file from its copy. The durable files the
//! tiers hold are deleted before the load, so a byte that came from storage instead would fail
//! it.
#![allow(clippy::unwrap_used, missing_docs, clippy::result_large_err)]

mod support_read;

use std::path::Path as FsPath;

use support_read::{expected_destination, synth_saved_by_rows};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, load_rank};
use tessera_loader::tier::{
    TIER_FORMAT, TIER_VERSION, TierCopies, TierEntry, TierRecord, find_copies, now_unix_ms,
    write_copy,
};
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_planner::{PlanOptions, ReadSources, SourceTier};

/// Leaves a tier copy of data file `file` of `checkpoint` under `dir`, as a save does; returns
/// the copy's path.
fn leave_copy(
    checkpoint: &Checkpoint,
    dir: &FsPath,
    file: u32,
    identity: &str,
) -> std::path::PathBuf {
    let meta = &checkpoint.meta;
    let data = &meta.files()[file as usize];
    let root = checkpoint.location.local_root.as_ref().unwrap();
    let durable = root.join(checkpoint.file_path(file).unwrap().as_ref());
    let bytes = std::fs::read(&durable).unwrap();
    // Every entry of the file, tensor boxes and plain values: (offset, length, crc32c).
    let mut entries: Vec<(u64, u64, u32)> = meta
        .chunks()
        .iter()
        .filter(|c| c.bytes.file == file)
        .map(|c| (c.bytes.offset, c.bytes.length, c.crc32c.unwrap()))
        .collect();
    entries.extend(
        meta.objects()
            .iter()
            .filter(|o| o.file == file)
            .map(|o| (o.offset, o.length, o.crc32c.unwrap())),
    );
    let record = TierRecord {
        format: TIER_FORMAT.into(),
        version: TIER_VERSION,
        checkpoint: checkpoint.location.display.clone(),
        identity: identity.into(),
        step: checkpoint.step,
        file: data.path.clone(),
        size: bytes.len() as u64,
        entries: entries
            .iter()
            .map(|&(offset, length, crc32c)| TierEntry {
                offset,
                length,
                crc32c,
            })
            .collect(),
        saved_unix_ms: now_unix_ms(),
    };
    let slices: Vec<&[u8]> = entries
        .iter()
        .map(|&(offset, length, _)| &bytes[offset as usize..(offset + length) as usize])
        .collect();
    write_copy(dir, &record, &slices).unwrap()
}

/// Of the bytes `plan` has its rank read, those of files `copies` holds and the rest: what the
/// rank's report must say it read from the tier and from storage.
fn split_reads(
    copies: &TierCopies,
    plan: &tessera_planner::RankPlan,
    meta: &tessera_metadata::CheckpointMeta,
) -> (u64, u64) {
    let held: Vec<&str> = copies
        .files
        .keys()
        .map(|&f| meta.files()[f as usize].path.as_str())
        .collect();
    let (mut tier, mut storage) = (0, 0);
    for p in &plan.pieces {
        let Some(read) = &p.read else { continue };
        if held.contains(&plan.files[read.file as usize].as_str()) {
            tier += p.bytes;
        } else {
            storage += p.bytes;
        }
    }
    (tier, storage)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_of_three_reads_the_surviving_tiers_and_storage_only_for_the_lost_node() {
    let (_dir, checkpoint) = synth_saved_by_rows(4).await;
    let identity = checkpoint.meta.identity().unwrap().to_string();
    assert_eq!(checkpoint.meta.files().len(), 4);
    // Node A kept the files of old ranks 0 and 1, node B of old rank 2; old rank 3's node is lost.
    let (node_a, node_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    leave_copy(&checkpoint, node_a.path(), 0, &identity);
    leave_copy(&checkpoint, node_a.path(), 1, &identity);
    leave_copy(&checkpoint, node_b.path(), 2, &identity);
    // A copy of another checkpoint (another step) in node B's tier: not taken.
    leave_copy(
        &checkpoint,
        node_b.path(),
        3,
        "native:0123456789abcdef0123456789abcdef",
    );

    let found_a = find_copies(node_a.path(), &checkpoint.meta, &identity);
    let found_b = find_copies(node_b.path(), &checkpoint.meta, &identity);
    assert_eq!(found_a.file_indices(), vec![0, 1]);
    assert_eq!(found_b.file_indices(), vec![2]);
    assert!(found_a.ignored.is_empty() && found_b.ignored.is_empty());

    // The durable copies of the held files are gone: only the tiers can serve them now.
    let root = checkpoint.location.local_root.clone().unwrap();
    for file in 0..3 {
        std::fs::remove_file(root.join(checkpoint.file_path(file).unwrap().as_ref())).unwrap();
    }

    // New job: ranks 0 and 1 on node A, rank 2 on node B; FSDP over 3.
    let node_of = [&found_a, &found_a, &found_b];
    let mut sources = ReadSources::none();
    for (rank, found) in node_of.iter().enumerate() {
        for file in found.file_indices() {
            sources.add(file, SourceTier::NodeMemory, [rank as u32]);
        }
    }
    let requests = tessera_planner::presets::fsdp(3)
        .unwrap()
        .resolve(checkpoint.meta.tensors())
        .unwrap();
    let plan = checkpoint
        .plan_with_sources(&requests, &PlanOptions::default(), &sources)
        .unwrap();
    let file_bytes = |f: u32| -> u64 {
        checkpoint
            .meta
            .chunks()
            .iter()
            .filter(|c| c.bytes.file == f)
            .map(|c| c.bytes.length)
            .sum()
    };
    assert_eq!(
        plan.summary().bytes_read_from_tier,
        (0..3).map(file_bytes).sum::<u64>()
    );
    assert_eq!(
        plan.summary().bytes_read - plan.summary().bytes_read_from_tier,
        file_bytes(3)
    );

    let mesh = InProcTransport::mesh(
        3,
        TransportOptions::with_timeout(std::time::Duration::from_secs(10)),
    );
    let mut tasks = Vec::new();
    for (rank, transport) in mesh.into_iter().enumerate() {
        let view = checkpoint.with_tier_copies(node_of[rank]).unwrap();
        let rank_plan = plan.rank_plan(rank as u32).unwrap();
        tasks.push(tokio::spawn(async move {
            load_rank(&view, rank_plan, &transport, &LoadOptions::default()).await
        }));
    }
    let (mut from_tier, mut from_storage) = (0, 0);
    for (rank, task) in tasks.into_iter().enumerate() {
        let loaded = task.await.unwrap().unwrap();
        for d in 0..loaded.plan.destinations.len() {
            assert!(
                loaded.buffers[d] == expected_destination(&loaded.plan, d),
                "rank {rank} destination {d} holds the wrong bytes"
            );
        }
        let (tier, storage) = split_reads(node_of[rank], &loaded.plan, &checkpoint.meta);
        // What the rank's report says is what its plan had it read where.
        assert_eq!(
            (
                loaded.report.bytes_from_memory_tier,
                loaded.report.bytes_from_storage
            ),
            (tier, storage),
            "rank {rank}"
        );
        assert_eq!(tier + storage, loaded.report.bytes_read);
        from_tier += tier;
        from_storage += storage;
    }
    assert_eq!(from_storage, file_bytes(3));
    assert_eq!(from_tier, plan.summary().bytes_read_from_tier);
}

#[tokio::test]
async fn a_damaged_or_incomplete_copy_is_ignored_and_says_why() {
    let (_dir, checkpoint) = synth_saved_by_rows(2).await;
    let identity = checkpoint.meta.identity().unwrap().to_string();
    let tier = tempfile::tempdir().unwrap();
    let good = leave_copy(&checkpoint, tier.path(), 0, &identity);
    let bad = leave_copy(&checkpoint, tier.path(), 1, &identity);
    // One flipped byte inside the first box of file 1.
    let first = checkpoint
        .meta
        .chunks()
        .iter()
        .find(|c| c.bytes.file == 1)
        .unwrap();
    let mut bytes = std::fs::read(&bad).unwrap();
    bytes[first.bytes.offset as usize + 3] ^= 0x40;
    std::fs::write(&bad, &bytes).unwrap();
    let found = find_copies(tier.path(), &checkpoint.meta, &identity);
    assert_eq!(found.file_indices(), vec![0]);
    assert_eq!(found.files[&0], good);
    assert_eq!(found.ignored.len(), 1, "{:?}", found.ignored);
    let why = &found.ignored[0];
    assert!(
        why.contains(&bad.display().to_string())
            && why.contains("does not match the checkpoint's checksum")
            && why.ends_with("read from storage instead"),
        "{why}"
    );

    // A copy whose record was never written (the save died before its commit) is not seen; a
    // truncated copy is refused by its size.
    std::fs::remove_file(format!("{}.tier.json", bad.display())).unwrap();
    std::fs::write(&good, &bytes[..10]).unwrap();
    let found = find_copies(tier.path(), &checkpoint.meta, &identity);
    assert_eq!(
        found,
        TierCopies {
            files: Default::default(),
            bytes: 0,
            ignored: found.ignored.clone(),
        }
    );
    assert!(
        found.ignored[0].contains("the copy has 10 bytes"),
        "{:?}",
        found.ignored
    );

    // No tier directory at all: nothing, no error.
    let none = find_copies(&tier.path().join("absent"), &checkpoint.meta, &identity);
    assert!(none.files.is_empty() && none.ignored.is_empty());
}

/// Loads `checkpoint` as a job of `world` ranks (FSDP) that all see `copies` (one node), with
/// the copies as the plan's sources; every destination's bytes are checked. Returns each rank's
/// report.
async fn load_with_copies(
    checkpoint: &Checkpoint,
    copies: &TierCopies,
    world: u32,
) -> Result<Vec<tessera_loader::load::RankReport>, String> {
    let mut sources = ReadSources::none();
    for file in copies.file_indices() {
        sources.add(file, SourceTier::NodeMemory, 0..world);
    }
    let requests = tessera_planner::presets::fsdp(world)
        .unwrap()
        .resolve(checkpoint.meta.tensors())
        .unwrap();
    let plan = checkpoint
        .plan_with_sources(&requests, &PlanOptions::default(), &sources)
        .unwrap();
    let mesh = InProcTransport::mesh(
        world,
        TransportOptions::with_timeout(std::time::Duration::from_secs(20)),
    );
    let mut tasks = Vec::new();
    for (rank, transport) in mesh.into_iter().enumerate() {
        let view = checkpoint
            .with_tier_copies(copies)
            .map_err(|e| e.to_string())?;
        let rank_plan = plan.rank_plan(rank as u32).unwrap();
        tasks.push(tokio::spawn(async move {
            load_rank(&view, rank_plan, &transport, &LoadOptions::default()).await
        }));
    }
    let mut reports = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        let loaded = task
            .await
            .unwrap()
            .map_err(|e| format!("rank {rank}: {e}"))?;
        for d in 0..loaded.plan.destinations.len() {
            assert!(
                loaded.buffers[d] == expected_destination(&loaded.plan, d),
                "rank {rank} destination {d} holds the wrong bytes"
            );
        }
        reports.push(loaded.report);
    }
    Ok(reports)
}

/// Runs `f` on a thread and waits at most 60 s for it: a call that blocks forever (a FIFO
/// opened for reading waits for a writer) fails the test instead of hanging it.
fn bounded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(std::time::Duration::from_secs(60))
        .unwrap_or_else(|_| panic!("{what} did not return within 60 s (blocked in open(2)?)"))
}

fn mkfifo(path: &FsPath) {
    let _ = std::fs::remove_file(path);
    let status = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .unwrap();
    assert!(status.success(), "mkfifo {}", path.display());
}

/// Issue 41 item 7: a FIFO in place of a copy (its record intact) is ignored, naming it, and
/// read from storage; finding the copies returns instead of blocking in `open(2)` for a writer
/// that never comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_in_place_of_a_copy_is_ignored_and_read_from_storage() {
    let (_dir, checkpoint) = synth_saved_by_rows(2).await;
    let identity = checkpoint.meta.identity().unwrap().to_string();
    let tier = tempfile::tempdir().unwrap();
    let fifo = leave_copy(&checkpoint, tier.path(), 0, &identity);
    let good = leave_copy(&checkpoint, tier.path(), 1, &identity);
    mkfifo(&fifo);
    let (dir, meta, id) = (
        tier.path().to_path_buf(),
        checkpoint.meta.clone(),
        identity.clone(),
    );
    let found = bounded("find_copies", move || find_copies(&dir, &meta, &id));
    assert_eq!(found.file_indices(), vec![1], "{:?}", found.ignored);
    assert_eq!(found.files[&1], good);
    assert_eq!(found.ignored.len(), 1, "{:?}", found.ignored);
    let why = &found.ignored[0];
    assert!(
        why.contains(&fifo.display().to_string()) && why.contains("a FIFO"),
        "{why}"
    );
    let reports = load_with_copies(&checkpoint, &found, 2).await.unwrap();
    assert!(reports.iter().any(|r| r.bytes_from_memory_tier > 0));
}

/// Issue 41 item 13: a tier named by a relative path is found and read like the absolute one
/// (its copies' paths were given to a store that takes only absolute ones).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relative_tier_path_loads_like_the_absolute_one() {
    let (_dir, checkpoint) = synth_saved_by_rows(2).await;
    let identity = checkpoint.meta.identity().unwrap().to_string();
    let tier = tempfile::tempdir().unwrap();
    for file in 0..2 {
        leave_copy(&checkpoint, tier.path(), file, &identity);
    }
    // The same directory, from the current one: `../../tmp/...`.
    let cwd = std::env::current_dir().unwrap();
    let up = cwd.components().count() - 1;
    let relative: std::path::PathBuf = std::iter::repeat_n(std::path::Component::ParentDir, up)
        .map(|c| c.as_os_str().to_owned())
        .chain(
            tier.path()
                .components()
                .skip(1)
                .map(|c| c.as_os_str().to_owned()),
        )
        .collect();
    assert!(relative.is_relative());
    let found = find_copies(&relative, &checkpoint.meta, &identity);
    assert_eq!(found.file_indices(), vec![0, 1], "{:?}", found.ignored);
    let reports = load_with_copies(&checkpoint, &found, 2).await.unwrap();
    let from_tier: u64 = reports.iter().map(|r| r.bytes_from_memory_tier).sum();
    let read: u64 = reports.iter().map(|r| r.bytes_read).sum();
    assert_eq!(from_tier, read);
}

/// Issue 41 item 14: a record whose size is not its copy's says both numbers.
#[tokio::test]
async fn a_record_of_the_wrong_size_says_both_sizes() {
    let (_dir, checkpoint) = synth_saved_by_rows(2).await;
    let identity = checkpoint.meta.identity().unwrap().to_string();
    let tier = tempfile::tempdir().unwrap();
    let copy = leave_copy(&checkpoint, tier.path(), 0, &identity);
    let record_path = format!("{}.tier.json", copy.display());
    let mut record: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&record_path).unwrap()).unwrap();
    let size = record["size"].as_u64().unwrap();
    record["size"] = serde_json::json!(size + 4096);
    std::fs::write(&record_path, record.to_string()).unwrap();
    let found = find_copies(tier.path(), &checkpoint.meta, &identity);
    assert!(found.files.is_empty());
    let why = &found.ignored[0];
    assert!(
        why.contains(&format!("the copy has {size} bytes"))
            && why.contains(&format!("its record says {}", size + 4096)),
        "{why}"
    );
}

/// Issue 41 item 10: copies that change after the load verified them (a byte flipped, truncated,
/// a FIFO swapped in) no longer fail the load blaming the intact durable file: each such read
/// comes from storage instead, the bytes are right, and the report names the copy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copy_that_changes_after_its_check_is_read_from_storage_and_named() {
    for change in ["flip", "truncate", "fifo"] {
        let (_dir, checkpoint) = synth_saved_by_rows(2).await;
        let identity = checkpoint.meta.identity().unwrap().to_string();
        let tier = tempfile::tempdir().unwrap();
        for file in 0..2 {
            leave_copy(&checkpoint, tier.path(), file, &identity);
        }
        let found = find_copies(tier.path(), &checkpoint.meta, &identity);
        assert_eq!(found.file_indices(), vec![0, 1], "{:?}", found.ignored);
        let changed = found.files[&1].clone();
        match change {
            "flip" => {
                let mut bytes = std::fs::read(&changed).unwrap();
                for at in (0..bytes.len()).step_by(4096) {
                    bytes[at] ^= 0x5a;
                }
                std::fs::write(&changed, &bytes).unwrap();
            }
            "truncate" => {
                let len = std::fs::metadata(&changed).unwrap().len();
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(&changed)
                    .unwrap()
                    .set_len(len / 3)
                    .unwrap();
            }
            _ => mkfifo(&changed),
        }
        let (ckpt, copies) = (checkpoint.clone(), found.clone());
        let handle = tokio::runtime::Handle::current();
        let outcome = bounded("the load", move || {
            handle.block_on(load_with_copies(&ckpt, &copies, 2))
        });
        let reports = outcome.unwrap_or_else(|e| panic!("{change}: {e}"));
        let named: Vec<&String> = reports
            .iter()
            .flat_map(|r| &r.memory_tier_fallbacks)
            .collect();
        assert!(!named.is_empty(), "{change}: no fallback reported");
        for why in &named {
            assert!(
                why.contains(&changed.display().to_string())
                    && why.contains("read from storage instead"),
                "{change}: {why}"
            );
        }
    }
}

/// Issue 41 item 10, the case a fallback cannot cover: column slices of row-saved boxes are
/// verified jointly (each rank folds its runs; the folds are checked after the exchange), so a
/// copy changed after its check is found only once the parts were handed on. The load fails,
/// and the error names the copy rather than only the intact durable file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jointly_checked_box_of_a_changed_copy_fails_naming_the_copy() {
    const COLUMNS: &str = r#"{"mesh": [{"name": "tp", "size": 2}],
        "rules": [{"match": "*norm*", "placements": ["replicate"]},
                  {"match": "*.weight", "placements": ["shard(1)"]},
                  {"match": "*", "placements": ["replicate"]}]}"#;
    let (_dir, checkpoint) = synth_saved_by_rows(2).await;
    let identity = checkpoint.meta.identity().unwrap().to_string();
    let tier = tempfile::tempdir().unwrap();
    for file in 0..2 {
        leave_copy(&checkpoint, tier.path(), file, &identity);
    }
    let found = find_copies(tier.path(), &checkpoint.meta, &identity);
    assert_eq!(found.file_indices(), vec![0, 1]);
    // Every byte of every box of copy 1 changed after the check.
    let changed = found.files[&1].clone();
    let mut bytes = std::fs::read(&changed).unwrap();
    for c in checkpoint
        .meta
        .chunks()
        .iter()
        .filter(|c| c.bytes.file == 1)
    {
        for at in c.bytes.offset..c.bytes.offset + c.bytes.length {
            bytes[at as usize] ^= 0x5a;
        }
    }
    std::fs::write(&changed, &bytes).unwrap();
    let mut sources = ReadSources::none();
    for file in 0..2 {
        sources.add(file, SourceTier::NodeMemory, 0..2);
    }
    let requests = tessera_planner::Layout::from_json(COLUMNS)
        .unwrap()
        .resolve(checkpoint.meta.tensors())
        .unwrap();
    let own_columns = PlanOptions {
        dedup: false,
        ..PlanOptions::default()
    };
    let plan = checkpoint
        .plan_with_sources(&requests, &own_columns, &sources)
        .unwrap();
    assert!(
        (0..2).any(|r| !plan.rank_plan(r).unwrap().joint_checks.is_empty()),
        "the column slices are checked jointly"
    );
    let view = checkpoint.with_tier_copies(&found).unwrap();
    let mesh = InProcTransport::mesh(
        2,
        TransportOptions::with_timeout(std::time::Duration::from_secs(20)),
    );
    let options = LoadOptions::default();
    let loads = mesh.iter().enumerate().map(|(rank, transport)| {
        let rank_plan = plan.rank_plan(rank as u32).unwrap();
        load_rank(&view, rank_plan, transport, &options)
    });
    let outcomes = futures::future::join_all(loads).await;
    let errors: Vec<String> = outcomes
        .into_iter()
        .filter_map(|o| o.err().map(|e| e.to_string()))
        .collect();
    assert!(!errors.is_empty(), "a changed copy's column slices loaded");
    assert!(
        errors
            .iter()
            .any(|e| e.contains(&format!("memory-tier copy {}", changed.display()))),
        "{errors:?}"
    );
}
