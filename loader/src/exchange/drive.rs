//! The async driver of the exchange protocol ([`super::protocol`]) over any [`Transport`]: a
//! rank's reads and its ring exchanges at once. A share goes out the moment its last piece is
//! read and verified (ByteCheckpoint's "overlap tensor reading with transferring"), receives run
//! from the start, and what arrives is placed between reads (the plan puts received pieces where
//! none of this rank's reads land) or, the rest, once reading is done.
//!
//! Two sides run together: the read side owns the buffers (it reads, feeds read pieces to the
//! protocol and places what arrived), the network side runs the transport operations the
//! protocol asks for and feeds their completions back. The protocol sits between them behind a
//! lock that neither holds across an await.

use std::future::Future;
use std::ops::Deref;
use std::pin::Pin;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tessera_planner::RankPlan;

use super::protocol::{Action, ExchangeProtocol};
use super::{ExchangeStats, in_round, invalid};
use crate::LoaderError;
use crate::checkpoint::Checkpoint;
use crate::exchange::direct::{ANSWER_TAG, HELLO_TAG, ack_tag, descriptor_tag};
use crate::load::LoadOptions;
use crate::read::ReadStats;
use crate::transport::Transport;

/// A transport operation that completed.
enum Completion {
    Sent { to: u32, tag: u64 },
    Received { from: u32, tag: u64, data: Bytes },
}

type Operation<'a> = Pin<Box<dyn Future<Output = Result<Completion, LoaderError>> + Send + 'a>>;

/// After a failure: every send offered so far is started and waited for (peers buffer what
/// arrives, so live peers get everything this rank owes them and fail, if at all, naming the
/// rank that actually died rather than this one). The failure that led here is the one
/// reported; the sends' own errors only end their wait.
async fn finish_sends<'a, T: Transport>(
    transport: &'a T,
    context: &ErrorContext,
    actions: &mut tokio::sync::mpsc::UnboundedReceiver<Vec<Action>>,
    mut sends: FuturesUnordered<Operation<'a>>,
    receives: FuturesUnordered<Operation<'a>>,
) {
    drop(receives);
    let mut ignored = FuturesUnordered::new();
    while let Ok(batch) = actions.try_recv() {
        for action in batch {
            if matches!(action, Action::Send { .. }) {
                start(transport, context, action, &mut sends, &mut ignored);
            }
        }
    }
    while sends.next().await.is_some() {}
}

/// Starts the transport operation of `action` among the `sends` or `receives` in flight.
fn start<'a, T: Transport>(
    transport: &'a T,
    context: &ErrorContext,
    action: Action,
    sends: &mut FuturesUnordered<Operation<'a>>,
    receives: &mut FuturesUnordered<Operation<'a>>,
) {
    let context = context.clone();
    match action {
        Action::Send { to, tag, data, .. } => sends.push(Box::pin(async move {
            transport
                .send(to, tag, data)
                .await
                .map(|()| Completion::Sent { to, tag })
                .map_err(|e| context.wrap(e, to, tag))
        })),
        Action::Recv { from, tag, .. } => receives.push(Box::pin(async move {
            transport
                .recv(from, tag)
                .await
                .map(|data| Completion::Received { from, tag, data })
                .map_err(|e| context.wrap(e, from, tag))
        })),
    }
}

