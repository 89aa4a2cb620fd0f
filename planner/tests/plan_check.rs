//! A rank plan is checked against the checkpoint's own metadata before it is executed
//! ([`RankPlan::check_against`]): honest plans pass, and a lying plan (another file, offset,
//! stride, box, tensor, dtype, destination or placement) either is refused or, carried out, puts
//! exactly the honest bytes in every destination. Lying plans never load wrong bytes.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::collections::HashMap;

use common::{Saved, explicit_request, layout_for, plan_and_check, save_layout, tensors_from};
use proptest::prelude::*;
use tessera_metadata::DType;
use tessera_planner::{
    ExplicitRequest, ExplicitRequests, PlanError, PlanOptions, RankPlan, RequestSet, Target,
};

fn tensor_strategy() -> impl Strategy<Value = (Vec<u64>, DType)> {
    (
        prop::collection::vec(1u64..8, 1..=3),
        prop::sample::select(DType::ALL.to_vec()),
    )
}

/// Carries out a one-rank plan alone: reads its pieces from `saved`'s files, places them. `None`
/// where it would read or write out of bounds or name a file the checkpoint lacks (a loader
/// refuses those too, on bounds).
fn run_alone(rp: &RankPlan, saved: &Saved) -> Option<Vec<Vec<u8>>> {
    let files: HashMap<&str, usize> = saved
        .meta
        .files()
        .iter()
        .enumerate()
        .map(|(i, f)| (f.path.as_str(), i))
        .collect();
    let mut out: Vec<Vec<u8>> = rp
        .destinations
        .iter()
        .map(|d| vec![0u8; d.bytes as usize])
        .collect();
    for p in &rp.pieces {
        let read = p.read.as_ref()?;
        let file = &saved.files[*files.get(rp.files.get(read.file as usize)?.as_str())?];
        let mut wire = vec![0u8; p.bytes as usize];
        let n = read.runs.run_bytes as usize;
        for (src, dst) in read.runs.iter() {
            let (src, dst) = (src as usize, dst as usize);
            wire.get_mut(dst..dst + n)?
                .copy_from_slice(file.get(src..src + n)?);
        }
        for place in &p.places {
            let n = place.runs.run_bytes as usize;
            let dest = out.get_mut(place.destination as usize)?;
            for (src, dst) in place.runs.iter() {
                let (src, dst) = (src as usize, dst as usize);
                dest.get_mut(dst..dst + n)?
                    .copy_from_slice(wire.get(src..src + n)?);
            }
        }
    }
    Some(out)
}

