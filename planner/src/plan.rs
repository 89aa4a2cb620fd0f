//! Whole-cluster load planning: intersect every rank's requests with the saved chunks, cut the
//! overlaps into pieces, read each piece once per group of ranks that need it (worst-fit by
//! bytes), and schedule the ring exchange that hands it to the rest of the group.

use std::borrow::Cow;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use rustc_hash::FxHashMap;

use tessera_metadata::{BoxIndex, CheckpointMeta, Dims, TensorBox, TensorMeta};

use crate::joint::{JointCheckPlan, joint_checks};
use crate::read_order::{
    DEFAULT_SLAB_ALIGNMENT, DEFAULT_SLAB_BYTES, LOCAL_REQUEST_COST_BYTES, LOCAL_RUN_COST_BYTES,
    MIN_CHUNK_BLOCKS, PieceCost, REQUEST_COST_BYTES, ReadOrder, RequestPricing, is_row_major,
    runs_of, slab_cuts, storage_order_pays,
};
use crate::request::{check_target, flat_range_to_boxes};
use crate::summary::{PlanSummary, union_volume};
use crate::{PlanError, RankPlan, ReadSources, RequestSet, Target};

/// Options of [`plan`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanOptions {
    /// Read a piece needed by several ranks once and exchange it (true), or have every rank read
    /// everything it needs itself (false; no exchange, more storage traffic).
    pub dedup: bool,
    /// Read a saved chunk per request or in storage order (slabs of whole rows, relayed through
    /// the exchange), or let the cost model choose per chunk (the default). Only with `dedup`.
    /// See [`crate::read_order`].
    pub read_order: ReadOrder,
    /// Target bytes of a storage-order slab ([`DEFAULT_SLAB_BYTES`], one loader request). A
    /// chunk gets at most one slab per rank that needs part of it, and at most one per row.
    pub slab_bytes: u64,
    /// File-offset alignment of slab cuts: the checksum block of the checkpoint
    /// ([`DEFAULT_SLAB_ALIGNMENT`], the native default; the loader passes the real one when it
    /// plans locally). Formats without checksum blocks lose nothing by it.
    pub slab_alignment: u64,
    /// A piece replicated over a group of at least `holder_read_min_members` ranks and at most
    /// this many bytes (64 KiB: one checksum block, about what one request costs) is read by
    /// every rank that needs it instead of being handed round the group's ring: a ring over m
    /// ranks takes m − 1 rounds (511 at 512 ranks for a replicated norm), each a message per
    /// rank, while a read this small is one request. Costs read amplification above 1.00 for
    /// exactly those pieces. 0 turns it off.
    pub holder_read_max_bytes: u64,
    /// Groups at least this wide (16 ranks) read their small pieces per holder (see
    /// `holder_read_max_bytes`). Narrower rings are few rounds, and reading once keeps read
    /// amplification at 1.00 for the usual TP×DP layouts.
    pub holder_read_min_members: u32,
    /// Name saved boxes that several ranks read in column slices (partitioned among them) as
    /// joint checks ([`crate::joint`]): verified by their own crc32c from the readers' folds
    /// instead of whole checksum blocks of every row. On by default; off makes every piece
    /// verified by blocks (side-by-side measurements).
    pub joint_checks: bool,
    /// The ranks read the checkpoint from local files: a request costs the storage-order cost
    /// model [`LOCAL_REQUEST_COST_BYTES`] instead of an object store's [`REQUEST_COST_BYTES`]
    /// (false). The loader sets it from the checkpoint's location when it plans, the server
    /// from its catalog's.
    pub local_reads: bool,
    /// The checkpoint has block checksums that reads per request widen to (true; the loader
    /// says false for formats that record none, DCP and safetensors): the cost model then
    /// counts the blocks around each run.
    pub block_checksums: bool,
}

impl Default for PlanOptions {
    fn default() -> Self {
        Self {
            dedup: true,
            read_order: ReadOrder::Auto,
            slab_bytes: DEFAULT_SLAB_BYTES,
            slab_alignment: DEFAULT_SLAB_ALIGNMENT,
            holder_read_max_bytes: 64 * 1024,
            holder_read_min_members: 16,
            joint_checks: true,
            local_reads: false,
            block_checksums: true,
        }
    }
}

/// What one rank asked for: a destination buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Destination {
    /// Index into the checkpoint's tensors.
    pub tensor: u32,
    /// The wanted part; the buffer is its row-major layout.
    pub target: Target,
}

/// The overlap of one saved chunk with what one or more ranks need: the unit that is read from
/// storage (once) and exchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Piece {
    /// Index into the checkpoint's tensors.
    pub tensor: u32,
    /// Index into [`CheckpointMeta::chunks`] of the saved chunk holding it.
    pub chunk: u32,
    /// The piece in global tensor coordinates (never empty).
    pub region: TensorBox,
    /// The group of ranks that need it, plus its reader when that is a storage-order slab's
    /// reader that does not need it (the reader relays it).
    pub group: u32,
    /// The member that reads it from storage (with `read_by_holders`, the group's first).
    pub reader: u32,
    /// The storage-order slab it is read with (plan-wide id): the slab's pieces share one
    /// reader and are adjacent in the file. `None` when read per request.
    pub slab: Option<u32>,
    /// Every rank of the group reads it itself instead of receiving it (a small piece of a
    /// wide group, [`PlanOptions::holder_read_max_bytes`]).
    pub read_by_holders: bool,
}

/// Ranks that need exactly the same pieces (and the reader of a storage-order slab relaying them,
/// when it needs none of them); ascending rank order. The ring runs over this order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Group {
    /// Member ranks, ascending.
    pub members: Vec<u32>,
}

