//! The ring all-to-all of a rank plan: every member of a group hands the pieces it read for the
//! group to every other member, one peer per round (round k: send to member i + k, receive from
//! member i − k). A round's share is the concatenation of its pieces' wire bytes in the order the
//! round lists them, sent whole or, when large, in parts ([`SHARE_PART_BYTES`]); the tag names
//! the group, round and part.
//!
//! This module holds the messages ([`ExchangeMessages`]: which pieces go to whom, checked against
//! the plan) and how bytes get in and out of a rank's buffers ([`place`], [`relay`] scratch for
//! pieces read only to pass on, [`direct`] copies out of a peer's memory on one host). What is
//! sent when is [`protocol`], a state machine without I/O that every path drives: the async
//! driver over a `Transport` (`drive`, beside the reads) and the Python package over a torch
//! process group.
//!
//! All of a rank's receives are posted at once, whatever the group: transports buffer what
//! arrives before it is asked for, so no interleaving of groups and ranks can deadlock, and a rank
//! waits at most one transport timeout for its slowest peer.

pub mod agree;
pub mod direct;
pub(crate) mod drive;
pub mod place;
pub mod protocol;
pub mod relay;

use std::time::{Duration, Instant};

use tessera_planner::{RankPlan, Round};

use crate::LoaderError;
use crate::exchange::direct::{PeerMemory, ShareDescriptor, push_span};
use crate::exchange::place::{copy_to_other_places, gather_piece, place_piece, wire_spans};
use crate::transport::{MAX_ROUNDS, MAX_SHARE_PARTS, Transport, share_part_tag};

/// Puts the group and round into a transport error, which only knows the tag.
pub(crate) fn in_round(error: LoaderError, group: u32, round: u32, tag: u64) -> LoaderError {
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
    /// Of `bytes_received`, the bytes copied straight out of peers' memory on this host.
    pub bytes_received_direct: u64,
    /// Messages this rank sent plus messages it received.
    pub messages: u64,
    /// Wall time of the exchange, gathering included.
    pub elapsed: Duration,
    /// Of the time after this rank's own reads, the time it had nothing to place: waiting for
    /// peers' shares (a peer still reading, or the bytes still on their way). It varies with the
    /// peers' reads, not with this rank's part of the exchange.
    pub waited: Duration,
}

/// A message this rank expects: (a part of) the share `from` sends it in one round of one group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Incoming {
    /// The exchange group.
    pub group: u32,
    /// The round within the group.
    pub round: u32,
    /// Which part of the round's share (0 for the first; see [`SHARE_PART_BYTES`]).
    pub part: u32,
    /// The sending rank.
    pub from: u32,
    /// The transport tag ([`share_part_tag`]).
    pub tag: u64,
    /// Indices into `plan.pieces`, in message order.
    pub pieces: Vec<usize>,
    /// Bytes of the message (the pieces' wire bytes, concatenated).
    pub bytes: u64,
}

/// A message this rank sends: (a part of) its share of one group to one peer in one round.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Outgoing {
    /// The exchange group.
    pub group: u32,
    /// The round within the group.
    pub round: u32,
    /// Which part of the round's share (0 for the first; see [`SHARE_PART_BYTES`]).
    pub part: u32,
    /// The receiving rank.
    pub to: u32,
    /// The transport tag ([`share_part_tag`]).
    pub tag: u64,
    /// Indices into `plan.pieces` (pieces this rank reads), in message order.
    pub pieces: Vec<usize>,
    /// Bytes of the message.
    pub bytes: u64,
}

/// Exchange groups a job may have: tags keep their top two bits for the direct-copy hand-shake.
pub const MAX_GROUPS: u32 = 1 << 30;

/// Every message of a rank's ring exchanges, checked against its plan: what it sends (gathered
/// from its destination buffers once its own pieces are placed) and what it receives. The
/// transport-independent half of [`run_exchanges`], also driven from outside tessera's transports
/// (the Python package passes these messages over the job's own torch process group).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ExchangeMessages {
    /// Messages to send, in plan order.
    pub outgoing: Vec<Outgoing>,
    /// Messages to receive, in plan order.
    pub incoming: Vec<Incoming>,
}

