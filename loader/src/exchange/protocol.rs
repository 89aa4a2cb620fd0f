//! The exchange protocol, written once, as a state machine without I/O of its own: events go in
//! (a piece read and verified, a message arrived, a message went out), actions come out (send
//! these bytes, receive that message). Drivers move the bytes: the async driver over any
//! [`crate::transport::Transport`] (`exchange::drive`), overlapped with the reads, and the Python
//! package's loop over the job's `torch.distributed` point-to-point ops. Parts, direct copies,
//! relays and the acknowledgements then work the same on every path.
//!
//! The messages of one rank's exchange, with their tags (u64 for tessera's transports, a small
//! per-pair tag for drivers whose tags are per pair of ranks and small, like torch's):
//!
//! | message | from → to | tag | pair tag | size |
//! |---|---|---|---|---|
//! | hello (pid and exchange token, or declining) | sender → receiver of shares | [`HELLO_TAG`] | 0 | framed |
//! | answer (1: I copy out of your memory) | receiver → sender | [`ANSWER_TAG`] | 2 | 1 byte |
//! | a share (part) as bytes | sender → receiver | the share's tag | 8 + 8k | known |
//! | a share (part) as a descriptor | sender → receiver | [`descriptor_tag`] | 8 + 8k + 2 | framed |
//! | acknowledgement of a copied share | receiver → sender | [`ack_tag`] | 8 + 8k + 4 | 1 byte |
//!
//! k is the message's index among the pair's messages in (group, round, part) order, which
//! sender and receiver compute alike. The hand-shake runs only where the driver can copy between
//! processes of one host (`direct`); the rest of the time the exchange is the shares as bytes.
//! A *framed* message's length is not known to its receiver: a driver whose receives need a
//! length sends it first (8 bytes, little-endian, under pair tag + 1).
//!
//! What a rank sends is gathered (or described) only once every piece of it was read and
//! verified ([`ExchangeProtocol::piece_read`]), and what arrives is placed only where the caller
//! says its buffers are free ([`ExchangeProtocol::pump`]: between reads, or after them): a
//! corrupt read fails this rank before any peer sees the bytes.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Deref;

use bytes::Bytes;
use tessera_planner::RankPlan;

use crate::LoaderError;
use crate::exchange::direct::{
    ANSWER_TAG, HELLO_TAG, PeerMemory, ShareDescriptor, ack_tag, descriptor_tag,
};
use crate::exchange::{
    ExchangeMessages, ExchangeStats, copy_share, describe_share, gather_message, invalid,
    place_message,
};

/// Pair tag of the hello.
const HELLO_PAIR_TAG: u32 = 0;
/// Pair tag of the answer.
const ANSWER_PAIR_TAG: u32 = 2;
/// Pair tags of the k-th message of a pair start here, [`PAIR_TAG_STRIDE`] apart.
const FIRST_MESSAGE_PAIR_TAG: u32 = 8;
const PAIR_TAG_STRIDE: u32 = 8;
/// Offsets of a message's descriptor and acknowledgement from its pair tag.
const DESCRIPTOR_PAIR_OFFSET: u32 = 2;
const ACK_PAIR_OFFSET: u32 = 4;

/// What a driver does next.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// Send `data` to rank `to`. A `framed` message's receiver does not know its length.
    Send {
        /// The receiving rank.
        to: u32,
        /// Its tag on tessera's transports.
        tag: u64,
        /// Its tag among the messages of this pair of ranks (see the module doc).
        pair_tag: u32,
        /// The bytes.
        data: Bytes,
        /// Whether the receiver learns the length only from the message.
        framed: bool,
    },
    /// Receive the next message rank `from` sends under `tag`: `bytes` long, or any length when
    /// `None` (a framed message).
    Recv {
        /// The sending rank.
        from: u32,
        /// Its tag on tessera's transports.
        tag: u64,
        /// Its tag among the messages of this pair of ranks.
        pair_tag: u32,
        /// Its length, when the protocol knows it.
        bytes: Option<u64>,
    },
}

