//! What a rank fetches as its answer when every rank needs a part of every saved shard (the
//! all-to-all reshard: 200 tensors saved Shard(0) over W files, loaded as Shard(1)): its plan
//! holds one piece per saved shard of every tensor, so it grows with W, but the pieces step
//! through ids and offsets evenly and the packed answer ([`tessera_ops::job::packed`]) grows by
//! far less than the world.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, SavedChunk, TensorBox, TensorMeta,
};
use tessera_ops::job::Answer;
use tessera_planner::{PlanOptions, Request, RequestSet, Target, plan};

const TENSORS: u64 = 200;
const ROWS: u64 = 64;
const COLS: u64 = 256;

/// The checkpoint `dcp.save` writes of 200 [64, 256] float32 tensors sharded by rows over
/// `world` ranks (each rank's file holds its rows of every tensor, back to back), with or
/// without checksums.
fn saved_by_rows(world: u64, checksums: bool) -> Arc<CheckpointMeta> {
    let tensors: Vec<TensorMeta> = (0..TENSORS)
        .map(|i| TensorMeta::new(format!("layers.{i}.weight"), DType::F32, vec![ROWS, COLS]))
        .collect();
    let rows = ROWS / world;
    let mut chunks = Vec::new();
    for file in 0..world {
        for t in 0..TENSORS {
            let length = rows * COLS * 4;
            chunks.push(SavedChunk {
                tensor: t as u32,
                region: TensorBox::new(vec![file * rows, 0], vec![rows, COLS]),
                bytes: ByteMeta {
                    file: file as u32,
                    offset: t * length,
                    length,
                    strides: None,
                },
                crc32c: checksums.then_some(0x1234_5678 ^ (file * TENSORS + t) as u32),
                crc32: None,
            });
        }
    }
    let files = (0..world)
        .map(|f| DataFile {
            path: format!("__{f}_0.distcp"),
            size: Some(TENSORS * rows * COLS * 4),
            encoded: None,
        })
        .collect();
    Arc::new(CheckpointMeta::new(tensors, chunks, Vec::new(), files).unwrap())
}

/// Every rank's requests: its columns of every tensor (Shard(1)).
fn by_columns(world: u64) -> RequestSet {
    let cols = COLS / world;
    RequestSet {
        ranks: (0..world)
            .map(|r| {
                (0..TENSORS)
                    .map(|t| Request {
                        tensor: t as u32,
                        target: Target::Box(TensorBox::new(vec![0, r * cols], vec![ROWS, cols])),
                    })
                    .collect()
            })
            .collect(),
        disjoint: true,
    }
}

/// The largest answer any rank fetches at `world`.
fn largest_answer(world: u64, checksums: bool) -> usize {
    let meta = saved_by_rows(world, checksums);
    let plan = plan(&meta, &by_columns(world), &PlanOptions::default()).unwrap();
    (0..world as u32)
        .map(|rank| {
            let rank_plan = plan.rank_plan(rank).unwrap();
            let answer = Answer::Plan {
                plan: Box::new(rank_plan.clone()),
                node_verified: Vec::new(),
                joint_at_coordinator: true,
                summary: Some(plan.summary().clone()),
            };
            let bytes = answer.encode().unwrap();
            // What travels is what was planned.
            match Answer::decode(rank, &bytes).unwrap() {
                Answer::Plan { plan, .. } => assert_eq!(*plan, rank_plan),
                other => panic!("rank {rank} decoded {other:?}"),
            }
            bytes.len()
        })
        .max()
        .unwrap()
}

#[test]
fn a_ranks_answer_in_an_all_to_all_reshard_grows_far_less_than_the_world() {
    for checksums in [false, true] {
        let (at_4, at_16) = (largest_answer(4, checksums), largest_answer(16, checksums));
        eprintln!("checksums {checksums}: {at_4} bytes at 4 ranks, {at_16} at 16");
        // Four times the pieces: as JSON rows, zstd-compressed, about four times the bytes
        // (9 KB, 38 KB).
        assert!(
            at_16 * 2 <= at_4 * 3,
            "checksums {checksums}: {at_16} bytes at 16 ranks, {at_4} at 4"
        );
    }
}
