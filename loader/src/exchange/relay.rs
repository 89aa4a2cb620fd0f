//! Relayed pieces: a plan that reads a saved chunk in storage order (see the planner's
//! `read_order`) has a slab's reader read parts of it that only other ranks need, and send them
//! on. Such a piece lands in none of the rank's destinations (`places` is empty), but the read
//! path places what it reads into destination buffers and the exchange gathers what it sends
//! back out of them. So the rank gets one scratch buffer per relayed piece, appended after the
//! caller's destinations as an extra destination of a copy of the plan: read, verification,
//! placement and the ring then run unchanged, and the caller's buffers stay exactly the plan's.

use tessera_metadata::row_major_strides;
use tessera_planner::{PiecePlacement, RankDestination, RankPlan, Side, StridedRuns, Target};

/// The plan with a scratch destination for every piece this rank only relays, or `None` when it
/// relays nothing (the plan is used as it is).
pub fn with_relay_buffers(plan: &RankPlan) -> Option<RankPlan> {
    if !plan
        .pieces
        .iter()
        .any(|p| p.read.is_some() && p.places.is_empty())
    {
        return None;
    }
    let mut relaying = plan.clone();
    for p in &mut relaying.pieces {
        if p.read.is_none() || !p.places.is_empty() {
            continue;
        }
        let esize = relaying
            .tensors
            .get(p.tensor as usize)
            .map_or(1, |t| t.dtype.size());
        // The scratch buffer is the piece's wire layout itself: row-major over the piece.
        let strides = row_major_strides(&p.region.lengths);
        let side = Side {
            origin: 0,
            strides: &strides,
        };
        let runs = StridedRuns::new(esize, &p.region.lengths, side, side);
        p.places.push(PiecePlacement {
            destination: relaying.destinations.len() as u32,
            runs,
        });
        relaying.destinations.push(RankDestination {
            tensor: p.tensor,
            target: Target::Box(p.region.clone()),
            bytes: p.bytes,
        });
    }
    Some(relaying)
}

/// A destination buffer of a relaying rank: the caller's, or a scratch buffer of a relayed piece.
pub enum Slot<'a, B> {
    /// One of the caller's destination buffers.
    Caller(&'a mut B),
    /// A relayed piece's bytes between its read and its sends.
    Scratch(Vec<u8>),
}

impl<B: AsRef<[u8]>> AsRef<[u8]> for Slot<'_, B> {
    fn as_ref(&self) -> &[u8] {
        match self {
            Slot::Caller(b) => (**b).as_ref(),
            Slot::Scratch(v) => v,
        }
    }
}

impl<B: AsMut<[u8]>> AsMut<[u8]> for Slot<'_, B> {
    fn as_mut(&mut self) -> &mut [u8] {
        match self {
            Slot::Caller(b) => (**b).as_mut(),
            Slot::Scratch(v) => v,
        }
    }
}

/// The caller's `buffers` followed by a zeroed scratch buffer for every destination `relaying`
/// (from [`with_relay_buffers`]) added, its pages faulted in up front where large
/// ([`crate::load::host_memory::zeroed_buffer`]).
pub fn slots<'a, B>(relaying: &RankPlan, buffers: &'a mut [B]) -> Vec<Slot<'a, B>> {
    let added = relaying.destinations.len().saturating_sub(buffers.len());
    let scratch = relaying.destinations[relaying.destinations.len() - added..]
        .iter()
        .map(|d| Slot::Scratch(crate::load::host_memory::zeroed_buffer(d.bytes as usize)));
    buffers
        .iter_mut()
        .map(Slot::Caller)
        .chain(scratch)
        .collect()
}
