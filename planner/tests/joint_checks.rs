//! Named cases of joint checks: saved boxes whose column slices several ranks read are verified
//! by the box's own crc32c from the readers' folds, instead of every rank fetching every checksum
//! block of every row. The soundness of every check (each byte of the box read exactly once by
//! its readers, every holder a member) is asserted by `common::check_joint_checks`, which
//! `check_summary` runs on every plan of the property tests too.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::sync::Arc;

use common::{
    Saved, boxes_per_rank, check_joint_checks, check_summary, columns, plan_and_check, rank_plans,
    rows, saved_by_rows,
};
use tessera_metadata::{CheckpointMeta, TensorBox};
use tessera_planner::{PlanOptions, ReadOrder, RequestSet};

fn request_order() -> PlanOptions {
    PlanOptions {
        read_order: ReadOrder::Request,
        ..PlanOptions::default()
    }
}

/// Shard(0) at world 4 read as Shard(1) at world 4, per request: each saved box is read in four
/// column slices by four ranks, so each box gets one joint check, every rank reads one piece of
/// it, and every rank checks it.
#[test]
fn column_slices_of_a_box_are_checked_jointly_by_all_four_readers() {
    let (tensor, saved) = saved_by_rows(256, 512, 4);
    let plan = plan_and_check(&saved, &columns(&tensor, 4, 4), &request_order());
    let plans = rank_plans(&plan);
    check_summary(&saved, &plan, &plans);
    for rp in &plans {
        assert_eq!(rp.joint_checks.len(), 4, "rank {}", rp.rank);
        for (box_index, check) in rp.joint_checks.iter().enumerate() {
            assert_eq!(check.id, box_index as u32);
            assert_eq!(check.readers, vec![0, 1, 2, 3]);
            assert_eq!(check.members, vec![0, 1, 2, 3]);
            assert_eq!(check.pieces.len(), 1, "rank {}", rp.rank);
            assert_eq!(
                check.region,
                TensorBox::new(vec![box_index as u64 * 64, 0], vec![64, 512])
            );
        }
    }
    // Survives both wire forms.
    for rp in &plans {
        assert_eq!(
            &tessera_planner::RankPlan::from_json(&rp.to_json()).unwrap(),
            rp
        );
        let arrow = rp.to_arrow_ipc().unwrap();
        assert_eq!(
            &tessera_planner::RankPlan::from_arrow_ipc(&arrow).unwrap(),
            rp
        );
    }
}

/// TP2 x DP2: the replicas' pieces are read once (by one of the two holders) and passed on, so
/// the readers still partition each box; the holders that only receive are members too.
#[test]
fn replicas_that_receive_their_pieces_are_members_of_the_check() {
    let (tensor, saved) = saved_by_rows(256, 512, 2);
    let plan = plan_and_check(&saved, &columns(&tensor, 4, 2), &request_order());
    let plans = rank_plans(&plan);
    check_summary(&saved, &plan, &plans);
    for rp in &plans {
        assert_eq!(rp.joint_checks.len(), 2, "rank {}", rp.rank);
        for check in &rp.joint_checks {
            assert_eq!(check.members, vec![0, 1, 2, 3]);
            assert_eq!(check.readers.len(), 2);
        }
    }
}

/// No joint check where blocks cost nothing extra or the pieces do not partition the box: rows
/// (each piece one contiguous run), storage order (whole rows per slab), no dedup (replicas read
/// the same bytes twice), a box without a recorded crc32c, or a box only one rank reads.
#[test]
fn boxes_that_blocks_verify_cheaply_or_that_no_partition_covers_get_no_check() {
    let (tensor, saved) = saved_by_rows(256, 512, 4);
    let row_halves = rows(&tensor, 2);
    let none = |saved: &Saved, requests: &RequestSet, options: &PlanOptions| {
        let plan = plan_and_check(saved, requests, options);
        let plans = rank_plans(&plan);
        check_joint_checks(saved, &plans);
        plans.iter().all(|rp| rp.joint_checks.is_empty())
    };
    assert!(none(&saved, &row_halves, &request_order()), "rows");
    let storage = PlanOptions {
        read_order: ReadOrder::Storage,
        ..PlanOptions::default()
    };
    assert!(
        none(&saved, &columns(&tensor, 4, 4), &storage),
        "storage order"
    );
    let no_dedup = PlanOptions {
        dedup: false,
        read_order: ReadOrder::Request,
        ..PlanOptions::default()
    };
    assert!(none(&saved, &columns(&tensor, 4, 2), &no_dedup), "no dedup");
    // The same checkpoint without box crcs.
    let meta = &saved.meta;
    let mut chunks = meta.chunks().to_vec();
    for c in &mut chunks {
        c.crc32c = None;
    }
    let bare = Saved {
        meta: Arc::new(
            CheckpointMeta::new(
                meta.tensors().to_vec(),
                chunks,
                Vec::new(),
                meta.files().to_vec(),
            )
            .unwrap(),
        ),
        files: saved.files.clone(),
    };
    assert!(
        none(&bare, &columns(&tensor, 4, 4), &request_order()),
        "no crc"
    );
    // One rank wanting a column slice of every box: one reader per box.
    let one = boxes_per_rank(&tensor, 1, |_| (vec![0, 0], vec![256, 128]));
    assert!(none(&saved, &one, &request_order()), "one reader");
}
