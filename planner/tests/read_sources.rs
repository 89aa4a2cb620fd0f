//! Plans with copies of data files outside storage ([`ReadSources`], a node's memory tier):
//! every byte lands right and is read once, every piece of a held file is read by a rank that
//! can read the copy, storage only serves the files no tier holds, and the summary's
//! `bytes_read_from_tier` is what the tier readers read.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use common::{
    check_summary, layout_for, plan_and_check_with, rank_plans, save_layout, storage_options,
    tensors_from,
};
use proptest::prelude::*;
use tessera_metadata::DType;
use tessera_planner::{PlanOptions, RankPlan, ReadSources, SourceTier};

fn tensor_strategy() -> impl Strategy<Value = (Vec<u64>, DType)> {
    (
        prop::collection::vec(1u64..10, 1..=3),
        prop::sample::select(vec![DType::Bf16, DType::F32, DType::U8]),
    )
}

/// Every piece of a file with a copy is read by a rank of the cheapest copy's reader set; the
/// tier bytes the summary counts are exactly those reads. Returns bytes read from storage.
fn check_sources(plans: &[RankPlan], sources: &ReadSources, files: &[String]) -> (u64, u64) {
    let index = |path: &str| files.iter().position(|f| f == path).unwrap() as u32;
    let (mut from_tier, mut from_storage) = (0, 0);
    for rp in plans {
        for p in &rp.pieces {
            let Some(read) = &p.read else { continue };
            let file = index(&rp.files[read.file as usize]);
            match sources.cheapest(file) {
                Some((_, ranks)) if !p.read_by_holders => {
                    assert!(
                        ranks.contains(&rp.rank),
                        "piece {} of held file #{file} read by rank {} outside its readers {ranks:?}",
                        p.id,
                        rp.rank
                    );
                    from_tier += p.bytes;
                }
                _ if sources.reads_from_tier(file, rp.rank) => from_tier += p.bytes,
                _ => from_storage += p.bytes,
            }
        }
    }
    (from_tier, from_storage)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn pieces_of_held_files_are_read_by_their_holders_and_land_right(
        specs in prop::collection::vec(tensor_strategy(), 1..=4),
        saved_mesh in prop::collection::vec(1u32..=3, 1..=2),
        target_mesh in prop::collection::vec(1u32..=3, 1..=2),
        choices in prop::collection::vec(0u32..30, 1..=12),
        target_choices in prop::collection::vec(0u32..30, 1..=12),
        held in prop::collection::vec(prop::collection::vec(any::<bool>(), 9), 9),
        disk in prop::collection::vec(any::<bool>(), 9),
        seed in any::<u64>(),
    ) {
        let tensors = tensors_from(specs);
        let saved = save_layout(tensors.clone(), &layout_for(&saved_mesh, &tensors, &choices));
        let requests = layout_for(&target_mesh, &tensors, &target_choices).resolve(&tensors).unwrap();
        let world = requests.world_size();
        let files: Vec<String> = saved.meta.files().iter().map(|f| f.path.clone()).collect();
        let mut sources = ReadSources::none();
        for file in 0..files.len() {
            let ranks = (0..world).filter(|&r| held[file % 9][r as usize % 9]);
            // Some files also on a local disk of other ranks: the memory copy still wins.
            let tier = if disk[file % 9] { SourceTier::LocalDisk } else { SourceTier::NodeMemory };
            sources.add(file as u32, tier, ranks);
        }
        for options in [PlanOptions::default(), storage_options(seed)] {
            // Every destination byte written once with the right value (inside the helper).
            let plan = plan_and_check_with(&saved, &requests, &options, &sources);
            let plans = rank_plans(&plan);
            check_summary(&saved, &plan, &plans);
            let s = plan.summary();
            prop_assert_eq!(s.bytes_needed + s.bytes_relayed, s.bytes_read + s.bytes_exchanged);
            let (tier, storage) = check_sources(&plans, &sources, &files);
            prop_assert_eq!(tier, s.bytes_read_from_tier);
            prop_assert_eq!(tier + storage, s.bytes_read);
            // Through JSON and Arrow IPC the relayed pieces survive.
            for rp in &plans {
                prop_assert_eq!(&RankPlan::from_json(&rp.to_json()).unwrap(), rp);
            }

            // Every rank holding every file (one node with a full tier): the ranks that need a
            // piece read it, so the plan is the storage plan, every byte from the tier.
            let mut everywhere = ReadSources::none();
            for file in 0..files.len() {
                everywhere.add(file as u32, SourceTier::NodeMemory, 0..world);
            }
            let full = plan_and_check_with(&saved, &requests, &options, &everywhere);
            let storage = plan_and_check_with(&saved, &requests, &options, &ReadSources::none());
            let mut expected = storage.summary().clone();
            expected.bytes_read_from_tier = expected.bytes_read;
            prop_assert_eq!(full.summary(), &expected);
        }
    }
}

/// 4 ranks on 2 "nodes" saved a TP4 layout; a job of 3 ranks wants DP3 (every rank everything).
/// Node A (ranks 0, 1 of the new job) holds files 0 and 1, node B (rank 2) lost its copy of file
/// 3 but holds file 2: storage serves exactly file 3, the rest comes from the tiers, read once.
#[test]
fn a_lost_node_is_read_from_storage_and_the_rest_from_the_surviving_tiers() {
    let tensors = tensors_from(vec![(vec![8, 6], DType::F32), (vec![4], DType::Bf16)]);
    let saved = save_layout(tensors.clone(), &layout_for(&[4], &tensors, &[1, 0]));
    assert_eq!(saved.meta.files().len(), 4);
    let requests = layout_for(&[3], &tensors, &[0, 0])
        .resolve(&tensors)
        .unwrap();
    let mut sources = ReadSources::none();
    sources.add(0, SourceTier::NodeMemory, [0, 1]);
    sources.add(1, SourceTier::NodeMemory, [0, 1]);
    sources.add(2, SourceTier::NodeMemory, [2]);
    let plan = plan_and_check_with(&saved, &requests, &PlanOptions::default(), &sources);
    let plans = rank_plans(&plan);
    check_summary(&saved, &plan, &plans);
    let files: Vec<String> = saved.meta.files().iter().map(|f| f.path.clone()).collect();
    let (tier, storage) = check_sources(&plans, &sources, &files);
    let file_bytes = |f: usize| {
        saved
            .meta
            .chunks()
            .iter()
            .filter(|c| c.bytes.file as usize == f)
            .map(|c| c.bytes.length)
            .sum::<u64>()
    };
    assert_eq!(storage, file_bytes(3));
    assert_eq!(tier, file_bytes(0) + file_bytes(1) + file_bytes(2));
    assert_eq!(plan.summary().bytes_read_from_tier, tier);
    assert_eq!(plan.summary().read_amplification, 1.0);

    // A rank outside the job cannot offer a copy.
    let mut far = ReadSources::none();
    far.add(0, SourceTier::NodeMemory, [7]);
    let err =
        tessera_planner::plan_with_sources(&saved.meta, &requests, &PlanOptions::default(), &far)
            .unwrap_err()
            .to_string();
    assert!(
        err.contains("rank 7 offers a NodeMemory copy of data file #0 but the job has 3 ranks"),
        "{err}"
    );
}
