//! The plan's ring all-to-all on a data plane, device to device: the grouped fast path.
//!
//! Every rank walks its exchanges in ascending group id and each ring's rounds in ascending
//! round number, and runs each round as one group of operations (NCCL: `ncclGroupStart`, the
//! send to `send_to` and the receive from `recv_from`, `ncclGroupEnd`). Why that cannot deadlock
//! although NCCL sends wait for their receives: the (group, round) pairs are totally ordered and
//! every rank takes its own in that order, so the smallest unfinished pair has every member
//! already posting it, and it completes.
//!
//! What a rank sends is gathered on the device from its destination buffers (the pieces it read
//! were uploaded there), into one scratch buffer per group (a member sends the same share every
//! round); what it receives lands in a scratch buffer and is scattered into the destinations
//! through the pieces' place runs. No byte goes through host memory.

use std::time::Instant;

use tessera_planner::{RankPlan, StridedRuns};

use super::{DataPlane, PlaneOp, check_runs};
use crate::LoaderError;
use crate::device::DeviceMemory;
use crate::exchange::{Direction, ExchangeStats, check_buffer_sizes, invalid, round_pieces};

/// Puts the group and round into a data plane error.
fn in_round(error: LoaderError, group: u32, round: u32) -> LoaderError {
    let context = format!("group {group} round {round}");
    error.in_context(&context, &context)
}

/// Gathers the wire bytes of `pieces` (back to back) from their first destinations into `share`.
fn gather<P: DataPlane>(
    plane: &mut P,
    plan: &RankPlan,
    pieces: &[usize],
    destinations: &[P::Buffer],
    share: &P::Buffer,
) -> Result<u64, LoaderError> {
    let device = plane.device();
    let mut at = 0u64;
    for &index in pieces {
        let piece = &plan.pieces[index];
        let Some(first) = piece.places.first() else {
            return Err(invalid(plan, format!("piece {} lands nowhere", piece.id)));
        };
        let Some(source) = destinations.get(first.destination as usize) else {
            return Err(invalid(
                plan,
                format!(
                    "piece {} lands in missing destination {}",
                    piece.id, first.destination
                ),
            ));
        };
        let mut runs = first.runs.reversed();
        runs.dst_offset = runs.dst_offset.saturating_add(at);
        check_runs(
            &device,
            &format!("gathering piece {}", piece.id),
            &runs,
            source.len(),
            share.len(),
        )?;
        plane.copy_runs(&runs, source, share)?;
        at += piece.bytes;
    }
    Ok(at)
}

/// Scatters `pieces`, back to back in `received`, into every destination they land in.
fn scatter<P: DataPlane>(
    plane: &mut P,
    plan: &RankPlan,
    pieces: &[usize],
    received: &P::Buffer,
    destinations: &[P::Buffer],
) -> Result<(), LoaderError> {
    let device = plane.device();
    let mut at = 0u64;
    for &index in pieces {
        let piece = &plan.pieces[index];
        for placement in &piece.places {
            let Some(target) = destinations.get(placement.destination as usize) else {
                return Err(invalid(
                    plan,
                    format!(
                        "piece {} lands in missing destination {}",
                        piece.id, placement.destination
                    ),
                ));
            };
            let runs = StridedRuns {
                src_offset: placement.runs.src_offset.saturating_add(at),
                ..placement.runs.clone()
            };
            check_runs(
                &device,
                &format!("placing piece {}", piece.id),
                &runs,
                received.len(),
                target.len(),
            )?;
            plane.copy_runs(&runs, received, target)?;
        }
        at += piece.bytes;
    }
    Ok(())
}

