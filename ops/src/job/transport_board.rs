//! The job's rounds over the job's own transport ([`tessera_loader::transport::Transport`]: TCP
//! between processes, in-process between tasks): rank 0 holds the board (every key the rounds
//! put, every round's arrivals) and serves each peer from a task of its own while it runs its own
//! rounds; a peer sends what it puts to rank 0 and asks it for what it fetches or waits for. A
//! star: rank 0 moves O(world) messages, a peer O(its own).
//!
//! Failures: a rank whose round fails tells rank 0 (its own error, as it will raise it), which
//! tells every other rank at once, even one busy reading its pieces, so every rank fails naming
//! it. A peer that dies (its connection ends) fails every rank naming it, as the transport blames
//! it. Every wait is bounded by the transport's timeout: rank 0 names the ranks that did not
//! arrive within it, and a peer waits one timeout longer than rank 0 for its answer, so that rank
//! 0's word (naming the late rank) reaches it before its own wait on rank 0 runs out.
//!
//! Tags: both top bits and bit 61 set ([`BOARD_TAG`]); exchange tags keep their top two bits
//! clear (`tessera_loader::transport::share_part_tag`), a share's descriptor and acknowledgement
//! set only one of them, and the exchange's own control tags (`HELLO_TAG | 0..=3`) keep bit 61
//! clear, so the rounds' messages never meet the exchange's.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use futures::future::BoxFuture;
use tessera_loader::LoaderError;
use tessera_loader::exchange::direct::HELLO_TAG;
use tessera_loader::transport::Transport;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::memory_board::JobFailure;
use super::{Action, AsyncJobWork, Event, RankRounds, Round};
use crate::OpsError;

/// Transport tag of what a peer sends rank 0's board (puts, arrivals, fetches, its failure).
pub const BOARD_TAG: u64 = HELLO_TAG | 1 << 61;
/// Transport tag of rank 0's replies to a peer (arrived, values, another rank's failure).
const REPLY_TAG: u64 = BOARD_TAG | 1;

const ROUNDS: [Round; 6] = [
    Round::Requests,
    Round::TierVerification,
    Round::Plan,
    Round::PlanAgreement,
    Round::Read,
    Round::JointChecks,
];

/// A rank's failure as the board passes it on: the rank, its round and its error as text, or
/// (`died`) what rank 0's transport said of its connection's end.
#[derive(Clone, Debug)]
struct Failure {
    rank: u32,
    round: Round,
    message: String,
    died: bool,
}

impl Failure {
    /// The failure as rank `me` raises it: a rank that died as its own transport would name it
    /// (`rank {me}: transport to rank {dead} failed: ...`), another rank's error as it said it.
    fn on(self, me: u32) -> JobFailure {
        let error = if self.died {
            OpsError::from(LoaderError::Transport {
                rank: me,
                peer: self.rank,
                detail: self.message,
            })
        } else {
            OpsError::invalid(self.message)
        };
        JobFailure {
            rank: self.rank,
            round: self.round,
            error: Box::new(error),
        }
    }
}

/// How a rank reads its pieces when the rounds say so ([`Action::Read`]): its folds of the boxes
/// it read in parts, encoded. The reader keeps what the read leaves (buffers, stats) for the
/// front end; `work` is the rank's own.
pub trait ReadPieces<W>: Send {
    /// Reads this rank's pieces.
    fn read<'a>(&'a mut self, work: &'a mut W) -> BoxFuture<'a, Result<Bytes, OpsError>>;
}

/// What a peer sends rank 0.
#[derive(Debug)]
enum Request {
    Put {
        key: String,
        value: Bytes,
    },
    Arrive(Round),
    Get {
        keys: Vec<String>,
        round: Round,
    },
    Await {
        key: String,
        round: Round,
    },
    Fail {
        round: Round,
        message: String,
    },
    /// The peer reached the exchange: it asks nothing more.
    Done,
}

/// What rank 0 sends a peer.
#[derive(Debug)]
enum Reply {
    Arrived,
    Values(Vec<Option<Bytes>>),
    Failed(Failure),
}

