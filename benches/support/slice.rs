//! The baselines' last step: a piece sliced out of a whole saved chunk held in memory, straight
//! into each of the rank's destinations it lands in, and the grouping of a rank's pieces by
//! chunk (shared by the naive and whole-blob readers).

use std::collections::BTreeMap;

use tessera_loader::exchange::place::copy_runs;
use tessera_metadata::{CheckpointMeta, row_major_strides};
use tessera_planner::{RankPiece, RankPlan, Side, StridedRuns, Target};

/// Copies `piece` from `chunk` (the piece's first element at byte `origin`, element strides
/// `chunk_strides`) into `buffers`.
pub fn place_from_chunk(
    plan: &RankPlan,
    piece: &RankPiece,
    chunk: &[u8],
    origin: u64,
    chunk_strides: &[u64],
    buffers: &mut [Vec<u8>],
) {
    let esize = plan.tensors[piece.tensor as usize].dtype.size();
    for place in &piece.places {
        let Target::Box(b) = &plan.destinations[place.destination as usize].target else {
            unreachable!("layouts make boxes")
        };
        let dest_strides = row_major_strides(&b.lengths);
        let rel = b.relative_offsets(&piece.region);
        let dest_origin = rel
            .iter()
            .zip(&dest_strides)
            .map(|(o, s)| o * s)
            .sum::<u64>()
            * esize;
        let runs = StridedRuns::new(
            esize,
            &piece.region.lengths,
            Side {
                origin,
                strides: chunk_strides,
            },
            Side {
                origin: dest_origin,
                strides: &dest_strides,
            },
        );
        copy_runs(&runs, chunk, &mut buffers[place.destination as usize]);
    }
}

/// The rank's pieces (indexes into `plan.pieces`) grouped by the saved chunk (index into
/// `meta.chunks()`) they come from, in chunk order: what a whole-chunk reader fetches, once each.
pub fn pieces_by_chunk(meta: &CheckpointMeta, plan: &RankPlan) -> BTreeMap<usize, Vec<usize>> {
    let mut by_chunk: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for (i, p) in plan.pieces.iter().enumerate() {
        let Some(t) = meta.tensor_index(&plan.tensors[p.tensor as usize].fqn) else {
            unreachable!("rank plans name tensors of the checkpoint")
        };
        let first = meta.first_chunk_index(t);
        for (c, chunk) in meta.chunks_of(t).iter().enumerate() {
            if chunk.region.overlaps(&p.region) {
                by_chunk.entry(first + c).or_default().push(i);
            }
        }
    }
    by_chunk
}
