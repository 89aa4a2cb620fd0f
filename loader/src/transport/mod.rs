//! Point-to-point messaging between the ranks of a job: one trait, [`Transport`], implemented
//! in-process ([`InProcTransport`], for tests and single-process runs), over TCP
//! ([`TcpTransport`]), and over a data plane with NCCL's rendezvous semantics
//! ([`SequencedTransport`]: NCCL on GPUs, an emulated plane in CPU tests), with one conformance
//! suite (`conformance`, feature `testing`) that every implementation passes.
//!
//! Semantics every implementation keeps:
//! - Messages are matched by `(from, tag)`; several messages with the same `(from, tag)` arrive in
//!   the order they were sent.
//! - `send` never waits for the receiver to call `recv`: incoming messages are buffered per
//!   `(from, tag)`, so ranks may send and receive in any order without deadlocking.
//! - `recv` fails with [`LoaderError::PeerTimeout`] when nothing arrives within
//!   [`TransportOptions::timeout`], and with [`LoaderError::Transport`] as soon as the peer is known
//!   to be gone (its connection closed or reset, its in-process handle dropped) and nothing it sent
//!   earlier is left to deliver. A dead rank makes the others fail fast instead of hanging.
//! - Sending to yourself, or to or from a rank outside the world, is an error.
//! - Where a transport can tell a peer that died (TCP: its connection ended without a goodbye)
//!   from one that left, a failure after a death names the rank that died first, not a peer
//!   that left because of it (`Mailbox::blame`).

#[cfg(feature = "testing")]
pub mod conformance;
mod inproc;
pub mod plane;
pub mod rendezvous;
mod sequenced;
mod tcp;

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::Notify;

pub use inproc::InProcTransport;
pub use sequenced::SequencedTransport;
pub use tcp::TcpTransport;

use crate::LoaderError;

/// Moves tagged byte messages between the ranks of one job.
///
/// Not object-safe (its methods return `impl Future`); code is generic over `T: Transport`.
pub trait Transport: Send + Sync {
    /// This rank.
    fn rank(&self) -> u32;

    /// Number of ranks.
    fn world(&self) -> u32;

    /// Sends `data` to rank `to` under `tag`. Completes once the message is handed to the peer
    /// (buffered there or in flight on the wire), not when the peer receives it.
    fn send(
        &self,
        to: u32,
        tag: u64,
        data: Bytes,
    ) -> impl Future<Output = Result<(), LoaderError>> + Send;

    /// Receives the next message rank `from` sent under `tag`.
    fn recv(&self, from: u32, tag: u64) -> impl Future<Output = Result<Bytes, LoaderError>> + Send;

    /// Whether the exchange may copy shares straight out of a peer's memory when the peer is a
    /// process on this host ([`crate::exchange::direct`]; a hand-shake over this transport checks
    /// each pair first). Transports whose receives match any send order (TCP, in-process) say
    /// yes; the sequenced plane, where both ends post in one agreed order, keeps to bytes.
    fn direct_copies(&self) -> bool {
        false
    }
}

/// A transport shared by several tasks of one rank (`Arc`), or borrowed by a load that does not
/// own the job's (`&`), is a transport.
macro_rules! forward_transport {
    ($($outer:ty),*) => {$(
        impl<T: Transport> Transport for $outer {
            fn rank(&self) -> u32 {
                (**self).rank()
            }

            fn world(&self) -> u32 {
                (**self).world()
            }

            fn send(
                &self,
                to: u32,
                tag: u64,
                data: Bytes,
            ) -> impl Future<Output = Result<(), LoaderError>> + Send {
                (**self).send(to, tag, data)
            }

            fn recv(
                &self,
                from: u32,
                tag: u64,
            ) -> impl Future<Output = Result<Bytes, LoaderError>> + Send {
                (**self).recv(from, tag)
            }

            fn direct_copies(&self) -> bool {
                (**self).direct_copies()
            }
        }
    )*};
}

forward_transport!(std::sync::Arc<T>, &T);

