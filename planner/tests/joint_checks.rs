//! Named cases of joint checks: saved boxes whose column slices several ranks read are verified
//! by the box's own crc32c from the readers' folds, instead of every rank fetching every checksum
//! block of every row. The soundness of every check (each byte of the box read exactly once by
//! its readers, every holder a member) is asserted by `common::check_joint_checks`, which
//! `check_summary` runs on every plan of the property tests too.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::sync::Arc;

use common::{
    Saved, StoredBox, check_joint_checks, check_summary, plan_and_check, rank_plans, save_boxes,
};
use tessera_metadata::{CheckpointMeta, DType, TensorBox, TensorMeta};
use tessera_planner::{ExplicitRequest, ExplicitRequests, PlanOptions, ReadOrder, RequestSet};

/// A [rows, cols] f32 matrix saved Shard(0) by `world` ranks, one file each.
fn saved_by_rows(rows: u64, cols: u64, world: u64) -> (TensorMeta, Saved) {
    let tensor = TensorMeta::new("layers.0.weight", DType::F32, vec![rows, cols]);
    let per = rows / world;
    let files = (0..world)
        .map(|r| {
            vec![StoredBox {
                tensor: 0,
                region: TensorBox::new(vec![r * per, 0], vec![per, cols]),
                strides: None,
            }]
        })
        .collect();
    (tensor.clone(), save_boxes(vec![tensor], files))
}

/// Rank r of `ranks` wants columns block `r % tp` of `tp` (ranks r and r + tp are replicas).
fn columns(tensor: &TensorMeta, ranks: u64, tp: u64) -> RequestSet {
    let [rows, cols] = tensor.shape[..] else {
        unreachable!()
    };
    let per = cols / tp;
    ExplicitRequests {
        ranks: (0..ranks)
            .map(|r| {
                vec![ExplicitRequest::Box {
                    fqn: tensor.fqn.clone(),
                    offsets: vec![0, (r % tp) * per],
                    lengths: vec![rows, per],
                }]
            })
            .collect(),
    }
    .resolve(std::slice::from_ref(tensor))
    .unwrap()
}

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
    let rows = ExplicitRequests {
        ranks: (0..2)
            .map(|r| {
                vec![ExplicitRequest::Box {
                    fqn: tensor.fqn.clone(),
                    offsets: vec![r * 128, 0],
                    lengths: vec![128, 512],
                }]
            })
            .collect(),
    }
    .resolve(std::slice::from_ref(&tensor))
    .unwrap();
    let none = |saved: &Saved, requests: &RequestSet, options: &PlanOptions| {
        let plan = plan_and_check(saved, requests, options);
        let plans = rank_plans(&plan);
        check_joint_checks(saved, &plans);
        plans.iter().all(|rp| rp.joint_checks.is_empty())
    };
    assert!(none(&saved, &rows, &request_order()), "rows");
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
    let one = ExplicitRequests {
        ranks: vec![vec![ExplicitRequest::Box {
            fqn: tensor.fqn.clone(),
            offsets: vec![0, 0],
            lengths: vec![256, 128],
        }]],
    }
    .resolve(std::slice::from_ref(&tensor))
    .unwrap();
    assert!(none(&saved, &one, &request_order()), "one reader");
}