/// A piece landing in a destination of a rank (whole-plan form).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceDestination {
    /// Index into [`Plan::pieces`].
    pub piece: u32,
    /// Index into the rank's destinations.
    pub destination: u32,
}

/// A whole-cluster load plan. Per-rank views come from [`Plan::rank_plan`].
#[derive(Clone, Debug)]
pub struct Plan {
    pub(crate) meta: Arc<CheckpointMeta>,
    pub(crate) destinations: Vec<Vec<Destination>>,
    pub(crate) pieces: Vec<Piece>,
    pub(crate) groups: Vec<Group>,
    /// Per rank, per destination: its distinct target.
    pub(crate) dest_targets: Vec<Vec<u32>>,
    /// CSR of each distinct target's pieces: ids `target_piece_ids[offsets[i]..offsets[i + 1]]`.
    pub(crate) target_piece_offsets: Vec<u32>,
    pub(crate) target_piece_ids: Vec<u32>,
    /// Per rank: the pieces it reads, in id order.
    pub(crate) reads: Vec<Vec<u32>>,
    /// Per group: its pieces ordered by (reader, id), so a member's share is one slice.
    pub(crate) group_pieces: Vec<Vec<u32>>,
    /// Per rank: the groups of more than one member it belongs to that exchange something.
    pub(crate) rank_groups: Vec<Vec<u32>>,
    /// Saved boxes verified jointly by the ranks reading their parts ([`crate::joint`]).
    pub(crate) joint_checks: Vec<JointCheckPlan>,
    /// Per rank: the joint checks it is a member of, ascending.
    pub(crate) rank_joint_checks: Vec<Vec<u32>>,
    pub(crate) summary: PlanSummary,
    /// Rank plans already cut, shared by this plan's clones and replays
    /// ([`Plan::keeping_rank_plans`]); `None`: each [`Plan::rank_plan`] call cuts anew.
    pub(crate) cut: Option<Arc<Vec<OnceLock<RankPlan>>>>,
}

impl Plan {
    /// Number of ranks.
    pub fn world_size(&self) -> u32 {
        self.destinations.len() as u32
    }

    /// The checkpoint metadata planned against.
    pub fn checkpoint(&self) -> &Arc<CheckpointMeta> {
        &self.meta
    }

    /// Every piece.
    pub fn pieces(&self) -> &[Piece] {
        &self.pieces
    }

    /// Every group.
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// Rank `rank`'s destinations.
    pub fn destinations(&self, rank: u32) -> &[Destination] {
        &self.destinations[rank as usize]
    }

    /// Rank `rank`'s placements (every piece it needs, per destination), by piece then
    /// destination. Derived from the destinations' targets rather than stored: with DP replicas
    /// most placements repeat across ranks.
    pub fn placements(&self, rank: u32) -> Vec<PieceDestination> {
        let mut out = Vec::new();
        for (d, &target) in self.dest_targets[rank as usize].iter().enumerate() {
            let (lo, hi) = (
                self.target_piece_offsets[target as usize] as usize,
                self.target_piece_offsets[target as usize + 1] as usize,
            );
            out.extend(
                self.target_piece_ids[lo..hi]
                    .iter()
                    .map(|&piece| PieceDestination {
                        piece,
                        destination: d as u32,
                    }),
            );
        }
        out.sort_unstable_by_key(|p| (p.piece, p.destination));
        out
    }

    /// The pieces rank `rank` reads from storage (including the pieces of its storage-order
    /// slabs that it only relays, and small pieces every holder reads).
    pub fn reads(&self, rank: u32) -> &[u32] {
        &self.reads[rank as usize]
    }

    /// Totals of the plan.
    pub fn summary(&self) -> &PlanSummary {
        &self.summary
    }

    /// Heap bytes this plan holds, counted from the capacities of its tables (the checkpoint
    /// metadata it points to is shared, not counted): what a cache of plans should weigh it at.
    /// `tests/memory.rs` checks it against a counting allocator.
    pub fn heap_bytes(&self) -> u64 {
        fn table<T>(v: &Vec<T>) -> u64 {
            (v.capacity() * std::mem::size_of::<T>()) as u64
        }
        fn nested<T>(v: &Vec<Vec<T>>) -> u64 {
            table(v) + v.iter().map(table).sum::<u64>()
        }
        let boxes = |region: &TensorBox| spilled_bytes_of(region);
        let destinations = nested(&self.destinations)
            + self
                .destinations
                .iter()
                .flatten()
                .map(|d| match &d.target {
                    Target::Box(b) => boxes(b),
                    Target::Flat { .. } => 0,
                })
                .sum::<u64>();
        let pieces =
            table(&self.pieces) + self.pieces.iter().map(|p| boxes(&p.region)).sum::<u64>();
        let groups =
            table(&self.groups) + self.groups.iter().map(|g| table(&g.members)).sum::<u64>();
        destinations
            + pieces
            + groups
            + nested(&self.dest_targets)
            + table(&self.target_piece_offsets)
            + table(&self.target_piece_ids)
            + nested(&self.reads)
            + nested(&self.group_pieces)
            + nested(&self.rank_groups)
            + table(&self.joint_checks)
            + self
                .joint_checks
                .iter()
                .map(|c| table(&c.pieces) + table(&c.readers) + table(&c.members))
                .sum::<u64>()
            + nested(&self.rank_joint_checks)
    }

    /// Bytes of piece `piece`.
    pub fn piece_bytes(&self, piece: u32) -> u64 {
        let p = &self.pieces[piece as usize];
        p.region.numel() * self.meta.tensors()[p.tensor as usize].dtype.size()
    }
}

/// Heap bytes of a box's dims (none while they fit inline).
fn spilled_bytes_of(region: &TensorBox) -> u64 {
    let dims = |d: &Dims| {
        if d.spilled() {
            (d.capacity() * std::mem::size_of::<u64>()) as u64
        } else {
            0
        }
    };
    dims(&region.offsets) + dims(&region.lengths)
}