/// A share that arrived, waiting to be placed.
enum Arrival {
    /// Its bytes.
    Bytes(Bytes),
    /// Where its bytes lie in the sender's memory.
    Direct(ShareDescriptor),
}

/// One rank's exchange (see the module doc), over its plan `P` (a reference, or an `Arc` where
/// the protocol must own it).
pub struct ExchangeProtocol<P: Deref<Target = RankPlan>> {
    plan: P,
    messages: ExchangeMessages,
    /// This rank's hello when the driver can copy between ranks of one host.
    hello: Option<Bytes>,
    /// Whether this rank copies out of peers that offer (`LoadOptions::cross_memory`).
    accept_direct: bool,
    /// Pair tag of every outgoing and incoming message.
    out_pair_tags: Vec<u32>,
    in_pair_tags: Vec<u32>,
    /// Peers whose hello has not arrived yet.
    hellos_due: BTreeSet<u32>,
    /// Peers whose answer has not arrived: until it does, how shares go to them is open.
    answers_due: BTreeSet<u32>,
    /// Peers that copy this rank's shares out of its memory.
    readers: HashSet<u32>,
    /// Peers whose shares this rank copies out of theirs.
    sources: HashMap<u32, PeerMemory>,
    /// Per outgoing message, how many of its pieces are still unread.
    left: Vec<usize>,
    /// Outgoing messages by piece.
    by_piece: HashMap<usize, Vec<usize>>,
    /// Outgoing messages read in full, waiting for their peer's answer or for buffers.
    ready: Vec<usize>,
    /// Outgoing messages offered (sent, or described).
    offered: Vec<bool>,
    /// The share of a group is the same for every round's peer: gathered (or described) once.
    prepared: HashMap<(bool, u32, Vec<usize>), Bytes>,
    /// Outgoing messages whose bytes went out, or whose copy was acknowledged.
    delivered: usize,
    /// Incoming messages by (sender, tag), outgoing ones being sent by (receiver, tag), and
    /// direct shares whose acknowledgement is due by (receiver, ack tag).
    incoming_by_tag: HashMap<(u32, u64), usize>,
    outgoing_by_tag: HashMap<(u32, u64), usize>,
    acks_due: HashMap<(u32, u64), usize>,
    arrived: Vec<(usize, Arrival)>,
    placed: usize,
    /// Incoming direct shares whose descriptor arrived, and whether each was acknowledged.
    acked: HashMap<usize, bool>,
    stats: ExchangeStats,
}

impl<P: Deref<Target = RankPlan>> ExchangeProtocol<P> {
    /// The exchange of `plan` cut into `messages`. `hello` is this rank's hello
    /// ([`crate::exchange::direct::Exposure::offer`]) when the driver can copy between processes of
    /// one host, `None` when it cannot (then no hand-shake runs and every share goes as bytes);
    /// `accept_direct` whether this rank copies out of peers that offer.
    pub fn new(
        plan: P,
        messages: ExchangeMessages,
        hello: Option<Bytes>,
        accept_direct: bool,
    ) -> Self {
        let out_pair_tags = pair_tags(
            messages
                .outgoing
                .iter()
                .map(|m| (m.to, m.group, m.round, m.part)),
        );
        let in_pair_tags = pair_tags(
            messages
                .incoming
                .iter()
                .map(|m| (m.from, m.group, m.round, m.part)),
        );
        let mut by_piece: HashMap<usize, Vec<usize>> = HashMap::new();
        for (m, message) in messages.outgoing.iter().enumerate() {
            for &piece in &message.pieces {
                by_piece.entry(piece).or_default().push(m);
            }
        }
        let (hellos_due, answers_due) = match hello {
            Some(_) => (
                messages.incoming.iter().map(|m| m.from).collect(),
                messages.outgoing.iter().map(|m| m.to).collect(),
            ),
            None => (BTreeSet::new(), BTreeSet::new()),
        };
        ExchangeProtocol {
            left: messages.outgoing.iter().map(|m| m.pieces.len()).collect(),
            offered: vec![false; messages.outgoing.len()],
            stats: ExchangeStats {
                messages: (messages.outgoing.len() + messages.incoming.len()) as u64,
                ..ExchangeStats::default()
            },
            plan,
            messages,
            hello,
            accept_direct,
            out_pair_tags,
            in_pair_tags,
            hellos_due,
            answers_due,
            readers: HashSet::new(),
            sources: HashMap::new(),
            by_piece,
            ready: Vec::new(),
            prepared: HashMap::new(),
            delivered: 0,
            incoming_by_tag: HashMap::new(),
            outgoing_by_tag: HashMap::new(),
            acks_due: HashMap::new(),
            arrived: Vec::new(),
            placed: 0,
            acked: HashMap::new(),
        }
    }