fn put_str(out: &mut BytesMut, s: &str) {
    out.put_u32_le(s.len() as u32);
    out.extend_from_slice(s.as_bytes());
}

fn put_round(out: &mut BytesMut, round: Round) {
    out.put_u8((round.number() - 1) as u8);
}

/// Reads a message's fields, refusing one that is cut short.
struct Reader(Bytes);

impl Reader {
    fn need(&self, n: usize) -> Result<(), String> {
        if self.0.remaining() < n {
            return Err(format!(
                "{} bytes left where {n} were expected",
                self.0.remaining()
            ));
        }
        Ok(())
    }
    fn u8(&mut self) -> Result<u8, String> {
        self.need(1)?;
        Ok(self.0.get_u8())
    }
    fn u32(&mut self) -> Result<u32, String> {
        self.need(4)?;
        Ok(self.0.get_u32_le())
    }
    fn bytes(&mut self, n: usize) -> Result<Bytes, String> {
        self.need(n)?;
        Ok(self.0.split_to(n))
    }
    fn string(&mut self) -> Result<String, String> {
        let n = self.u32()? as usize;
        let bytes = self.bytes(n)?;
        String::from_utf8(bytes.to_vec()).map_err(|e| format!("a key that is not UTF-8: {e}"))
    }
    fn round(&mut self) -> Result<Round, String> {
        let n = self.u8()?;
        ROUNDS
            .get(n as usize)
            .copied()
            .ok_or_else(|| format!("round {} of {}", u32::from(n) + 1, ROUNDS.len()))
    }
    fn end(&self) -> Result<(), String> {
        if self.0.has_remaining() {
            return Err(format!("{} bytes too many", self.0.remaining()));
        }
        Ok(())
    }
}

impl Request {
    fn encode(&self) -> Bytes {
        let mut out = BytesMut::new();
        match self {
            Request::Put { key, value } => {
                out.put_u8(0);
                put_str(&mut out, key);
                out.extend_from_slice(value);
            }
            Request::Arrive(round) => {
                out.put_u8(1);
                put_round(&mut out, *round);
            }
            Request::Get { keys, round } => {
                out.put_u8(2);
                put_round(&mut out, *round);
                out.put_u32_le(keys.len() as u32);
                for key in keys {
                    put_str(&mut out, key);
                }
            }
            Request::Await { key, round } => {
                out.put_u8(3);
                put_round(&mut out, *round);
                put_str(&mut out, key);
            }
            Request::Fail { round, message } => {
                out.put_u8(4);
                put_round(&mut out, *round);
                out.extend_from_slice(message.as_bytes());
            }
            Request::Done => out.put_u8(5),
        }
        out.freeze()
    }

    fn decode(bytes: Bytes) -> Result<Request, String> {
        let mut r = Reader(bytes);
        let request = match r.u8()? {
            0 => {
                let key = r.string()?;
                let value = r.0.split_off(0);
                Request::Put { key, value }
            }
            1 => Request::Arrive(r.round()?),
            2 => {
                let round = r.round()?;
                let n = r.u32()? as usize;
                let keys = (0..n).map(|_| r.string()).collect::<Result<Vec<_>, _>>()?;
                Request::Get { keys, round }
            }
            3 => {
                let round = r.round()?;
                Request::Await {
                    key: r.string()?,
                    round,
                }
            }
            4 => {
                let round = r.round()?;
                let message = String::from_utf8_lossy(&r.0.split_off(0)).into_owned();
                Request::Fail { round, message }
            }
            5 => Request::Done,
            other => return Err(format!("unknown request {other}")),
        };
        r.end()?;
        Ok(request)
    }
}

