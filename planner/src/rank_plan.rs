//! One rank's view of a plan: its destination buffers, the pieces it reads and where their bytes
//! are, where every piece it needs lands, and its ring exchange rounds. This is what the server
//! hands each rank and what the loader executes; it serializes to JSON and Arrow IPC.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tessera_metadata::{SavedChunk, TensorBox, TensorMeta, row_major_strides};

use crate::request::{flat_index, global_strides};
use crate::runs::{Side, StridedRuns};
use crate::{PieceDestination, Plan, PlanError, Target};

/// A destination buffer of the rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankDestination {
    /// Index into [`RankPlan::tensors`].
    pub tensor: u32,
    /// The wanted part.
    pub target: Target,
    /// Bytes of the buffer.
    pub bytes: u64,
}

/// Where a piece this rank reads lives in storage.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SourceRead {
    /// Index into [`RankPlan::files`].
    pub file: u32,
    /// Runs from the file into the piece's wire buffer (row-major over the piece).
    pub runs: StridedRuns,
}

/// Where a piece lands in one of the rank's destinations.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PiecePlacement {
    /// Index into [`RankPlan::destinations`].
    pub destination: u32,
    /// Runs from the piece's wire buffer into the destination buffer.
    pub runs: StridedRuns,
}

/// A piece this rank needs (read by itself or received from its group's reader), or one it
/// reads only to relay (a storage-order slab's part another rank needs; `places` is empty).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPiece {
    /// Plan-wide piece id (names the piece on the wire).
    pub id: u32,
    /// Index into [`RankPlan::tensors`].
    pub tensor: u32,
    /// The piece in global coordinates.
    pub region: TensorBox,
    /// Bytes of the piece.
    pub bytes: u64,
    /// Plan-wide group id.
    pub group: u32,
    /// The rank that reads it from storage.
    pub reader: u32,
    /// Present when this rank is the reader.
    pub read: Option<SourceRead>,
    /// Every rank that needs it reads it itself (a small piece of a wide group): it is in no
    /// exchange round, and `reader` is this rank.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub read_by_holders: bool,
    /// Where it lands (one entry per destination that contains it; none for a piece this rank
    /// reads in storage order only to pass on).
    pub places: Vec<PiecePlacement>,
}

/// One round of a ring: send my share to `send_to`, receive `recv_from`'s share.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Round {
    /// Round number k (1-based): member i sends to member (i + k) mod m.
    pub round: u32,
    /// Peer rank I send to.
    pub send_to: u32,
    /// Peer rank I receive from.
    pub recv_from: u32,
    /// Piece ids I send.
    pub send: Vec<u32>,
    /// Piece ids I receive.
    pub recv: Vec<u32>,
    /// Bytes I send.
    pub send_bytes: u64,
    /// Bytes I receive.
    pub recv_bytes: u64,
}

/// This rank's ring over one group.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Exchange {
    /// Plan-wide group id (tags messages).
    pub group: u32,
    /// Members, ascending.
    pub members: Vec<u32>,
    /// This rank's position in `members`.
    pub position: u32,
    /// Rounds with something to send or receive.
    pub rounds: Vec<Round>,
}

/// A saved box this rank holds bytes of, verified jointly: the ranks that read its parts each
/// fold theirs into one crc32c contribution and send it to every member ([`crate::joint`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct JointCheck {
    /// Plan-wide id (orders the contributions on the wire).
    pub id: u32,
    /// Index into [`RankPlan::tensors`].
    pub tensor: u32,
    /// The saved box, in global coordinates (its crc32c is in the checkpoint's metadata).
    pub region: TensorBox,
    /// Ranks whose pieces partition the box, ascending: each sends its fold to every member.
    pub readers: Vec<u32>,
    /// Ranks holding bytes of the box (readers and receivers), ascending: each checks the sum.
    pub members: Vec<u32>,
    /// Ids of the pieces this rank reads from the box (empty when it only receives).
    pub pieces: Vec<u32>,
}

/// Totals for one rank.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankSummary {
    /// Bytes of all destination buffers.
    pub bytes_needed: u64,
    /// Bytes read from storage.
    pub bytes_read: u64,
    /// Bytes sent to peers.
    pub bytes_sent: u64,
    /// Bytes received from peers.
    pub bytes_received: u64,
}