    /// The plan.
    pub fn plan(&self) -> &P {
        &self.plan
    }

    /// The messages.
    pub fn messages(&self) -> &ExchangeMessages {
        &self.messages
    }

    /// The first actions: the hand-shake's hellos and receives, or (without one) the receives of
    /// every share.
    pub fn start(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        match &self.hello {
            Some(hello) => {
                let send_to: BTreeSet<u32> = self.answers_due.clone();
                for &peer in &send_to {
                    actions.push(Action::Send {
                        to: peer,
                        tag: HELLO_TAG,
                        pair_tag: HELLO_PAIR_TAG,
                        data: hello.clone(),
                        framed: true,
                    });
                }
                for &peer in &self.hellos_due {
                    actions.push(Action::Recv {
                        from: peer,
                        tag: HELLO_TAG,
                        pair_tag: HELLO_PAIR_TAG,
                        bytes: None,
                    });
                }
                for &peer in &send_to {
                    actions.push(Action::Recv {
                        from: peer,
                        tag: ANSWER_TAG,
                        pair_tag: ANSWER_PAIR_TAG,
                        bytes: Some(1),
                    });
                }
            }
            None => {
                let peers: BTreeSet<u32> = self.messages.incoming.iter().map(|m| m.from).collect();
                for peer in peers {
                    self.receive_shares_of(peer, false, &mut actions);
                }
            }
        }
        actions
    }

    /// The receives of every share `peer` sends this rank: descriptors when it copies them
    /// (`direct`), else their bytes.
    fn receive_shares_of(&mut self, peer: u32, direct: bool, actions: &mut Vec<Action>) {
        for (i, expect) in self.messages.incoming.iter().enumerate() {
            if expect.from != peer {
                continue;
            }
            let pair_tag = self.in_pair_tags[i];
            let (tag, action) = if direct {
                let tag = descriptor_tag(expect.tag);
                (
                    tag,
                    Action::Recv {
                        from: peer,
                        tag,
                        pair_tag: pair_tag + DESCRIPTOR_PAIR_OFFSET,
                        bytes: None,
                    },
                )
            } else {
                (
                    expect.tag,
                    Action::Recv {
                        from: peer,
                        tag: expect.tag,
                        pair_tag,
                        bytes: Some(expect.bytes),
                    },
                )
            };
            self.incoming_by_tag.insert((peer, tag), i);
            actions.push(action);
        }
    }

    /// Piece `piece` (an index into the plan's pieces) is read, verified and placed in
    /// `buffers`: shares it completes go out (or, while their peer's answer is still due, wait).
    pub fn piece_read<B: AsRef<[u8]>>(
        &mut self,
        piece: usize,
        buffers: &[B],
    ) -> Result<Vec<Action>, LoaderError> {
        if let Some(waiting) = self.by_piece.get(&piece) {
            for &m in waiting {
                self.left[m] = self.left[m].saturating_sub(1);
                if self.left[m] == 0 {
                    self.ready.push(m);
                }
            }
        }
        self.offer_ready(buffers)
    }

