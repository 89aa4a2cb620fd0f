//! Views of a computed plan for people rather than loaders: per-rank totals of every rank in one
//! small, columnar answer (what a preview of thousands of ranks draws from, instead of fetching
//! each rank's full plan), and one rank's plan boiled down to its reads by file and its ring
//! partners (what a drill-down shows).
//!
//! The totals are computed from the plan's pieces and groups in one pass, not by extracting every
//! rank plan: a 405B plan at 2,048 ranks holds millions of placements, and extracting each rank's
//! plan walks them per rank. They equal the `summary` of each rank plan field for field (tested).

use std::collections::HashMap;
use std::collections::hash_map::Entry;

use serde::{Deserialize, Serialize};
use tessera_planner::{Plan, RankPlan};
use utoipa::ToSchema;

/// A mesh dimension of the layout a plan was made for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct MeshDimView {
    /// Name (`pp`, `dp`, `tp`, …).
    pub name: String,
    /// Ranks along it.
    pub size: u32,
}

/// Per-rank totals as columns: entry `r` of each list is rank `r`'s.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RankColumns {
    /// Bytes of the rank's destination buffers.
    pub bytes_needed: Vec<u64>,
    /// Bytes the rank reads from storage.
    pub bytes_read: Vec<u64>,
    /// Bytes the rank sends to its ring partners.
    pub bytes_sent: Vec<u64>,
    /// Bytes the rank receives from its ring partners.
    pub bytes_received: Vec<u64>,
    /// Pieces the rank needs (read by itself or received).
    pub pieces: Vec<u64>,
    /// Pieces the rank reads from storage.
    pub pieces_read: Vec<u64>,
    /// Exchange groups (rings of more than one rank) the rank is in.
    pub groups: Vec<u64>,
    /// Ring rounds the rank sends or receives in, over all its groups.
    pub rounds: Vec<u64>,
}

impl RankColumns {
    fn zeros(world: usize) -> Self {
        Self {
            bytes_needed: vec![0; world],
            bytes_read: vec![0; world],
            bytes_sent: vec![0; world],
            bytes_received: vec![0; world],
            pieces: vec![0; world],
            pieces_read: vec![0; world],
            groups: vec![0; world],
            rounds: vec![0; world],
        }
    }

    /// The totals of every rank of `plan`.
    pub(crate) fn of_plan(plan: &Plan) -> Self {
        let world = plan.world_size() as usize;
        let tensors = plan.checkpoint().tensors();
        let mut c = Self::zeros(world);
        for r in 0..world {
            let rank = r as u32;
            c.bytes_needed[r] = plan
                .destinations(rank)
                .iter()
                .map(|d| d.target.numel() * tensors[d.tensor as usize].dtype.size())
                .sum();
            let reads = plan.reads(rank);
            c.pieces_read[r] = reads.len() as u64;
            c.bytes_read[r] = reads.iter().map(|&p| plan.piece_bytes(p)).sum();
        }
        // Per group: its pieces and bytes, and the bytes each of its readers reads for it. Every
        // member of a group needs every piece of it (a group is the set of ranks needing them).
        let groups = plan.groups();
        let mut group_pieces = vec![0u64; groups.len()];
        let mut group_bytes = vec![0u64; groups.len()];
        let mut readers: HashMap<(u32, u32), u64> = HashMap::new();
        let mut group_readers = vec![0u64; groups.len()];
        for (id, piece) in plan.pieces().iter().enumerate() {
            let bytes = plan.piece_bytes(id as u32);
            let g = piece.group as usize;
            group_pieces[g] += 1;
            group_bytes[g] += bytes;
            // Pieces are never empty, so a reader with a share has read something.
            match readers.entry((piece.group, piece.reader)) {
                Entry::Occupied(mut share) => *share.get_mut() += bytes,
                Entry::Vacant(share) => {
                    share.insert(bytes);
                    group_readers[g] += 1;
                }
            }
        }
        for (g, group) in groups.iter().enumerate() {
            let m = group.members.len() as u64;
            for &member in &group.members {
                let r = member as usize;
                let mine = readers.get(&(g as u32, member)).copied().unwrap_or(0);
                c.pieces[r] += group_pieces[g];
                c.bytes_received[r] += group_bytes[g] - mine;
                if m > 1 {
                    c.groups[r] += 1;
                    c.bytes_sent[r] += mine * (m - 1);
                    // The ring of `m` members has `m - 1` rounds; a member takes part in those
                    // where it sends (all of them once it read anything for the group) or where
                    // the member it receives from read something.
                    c.rounds[r] += if mine > 0 { m - 1 } else { group_readers[g] };
                }
            }
        }
        c
    }
}

