//! Property tests of flat-range saved chunks: checkpoints where some boxes are stored as flat
//! ranges of their row-major flattening (Megatron's distributed optimizer, ZeRO partitions), each
//! range modelled by `tessera_metadata::flat_range_chunks` as the boxes that tile it, mixed with
//! plain boxes, requested as boxes (layouts, with replicas) and as flat ranges (explicit
//! requests, some asked by several ranks). Every plan is executed on real bytes.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;

use std::sync::Arc;

use common::{
    Saved, check_summary, coords_of, element, explicit_request, flat_of, layout_for,
    plan_and_check, rank_plans, storage_options, tensors_from,
};
use proptest::prelude::*;
use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, SavedChunk, TensorBox, TensorMeta,
    flat_range_chunks, validate,
};
use tessera_planner::baseline::all_pairs_overlaps;
use tessera_planner::{
    ExplicitRequest, ExplicitRequests, PlanOptions, RequestSet, plan as make_plan,
};

/// A small deterministic generator (splitmix64), so one proptest seed drives every structural
/// choice of a checkpoint: the cuts, which boxes are flat, where each range lands.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// How one saved box of a tensor is stored.
#[derive(Debug)]
enum Stored {
    /// The box, row-major.
    Box(TensorBox),
    /// The box cut at these flat positions into ranges, each stored contiguously on its own.
    Flat(TensorBox, Vec<u64>),
}

/// Cuts `shape` into a grid of boxes (cuts in up to two dims), then stores each box either whole
/// or as 1 to 4 flat ranges at random cut points.
fn decompose(shape: &[u64], rng: &mut Rng) -> Vec<Stored> {
    let mut cuts: Vec<Vec<u64>> = shape.iter().map(|&n| vec![0, n]).collect();
    for _ in 0..2 {
        if shape.is_empty() {
            break;
        }
        let d = rng.below(shape.len() as u64) as usize;
        if shape[d] > 1 {
            cuts[d].push(1 + rng.below(shape[d] - 1));
        }
    }
    for c in &mut cuts {
        c.sort_unstable();
        c.dedup();
    }
    // Every combination of one interval per dim.
    let mut parents = vec![(Vec::new(), Vec::new())];
    for c in &cuts {
        let mut next = Vec::new();
        for (offsets, lengths) in &parents {
            for w in c.windows(2) {
                let (mut o, mut l): (Vec<u64>, Vec<u64>) = (offsets.clone(), lengths.clone());
                o.push(w[0]);
                l.push(w[1] - w[0]);
                next.push((o, l));
            }
        }
        parents = next;
    }
    parents
        .into_iter()
        .map(|(offsets, lengths)| {
            let parent = TensorBox::new(offsets, lengths);
            let numel = parent.numel();
            if numel == 0 || rng.below(3) == 0 {
                return Stored::Box(parent);
            }
            let mut points: Vec<u64> = (0..rng.below(4)).map(|_| rng.below(numel + 1)).collect();
            points.push(0);
            points.push(numel);
            points.sort_unstable();
            points.dedup();
            Stored::Flat(parent, points)
        })
        .collect()
}

/// A checkpoint of `tensors`, each decomposed by [`decompose`] and spread over `files` data files
/// with a few bytes of gap before each entry (so no offset is special). The bytes of a flat range
/// are generated element by element in the parent box's row-major order, independently of the
/// tiling that `flat_range_chunks` computes, so a wrong tile offset shows as wrong bytes.
fn save_mixed(tensors: Vec<TensorMeta>, files: u64, rng: &mut Rng) -> (Saved, usize) {
    let mut datas: Vec<Vec<u8>> = vec![Vec::new(); files as usize];
    let mut chunks = Vec::new();
    let mut flat_ranges = 0;
    for (t, tensor) in tensors.iter().enumerate() {
        let t = t as u32;
        let esize = tensor.dtype.size();
        let value = |region: &TensorBox, i: u64| {
            element(t, flat_of(&coords_of(region, i), &tensor.shape), esize)
        };
        for stored in decompose(&tensor.shape, rng) {
            match stored {
                Stored::Box(region) => {
                    let file = rng.below(files) as usize;
                    let data = &mut datas[file];
                    data.resize(data.len() + rng.below(7) as usize, 0xAA);
                    let offset = data.len() as u64;
                    for i in 0..region.numel() {
                        data.extend(value(&region, i));
                    }
                    chunks.push(SavedChunk {
                        tensor: t,
                        bytes: ByteMeta {
                            file: file as u32,
                            offset,
                            length: region.numel() * esize,
                            strides: None,
                        },
                        region,
                        crc32c: None,
                        crc32: None,
                    });
                }
                Stored::Flat(parent, points) => {
                    for w in points.windows(2) {
                        let (start, end) = (w[0], w[1]);
                        let file = rng.below(files) as usize;
                        let data = &mut datas[file];
                        data.resize(data.len() + rng.below(7) as usize, 0xAA);
                        let offset = data.len() as u64;
                        for i in start..end {
                            data.extend(value(&parent, i));
                        }
                        let tiles =
                            flat_range_chunks(t, &parent, start, end, file as u32, offset, esize);
                        assert!(
                            tiles.len() < (2 * tensor.shape.len()).max(2),
                            "at most 2·ndim − 1 tiles"
                        );
                        chunks.extend(tiles);
                        flat_ranges += 1;
                    }
                }
            }
        }
    }
    let data_files = datas
        .iter()
        .enumerate()
        .map(|(f, data)| DataFile {
            path: format!("data/rank-{f:05}.bin"),
            size: Some(data.len() as u64),
            encoded: None,
        })
        .collect();
    let meta = CheckpointMeta::new(tensors, chunks, Vec::new(), data_files).unwrap();
    validate(&meta).unwrap();
    (
        Saved {
            meta: Arc::new(meta),
            files: datas,
        },
        flat_ranges,
    )
}