/// One rank's plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankPlan {
    /// This rank.
    pub rank: u32,
    /// World size.
    pub world: u32,
    /// Data files this rank reads, relative to the checkpoint root.
    pub files: Vec<String>,
    /// Tensors this rank touches.
    pub tensors: Vec<TensorMeta>,
    /// Destination buffers, in request order.
    pub destinations: Vec<RankDestination>,
    /// Pieces this rank needs or relays, in piece-id order.
    pub pieces: Vec<RankPiece>,
    /// Ring exchanges, by group id.
    pub exchanges: Vec<Exchange>,
    /// Totals.
    pub summary: RankSummary,
    /// Identity of the checkpoint the plan was made for
    /// ([`CheckpointMeta::identity`](tessera_metadata::CheckpointMeta::identity)): a loader
    /// refuses to execute the plan against a checkpoint with another one. `None` when the
    /// metadata planned against had none (assembled in memory), or from a server that predates
    /// identities.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checkpoint_identity: Option<String>,
    /// Saved boxes this rank helps verify jointly instead of by checksum blocks, by id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub joint_checks: Vec<JointCheck>,
}

impl RankPlan {
    /// Pretty JSON.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Parses JSON written by [`RankPlan::to_json`].
    pub fn from_json(text: &str) -> Result<RankPlan, PlanError> {
        serde_json::from_str(text).map_err(|e| PlanError::Json {
            what: "rank plan",
            detail: e.to_string(),
        })
    }
}

impl Plan {
    /// Extracts rank `rank`'s plan; from the rank plans kept when this plan keeps them
    /// ([`Plan::keeping_rank_plans`]: a replayed plan), with this plan's checkpoint identity.
    pub fn rank_plan(&self, rank: u32) -> Result<RankPlan, PlanError> {
        let Some(kept) = self.cut.as_ref().and_then(|cut| cut.get(rank as usize)) else {
            return self.cut_rank_plan(rank);
        };
        let mut plan = match kept.get() {
            Some(plan) => plan.clone(),
            None => {
                let plan = self.cut_rank_plan(rank)?;
                // Another thread may have cut it meanwhile: the same plan either way.
                let _ = kept.set(plan.clone());
                plan
            }
        };
        // The only part of a rank plan that is the checkpoint's and not its layout's.
        plan.checkpoint_identity = self.meta.identity().map(str::to_string);
        Ok(plan)
    }

