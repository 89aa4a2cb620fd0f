//! What two ranks of one job must agree on before either passes the other a byte: every share
//! one sends the other (its group, round and each piece's descriptor, in wire order) and every
//! saved box they verify together. A rank plan only holds what its rank reads, receives and
//! places, so no rank can digest the whole plan; but every byte that crosses between two ranks
//! is described on both of them, and [`RankPlan::peer_digests`] digests exactly that, the same
//! way on both ends. Two ranks handed rank plans of different plans of the same requests (piece
//! id 0 is rows 0..64 on one and rows 64..128 on the other) compute different digests for each
//! other and are refused before the exchange. What no pair shares (a rank's own reads and
//! placements) is checked by each rank alone: [`RankPlan::check_against`] against the opened
//! checkpoint, [`RankPlan::check_destinations`] against its own requests.

use std::collections::HashMap;

use tessera_metadata::{TensorBox, TensorMeta};

use crate::{RankPlan, Target};

/// FNV-1a over length-prefixed fields: stable across processes and builds (unlike std's
/// hasher); each field's length goes first, so that ("ab", "c") and ("a", "bc") differ.
#[derive(Clone)]
struct Fnv(u64);

impl Fnv {
    fn new() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for byte in (bytes.len() as u64).to_le_bytes().iter().chain(bytes) {
            self.0 ^= u64::from(*byte);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    fn u64(&mut self, value: u64) {
        self.bytes(&value.to_le_bytes());
    }

    fn u64s(&mut self, values: impl IntoIterator<Item = u64>) {
        let values: Vec<u64> = values.into_iter().collect();
        self.u64(values.len() as u64);
        for v in values {
            self.u64(v);
        }
    }

    fn tensor(&mut self, tensor: &TensorMeta) {
        self.bytes(tensor.fqn.as_bytes());
        self.bytes(tensor.dtype.to_string().as_bytes());
        self.u64s(tensor.shape.iter().copied());
    }

    fn region(&mut self, region: &TensorBox) {
        self.u64s(region.offsets.iter().copied());
        self.u64s(region.lengths.iter().copied());
    }
}

impl RankPlan {
    /// One digest per rank of the world (this rank's own entry digests nothing but the plan's
    /// checkpoint identity and world): for peer `p`, what this rank and `p` pass each other
    /// (shares either way: sender, receiver, group, round, and for each piece in wire order its
    /// id, tensor, box, bytes, group and reader) and the saved boxes both verify jointly (id,
    /// tensor, box, readers, members), over the checkpoint identity and world. Rank `p`'s plan
    /// computes the same value for this rank exactly when the two plans describe those bytes
    /// alike. A piece id this plan does not hold digests as unknown (and so disagrees).
    pub fn peer_digests(&self) -> Vec<u64> {
        let base = self.pair_base();
        let mut all = vec![base.clone().finish_empty(); self.world as usize];
        for (peer, digest) in self.pair_digests() {
            if let Some(slot) = all.get_mut(peer as usize) {
                *slot = digest;
            }
        }
        all
    }

    /// The digest of a pair of ranks that pass each other nothing (what
    /// [`RankPlan::peer_digests`] holds for every peer [`RankPlan::pair_digests`] does not list).
    pub fn empty_pair_digest(&self) -> u64 {
        self.pair_base().finish_empty()
    }

    fn pair_base(&self) -> Fnv {
        let mut base = Fnv::new();
        base.bytes(b"tessera rank-pair plan digest v1");
        base.u64(u64::from(self.world));
        base.bytes(self.checkpoint_identity.as_deref().unwrap_or("").as_bytes());
        base
    }

    /// [`RankPlan::peer_digests`] of the peers this rank passes something (ascending), without
    /// the world-long list: what the job's plan agreement sends, so that its cost grows with the
    /// rank's peers, not with the job.
    pub fn pair_digests(&self) -> Vec<(u32, u64)> {
        let base = self.pair_base();
        let by_id: HashMap<u32, usize> = self
            .pieces
            .iter()
            .enumerate()
            .map(|(i, p)| (p.id, i))
            .collect();
        // Each entry's digest, per peer; sorted before they are folded, so that both ends (which
        // list the same shares in their own order of groups) fold them alike.
        let mut entries: std::collections::BTreeMap<u32, Vec<u64>> =
            std::collections::BTreeMap::new();
        let share = |from: u32, to: u32, group: u32, round: u32, ids: &[u32]| {
            let mut h = Fnv::new();
            h.bytes(b"share");
            for v in [from, to, group, round] {
                h.u64(u64::from(v));
            }
            h.u64(ids.len() as u64);
            for id in ids {
                h.u64(u64::from(*id));
                match by_id.get(id).map(|&i| &self.pieces[i]) {
                    Some(piece) => {
                        match self.tensors.get(piece.tensor as usize) {
                            Some(tensor) => h.tensor(tensor),
                            None => h.bytes(b"unknown tensor"),
                        }
                        h.region(&piece.region);
                        h.u64(piece.bytes);
                        h.u64(u64::from(piece.group));
                        h.u64(u64::from(piece.reader));
                    }
                    None => h.bytes(b"unknown piece"),
                }
            }
            h.0
        };
        let world = self.world;
        let mut add = |peer: u32, digest: u64| {
            if peer < world {
                entries.entry(peer).or_default().push(digest);
            }
        };
        for exchange in &self.exchanges {
            for round in &exchange.rounds {
                if !round.send.is_empty() {
                    let d = share(
                        self.rank,
                        round.send_to,
                        exchange.group,
                        round.round,
                        &round.send,
                    );
                    add(round.send_to, d);
                }
                if !round.recv.is_empty() {
                    let d = share(
                        round.recv_from,
                        self.rank,
                        exchange.group,
                        round.round,
                        &round.recv,
                    );
                    add(round.recv_from, d);
                }
            }
        }
        for check in &self.joint_checks {
            let mut h = Fnv::new();
            h.bytes(b"joint check");
            h.u64(u64::from(check.id));
            match self.tensors.get(check.tensor as usize) {
                Some(tensor) => h.tensor(tensor),
                None => h.bytes(b"unknown tensor"),
            }
            h.region(&check.region);
            h.u64s(check.readers.iter().map(|&r| u64::from(r)));
            h.u64s(check.members.iter().map(|&r| u64::from(r)));
            for &member in &check.members {
                if member != self.rank {
                    add(member, h.0);
                }
            }
        }
        entries
            .into_iter()
            .map(|(peer, mut list)| {
                list.sort_unstable();
                let mut h = base.clone();
                h.u64s(list);
                (peer, h.0)
            })
            .collect()
    }
}

impl Fnv {
    /// The digest of a base with no entries (as `pair_digests` folds an empty list).
    fn finish_empty(mut self) -> u64 {
        self.u64s(std::iter::empty());
        self.0
    }
}

/// A destination's target as text for errors.
pub(crate) fn target_text(target: &Target) -> String {
    match target {
        Target::Box(b) => format!("box at {:?} of {:?}", b.offsets, b.lengths),
        Target::Flat { start, end } => format!("flat range [{start}, {end})"),
    }
}
