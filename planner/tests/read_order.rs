//! Named cases of storage-order reads (slabs relayed through the exchange) and of small pieces of
//! wide groups read by every holder: the request counts, fetched checksum blocks and ring rounds
//! they exist to cut, on plans executed on real bytes.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::collections::BTreeSet;

use common::{
    StoredBox, check_summary, columns, plan_and_check, rank_plans, rows, save_boxes, saved_by_rows,
};
use tessera_metadata::{DType, TensorBox, TensorMeta};
use tessera_planner::{ExplicitRequest, ExplicitRequests, PlanOptions, RankPlan, ReadOrder};

const BLOCK: u64 = 64 * 1024;

/// Storage requests of a rank plan the way the loader's range scheduler makes them with coalesce
/// gap 0: the read runs of all its pieces, by file and offset, touching ones merged.
fn requests_of(rp: &RankPlan) -> u64 {
    let mut ranges: Vec<(u32, u64, u64)> = Vec::new();
    for p in &rp.pieces {
        let Some(read) = &p.read else { continue };
        let n = read.runs.run_bytes;
        ranges.extend(read.runs.iter().map(|(src, _)| (read.file, src, src + n)));
    }
    ranges.sort_unstable();
    let mut count = 0;
    let mut open: Option<(u32, u64)> = None;
    for (file, start, end) in ranges {
        match open {
            Some((f, e)) if f == file && start <= e => open = Some((f, e.max(end))),
            _ => {
                count += 1;
                open = Some((file, end));
            }
        }
    }
    count
}

/// Checksum blocks a rank fetches to verify what it reads (each block it touches, once).
fn blocks(rp: &RankPlan) -> u64 {
    let mut touched: BTreeSet<(u32, u64)> = BTreeSet::new();
    for p in &rp.pieces {
        let Some(read) = &p.read else { continue };
        let n = read.runs.run_bytes;
        for (src, _) in read.runs.iter() {
            touched.extend((src / BLOCK..(src + n).div_ceil(BLOCK)).map(|b| (read.file, b)));
        }
    }
    touched.len() as u64
}

/// Shard(0) at world 4 loaded as Shard(1) at world 4: per request every rank reads a 512-byte
/// slice of each of the 1024 rows (1024 requests per rank, every 64 KiB block of the checkpoint
/// fetched by every rank); in storage order each rank reads one saved chunk whole (one request)
/// and relays the three quarters the others need.
#[test]
fn shard0_world4_to_shard1_world4_reads_each_chunk_once_in_order() {
    let (tensor, saved) = saved_by_rows(1024, 512, 4);
    let requests = columns(&tensor, 4, 4);
    let total = 1024 * 512 * 4;

    let per_request = plan_and_check(
        &saved,
        &requests,
        &PlanOptions {
            read_order: ReadOrder::Request,
            ..PlanOptions::default()
        },
    );
    let plans = rank_plans(&per_request);
    check_summary(&saved, &per_request, &plans);
    assert_eq!(plans.iter().map(requests_of).sum::<u64>(), 4 * 1024);
    assert_eq!(plans.iter().map(blocks).sum::<u64>(), 4 * total / BLOCK);
    assert_eq!(per_request.summary().bytes_exchanged, 0);
    assert_eq!(per_request.summary().slabs, 0);

    // The cost model picks storage order for these 512 KiB chunks on its own.
    let in_order = plan_and_check(&saved, &requests, &PlanOptions::default());
    let plans = rank_plans(&in_order);
    check_summary(&saved, &in_order, &plans);
    let s = in_order.summary();
    assert_eq!(s.slabs, 4);
    assert_eq!(plans.iter().map(requests_of).sum::<u64>(), 4);
    for rp in &plans {
        assert_eq!(requests_of(rp), 1, "rank {}", rp.rank);
        assert_eq!(rp.summary.bytes_read, total / 4, "rank {}", rp.rank);
        assert_eq!(rp.summary.bytes_sent, total / 4 * 3 / 4, "rank {}", rp.rank);
    }
    // Each byte and each checksum block read once over the cluster.
    assert_eq!(plans.iter().map(blocks).sum::<u64>(), total / BLOCK);
    assert_eq!(s.read_amplification, 1.0);
    assert_eq!(s.bytes_read, total);
    assert_eq!(s.bytes_relayed, total / 4 * 3);
    assert_eq!(s.bytes_exchanged, s.bytes_relayed);
    assert_eq!(s.max_rounds, 1);
}