/// The distinct targets of a plan (identical requests of several ranks folded into one) and
/// every (rank, destination) that asked for each, as a CSR.
struct DistinctTargets<'a> {
    targets: Vec<(u32, &'a Target)>,
    holder_offsets: Vec<u32>,
    holders: Vec<(u32, u32)>,
}

impl<'a> DistinctTargets<'a> {
    /// Folds one tensor's requests, given as (rank, destination) in rank order, into distinct
    /// targets. A small per-tensor map stays in cache, unlike one map over the whole cluster.
    fn fold(requests: &'a RequestSet, tensor: u32, asked: &[(u32, u32)], dedup: bool) -> Self {
        let mut ids: FxHashMap<(u32, &Target), u32> = FxHashMap::default();
        let mut targets: Vec<(u32, &Target)> = Vec::new();
        let mut of_request: Vec<u32> = Vec::with_capacity(asked.len());
        for &(rank, dest) in asked {
            let target = &requests.ranks[rank as usize][dest as usize].target;
            // Without dedup every rank's target stays its own.
            let owner = if dedup { u32::MAX } else { rank };
            let id = *ids.entry((owner, target)).or_insert_with(|| {
                targets.push((tensor, target));
                targets.len() as u32 - 1
            });
            of_request.push(id);
        }
        let mut holder_offsets = vec![0u32; targets.len() + 1];
        for &id in &of_request {
            holder_offsets[id as usize + 1] += 1;
        }
        for i in 0..targets.len() {
            holder_offsets[i + 1] += holder_offsets[i];
        }
        let mut fill = holder_offsets.clone();
        let mut holders = vec![(0u32, 0u32); asked.len()];
        for (&id, &holder) in of_request.iter().zip(asked) {
            holders[fill[id as usize] as usize] = holder;
            fill[id as usize] += 1;
        }
        Self {
            targets,
            holder_offsets,
            holders,
        }
    }

    fn len(&self) -> usize {
        self.targets.len()
    }

    fn target(&self, id: u32) -> &Target {
        self.targets[id as usize].1
    }

    fn holders(&self, id: u32) -> &[(u32, u32)] {
        &self.holders[self.holder_offsets[id as usize] as usize
            ..self.holder_offsets[id as usize + 1] as usize]
    }
}

/// Where a tensor-local piece's holders come from.
enum Holders {
    /// Exactly the holders of one distinct target (the common case).
    Target(u32),
    /// A refined cell shared by several overlapping targets (their ids).
    Cell(Vec<u32>),
}

/// A piece found by a worker, before it gets its plan-wide id.
pub(crate) struct LocalPiece {
    chunk: u32,
    region: TensorBox,
    holders: Holders,
    /// Tensor-local storage-order slab, `u32::MAX` when read per request.
    slab: u32,
}

/// What a worker found for one tensor.
struct TensorPieces<'a> {
    targets: DistinctTargets<'a>,
    pieces: Vec<LocalPiece>,
    unique_bytes: u64,
}

/// Plans `requests` against the checkpoint `meta`, every byte from its storage.
pub fn plan(
    meta: &Arc<CheckpointMeta>,
    requests: &RequestSet,
    options: &PlanOptions,
) -> Result<Plan, PlanError> {
    plan_with_sources(meta, requests, options, &ReadSources::none())
}

/// [`plan`] where some data files also have copies outside storage (`sources`, e.g. the memory
/// tiers of the nodes a job runs on): every piece of such a file is read from the cheapest tier
/// that holds it, by a rank that can read it there (balanced by bytes like any reader), and
/// handed to the ranks that need it through the exchange; a reader that needs none of it relays
/// it. Storage is read only for files no tier holds.
pub fn plan_with_sources(
    meta: &Arc<CheckpointMeta>,
    requests: &RequestSet,
    options: &PlanOptions,
    sources: &ReadSources,
) -> Result<Plan, PlanError> {
    let tensors = meta.tensors();
    let world = requests.world_size();
    sources.check(world, meta.files().len())?;

    // 1. Destinations, and every tensor's requests as (rank, destination) in rank order.
    let (destinations, asked) = destinations(tensors, requests)?;

    // 2. Per tensor: distinct targets intersected with the saved chunks.
    let found = find_tensor_pieces(meta, requests, options, &asked)?;

    // 3. Plan-wide ids in tensor order (deterministic whatever the thread timing): targets,
    // pieces, groups, and which pieces make up each target.
    let mut builder = PieceBuilder::new(world);
    let mut ids = PlanIds {
        dest_targets: destinations.iter().map(|d| vec![0; d.len()]).collect(),
        target_count: 0,
        memberships: Vec::new(),
        unique_bytes_needed: 0,
        slab_count: 0,
    };
    for (t, result) in found {
        ids.add(&mut builder, t, result?);
    }
    let (target_piece_offsets, target_piece_ids) = ids.target_pieces();

    builder.finish(
        meta,
        options,
        sources,
        ids.slab_count,
        destinations,
        Targets {
            dest_targets: ids.dest_targets,
            target_piece_offsets,
            target_piece_ids,
        },
        ids.unique_bytes_needed,
    )
}

