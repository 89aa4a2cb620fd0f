//! What two ranks pass each other, digested on each end ([`RankPlan::peer_digests`]): the rank
//! plans of one plan always agree (whatever the layouts, read order, joint checks and relays),
//! rank plans of two plans of the same requests that name rows differently by one piece id
//! never do, and a rank plan is checked against its rank's own requests
//! ([`RankPlan::check_destinations`]).
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::{
    layout_for, plan_and_check, rank_plans, save_layout, saved_by_rows, storage_options,
    tensors_from,
};
use proptest::prelude::*;
use tessera_metadata::DType;
use tessera_planner::{ExplicitRequest, ExplicitRequests, PlanError, PlanOptions, RankPlan};

fn tensor_strategy() -> impl Strategy<Value = (Vec<u64>, DType)> {
    (
        prop::collection::vec(prop_oneof![9 => 1u64..10, 1 => Just(0u64)], 0..=3),
        prop::sample::select(DType::ALL.to_vec()),
    )
}

fn mesh_strategy() -> impl Strategy<Value = Vec<u32>> {
    prop::collection::vec(1u32..=3, 1..=3)
}

/// Every pair of ranks digests what it shares alike.
fn assert_pairs_agree(plans: &[RankPlan]) -> Result<(), TestCaseError> {
    let digests: Vec<Vec<u64>> = plans.iter().map(RankPlan::peer_digests).collect();
    for (r, mine) in digests.iter().enumerate() {
        prop_assert_eq!(mine.len(), plans.len());
        for (p, theirs) in digests.iter().enumerate() {
            prop_assert_eq!(
                mine[p],
                theirs[r],
                "ranks {} and {} disagree on an honest plan",
                r,
                p
            );
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn the_rank_plans_of_one_plan_agree_pairwise(
        specs in prop::collection::vec(tensor_strategy(), 1..=4),
        saved_mesh in mesh_strategy(),
        target_mesh in mesh_strategy(),
        choices in prop::collection::vec(0u32..30, 1..=12),
        target_choices in prop::collection::vec(0u32..30, 1..=12),
        seed in any::<u64>(),
        storage in any::<bool>(),
    ) {
        let tensors = tensors_from(specs);
        let saved = save_layout(tensors.clone(), &layout_for(&saved_mesh, &tensors, &choices));
        let requests = layout_for(&target_mesh, &tensors, &target_choices).resolve(&tensors).unwrap();
        let options = if storage { storage_options(seed) } else { PlanOptions::default() };
        let plan = plan_and_check(&saved, &requests, &options);
        let plans = rank_plans(&plan);
        assert_pairs_agree(&plans)?;
        for (rank, rp) in plans.iter().enumerate() {
            prop_assert!(rp.check_destinations(&saved.meta, &requests.ranks[rank]).is_ok());
        }
    }
}

/// The campaign's lie: both ranks want a matrix's two halves by rows, and the second plan lists
/// rank 0's halves the other way round, so piece id 0 names other rows in it.
#[test]
fn rank_plans_of_two_plans_of_the_same_requests_disagree() {
    let (tensor, saved) = saved_by_rows(8, 4, 1);
    let half = |top: bool| ExplicitRequest::Box {
        fqn: tensor.fqn.clone(),
        offsets: vec![if top { 0 } else { 4 }, 0],
        lengths: vec![4, 4],
    };
    let asked = |reversed: bool| {
        let mut rank0 = vec![half(true), half(false)];
        if reversed {
            rank0.reverse();
        }
        ExplicitRequests {
            ranks: vec![rank0, vec![half(true), half(false)]],
        }
        .resolve(std::slice::from_ref(&tensor))
        .unwrap()
    };
    let (a, b) = (asked(false), asked(true));
    let plan_a = plan_and_check(&saved, &a, &PlanOptions::default());
    let plan_b = plan_and_check(&saved, &b, &PlanOptions::default());
    let (a0, b1) = (plan_a.rank_plan(0).unwrap(), plan_b.rank_plan(1).unwrap());
    let honest = plan_a.rank_plan(1).unwrap();
    assert_eq!(a0.peer_digests()[1], honest.peer_digests()[0]);
    assert_ne!(
        a0.peer_digests()[1],
        b1.peer_digests()[0],
        "rank 0 of one plan and rank 1 of the other agree"
    );

    // Plan B's rank 0 is not rank 0's requests as plan A asked them: its first destination is
    // the bottom half.
    let b0 = plan_b.rank_plan(0).unwrap();
    let err = b0.check_destinations(&saved.meta, &a.ranks[0]).unwrap_err();
    assert!(
        matches!(err, PlanError::NotTheRequests { rank: 0, .. }),
        "{err}"
    );
    assert_eq!(
        err.to_string(),
        "rank 0: the plan's destinations are not this rank's requests: destination 0 is box at \
         [4, 0] of [4, 4] of tensor layers.0.weight but request 0 is box at [0, 0] of [4, 4] of \
         tensor layers.0.weight; nothing was read (a plan server that planned other requests, \
         or listed them in another order: plan it again)"
    );
    let short = &a.ranks[0][..1];
    let err = b0.check_destinations(&saved.meta, short).unwrap_err();
    assert!(
        err.to_string()
            .contains("the plan has 2 destinations for this rank's 1 requests"),
        "{err}"
    );
}