fn tensor_strategy() -> impl Strategy<Value = (Vec<u64>, DType)> {
    (
        prop::collection::vec(prop_oneof![12 => 1u64..8, 1 => Just(0u64)], 0..=4),
        prop::sample::select(vec![DType::Bf16, DType::F32, DType::I64, DType::U8]),
    )
}

/// The invariants every plan here must keep: nothing read twice inside a group, exactly the
/// distinct bytes needed read (amplification 1.00, but for small pieces of wide groups that every
/// holder reads, see `check_summary`). The destination bytes were already checked by
/// `plan_and_check`. (A rank that asks for overlapping parts itself needs those bytes twice but
/// receives them from nobody, so `bytes_needed` is only an upper bound of read + exchanged.)
fn check_exact(saved: &Saved, plan: &tessera_planner::Plan) {
    let plans = rank_plans(plan);
    check_summary(saved, plan, &plans);
    let s = plan.summary();
    assert!(s.bytes_needed + s.bytes_relayed >= s.bytes_read + s.bytes_exchanged);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn flat_chunks_into_layouts_are_exact(
        specs in prop::collection::vec(tensor_strategy(), 1..=4),
        seed in any::<u64>(),
        files in 1u64..=3,
        target_mesh in prop::collection::vec(1u32..=3, 1..=3),
        target_choices in prop::collection::vec(0u32..30, 1..=12),
    ) {
        let tensors = tensors_from(specs);
        let (saved, _) = save_mixed(tensors.clone(), files, &mut Rng(seed));
        let requests = layout_for(&target_mesh, &tensors, &target_choices).resolve(&tensors).unwrap();

        let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
        check_exact(&saved, &plan);
        // A layout's boxes partition each tensor per rank: what a rank needs it reads or receives.
        let s = plan.summary();
        prop_assert_eq!(s.bytes_needed + s.bytes_relayed, s.bytes_read + s.bytes_exchanged);

        // Read in storage order (slabs of a few bytes, so that these small tensors get several):
        // the same bytes land, each read once.
        let storage = storage_options(seed);
        let in_order = plan_and_check(&saved, &requests, &storage);
        check_exact(&saved, &in_order);
        let o = in_order.summary();
        prop_assert_eq!(o.bytes_needed + o.bytes_relayed, o.bytes_read + o.bytes_exchanged);
        prop_assert_eq!(o.unique_bytes_needed, s.unique_bytes_needed);

        // Without the layout's disjointness promise the plan is the same.
        let checked = RequestSet { disjoint: false, ..requests.clone() };
        let unchecked = make_plan(&saved.meta, &checked, &PlanOptions::default()).unwrap();
        prop_assert_eq!(unchecked.summary(), plan.summary());

        // Every rank reading for itself: still exact, and the index finds what all pairs find.
        let no_dedup = plan_and_check(&saved, &requests, &PlanOptions { dedup: false, ..PlanOptions::default() });
        let (pairs, pair_bytes) = all_pairs_overlaps(&saved.meta, &requests);
        prop_assert_eq!(no_dedup.pieces().len() as u64, pairs);
        prop_assert_eq!(no_dedup.summary().bytes_read, pair_bytes);
    }

    #[test]
    fn flat_chunks_into_explicit_requests_are_exact(
        specs in prop::collection::vec(tensor_strategy(), 1..=3),
        seed in any::<u64>(),
        files in 1u64..=3,
        picks in prop::collection::vec(
            (0usize..3, any::<bool>(), prop::collection::vec(0u64..4096, 8), 1usize..=2),
            1..=12,
        ),
        world in 1usize..=4,
    ) {
        let tensors = tensors_from(specs);
        let (saved, _) = save_mixed(tensors.clone(), files, &mut Rng(seed));
        let mut ranks: Vec<Vec<ExplicitRequest>> = vec![Vec::new(); world];
        for (i, (t, flat, nums, copies)) in picks.iter().enumerate() {
            let tensor = &tensors[t % tensors.len()];
            let request = explicit_request(tensor, *flat, nums);
            // Replicas: the same request asked by one or two ranks.
            for c in 0..*copies {
                ranks[(i + c) % world].push(request.clone());
            }
        }
        let requests = ExplicitRequests { ranks }.resolve(&tensors).unwrap();
        let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
        check_exact(&saved, &plan);
        let in_order = plan_and_check(&saved, &requests, &storage_options(seed));
        check_exact(&saved, &in_order);
    }

    /// The whole of every tensor, asked as one flat range per rank cutting the tensor at random
    /// points (ZeRO-style partitions of a checkpoint whose chunks are flat ranges elsewhere).
    #[test]
    fn flat_chunks_into_flat_partitions_are_exact(
        specs in prop::collection::vec(tensor_strategy(), 1..=3),
        seed in any::<u64>(),
        world in 1usize..=4,
    ) {
        let tensors = tensors_from(specs);
        let mut rng = Rng(seed);
        let (saved, _) = save_mixed(tensors.clone(), 2, &mut rng);
        let mut ranks: Vec<Vec<ExplicitRequest>> = vec![Vec::new(); world];
        for tensor in &tensors {
            let n = tensor.numel();
            let mut points: Vec<u64> = (1..world).map(|_| rng.below(n + 1)).collect();
            points.push(0);
            points.push(n);
            points.sort_unstable();
            for (r, w) in points.windows(2).enumerate() {
                ranks[r].push(ExplicitRequest::Flat { fqn: tensor.fqn.clone(), flat: [w[0], w[1]] });
            }
        }
        let requests = ExplicitRequests { ranks }.resolve(&tensors).unwrap();
        let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
        check_exact(&saved, &plan);
        let s = plan.summary();
        let total: u64 = tensors.iter().map(TensorMeta::nbytes).sum();
        prop_assert_eq!(s.bytes_read, total);
        prop_assert_eq!(s.bytes_exchanged, 0);
    }
}

