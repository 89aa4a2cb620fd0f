//! Named resharding scenarios, each executed on real bytes through the in-memory executor.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::{StoredBox, plan_and_check, save_boxes, save_layout, small_gpt};
use tessera_metadata::{DType, TensorBox, TensorMeta};
use tessera_planner::presets::{MegatronGpt, fsdp, megatron_gpt};
use tessera_planner::{ExplicitRequests, Layout, PlanOptions, Target};

fn megatron(tp: u32, pp: u32, dp: u32, layers: u64) -> Layout {
    megatron_gpt(MegatronGpt {
        tp,
        pp,
        dp,
        num_layers: layers,
        zero1: false,
    })
    .unwrap()
}

fn total_bytes(tensors: &[TensorMeta]) -> u64 {
    tensors.iter().map(TensorMeta::nbytes).sum()
}

#[test]
fn tp2_to_tp4() {
    let tensors = small_gpt(2, true);
    let saved = save_layout(tensors.clone(), &megatron(2, 1, 1, 2));
    let target = megatron(4, 1, 1, 2);
    let plan = plan_and_check(
        &saved,
        &target.resolve(&tensors).unwrap(),
        &PlanOptions::default(),
    );
    let s = plan.summary();
    assert_eq!(s.ranks, 4);
    assert_eq!(s.read_amplification, 1.0);
    assert_eq!(s.bytes_read, total_bytes(&tensors));
    // Norms (and their optimizer states) and the step are replicated over tp: read once, sent to 3.
    let replicated: u64 = tensors
        .iter()
        .filter(|t| t.fqn.contains("norm") || t.fqn == "train.step")
        .map(TensorMeta::nbytes)
        .sum();
    assert_eq!(s.bytes_exchanged, 3 * replicated);
    // A tp4 shard of qkv (24 rows -> 6 each) lies inside one tp2 chunk (12 rows): one piece.
    let qkv = saved
        .meta
        .tensor_index("model.layers.0.attn.qkv.weight")
        .unwrap();
    assert_eq!(plan.pieces().iter().filter(|p| p.tensor == qkv).count(), 4);
}

#[test]
fn tp4_to_tp1() {
    let tensors = small_gpt(2, false);
    let saved = save_layout(tensors.clone(), &megatron(4, 1, 1, 2));
    let plan = plan_and_check(
        &saved,
        &megatron(1, 1, 1, 2).resolve(&tensors).unwrap(),
        &PlanOptions::default(),
    );
    let s = plan.summary();
    assert_eq!((s.ranks, s.bytes_exchanged, s.exchange_groups), (1, 0, 0));
    assert_eq!(s.bytes_read, total_bytes(&tensors));
    // The whole fc2 (row-parallel, shard(1)) comes from its 4 saved column blocks.
    let fc2 = saved
        .meta
        .tensor_index("model.layers.1.mlp.fc2.weight")
        .unwrap();
    assert_eq!(plan.pieces().iter().filter(|p| p.tensor == fc2).count(), 4);
}

#[test]
fn pp4_to_pp2() {
    let tensors = small_gpt(8, true);
    let saved = save_layout(tensors.clone(), &megatron(1, 4, 1, 8));
    let plan = plan_and_check(
        &saved,
        &megatron(1, 2, 1, 8).resolve(&tensors).unwrap(),
        &PlanOptions::default(),
    );
    let rank0 = plan.rank_plan(0).unwrap();
    let rank1 = plan.rank_plan(1).unwrap();
    let names = |rp: &tessera_planner::RankPlan| -> Vec<String> {
        rp.destinations
            .iter()
            .map(|d| rp.tensors[d.tensor as usize].fqn.clone())
            .collect()
    };
    let (n0, n1) = (names(&rank0), names(&rank1));
    assert!(n0.contains(&"model.embed_tokens.weight".to_string()));
    assert!(n0.contains(&"model.layers.3.mlp.fc1.weight".to_string()));
    assert!(!n0.contains(&"model.layers.4.mlp.fc1.weight".to_string()));
    assert!(n1.contains(&"model.layers.4.mlp.fc1.weight".to_string()));
    assert!(n1.contains(&"model.lm_head.weight".to_string()));
    assert!(n1.contains(&"optim.state.model.final_norm.weight.exp_avg".to_string()));
    // Only the 0-dim step is on both stages.
    assert_eq!(plan.summary().bytes_exchanged, 8);
    assert_eq!(plan.summary().read_amplification, 1.0);
}

