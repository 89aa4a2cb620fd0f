//! A [`Transport`] over a data plane with rendezvous semantics (NCCL), kept deadlock-free by a
//! global order of transfers.
//!
//! The [`Transport`] contract says `send` never waits for the receiver to call `recv`, and
//! messages are buffered by `(from, tag)`. NCCL point-to-point says the opposite: a send blocks
//! until the peer posts the matching receive, operations of one communicator run one after
//! another, and they match in posting order per pair of ranks. Posting transfers in the order
//! the application happens to issue them would deadlock (rank 0 sends to 1 while 1 sends to 0,
//! each plane blocked on its send). So every transfer gets a place in one global order:
//!
//! 1. A sender keeps the bytes in its outbox and asks the sequencer (rank 0, over the control
//!    transport) for a sequence number for `(from, to, tag, len)`.
//! 2. The sequencer numbers requests as they come and sends the order to both endpoints. Its
//!    messages to a rank are FIFO (one tag, one sender), so each rank learns its transfers in
//!    sequence order.
//! 3. Each rank's data plane thread executes the transfers that involve it in that order: a send
//!    uploads the bytes and sends them; a receive receives, downloads, and delivers the bytes to
//!    the mailbox under `(from, tag)`, whether or not anyone called `recv` yet.
//!
//! The earliest transfer not yet done always has both endpoints at it (each has finished every
//! earlier transfer of its own), so it completes: no deadlock, whatever the application does.
//! `send` returns once its transfer is done (the bytes are in the peer's mailbox), so what a rank
//! sent before exiting is delivered. A rank whose control connection closes is announced to every
//! rank by the sequencer, which fails receives from it at once and refuses transfers to it; when
//! the sequencer itself goes, every peer is gone.
//!
//! The control transport carries only small control messages (TCP for NCCL, in-process for the
//! CPU tests). Bulk exchanges should not come this way: the plan's ring has a grouped fast path
//! on the data plane ([`crate::transport::plane::ring`]), and it must not run while transfers of this
//! transport are in flight (both share the plane's thread and communicator).
//!
//! ```text
//! request  (rank -> 0, tag 1)   id:u64 to:u32 tag:u64 len:u64
//! order    (0 -> rank, tag 2)   1 seq:u64 from:u32 to:u32 tag:u64 len:u64 id:u64
//! gone     (0 -> rank, tag 2)   2 rank:u32 reason (UTF-8, to the end)
//! reject   (0 -> rank, tag 2)   3 id:u64 reason (UTF-8, to the end)      all integers little-endian
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::{Mailbox, Transport, TransportOptions, check_peer};
use crate::LoaderError;
use crate::device::DeviceMemory;
use crate::transport::plane::{DataPlane, PlaneOp, PlaneThread};

const TAG_REQUEST: u64 = 1;
const TAG_SEQUENCE: u64 = 2;
const ORDER: u8 = 1;
const GONE: u8 = 2;
const REJECT: u8 = 3;
/// Rank 0 orders every transfer.
const SEQUENCER: u32 = 0;

/// A transfer as ordered by the sequencer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Order {
    seq: u64,
    from: u32,
    to: u32,
    tag: u64,
    len: u64,
    id: u64,
}

/// What the sequencer acts on.
enum Input {
    Request {
        from: u32,
        id: u64,
        to: u32,
        tag: u64,
        len: u64,
    },
    Gone {
        rank: u32,
        reason: String,
    },
}

/// What the sequencer tells a rank.
#[derive(Debug, PartialEq, Eq)]
enum Notice {
    Order(Order),
    Gone { rank: u32, reason: String },
    Reject { id: u64, reason: String },
}

fn encode_request(id: u64, to: u32, tag: u64, len: u64) -> Bytes {
    let mut out = BytesMut::with_capacity(28);
    out.put_u64_le(id);
    out.put_u32_le(to);
    out.put_u64_le(tag);
    out.put_u64_le(len);
    out.freeze()
}

// Untrusted lengths: `try_get_*` (never the panicking `get_*`) read off the front.
fn decode_request(mut bytes: &[u8]) -> Option<(u64, u32, u64, u64)> {
    let out = (
        bytes.try_get_u64_le().ok()?,
        bytes.try_get_u32_le().ok()?,
        bytes.try_get_u64_le().ok()?,
        bytes.try_get_u64_le().ok()?,
    );
    bytes.is_empty().then_some(out)
}