/// Every rank's destinations (its requests, checked against the tensors), and per tensor the
/// (rank, destination) pairs that ask for it, in rank order.
#[allow(clippy::type_complexity)]
fn destinations(
    tensors: &[TensorMeta],
    requests: &RequestSet,
) -> Result<(Vec<Vec<Destination>>, Vec<Vec<(u32, u32)>>), PlanError> {
    let mut destinations: Vec<Vec<Destination>> = Vec::with_capacity(requests.ranks.len());
    let mut asked: Vec<Vec<(u32, u32)>> = vec![Vec::new(); tensors.len()];
    for (rank, rank_requests) in requests.ranks.iter().enumerate() {
        let rank = rank as u32;
        let mut rank_destinations = Vec::with_capacity(rank_requests.len());
        for request in rank_requests {
            let Some(tensor) = tensors.get(request.tensor as usize) else {
                return Err(PlanError::UnknownTensor {
                    rank,
                    fqn: format!("#{}", request.tensor),
                });
            };
            check_target(rank, tensor, &request.target)?;
            asked[request.tensor as usize].push((rank, rank_destinations.len() as u32));
            rank_destinations.push(Destination {
                tensor: request.tensor,
                target: request.target.clone(),
            });
        }
        destinations.push(rank_destinations);
    }
    Ok((destinations, asked))
}

/// Per tensor asked for (independent, so spread over the cores): folds identical requests (DP
/// replicas) into distinct targets, and intersects those with the saved chunks through a
/// partition index. The results come in tensor order.
#[allow(clippy::type_complexity)]
fn find_tensor_pieces<'r>(
    meta: &Arc<CheckpointMeta>,
    requests: &'r RequestSet,
    options: &PlanOptions,
    asked: &[Vec<(u32, u32)>],
) -> Result<Vec<(u32, Result<TensorPieces<'r>, PlanError>)>, PlanError> {
    let work: Vec<u32> = (0..asked.len() as u32)
        .filter(|&t| !asked[t as usize].is_empty())
        .collect();
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, 8)
        .min(work.len().max(1));
    let next = AtomicUsize::new(0);
    let mut found: Vec<(u32, Result<TensorPieces<'_>, PlanError>)> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..workers)
            .map(|_| {
                scope.spawn(|| {
                    let mut out = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&t) = work.get(i) else { break };
                        let targets =
                            DistinctTargets::fold(requests, t, &asked[t as usize], options.dedup);
                        out.push((
                            t,
                            tensor_pieces(meta, t, targets, options, requests.disjoint),
                        ));
                    }
                    out
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });
    if found.len() != work.len() {
        return Err(PlanError::Uncovered {
            rank: 0,
            fqn: "(a planning worker panicked)".to_string(),
            region: String::new(),
        });
    }
    found.sort_by_key(|(t, _)| *t);
    Ok(found)
}

/// The plan-wide numbering of what the workers found, tensor by tensor: target ids (by rank and
/// destination), which pieces make up each target, storage-order slabs, and the bytes needed.
struct PlanIds {
    dest_targets: Vec<Vec<u32>>,
    target_count: u32,
    /// (target, piece) pairs.
    memberships: Vec<(u32, u32)>,
    unique_bytes_needed: u64,
    slab_count: u32,
}

impl PlanIds {
    /// Numbers tensor `t`'s targets and adds its pieces to `builder`, each with the group of
    /// ranks that hold it.
    fn add(&mut self, builder: &mut PieceBuilder, t: u32, found: TensorPieces<'_>) {
        let TensorPieces {
            targets,
            pieces,
            unique_bytes,
        } = found;
        self.unique_bytes_needed += unique_bytes;
        let base = self.target_count;
        let mut target_group: Vec<u32> = vec![u32::MAX; targets.len()];
        for id in 0..targets.len() as u32 {
            for &(rank, dest) in targets.holders(id) {
                self.dest_targets[rank as usize][dest as usize] = base + id;
            }
        }
        self.target_count += targets.len() as u32;
        builder.pieces.reserve(pieces.len());
        let slab_base = self.slab_count;
        for local in pieces {
            let slab = (local.slab != u32::MAX).then(|| {
                self.slab_count = self.slab_count.max(slab_base + local.slab + 1);
                slab_base + local.slab
            });
            let piece = builder.pieces.len() as u32;
            let group = match &local.holders {
                Holders::Target(id) => {
                    self.memberships.push((base + *id, piece));
                    let cached = &mut target_group[*id as usize];
                    if *cached == u32::MAX {
                        *cached = builder.group_of(targets.holders(*id).iter().map(|h| h.0));
                    }
                    *cached
                }
                Holders::Cell(ids) => {
                    self.memberships
                        .extend(ids.iter().map(|&id| (base + id, piece)));
                    builder.group_of(
                        ids.iter()
                            .flat_map(|&id| targets.holders(id).iter().map(|h| h.0)),
                    )
                }
            };
            builder.pieces.push(Piece {
                tensor: t,
                chunk: local.chunk,
                region: local.region,
                group,
                reader: u32::MAX,
                slab,
                read_by_holders: false,
            });
        }
    }

    /// Which pieces make up each target, as a CSR (offsets per target, piece ids): a counting
    /// sort of the memberships, pieces ascending within a target.
    fn target_pieces(&mut self) -> (Vec<u32>, Vec<u32>) {
        let target_count = self.target_count as usize;
        let mut target_piece_offsets = vec![0u32; target_count + 1];
        for &(id, _) in &self.memberships {
            target_piece_offsets[id as usize + 1] += 1;
        }
        for i in 0..target_count {
            target_piece_offsets[i + 1] += target_piece_offsets[i];
        }
        let mut fill = target_piece_offsets.clone();
        let mut target_piece_ids = vec![0u32; self.memberships.len()];
        for (id, piece) in std::mem::take(&mut self.memberships) {
            target_piece_ids[fill[id as usize] as usize] = piece;
            fill[id as usize] += 1;
        }
        (target_piece_offsets, target_piece_ids)
    }
}

/// Which pieces each rank's destinations are made of (see [`Plan::placements`]).
struct Targets {
    dest_targets: Vec<Vec<u32>>,
    target_piece_offsets: Vec<u32>,
    target_piece_ids: Vec<u32>,
}