    /// Cuts rank `rank`'s plan out of the whole plan.
    fn cut_rank_plan(&self, rank: u32) -> Result<RankPlan, PlanError> {
        let world = self.world_size();
        if rank >= world {
            return Err(PlanError::RankOutOfRange { rank, world });
        }
        let meta = &*self.meta;
        let all_tensors = meta.tensors();
        let chunks = meta.chunks();
        let r = rank as usize;

        let mut tensor_ids: HashMap<u32, u32> = HashMap::new();
        let mut tensors: Vec<TensorMeta> = Vec::new();
        let mut local_tensor = |t: u32, tensors: &mut Vec<TensorMeta>| {
            *tensor_ids.entry(t).or_insert_with(|| {
                tensors.push(all_tensors[t as usize].clone());
                tensors.len() as u32 - 1
            })
        };

        let mut destinations = Vec::with_capacity(self.destinations[r].len());
        for d in &self.destinations[r] {
            let tensor = &all_tensors[d.tensor as usize];
            destinations.push(RankDestination {
                tensor: local_tensor(d.tensor, &mut tensors),
                target: d.target.clone(),
                bytes: d.target.numel() * tensor.dtype.size(),
            });
        }

        let mut file_ids: HashMap<u32, u32> = HashMap::new();
        let mut files: Vec<String> = Vec::new();
        let mut pieces: Vec<RankPiece> = Vec::new();
        let mut piece_index: HashMap<u32, usize> = HashMap::new();
        let mut placements = self.placements(rank);
        // Pieces of this rank's storage-order slabs that it only relays land nowhere here: they
        // are read, then sent on (an entry without placement keeps them in piece-id order).
        let needed: Vec<u32> = placements.iter().map(|p| p.piece).collect();
        let relays: Vec<u32> = self.reads[r]
            .iter()
            .copied()
            .filter(|i| needed.binary_search(i).is_err())
            .collect();
        if !relays.is_empty() {
            placements.extend(relays.iter().map(|&piece| PieceDestination {
                piece,
                destination: u32::MAX,
            }));
            placements.sort_unstable_by_key(|p| (p.piece, p.destination));
        }
        let mut summary = RankSummary {
            bytes_needed: destinations.iter().map(|d| d.bytes).sum(),
            ..RankSummary::default()
        };
        for placement in &placements {
            let p = &self.pieces[placement.piece as usize];
            let tensor = &all_tensors[p.tensor as usize];
            let esize = tensor.dtype.size();
            let wire_strides = row_major_strides(&p.region.lengths);
            let slot = match piece_index.get(&placement.piece) {
                Some(&slot) => slot,
                None => {
                    let reads_it = p.reader == rank || p.read_by_holders;
                    let read = if reads_it {
                        let chunk = &chunks[p.chunk as usize];
                        let file = *file_ids.entry(chunk.bytes.file).or_insert_with(|| {
                            files.push(meta.files()[chunk.bytes.file as usize].path.clone());
                            files.len() as u32 - 1
                        });
                        let runs = source_runs(chunk, &p.region, esize);
                        summary.bytes_read += runs.total_bytes();
                        Some(SourceRead { file, runs })
                    } else {
                        summary.bytes_received += p.region.numel() * esize;
                        None
                    };
                    pieces.push(RankPiece {
                        id: placement.piece,
                        tensor: local_tensor(p.tensor, &mut tensors),
                        region: p.region.clone(),
                        bytes: p.region.numel() * esize,
                        group: p.group,
                        reader: if p.read_by_holders { rank } else { p.reader },
                        read,
                        read_by_holders: p.read_by_holders,
                        places: Vec::new(),
                    });
                    piece_index.insert(placement.piece, pieces.len() - 1);
                    pieces.len() - 1
                }
            };
            if placement.destination == u32::MAX {
                continue;
            }
            let dest = &self.destinations[r][placement.destination as usize];
            let runs = place_runs(tensor, &p.region, &dest.target, &wire_strides);
            pieces[slot].places.push(PiecePlacement {
                destination: placement.destination,
                runs,
            });
        }

        let exchanges = exchanges_for(
            rank,
            |g| self.groups[g as usize].members.clone(),
            |g| {
                self.group_pieces[g as usize]
                    .iter()
                    .map(|&i| (i, self.pieces[i as usize].reader, self.piece_bytes(i)))
                    .collect()
            },
            &self.rank_groups[r],
        );
        summary.bytes_sent = exchanges
            .iter()
            .flat_map(|e| &e.rounds)
            .map(|round| round.send_bytes)
            .sum();
        let joint_checks = self.rank_joint_checks[r]
            .iter()
            .map(|&c| {
                let check = &self.joint_checks[c as usize];
                let chunk = &chunks[check.chunk as usize];
                JointCheck {
                    id: c,
                    tensor: local_tensor(chunk.tensor, &mut tensors),
                    region: chunk.region.clone(),
                    readers: check.readers.clone(),
                    members: check.members.clone(),
                    pieces: check
                        .pieces
                        .iter()
                        .copied()
                        .filter(|&i| self.pieces[i as usize].reader == rank)
                        .collect(),
                }
            })
            .collect();
        Ok(RankPlan {
            rank,
            world,
            files,
            tensors,
            destinations,
            pieces,
            exchanges,
            summary,
            checkpoint_identity: meta.identity().map(str::to_string),
            joint_checks,
        })
    }
}

/// Runs from the file holding saved box `chunk` into the wire buffer (row-major) of its part
/// `region`, elements of `esize` bytes.
pub(crate) fn source_runs(chunk: &SavedChunk, region: &TensorBox, esize: u64) -> StridedRuns {
    let src_strides = chunk.bytes.strides_for(&chunk.region.lengths);
    let rel = chunk.region.relative_offsets(region);
    let origin = chunk.bytes.offset
        + esize
            * rel
                .iter()
                .zip(&src_strides)
                .map(|(o, s)| o * s)
                .sum::<u64>();
    StridedRuns::new(
        esize,
        &region.lengths,
        Side {
            origin,
            strides: &src_strides,
        },
        Side {
            origin: 0,
            strides: &row_major_strides(&region.lengths),
        },
    )
}