/// Options shared by the transports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportOptions {
    /// How long `recv` (and a TCP `send`) waits for a peer before failing with
    /// [`LoaderError::PeerTimeout`]. A peer that is known to be dead fails a `recv` at once instead.
    pub timeout: Duration,
    /// How long [`TcpTransport::connect`] may take altogether: reaching the master (ranks start in
    /// any order, so it retries), exchanging addresses, and connecting the mesh. The CLI sets it
    /// to `--peer-timeout`, like `timeout`: one bound for every wait on a peer.
    pub connect_timeout: Duration,
    /// While [`TcpTransport::connect`] waits, print who waits for whom to stderr this often
    /// (`rank 0: waiting for ranks 2,3 to join at host:port (2 of 4 in, 12 s of 60 s)`); `None`
    /// keeps it silent.
    pub progress_every: Option<Duration>,
}

impl TransportOptions {
    /// Options with both timeouts set to `timeout` (tests use a couple of seconds).
    pub fn with_timeout(timeout: Duration) -> Self {
        Self {
            timeout,
            connect_timeout: timeout,
            progress_every: None,
        }
    }
}

impl Default for TransportOptions {
    /// A minute for a message: a peer may still be reading a large share from storage before it
    /// sends. Five minutes to rendezvous: in a large job the last rank may start much later than
    /// the first.
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(60),
            connect_timeout: Duration::from_secs(300),
            progress_every: None,
        }
    }
}

/// The message tag of round `round` of group `group` in the ring exchange (the first part of
/// its share: [`share_part_tag`]).
pub fn exchange_tag(group: u32, round: u32) -> u64 {
    share_part_tag(group, round, 0)
}

/// Rounds a group's ring may have (members − 1) before its tags would need the bits that number
/// a share's parts.
pub const MAX_ROUNDS: u32 = 1 << 20;

/// Parts a share may be sent in (see [`crate::exchange::SHARE_PART_BYTES`]).
pub const MAX_SHARE_PARTS: u32 = 1 << 12;

/// The message tag of part `part` of the share of round `round` of group `group`: group in bits
/// 32–61, part in bits 20–31, round in bits 0–19 (callers keep round < [`MAX_ROUNDS`] and part <
/// [`MAX_SHARE_PARTS`]).
pub fn share_part_tag(group: u32, round: u32, part: u32) -> u64 {
    (u64::from(group) << 32) | (u64::from(part) << 20) | u64::from(round)
}

/// Checks that `peer` is another rank of the world.
pub(crate) fn check_peer(rank: u32, world: u32, peer: u32, op: &str) -> Result<(), LoaderError> {
    if peer == rank {
        return Err(LoaderError::Transport {
            rank,
            peer,
            detail: format!("cannot {op} itself"),
        });
    }
    if peer >= world {
        return Err(LoaderError::Transport {
            rank,
            peer,
            detail: format!("cannot {op} a rank outside the world of {world}"),
        });
    }
    Ok(())
}

/// Incoming messages of one rank, buffered per `(from, tag)`, and which peers are gone.
/// Shared by the transports: the in-process one delivers into it directly, the TCP one from a
/// reader task per connection.
pub(crate) struct Mailbox {
    rank: u32,
    world: u32,
    inbox: Mutex<Inbox>,
    /// Woken on every delivery and every peer death; waiters re-check their own key.
    changed: Notify,
}

#[derive(Default)]
struct Inbox {
    queues: HashMap<(u32, u64), VecDeque<Bytes>>,
    /// Per peer: why it is gone, once it is.
    gone: HashMap<u32, String>,
    /// The peers gone, in the order this rank learnt it, each with whether it died
    /// ([`Mailbox::peer_died`]) rather than left.
    went: Vec<(u32, bool)>,
}