/// The pieces of tensor `t` for its distinct targets `ids`.
fn tensor_pieces<'a>(
    meta: &CheckpointMeta,
    t: u32,
    distinct: DistinctTargets<'a>,
    options: &PlanOptions,
    disjoint: bool,
) -> Result<TensorPieces<'a>, PlanError> {
    let tensor = &meta.tensors()[t as usize];
    let chunks = meta.chunks_of(t);
    let first_chunk = meta.first_chunk_index(t) as u32;
    let index = BoxIndex::build(chunks.iter().map(|c| &c.region).collect::<Vec<_>>());

    let mut subs: Vec<(u32, Cow<'_, TensorBox>)> = Vec::with_capacity(distinct.len());
    for id in 0..distinct.len() as u32 {
        match distinct.target(id) {
            Target::Box(b) => subs.push((id, Cow::Borrowed(b))),
            flat => subs.extend(
                target_boxes(tensor, flat)
                    .into_iter()
                    .map(|b| (id, Cow::Owned(b))),
            ),
        }
    }
    subs.retain(|(_, b)| !b.is_empty());
    let (unique_elems, refine) = if disjoint && options.dedup {
        // Distinct targets of a layout are pairwise disjoint: nothing to refine or to union.
        (subs.iter().map(|(_, b)| b.numel()).sum(), false)
    } else {
        let mut unique: Vec<&TensorBox> = subs.iter().map(|(_, b)| b.as_ref()).collect();
        unique.sort_unstable();
        unique.dedup();
        let requests_overlap = BoxIndex::build(unique.clone()).find_overlap().is_some();
        let elems = if requests_overlap {
            union_volume(&unique)
        } else {
            unique.iter().map(|b| b.numel()).sum()
        };
        // Overlapping (or repeated) requests are refined so that shared elements become shared
        // pieces; disjoint ones map straight to pieces.
        (
            elems,
            (requests_overlap || unique.len() < subs.len()) && options.dedup,
        )
    };
    let mut per_chunk: Vec<Vec<(TensorBox, u32)>> = if refine {
        vec![Vec::new(); chunks.len()]
    } else {
        Vec::new()
    };

    let mut pieces = Vec::new();
    let mut hits = Vec::new();
    for (id, sub) in &subs {
        hits.clear();
        index.query(sub, &mut hits);
        let mut covered = 0u64;
        for &hit in &hits {
            let Some(region) = chunks[hit as usize].region.intersect(sub) else {
                continue;
            };
            covered += region.numel();
            if refine {
                per_chunk[hit as usize].push((region, *id));
            } else {
                pieces.push(LocalPiece {
                    chunk: first_chunk + hit,
                    region,
                    holders: Holders::Target(*id),
                    slab: u32::MAX,
                });
            }
        }
        if covered != sub.numel() {
            let rank = distinct.holders(*id).first().map_or(0, |h| h.0);
            return Err(PlanError::Uncovered {
                rank,
                fqn: tensor.fqn.clone(),
                region: sub.to_string(),
            });
        }
    }
    for (hit, items) in per_chunk.iter().enumerate() {
        if !items.is_empty() {
            refine_chunk(&mut pieces, first_chunk + hit as u32, items);
        }
    }
    if options.dedup && options.read_order != ReadOrder::Request {
        pieces = storage_order(meta, tensor, &distinct, pieces, options);
    }
    Ok(TensorPieces {
        targets: distinct,
        pieces,
        unique_bytes: unique_elems * tensor.dtype.size(),
    })
}

/// The ranks that need a tensor-local piece, ascending.
fn holder_ranks(distinct: &DistinctTargets<'_>, holders: &Holders) -> Vec<u32> {
    let mut ranks: Vec<u32> = match holders {
        Holders::Target(id) => distinct.holders(*id).iter().map(|h| h.0).collect(),
        Holders::Cell(ids) => ids
            .iter()
            .flat_map(|&id| distinct.holders(id).iter().map(|h| h.0))
            .collect(),
    };
    ranks.sort_unstable();
    ranks.dedup();
    ranks
}

