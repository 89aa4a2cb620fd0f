//! What planning will hold in memory, estimated from counts before any per-rank table exists,
//! so that a service can refuse a request that would exhaust it (a 2^20-rank mesh over a few
//! hundred tensors is 10^8 requests, tens of GB) in milliseconds instead of aborting on
//! allocation. The model follows what [`plan`](crate::plan()) and [`Layout::resolve`] allocate:
//! per (rank, tensor) request a `Request` and a `Destination` plus a few ids, per piece a
//! `Piece` and its indexes, per group its members (twice: the group and its lookup key), per
//! rank a handful of vectors. `tests/memory.rs` measures the real peak with a counting
//! allocator and checks the estimate stays above it and within 1.5x of it.

use std::collections::HashMap;
use std::mem::size_of;

use rustc_hash::FxHashSet;
use tessera_metadata::{BoxIndex, CheckpointMeta, SavedChunk, TensorBox, TensorMeta};

use crate::layout::StageResolver;
use crate::plan::{LocalPiece, target_boxes};
use crate::{
    Destination, Group, Layout, Piece, Placement, PlanError, PlanOptions, Request, RequestSet,
    Target,
};

/// Most target intervals enumerated per tensor dimension to count pieces exactly; past it the
/// count falls back to an upper bound (n + 1 intervals of a dim of length n).
const ENUMERATE_CAP: u64 = 1 << 16;

/// The estimated size of a plan computation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlanEstimate {
    /// Ranks.
    pub ranks: u64,
    /// (rank, tensor) requests over all ranks.
    pub requests: u64,
    /// Distinct targets (identical requests of replicas folded).
    pub targets: u64,
    /// Pieces (an upper bound: cells of the grid formed by target and chunk boundaries).
    pub pieces: u64,
    /// Groups of ranks (an upper bound).
    pub groups: u64,
    /// Peak heap bytes while resolving and planning.
    pub bytes: u64,
}

impl std::fmt::Display for PlanEstimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "about {} bytes ({:.2} GiB) for {} ranks, {} requests, {} distinct targets, {} pieces, {} groups",
            self.bytes,
            self.bytes as f64 / f64::from(1u32 << 30),
            self.ranks,
            self.requests,
            self.targets,
            self.pieces,
            self.groups
        )
    }
}

impl PlanEstimate {
    /// This estimate, or [`PlanError::TooLarge`] when it is over `limit` bytes: the bound a
    /// front end puts on one plan computation, checked before resolving a layout (which alone
    /// allocates a request per rank and tensor). The one check of every front end (the server's
    /// 422 `plan_too_large`, `tessera plan`), so that what one refuses the other refuses too.
    pub fn within(self, limit: u64) -> Result<PlanEstimate, PlanError> {
        if self.bytes > limit {
            return Err(PlanError::TooLarge {
                estimate: Box::new(self),
                limit,
            });
        }
        Ok(self)
    }
}

/// What decides a tensor's groups under a layout: its stage (mesh dim, stage) if any and the
/// mesh dims that shard it. Tensors with the same signature share their groups.
type GroupSignature = (Option<(usize, u32)>, Vec<usize>);

/// The counts the memory model is written in.
#[derive(Default)]
struct Counts {
    world: u64,
    /// Tensors of the checkpoint (the length of the per-tensor request lists).
    all_tensors: u64,
    /// Tensors with at least one request.
    tensors: u64,
    requests: u64,
    /// Σ over ranks of the capacity of the rank's request vector.
    request_slots: u64,
    /// Σ over tensors of the capacity of its (rank, destination) list.
    asked_slots: u64,
    /// Bytes of the per-rank mesh coordinates `Layout::resolve` keeps while it runs.
    coords: u64,
    targets: u64,
    pieces: u64,
    /// Σ over tensors of the capacity of its list of pieces found (grown by push).
    piece_slots: u64,
    groups: u64,
    group_members: u64,
    /// Σ over groups of more than one member of their size (per-rank group lists).
    exchange_members: u64,
    /// Largest (holders, targets) of one tensor: a worker's transient maps.
    max_tensor: (u64, u64),
    /// Heap bytes of request boxes with more than four dims (their dims spill from the inline
    /// storage); each is held twice, as a request and as a destination.
    spilled_requests: u64,
    /// The same for pieces.
    spilled_pieces: u64,
}