impl Reply {
    fn encode(&self) -> Bytes {
        let mut out = BytesMut::new();
        match self {
            Reply::Arrived => out.put_u8(0),
            Reply::Values(values) => {
                out.put_u8(1);
                out.put_u32_le(values.len() as u32);
                for value in values {
                    match value {
                        None => out.put_u8(0),
                        Some(v) => {
                            out.put_u8(1);
                            out.put_u64_le(v.len() as u64);
                            out.extend_from_slice(v);
                        }
                    }
                }
            }
            Reply::Failed(f) => {
                out.put_u8(2);
                out.put_u32_le(f.rank);
                put_round(&mut out, f.round);
                out.put_u8(u8::from(f.died));
                out.extend_from_slice(f.message.as_bytes());
            }
        }
        out.freeze()
    }

    fn decode(bytes: Bytes) -> Result<Reply, String> {
        let mut r = Reader(bytes);
        let reply = match r.u8()? {
            0 => Reply::Arrived,
            1 => {
                let n = r.u32()? as usize;
                let mut values = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    values.push(match r.u8()? {
                        0 => None,
                        _ => {
                            r.need(8)?;
                            let len = r.0.get_u64_le();
                            let len = usize::try_from(len).map_err(|e| e.to_string())?;
                            Some(r.bytes(len)?)
                        }
                    });
                }
                Reply::Values(values)
            }
            2 => {
                let rank = r.u32()?;
                let round = r.round()?;
                let died = r.u8()? != 0;
                let message = String::from_utf8_lossy(&r.0.split_off(0)).into_owned();
                Reply::Failed(Failure {
                    rank,
                    round,
                    message,
                    died,
                })
            }
            other => return Err(format!("unknown reply {other}")),
        };
        r.end()?;
        Ok(reply)
    }
}

/// Rank 0's board: every key put, every round's arrivals, the first failure, and whether rank 0
/// reached the exchange.
struct Board {
    world: u32,
    timeout: Duration,
    state: Mutex<BoardState>,
    /// Woken on every put, arrival and failure; waiters re-check what they wait for.
    changed: Notify,
}

#[derive(Default)]
struct BoardState {
    values: HashMap<String, Bytes>,
    arrived: HashMap<Round, Vec<bool>>,
    failure: Option<Failure>,
    finished: bool,
}

impl Board {
    fn lock(&self) -> MutexGuard<'_, BoardState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn put(&self, key: String, value: Bytes) {
        self.lock().values.insert(key, value);
        self.changed.notify_waiters();
    }

    fn get(&self, keys: &[String]) -> Vec<Option<Bytes>> {
        let state = self.lock();
        keys.iter().map(|k| state.values.get(k).cloned()).collect()
    }

    /// Records `failure` unless a rank failed first; the first failure is the job's.
    fn fail(&self, failure: Failure) -> Failure {
        let first = self.lock().failure.get_or_insert(failure).clone();
        self.changed.notify_waiters();
        first
    }

    fn finish(&self) {
        self.lock().finished = true;
        self.changed.notify_waiters();
    }

    /// Waits until `ready` gives a value, a rank fails, or the transport's timeout passes (then
    /// `late` says who failed).
    async fn wait<T>(
        &self,
        mut ready: impl FnMut(&BoardState) -> Option<T>,
        late: impl FnOnce(&BoardState) -> Failure,
    ) -> Result<T, Failure> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                // What is there is delivered even after a failure (a verdict every rank takes
                // itself); a wait that would go on ends with the failure.
                let state = self.lock();
                if let Some(value) = ready(&state) {
                    return Ok(value);
                }
                if let Some(failure) = &state.failure {
                    return Err(failure.clone());
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                let failure = late(&self.lock());
                return Err(self.fail(failure));
            }
        }
    }

    async fn arrive(&self, rank: u32, round: Round) -> Result<(), Failure> {
        {
            let world = self.world as usize;
            let mut state = self.lock();
            let arrived = state
                .arrived
                .entry(round)
                .or_insert_with(|| vec![false; world]);
            if let Some(slot) = arrived.get_mut(rank as usize) {
                *slot = true;
            }
        }
        self.changed.notify_waiters();
        let timeout = self.timeout;
        self.wait(
            |state| {
                state
                    .arrived
                    .get(&round)
                    .is_some_and(|a| a.iter().all(|&x| x))
                    .then_some(())
            },
            |state| {
                let missing: Vec<u32> = state
                    .arrived
                    .get(&round)
                    .map(|a| {
                        a.iter()
                            .enumerate()
                            .filter(|(_, x)| !**x)
                            .map(|(r, _)| r as u32)
                            .collect()
                    })
                    .unwrap_or_default();
                Failure {
                    rank: missing.first().copied().unwrap_or(0),
                    round,
                    died: false,
                    message: format!(
                        "rank 0 waited {timeout:?} for ranks {} to arrive at round {} ({}); they may have died or hang",
                        tessera_loader::exchange::agree::ranks_text(&missing),
                        round.number(),
                        round.step()
                    ),
                }
            },
        )
        .await
    }

    async fn await_key(&self, key: &str, round: Round) -> Result<Bytes, Failure> {
        let timeout = self.timeout;
        self.wait(
            |state| state.values.get(key).cloned(),
            |_| Failure {
                rank: 0,
                round,
                died: false,
                message: format!(
                    "rank 0 did not write {key} within {timeout:?} in round {} ({})",
                    round.number(),
                    round.step()
                ),
            },
        )
        .await
    }

    /// The job's first failure, once there is one.
    async fn failed(&self) -> Failure {
        loop {
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(failure) = &self.lock().failure {
                return failure.clone();
            }
            notified.await;
        }
    }
}

