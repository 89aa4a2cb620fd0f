//! Storage-order reads end to end: a synthetic checkpoint saved Shard(0) by 4 ranks (native,
//! block checksums) loaded into a column layout over 4 in-process ranks with verify on. Read per
//! request every rank fetches the checksum blocks (or whole boxes) of every saved row; read in
//! storage order each saved chunk is fetched once, by one rank, and its columns are relayed
//! through the exchange. Both must land the formula's bytes.
// LoaderError is 128 bytes (object_store::Error is 72 of them), just at clippy's
// `result_large_err` threshold; the closures here return it on the cold path.
#![allow(clippy::unwrap_used, missing_docs, clippy::result_large_err)]

mod support_read;

use std::time::Duration;

use support_read::load_every_rank;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, RankReport, load_rank};
use tessera_loader::read::ReadOptions;
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_metadata::formats::native::DEFAULT_BLOCK_SIZE;
use tessera_planner::{
    ExplicitRequest, ExplicitRequests, PlanOptions, PlanSummary, RankPlan, ReadOrder, RequestSet,
};

const WORLD: u32 = 4;

async fn saved_by_rows() -> (tempfile::TempDir, Checkpoint) {
    support_read::synth_saved_by_rows(WORLD).await
}

/// Every matrix split over the ranks by columns (as `torch.chunk` does), every vector by rows,
/// scalars whole.
fn columns(checkpoint: &Checkpoint) -> RequestSet {
    let tensors = checkpoint.meta.tensors();
    let ranks = (0..u64::from(WORLD))
        .map(|r| {
            tensors
                .iter()
                .map(|t| {
                    if t.shape.is_empty() {
                        return ExplicitRequest::Box {
                            fqn: t.fqn.clone(),
                            offsets: Vec::new(),
                            lengths: Vec::new(),
                        };
                    }
                    let dim = usize::from(t.shape.len() >= 2);
                    let n = t.shape[dim];
                    let chunk = n.div_ceil(u64::from(WORLD));
                    let start = (r * chunk).min(n);
                    let mut offsets = vec![0; t.shape.len()];
                    let mut lengths = t.shape.to_vec();
                    offsets[dim] = start;
                    lengths[dim] = ((r + 1) * chunk).min(n) - start;
                    ExplicitRequest::Box {
                        fqn: t.fqn.clone(),
                        offsets,
                        lengths,
                    }
                })
                .collect()
        })
        .collect();
    ExplicitRequests { ranks }.resolve(tensors).unwrap()
}