fn encode_notice(notice: &Notice) -> Bytes {
    let mut out = BytesMut::with_capacity(41);
    match notice {
        Notice::Order(o) => {
            out.put_u8(ORDER);
            out.put_u64_le(o.seq);
            out.put_u32_le(o.from);
            out.put_u32_le(o.to);
            out.put_u64_le(o.tag);
            out.put_u64_le(o.len);
            out.put_u64_le(o.id);
        }
        Notice::Gone { rank, reason } => {
            out.put_u8(GONE);
            out.put_u32_le(*rank);
            out.put_slice(reason.as_bytes());
        }
        Notice::Reject { id, reason } => {
            out.put_u8(REJECT);
            out.put_u64_le(*id);
            out.put_slice(reason.as_bytes());
        }
    }
    out.freeze()
}

fn decode_notice(mut bytes: &[u8]) -> Option<Notice> {
    let text = |rest: &[u8]| String::from_utf8_lossy(rest).into_owned();
    match bytes.try_get_u8().ok()? {
        ORDER => {
            let order = Order {
                seq: bytes.try_get_u64_le().ok()?,
                from: bytes.try_get_u32_le().ok()?,
                to: bytes.try_get_u32_le().ok()?,
                tag: bytes.try_get_u64_le().ok()?,
                len: bytes.try_get_u64_le().ok()?,
                id: bytes.try_get_u64_le().ok()?,
            };
            bytes.is_empty().then_some(Notice::Order(order))
        }
        GONE => {
            let rank = bytes.try_get_u32_le().ok()?;
            Some(Notice::Gone {
                rank,
                reason: text(bytes),
            })
        }
        REJECT => {
            let id = bytes.try_get_u64_le().ok()?;
            Some(Notice::Reject {
                id,
                reason: text(bytes),
            })
        }
        _ => None,
    }
}

/// A message waiting in the outbox for its turn.
struct Pending {
    to: u32,
    tag: u64,
    data: Bytes,
    done: oneshot::Sender<Result<(), LoaderError>>,
}

/// This rank's side: what transfers act on.
struct Local<P: DataPlane> {
    rank: u32,
    world: u32,
    plane: PlaneThread<P>,
    mailbox: Arc<Mailbox>,
    outbox: Mutex<HashMap<u64, Pending>>,
    /// Device memory reused by transfers, grown to the largest.
    scratch: Arc<Mutex<Option<P::Buffer>>>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every critical section is a single insert, remove or swap: a panic cannot tear the maps.
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Scratch device memory of at least `len` bytes (taken from `slot` or newly allocated).
fn scratch<P: DataPlane>(
    plane: &mut P,
    slot: &Mutex<Option<P::Buffer>>,
    len: usize,
) -> Result<P::Buffer, LoaderError> {
    match lock(slot).take() {
        Some(buffer) if buffer.len() >= len => Ok(buffer),
        _ => plane.alloc(len),
    }
}

impl<P: DataPlane> Local<P> {
    /// Executes this rank's part of an ordered transfer on the plane thread (in order).
    fn apply(&self, order: Order) {
        let Order {
            from, to, tag, len, ..
        } = order;
        if from == self.rank {
            let Some(pending) = lock(&self.outbox).remove(&order.id) else {
                // Cannot happen: only an order for an id this rank requested names it as sender.
                return;
            };
            let slot = Arc::clone(&self.scratch);
            let job = move |plane: &mut P| {
                let result = (|| {
                    let buffer = scratch(plane, &slot, pending.data.len())?;
                    let sent = plane.upload(&pending.data, &buffer, 0).and_then(|()| {
                        plane.group(&[PlaneOp::Send {
                            peer: to,
                            buffer: &buffer,
                            len: pending.data.len(),
                        }])
                    });
                    *lock(&slot) = Some(buffer);
                    sent
                })();
                let _ = pending.done.send(result.map_err(|e| in_transfer(e, tag)));
            };
            if let Err(e) = self.plane.submit(job) {
                // The job (and its reply channel) was dropped; the waiting send sees it closed.
                let _ = e;
            }
        } else if to == self.rank {
            let slot = Arc::clone(&self.scratch);
            let mailbox = Arc::clone(&self.mailbox);
            let job = move |plane: &mut P| {
                let result = (|| {
                    let len = len as usize;
                    let buffer = scratch(plane, &slot, len)?;
                    let mut data = vec![0u8; len];
                    let received = plane
                        .group(&[PlaneOp::Recv {
                            peer: from,
                            buffer: &buffer,
                            len,
                        }])
                        .and_then(|()| plane.download(&buffer, 0, &mut data));
                    *lock(&slot) = Some(buffer);
                    received.map(|()| data)
                })();
                match result {
                    Ok(data) => mailbox.deliver(from, tag, Bytes::from(data)),
                    // The message is lost: whoever waits for it must fail now, not time out.
                    Err(e) => mailbox.peer_gone(
                        from,
                        format!("receiving a {len}-byte message (tag {tag:#x}) failed: {e}"),
                    ),
                }
            };
            if self.plane.submit(job).is_err() {
                self.mailbox.peer_gone(
                    from,
                    format!(
                        "this rank's data plane is gone; a {len}-byte message (tag {tag:#x}) cannot be received"
                    ),
                );
            }
        }
    }