/// Runs from a piece's wire buffer (row-major over `region`) into a destination buffer.
pub(crate) fn place_runs(
    tensor: &TensorMeta,
    region: &TensorBox,
    target: &Target,
    wire_strides: &[u64],
) -> StridedRuns {
    let esize = tensor.dtype.size();
    let (origin, strides) = match target {
        Target::Box(dest) => {
            let strides = row_major_strides(&dest.lengths);
            let rel = dest.relative_offsets(region);
            (flat_index(&rel, &strides), strides)
        }
        Target::Flat { start, .. } => {
            let strides = global_strides(&tensor.shape);
            (flat_index(&region.offsets, &strides) - start, strides)
        }
    };
    StridedRuns::new(
        esize,
        &region.lengths,
        Side {
            origin: 0,
            strides: wire_strides,
        },
        Side {
            origin: origin * esize,
            strides: &strides,
        },
    )
}

/// Builds the ring rounds of `rank` over each of its groups. In round k (1 ≤ k < m), member i
/// sends every piece it read for the group to member (i + k) mod m and receives member
/// (i − k) mod m's. `group_pieces(g)` lists the group's pieces as (id, reader, bytes) sorted by
/// reader then id.
pub(crate) fn exchanges_for(
    rank: u32,
    members_of: impl Fn(u32) -> Vec<u32>,
    group_pieces: impl Fn(u32) -> Vec<(u32, u32, u64)>,
    groups: &[u32],
) -> Vec<Exchange> {
    let mut exchanges = Vec::with_capacity(groups.len());
    for &g in groups {
        let members = members_of(g);
        let m = members.len();
        let Some(position) = members.iter().position(|&x| x == rank) else {
            continue;
        };
        let list = group_pieces(g);
        let share = |reader: u32| -> (Vec<u32>, u64) {
            let lo = list.partition_point(|e| e.1 < reader);
            let hi = list.partition_point(|e| e.1 <= reader);
            (
                list[lo..hi].iter().map(|e| e.0).collect(),
                list[lo..hi].iter().map(|e| e.2).sum(),
            )
        };
        let (send, send_bytes) = share(rank);
        let mut rounds = Vec::new();
        for k in 1..m {
            let send_to = members[(position + k) % m];
            let recv_from = members[(position + m - k) % m];
            let (recv, recv_bytes) = share(recv_from);
            if send.is_empty() && recv.is_empty() {
                continue;
            }
            rounds.push(Round {
                round: k as u32,
                send_to,
                recv_from,
                send: send.clone(),
                recv,
                send_bytes,
                recv_bytes,
            });
        }
        exchanges.push(Exchange {
            group: g,
            members,
            position: position as u32,
            rounds,
        });
    }
    exchanges
}

impl Plan {
    /// Every joint check of the plan as one rank plan of rank 0 that holds nothing else (no
    /// destinations, pieces or exchanges): the job's coordinator checks every jointly read box
    /// against every reader's folds with it, in one place, instead of each member fetching the
    /// folds of every other reader (whose number grows with the world in an all-to-all
    /// reshard). Tensors are the checkpoint's, by index.
    pub fn joint_checks_view(&self) -> RankPlan {
        let meta = &*self.meta;
        let chunks = meta.chunks();
        let joint_checks = self
            .joint_checks
            .iter()
            .enumerate()
            .map(|(c, check)| {
                let chunk = &chunks[check.chunk as usize];
                JointCheck {
                    id: c as u32,
                    tensor: chunk.tensor,
                    region: chunk.region.clone(),
                    readers: check.readers.clone(),
                    members: check.members.clone(),
                    pieces: Vec::new(),
                }
            })
            .collect();
        RankPlan {
            rank: 0,
            world: self.world_size(),
            files: Vec::new(),
            tensors: meta.tensors().to_vec(),
            destinations: Vec::new(),
            pieces: Vec::new(),
            exchanges: Vec::new(),
            summary: RankSummary::default(),
            checkpoint_identity: meta.identity().map(str::to_string),
            joint_checks,
        }
    }
}