/// Capacity of a vector grown by `push` to `n` elements (Rust doubles, starting at 4).
fn grown(n: u64) -> u64 {
    if n == 0 {
        0
    } else {
        n.max(4).next_power_of_two()
    }
}

/// Heap bytes of a box's dims: none up to four dims, two spilled arrays past that.
pub(crate) fn spilled_bytes(ndim: usize) -> u64 {
    if ndim > 4 { 16 * ndim as u64 } else { 0 }
}

impl Counts {
    fn estimate(&self) -> PlanEstimate {
        PlanEstimate {
            ranks: self.world,
            requests: self.requests,
            targets: self.targets,
            pieces: self.pieces,
            groups: self.groups,
            bytes: self.peak_bytes(),
        }
    }

    /// Peak heap bytes: the requests, then the largest of the planner's phases on top of what
    /// stays alive through all of them.
    fn peak_bytes(&self) -> u64 {
        let v = size_of::<Vec<u32>>() as u64;
        let w = self.world;
        let requests =
            v * w + self.request_slots * size_of::<Request>() as u64 + self.spilled_requests;
        let resolve = requests + self.coords;
        // Alive from step 1 to the end: destinations (exact capacity) and per-tensor lists.
        let base = requests
            + v * w
            + self.requests * size_of::<Destination>() as u64
            + self.spilled_requests
            + v * self.all_tensors
            + 8 * self.asked_slots;
        // A worker's transient maps over one tensor, for up to 8 workers.
        let (holders, targets) = self.max_tensor;
        let worker = 4 * holders + 2 * 40 * grown(targets) + 24 * targets;
        let workers = worker * self.tensors.clamp(1, 8);
        // Step 2: every tensor's distinct targets, holders and pieces, kept until step 3.
        let found = 8 * self.requests
            + 20 * self.targets
            + 4 * self.tensors
            + size_of::<LocalPiece>() as u64 * self.piece_slots
            + self.spilled_pieces;
        let step2 = base + found + workers;
        // Step 3 begins with the per-destination target ids allocated while `found` is whole.
        let dest_targets = v * w + 4 * self.requests;
        let step3_start = base + found + dest_targets;
        // Step 3: per-destination target ids, pieces, groups (members twice: the group and the
        // lookup key), the (target, piece) memberships and the CSR built from them.
        let groups = self.groups * (size_of::<Group>() as u64 + 2 * 33)
            + 8 * self.group_members
            + 33 * grown(self.groups * 8 / 7);
        let pieces = grown(self.pieces) * size_of::<Piece>() as u64 + self.spilled_pieces;
        // While the pieces vector doubles from C/2 to C both buffers are live, and the pieces
        // found for the tensors not yet numbered are still held (as are the memberships).
        let slots = grown(self.pieces);
        let growing = base
            + dest_targets
            + (size_of::<Piece>() as u64 + 8) * (slots + slots / 2)
            + self.pieces.saturating_sub(slots / 2) * size_of::<LocalPiece>() as u64
            + self.spilled_pieces
            + groups;
        let step3 = base
            + dest_targets
            + pieces
            + groups
            + 8 * slots
            + 8 * (self.targets + 1)
            + 4 * self.pieces;
        // Finish: per-piece sizes and readers, per-rank reads and group lists.
        let finish = base
            + dest_targets
            + pieces
            + groups
            + 4 * (self.targets + 1)
            + 4 * self.pieces
            + 8 * self.pieces
            + 8 * w
            + 2 * 4 * grown(self.pieces)
            + v * w
            + 4 * grown(self.pieces)
            + v * self.groups
            + 4 * self.pieces
            + v * w
            + 4 * grown(self.exchange_members);
        let peak = resolve
            .max(step2)
            .max(step3_start)
            .max(growing)
            .max(step3)
            .max(finish);
        // What the model leaves out (allocator rounding, small per-tensor scratch) is a few
        // percent in the measurements of tests/memory.rs: a tenth and a MiB on top covers it.
        peak + peak / 10 + (1 << 20)
    }
}

