//! A rank's reads and its ring exchanges at once: a share goes out the moment its last piece is
//! read and verified (ByteCheckpoint's "overlap tensor reading with transferring"), receives run
//! from the start, and what arrives is placed between reads (the plan puts received pieces where
//! none of this rank's reads land) or, the rest, once reading is done.
//!
//! Between ranks on one host a share is not sent at all: after a hand-shake that proves the
//! receiver can read the sender's memory ([`crate::cross_memory`]), the sender announces where
//! the share's bytes lie and the receiver copies them straight into its destinations, then
//! acknowledges; the sender keeps its buffers until then. Other pairs send the share's bytes
//! over the transport, as [`crate::exchange::run_exchanges`] does (one message per group and
//! round).

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tessera_planner::RankPlan;

use crate::cross_memory::{
    ANSWER_TAG, Exposure, HELLO_TAG, PeerMemory, ShareDescriptor, ack_tag, descriptor_tag,
};
use crate::exchange::{
    ExchangeMessages, ExchangeStats, copy_share, describe_share, gather_message, in_round, invalid,
    place_message,
};
use crate::load::{Checkpoint, LoadOptions};
use crate::read::ReadStats;
use crate::transport::Transport;
use crate::{LoaderError, exchange};

/// Which peers copy directly, as the hand-shake settled it.
#[derive(Debug, Default)]
struct DirectPeers {
    /// Peers that copy this rank's shares out of its memory.
    readers: HashSet<u32>,
    /// Peers whose shares this rank copies out of theirs.
    sources: HashMap<u32, PeerMemory>,
}

/// The hand-shake: every rank says hello to the peers it sends to (its pid and exchange token, or
/// that it declines), and answers the hellos of the peers it receives from with whether it can
/// read their memory. Both ends of each pair then know how its shares travel.
async fn handshake<T: Transport>(
    transport: &T,
    plan: &RankPlan,
    messages: &ExchangeMessages,
    exposure: &Exposure,
    cross_memory: bool,
) -> Result<DirectPeers, LoaderError> {
    let send_to: BTreeSet<u32> = messages.outgoing.iter().map(|m| m.to).collect();
    let recv_from: BTreeSet<u32> = messages.incoming.iter().map(|m| m.from).collect();
    let hello = Bytes::from(exposure.offer(cross_memory));
    let in_handshake = |e: LoaderError| {
        e.in_context(
            "direct-copy hand-shake",
            "the direct-copy hand-shake at the start of the exchange",
        )
    };
    let hellos = futures::future::try_join_all(send_to.iter().map(|&peer| {
        let hello = hello.clone();
        async move { transport.send(peer, HELLO_TAG, hello).await }
    }));
    let answers = futures::future::try_join_all(recv_from.iter().map(|&peer| async move {
        let data = transport.recv(peer, HELLO_TAG).await?;
        let memory =
            PeerMemory::accept(&data, cross_memory).map_err(|detail| LoaderError::Transport {
                rank: plan.rank,
                peer,
                detail,
            })?;
        let answer: &'static [u8] = if memory.is_some() { &[1] } else { &[0] };
        transport
            .send(peer, ANSWER_TAG, Bytes::from_static(answer))
            .await?;
        Ok::<_, LoaderError>((peer, memory))
    }));
    let modes = futures::future::try_join_all(send_to.iter().map(|&peer| async move {
        let data = transport.recv(peer, ANSWER_TAG).await?;
        match &data[..] {
            [answer @ (0 | 1)] => Ok((peer, *answer == 1)),
            other => Err(LoaderError::Transport {
                rank: plan.rank,
                peer,
                detail: format!("answered the hello with {} bytes", other.len()),
            }),
        }
    }));
    let (_, answers, modes) = futures::future::try_join3(hellos, answers, modes)
        .await
        .map_err(in_handshake)?;
    Ok(DirectPeers {
        readers: modes
            .into_iter()
            .filter_map(|(peer, direct)| direct.then_some(peer))
            .collect(),
        sources: answers
            .into_iter()
            .filter_map(|(peer, memory)| memory.map(|m| (peer, m)))
            .collect(),
    })
}

/// A share on its way out.
enum Share {
    /// Its bytes, gathered.
    Bytes(Bytes),
    /// Where its bytes lie in this rank's memory (the receiver copies them).
    Direct(Bytes),
}

/// A share that arrived.
enum Arrival {
    /// Its bytes.
    Bytes(Bytes),
    /// Where its bytes lie in the sender's memory.
    Direct(ShareDescriptor),
}