    /// Fails the outbox entry `id` (a refused or unsendable request).
    /// Marks `rank` gone once every transfer ordered before this notice has run on the plane:
    /// what `rank` sent before it left is delivered first (the plane thread runs jobs in order,
    /// and the sequencer's notices reach a rank in sequence order).
    fn peer_gone_after_pending(&self, rank: u32, reason: String) {
        let mailbox = Arc::clone(&self.mailbox);
        let marked = reason.clone();
        if self
            .plane
            .submit(move |_plane: &mut P| mailbox.peer_gone(rank, marked))
            .is_err()
        {
            self.mailbox.peer_gone(rank, reason);
        }
    }

    fn fail(&self, id: u64, reason: String) {
        if let Some(pending) = lock(&self.outbox).remove(&id) {
            let _ = pending.done.send(Err(LoaderError::Transport {
                rank: self.rank,
                peer: pending.to,
                detail: format!("sending tag {:#x}: {reason}", pending.tag),
            }));
        }
    }

    /// Every peer is unreachable (the sequencer is gone or this rank is shutting down).
    fn all_gone(&self, reason: &str) {
        for peer in (0..self.world).filter(|&p| p != self.rank) {
            self.mailbox.peer_gone(peer, reason.to_string());
        }
        let ids: Vec<u64> = lock(&self.outbox).keys().copied().collect();
        for id in ids {
            self.fail(id, reason.to_string());
        }
    }
}

fn in_transfer(error: LoaderError, tag: u64) -> LoaderError {
    error.in_context(&format!("sending tag {tag:#x}"), &format!("tag {tag:#x}"))
}

/// One rank's end of a sequenced transport (see the module docs): a control transport `C` plus
/// a data plane `P` on its own thread. Must be created inside a tokio runtime. Dropping it counts
/// as the rank leaving: its control connection closes and the sequencer tells the others.
pub struct SequencedTransport<C: Transport + 'static, P: DataPlane> {
    rank: u32,
    world: u32,
    options: TransportOptions,
    local: Arc<Local<P>>,
    control: Arc<C>,
    requests: mpsc::UnboundedSender<Input>,
    next_id: AtomicU64,
    tasks: Vec<JoinHandle<()>>,
}

impl<C: Transport + 'static, P: DataPlane> SequencedTransport<C, P> {
    /// Joins `control` (a connected mesh used only by this transport) and `plane` (this rank's
    /// data plane, of the same rank and world) into a transport. Every rank of the mesh must do
    /// the same; rank 0 sequences.
    pub fn new(control: C, plane: PlaneThread<P>, options: TransportOptions) -> Self {
        let (rank, world) = (control.rank(), control.world());
        let mailbox = Arc::new(Mailbox::new(rank, world));
        let local = Arc::new(Local {
            rank,
            world,
            plane,
            mailbox,
            outbox: Mutex::new(HashMap::new()),
            scratch: Arc::new(Mutex::new(None)),
        });
        let control = Arc::new(control);
        let (requests, inputs) = mpsc::unbounded_channel::<Input>();
        let mut tasks = Vec::new();
        if rank == SEQUENCER {
            // One reader per peer feeds the sequencer, which also takes this rank's requests.
            for peer in (0..world).filter(|&p| p != rank) {
                let control = Arc::clone(&control);
                let inputs = requests.clone();
                tasks.push(tokio::spawn(async move {
                    read_requests(control, peer, inputs).await;
                }));
            }
            tasks.push(tokio::spawn(sequence(
                Arc::clone(&control),
                Arc::clone(&local),
                inputs,
            )));
        } else {
            tasks.push(tokio::spawn(forward_requests(
                Arc::clone(&control),
                Arc::clone(&local),
                inputs,
            )));
            tasks.push(tokio::spawn(follow(
                Arc::clone(&control),
                Arc::clone(&local),
            )));
        }
        Self {
            rank,
            world,
            options,
            local,
            control,
            requests,
            next_id: AtomicU64::new(0),
            tasks,
        }
    }

    /// This rank's data plane thread (for the grouped ring exchange).
    pub fn plane(&self) -> &PlaneThread<P> {
        &self.local.plane
    }

    /// The control transport.
    pub fn control(&self) -> &C {
        &self.control
    }
}