/// Re-cuts the pieces of every chunk that is to be read in storage order (see
/// [`crate::read_order`]) into slabs: each piece ∩ slab becomes a piece of that slab, and a
/// slab's pieces come out next to each other. Other chunks' pieces stay as they are.
fn storage_order(
    meta: &CheckpointMeta,
    tensor: &TensorMeta,
    distinct: &DistinctTargets<'_>,
    pieces: Vec<LocalPiece>,
    options: &PlanOptions,
) -> Vec<LocalPiece> {
    let esize = tensor.dtype.size();
    // Auto: only a chunk larger than a few blocks with a piece of more than one run can gain.
    // Checked first without allocating: at 405B scale almost every chunk fails it, and this
    // pass must cost next to nothing there.
    let min_bytes = MIN_CHUNK_BLOCKS.saturating_mul(options.slab_alignment.max(1));
    let candidate = |p: &LocalPiece| {
        let chunk = &meta.chunks()[p.chunk as usize];
        chunk.region.numel() * esize > min_bytes
            && runs_of(&chunk.region.lengths, &p.region.lengths).1 > 1
    };
    let auto = options.read_order == ReadOrder::Auto;
    if auto && !pieces.iter().any(candidate) {
        return pieces;
    }
    let mut pieces = pieces;
    // Stable: pieces of one chunk keep their order (and the plan stays deterministic).
    pieces.sort_by_key(|p| p.chunk);
    let mut out = Vec::with_capacity(pieces.len());
    let mut slabs = 0u32;
    let mut rest = pieces.into_iter().peekable();
    while let Some(first) = rest.next() {
        let mut of_chunk = vec![first];
        while let Some(next) = rest.next_if(|p| p.chunk == of_chunk[0].chunk) {
            of_chunk.push(next);
        }
        let chunk = &meta.chunks()[of_chunk[0].chunk as usize];
        if auto && !of_chunk.iter().any(candidate) {
            out.extend(of_chunk);
            continue;
        }
        let holders: Vec<Vec<u32>> = of_chunk
            .iter()
            .map(|p| holder_ranks(distinct, &p.holders))
            .collect();
        let mut readers: Vec<u32> = holders.iter().flatten().copied().collect();
        readers.sort_unstable();
        readers.dedup();
        let cuts = if is_row_major(chunk) {
            slab_cuts(
                chunk,
                esize,
                readers.len(),
                options.slab_bytes,
                options.slab_alignment,
            )
        } else {
            None
        };
        let Some((dim, cuts)) = cuts else {
            out.extend(of_chunk);
            continue;
        };
        let chosen = match options.read_order {
            ReadOrder::Storage => true,
            ReadOrder::Request => false,
            ReadOrder::Auto => {
                let costs: Vec<PieceCost<'_>> = of_chunk
                    .iter()
                    .zip(&holders)
                    .map(|(p, h)| PieceCost {
                        region: &p.region,
                        holders: h.len(),
                    })
                    .collect();
                // Per request, pieces are fetched exactly (no checksum block around them) where
                // the checkpoint has no block checksums, or the box is checked jointly (its
                // pieces partition it among its readers).
                let exact = !options.block_checksums
                    || options.joint_checks && chunk.checksum().is_some() && readers.len() > 1;
                let request_cost = if options.local_reads {
                    LOCAL_REQUEST_COST_BYTES
                } else {
                    REQUEST_COST_BYTES
                };
                // Local files, pieces fetched exactly (no checksum blocks, or a joint check):
                // the loader reads a column slice by position, all its runs in one read.
                let positioned_run_cost =
                    (options.local_reads && exact).then_some(LOCAL_RUN_COST_BYTES);
                let pricing = RequestPricing {
                    alignment: options.slab_alignment,
                    request_cost,
                    exact,
                    positioned_run_cost,
                };
                storage_order_pays(chunk, esize, &costs, readers.len(), &cuts, pricing)
            }
        };
        if !chosen {
            out.extend(of_chunk);
            continue;
        }
        let base = chunk.region.offsets[dim];
        for w in cuts.windows(2) {
            let (lo, hi) = (base + w[0], base + w[1]);
            let before = out.len();
            for p in &of_chunk {
                let (start, end) = (p.region.offsets[dim].max(lo), p.region.end(dim).min(hi));
                if start >= end {
                    continue;
                }
                let mut region = p.region.clone();
                region.offsets[dim] = start;
                region.lengths[dim] = end - start;
                out.push(LocalPiece {
                    chunk: p.chunk,
                    region,
                    holders: match &p.holders {
                        Holders::Target(id) => Holders::Target(*id),
                        Holders::Cell(ids) => Holders::Cell(ids.clone()),
                    },
                    slab: slabs,
                });
            }
            if out.len() > before {
                slabs += 1;
            }
        }
    }
    out
}

/// Cuts the overlaps of several requests with one saved chunk into disjoint cells along every
/// boundary, so each element is one piece read once and placed wherever it is wanted. Only
/// overlapping explicit requests get here; the cell count grows with the number of overlaps.
fn refine_chunk(pieces: &mut Vec<LocalPiece>, chunk: u32, items: &[(TensorBox, u32)]) {
    let ndim = items[0].0.ndim();
    let cuts: Vec<Vec<u64>> = (0..ndim)
        .map(|d| {
            let mut c: Vec<u64> = items
                .iter()
                .flat_map(|(b, _)| [b.offsets[d], b.end(d)])
                .collect();
            c.sort_unstable();
            c.dedup();
            c
        })
        .collect();
    let mut index = vec![0usize; ndim];
    loop {
        let cell = TensorBox::new(
            (0..ndim).map(|d| cuts[d][index[d]]).collect::<Dims>(),
            (0..ndim)
                .map(|d| cuts[d][index[d] + 1] - cuts[d][index[d]])
                .collect::<Dims>(),
        );
        let mut ids: Vec<u32> = items
            .iter()
            .filter(|(b, _)| b.contains(&cell))
            .map(|(_, id)| *id)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        if !ids.is_empty() {
            pieces.push(LocalPiece {
                chunk,
                region: cell,
                holders: Holders::Cell(ids),
                slab: u32::MAX,
            });
        }
        // Odometer over the cells, last dim fastest; a 0-dim chunk has exactly one cell.
        let mut d = ndim;
        loop {
            if d == 0 {
                return;
            }
            d -= 1;
            index[d] += 1;
            if index[d] + 1 < cuts[d].len() {
                break;
            }
            index[d] = 0;
        }
    }
}

/// The boxes a target consists of: itself, or the boxes of a flat range.
pub(crate) fn target_boxes(tensor: &TensorMeta, target: &Target) -> Vec<TensorBox> {
    match target {
        Target::Box(b) => vec![b.clone()],
        Target::Flat { start, end } => flat_range_to_boxes(&tensor.shape, *start, *end),
    }
}

/// What the worst-fit reader assignment places: a shared piece, or a whole storage-order slab.
#[derive(Clone, Copy)]
enum Unit {
    Piece(u32),
    Slab(u32),
}

struct PieceBuilder {
    world: u32,
    pieces: Vec<Piece>,
    groups: Vec<Group>,
    group_ids: FxHashMap<Vec<u32>, u32>,
    scratch: Vec<u32>,
}

impl PieceBuilder {
    fn new(world: u32) -> Self {
        Self {
            world,
            pieces: Vec::new(),
            groups: Vec::new(),
            group_ids: FxHashMap::default(),
            scratch: Vec::new(),
        }
    }