    /// Every piece this rank reads is in `buffers` (an exchange after the reads).
    pub fn all_read<B: AsRef<[u8]>>(&mut self, buffers: &[B]) -> Result<Vec<Action>, LoaderError> {
        for (m, left) in self.left.iter_mut().enumerate() {
            if *left > 0 {
                *left = 0;
                self.ready.push(m);
            }
        }
        self.offer_ready(buffers)
    }

    /// After the last read: every share this rank sends must have been completed by it.
    pub fn reads_done(&self) -> Result<(), LoaderError> {
        if let Some((m, &missing)) = self.left.iter().enumerate().find(|(_, n)| **n > 0) {
            let message = &self.messages.outgoing[m];
            return Err(invalid(
                &self.plan,
                format!(
                    "group {} round {}: {missing} of the pieces to send to rank {} were never read",
                    message.group, message.round, message.to
                ),
            ));
        }
        Ok(())
    }

    /// Offers the shares that are read and whose peer's answer is in.
    fn offer_ready<B: AsRef<[u8]>>(&mut self, buffers: &[B]) -> Result<Vec<Action>, LoaderError> {
        let mut actions = Vec::new();
        let mut waiting = Vec::new();
        for m in std::mem::take(&mut self.ready) {
            let to = self.messages.outgoing[m].to;
            if self.answers_due.contains(&to) {
                waiting.push(m);
            } else {
                actions.push(self.offer(m, buffers)?);
            }
        }
        self.ready = waiting;
        Ok(actions)
    }

    fn offer<B: AsRef<[u8]>>(&mut self, m: usize, buffers: &[B]) -> Result<Action, LoaderError> {
        let message = &self.messages.outgoing[m];
        let direct = self.readers.contains(&message.to);
        let key = (direct, message.group, message.pieces.clone());
        let data = match self.prepared.get(&key) {
            Some(data) => data.clone(),
            None => {
                let data = if direct {
                    Bytes::from(describe_share(&self.plan, message, buffers)?.encode())
                } else {
                    let mut out = vec![0u8; message.bytes as usize];
                    gather_message(&self.plan, message, buffers, &mut out)?;
                    Bytes::from(out)
                };
                self.prepared.insert(key, data.clone());
                data
            }
        };
        self.offered[m] = true;
        let pair_tag = self.out_pair_tags[m];
        let (tag, pair_tag) = if direct {
            (
                descriptor_tag(message.tag),
                pair_tag + DESCRIPTOR_PAIR_OFFSET,
            )
        } else {
            (message.tag, pair_tag)
        };
        self.outgoing_by_tag.insert((message.to, tag), m);
        Ok(Action::Send {
            to: message.to,
            tag,
            pair_tag,
            data,
            framed: direct,
        })
    }