/// One lie told about `rp`, chosen by `kind`, sized by `value`, in piece `at` (mod the count).
fn lie(rp: &mut RankPlan, saved: &Saved, kind: u8, value: u64, at: usize) {
    let meta_files: Vec<String> = saved.meta.files().iter().map(|f| f.path.clone()).collect();
    if rp.pieces.is_empty() {
        return;
    }
    let n = rp.pieces.len();
    let piece = &mut rp.pieces[at % n];
    let delta = 1 + value % 17;
    match kind % 12 {
        // Another data file of the same checkpoint, under the plan's file index.
        0 => {
            let f = piece.read.as_ref().unwrap().file as usize;
            let other = &meta_files[value as usize % meta_files.len()];
            rp.files[f].clone_from(other);
        }
        // Another entry of the plan's file list.
        1 => {
            let read = piece.read.as_mut().unwrap();
            read.file = (read.file + 1 + value as u32) % rp.files.len() as u32;
        }
        2 => piece.read.as_mut().unwrap().runs.src_offset += delta,
        3 => {
            let runs = &mut piece.read.as_mut().unwrap().runs;
            runs.src_offset = runs.src_offset.saturating_sub(delta);
        }
        4 => {
            if let Some(s) = piece.read.as_mut().unwrap().runs.src_strides.first_mut() {
                *s += delta;
            }
        }
        // Another box of the tensor of the same size.
        5 => {
            let d = value as usize % piece.region.ndim().max(1);
            if let Some(o) = piece.region.offsets.get_mut(d) {
                *o = o.wrapping_add(delta) % 8;
            }
        }
        6 => piece.tensor = (piece.tensor + 1 + value as u32) % rp.tensors.len() as u32,
        7 => {
            let t = piece.tensor as usize;
            let dtypes = DType::ALL;
            rp.tensors[t].dtype = dtypes[value as usize % dtypes.len()];
        }
        8 => {
            if let Some(place) = piece.places.first_mut() {
                place.runs.dst_offset += delta;
            }
        }
        9 => {
            let dests = rp.destinations.len() as u32;
            if let Some(place) = piece.places.first_mut() {
                place.destination = (place.destination + 1 + value as u32) % dests;
            }
        }
        10 => {
            let d = piece.places.first().map_or(0, |p| p.destination as usize);
            match &mut rp.destinations[d].target {
                Target::Box(b) => {
                    if let Some(o) = b.offsets.first_mut() {
                        *o = o.wrapping_add(delta) % 8;
                    }
                }
                Target::Flat { start, end } => {
                    let s = *start % delta;
                    *end -= *start - s;
                    *start = s;
                }
            }
        }
        _ => {
            let t = piece.tensor as usize;
            if let Some(s) = rp.tensors[t].shape.first_mut() {
                *s += delta;
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn lying_plans_are_refused_or_load_the_honest_bytes(
        specs in prop::collection::vec(tensor_strategy(), 1..=3),
        saved_mesh in prop::collection::vec(1u32..=3, 1..=2),
        choices in prop::collection::vec(0u32..30, 1..=8),
        picks in prop::collection::vec((0usize..3, any::<bool>(), prop::collection::vec(0u64..8, 6)), 1..=6),
        lies in prop::collection::vec((any::<u8>(), any::<u64>(), any::<usize>()), 1..=3),
    ) {
        let tensors = tensors_from(specs);
        let saved = save_layout(tensors.clone(), &layout_for(&saved_mesh, &tensors, &choices));
        let requests: Vec<ExplicitRequest> = picks
            .iter()
            .map(|(t, flat, nums)| explicit_request(&tensors[t % tensors.len()], *flat, nums))
            .collect();
        let requests: RequestSet = ExplicitRequests { ranks: vec![requests] }.resolve(&tensors).unwrap();
        // One rank reads and places every piece, so each plan can be carried out alone.
        let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
        let honest = plan.rank_plan(0).unwrap();
        honest.check_against(&saved.meta).unwrap();
        let expected = run_alone(&honest, &saved).unwrap();

        let mut lying = honest.clone();
        for (kind, value, at) in lies {
            lie(&mut lying, &saved, kind, value, at);
        }
        match lying.check_against(&saved.meta) {
            Ok(()) => prop_assert_eq!(
                run_alone(&lying, &saved),
                Some(expected),
                "a lying plan passed the check and loads other bytes: {:?}",
                lying
            ),
            Err(e) => {
                prop_assert!(matches!(e, PlanError::DisagreesWithCheckpoint { rank: 0, .. }), "{e}");
            }
        }
    }
}

#[test]
fn a_plan_reading_another_file_of_the_checkpoint_is_refused_naming_the_piece() {
    let tensors = tensors_from(vec![(vec![4, 6], DType::F32)]);
    // Two ranks saved row halves: two data files holding boxes of the same size.
    let saved = save_layout(tensors.clone(), &layout_for(&[2], &tensors, &[1]));
    assert_eq!(saved.meta.files().len(), 2);
    let requests = layout_for(&[1], &tensors, &[0]).resolve(&tensors).unwrap();
    let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
    let mut rp = plan.rank_plan(0).unwrap();
    rp.check_against(&saved.meta).unwrap();
    // What the campaign's lying server did: the same checkpoint, another file's name.
    rp.files.swap(0, 1);
    let error = rp.check_against(&saved.meta).unwrap_err().to_string();
    assert!(
        error.starts_with("rank 0: the plan disagrees with the checkpoint's own metadata: piece ")
            && error.contains("layers.0.weight")
            && error.contains("no saved box of the tensor holds it at the bytes the plan reads")
            && error.contains("nothing was read"),
        "{error}"
    );
}