/// Runs every ring exchange of `plan` on `plane`, device to device (see the module docs), into
/// `destinations` (one per plan destination, of the plan's sizes).
///
/// Precondition: the pieces this rank reads are already in `destinations`.
pub fn ring_exchange<P: DataPlane>(
    plane: &mut P,
    plan: &RankPlan,
    destinations: &[P::Buffer],
) -> Result<ExchangeStats, LoaderError> {
    let start = Instant::now();
    check_buffer_sizes(plan, destinations.iter().map(|b| b.len() as u64))
        .map_err(|detail| invalid(plan, detail))?;
    // Every rank must walk the pairs in the same order: ascending group, then round. All of it
    // is checked before anything moves, so a bad plan fails here instead of stranding peers.
    let mut exchanges: Vec<_> = plan.exchanges.iter().collect();
    exchanges.sort_by_key(|e| e.group);
    let mut steps = Vec::new();
    let (mut plan_sent, mut plan_received) = (0u64, 0u64);
    for exchange in exchanges {
        let group = exchange.group;
        let mut rounds: Vec<_> = exchange.rounds.iter().collect();
        rounds.sort_by_key(|r| r.round);
        for round in rounds {
            let r = round.round;
            let send = if round.send.is_empty() {
                None
            } else {
                let (pieces, bytes) = round_pieces(plan, group, round, Direction::Send)?;
                plan_sent += bytes;
                Some((round.send_to, pieces, bytes))
            };
            let recv = if round.recv.is_empty() {
                None
            } else {
                let (pieces, bytes) = round_pieces(plan, group, round, Direction::Recv)?;
                plan_received += bytes;
                Some((round.recv_from, pieces, bytes))
            };
            if send.is_some() || recv.is_some() {
                steps.push((group, r, send, recv));
            }
        }
    }
    if plan_sent != plan.summary.bytes_sent || plan_received != plan.summary.bytes_received {
        return Err(invalid(
            plan,
            format!(
                "the exchange rounds send {plan_sent} and receive {plan_received} bytes but the summary says {} and {}",
                plan.summary.bytes_sent, plan.summary.bytes_received
            ),
        ));
    }

    let mut stats = ExchangeStats::default();
    // A member sends the same share in every round of its group: gathered once.
    let mut share: Option<(u32, Vec<usize>, P::Buffer)> = None;
    // One receive buffer for the whole exchange, grown to the largest round.
    let mut inbox: Option<P::Buffer> = None;
    for (group, r, send, recv) in steps {
        if let Some((_, pieces, bytes)) = &send
            && share
                .as_ref()
                .is_none_or(|(g, ids, _)| *g != group || ids != pieces)
        {
            // Free the previous share before allocating the next.
            drop(share.take());
            let buffer = plane
                .alloc(*bytes as usize)
                .map_err(|e| in_round(e, group, r))?;
            gather(plane, plan, pieces, destinations, &buffer)
                .map_err(|e| in_round(e, group, r))?;
            share = Some((group, pieces.clone(), buffer));
        }
        if let Some((_, _, bytes)) = &recv
            && inbox.as_ref().is_none_or(|b| (b.len() as u64) < *bytes)
        {
            drop(inbox.take());
            inbox = Some(
                plane
                    .alloc(*bytes as usize)
                    .map_err(|e| in_round(e, group, r))?,
            );
        }
        let mut ops = Vec::with_capacity(2);
        if let (Some((to, _, bytes)), Some((_, _, buffer))) = (&send, &share) {
            ops.push(PlaneOp::Send {
                peer: *to,
                buffer,
                len: *bytes as usize,
            });
        }
        if let (Some((from, _, bytes)), Some(buffer)) = (&recv, &inbox) {
            ops.push(PlaneOp::Recv {
                peer: *from,
                buffer,
                len: *bytes as usize,
            });
        }
        plane.group(&ops).map_err(|e| in_round(e, group, r))?;
        stats.messages += ops.len() as u64;
        if let Some((_, _, bytes)) = &send {
            stats.bytes_sent += bytes;
        }
        if let (Some((_, pieces, bytes)), Some(buffer)) = (&recv, &inbox) {
            scatter(plane, plan, pieces, buffer, destinations)
                .map_err(|e| in_round(e, group, r))?;
            stats.bytes_received += bytes;
        }
    }
    // The last scatter's copies may still be running; whoever reads the destinations next may
    // do so on another stream.
    plane.synchronize()?;
    stats.elapsed = start.elapsed();
    Ok(stats)
}