    /// A message arrived: from `from` under `tag`. Hellos are answered, answers settle how shares
    /// go to their sender, shares wait for [`ExchangeProtocol::pump`], acknowledgements complete
    /// a direct share. A message the protocol did not ask for, or of the wrong size, fails.
    pub fn received(
        &mut self,
        from: u32,
        tag: u64,
        data: Bytes,
    ) -> Result<Vec<Action>, LoaderError> {
        let rank = self.plan.rank;
        let transport = |detail: String| LoaderError::Transport {
            rank,
            peer: from,
            detail,
        };
        let mut actions = Vec::new();
        if tag == HELLO_TAG {
            if !self.hellos_due.remove(&from) {
                return Err(transport(
                    "sent a hello this rank did not expect".to_string(),
                ));
            }
            let memory = PeerMemory::accept(&data, self.accept_direct).map_err(transport)?;
            let direct = memory.is_some();
            if let Some(memory) = memory {
                self.sources.insert(from, memory);
            }
            actions.push(Action::Send {
                to: from,
                tag: ANSWER_TAG,
                pair_tag: ANSWER_PAIR_TAG,
                data: Bytes::from_static(if direct { &[1] } else { &[0] }),
                framed: false,
            });
            self.receive_shares_of(from, direct, &mut actions);
            return Ok(actions);
        }
        if tag == ANSWER_TAG {
            if !self.answers_due.remove(&from) {
                return Err(transport(
                    "answered a hello this rank did not send".to_string(),
                ));
            }
            match &data[..] {
                [answer @ (0 | 1)] => {
                    if *answer == 1 {
                        self.readers.insert(from);
                    }
                }
                other => {
                    return Err(transport(format!(
                        "answered the hello with {} bytes",
                        other.len()
                    )));
                }
            }
            return Ok(actions);
        }
        if let Some(m) = self.acks_due.remove(&(from, tag)) {
            // The peer copied a direct share: this rank's buffers may change now.
            let message = &self.messages.outgoing[m];
            if data[..] == [0] {
                return Err(transport(format!(
                    "group {} round {}: it could not copy its share out of this rank's memory \
                     (its own error says why)",
                    message.group, message.round
                )));
            }
            if data[..] != [1] {
                return Err(transport(format!(
                    "group {} round {}: a {}-byte acknowledgement",
                    message.group,
                    message.round,
                    data.len()
                )));
            }
            self.delivered += 1;
            self.stats.bytes_sent += message.bytes;
            return Ok(actions);
        }
        let Some(i) = self.incoming_by_tag.remove(&(from, tag)) else {
            return Err(transport(format!(
                "sent a message this rank did not expect (tag {tag:#x})"
            )));
        };
        let expect = &self.messages.incoming[i];
        if tag == expect.tag {
            if data.len() as u64 != expect.bytes {
                return Err(transport(format!(
                    "group {} round {}: expected {} bytes but got {}",
                    expect.group,
                    expect.round,
                    expect.bytes,
                    data.len()
                )));
            }
            self.stats.bytes_received += expect.bytes;
            self.arrived.push((i, Arrival::Bytes(data)));
        } else {
            let descriptor = ShareDescriptor::decode(&data).map_err(transport)?;
            self.acked.insert(i, false);
            self.stats.bytes_received += expect.bytes;
            self.arrived.push((i, Arrival::Direct(descriptor)));
        }
        Ok(actions)
    }

    /// A message this rank sent (to `to` under `tag`) went out: a share's bytes are delivered; a
    /// descriptor's share waits for its acknowledgement (the buffers stay put until then).
    pub fn sent(&mut self, to: u32, tag: u64) -> Vec<Action> {
        let Some(m) = self.outgoing_by_tag.remove(&(to, tag)) else {
            // A hello, an answer or an acknowledgement: nothing waits on it going out.
            return Vec::new();
        };
        let message = &self.messages.outgoing[m];
        if tag == message.tag {
            self.delivered += 1;
            self.stats.bytes_sent += message.bytes;
            return Vec::new();
        }
        let ack = ack_tag(message.tag);
        self.acks_due.insert((to, ack), m);
        vec![Action::Recv {
            from: to,
            tag: ack,
            pair_tag: self.out_pair_tags[m] + ACK_PAIR_OFFSET,
            bytes: Some(1),
        }]
    }