fn lock<'a, 'p>(
    protocol: &'a Mutex<ExchangeProtocol<&'p RankPlan>>,
) -> MutexGuard<'a, ExchangeProtocol<&'p RankPlan>> {
    protocol.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Runs `protocol`'s exchange over `transport`: with `reads`, this rank's reads into `buffers`
/// at the same time (the protocol hears of every piece as it is read and verified); without,
/// the pieces this rank reads must already be in `buffers`. With `reads`, the plan must have
/// passed [`Checkpoint::check_plan`] (as [`read_and_exchange`] does before any peer is
/// contacted). Returns the read's stats (with
/// `reads`), the seconds from `started` until the reads ended, and the exchange's stats.
///
/// Memory: a share sent as bytes is gathered once per group (the same bytes go to every round's
/// peer) and held until sent; a direct share costs a descriptor. What arrives as bytes waits at
/// most until the read ends: at most the rank's own destination bytes.
pub(crate) async fn drive<T: Transport, B: AsMut<[u8]> + AsRef<[u8]>>(
    transport: &T,
    mut protocol: ExchangeProtocol<&RankPlan>,
    buffers: &mut [B],
    reads: Option<(&Checkpoint, &LoadOptions)>,
    started: Instant,
) -> Result<(Option<ReadStats>, f64, ExchangeStats), LoaderError> {
    let exchange_started = Instant::now();
    let plan: &RankPlan = protocol.plan();
    let context = ErrorContext::of(&protocol);
    let first = protocol.start();
    let protocol = Mutex::new(protocol);
    let (to_network, mut actions) = tokio::sync::mpsc::unbounded_channel::<Vec<Action>>();
    let _ = to_network.send(first);
    let arrival = tokio::sync::Notify::new();

    let read = async {
        let stats = match reads {
            Some((checkpoint, options)) => Some(
                checkpoint
                    .read_checked_plan(plan, options, buffers, |piece, buffers| {
                        let mut protocol = lock(&protocol);
                        let mut next = protocol.piece_read(piece, buffers)?;
                        next.extend(protocol.pump(buffers)?);
                        drop(protocol);
                        if !next.is_empty() {
                            // A closed channel means the network side failed: its error is the
                            // one reported.
                            let _ = to_network.send(next);
                        }
                        Ok(())
                    })
                    .await?,
            ),
            None => {
                let next = lock(&protocol).all_read(buffers)?;
                let _ = to_network.send(next);
                None
            }
        };
        let read_seconds = started.elapsed().as_secs_f64();
        lock(&protocol).reads_done()?;
        // Place the rest as it arrives (a direct share's sender waits for this rank's copy) and
        // offer what waited for a peer's answer.
        let mut waited = std::time::Duration::ZERO;
        loop {
            let notified = arrival.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable();
            let (next, placed_all) = {
                let mut protocol = lock(&protocol);
                let next = protocol.pump(buffers)?;
                (next, protocol.placed_all())
            };
            if !next.is_empty() {
                let _ = to_network.send(next);
            }
            if placed_all {
                break;
            }
            let idle = Instant::now();
            notified.await;
            waited += idle.elapsed();
        }
        // Closing the channel tells the network side that nothing more will come from here.
        drop(to_network);
        Ok::<_, LoaderError>((stats, read_seconds, waited))
    };

    let network = async {
        let mut sends: FuturesUnordered<Operation<'_>> = FuturesUnordered::new();
        let mut receives: FuturesUnordered<Operation<'_>> = FuturesUnordered::new();
        let mut open = true;
        loop {
            let completion = tokio::select! {
                // Actions first: a share the protocol offered goes out before anything else
                // (also when a receive fails next).
                biased;
                next = actions.recv(), if open => {
                    match next {
                        Some(batch) => {
                            for action in batch {
                                start(transport, &context, action, &mut sends, &mut receives);
                            }
                        }
                        None => open = false,
                    }
                    continue;
                }
                Some(sent) = sends.next(), if !sends.is_empty() => match sent {
                    Ok(sent) => sent,
                    Err(e) => {
                        finish_sends(transport, &context, &mut actions, sends, receives).await;
                        return Err(e);
                    }
                },
                Some(got) = receives.next(), if !receives.is_empty() => match got {
                    Ok(got) => got,
                    Err(e) => {
                        finish_sends(transport, &context, &mut actions, sends, receives).await;
                        return Err(e);
                    }
                },
                else => break,
            };
            let next = match completion {
                Completion::Sent { to, tag } => lock(&protocol).sent(to, tag),
                Completion::Received { from, tag, data } => {
                    let next = lock(&protocol).received(from, tag, data);
                    arrival.notify_one();
                    next?
                }
            };
            for action in next {
                start(transport, &context, action, &mut sends, &mut receives);
            }
        }
        let protocol = lock(&protocol);
        if !protocol.is_done() {
            return Err(invalid(
                plan,
                format!(
                    "the exchange ended unfinished, still waiting on ranks {:?}",
                    protocol.waiting_on()
                ),
            ));
        }
        Ok::<_, LoaderError>(protocol.stats().clone())
    };

    let ((stats, read_seconds, waited), mut exchanged) =
        futures::future::try_join(read, network).await?;
    exchanged.elapsed = exchange_started.elapsed();
    exchanged.waited = waited;
    Ok((stats, read_seconds, exchanged))
}

/// (group, round, the share's tag) of a share message, by (peer, tag) of each of its messages.
type SharesByTag = std::collections::HashMap<(u32, u64), (u32, u32, u64)>;

/// What a transport error needs to name the exchange step it happened in.
#[derive(Clone)]
pub(crate) struct ErrorContext {
    shares: std::sync::Arc<SharesByTag>,
}

impl ErrorContext {
    /// The context of every message of `plan`'s exchange `protocol` moves.
    pub(crate) fn of<P: Deref<Target = RankPlan>>(protocol: &ExchangeProtocol<P>) -> ErrorContext {
        let messages = protocol.messages();
        let mut shares = std::collections::HashMap::new();
        for m in &messages.outgoing {
            for tag in [m.tag, descriptor_tag(m.tag), ack_tag(m.tag)] {
                shares.insert((m.to, tag), (m.group, m.round, m.tag));
            }
        }
        for m in &messages.incoming {
            for tag in [m.tag, descriptor_tag(m.tag), ack_tag(m.tag)] {
                shares.insert((m.from, tag), (m.group, m.round, m.tag));
            }
        }
        ErrorContext {
            shares: std::sync::Arc::new(shares),
        }
    }

    /// `error` of the operation with `peer` under `tag`, naming its step.
    fn wrap(&self, error: LoaderError, peer: u32, tag: u64) -> LoaderError {
        if tag == HELLO_TAG || tag == ANSWER_TAG {
            return error.in_context(
                "direct-copy hand-shake",
                "the direct-copy hand-shake at the start of the exchange",
            );
        }
        match self.shares.get(&(peer, tag)) {
            Some(&(group, round, share_tag)) => in_round(error, group, round, share_tag),
            None => error,
        }
    }
}

/// One rank's reads and exchange over `transport` (see the module doc): reads and the exchange
/// overlap unless `options.exchange_overlap` is off (then the exchange runs after the reads);
/// shares go straight from memory to memory between ranks of one host where the transport
/// allows it and `options.cross_memory` is on. Returns the read's stats, the seconds until the
/// read ended, and the exchange's stats.
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
    let messages = super::ExchangeMessages::of_plan_in_parts(
        plan,
        options.share_part_bytes.unwrap_or(super::SHARE_PART_BYTES),
    )?;
    // Declared before everything that may hold its addresses: dropped (token zeroed) last.
    let exposure = crate::exchange::direct::Exposure::new();
    let hello = transport
        .direct_copies()
        .then(|| Bytes::from(exposure.offer(options.cross_memory)));
    let protocol = ExchangeProtocol::new(plan, messages, hello, options.cross_memory);
    if options.exchange_overlap {
        let (stats, read_seconds, exchanged) = drive(
            transport,
            protocol,
            buffers,
            Some((checkpoint, options)),
            started,
        )
        .await?;
        let stats = stats.ok_or_else(|| invalid(plan, "the load read nothing".to_string()))?;
        return Ok((stats, read_seconds, exchanged));
    }
    // The exchange after the whole read (a switch for side-by-side measurements).
    let stats = checkpoint
        .read_checked_plan(plan, options, buffers, |_, _| Ok(()))
        .await?;
    let read_seconds = started.elapsed().as_secs_f64();
    let (_, _, exchanged) = drive(transport, protocol, buffers, None, started).await?;
    Ok((stats, read_seconds, exchanged))
}
