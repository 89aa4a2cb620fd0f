//! Joint checks: verifying a saved box that several ranks read in parts, without whole checksum
//! blocks. A column slice of a row-major box (Shard(1) of a Shard(0)-saved matrix) is one short
//! run per row; verified by the native format's block checksums every rank fetches every block
//! of every row: 4x the bytes at 4 ranks. But when the ranks' pieces of a box partition it (each
//! byte read by exactly one rank), the box's own crc32c can be checked from parts: crc32c is
//! affine over GF(2), so each reader folds the bytes it read into one 32-bit value (the crc of
//! the box with every other byte zero, less the crc of zeros) and the XOR of the readers' folds
//! gives the crc of the whole box. The loader exchanges the folds after reading; every rank that
//! holds bytes of the box (its *members*: readers and the ranks they pass pieces to) checks the
//! sum before it reports success.
//!
//! The planner only names the boxes and who takes part; it decides per saved chunk:
//! - the chunk has a checksum (crc32c, or a DCP blob's CRC-32) and is stored row-major (its
//!   bytes are one dense range);
//! - it is read per request (a storage-order slab is read whole rows at a time, where blocks
//!   cost nothing extra), by at least two ranks, none of its pieces read by every holder;
//! - its pieces partition it (pairwise disjoint, volumes summing to the chunk's), checked for
//!   chunks of at most [`MAX_PIECES`] pieces;
//! - at least one piece is not one contiguous run of the chunk (otherwise block checks cost at
//!   most a block at each end of each piece).

use tessera_metadata::CheckpointMeta;

use crate::read_order::{is_row_major, runs_of};
use crate::{Group, Piece};

/// Chunks split into more pieces than this are verified by blocks: the partition test is
/// quadratic in the pieces, and a box cut that finely is rarely a column slice.
pub const MAX_PIECES: usize = 256;

/// A saved box verified jointly (whole-plan form).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JointCheckPlan {
    /// Index into the checkpoint's chunks.
    pub chunk: u32,
    /// The pieces that partition it, ascending ids.
    pub pieces: Vec<u32>,
    /// Ranks reading them, ascending.
    pub readers: Vec<u32>,
    /// Ranks holding bytes of it (readers and every member of the pieces' groups), ascending.
    pub members: Vec<u32>,
}

/// The joint checks of a plan's pieces (see the module doc), in chunk order. `block_checksums`:
/// the checkpoint has checksum blocks, which verify whole rows and storage-order slabs cheaply;
/// without them (DCP) every partitioned box with a checksum is checked jointly, slabs and
/// single readers included, since nothing else can verify a part of it.
pub(crate) fn joint_checks(
    meta: &CheckpointMeta,
    pieces: &[Piece],
    groups: &[Group],
    block_checksums: bool,
) -> Vec<JointCheckPlan> {
    let chunks = meta.chunks();
    // Only pieces of boxes with a recorded checksum can take part (none in a metadata-only
    // checkpoint): filtered before the sort, which is the cost of this pass.
    let mut by_chunk: Vec<(u32, u32)> = pieces
        .iter()
        .enumerate()
        .filter(|(_, p)| chunks[p.chunk as usize].checksum().is_some())
        .map(|(i, p)| (p.chunk, i as u32))
        .collect();
    by_chunk.sort_unstable();
    let mut checks = Vec::new();
    for same in by_chunk.chunk_by(|a, b| a.0 == b.0) {
        let chunk_index = same[0].0;
        let chunk = &chunks[chunk_index as usize];
        let ids: Vec<u32> = same.iter().map(|&(_, i)| i).collect();
        let members_of = |i: u32| &groups[pieces[i as usize].group as usize].members;
        if chunk.checksum().is_none()
            || !(is_row_major(chunk) || !block_checksums && is_dense(chunk))
            || ids.len() < 2
            || ids.len() > MAX_PIECES
            || ids.iter().any(|&i| {
                let p = &pieces[i as usize];
                (block_checksums && p.slab.is_some())
                    || (p.read_by_holders && members_of(i).len() > 1)
            })
        {
            continue;
        }
        let mut readers: Vec<u32> = ids.iter().map(|&i| pieces[i as usize].reader).collect();
        readers.sort_unstable();
        readers.dedup();
        if block_checksums && readers.len() < 2 {
            continue;
        }
        let lengths = &chunk.region.lengths;
        let strided = !block_checksums
            || ids
                .iter()
                .any(|&i| runs_of(lengths, &pieces[i as usize].region.lengths).1 > 1);
        if !strided || !partitions(chunk.region.numel(), pieces, &ids) {
            continue;
        }
        let mut members: Vec<u32> = ids
            .iter()
            .flat_map(|&i| members_of(i).iter().copied())
            .chain(readers.iter().copied())
            .collect();
        members.sort_unstable();
        members.dedup();
        checks.push(JointCheckPlan {
            chunk: chunk_index,
            pieces: ids,
            readers,
            members,
        });
    }
    checks
}

/// True when a chunk's elements lie each once in one dense range of its file in some order of
/// its dims (a transposed weight DCP saved as it was): its pieces then partition its bytes as
/// they partition the box, and the readers' folds over file ranges add up to the range's crc.
fn is_dense(chunk: &tessera_metadata::SavedChunk) -> bool {
    let Some(strides) = &chunk.bytes.strides else {
        return true;
    };
    let lengths = &chunk.region.lengths;
    let mut dims: Vec<(u64, u64)> = strides
        .iter()
        .zip(lengths)
        .filter(|(_, len)| **len > 1)
        .map(|(s, l)| (*s, *l))
        .collect();
    dims.sort_unstable_by_key(|d| std::cmp::Reverse(d.0));
    let mut expect = 1u64;
    for &(stride, len) in dims.iter().rev() {
        if stride != expect {
            return false;
        }
        expect = expect.saturating_mul(len);
    }
    true
}

/// True when the pieces `ids` (all inside one chunk of `numel` elements) are pairwise disjoint
/// and their volumes add up to the chunk's: every element in exactly one of them.
fn partitions(numel: u64, pieces: &[Piece], ids: &[u32]) -> bool {
    let total: u64 = ids.iter().map(|&i| pieces[i as usize].region.numel()).sum();
    if total != numel {
        return false;
    }
    ids.iter().enumerate().all(|(k, &a)| {
        ids[k + 1..].iter().all(|&b| {
            !pieces[a as usize]
                .region
                .overlaps(&pieces[b as usize].region)
        })
    })
}
