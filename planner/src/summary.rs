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
    /// Groups that exchange something (rings of more than one rank).
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
    /// Most ring rounds of any group that exchanges something (m − 1 for m members).
    pub max_rounds: u64,
    /// Of `bytes_read`, bytes read by a storage-order slab's reader that does not need them and
    /// passes them on (also counted in `bytes_exchanged`).
    #[serde(default)]
    pub bytes_relayed: u64,
    /// Storage-order slabs (runs of whole saved rows read in file order by one rank).
    #[serde(default)]
    pub slabs: u64,
    /// Small pieces of wide groups read by every rank that needs them instead of exchanged.
    #[serde(default)]
    pub holder_read_pieces: u64,
    /// Of `bytes_read`, bytes read from copies outside storage (a node's memory tier,
    /// [`crate::ReadSources`]); the rest comes from storage.
    #[serde(default)]
    pub bytes_read_from_tier: u64,
    /// The plan was not made for this checkpoint but replayed: made for another one of the same
    /// layout and bound to this one ([`crate::Plan::rebind`]), its planning skipped.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub replayed: bool,
}

impl PlanSummary {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn compute(
        tensors: &[TensorMeta],
        destinations: &[Vec<Destination>],
        pieces: &[Piece],
        piece_bytes: &[u64],
        groups: &[Group],
        group_pieces: &[Vec<u32>],
        load: &[u64],
        unique_bytes_needed: u64,
        bytes_relayed: u64,
        slabs: u32,
    ) -> PlanSummary {
        let bytes_needed = destinations
            .iter()
            .flatten()
            .map(|d| d.target.numel() * tensors[d.tensor as usize].dtype.size())
            .sum();
        let (mut bytes_read, mut bytes_exchanged, mut holder_read_pieces) = (0u64, 0u64, 0u64);
        for (p, b) in pieces.iter().zip(piece_bytes) {
            let others = groups[p.group as usize].members.len() as u64 - 1;
            if p.read_by_holders {
                bytes_read += b * (others + 1);
                holder_read_pieces += 1;
            } else {
                bytes_read += b;
                bytes_exchanged += b * others;
            }
        }
        let ranks = destinations.len() as u32;
        PlanSummary {
            replayed: false,
            ranks,
            destinations: destinations.iter().map(|d| d.len() as u64).sum(),
            pieces: pieces.len() as u64,
            exchange_groups: group_pieces.iter().filter(|g| !g.is_empty()).count() as u64,
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
                .zip(group_pieces)
                .filter(|(_, exchanged)| !exchanged.is_empty())
                .map(|(g, _)| g.members.len() as u64 - 1)
                .max()
                .unwrap_or(0),
            bytes_relayed,
            slabs: u64::from(slabs),
            holder_read_pieces,
            bytes_read_from_tier: 0,
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