impl Mailbox {
    pub(crate) fn new(rank: u32, world: u32) -> Self {
        Self {
            rank,
            world,
            inbox: Mutex::new(Inbox::default()),
            changed: Notify::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inbox> {
        // A panic while holding the lock leaves the maps consistent (single inserts/removes).
        self.inbox.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Buffers a message from `from`.
    pub(crate) fn deliver(&self, from: u32, tag: u64, data: Bytes) {
        self.lock()
            .queues
            .entry((from, tag))
            .or_default()
            .push_back(data);
        self.changed.notify_waiters();
    }

    /// Records that `peer` is gone (first reason wins). What it sent before stays deliverable.
    pub(crate) fn peer_gone(&self, peer: u32, reason: String) {
        self.went(peer, reason, false);
    }

    fn went(&self, peer: u32, reason: String, died: bool) {
        let mut inbox = self.lock();
        if let std::collections::hash_map::Entry::Vacant(entry) = inbox.gone.entry(peer) {
            entry.insert(reason);
            inbox.went.push((peer, died));
        }
        drop(inbox);
        self.changed.notify_waiters();
    }

    /// Records that `peer` died: it went away without saying goodbye (a killed or crashed
    /// process, a cut connection), as opposed to one that ended its load and left. What fails
    /// on this rank afterwards is blamed on the first peer that died ([`Mailbox::blame`]).
    pub(crate) fn peer_died(&self, peer: u32, reason: String) {
        self.went(peer, reason, true);
    }

    /// Why `peer` is gone, if it is.
    pub(crate) fn gone_reason(&self, peer: u32) -> Option<String> {
        self.lock().gone.get(&peer).cloned()
    }

    /// `error` (a failed send to, receive from or wait on one peer), blamed on the first peer
    /// that died, when that is another one and it died before this peer went (a peer that left
    /// before anyone died did not leave because of it). When a rank is killed, its peers that
    /// wait on it fail and leave, and a rank that only waited on one of those would otherwise
    /// name the survivor that left, not the rank that died: the one to look at. The error keeps
    /// what happened with its own peer after the blame.
    pub(crate) fn blame(&self, error: LoaderError) -> LoaderError {
        let (rank, peer, then) = match &error {
            LoaderError::Transport { rank, peer, detail } => {
                (*rank, *peer, format!("then, with rank {peer}: {detail}"))
            }
            LoaderError::PeerTimeout {
                rank,
                peer,
                what,
                waited,
            } => (
                *rank,
                *peer,
                format!("then nothing came from rank {peer} for {what} within {waited:?}"),
            ),
            _ => return error,
        };
        let inbox = self.lock();
        let Some(&(first, _)) = inbox
            .went
            .iter()
            .take_while(|(went, _)| *went != peer)
            .find(|(_, died)| *died)
        else {
            return error;
        };
        let why = inbox.gone.get(&first).cloned().unwrap_or_default();
        LoaderError::Transport {
            rank,
            peer: first,
            detail: format!("{why}; {then} (likely because of rank {first}, which died first)"),
        }
    }

    /// Drops everything buffered (the owner is shutting down).
    pub(crate) fn clear(&self) {
        self.lock().queues.clear();
    }

    /// The next message from `from` under `tag`, waiting at most `timeout`.
    pub(crate) async fn recv(
        &self,
        from: u32,
        tag: u64,
        timeout: Duration,
    ) -> Result<Bytes, LoaderError> {
        check_peer(self.rank, self.world, from, "receive from")?;
        let wait = async {
            loop {
                // Register interest before looking, so a delivery between the look and the
                // await is not missed.
                let changed = self.changed.notified();
                let mut changed = std::pin::pin!(changed);
                changed.as_mut().enable();
                {
                    let mut inbox = self.lock();
                    if let Some(queue) = inbox.queues.get_mut(&(from, tag))
                        && let Some(data) = queue.pop_front()
                    {
                        if queue.is_empty() {
                            inbox.queues.remove(&(from, tag));
                        }
                        return Ok(data);
                    }
                    if let Some(reason) = inbox.gone.get(&from) {
                        let error = LoaderError::Transport {
                            rank: self.rank,
                            peer: from,
                            detail: format!("waiting for tag {tag:#x}: {reason}"),
                        };
                        drop(inbox);
                        return Err(self.blame(error));
                    }
                }
                changed.await;
            }
        };
        match tokio::time::timeout(timeout, wait).await {
            Ok(result) => result,
            Err(_) => Err(self.blame(LoaderError::PeerTimeout {
                rank: self.rank,
                peer: from,
                what: format!("tag {tag:#x}"),
                waited: timeout,
            })),
        }
    }
}