    /// Where `buffers` are free to write (between reads, or after them): places what arrived
    /// (copying direct shares out of their senders' memory and acknowledging them) and offers
    /// the shares whose peer's answer came in since.
    pub fn pump<B: AsMut<[u8]> + AsRef<[u8]>>(
        &mut self,
        buffers: &mut [B],
    ) -> Result<Vec<Action>, LoaderError> {
        let mut actions = Vec::new();
        for (i, arrival) in std::mem::take(&mut self.arrived) {
            let expect = &self.messages.incoming[i];
            match arrival {
                Arrival::Bytes(data) => place_message(&self.plan, expect, &data, buffers)?,
                Arrival::Direct(descriptor) => {
                    let Some(source) = self.sources.get(&expect.from) else {
                        return Err(invalid(
                            &self.plan,
                            format!("rank {} sent a share descriptor unasked", expect.from),
                        ));
                    };
                    copy_share(&self.plan, expect, source, &descriptor, buffers)?;
                    self.stats.bytes_received_direct += expect.bytes;
                    self.acked.insert(i, true);
                    actions.push(Action::Send {
                        to: expect.from,
                        tag: ack_tag(expect.tag),
                        pair_tag: self.in_pair_tags[i] + ACK_PAIR_OFFSET,
                        data: Bytes::from_static(&[1]),
                        framed: false,
                    });
                }
            }
            self.placed += 1;
        }
        actions.extend(self.offer_ready(buffers)?);
        Ok(actions)
    }

    /// What a rank that fails says before it goes: a negative acknowledgement of every direct
    /// share it did not copy, so that the share's sender fails at once (naming this rank)
    /// instead of waiting out its timeout. Drivers whose transport tells peers of a failed rank
    /// by itself (tessera's) need not send them.
    pub fn farewell(&mut self) -> Vec<Action> {
        let mut actions = Vec::new();
        for (&i, acked) in self.acked.iter_mut().filter(|(_, acked)| !**acked) {
            *acked = true;
            let expect = &self.messages.incoming[i];
            actions.push(Action::Send {
                to: expect.from,
                tag: ack_tag(expect.tag),
                pair_tag: self.in_pair_tags[i] + ACK_PAIR_OFFSET,
                data: Bytes::from_static(&[0]),
                framed: false,
            });
        }
        actions
    }

    /// Whether every share that arrived is placed and every share this rank sends is offered:
    /// nothing more needs this rank's buffers to be free.
    pub fn placed_all(&self) -> bool {
        self.placed == self.messages.incoming.len() && self.offered.iter().all(|&o| o)
    }

    /// Whether the exchange is over: every share placed, every share delivered (sent, or copied
    /// and acknowledged), the hand-shake done.
    pub fn is_done(&self) -> bool {
        self.placed_all()
            && self.delivered == self.messages.outgoing.len()
            && self.hellos_due.is_empty()
            && self.answers_due.is_empty()
    }

    /// The ranks this rank still waits on (for an error that names them).
    pub fn waiting_on(&self) -> Vec<u32> {
        let mut peers: BTreeSet<u32> = self.hellos_due.union(&self.answers_due).copied().collect();
        peers.extend(self.incoming_by_tag.keys().map(|(from, _)| *from));
        peers.extend(self.outgoing_by_tag.keys().map(|(to, _)| *to));
        peers.extend(self.acks_due.keys().map(|(to, _)| *to));
        peers.into_iter().collect()
    }

    /// What the exchange moved so far.
    pub fn stats(&self) -> &ExchangeStats {
        &self.stats
    }
}

/// The pair tag of each message: [`FIRST_MESSAGE_PAIR_TAG`] + [`PAIR_TAG_STRIDE`] × its index
/// among the messages with the same peer in (group, round, part) order.
fn pair_tags(messages: impl Iterator<Item = (u32, u32, u32, u32)>) -> Vec<u32> {
    let messages: Vec<_> = messages.collect();
    let mut by_peer: HashMap<u32, Vec<usize>> = HashMap::new();
    for (i, (peer, ..)) in messages.iter().enumerate() {
        by_peer.entry(*peer).or_default().push(i);
    }
    let mut tags = vec![0; messages.len()];
    for indices in by_peer.values_mut() {
        indices.sort_by_key(|&i| (messages[i].1, messages[i].2, messages[i].3));
        for (k, &i) in indices.iter().enumerate() {
            tags[i] = FIRST_MESSAGE_PAIR_TAG + PAIR_TAG_STRIDE * k as u32;
        }
    }
    tags
}