/// `GET /v1/plans/{plan}/ranks`: every rank's totals, in columns.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct RankSummaries {
    /// Plan id.
    pub plan: String,
    /// Number of ranks.
    pub world: u32,
    /// The mesh of the layout planned for (rank numbering is row-major over it, last dim
    /// fastest); absent for explicit requests.
    pub mesh: Option<Vec<MeshDimView>>,
    /// Per-rank totals.
    pub ranks: RankColumns,
}

/// The reads of one rank from one data file.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct FileReads {
    /// Data file, relative to the checkpoint.
    pub file: String,
    /// Pieces read from it.
    pub pieces: u64,
    /// Bytes read from it.
    pub bytes: u64,
}

/// One ring round of a rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RoundView {
    /// Round number (1 to members - 1).
    pub round: u32,
    /// Rank sent to.
    pub send_to: u32,
    /// Rank received from.
    pub recv_from: u32,
    /// Bytes sent.
    pub send_bytes: u64,
    /// Bytes received.
    pub recv_bytes: u64,
}

/// One exchange ring of a rank.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ExchangeView {
    /// Group id.
    pub group: u32,
    /// Member ranks, ascending (the ring order).
    pub members: Vec<u32>,
    /// This rank's place in `members`.
    pub position: u32,
    /// Rounds in which this rank sends or receives.
    pub rounds: Vec<RoundView>,
}

/// `GET /v1/plans/{plan}/ranks/{rank}/overview`: one rank's plan, summed up.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RankOverview {
    /// Plan id.
    pub plan: String,
    /// The rank.
    pub rank: u32,
    /// Number of ranks.
    pub world: u32,
    /// Bytes of its destination buffers.
    pub bytes_needed: u64,
    /// Bytes read from storage.
    pub bytes_read: u64,
    /// Bytes sent to peers.
    pub bytes_sent: u64,
    /// Bytes received from peers.
    pub bytes_received: u64,
    /// Destination buffers.
    pub destinations: u64,
    /// Tensors it touches.
    pub tensors: u64,
    /// Pieces it needs.
    pub pieces: u64,
    /// Its reads, by data file (most bytes first).
    pub reads: Vec<FileReads>,
    /// Its exchange rings (groups of more than one rank).
    pub exchanges: Vec<ExchangeView>,
}

impl RankOverview {
    pub(crate) fn new(plan: &str, rp: &RankPlan) -> Self {
        let mut by_file: Vec<FileReads> = rp
            .files
            .iter()
            .map(|f| FileReads {
                file: f.clone(),
                pieces: 0,
                bytes: 0,
            })
            .collect();
        for piece in &rp.pieces {
            let Some(read) = &piece.read else { continue };
            if let Some(entry) = by_file.get_mut(read.file as usize) {
                entry.pieces += 1;
                entry.bytes += read.runs.total_bytes();
            }
        }
        by_file.sort_by(|a, b| b.bytes.cmp(&a.bytes).then_with(|| a.file.cmp(&b.file)));
        Self {
            plan: plan.to_string(),
            rank: rp.rank,
            world: rp.world,
            bytes_needed: rp.summary.bytes_needed,
            bytes_read: rp.summary.bytes_read,
            bytes_sent: rp.summary.bytes_sent,
            bytes_received: rp.summary.bytes_received,
            destinations: rp.destinations.len() as u64,
            tensors: rp.tensors.len() as u64,
            pieces: rp.pieces.len() as u64,
            reads: by_file,
            exchanges: rp
                .exchanges
                .iter()
                .map(|e| ExchangeView {
                    group: e.group,
                    members: e.members.clone(),
                    position: e.position,
                    rounds: e
                        .rounds
                        .iter()
                        .map(|r| RoundView {
                            round: r.round,
                            send_to: r.send_to,
                            recv_from: r.recv_from,
                            send_bytes: r.send_bytes,
                            recv_bytes: r.recv_bytes,
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}