impl ExchangeMessages {
    /// The messages of `plan`'s exchanges, checked: every piece listed by the plan, every piece
    /// sent one this rank reads, every round's bytes what it declares, and the totals what the
    /// plan's summary says.
    pub fn of_plan(plan: &RankPlan) -> Result<Self, LoaderError> {
        Self::of_plan_in_parts(plan, SHARE_PART_BYTES)
    }

    /// [`Self::of_plan`] with shares cut into parts of `part_bytes` instead of
    /// [`SHARE_PART_BYTES`]. Every rank of a load must cut with the same size: a part's tag
    /// names its place in the share, and the receiver expects the sender's cut.
    pub fn of_plan_in_parts(plan: &RankPlan, part_bytes: u64) -> Result<Self, LoaderError> {
        let mut messages = ExchangeMessages::default();
        let (mut plan_sent, mut plan_received) = (0u64, 0u64);
        for exchange in &plan.exchanges {
            let group = exchange.group;
            if group >= MAX_GROUPS {
                return Err(invalid(
                    plan,
                    format!(
                        "exchange group {group} is past the {MAX_GROUPS} groups a job's exchange tags can name"
                    ),
                ));
            }
            for round in &exchange.rounds {
                if round.round >= MAX_ROUNDS {
                    return Err(invalid(
                        plan,
                        format!(
                            "group {group} round {} is past the {MAX_ROUNDS} rounds a ring's tags can name",
                            round.round
                        ),
                    ));
                }
                if !round.send.is_empty() {
                    let (pieces, bytes) = round_pieces(plan, group, round, Direction::Send)?;
                    plan_sent += bytes;
                    for (part, pieces, bytes) in share_parts(plan, pieces, part_bytes) {
                        messages.outgoing.push(Outgoing {
                            group,
                            round: round.round,
                            part,
                            to: round.send_to,
                            tag: share_part_tag(group, round.round, part),
                            pieces,
                            bytes,
                        });
                    }
                }
                if !round.recv.is_empty() {
                    let (pieces, bytes) = round_pieces(plan, group, round, Direction::Recv)?;
                    plan_received += bytes;
                    for (part, pieces, bytes) in share_parts(plan, pieces, part_bytes) {
                        messages.incoming.push(Incoming {
                            group,
                            round: round.round,
                            part,
                            from: round.recv_from,
                            tag: share_part_tag(group, round.round, part),
                            pieces,
                            bytes,
                        });
                    }
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
        Ok(messages)
    }
}

/// A share (the pieces one reader sends a peer in one round) larger than this goes in parts of
/// about this size, cut between pieces in plan order. With the exchange beside the reads
/// (`exchange::drive`) a part goes out as soon as its own pieces are read, so the peer's copy of
/// a large share runs while the rest is still being read instead of all of it after the last
/// read; a part this large keeps the per-message cost (a descriptor and an acknowledgement for a
/// direct copy) negligible.
pub const SHARE_PART_BYTES: u64 = 64 << 20;

/// `pieces` (a share, in plan order) cut into consecutive parts of at least `part_bytes` each
/// (the last may be smaller; a larger piece is a part of its own), at most [`MAX_SHARE_PARTS`]
/// (the part size grows for a share that would need more): (part, pieces, bytes) each. Sender
/// and receiver cut the same list the same way, so their parts and tags agree.
fn share_parts(
    plan: &RankPlan,
    pieces: Vec<usize>,
    part_bytes: u64,
) -> Vec<(u32, Vec<usize>, u64)> {
    let total: u64 = pieces.iter().map(|&i| plan.pieces[i].bytes).sum();
    let part_bytes = part_bytes
        .max(1)
        .max(total.div_ceil(u64::from(MAX_SHARE_PARTS)));
    if total <= part_bytes {
        return vec![(0, pieces, total)];
    }
    let mut parts = Vec::new();
    let (mut current, mut bytes) = (Vec::new(), 0u64);
    for index in pieces {
        current.push(index);
        bytes += plan.pieces[index].bytes;
        if bytes >= part_bytes {
            parts.push((parts.len() as u32, std::mem::take(&mut current), bytes));
            bytes = 0;
        }
    }
    if !current.is_empty() {
        parts.push((parts.len() as u32, current, bytes));
    }
    parts
}

/// Gathers the wire bytes of `message` out of `buffers` (where this rank placed the pieces it
/// read) into `out`, which must be exactly the message's length.
pub fn gather_message<B: AsRef<[u8]>>(
    plan: &RankPlan,
    message: &Outgoing,
    buffers: &[B],
    out: &mut [u8],
) -> Result<(), LoaderError> {
    if out.len() as u64 != message.bytes {
        return Err(invalid(
            plan,
            format!(
                "group {} round {}: a {}-byte buffer for a {}-byte message to rank {}",
                message.group,
                message.round,
                out.len(),
                message.bytes,
                message.to
            ),
        ));
    }
    let mut at = 0usize;
    for &index in &message.pieces {
        let wire = gather_piece(plan, index, buffers)?;
        out[at..at + wire.len()].copy_from_slice(&wire);
        at += wire.len();
    }
    Ok(())
}

/// Places a received message's pieces into `buffers`, after checking its length against what the
/// plan expects from that peer in that round.
pub fn place_message<B: AsMut<[u8]>>(
    plan: &RankPlan,
    message: &Incoming,
    data: &[u8],
    buffers: &mut [B],
) -> Result<(), LoaderError> {
    if data.len() as u64 != message.bytes {
        return Err(LoaderError::Transport {
            rank: plan.rank,
            peer: message.from,
            detail: format!(
                "group {} round {}: expected {} bytes (pieces {:?}) but got {}",
                message.group,
                message.round,
                message.bytes,
                message
                    .pieces
                    .iter()
                    .map(|&i| plan.pieces[i].id)
                    .collect::<Vec<_>>(),
                data.len()
            ),
        });
    }
    let mut at = 0usize;
    for &index in &message.pieces {
        let len = plan.pieces[index].bytes as usize;
        place_piece(plan, index, &data[at..at + len], buffers)?;
        at += len;
    }
    Ok(())
}

/// Where the wire bytes of `message`'s pieces lie in `buffers` (where this rank placed the pieces
/// it read), as a descriptor for a peer that copies them out of this rank's memory.
pub fn describe_share<B: AsRef<[u8]>>(
    plan: &RankPlan,
    message: &Outgoing,
    buffers: &[B],
) -> Result<ShareDescriptor, LoaderError> {
    let mut descriptor = ShareDescriptor {
        pieces: Vec::with_capacity(message.pieces.len()),
        spans: Vec::new(),
    };
    for &index in &message.pieces {
        let (destination, spans) = wire_spans(plan, index)?;
        let Some(buffer) = buffers.get(destination) else {
            return Err(invalid(
                plan,
                format!(
                    "piece {} lands in missing destination {destination}",
                    plan.pieces[index].id
                ),
            ));
        };
        let base = buffer.as_ref().as_ptr() as u64;
        for (offset, len) in spans {
            push_span(&mut descriptor.spans, base + offset, len);
        }
        descriptor
            .pieces
            .push((plan.pieces[index].id, plan.pieces[index].bytes));
    }
    Ok(descriptor)
}

/// Checks a share descriptor against what the plan expects from its sender: the same pieces
/// (ids and bytes) in the same order.
pub fn check_share_descriptor(
    plan: &RankPlan,
    expect: &Incoming,
    descriptor: &ShareDescriptor,
) -> Result<(), LoaderError> {
    let expected: Vec<(u32, u64)> = expect
        .pieces
        .iter()
        .map(|&i| (plan.pieces[i].id, plan.pieces[i].bytes))
        .collect();
    if descriptor.pieces != expected {
        return Err(LoaderError::Transport {
            rank: plan.rank,
            peer: expect.from,
            detail: format!(
                "group {} round {}: expected pieces {:?} but its share lists {:?} (the ranks run different plans)",
                expect.group, expect.round, expected, descriptor.pieces
            ),
        });
    }
    Ok(())
}

/// Copies a share straight out of the sender's memory into `buffers` (where this rank places
/// the pieces), after checking its descriptor against the plan, then into each piece's other
/// placements.
pub fn copy_share<B: AsMut<[u8]> + AsRef<[u8]>>(
    plan: &RankPlan,
    expect: &Incoming,
    source: &PeerMemory,
    descriptor: &ShareDescriptor,
    buffers: &mut [B],
) -> Result<(), LoaderError> {
    check_share_descriptor(plan, expect, descriptor)?;
    let mut local = Vec::new();
    for &index in &expect.pieces {
        let (destination, spans) = wire_spans(plan, index)?;
        local.extend(
            spans
                .into_iter()
                .map(|(offset, len)| (destination, offset, len)),
        );
    }
    source
        .copy_into(&descriptor.spans, buffers, &local)
        .map_err(|detail| LoaderError::Transport {
            rank: plan.rank,
            peer: expect.from,
            detail: format!(
                "group {} round {}: copying its share out of its memory: {detail} (TESSERA_CROSS_MEMORY=0 sends shares over the transport instead)",
                expect.group, expect.round
            ),
        })?;
    for &index in &expect.pieces {
        copy_to_other_places(plan, index, buffers)?;
    }
    Ok(())
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
pub fn check_buffer_sizes(
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
/// per plan destination, as from [`crate::exchange::place::allocate`]): the exchange protocol
/// ([`protocol`]) with every share sent as bytes.
///
/// Precondition: every piece this rank reads (`read.is_some()`) is already placed in `buffers`;
/// what this rank sends is gathered back out of them. Sizes are checked against the plan before
/// anything is sent, and every message's length when it arrives.
pub async fn run_exchanges<T: Transport, B: AsMut<[u8]> + AsRef<[u8]>>(
    transport: &T,
    plan: &RankPlan,
    buffers: &mut [B],
) -> Result<ExchangeStats, LoaderError> {
    let messages = ExchangeMessages::of_plan(plan)?;
    run_exchange_messages(transport, plan, &messages, buffers).await
}

/// [`run_exchanges`] with the plan's messages already cut ([`ExchangeMessages::of_plan_in_parts`]).
pub async fn run_exchange_messages<T: Transport, B: AsMut<[u8]> + AsRef<[u8]>>(
    transport: &T,
    plan: &RankPlan,
    messages: &ExchangeMessages,
    buffers: &mut [B],
) -> Result<ExchangeStats, LoaderError> {
    check_rank(plan, transport.rank(), transport.world())?;
    check_buffer_sizes(plan, buffers.iter().map(|b| b.as_ref().len() as u64))
        .map_err(|detail| invalid(plan, detail))?;
    let protocol = protocol::ExchangeProtocol::new(plan, messages.clone(), None, false);
    let (_, _, stats) = drive::drive(transport, protocol, buffers, None, Instant::now()).await?;
    Ok(stats)
}

/// The exchange of a rank whose own reads are done (a load job's rounds read, check the jointly
/// read boxes, then exchange: `tessera_ops::job`): every share of `plan` over `transport`, sent
/// in parts of `options.share_part_bytes`, straight from memory to memory between ranks of one
/// host where the transport allows it and `options.cross_memory` is on, placing what arrives in
/// `buffers` (one per plan destination, every piece this rank reads already in place).
pub async fn exchange_after_read<T: Transport, B: AsMut<[u8]> + AsRef<[u8]>>(
    plan: &RankPlan,
    transport: &T,
    options: &crate::load::LoadOptions,
    buffers: &mut [B],
) -> Result<ExchangeStats, LoaderError> {
    check_rank(plan, transport.rank(), transport.world())?;
    check_buffer_sizes(plan, buffers.iter().map(|b| b.as_ref().len() as u64))
        .map_err(|detail| invalid(plan, detail))?;
    let messages = ExchangeMessages::of_plan_in_parts(
        plan,
        options.share_part_bytes.unwrap_or(SHARE_PART_BYTES),
    )?;
    // Declared before everything that may hold its addresses: dropped (token zeroed) last.
    let exposure = direct::Exposure::new();
    let hello = transport
        .direct_copies()
        .then(|| bytes::Bytes::from(exposure.offer(options.cross_memory)));
    let protocol = protocol::ExchangeProtocol::new(plan, messages, hello, options.cross_memory);
    let (_, _, stats) = drive::drive(transport, protocol, buffers, None, Instant::now()).await?;
    Ok(stats)
}