/// Rank 0: reads `peer`'s requests until its connection ends.
async fn read_requests<C: Transport>(
    control: Arc<C>,
    peer: u32,
    inputs: mpsc::UnboundedSender<Input>,
) {
    loop {
        match control.recv(peer, TAG_REQUEST).await {
            Ok(bytes) => {
                let Some((id, to, tag, len)) = decode_request(&bytes) else {
                    let _ = inputs.send(Input::Gone {
                        rank: peer,
                        reason: format!("rank {peer} sent a malformed transfer request"),
                    });
                    return;
                };
                if inputs
                    .send(Input::Request {
                        from: peer,
                        id,
                        to,
                        tag,
                        len,
                    })
                    .is_err()
                {
                    return;
                }
            }
            // Idle is normal: nobody sends for a while.
            Err(LoaderError::PeerTimeout { .. }) => {}
            Err(e) => {
                let _ = inputs.send(Input::Gone {
                    rank: peer,
                    reason: format!("rank {peer} left: {e}"),
                });
                return;
            }
        }
    }
}

/// Rank 0: numbers transfers and tells both endpoints; announces ranks that leave.
async fn sequence<C: Transport, P: DataPlane>(
    control: Arc<C>,
    local: Arc<Local<P>>,
    mut inputs: mpsc::UnboundedReceiver<Input>,
) {
    let world = local.world;
    let mut alive = vec![true; world as usize];
    let mut seq = 0u64;
    let mut gone: Vec<(u32, String)> = Vec::new();
    while let Some(input) = inputs.recv().await {
        match input {
            Input::Request {
                from,
                id,
                to,
                tag,
                len,
            } => {
                let live = |r: u32| alive.get(r as usize).copied().unwrap_or(false);
                if !live(from) {
                    continue;
                }
                if to == from || !live(to) {
                    let reason = if to == from || to >= world {
                        format!("rank {from} asked to send to rank {to}")
                    } else {
                        format!("rank {to} has left")
                    };
                    if from == local.rank {
                        local.fail(id, reason);
                    } else if let Err(e) = control
                        .send(
                            from,
                            TAG_SEQUENCE,
                            encode_notice(&Notice::Reject { id, reason }),
                        )
                        .await
                    {
                        gone.push((from, format!("rank {from} is unreachable: {e}")));
                    }
                } else {
                    seq += 1;
                    let order = Order {
                        seq,
                        from,
                        to,
                        tag,
                        len,
                        id,
                    };
                    for endpoint in [from, to] {
                        if endpoint == local.rank {
                            local.apply(order);
                        } else if let Err(e) = control
                            .send(endpoint, TAG_SEQUENCE, encode_notice(&Notice::Order(order)))
                            .await
                        {
                            gone.push((endpoint, format!("rank {endpoint} is unreachable: {e}")));
                        }
                    }
                }
            }
            Input::Gone { rank, reason } => gone.push((rank, reason)),
        }
        while let Some((rank, reason)) = gone.pop() {
            let Some(flag) = alive.get_mut(rank as usize) else {
                continue;
            };
            if !std::mem::replace(flag, false) {
                continue;
            }
            local.peer_gone_after_pending(rank, reason.clone());
            for peer in (0..world).filter(|&p| p != local.rank && p != rank) {
                if !alive[peer as usize] {
                    continue;
                }
                let notice = Notice::Gone {
                    rank,
                    reason: reason.clone(),
                };
                if let Err(e) = control
                    .send(peer, TAG_SEQUENCE, encode_notice(&notice))
                    .await
                {
                    gone.push((peer, format!("rank {peer} is unreachable: {e}")));
                }
            }
        }
    }
}

/// Other ranks: sends this rank's requests to the sequencer, in the order they were made.
async fn forward_requests<C: Transport, P: DataPlane>(
    control: Arc<C>,
    local: Arc<Local<P>>,
    mut inputs: mpsc::UnboundedReceiver<Input>,
) {
    while let Some(input) = inputs.recv().await {
        let Input::Request {
            id, to, tag, len, ..
        } = input
        else {
            continue;
        };
        if let Err(e) = control
            .send(SEQUENCER, TAG_REQUEST, encode_request(id, to, tag, len))
            .await
        {
            local.fail(
                id,
                format!("rank 0, which orders every transfer, is unreachable: {e}"),
            );
        }
    }
}