    /// The group of exactly these member ranks (any order, repeats allowed).
    fn group_of(&mut self, ranks: impl Iterator<Item = u32>) -> u32 {
        self.scratch.clear();
        self.scratch.extend(ranks);
        self.scratch.sort_unstable();
        self.scratch.dedup();
        if let Some(&g) = self.group_ids.get(self.scratch.as_slice()) {
            return g;
        }
        let g = self.groups.len() as u32;
        self.group_ids.insert(self.scratch.clone(), g);
        self.groups.push(Group {
            members: self.scratch.clone(),
        });
        g
    }

    #[allow(clippy::too_many_arguments)]
    fn finish(
        mut self,
        meta: &Arc<CheckpointMeta>,
        options: &PlanOptions,
        sources: &ReadSources,
        slab_count: u32,
        destinations: Vec<Vec<Destination>>,
        targets: Targets,
        unique_bytes_needed: u64,
    ) -> Result<Plan, PlanError> {
        let tensors = meta.tensors();
        let piece_bytes: Vec<u64> = self
            .pieces
            .iter()
            .map(|p| p.region.numel() * tensors[p.tensor as usize].dtype.size())
            .collect();

        // 3. Readers, and what they read from a faster tier.
        let (load, relayed) = self.assign_readers(meta, options, sources, slab_count, &piece_bytes);
        let from_tier = self.bytes_from_tier(meta, sources, &piece_bytes);

        // 4. Indexes for per-rank extraction.
        let (reads, group_pieces, rank_groups) = self.rank_indexes();
        let joint_checks = if options.joint_checks {
            joint_checks(meta, &self.pieces, &self.groups, options.block_checksums)
        } else {
            Vec::new()
        };
        let mut rank_joint_checks: Vec<Vec<u32>> = vec![Vec::new(); self.world as usize];
        for (c, check) in joint_checks.iter().enumerate() {
            for &m in &check.members {
                rank_joint_checks[m as usize].push(c as u32);
            }
        }

        let summary = PlanSummary::compute(
            tensors,
            &destinations,
            &self.pieces,
            &piece_bytes,
            &self.groups,
            &group_pieces,
            &load,
            unique_bytes_needed,
            relayed,
            slab_count,
        );
        let summary = PlanSummary {
            bytes_read_from_tier: from_tier,
            ..summary
        };
        Ok(Plan {
            meta: Arc::clone(meta),
            destinations,
            pieces: self.pieces,
            groups: self.groups,
            dest_targets: targets.dest_targets,
            target_piece_offsets: targets.target_piece_offsets,
            target_piece_ids: targets.target_piece_ids,
            reads,
            group_pieces,
            rank_groups,
            joint_checks,
            rank_joint_checks,
            summary,
            cut: None,
        })
    }

    /// Chooses every piece's reader; returns the bytes each rank reads and the bytes relayed.
    /// Pieces only one rank needs are that rank's; small pieces of wide groups are read by every
    /// holder; the shared ones and the storage-order slabs (each read whole by one rank that needs
    /// part of it) go, largest first, to the least-loaded candidate (worst-fit), which balances
    /// bytes read per rank. A piece of a file that a faster tier holds (`sources`) is read there:
    /// its candidates are the ranks that can read that copy, and the one chosen relays it when it
    /// needs none of it.
    fn assign_readers(
        &mut self,
        meta: &CheckpointMeta,
        options: &PlanOptions,
        sources: &ReadSources,
        slab_count: u32,
        piece_bytes: &[u64],
    ) -> (Vec<u64>, u64) {
        let mut load = vec![0u64; self.world as usize];
        let mut slab_pieces: Vec<Vec<u32>> = vec![Vec::new(); slab_count as usize];
        let mut units: Vec<(u64, Unit)> = Vec::new();
        for (i, p) in self.pieces.iter_mut().enumerate() {
            let members = &self.groups[p.group as usize].members;
            // Whether every rank that needs the piece may read it itself: no tier holds its file,
            // or every one of them can read the tier's copy.
            let holders_may_read = tier_readers(meta, sources, p)
                .is_none_or(|ranks| members.iter().all(|m| ranks.binary_search(m).is_ok()));
            if let Some(s) = p.slab {
                slab_pieces[s as usize].push(i as u32);
            } else if members.len() == 1 && holders_may_read {
                p.reader = members[0];
                load[members[0] as usize] += piece_bytes[i];
            } else if holders_may_read
                && piece_bytes[i] <= options.holder_read_max_bytes
                && members.len() >= options.holder_read_min_members.max(2) as usize
            {
                p.reader = members[0];
                p.read_by_holders = true;
                for &m in members {
                    load[m as usize] += piece_bytes[i];
                }
            } else {
                units.push((piece_bytes[i], Unit::Piece(i as u32)));
            }
        }
        for (s, pieces) in slab_pieces.iter().enumerate() {
            let bytes = pieces.iter().map(|&i| piece_bytes[i as usize]).sum();
            units.push((bytes, Unit::Slab(s as u32)));
        }
        // Largest first, ties in the order made (pieces by id, then slabs by id). Pieces come in
        // few distinct sizes (one per tensor shard shape), so bucketing by size is a linear-time
        // sort.
        let mut by_size: FxHashMap<u64, Vec<Unit>> = FxHashMap::default();
        for (bytes, unit) in units {
            by_size.entry(bytes).or_default().push(unit);
        }
        let mut sizes: Vec<u64> = by_size.keys().copied().collect();
        sizes.sort_unstable_by(|a, b| b.cmp(a));
        let mut candidates: Vec<u32> = Vec::new();
        let mut relayed = 0u64;
        for (bytes, unit) in sizes
            .iter()
            .flat_map(|size| by_size[size].iter().map(move |&u| (*size, u)))
        {
            let first = match unit {
                Unit::Piece(i) => i,
                // A slab is one saved chunk's rows: one file.
                Unit::Slab(s) => slab_pieces[s as usize][0],
            };
            let single = [first];
            let of_unit: &[u32] = match unit {
                Unit::Piece(_) => &single,
                Unit::Slab(s) => &slab_pieces[s as usize],
            };
            let tier = tier_readers(meta, sources, &self.pieces[first as usize]);
            self.candidates(unit, of_unit, tier, &mut candidates);
            let mut reader = candidates[0];
            for &m in &candidates[1..] {
                if load[m as usize] < load[reader as usize] {
                    reader = m;
                }
            }
            load[reader as usize] += bytes;
            relayed += self.set_reader(of_unit, reader, piece_bytes);
        }
        (load, relayed)
    }