/// Rank 0 serves peer `peer` until it reaches the exchange, fails or dies. After another rank
/// failed, what the peer asks for that is there is still given (the verdict on the plan: every
/// rank raises its own refusal) and a wait that would go on ends with the failure; a peer busy
/// reading its pieces, which asks nothing, is told at once.
async fn serve<T: Transport>(board: Arc<Board>, transport: Arc<T>, peer: u32) {
    let mut round = Round::Requests;
    // The peer took the verdict and reads its pieces: it asks nothing until it is done.
    let mut reading = false;
    let tell = |reply: Reply| {
        let transport = Arc::clone(&transport);
        async move {
            // A peer that cannot be told is gone; its own waits fail it.
            let _ = transport.send(peer, REPLY_TAG, reply.encode()).await;
        }
    };
    loop {
        let received = if reading {
            tokio::select! {
                biased;
                received = transport.recv(peer, BOARD_TAG) => received,
                failure = board.failed() => {
                    tell(Reply::Failed(failure)).await;
                    return;
                }
            }
        } else {
            transport.recv(peer, BOARD_TAG).await
        };
        let bytes = match received {
            Ok(bytes) => bytes,
            // A peer reading or waiting says nothing for a while: the waits on it are bounded
            // where they happen. Once rank 0 reached the exchange, only its word that it did
            // too is due; once a rank failed, a peer that says nothing is not waited for.
            Err(LoaderError::PeerTimeout { .. }) => {
                let (finished, failure) = {
                    let state = board.lock();
                    (state.finished, state.failure.clone())
                };
                if let Some(failure) = failure {
                    tell(Reply::Failed(failure)).await;
                    return;
                }
                if finished {
                    board.fail(Failure {
                        rank: peer,
                        round,
                        died: false,
                        message: format!(
                            "rank 0: rank {peer} did not say within {:?} that it reached the exchange",
                            board.timeout
                        ),
                    });
                    return;
                }
                continue;
            }
            // Its connection ended: every rank names it as its own transport would.
            Err(LoaderError::Transport { detail, .. }) => {
                board.fail(Failure {
                    rank: peer,
                    round,
                    message: detail,
                    died: true,
                });
                return;
            }
            Err(error) => {
                board.fail(Failure {
                    rank: peer,
                    round,
                    message: error.to_string(),
                    died: false,
                });
                return;
            }
        };
        reading = false;
        let request = match Request::decode(bytes) {
            Ok(request) => request,
            Err(why) => {
                let failure = board.fail(Failure {
                    rank: peer,
                    round,
                    died: false,
                    message: format!(
                        "rank 0: rank {peer}'s message of the job's rounds does not decode: {why}"
                    ),
                });
                tell(Reply::Failed(failure)).await;
                return;
            }
        };
        let reply = match request {
            Request::Put { key, value } => {
                board.put(key, value);
                continue;
            }
            Request::Arrive(r) => {
                round = r;
                board.arrive(peer, r).await.map(|()| Reply::Arrived)
            }
            Request::Get { keys, round: r } => {
                round = r;
                Ok(Reply::Values(board.get(&keys)))
            }
            Request::Await { key, round: r } => {
                round = r;
                reading = r == Round::PlanAgreement;
                board
                    .await_key(&key, r)
                    .await
                    .map(|v| Reply::Values(vec![Some(v)]))
            }
            Request::Fail { round, message } => {
                board.fail(Failure {
                    rank: peer,
                    round,
                    message,
                    died: false,
                });
                return;
            }
            Request::Done => return,
        };
        match reply {
            Ok(reply) => tell(reply).await,
            Err(failure) => {
                tell(Reply::Failed(failure)).await;
                return;
            }
        }
    }
}

