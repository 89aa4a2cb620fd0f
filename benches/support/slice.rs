//! The baselines' last step: a piece sliced out of a whole saved chunk held in memory, straight
//! into each of the rank's destinations it lands in (shared by the naive and whole-blob readers).

use tessera_loader::place::copy_runs;
use tessera_metadata::row_major_strides;
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