#[test]
fn fsdp_dp4_to_tp2_dp2() {
    let tensors = small_gpt(2, true);
    let saved = save_layout(tensors.clone(), &fsdp(4).unwrap());
    let plan = plan_and_check(
        &saved,
        &megatron(2, 1, 2, 2).resolve(&tensors).unwrap(),
        &PlanOptions::default(),
    );
    let s = plan.summary();
    assert_eq!(s.bytes_read, total_bytes(&tensors));
    assert_eq!(s.unique_bytes_needed, total_bytes(&tensors));
    // Every byte a rank ends up with was either read by it or received once.
    assert_eq!(s.bytes_needed, s.bytes_read + s.bytes_exchanged);
    // dp replicas split the reads: nobody reads more than 60% of its tp half.
    assert!(s.max_read_per_rank as f64 <= 0.6 * (total_bytes(&tensors) as f64 / 2.0) + 4096.0);
}

#[test]
fn rows_98_over_4_ranks_are_25_25_25_23() {
    let tensors = vec![TensorMeta::new("pos_emb", DType::F32, vec![98, 4])];
    let saved = save_layout(tensors.clone(), &fsdp(4).unwrap());
    let rows: Vec<u64> = saved
        .meta
        .chunks()
        .iter()
        .map(|c| c.region.lengths[0])
        .collect();
    assert_eq!(rows, vec![25, 25, 25, 23]);
    let plan = plan_and_check(
        &saved,
        &fsdp(3).unwrap().resolve(&tensors).unwrap(),
        &PlanOptions::default(),
    );
    let rows: Vec<u64> = (0..3)
        .map(|r| plan.destinations(r)[0].target.buffer_shape()[0])
        .collect();
    assert_eq!(rows, vec![33, 33, 32]);
    // Rank 1 (rows 33..66) straddles saved chunks 1 and 2.
    assert_eq!(plan.rank_plan(1).unwrap().pieces.len(), 2);
}

#[test]
fn rows_5_over_4_ranks_leave_an_empty_box() {
    let tensors = vec![TensorMeta::new("tiny.weight", DType::F16, vec![5, 3])];
    let saved = save_layout(tensors.clone(), &fsdp(4).unwrap());
    let regions: Vec<TensorBox> = saved
        .meta
        .chunks()
        .iter()
        .map(|c| c.region.clone())
        .collect();
    assert_eq!(regions[3], TensorBox::new(vec![5, 0], vec![0, 3]));
    assert_eq!(saved.meta.chunks()[3].bytes.length, 0);
    for target in [fsdp(2).unwrap(), fsdp(4).unwrap()] {
        let plan = plan_and_check(
            &saved,
            &target.resolve(&tensors).unwrap(),
            &PlanOptions::default(),
        );
        assert_eq!(plan.summary().bytes_read, 30);
    }
    let plan = plan_and_check(
        &saved,
        &fsdp(4).unwrap().resolve(&tensors).unwrap(),
        &PlanOptions::default(),
    );
    let empty = plan.rank_plan(3).unwrap();
    assert_eq!(empty.destinations[0].bytes, 0);
    assert!(empty.pieces.is_empty());
}

#[test]
fn nested_shard0_shard0_splits_in_mesh_order() {
    let tensors = vec![TensorMeta::new("w", DType::Bf16, vec![10, 4])];
    let layout = Layout::from_json(
        r#"{"mesh": [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}],
            "rules": [{"match": "*", "placements": ["shard(0)", "shard(0)"]}]}"#,
    )
    .unwrap();
    let holdings = layout.resolve(&tensors).unwrap();
    let rows: Vec<(u64, u64)> = holdings
        .ranks
        .iter()
        .map(|r| match &r[0].target {
            Target::Box(b) => (b.offsets[0], b.lengths[0]),
            Target::Flat { .. } => unreachable!(),
        })
        .collect();
    // dp splits 10 rows into 5 + 5, then tp splits each 5 into 3 + 2.
    assert_eq!(rows, vec![(0, 3), (3, 2), (5, 3), (8, 2)]);
    let saved = save_layout(tensors.clone(), &layout);
    plan_and_check(
        &saved,
        &fsdp(3).unwrap().resolve(&tensors).unwrap(),
        &PlanOptions::default(),
    );
}

