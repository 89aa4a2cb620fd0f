//! Plan totals: what the cluster needs, reads and exchanges.

use serde::{Deserialize, Serialize};
use tessera_metadata::{TensorBox, TensorMeta};

use crate::{Destination, Group, Piece};

/// Totals of a whole-cluster plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanSummary {
    /// Ranks.
    pub ranks: u32,
    /// Destination buffers over all ranks.
    pub destinations: u64,
    /// Pieces (reads from storage).
    pub pieces: u64,
    /// Groups of more than one rank (exchange rings).
    pub exchange_groups: u64,
    /// Σ over ranks of the bytes each rank ends up with (replicas counted per rank).
    pub bytes_needed: u64,
    /// Distinct bytes needed by the cluster (replicas counted once).
    pub unique_bytes_needed: u64,
    /// Bytes read from storage.
    pub bytes_read: u64,
    /// `bytes_read / unique_bytes_needed` (1.0 when nothing is needed).
    pub read_amplification: f64,
    /// Bytes sent between ranks.
    pub bytes_exchanged: u64,
    /// Most bytes one rank reads.
    pub max_read_per_rank: u64,
    /// Mean bytes read per rank.
    pub mean_read_per_rank: f64,
    /// Most ring rounds of any group.
    pub max_rounds: u64,
}

impl PlanSummary {
    pub(crate) fn compute(
        tensors: &[TensorMeta],
        destinations: &[Vec<Destination>],
        pieces: &[Piece],
        piece_bytes: &[u64],
        groups: &[Group],
        load: &[u64],
        unique_bytes_needed: u64,
    ) -> PlanSummary {
        let bytes_needed = destinations
            .iter()
            .flatten()
            .map(|d| d.target.numel() * tensors[d.tensor as usize].dtype.size())
            .sum();
        let bytes_read: u64 = piece_bytes.iter().sum();
        let bytes_exchanged = pieces
            .iter()
            .zip(piece_bytes)
            .map(|(p, b)| b * (groups[p.group as usize].members.len() as u64 - 1))
            .sum();
        let ranks = destinations.len() as u32;
        PlanSummary {
            ranks,
            destinations: destinations.iter().map(|d| d.len() as u64).sum(),
            pieces: pieces.len() as u64,
            exchange_groups: groups.iter().filter(|g| g.members.len() > 1).count() as u64,
            bytes_needed,
            unique_bytes_needed,
            bytes_read,
            read_amplification: if unique_bytes_needed == 0 {
                1.0
            } else {
                bytes_read as f64 / unique_bytes_needed as f64
            },
            bytes_exchanged,
            max_read_per_rank: load.iter().copied().max().unwrap_or(0),
            mean_read_per_rank: if ranks == 0 {
                0.0
            } else {
                bytes_read as f64 / f64::from(ranks)
            },
            max_rounds: groups
                .iter()
                .map(|g| g.members.len() as u64 - 1)
                .max()
                .unwrap_or(0),
        }
    }
}

/// Elements covered by the union of `boxes` (all of one tensor): a sweep over dim 0 that
/// recurses into the boxes active in each slab.
pub(crate) fn union_volume(boxes: &[&TensorBox]) -> u64 {
    let live: Vec<&TensorBox> = boxes.iter().copied().filter(|b| !b.is_empty()).collect();
    union_rec(&live, 0)
}

fn union_rec(boxes: &[&TensorBox], dim: usize) -> u64 {
    if boxes.is_empty() {
        return 0;
    }
    if dim == boxes[0].ndim() {
        return 1;
    }
    let mut cuts: Vec<u64> = boxes
        .iter()
        .flat_map(|b| [b.offsets[dim], b.end(dim)])
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    let mut total = 0;
    for w in cuts.windows(2) {
        let (lo, hi) = (w[0], w[1]);
        let active: Vec<&TensorBox> = boxes
            .iter()
            .copied()
            .filter(|b| b.offsets[dim] <= lo && b.end(dim) >= hi)
            .collect();
        total += (hi - lo) * union_rec(&active, dim + 1);
    }
    total
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn union_volume_counts_overlaps_once() {
        let a = TensorBox::new(vec![0, 0], vec![4, 4]);
        let b = TensorBox::new(vec![2, 2], vec![4, 4]);
        assert_eq!(union_volume(&[&a, &b]), 28);
        assert_eq!(union_volume(&[&a, &a]), 16);
        assert_eq!(union_volume(&[&TensorBox::whole(&[])]), 1);
    }
}