/// Loads every rank concurrently over in-process transports, checks every destination against
/// the formula, and returns the plan's summary and the ranks' reports.
async fn load_all(
    checkpoint: &Checkpoint,
    order: ReadOrder,
    joint_checks: bool,
) -> (PlanSummary, Vec<RankReport>) {
    let plan = checkpoint
        .plan(
            &columns(checkpoint),
            &PlanOptions {
                read_order: order,
                joint_checks,
                ..PlanOptions::default()
            },
        )
        .unwrap();
    let plans: Vec<RankPlan> = (0..WORLD).map(|r| plan.rank_plan(r).unwrap()).collect();
    let options = LoadOptions {
        read: ReadOptions {
            verify: true,
            // Count every range as its own request, as an object store without coalescing
            // would serve it: the request count is what storage order is for.
            coalesce_gap: Some(0),
            exact_multi_range: Some(false),
            ..ReadOptions::default()
        },
        progress: None,
        ..LoadOptions::default()
    };
    let mut reports = Vec::new();
    for loaded in load_every_rank(checkpoint, plans, &options).await {
        assert_eq!(loaded.report.bytes_read, loaded.plan.summary.bytes_read);
        assert_eq!(loaded.report.bytes_sent, loaded.plan.summary.bytes_sent);
        reports.push(loaded.report);
    }
    (plan.summary().clone(), reports)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_of_a_row_sharded_checkpoint_are_fetched_once_in_storage_order() {
    let (_dir, checkpoint) = saved_by_rows().await;
    let chunks = checkpoint.meta.chunks().len() as u64;

    let (per_request, request_reports) = load_all(&checkpoint, ReadOrder::Request, false).await;
    let (in_order, order_reports) = load_all(&checkpoint, ReadOrder::Storage, true).await;
    let (jointly, joint_reports) = load_all(&checkpoint, ReadOrder::Request, true).await;
    let unique = in_order.unique_bytes_needed;
    let fetched = |r: &[RankReport]| r.iter().map(|r| r.bytes_fetched).sum::<u64>();
    let requests = |r: &[RankReport]| r.iter().map(|r| r.requests).sum::<u64>();

    // Per request, verified by blocks: every rank fetches (the blocks or boxes around) every
    // saved row.
    assert_eq!(per_request.bytes_read, unique);
    assert!(
        fetched(&request_reports) > 3 * unique,
        "per request fetched {} of {unique} unique bytes",
        fetched(&request_reports)
    );
    // Per request with joint checks (the default): each rank fetches its own columns and no
    // more, the boxes verified by the folds of their readers.
    assert_eq!(jointly.bytes_read, unique);
    assert_eq!(fetched(&joint_reports), unique);
    assert!(joint_reports.iter().all(|r| r.verify_extra_bytes == 0));

    // In storage order: each byte read once, and within one checksum block per slab fetched on
    // top (slab cuts are block aligned; a chunk's ends are only 4 KiB aligned, but a block
    // shared by two neighbouring chunks is fetched by each of their readers at most once).
    assert_eq!(in_order.bytes_read, unique);
    assert_eq!(in_order.read_amplification, 1.0);
    assert!(in_order.slabs > 0 && in_order.bytes_relayed > 0);
    let extra = fetched(&order_reports) - unique;
    assert!(
        extra <= DEFAULT_BLOCK_SIZE * in_order.slabs,
        "storage order fetched {extra} bytes beyond the {unique} unique ones"
    );
    // The pieces of one slab are adjacent: about one request per saved chunk, not one per row.
    assert!(
        requests(&order_reports) <= 2 * chunks,
        "{} requests for {chunks} saved chunks",
        requests(&order_reports)
    );
    assert!(requests(&order_reports) < requests(&request_reports));
    for (a, b) in request_reports.iter().zip(&order_reports) {
        eprintln!(
            "rank {}: per request {} requests {} bytes fetched; storage order {} requests {} bytes fetched, {} sent",
            a.rank, a.requests, a.bytes_fetched, b.requests, b.bytes_fetched, b.bytes_sent
        );
    }
}

/// Loads the columns layout with every rank on one in-process mesh after flipping the middle
/// byte of the largest data file; returns each rank's outcome (its error's text).
async fn load_corrupted(order: ReadOrder) -> Vec<Result<(), String>> {
    let (dir, checkpoint) = saved_by_rows().await;
    let data = walk(dir.path())
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "bin"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .unwrap();
    let mut bytes = std::fs::read(&data).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xFF;
    std::fs::write(&data, bytes).unwrap();
    let plan = checkpoint
        .plan(
            &columns(&checkpoint),
            &PlanOptions {
                read_order: order,
                ..PlanOptions::default()
            },
        )
        .unwrap();
    let options = LoadOptions {
        read: ReadOptions {
            verify: true,
            ..ReadOptions::default()
        },
        progress: None,
        ..LoadOptions::default()
    };
    let mesh = InProcTransport::mesh(
        WORLD,
        TransportOptions::with_timeout(Duration::from_secs(10)),
    );
    let tasks: Vec<_> = (0..WORLD)
        .zip(mesh)
        .map(|(rank, transport)| {
            let (checkpoint, options) = (checkpoint.clone(), options.clone());
            let rank_plan = plan.rank_plan(rank).unwrap();
            tokio::spawn(async move {
                load_rank(&checkpoint, rank_plan, &transport, &options)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap());
    }
    outcomes
}

/// A corrupt byte in a saved chunk that one rank reads in storage order for everyone: that rank
/// fails verification before it sends the slab (the exchange overlaps the reads, but a share is
/// sent only once all of its pieces are verified), so no rank reports success with the bad byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_slab_fails_every_rank_that_needs_it_and_none_succeeds() {
    let errors = load_corrupted(ReadOrder::Storage).await;
    assert!(errors.iter().all(Result::is_err), "{errors:?}");
    assert!(
        errors
            .iter()
            .any(|e| e.as_ref().unwrap_err().contains("checksum mismatch")),
        "{errors:?}"
    );
}

/// The same corrupt byte read per request: the box holding it is read in column slices by all
/// four ranks and verified jointly, no rank fetching a checksum block. The rank that read the
/// byte cannot tell (its slice has no checksum of its own), but the folds do not add up to the
/// box's crc32c, and every rank, each holding a part of that box, fails naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_byte_in_a_box_read_in_columns_fails_every_member_naming_the_box() {
    let errors = load_corrupted(ReadOrder::Request).await;
    for (rank, outcome) in errors.iter().enumerate() {
        let error = outcome.as_ref().unwrap_err();
        assert!(
            error.starts_with("checksum mismatch in ")
                && error.contains(".bin bytes ")
                && error.contains("(tensor ")
                && error.contains("read in parts by ranks [0, 1, 2, 3]")
                && error.ends_with(&format!("(checked on rank {rank})")),
            "rank {rank}: {error}"
        );
    }
}

fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}