/// Whether `failure` is a transport's (rank 0 gone), not a rank's word.
fn is_transport(failure: &JobFailure) -> bool {
    matches!(&*failure.error, OpsError::Loader(_))
}

/// This rank's side of the board: rank 0 holds it (and serves every peer), a peer asks rank 0.
enum Side<T> {
    Holder {
        board: Arc<Board>,
        servers: Vec<JoinHandle<()>>,
    },
    Peer {
        transport: Arc<T>,
    },
}

impl<T: Transport + 'static> Side<T> {
    async fn send(transport: &T, request: Request, round: Round) -> Result<(), JobFailure> {
        match transport.send(0, BOARD_TAG, request.encode()).await {
            Ok(()) => Ok(()),
            // Rank 0 left: when another rank failed, it told this one before it went (its word
            // is still delivered), and that failure is the one to name.
            Err(error) => Err(match Self::reply(transport, round).await {
                Err(failure) if failure.rank != 0 || !is_transport(&failure) => failure,
                _ => JobFailure {
                    rank: 0,
                    round,
                    error: Box::new(error.into()),
                },
            }),
        }
    }

    /// Rank 0's reply. A peer waits one timeout more than rank 0 waits for any rank, so that
    /// rank 0's word naming a late rank comes first; then it blames rank 0.
    async fn reply(transport: &T, round: Round) -> Result<Reply, JobFailure> {
        let mut patience = 1;
        loop {
            match transport.recv(0, REPLY_TAG).await {
                Ok(bytes) => {
                    return match Reply::decode(bytes) {
                        Ok(Reply::Failed(failure)) => Err(failure.on(transport.rank())),
                        Ok(reply) => Ok(reply),
                        Err(why) => Err(JobFailure {
                            rank: 0,
                            round,
                            error: Box::new(OpsError::invalid(format!(
                                "rank {}: rank 0's reply in the job's rounds does not decode: {why}",
                                transport.rank()
                            ))),
                        }),
                    };
                }
                Err(LoaderError::PeerTimeout { .. }) if patience > 0 => patience -= 1,
                Err(error) => {
                    return Err(JobFailure {
                        rank: 0,
                        round,
                        error: Box::new(error.into()),
                    });
                }
            }
        }
    }

    fn out_of_turn(rank: u32, round: Round, reply: &Reply) -> JobFailure {
        JobFailure {
            rank,
            round,
            error: Box::new(OpsError::invalid(format!(
                "rank {rank}: rank 0 replied {reply:?} out of turn in round {} ({})",
                round.number(),
                round.step()
            ))),
        }
    }

    async fn put(&self, key: String, value: Bytes, round: Round) -> Result<(), JobFailure> {
        match self {
            Side::Holder { board, .. } => {
                board.put(key, value);
                Ok(())
            }
            Side::Peer { transport } => {
                Self::send(transport, Request::Put { key, value }, round).await
            }
        }
    }

    async fn arrive(&self, round: Round) -> Result<(), JobFailure> {
        match self {
            Side::Holder { board, .. } => board.arrive(0, round).await.map_err(|f| f.on(0)),
            Side::Peer { transport } => {
                Self::send(transport, Request::Arrive(round), round).await?;
                match Self::reply(transport, round).await? {
                    Reply::Arrived => Ok(()),
                    other => Err(Self::out_of_turn(transport.rank(), round, &other)),
                }
            }
        }
    }

    async fn values(
        &self,
        request: Request,
        round: Round,
        count: usize,
    ) -> Result<Vec<Option<Bytes>>, JobFailure> {
        let Side::Peer { transport } = self else {
            unreachable!("rank 0 reads its own board")
        };
        Self::send(transport, request, round).await?;
        match Self::reply(transport, round).await? {
            Reply::Values(values) if values.len() == count => Ok(values),
            other => Err(Self::out_of_turn(transport.rank(), round, &other)),
        }
    }

    async fn get(&self, keys: Vec<String>, round: Round) -> Result<Vec<Option<Bytes>>, JobFailure> {
        match self {
            Side::Holder { board, .. } => Ok(board.get(&keys)),
            Side::Peer { .. } => {
                let count = keys.len();
                self.values(Request::Get { keys, round }, round, count)
                    .await
            }
        }
    }

    async fn await_key(&self, key: String, round: Round) -> Result<Bytes, JobFailure> {
        match self {
            Side::Holder { board, .. } => board.await_key(&key, round).await.map_err(|f| f.on(0)),
            Side::Peer { .. } => {
                let mut values = self.values(Request::Await { key, round }, round, 1).await?;
                values.pop().flatten().ok_or_else(|| JobFailure {
                    rank: 0,
                    round,
                    error: Box::new(OpsError::invalid(
                        "rank 0 answered an awaited key with none",
                    )),
                })
            }
        }
    }

    /// Resolves when another rank failed (while this one reads).
    async fn watch(&self, round: Round) -> JobFailure {
        match self {
            Side::Holder { board, .. } => board.failed().await.on(0),
            Side::Peer { transport } => loop {
                match transport.recv(0, REPLY_TAG).await {
                    Ok(bytes) => {
                        return match Reply::decode(bytes) {
                            Ok(Reply::Failed(failure)) => failure.on(transport.rank()),
                            Ok(other) => Self::out_of_turn(transport.rank(), round, &other),
                            Err(why) => JobFailure {
                                rank: 0,
                                round,
                                error: Box::new(OpsError::invalid(format!(
                                    "rank 0's word in the job's rounds does not decode: {why}"
                                ))),
                            },
                        };
                    }
                    // Rank 0 says nothing while every rank reads: that is the good case.
                    Err(LoaderError::PeerTimeout { .. }) => continue,
                    Err(error) => {
                        return JobFailure {
                            rank: 0,
                            round,
                            error: Box::new(error.into()),
                        };
                    }
                }
            },
        }
    }

    /// Tells the job this rank failed (`failure` is its own).
    async fn publish(&self, failure: &JobFailure) {
        let message = format!("{}", failure.error);
        match self {
            Side::Holder { board, .. } => {
                board.fail(Failure {
                    rank: failure.rank,
                    round: failure.round,
                    message,
                    died: false,
                });
            }
            Side::Peer { transport } => {
                let request = Request::Fail {
                    round: failure.round,
                    message,
                };
                // Rank 0 gone too: its death fails the others.
                let _ = Self::send(transport, request, failure.round).await;
            }
        }
    }

    /// This rank reached the exchange: a peer says so; rank 0 waits until every peer did (its
    /// servers ended), so that no peer is left waiting for a reply.
    async fn done(&mut self) -> Result<(), JobFailure> {
        match self {
            Side::Peer { transport } => {
                Self::send(transport, Request::Done, Round::JointChecks).await
            }
            Side::Holder { board, servers } => {
                board.finish();
                for server in servers.drain(..) {
                    let _ = server.await;
                }
                match board.lock().failure.clone() {
                    Some(failure) => Err(failure.on(0)),
                    None => Ok(()),
                }
            }
        }
    }
}