    /// The ranks that may read a shared piece or slab (`of_unit`: its pieces) into `out`. With
    /// a tier copy of its file (`tier`: the ranks that can read the copy), the ranks that need
    /// it and can read the copy (no relay), or, only when none can, every holder of the copy;
    /// otherwise the members of its pieces' groups.
    fn candidates(&self, unit: Unit, of_unit: &[u32], tier: Option<&[u32]>, out: &mut Vec<u32>) {
        out.clear();
        match (unit, tier) {
            (_, Some(ranks)) => {
                for &i in of_unit {
                    let members = &self.groups[self.pieces[i as usize].group as usize].members;
                    out.extend(members.iter().filter(|m| ranks.binary_search(m).is_ok()));
                }
                out.sort_unstable();
                out.dedup();
                if out.is_empty() {
                    out.extend_from_slice(ranks);
                }
            }
            (Unit::Piece(i), None) => {
                out.extend_from_slice(&self.groups[self.pieces[i as usize].group as usize].members)
            }
            (Unit::Slab(_), None) => {
                for &i in of_unit {
                    let g = self.pieces[i as usize].group as usize;
                    out.extend_from_slice(&self.groups[g].members);
                }
                out.sort_unstable();
                out.dedup();
            }
        }
    }

    /// Makes `reader` the reader of the pieces `of_unit`; returns the bytes it relays. The
    /// reader relays what it does not need itself (a slab's reader, a tier copy's reader): it
    /// joins the piece's ring so that the exchange hands the piece on.
    fn set_reader(&mut self, of_unit: &[u32], reader: u32, piece_bytes: &[u64]) -> u64 {
        let mut relayed = 0u64;
        for &i in of_unit {
            let g = self.pieces[i as usize].group;
            let members = &self.groups[g as usize].members;
            if members.binary_search(&reader).is_err() {
                let with_reader: Vec<u32> = members.iter().copied().chain([reader]).collect();
                relayed += piece_bytes[i as usize];
                self.pieces[i as usize].group = self.group_of(with_reader.into_iter());
            }
            self.pieces[i as usize].reader = reader;
        }
        relayed
    }

    /// Bytes the readers read from a faster tier's copies rather than from storage (every
    /// holder's read counted for pieces read by their holders).
    fn bytes_from_tier(
        &self,
        meta: &CheckpointMeta,
        sources: &ReadSources,
        piece_bytes: &[u64],
    ) -> u64 {
        let mut from_tier = 0u64;
        if sources.is_empty() {
            return from_tier;
        }
        for (p, &bytes) in self.pieces.iter().zip(piece_bytes) {
            let file = meta.chunks()[p.chunk as usize].bytes.file;
            from_tier += if p.read_by_holders {
                let members = &self.groups[p.group as usize].members;
                let n = members
                    .iter()
                    .filter(|&&m| sources.reads_from_tier(file, m))
                    .count();
                bytes * n as u64
            } else if sources.reads_from_tier(file, p.reader) {
                bytes
            } else {
                0
            };
        }
        from_tier
    }

    /// The indexes per-rank extraction uses, built in linear time: each rank's reads in id order
    /// (`reads`), each group's exchanged pieces by (reader, id) by walking the readers in rank
    /// order (`group_pieces`), and each rank's groups that exchange something (`rank_groups`).
    #[allow(clippy::type_complexity)]
    fn rank_indexes(&self) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, Vec<Vec<u32>>) {
        let mut reads: Vec<Vec<u32>> = vec![Vec::new(); self.world as usize];
        for (i, p) in self.pieces.iter().enumerate() {
            if p.read_by_holders {
                for &m in &self.groups[p.group as usize].members {
                    reads[m as usize].push(i as u32);
                }
            } else {
                reads[p.reader as usize].push(i as u32);
            }
        }
        let mut group_pieces: Vec<Vec<u32>> = vec![Vec::new(); self.groups.len()];
        for rank_reads in &reads {
            for &i in rank_reads {
                let p = &self.pieces[i as usize];
                let g = p.group as usize;
                if self.groups[g].members.len() > 1 && !p.read_by_holders {
                    group_pieces[g].push(i);
                }
            }
        }
        let mut rank_groups: Vec<Vec<u32>> = vec![Vec::new(); self.world as usize];
        for (g, group) in self.groups.iter().enumerate() {
            if group.members.len() > 1 && !group_pieces[g].is_empty() {
                for &m in &group.members {
                    rank_groups[m as usize].push(g as u32);
                }
            }
        }
        (reads, group_pieces, rank_groups)
    }
}

/// The ranks that can read the copy of the piece's file that a faster tier holds, if one does.
fn tier_readers<'s>(
    meta: &CheckpointMeta,
    sources: &'s ReadSources,
    p: &Piece,
) -> Option<&'s [u32]> {
    sources
        .cheapest(meta.chunks()[p.chunk as usize].bytes.file)
        .map(|(_, ranks)| ranks)
}
