//! Property tests over random tensors, dtypes, saved layouts and target layouts or requests.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::{
    check_summary, execute, explicit_request, layout_for, plan_and_check, rank_plans, save_layout,
    storage_options, tensors_from,
};
use proptest::prelude::*;
use tessera_metadata::DType;
use tessera_planner::baseline::all_pairs_overlaps;
use tessera_planner::{
    ExplicitRequest, ExplicitRequests, PlanOptions, RankPlan, RequestSet, plan as make_plan,
};

fn tensor_strategy() -> impl Strategy<Value = (Vec<u64>, DType)> {
    (
        prop::collection::vec(prop_oneof![9 => 1u64..10, 1 => Just(0u64)], 0..=3),
        prop::sample::select(DType::ALL.to_vec()),
    )
}

fn mesh_strategy() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(1u32..=3, 1..=3)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn layout_to_layout_plans_are_exact(
        specs in prop::collection::vec(tensor_strategy(), 1..=4),
        saved_mesh in mesh_strategy(),
        target_mesh in mesh_strategy(),
        choices in prop::collection::vec(0u32..30, 1..=12),
        target_choices in prop::collection::vec(0u32..30, 1..=12),
        seed in any::<u64>(),
    ) {
        let tensors = tensors_from(specs);
        let saved = save_layout(tensors.clone(), &layout_for(&saved_mesh, &tensors, &choices));
        let requests = layout_for(&target_mesh, &tensors, &target_choices).resolve(&tensors).unwrap();

        // Every destination byte written exactly once with the right value (inside the helper).
        let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
        let plans = rank_plans(&plan);

        // Read dedup: nothing read twice, and exactly the distinct bytes needed are read (plus
        // small pieces of wide groups, read by every holder).
        check_summary(&saved, &plan, &plans);
        let s = plan.summary();
        prop_assert_eq!(s.bytes_needed + s.bytes_relayed, s.bytes_read + s.bytes_exchanged);

        // Read in storage order: the same bytes land (checked inside), each read once, and what
        // slab readers relay is exactly what crosses the exchange on top of the replicas.
        let in_order = plan_and_check(&saved, &requests, &storage_options(seed));
        let in_order_plans = rank_plans(&in_order);
        check_summary(&saved, &in_order, &in_order_plans);
        let o = in_order.summary();
        prop_assert_eq!(o.bytes_needed + o.bytes_relayed, o.bytes_read + o.bytes_exchanged);
        prop_assert_eq!(o.unique_bytes_needed, s.unique_bytes_needed);
        for rp in &in_order_plans {
            prop_assert_eq!(&RankPlan::from_json(&rp.to_json()).unwrap(), rp);
            prop_assert_eq!(&RankPlan::from_arrow_ipc(&rp.to_arrow_ipc().unwrap()).unwrap(), rp);
        }

        // The layout's promise that requests are identical or disjoint holds: planning without
        // it (overlap check, refinement) gives the same plan.
        let checked = RequestSet { disjoint: false, ..requests.clone() };
        let unchecked_plan = make_plan(&saved.meta, &checked, &PlanOptions::default()).unwrap();
        prop_assert_eq!(unchecked_plan.summary(), plan.summary());

        // The partition index finds exactly what scanning all pairs finds.
        let no_dedup = plan_and_check(&saved, &requests, &PlanOptions { dedup: false, ..PlanOptions::default() });
        let (pairs, pair_bytes) = all_pairs_overlaps(&saved.meta, &requests);
        prop_assert_eq!(no_dedup.pieces().len() as u64, pairs);
        prop_assert_eq!(no_dedup.summary().bytes_read, pair_bytes);

        // Deterministic, and identical through JSON and Arrow IPC.
        let again = make_plan(&saved.meta, &requests, &PlanOptions::default()).unwrap();
        for (r, rp) in plans.iter().enumerate() {
            let rp2 = again.rank_plan(r as u32).unwrap();
            prop_assert_eq!(rp, &rp2);
            prop_assert_eq!(&RankPlan::from_json(&rp.to_json()).unwrap(), rp);
            prop_assert_eq!(&RankPlan::from_arrow_ipc(&rp.to_arrow_ipc().unwrap()).unwrap(), rp);
        }
    }

    #[test]
    fn explicit_requests_are_exact(
        specs in prop::collection::vec(tensor_strategy(), 1..=3),
        saved_mesh in mesh_strategy(),
        choices in prop::collection::vec(0u32..30, 1..=12),
        picks in prop::collection::vec((0usize..3, any::<bool>(), prop::collection::vec(0u64..10, 6)), 1..=12),
        world in 1usize..=4,
        seed in any::<u64>(),
    ) {
        let tensors = tensors_from(specs);
        let saved = save_layout(tensors.clone(), &layout_for(&saved_mesh, &tensors, &choices));
        let mut ranks: Vec<Vec<ExplicitRequest>> = vec![Vec::new(); world];
        for (i, (t, flat, nums)) in picks.iter().enumerate() {
            let tensor = &tensors[t % tensors.len()];
            let request = explicit_request(tensor, *flat, nums);
            ranks[i % world].push(request);
        }
        let requests: RequestSet = ExplicitRequests { ranks }.resolve(&tensors).unwrap();
        let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
        let plans = rank_plans(&plan);
        // Overlapping requests are cut into shared pieces: still nothing is read twice.
        check_summary(&saved, &plan, &plans);
        let s = plan.summary();
        prop_assert!(s.bytes_read <= s.bytes_needed);
        let _ = execute(&plans, &saved);
        // Shared cells cut again by slabs: still exact, nothing read twice.
        let in_order = plan_and_check(&saved, &requests, &storage_options(seed));
        check_summary(&saved, &in_order, &rank_plans(&in_order));
    }
}
