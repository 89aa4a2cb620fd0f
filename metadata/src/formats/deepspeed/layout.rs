//! Where each parameter's elements lie in the data-parallel ranks' flat partitions, by the rules
//! DeepSpeed's own `zero_to_fp32.py` reconstructs with (pure arithmetic, no IO):
//!
//! ```text
//! ZeRO-1/2, one parameter group: parameters back to back in `param_shapes` order, the whole
//! buffer aligned to 2·W elements and split into W equal partitions; each rank saves its
//! partition without the alignment padding, so concatenating the saved partitions gives the
//! parameters back:
//!
//!   flat group   |p0 p0 p0 p0 p1 p1 p1|p1 p1 p2 p2 p2 p2 p3|p3 p3 p3 pad|
//!   saved         rank 0               rank 1               rank 2 (shorter)
//!
//! ZeRO-3: every parameter partitioned on its own into W slices of ceil(n/W) elements (the last
//! padded); a rank's flat groups are its slices of every parameter, in `param_shapes` order:
//!
//!   rank r       |p0[r·c0 ..] |p1[r·c1 ..] |p2[r·c2 ..] | ...   (sub-groups split this anywhere)
//! ```

/// A run of one parameter's flat elements that lies contiguously in one saved flat tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index of the parameter in the list given.
    pub param: usize,
    /// First flat element of the parameter this piece holds.
    pub start: u64,
    /// One past its last.
    pub end: u64,
    /// Data-parallel rank whose file holds it.
    pub rank: usize,
    /// Flat group (tensor) of that rank.
    pub group: usize,
    /// Element of that flat tensor where the piece starts.
    pub at: u64,
}

/// ZeRO-1/2: the pieces of one parameter group whose parameters have `numels` (in `param_shapes`
/// order) and whose ranks saved partitions of `saved` elements (rank order). Fails when the
/// partitions cannot hold the parameters (zero_to_fp32's own consistency check: the parameters'
/// total and the partitions' total agree once both are aligned to 2·W).
pub fn zero12_pieces(group: usize, numels: &[u64], saved: &[u64]) -> Result<Vec<Piece>, String> {
    let world = saved.len() as u64;
    let total = numels
        .iter()
        .try_fold(0u64, |a, &n| a.checked_add(n))
        .ok_or("the parameters' sizes overflow")?;
    let avail = saved
        .iter()
        .try_fold(0u64, |a, &n| a.checked_add(n))
        .ok_or("the partitions' sizes overflow")?;
    let align = |x: u64| -> Option<u64> {
        let to = 2 * world.max(1);
        x.div_ceil(to).checked_mul(to)
    };
    if total > avail || align(total) != align(avail) {
        return Err(format!(
            "param_shapes of group {group} add up to {total} elements, but the {world} saved partitions hold {avail} ({})",
            saved
                .iter()
                .map(u64::to_string)
                .collect::<Vec<_>>()
                .join(" + ")
        ));
    }
    let mut starts = Vec::with_capacity(saved.len());
    let mut at = 0u64;
    for &n in saved {
        starts.push(at);
        at += n;
    }
    let mut pieces = Vec::new();
    let mut offset = 0u64;
    for (param, &n) in numels.iter().enumerate() {
        let (a, b) = (offset, offset + n);
        for (rank, (&s, &len)) in starts.iter().zip(saved).enumerate() {
            let lo = a.max(s);
            let hi = b.min(s + len);
            if lo < hi {
                pieces.push(Piece {
                    param,
                    start: lo - a,
                    end: hi - a,
                    rank,
                    group,
                    at: lo - s,
                });
            }
        }
        offset = b;
    }
    Ok(pieces)
}

