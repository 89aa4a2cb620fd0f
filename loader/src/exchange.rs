//! The ring all-to-all of a rank plan: every member of a group hands the pieces it read for the
//! group to every other member, one peer per round (round k: send to member i + k, receive from
//! member i − k). One message per round carries the sender's whole share, the concatenation of
//! its pieces' wire bytes in the order the round lists them; the tag names the group and round.
//!
//! All of a rank's sends are started together with all of its receives, whatever the group:
//! transports buffer what arrives before it is asked for, so no interleaving of groups and ranks
//! can deadlock, and a rank waits at most one transport timeout for its slowest peer.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use futures::future::Either;
use futures::stream::FuturesUnordered;
use tessera_planner::{RankPlan, Round};

use crate::LoaderError;
use crate::place::{gather_piece, place_piece};
use crate::transport::{Transport, exchange_tag};

/// Puts the group and round into a transport error, which only knows the tag.
fn in_round(error: LoaderError, group: u32, round: u32, tag: u64) -> LoaderError {
    error.in_context(
        &format!("group {group} round {round}"),
        &format!("group {group} round {round} (tag {tag:#x})"),
    )
}

/// What one rank's exchange moved.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExchangeStats {
    /// Bytes this rank sent (equals the plan's `summary.bytes_sent`).
    pub bytes_sent: u64,
    /// Bytes this rank received (equals the plan's `summary.bytes_received`).
    pub bytes_received: u64,
    /// Messages this rank sent plus messages it received.
    pub messages: u64,
    /// Wall time of the exchange, gathering included.
    pub elapsed: Duration,
}

/// A message this rank expects.
struct Incoming {
    group: u32,
    round: u32,
    from: u32,
    tag: u64,
    /// Indices into `plan.pieces`, in message order.
    pieces: Vec<usize>,
    bytes: u64,
}

/// A message this rank sends.
struct Outgoing {
    group: u32,
    round: u32,
    to: u32,
    tag: u64,
    data: Bytes,
}

/// A plan error naming the rank (shared with the device ring).
pub(crate) fn invalid(plan: &RankPlan, detail: String) -> LoaderError {
    LoaderError::InvalidPlan {
        detail: format!("rank {}: {detail}", plan.rank),
    }
}

/// Checks that a rank's transport (or data plane) is the one `plan` is for.
pub(crate) fn check_rank(plan: &RankPlan, rank: u32, world: u32) -> Result<(), LoaderError> {
    if rank != plan.rank || world != plan.world {
        return Err(invalid(
            plan,
            format!(
                "the plan is for rank {} of {} but the transport is rank {rank} of {world}",
                plan.rank, plan.world
            ),
        ));
    }
    Ok(())
}

/// Checks a rank's destination buffers, given by their sizes, against `plan`: one per plan
/// destination, each of its destination's bytes. The detail names the first mismatch (callers
/// wrap it in their error: host or device memory).
pub(crate) fn check_buffer_sizes(
    plan: &RankPlan,
    sizes: impl ExactSizeIterator<Item = u64>,
) -> Result<(), String> {
    if sizes.len() != plan.destinations.len() {
        return Err(format!(
            "{} destination buffers given for the plan's {} destinations",
            sizes.len(),
            plan.destinations.len()
        ));
    }
    for (i, (len, dest)) in sizes.zip(&plan.destinations).enumerate() {
        if len != dest.bytes {
            let fqn = plan
                .tensors
                .get(dest.tensor as usize)
                .map_or("?", |t| t.fqn.as_str());
            return Err(format!(
                "destination {i} ({fqn}) is {len} bytes but the plan needs {}",
                dest.bytes
            ));
        }
    }
    Ok(())
}

/// Index into `plan.pieces` of the piece with plan-wide id `id` (pieces are in id order).
pub(crate) fn piece_index(plan: &RankPlan, id: u32, group: u32) -> Result<usize, LoaderError> {
    plan.pieces
        .binary_search_by_key(&id, |p| p.id)
        .map_err(|_| {
            invalid(
                plan,
                format!("group {group} exchanges piece {id}, which this rank's plan does not list"),
            )
        })
}

/// Which half of a round.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Direction {
    /// The pieces this rank sends.
    Send,
    /// The pieces this rank receives.
    Recv,
}