/// With slabs smaller than a chunk every rank that needs part of it reads one slab: the slabs of
/// a chunk are cut on rows at 64 KiB file offsets, so no block is fetched by two readers.
#[test]
fn slabs_split_a_chunk_over_its_readers_on_block_boundaries() {
    let (tensor, saved) = saved_by_rows(1024, 512, 2);
    let requests = columns(&tensor, 4, 4);
    let options = PlanOptions {
        slab_bytes: 256 * 1024,
        ..PlanOptions::default()
    };
    let plan = plan_and_check(&saved, &requests, &options);
    let plans = rank_plans(&plan);
    check_summary(&saved, &plan, &plans);
    // Two 1 MiB chunks, four 256 KiB slabs each, balanced over the four ranks.
    assert_eq!(plan.summary().slabs, 8);
    for rp in &plans {
        assert_eq!(
            rp.summary.bytes_read,
            1024 * 512 * 4 / 4,
            "rank {}",
            rp.rank
        );
        assert_eq!(requests_of(rp), 2, "rank {}", rp.rank);
    }
    assert_eq!(
        plans.iter().map(blocks).sum::<u64>(),
        1024 * 512 * 4 / BLOCK
    );
}

/// A target that follows the storage order (Shard(0) to Shard(0)) gains nothing from slabs: the
/// cost model keeps every rank reading its own chunk, nothing is relayed.
#[test]
fn auto_keeps_reads_that_follow_the_storage_order() {
    let (tensor, saved) = saved_by_rows(1024, 512, 4);
    let requests = rows(&tensor, 4);
    let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
    let s = plan.summary();
    assert_eq!((s.slabs, s.bytes_relayed, s.bytes_exchanged), (0, 0, 0));
    assert!(rank_plans(&plan).iter().all(|rp| requests_of(rp) == 1));
}

/// A 4 KiB norm replicated over 32 ranks: handed round a ring it takes 31 rounds; read by each
/// of its holders (the default for pieces this small in groups this wide) it takes none, at the
/// cost of 31 extra reads of 4 KiB. A big replicated tensor still goes round its ring, and a
/// narrow group keeps reading once.
#[test]
fn small_pieces_of_a_wide_group_are_read_by_every_holder() {
    let norm = TensorMeta::new("layers.0.norm", DType::F32, vec![1024]);
    let big = TensorMeta::new("layers.0.big", DType::F32, vec![64, 1024]);
    let tensors = vec![norm.clone(), big.clone()];
    let saved = save_boxes(
        tensors.clone(),
        vec![vec![
            StoredBox {
                tensor: 0,
                region: TensorBox::whole(&norm.shape),
                strides: None,
            },
            StoredBox {
                tensor: 1,
                region: TensorBox::whole(&big.shape),
                strides: None,
            },
        ]],
    );
    let whole = |t: &TensorMeta| ExplicitRequest::Box {
        fqn: t.fqn.clone(),
        offsets: vec![0; t.shape.len()],
        lengths: t.shape.to_vec(),
    };
    let only_norm = ExplicitRequests {
        ranks: vec![vec![whole(&norm)]; 32],
    }
    .resolve(&tensors)
    .unwrap();

    let plan = plan_and_check(&saved, &only_norm, &PlanOptions::default());
    let plans = rank_plans(&plan);
    check_summary(&saved, &plan, &plans);
    let s = plan.summary();
    assert_eq!(s.max_rounds, 0);
    assert_eq!(s.holder_read_pieces, 1);
    assert_eq!(s.bytes_read, 32 * 4096);
    assert_eq!(s.bytes_exchanged, 0);
    assert_eq!(s.read_amplification, 32.0);
    assert!(plans.iter().all(|rp| rp.exchanges.is_empty()));

    let ring = plan_and_check(
        &saved,
        &only_norm,
        &PlanOptions {
            holder_read_max_bytes: 0,
            ..PlanOptions::default()
        },
    );
    let r = ring.summary();
    assert_eq!((r.max_rounds, r.holder_read_pieces), (31, 0));
    assert_eq!((r.bytes_read, r.bytes_exchanged), (4096, 31 * 4096));

    // The 256 KiB tensor is too big to read 32 times: it stays in the ring.
    let both = ExplicitRequests {
        ranks: vec![vec![whole(&norm), whole(&big)]; 32],
    }
    .resolve(&tensors)
    .unwrap();
    let plan = plan_and_check(&saved, &both, &PlanOptions::default());
    check_summary(&saved, &plan, &rank_plans(&plan));
    let s = plan.summary();
    assert_eq!((s.max_rounds, s.holder_read_pieces), (31, 1));
    assert_eq!(s.bytes_exchanged, 31 * 64 * 1024 * 4);

    // Eight ranks are a narrow group: the norm is read once and handed round.
    let narrow = ExplicitRequests {
        ranks: vec![vec![whole(&norm)]; 8],
    }
    .resolve(&tensors)
    .unwrap();
    let plan = plan_and_check(&saved, &narrow, &PlanOptions::default());
    let s = plan.summary();
    assert_eq!(
        (s.max_rounds, s.holder_read_pieces, s.bytes_read),
        (7, 0, 4096)
    );
}