#[test]
fn flat_ranges_across_box_borders() {
    let tensors = vec![
        TensorMeta::new("w", DType::F32, vec![10, 6]),
        TensorMeta::new("v", DType::Bf16, vec![3, 4, 5]),
    ];
    let saved = save_layout(tensors.clone(), &fsdp(2).unwrap());
    // w's saved chunks meet at row 5 = flat 30; v's at dim-0 index 2 = flat 40.
    let requests = ExplicitRequests::from_json(
        r#"{"ranks": [
            [{"fqn": "w", "flat": [0, 25]}, {"fqn": "v", "flat": [7, 43]}],
            [{"fqn": "w", "flat": [25, 60]}, {"fqn": "v", "flat": [43, 60]}],
            [{"fqn": "w", "flat": [27, 33]}, {"fqn": "v", "offsets": [1, 1, 0], "lengths": [2, 2, 5]}]
        ]}"#,
    )
    .unwrap()
    .resolve(&tensors)
    .unwrap();
    let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
    // Rank 2's w range overlaps both others and straddles the border: shared cells, read once.
    assert_eq!(plan.summary().read_amplification, 1.0);
    assert_eq!(plan.summary().unique_bytes_needed, 60 * 4 + 60 * 2 - 7 * 2);
}

#[test]
fn strided_source_is_read_element_by_element() {
    let tensors = vec![TensorMeta::new("lm_head", DType::F32, vec![6, 4])];
    // Stored as a transposed view: element (i, j) at i + 6 j.
    let saved = save_boxes(
        tensors.clone(),
        vec![vec![StoredBox {
            tensor: 0,
            region: TensorBox::whole(&[6, 4]),
            strides: Some(vec![1, 6]),
        }]],
    );
    let layout = Layout::from_json(
        r#"{"mesh": [{"name": "tp", "size": 2}], "rules": [{"match": "*", "placements": ["shard(1)"]}]}"#,
    )
    .unwrap();
    let plan = plan_and_check(
        &saved,
        &layout.resolve(&tensors).unwrap(),
        &PlanOptions::default(),
    );
    let rp = plan.rank_plan(1).unwrap();
    let read = rp.pieces[0].read.as_ref().unwrap();
    assert_eq!(read.runs.run_bytes, 4);
    assert_eq!(read.runs.num_runs(), 12);
}

#[test]
fn without_dedup_every_rank_reads_its_own() {
    let tensors = small_gpt(1, false);
    let saved = save_layout(tensors.clone(), &megatron(2, 1, 1, 1));
    let requests = megatron(1, 1, 4, 1).resolve(&tensors).unwrap();
    let plan = plan_and_check(
        &saved,
        &requests,
        &PlanOptions {
            dedup: false,
            ..PlanOptions::default()
        },
    );
    let s = plan.summary();
    assert_eq!(s.bytes_exchanged, 0);
    assert_eq!(s.bytes_read, 4 * total_bytes(&tensors));
    assert_eq!(s.read_amplification, 4.0);
}

#[test]
fn rank_plans_carry_the_checkpoint_identity_through_json_and_arrow() {
    let tensors = small_gpt(2, false);
    let saved = save_layout(tensors.clone(), &megatron(2, 1, 1, 2));
    let requests = megatron(1, 1, 2, 2).resolve(&tensors).unwrap();
    let unstamped = tessera_planner::plan(&saved.meta, &requests, &PlanOptions::default()).unwrap();
    assert_eq!(unstamped.rank_plan(0).unwrap().checkpoint_identity, None);
    let stamped = std::sync::Arc::new(
        saved
            .meta
            .as_ref()
            .clone()
            .with_identity("native:0123456789abcdef0123456789abcdef".to_string()),
    );
    let plan = tessera_planner::plan(&stamped, &requests, &PlanOptions::default()).unwrap();
    for rank in 0..plan.world_size() {
        let rank_plan = plan.rank_plan(rank).unwrap();
        assert_eq!(
            rank_plan.checkpoint_identity.as_deref(),
            Some("native:0123456789abcdef0123456789abcdef")
        );
        let json = tessera_planner::RankPlan::from_json(&rank_plan.to_json()).unwrap();
        assert_eq!(json, rank_plan);
        let arrow =
            tessera_planner::RankPlan::from_arrow_ipc(&rank_plan.to_arrow_ipc().unwrap()).unwrap();
        assert_eq!(arrow.checkpoint_identity, rank_plan.checkpoint_identity);
        assert_eq!(arrow, rank_plan);
    }
}