/// Distinct intervals a tensor dim of length `n` is cut into by nested `torch.chunk` splits
/// into `ks` parts each, and the starts of the non-empty ones (`None` past [`ENUMERATE_CAP`]).
fn shard_intervals(n: u64, ks: &[u64]) -> (u64, Option<Vec<u64>>) {
    let mut intervals: Vec<(u64, u64)> = vec![(0, n)];
    for &k in ks {
        if (intervals.len() as u64).saturating_mul(k) > ENUMERATE_CAP {
            let parts = ks.iter().fold(1u64, |a, &k| a.saturating_mul(k));
            return (parts.min(2 * n + 1), None);
        }
        let mut next = Vec::with_capacity(intervals.len() * k as usize);
        for &(s, l) in &intervals {
            let chunk = l.div_ceil(k);
            for c in 0..k {
                let start = (c * chunk).min(l);
                let end = ((c + 1) * chunk).min(l);
                next.push((s + start, end - start));
            }
        }
        next.sort_unstable();
        next.dedup();
        intervals = next;
    }
    let starts = intervals
        .iter()
        .filter(|(_, l)| *l > 0)
        .map(|(s, _)| *s)
        .collect();
    (intervals.len() as u64, Some(starts))
}

impl Layout {
    /// Estimates the memory of resolving this layout against `meta` and planning it, in time
    /// linear in tensors, chunks and ranks and without per-(rank, tensor) tables. Fails like
    /// [`Layout::resolve`] on a layout that does not fit the tensors.
    pub fn estimate(
        &self,
        meta: &CheckpointMeta,
        options: &PlanOptions,
    ) -> Result<PlanEstimate, PlanError> {
        let placements = self.check()?;
        let tensors = meta.tensors();
        let stage_of = StageResolver::new(self, tensors)?;
        let world = self
            .mesh
            .iter()
            .fold(1u64, |a, d| a.saturating_mul(u64::from(d.size)));
        let mut c = Counts {
            world,
            all_tensors: tensors.len() as u64,
            coords: world * (size_of::<Vec<u32>>() + 4 * self.mesh.len()) as u64,
            ..Counts::default()
        };
        // Tensors per (stage mesh dim, stage), for the per-rank request counts; and the group
        // signatures seen: ranks split by the same mesh dims on the same stage form the same
        // groups whatever the tensor.
        let mut unstaged = 0u64;
        let mut staged: HashMap<(usize, u32), u64> = HashMap::new();
        let mut signatures: FxHashSet<GroupSignature> = FxHashSet::default();
        for (t, tensor) in tensors.iter().enumerate() {
            let rule_placements = self.placements_of(tensor, &placements)?;
            let ndim = tensor.shape.len();
            let chunks = meta.chunks_of(t as u32);
            let stage = match rule_placements.iter().position(|p| *p == Placement::Stage) {
                Some(i) => Some((
                    i,
                    stage_of.stage(tensor, self.stage_dim_size(rule_placements))?,
                )),
                None => None,
            };
            let holders = match stage {
                Some((i, _)) => world / u64::from(self.mesh[i].size),
                None => world,
            };
            match stage {
                Some(key) => *staged.entry(key).or_default() += 1,
                None => unstaged += 1,
            }
            let (distinct, nonempty, cells) = self.grid(tensor, rule_placements, chunks);
            let distinct = distinct.clamp(1, holders.max(1));
            let pieces = cells.min(nonempty.saturating_mul(chunks.len() as u64));
            let (targets, pieces) = if options.dedup {
                (distinct, pieces)
            } else {
                (holders, pieces.saturating_mul(holders.div_ceil(distinct)))
            };
            if options.dedup {
                let split: Vec<usize> = rule_placements
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| matches!(p, Placement::Shard(_)))
                    .map(|(i, _)| i)
                    .collect();
                let groups: u64 = split
                    .iter()
                    .map(|&i| u64::from(self.mesh[i].size))
                    .product::<u64>()
                    .min(holders);
                if signatures.insert((stage, split)) {
                    c.groups += groups;
                    c.group_members += holders;
                    if holders > groups {
                        c.exchange_members += holders;
                    }
                }
            }
            if holders > 0 {
                c.tensors += 1;
            }
            c.requests += holders;
            c.asked_slots += grown(holders);
            c.targets += targets;
            c.pieces += pieces;
            c.piece_slots += grown(pieces);
            c.max_tensor = (c.max_tensor.0.max(holders), c.max_tensor.1.max(targets));
            c.spilled_requests += spilled_bytes(ndim) * holders;
            c.spilled_pieces += spilled_bytes(ndim) * pieces;
        }
        if !options.dedup {
            // Every piece's group is its one reader: at most one group per rank.
            c.groups = world;
            c.group_members = world;
        }
        // Each rank's request vector grows by push to the number of tensors it holds.
        c.request_slots = self.request_slots(world, unstaged, staged);
        Ok(c.estimate())
    }

    /// A tensor's distinct targets, targets that hold elements and grid cells (the pieces the
    /// targets cut out of its saved chunks, at most), counted dim by dim: per dim, the shard
    /// intervals the placements split it into, and those cut again at the chunks' starts.
    fn grid(
        &self,
        tensor: &TensorMeta,
        rule_placements: &[Placement],
        chunks: &[SavedChunk],
    ) -> (u64, u64, u64) {
        let mut distinct = 1u64;
        let mut nonempty = 1u64;
        let mut cells = 1u64;
        for (d, &n) in tensor.shape.iter().enumerate() {
            let ks: Vec<u64> = rule_placements
                .iter()
                .zip(&self.mesh)
                .filter(|(p, _)| **p == Placement::Shard(d))
                .map(|(_, m)| u64::from(m.size))
                .collect();
            let (count, starts) = shard_intervals(n, &ks);
            let mut chunk_starts: Vec<u64> = chunks
                .iter()
                .filter(|c| !c.region.is_empty())
                .map(|c| c.region.offsets[d])
                .collect();
            chunk_starts.sort_unstable();
            chunk_starts.dedup();
            let (nonempty_d, cells_d) = match starts {
                Some(mut starts) => {
                    let nonempty_d = starts.len() as u64;
                    starts.extend(chunk_starts);
                    starts.sort_unstable();
                    starts.dedup();
                    (nonempty_d, starts.len() as u64)
                }
                None => (
                    count.min(n),
                    (count.min(n) + chunk_starts.len() as u64).min(n),
                ),
            };
            distinct = distinct.saturating_mul(count);
            nonempty = nonempty.saturating_mul(nonempty_d);
            cells = cells.saturating_mul(cells_d);
        }
        (distinct, nonempty, cells)
    }

    /// The request slots of every rank's request vector, which grows by push to the number of
    /// tensors the rank holds: `unstaged` tensors held by every rank, and per (stage mesh dim,
    /// stage) the tensors only that stage's ranks hold.
    fn request_slots(&self, world: u64, unstaged: u64, staged: HashMap<(usize, u32), u64>) -> u64 {
        if staged.is_empty() {
            return world * grown(unstaged);
        }
        let strides: Vec<u64> = (0..self.mesh.len())
            .map(|i| {
                self.mesh[i + 1..]
                    .iter()
                    .map(|d| u64::from(d.size))
                    .product()
            })
            .collect();
        let staged: Vec<((usize, u32), u64)> = staged.into_iter().collect();
        (0..world)
            .map(|r| {
                let held = unstaged
                    + staged
                        .iter()
                        .filter(|((i, s), _)| {
                            (r / strides[*i]) % u64::from(self.mesh[*i].size) == u64::from(*s)
                        })
                        .map(|(_, n)| n)
                        .sum::<u64>();
                grown(held)
            })
            .sum()
    }
}