/// Runs rank `transport.rank()`'s rounds of the job over `transport` until they hand over to
/// the exchange: `hello` is what it says first ([`super::Hello`], encoded), `work` does its local
/// steps and `read` reads its pieces when the rounds say so (its folds of boxes read in parts,
/// encoded), stopped when another rank fails meanwhile. `timeout`: the transport's, which bounds
/// every wait. On rank 0 the board is served from one task per peer; every rank returns only
/// once no peer waits on it for the rounds.
///
/// An error names the rank that failed first and its round: this rank's own error, or another
/// rank's as it told rank 0, or a peer that died.
pub async fn run_job<T, W, R>(
    transport: Arc<T>,
    timeout: Duration,
    work: &mut W,
    hello: Bytes,
    read: &mut R,
) -> Result<(), JobFailure>
where
    T: Transport + 'static,
    W: AsyncJobWork,
    R: ReadPieces<W>,
{
    let (rank, world) = (transport.rank(), transport.world());
    let mut side = if rank == 0 {
        let board = Arc::new(Board {
            world,
            timeout,
            state: Mutex::new(BoardState::default()),
            changed: Notify::new(),
        });
        let servers = (1..world)
            .map(|peer| tokio::spawn(serve(Arc::clone(&board), Arc::clone(&transport), peer)))
            .collect();
        Side::Holder { board, servers }
    } else {
        Side::Peer {
            transport: Arc::clone(&transport),
        }
    };
    let outcome = drive(&side, rank, world, work, hello, read).await;
    match outcome {
        Ok(()) => side.done().await,
        Err(failure) => {
            if let Side::Holder { servers, .. } = &mut side {
                // Every server tells its peer, then ends.
                for server in servers.drain(..) {
                    let _ = server.await;
                }
            }
            Err(failure)
        }
    }
}