/// Reads this rank's pieces and runs its ring exchanges at the same time (see the module doc).
///
/// Memory: a share sent as bytes is gathered once per group (the same bytes go to every round's
/// peer) and held until sent; a direct share costs a descriptor. What arrives as bytes waits at
/// most until the read ends: at most the rank's own destination bytes. A share is offered only
/// once every one of its pieces passed verification, so a corrupt read fails this rank before any
/// peer sees the bytes.
///
/// Returns the read's stats, the seconds until the read ended, and the exchange's stats.
pub(crate) async fn read_and_exchange<T: Transport, B: AsMut<[u8]> + AsRef<[u8]>>(
    checkpoint: &Checkpoint,
    plan: &RankPlan,
    transport: &T,
    options: &LoadOptions,
    buffers: &mut [B],
    started: Instant,
) -> Result<(ReadStats, f64, ExchangeStats), LoaderError> {
    // A plan for another checkpoint is refused before any peer is contacted.
    checkpoint.check_plan(plan)?;
    let messages = ExchangeMessages::of_plan_in_parts(
        plan,
        options
            .share_part_bytes
            .unwrap_or(exchange::SHARE_PART_BYTES),
    )?;
    if messages.outgoing.is_empty() && messages.incoming.is_empty() || !options.exchange_overlap {
        // Nothing to exchange, or the exchange after the whole read (`exchange_overlap` off).
        let stats = checkpoint.read_into(plan, options, buffers).await?;
        let read_seconds = started.elapsed().as_secs_f64();
        let exchanged =
            exchange::run_exchange_messages(transport, plan, &messages, buffers).await?;
        return Ok((stats, read_seconds, exchanged));
    }
    let exchange_started = Instant::now();
    // Declared before everything that may hold its addresses: dropped (token zeroed) last.
    let exposure = Exposure::new();
    let direct = if transport.direct_copies() {
        handshake(transport, plan, &messages, &exposure, options.cross_memory).await?
    } else {
        DirectPeers::default()
    };

    // Outgoing messages by piece: how many of each message's pieces are still being read.
    let mut left: Vec<usize> = messages.outgoing.iter().map(|m| m.pieces.len()).collect();
    let mut by_piece: HashMap<usize, Vec<usize>> = HashMap::new();
    for (m, message) in messages.outgoing.iter().enumerate() {
        for &piece in &message.pieces {
            by_piece.entry(piece).or_default().push(m);
        }
    }
    let (ready, mut to_send) = tokio::sync::mpsc::unbounded_channel::<(usize, Share)>();
    let (copied, mut to_ack) = tokio::sync::mpsc::unbounded_channel::<usize>();
    let arrived: Mutex<Vec<(usize, Arrival)>> = Mutex::new(Vec::new());
    let arrival = tokio::sync::Notify::new();
    let take_arrived = || {
        std::mem::take(
            &mut *arrived
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    };

    let read = async {
        // The share of a group is the same for every round's peer: gathered (or described) once.
        let mut prepared: HashMap<(bool, u32, Vec<usize>), Bytes> = HashMap::new();
        let mut send_ready = |m: usize, buffers: &[B]| -> Result<(), LoaderError> {
            let message = &messages.outgoing[m];
            let is_direct = direct.readers.contains(&message.to);
            let key = (is_direct, message.group, message.pieces.clone());
            let data = match prepared.get(&key) {
                Some(data) => data.clone(),
                None => {
                    let data = if is_direct {
                        Bytes::from(describe_share(plan, message, buffers)?.encode())
                    } else {
                        let mut out = vec![0u8; message.bytes as usize];
                        gather_message(plan, message, buffers, &mut out)?;
                        Bytes::from(out)
                    };
                    prepared.insert(key, data.clone());
                    data
                }
            };
            let share = if is_direct {
                Share::Direct(data)
            } else {
                Share::Bytes(data)
            };
            // The network side ends only after this side dropped `ready`: a closed channel
            // means it failed, and its error is the one reported.
            let _ = ready.send((m, share));
            Ok(())
        };
        // Counters shared by the read hook and the drain below (atomics: the future is Send).
        let placed = AtomicUsize::new(0);
        let direct_bytes = AtomicU64::new(0);
        let place_arrived = |buffers: &mut [B]| -> Result<(), LoaderError> {
            for (i, arrival) in take_arrived() {
                let expect = &messages.incoming[i];
                match arrival {
                    Arrival::Bytes(data) => place_message(plan, expect, &data, buffers)?,
                    Arrival::Direct(descriptor) => {
                        let Some(source) = direct.sources.get(&expect.from) else {
                            return Err(invalid(
                                plan,
                                format!("rank {} sent a share descriptor unasked", expect.from),
                            ));
                        };
                        copy_share(plan, expect, source, &descriptor, buffers)?;
                        direct_bytes.fetch_add(expect.bytes, Ordering::Relaxed);
                        let _ = copied.send(i);
                    }
                }
                placed.fetch_add(1, Ordering::Relaxed);
            }
            Ok(())
        };
        let stats = checkpoint
            .read_into_with(plan, options, buffers, |piece, buffers| {
                if let Some(waiting) = by_piece.get(&piece) {
                    for &m in waiting {
                        left[m] -= 1;
                        if left[m] == 0 {
                            send_ready(m, buffers)?;
                        }
                    }
                }
                place_arrived(buffers)
            })
            .await?;
        let read_seconds = started.elapsed().as_secs_f64();
        // A message whose pieces were all empty (or none read here) never completed a piece.
        if let Some((m, &missing)) = left.iter().enumerate().find(|(_, n)| **n > 0) {
            let message = &messages.outgoing[m];
            return Err(invalid(
                plan,
                format!(
                    "group {} round {}: {missing} of the pieces to send to rank {} were never read",
                    message.group, message.round, message.to
                ),
            ));
        }
        // Closing the channel tells the network side that nothing more will be sent.
        drop(ready);
        // Place the rest as it arrives: a direct share's sender waits for this rank's copy.
        loop {
            let notified = arrival.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            place_arrived(buffers)?;
            if placed.load(Ordering::Relaxed) == messages.incoming.len() {
                break;
            }
            notified.await;
        }
        drop(copied);
        Ok::<_, LoaderError>((stats, read_seconds, direct_bytes.load(Ordering::Relaxed)))
    };

    let network = async {
        let mut sends = FuturesUnordered::new();
        let mut acks = FuturesUnordered::new();
        let mut receives: FuturesUnordered<_> = messages
            .incoming
            .iter()
            .enumerate()
            .map(|(i, expect)| {
                let is_direct = direct.sources.contains_key(&expect.from);
                async move {
                    let context = |e| in_round(e, expect.group, expect.round, expect.tag);
                    if is_direct {
                        let data = transport
                            .recv(expect.from, descriptor_tag(expect.tag))
                            .await
                            .map_err(context)?;
                        let descriptor = ShareDescriptor::decode(&data).map_err(|detail| {
                            LoaderError::Transport {
                                rank: plan.rank,
                                peer: expect.from,
                                detail,
                            }
                        })?;
                        return Ok::<_, LoaderError>((i, Arrival::Direct(descriptor)));
                    }
                    let data = transport
                        .recv(expect.from, expect.tag)
                        .await
                        .map_err(context)?;
                    if data.len() as u64 != expect.bytes {
                        return Err(LoaderError::Transport {
                            rank: plan.rank,
                            peer: expect.from,
                            detail: format!(
                                "group {} round {}: expected {} bytes but got {}",
                                expect.group,
                                expect.round,
                                expect.bytes,
                                data.len()
                            ),
                        });
                    }
                    Ok((i, Arrival::Bytes(data)))
                }
            })
            .collect();
        let (mut sent, mut received) = (0u64, 0u64);
        let (mut sends_open, mut acks_open) = (true, true);
        loop {
            tokio::select! {
                next = to_send.recv(), if sends_open => match next {
                    Some((m, share)) => {
                        let message = &messages.outgoing[m];
                        sends.push(async move {
                            let context =
                                |e| in_round(e, message.group, message.round, message.tag);
                            match share {
                                Share::Bytes(data) => transport
                                    .send(message.to, message.tag, data)
                                    .await
                                    .map_err(context)?,
                                Share::Direct(descriptor) => {
                                    transport
                                        .send(message.to, descriptor_tag(message.tag), descriptor)
                                        .await
                                        .map_err(context)?;
                                    // The buffers stay put until the peer copied them.
                                    let ack = transport
                                        .recv(message.to, ack_tag(message.tag))
                                        .await
                                        .map_err(context)?;
                                    if ack[..] != [1] {
                                        return Err(LoaderError::Transport {
                                            rank: plan.rank,
                                            peer: message.to,
                                            detail: format!(
                                                "group {} round {}: a {}-byte acknowledgement",
                                                message.group, message.round, ack.len()
                                            ),
                                        });
                                    }
                                }
                            }
                            Ok::<u64, LoaderError>(message.bytes)
                        });
                    }
                    None => sends_open = false,
                },
                next = to_ack.recv(), if acks_open => match next {
                    Some(i) => {
                        let expect = &messages.incoming[i];
                        acks.push(async move {
                            transport
                                .send(expect.from, ack_tag(expect.tag), Bytes::from_static(&[1]))
                                .await
                                .map_err(|e| in_round(e, expect.group, expect.round, expect.tag))
                        });
                    }
                    None => acks_open = false,
                },
                Some(done) = sends.next(), if !sends.is_empty() => sent += done?,
                Some(done) = acks.next(), if !acks.is_empty() => done?,
                Some(got) = receives.next(), if !receives.is_empty() => {
                    let (i, got) = got?;
                    received += messages.incoming[i].bytes;
                    arrived
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .push((i, got));
                    arrival.notify_one();
                }
                else => break,
            }
        }
        Ok::<_, LoaderError>((sent, received))
    };

    let ((stats, read_seconds, direct_bytes), (sent, received)) =
        futures::future::try_join(read, network).await?;
    Ok((
        stats,
        read_seconds,
        ExchangeStats {
            bytes_sent: sent,
            bytes_received: received,
            bytes_received_direct: direct_bytes,
            messages: (messages.outgoing.len() + messages.incoming.len()) as u64,
            elapsed: exchange_started.elapsed(),
        },
    ))
}