/// A round's pieces in one direction as indices into `plan.pieces`, with their total bytes,
/// checked against the plan: every piece is listed, a piece sent is one this rank reads, and the
/// bytes are what the round declares. (Shared with the device ring.)
pub(crate) fn round_pieces(
    plan: &RankPlan,
    group: u32,
    round: &Round,
    direction: Direction,
) -> Result<(Vec<usize>, u64), LoaderError> {
    let r = round.round;
    let (ids, declared, verb) = match direction {
        Direction::Send => (&round.send, round.send_bytes, "send"),
        Direction::Recv => (&round.recv, round.recv_bytes, "receive"),
    };
    let pieces = ids
        .iter()
        .map(|&id| {
            let index = piece_index(plan, id, group)?;
            if direction == Direction::Send && plan.pieces[index].read.is_none() {
                return Err(invalid(
                    plan,
                    format!(
                        "group {group} round {r} sends piece {id}, which this rank does not read"
                    ),
                ));
            }
            Ok(index)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bytes: u64 = pieces.iter().map(|&i| plan.pieces[i].bytes).sum();
    if bytes != declared {
        return Err(invalid(
            plan,
            format!(
                "group {group} round {r}: the pieces to {verb} hold {bytes} bytes but the round says {declared}"
            ),
        ));
    }
    Ok((pieces, bytes))
}

/// Runs every ring exchange of `plan` over `transport`, placing what arrives into `buffers` (one
/// per plan destination, as from [`crate::place::allocate`]).
///
/// Precondition: every piece this rank reads (`read.is_some()`) is already placed in `buffers`;
/// what this rank sends is gathered back out of them. Sizes are checked against the plan before
/// anything is sent, and every message's length when it arrives.
pub async fn run_exchanges<T: Transport, B: AsMut<[u8]> + AsRef<[u8]>>(
    transport: &T,
    plan: &RankPlan,
    buffers: &mut [B],
) -> Result<ExchangeStats, LoaderError> {
    let start = Instant::now();
    check_rank(plan, transport.rank(), transport.world())?;
    check_buffer_sizes(plan, buffers.iter().map(|b| b.as_ref().len() as u64))
        .map_err(|detail| invalid(plan, detail))?;

    let mut outgoing: Vec<Outgoing> = Vec::new();
    let mut incoming: Vec<Incoming> = Vec::new();
    let (mut plan_sent, mut plan_received) = (0u64, 0u64);
    for exchange in &plan.exchanges {
        let group = exchange.group;
        // A member sends the same share in every round: gather it once.
        let mut share: Option<(Vec<u32>, Bytes)> = None;
        for round in &exchange.rounds {
            let tag = exchange_tag(group, round.round);
            if !round.send.is_empty() {
                let data = match &share {
                    Some((ids, data)) if *ids == round.send => data.clone(),
                    _ => {
                        let (pieces, bytes) = round_pieces(plan, group, round, Direction::Send)?;
                        let mut message = Vec::with_capacity(bytes as usize);
                        for index in pieces {
                            message.extend_from_slice(&gather_piece(plan, index, buffers)?);
                        }
                        let data = Bytes::from(message);
                        share = Some((round.send.clone(), data.clone()));
                        data
                    }
                };
                if data.len() as u64 != round.send_bytes {
                    return Err(invalid(
                        plan,
                        format!(
                            "group {group} round {}: the pieces to send hold {} bytes but the round says {}",
                            round.round,
                            data.len(),
                            round.send_bytes
                        ),
                    ));
                }
                plan_sent += round.send_bytes;
                outgoing.push(Outgoing {
                    group,
                    round: round.round,
                    to: round.send_to,
                    tag,
                    data,
                });
            }
            if !round.recv.is_empty() {
                let (pieces, bytes) = round_pieces(plan, group, round, Direction::Recv)?;
                plan_received += bytes;
                incoming.push(Incoming {
                    group,
                    round: round.round,
                    from: round.recv_from,
                    tag,
                    pieces,
                    bytes,
                });
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

    let mut stats = ExchangeStats {
        messages: (outgoing.len() + incoming.len()) as u64,
        ..ExchangeStats::default()
    };
    // Every send runs to completion, even after a receive failed: peers buffer what arrives, so
    // this costs at most one transport timeout per send (a dead peer fails at once), and live
    // peers then get everything this rank owes them and fail, if at all, naming the rank that
    // actually died rather than this one.
    let sends = async {
        let results = futures::future::join_all(outgoing.iter().map(|message| async move {
            transport
                .send(message.to, message.tag, message.data.clone())
                .await
                .map_err(|e| in_round(e, message.group, message.round, message.tag))?;
            Ok::<u64, LoaderError>(message.data.len() as u64)
        }))
        .await;
        results.into_iter().sum::<Result<u64, LoaderError>>()
    };
    let receives = async {
        let mut pending: FuturesUnordered<_> = incoming
            .iter()
            .map(|expect| async move {
                let data = transport
                    .recv(expect.from, expect.tag)
                    .await
                    .map_err(|e| in_round(e, expect.group, expect.round, expect.tag))?;
                Ok::<_, LoaderError>((expect, data))
            })
            .collect();
        let mut received = 0u64;
        while let Some(arrived) = pending.next().await {
            let (expect, data) = arrived?;
            if data.len() as u64 != expect.bytes {
                return Err(LoaderError::Transport {
                    rank: plan.rank,
                    peer: expect.from,
                    detail: format!(
                        "group {} round {}: expected {} bytes (pieces {:?}) but got {}",
                        expect.group,
                        expect.round,
                        expect.bytes,
                        expect
                            .pieces
                            .iter()
                            .map(|&i| plan.pieces[i].id)
                            .collect::<Vec<_>>(),
                        data.len()
                    ),
                });
            }
            let mut at = 0usize;
            for &index in &expect.pieces {
                let len = plan.pieces[index].bytes as usize;
                place_piece(plan, index, &data[at..at + len], buffers)?;
                at += len;
            }
            received += data.len() as u64;
        }
        Ok(received)
    };
    let (mut sends, mut receives) = (std::pin::pin!(sends), std::pin::pin!(receives));
    let (sent, received) = match futures::future::select(sends.as_mut(), receives.as_mut()).await {
        // Sends done first. A failed one means a peer misses this rank's share (the exchange is
        // lost either way): report it without waiting for the receives.
        Either::Left((sent, _)) => {
            let sent = sent?;
            (sent, receives.await?)
        }
        // A failed receive is reported once the sends are done.
        Either::Right((received, _)) => {
            let sent = sends.await;
            let received = received?;
            (sent?, received)
        }
    };
    stats.bytes_sent = sent;
    stats.bytes_received = received;
    stats.elapsed = start.elapsed();
    Ok(stats)
}