/// Other ranks: acts on the sequencer's notices until it is gone.
async fn follow<C: Transport, P: DataPlane>(control: Arc<C>, local: Arc<Local<P>>) {
    loop {
        match control.recv(SEQUENCER, TAG_SEQUENCE).await {
            Ok(bytes) => match decode_notice(&bytes) {
                Some(Notice::Order(order)) => local.apply(order),
                Some(Notice::Gone { rank, reason }) => local.peer_gone_after_pending(rank, reason),
                Some(Notice::Reject { id, reason }) => local.fail(id, reason),
                None => {
                    local.all_gone("rank 0, which orders every transfer, sent a malformed notice");
                    return;
                }
            },
            Err(LoaderError::PeerTimeout { .. }) => {}
            Err(e) => {
                local.all_gone(&format!(
                    "rank 0, which orders every transfer, is gone: {e}"
                ));
                return;
            }
        }
    }
}

impl<C: Transport + 'static, P: DataPlane> Transport for SequencedTransport<C, P> {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    async fn send(&self, to: u32, tag: u64, data: Bytes) -> Result<(), LoaderError> {
        check_peer(self.rank, self.world, to, "send to")?;
        if let Some(reason) = self.local.mailbox.gone_reason(to) {
            return Err(LoaderError::Transport {
                rank: self.rank,
                peer: to,
                detail: format!("sending tag {tag:#x}: {reason}"),
            });
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let len = data.len() as u64;
        let (done, finished) = oneshot::channel();
        lock(&self.local.outbox).insert(
            id,
            Pending {
                to,
                tag,
                data,
                done,
            },
        );
        if self
            .requests
            .send(Input::Request {
                from: self.rank,
                id,
                to,
                tag,
                len,
            })
            .is_err()
        {
            self.local
                .fail(id, "this rank's transport is shutting down".to_string());
        }
        // The transfer runs once both planes reach it; a peer that does not take it within the
        // timeout is reported like a TCP peer that stops reading. (The bytes stay in the outbox:
        // the transfer still happens when its turn comes, so the global order stays intact.)
        match tokio::time::timeout(self.options.timeout, finished).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(LoaderError::Transport {
                rank: self.rank,
                peer: to,
                detail: format!("sending tag {tag:#x}: this rank's data plane is gone"),
            }),
            Err(_) => Err(LoaderError::PeerTimeout {
                rank: self.rank,
                peer: to,
                what: format!("sending tag {tag:#x} ({len} bytes) to be taken"),
                waited: self.options.timeout,
            }),
        }
    }

    async fn recv(&self, from: u32, tag: u64) -> Result<Bytes, LoaderError> {
        self.local
            .mailbox
            .recv(from, tag, self.options.timeout)
            .await
    }
}

impl<C: Transport + 'static, P: DataPlane> Drop for SequencedTransport<C, P> {
    fn drop(&mut self) {
        // The tasks hold the control transport; once they are gone it closes, which the
        // sequencer (or, for rank 0, every rank) sees as this rank leaving.
        for task in &self.tasks {
            task.abort();
        }
        self.local.mailbox.clear();
    }
}

impl<C: Transport + 'static, P: DataPlane> std::fmt::Debug for SequencedTransport<C, P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SequencedTransport")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("device", &self.local.plane.device())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn notices_round_trip() {
        for notice in [
            Notice::Order(Order {
                seq: 7,
                from: 3,
                to: 1,
                tag: u64::MAX,
                len: 1 << 40,
                id: 99,
            }),
            Notice::Gone {
                rank: 2,
                reason: "rank 2 left: closed".to_string(),
            },
            Notice::Reject {
                id: 5,
                reason: String::new(),
            },
        ] {
            assert_eq!(decode_notice(&encode_notice(&notice)).unwrap(), notice);
        }
        assert_eq!(
            decode_request(&encode_request(1, 2, 3, 4)).unwrap(),
            (1, 2, 3, 4)
        );
    }

    #[test]
    fn malformed_messages_are_refused() {
        assert!(decode_notice(&[]).is_none());
        assert!(decode_notice(&[9, 0, 0]).is_none());
        assert!(decode_notice(&[ORDER, 1, 2, 3]).is_none());
        let mut long = encode_notice(&Notice::Order(Order {
            seq: 1,
            from: 0,
            to: 1,
            tag: 0,
            len: 0,
            id: 0,
        }))
        .to_vec();
        long.push(0);
        assert!(decode_notice(&long).is_none());
        assert!(decode_request(&[0; 27]).is_none());
        assert!(decode_request(&[0; 29]).is_none());
    }
}