/// The rounds' loop: moves the machine's actions over `side` until the exchange.
async fn drive<T, W, R>(
    side: &Side<T>,
    rank: u32,
    world: u32,
    work: &mut W,
    hello: Bytes,
    read: &mut R,
) -> Result<(), JobFailure>
where
    T: Transport + 'static,
    W: AsyncJobWork,
    R: ReadPieces<W>,
{
    let mut rounds = RankRounds::new(rank, world);
    let mut queue: VecDeque<Action> = rounds.start(hello).into();
    let mut read = Some(read);
    let own = |round: Round, error: OpsError| JobFailure {
        rank,
        round,
        error: Box::new(error),
    };
    loop {
        let round = rounds.round();
        let Some(action) = queue.pop_front() else {
            let failure = own(
                round,
                OpsError::invalid(format!(
                    "rank {rank}: the job's rounds stopped before the exchange"
                )),
            );
            side.publish(&failure).await;
            return Err(failure);
        };
        let event = match action {
            Action::Put { key, value } => {
                side.put(key, value, round).await?;
                continue;
            }
            Action::Arrive { round } => {
                side.arrive(round).await?;
                Event::Arrived
            }
            Action::Get { keys, round } => Event::Got(side.get(keys, round).await?),
            Action::Await { key, round } => {
                Event::Got(vec![Some(side.await_key(key, round).await?)])
            }
            Action::Read => {
                let Some(read) = read.take() else {
                    let failure = own(
                        Round::Read,
                        OpsError::invalid(format!("rank {rank}: asked to read twice")),
                    );
                    side.publish(&failure).await;
                    return Err(failure);
                };
                let folds = tokio::select! {
                    folds = read.read(work) => folds,
                    failure = side.watch(Round::Read) => return Err(failure),
                };
                match folds {
                    Ok(folds) => Event::Read(folds),
                    Err(error) => {
                        let failure = own(Round::Read, error);
                        side.publish(&failure).await;
                        return Err(failure);
                    }
                }
            }
            Action::Exchange => return Ok(()),
        };
        match rounds.step_async(work, event).await {
            Ok(actions) => queue.extend(actions),
            Err(error) => {
                let failure = own(rounds.round(), error);
                side.publish(&failure).await;
                return Err(failure);
            }
        }
    }
}
