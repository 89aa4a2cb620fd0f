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