/// Megatron's distributed optimizer on a [6, 10] tensor: TP2 over rows (two [3, 10] boxes), each
/// TP-local box split over DP3 into flat ranges of 10 elements, except that the second box is cut
/// unevenly (12 / 12 / 6) so ranges start mid-row. Loaded into TP3 over columns with DP2 replicas.
#[test]
fn megatron_flat_optimizer_tp2_dp3_to_tp3_dp2() {
    let tensor = TensorMeta::new("layers.0.exp_avg", DType::F32, vec![6, 10]);
    let tensors = vec![tensor.clone()];
    let mut data = Vec::new();
    let mut chunks = Vec::new();
    let mut ranges = 0;
    for (parent, points) in [
        (TensorBox::new(vec![0, 0], vec![3, 10]), vec![0, 10, 20, 30]),
        (TensorBox::new(vec![3, 0], vec![3, 10]), vec![0, 12, 24, 30]),
    ] {
        for w in points.windows(2) {
            let offset = data.len() as u64;
            for i in w[0]..w[1] {
                data.extend(element(
                    0,
                    flat_of(&coords_of(&parent, i), &tensor.shape),
                    4,
                ));
            }
            chunks.extend(flat_range_chunks(0, &parent, w[0], w[1], 0, offset, 4));
            ranges += 1;
        }
    }
    assert_eq!(ranges, 6);
    // The first box's ranges are whole rows (a box each); the second's 12 / 12 / 6 cut rows:
    // row + 2 columns, 8 columns + 4 columns, 6 columns.
    assert_eq!(chunks.len(), 3 + 5);
    let meta = CheckpointMeta::new(
        tensors.clone(),
        chunks,
        Vec::new(),
        vec![DataFile {
            path: "data/rank-00000.bin".to_string(),
            size: Some(data.len() as u64),
            encoded: None,
        }],
    )
    .unwrap();
    validate(&meta).unwrap();
    let saved = Saved {
        meta: Arc::new(meta),
        files: vec![data],
    };
    let layout: tessera_planner::Layout = serde_json::from_value(serde_json::json!({
        "mesh": [{"name": "dp", "size": 2}, {"name": "tp", "size": 3}],
        "rules": [{"match": "*", "placements": ["replicate", "shard(1)"]}]
    }))
    .unwrap();
    let requests = layout.resolve(&tensors).unwrap();
    let plan = plan_and_check(&saved, &requests, &PlanOptions::default());
    check_exact(&saved, &plan);
    let s = plan.summary();
    assert_eq!(s.bytes_read, 6 * 10 * 4);
    // Each tp column block is needed by both dp replicas: read by one, sent to the other.
    assert_eq!(s.bytes_exchanged, 6 * 10 * 4);
}