/// ZeRO-3: the pieces of every parameter (`numels` over all groups, in `param_shapes` order) in
/// the ranks' flat groups, whose element counts are `groups[rank]`. Fails when a rank's groups do
/// not hold exactly its slices of every parameter (zero_to_fp32's check).
pub fn zero3_pieces(numels: &[u64], groups: &[Vec<u64>]) -> Result<Vec<Piece>, String> {
    let world = groups.len() as u64;
    if world == 0 {
        return Err("no ranks".to_string());
    }
    let mut per_rank = 0u64;
    for &n in numels {
        per_rank = per_rank
            .checked_add(n.div_ceil(world))
            .ok_or("the parameters' sizes overflow")?;
    }
    for (rank, lens) in groups.iter().enumerate() {
        let held = lens
            .iter()
            .try_fold(0u64, |a, &n| a.checked_add(n))
            .ok_or("the flat groups' sizes overflow")?;
        if held != per_rank {
            return Err(format!(
                "rank {rank}'s fp32_flat_groups hold {held} elements, but its slices of the {} parameters in param_shapes take {per_rank}",
                numels.len()
            ));
        }
    }
    let mut pieces = Vec::new();
    let mut offset = 0u64;
    for (param, &n) in numels.iter().enumerate() {
        let slice = n.div_ceil(world);
        for (rank, lens) in groups.iter().enumerate() {
            let first = (rank as u64 * slice).min(n);
            let last = ((rank as u64 + 1) * slice).min(n);
            // Elements first..last of the parameter lie at offset.. of the rank's groups, which
            // may cross from one sub-group into the next.
            let (mut from, mut pos) = (first, offset);
            let mut group_start = 0u64;
            for (group, &len) in lens.iter().enumerate() {
                let group_end = group_start + len;
                if from < last && pos < group_end && pos >= group_start {
                    let take = (last - from).min(group_end - pos);
                    pieces.push(Piece {
                        param,
                        start: from,
                        end: from + take,
                        rank,
                        group,
                        at: pos - group_start,
                    });
                    from += take;
                    pos += take;
                }
                group_start = group_end;
            }
        }
        offset += slice;
    }
    Ok(pieces)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Every element of every parameter exactly once.
    fn covers(pieces: &[Piece], numels: &[u64]) {
        for (param, &n) in numels.iter().enumerate() {
            let mut runs: Vec<(u64, u64)> = pieces
                .iter()
                .filter(|p| p.param == param)
                .map(|p| (p.start, p.end))
                .collect();
            runs.sort();
            let mut at = 0;
            for (s, e) in runs {
                assert_eq!(s, at, "param {param}");
                at = e;
            }
            assert_eq!(at, n, "param {param}");
        }
    }

    #[test]
    fn zero2_fixture_layout_matches_its_param_slice_mappings() {
        // deepspeed_0.19.8_zero2_w2: 8 params, 2 ranks of 16560 elements.
        let numels = [6144, 10240, 160, 10240, 64, 64, 64, 6144];
        let pieces = zero12_pieces(0, &numels, &[16560, 16560]).unwrap();
        covers(&pieces, &numels);
        let l2: Vec<_> = pieces.iter().filter(|p| p.param == 3).collect();
        // param_slice_mappings: rank 0 l2.weight (16, 16544), rank 1 l2.weight (10224, 0).
        assert_eq!(
            (l2[0].rank, l2[0].end - l2[0].start, l2[0].at),
            (0, 16, 16544)
        );
        assert_eq!(
            (l2[1].rank, l2[1].end - l2[1].start, l2[1].at),
            (1, 10224, 0)
        );
    }

    #[test]
    fn zero2_unpadded_tail_partitions_and_empty_ranks() {
        // 7 elements over 4 ranks: aligned to 8, partitions of 2, the last saved with 1, then
        // padding only.
        let pieces = zero12_pieces(0, &[3, 4], &[2, 2, 2, 1]).unwrap();
        covers(&pieces, &[3, 4]);
        assert_eq!(
            pieces[1],
            Piece {
                param: 0,
                start: 2,
                end: 3,
                rank: 1,
                group: 0,
                at: 0
            }
        );
        // bf16 optimizer: partitions saved with their padding.
        let padded = zero12_pieces(0, &[3, 4], &[2, 2, 2, 2]).unwrap();
        assert_eq!(pieces, padded);
    }

    #[test]
    fn zero2_partitions_too_small_or_too_large_are_refused() {
        let err = zero12_pieces(1, &[10, 10], &[8, 8]).unwrap_err();
        assert!(
            err.contains("group 1 add up to 20 elements, but the 2 saved partitions hold 16"),
            "{err}"
        );
        assert!(zero12_pieces(0, &[4], &[8, 8]).is_err());
    }

    #[test]
    fn zero3_params_partitioned_one_by_one_across_sub_groups() {
        // 3 ranks; params of 7, 3, 1 elements: slices of 3, 1, 1 = 5 per rank, in sub-groups of
        // 4 and 1 (p0's slice then p1's in the first, p2's in the second).
        let numels = [7, 3, 1];
        let groups = vec![vec![4, 1]; 3];
        let pieces = zero3_pieces(&numels, &groups).unwrap();
        covers(&pieces, &numels);
        // Rank 2 holds p0[6..7] (then padding), p1[2..3], and nothing of p2.
        let rank2: Vec<_> = pieces.iter().filter(|p| p.rank == 2).copied().collect();
        assert_eq!(
            rank2,
            vec![
                Piece {
                    param: 0,
                    start: 6,
                    end: 7,
                    rank: 2,
                    group: 0,
                    at: 0
                },
                Piece {
                    param: 1,
                    start: 2,
                    end: 3,
                    rank: 2,
                    group: 0,
                    at: 3
                },
            ]
        );
        // A slice crossing a sub-group boundary is split in two pieces.
        let split = zero3_pieces(&[8], &[vec![3, 1], vec![3, 1]]).unwrap();
        covers(&split, &[8]);
        assert_eq!(split.len(), 4);
        assert_eq!((split[1].group, split[1].at, split[1].start), (1, 0, 3));
    }

    #[test]
    fn zero3_groups_of_the_wrong_size_are_refused() {
        let err = zero3_pieces(&[7], &[vec![4], vec![3]]).unwrap_err();
        assert!(
            err.contains("rank 1's fp32_flat_groups hold 3 elements"),
            "{err}"
        );
    }
}