impl RequestSet {
    /// Estimates the memory of planning these (already resolved) requests against `meta`. Pieces
    /// are counted by querying each distinct target against the tensor's chunks; overlapping
    /// explicit requests are refined into more cells than that, which this does not count.
    pub fn estimate(&self, meta: &CheckpointMeta, options: &PlanOptions) -> PlanEstimate {
        let tensors = meta.tensors();
        let world = self.ranks.len() as u64;
        let mut c = Counts {
            world,
            all_tensors: tensors.len() as u64,
            ..Counts::default()
        };
        let mut by_tensor: Vec<Vec<&Target>> = vec![Vec::new(); tensors.len()];
        for rank in &self.ranks {
            c.requests += rank.len() as u64;
            c.request_slots += rank.capacity() as u64;
            for request in rank {
                if let Some(list) = by_tensor.get_mut(request.tensor as usize) {
                    list.push(&request.target);
                }
            }
        }
        let mut hits = Vec::new();
        for (t, asked) in by_tensor.iter().enumerate() {
            if asked.is_empty() {
                continue;
            }
            let tensor = &tensors[t];
            let chunks = meta.chunks_of(t as u32);
            let index = BoxIndex::build(chunks.iter().map(|c| &c.region).collect::<Vec<_>>());
            let distinct: Vec<&Target> = if options.dedup {
                let set: FxHashSet<&Target> = asked.iter().copied().collect();
                set.into_iter().collect()
            } else {
                asked.clone()
            };
            let mut pieces = 0u64;
            for target in &distinct {
                for sub in target_boxes(tensor, target) {
                    if sub.is_empty() {
                        continue;
                    }
                    hits.clear();
                    index.query(&sub, &mut hits);
                    pieces += hits
                        .iter()
                        .filter(|&&h| {
                            chunks[h as usize]
                                .region
                                .intersect(&sub)
                                .is_some_and(|r: TensorBox| !r.is_empty())
                        })
                        .count() as u64;
                }
            }
            let holders = asked.len() as u64;
            c.tensors += 1;
            c.asked_slots += grown(holders);
            c.targets += distinct.len() as u64;
            c.pieces += pieces;
            c.piece_slots += grown(pieces);
            c.max_tensor = (
                c.max_tensor.0.max(holders),
                c.max_tensor.1.max(distinct.len() as u64),
            );
            c.spilled_requests += spilled_bytes(tensor.shape.len()) * holders;
            c.spilled_pieces += spilled_bytes(tensor.shape.len()) * pieces;
        }
        // A group per distinct target at most, each holder in one.
        c.groups = c.targets.min(c.pieces).max(world.min(c.pieces));
        c.group_members = c.requests;
        c.exchange_members = c.requests;
        c.estimate()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_estimate_over_the_bound_is_refused_naming_both() {
        let estimate = PlanEstimate {
            ranks: 1 << 20,
            requests: 1 << 27,
            bytes: 40 << 30,
            ..PlanEstimate::default()
        };
        assert_eq!(estimate.clone().within(40 << 30), Ok(estimate.clone()));
        let Err(refused) = estimate.within(1 << 30) else {
            panic!("an estimate of 40 GiB passed a bound of 1 GiB");
        };
        let message = refused.to_string();
        assert!(
            message.starts_with(
                "planning this would take about 42949672960 bytes (40.00 GiB) for 1048576 ranks"
            ),
            "{message}"
        );
        assert!(
            message.ends_with("over the bound of 1073741824 bytes for one plan computation"),
            "{message}"
        );
    }
}
