//! TCP transport: a full mesh of connections, one per pair of ranks.
//!
//! Rendezvous: rank 0 listens on `MASTER_ADDR:MASTER_PORT`; every other rank connects there
//! (retrying, since ranks start in any order), binds its own listener on the local address it
//! reached the master from (loopback when the master is on loopback), and reports that address.
//! Rank 0 answers everyone with the table of all listeners and a session id. Then every rank
//! connects to every higher rank, with a handshake naming both ranks and the session (a stray or
//! stale connection is turned away).
//!
//! ```text
//! hello  (rank -> master) "TSRH" version:u32 rank:u32 world:u32 job:u64 addr_len:u16 addr
//!                         terms:u16 (name_len:u16 name value_len:u16 value) x terms
//! table  (master -> rank) "TSRT" version:u32 session:u64 world:u32 (addr_len:u16 addr) x world
//! refuse (master -> rank) "TSRN" version:u32 kind:u8 len:u16 reason[len]  (instead of the table)
//! shake  (low -> high)    "TSPH" version:u32 session:u64 from:u32 to:u32 world:u32
//! ack    (high -> low)    "TSPA" to:u32
//! frame  (both ways)      tag:u64 len:u64 bytes[len]            all integers little-endian
//! bye    (both ways)      tag:u64 len:u64=2^64-1                (the last thing on a connection)
//! ```
//!
//! A reader task per connection buffers incoming frames in the rank's mailbox, so a send never
//! waits for the receiver to ask; end of stream or a reset marks the peer gone, which fails
//! pending and later receives from it at once. A rank that drops its transport (its load ended,
//! done or failed with its own error) says goodbye first; a peer whose connection ends without
//! one died (killed, crashed, cut off), and what fails on this rank after that is blamed on the
//! first peer that died ([`Mailbox::blame`]), not on a survivor that left because of it.
//!
//! Rank 0 refuses a connection that checks in with another world size, job fingerprint
//! ([`RendezvousConfig::job`]) or a rank number already taken, and one that is not a tessera
//! hello at all, on that connection alone: a stray (a rank of another job on the same port, a
//! stale process, a port scanner) must not abort a healthy job. The refused peer is answered
//! with the reason (it fails at once, saying it), rank 0 says each refusal on stderr, naming
//! the peer's address, and goes on waiting for its own ranks; if they do not all come by the
//! deadline, its error names the refusals too (they usually explain the missing rank).
//!
//! The hello also carries the options of the rank's plan ([`RendezvousConfig::plan`], `terms`,
//! utf-8 text). A rank of this job (same world and job fingerprint) that plans with other
//! options is not a stray: once every rank is in, rank 0 compares their options with its own
//! and, on any difference, sends every rank a refusal of kind [`CALLED_OFF`] naming each option,
//! both values and the rank, and fails itself with the same words; the mesh is never built.
//! Every wait is bounded by
//! [`TransportOptions::connect_timeout`]; with [`TransportOptions::progress_every`] each rank
//! says on stderr whom it is waiting for.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use backon::{ExponentialBuilder, Retryable};
use bytes::{Buf, BufMut, Bytes};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tessera_storage::RetryPolicy;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::{Mailbox, Transport, TransportOptions, check_peer};
use crate::LoaderError;
use crate::transport::rendezvous::{RendezvousConfig, plan_differences};

/// 2: the hello carries the job fingerprint. 3: and the plan's options; refusals.
const VERSION: u32 = 3;
const HELLO: &[u8; 4] = b"TSRH";
const TABLE: &[u8; 4] = b"TSRT";
const SHAKE: &[u8; 4] = b"TSPH";
const ACK: &[u8; 4] = b"TSPA";
const REFUSE: &[u8; 4] = b"TSRN";
/// A refusal's reason is a sentence or two; the cap keeps a corrupt length from asking for much.
const MAX_REASON_LEN: u16 = 4096;
/// A refusal of one connection that is not this job's: that rank fails, the job goes on.
const TURNED_AWAY: u8 = 0;
/// A refusal of the whole job: its ranks plan with different options.
const CALLED_OFF: u8 = 1;
/// Rank 0 gave up waiting for ranks that never checked in: the ones that did are told which.
const GAVE_UP: u8 = 2;
/// How much longer than its connect timeout a rank waits for rank 0's table, so that rank 0,
/// which may have started later, can say which ranks never came before this one gives up.
const VERDICT_GRACE: Duration = Duration::from_secs(3);
/// Plan options a hello may carry, and bytes of one name or value: a front end sends a handful
/// of flags and short values; the caps keep a corrupt count from asking for much.
const MAX_PLAN_TERMS: u16 = 64;
const MAX_TERM_LEN: u16 = 1024;
/// How long rank 0 tries to hand a refused peer its refusal.
const REFUSAL_WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// A socket address as text is at most ~50 bytes; anything longer is not one of ours.
const MAX_ADDR_LEN: u16 = 256;
/// Largest frame accepted from a peer (64 GiB): far above any piece share, and it keeps a corrupt
/// length from asking for an absurd allocation.
const MAX_FRAME: u64 = 1 << 36;
/// The length of a goodbye frame: far over [`MAX_FRAME`], so never a message's.
const GOODBYE: u64 = u64::MAX;
/// Messages up to this size are written with their header in one buffer (one segment with
/// nodelay); larger ones are written as header then payload, without copying the payload.
const COALESCE_BELOW: usize = 64 * 1024;

/// One rank's end of a TCP mesh. Dropping it closes its connections, which the other ranks see
/// as this rank dying.
pub struct TcpTransport {
    rank: u32,
    world: u32,
    options: TransportOptions,
    mailbox: Arc<Mailbox>,
    /// Per peer rank (`None` for this rank).
    writers: Vec<Option<tokio::sync::Mutex<PeerWriter>>>,
    readers: Vec<JoinHandle<()>>,
    /// Dropping says goodbye to the peers (false only for a test's crash).
    goodbye: bool,
}

struct PeerWriter {
    half: OwnedWriteHalf,
    /// Set while a frame is being written and left set when that write fails or is abandoned: the
    /// stream is then mid-frame and must not carry another message.
    broken: Option<String>,
}

fn rendezvous(detail: String) -> LoaderError {
    LoaderError::Rendezvous { detail }
}

impl TcpTransport {
    /// Joins the mesh described by `config`: rendezvous through rank 0, then connect to every
    /// other rank. Must run inside a tokio runtime (it spawns one reader task per peer). Fails
    /// with [`LoaderError::Rendezvous`] when the mesh is not up within
    /// [`TransportOptions::connect_timeout`].
    pub async fn connect(
        config: &RendezvousConfig,
        options: TransportOptions,
    ) -> Result<TcpTransport, LoaderError> {
        let (rank, world) = (config.rank, config.world);
        if world == 0 || rank >= world {
            return Err(rendezvous(format!(
                "rank {rank} is outside the world of {world} ranks"
            )));
        }
        let deadline = Instant::now() + options.connect_timeout;
        let mailbox = Arc::new(Mailbox::new(rank, world));
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        if world > 1 {
            let (session, table, listener) = if rank == 0 {
                master(config, &options, deadline).await?
            } else {
                worker(config, &options, deadline).await?
            };
            let mesh =
                build_mesh(rank, world, session, &table, &listener, &options, deadline).await?;
            for (peer, stream) in mesh {
                streams[peer as usize] = Some(stream);
            }
        }
        let mut writers = Vec::with_capacity(world as usize);
        let mut readers = Vec::with_capacity(world.saturating_sub(1) as usize);
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                writers.push(None);
                continue;
            };
            let (read, write) = stream.into_split();
            readers.push(tokio::spawn(read_loop(
                read,
                peer as u32,
                Arc::clone(&mailbox),
            )));
            writers.push(Some(tokio::sync::Mutex::new(PeerWriter {
                half: write,
                broken: None,
            })));
        }
        Ok(TcpTransport {
            rank,
            world,
            options,
            mailbox,
            writers,
            readers,
            goodbye: true,
        })
    }

    /// Closes every connection without a goodbye, as a killed process's connections end: what
    /// the peers see of a rank that died (tests of how they tell it from one that left).
    #[cfg(feature = "testing")]
    pub fn crash(mut self) {
        self.goodbye = false;
    }

    async fn send_frame(&self, to: u32, tag: u64, data: Bytes) -> Result<(), LoaderError> {
        check_peer(self.rank, self.world, to, "send to")?;
        let transport_error = |detail: String| LoaderError::Transport {
            rank: self.rank,
            peer: to,
            detail,
        };
        if let Some(reason) = self.mailbox.gone_reason(to) {
            return Err(self
                .mailbox
                .blame(transport_error(format!("sending tag {tag:#x}: {reason}"))));
        }
        let Some(Some(writer)) = self.writers.get(to as usize) else {
            return Err(transport_error("no connection to this rank".to_string()));
        };
        let write = async {
            let mut writer = writer.lock().await;
            if let Some(reason) = &writer.broken {
                return Err(transport_error(format!(
                    "sending tag {tag:#x}: the connection is unusable: {reason}"
                )));
            }
            writer.broken = Some("a send was abandoned mid-message".to_string());
            let mut header = [0u8; 16];
            let mut at = &mut header[..];
            at.put_u64_le(tag);
            at.put_u64_le(data.len() as u64);
            let written = if data.len() < COALESCE_BELOW {
                let mut frame = Vec::with_capacity(16 + data.len());
                frame.extend_from_slice(&header);
                frame.extend_from_slice(&data);
                writer.half.write_all(&frame).await
            } else {
                match writer.half.write_all(&header).await {
                    Ok(()) => writer.half.write_all(&data).await,
                    Err(e) => Err(e),
                }
            };
            match written {
                Ok(()) => {
                    writer.broken = None;
                    Ok(())
                }
                Err(e) => {
                    let detail = format!("sending tag {tag:#x} ({} bytes): {e}", data.len());
                    writer.broken = Some(detail.clone());
                    Err(transport_error(detail))
                }
            }
        };
        let error = match tokio::time::timeout(self.options.timeout, write).await {
            Ok(Ok(())) => return Ok(()),
            Ok(Err(error)) => error,
            Err(_) => LoaderError::PeerTimeout {
                rank: self.rank,
                peer: to,
                what: format!("sending tag {tag:#x} ({} bytes) to be taken", data.len()),
                waited: self.options.timeout,
            },
        };
        Err(self.mailbox.blame(error))
    }
}

impl Transport for TcpTransport {
    fn rank(&self) -> u32 {
        self.rank
    }

    fn world(&self) -> u32 {
        self.world
    }

    async fn send(&self, to: u32, tag: u64, data: Bytes) -> Result<(), LoaderError> {
        self.send_frame(to, tag, data).await
    }

    async fn recv(&self, from: u32, tag: u64) -> Result<Bytes, LoaderError> {
        self.mailbox.recv(from, tag, self.options.timeout).await
    }

    fn direct_copies(&self) -> bool {
        true
    }
}

impl Drop for TcpTransport {
    fn drop(&mut self) {
        // Goodbye to every peer whose connection is between messages, so that it tells this
        // rank leaving from a rank dying. Without waiting (a drop cannot): a peer whose
        // connection is mid-message or full gets none and counts this rank as dead, which is
        // what a rank that leaves in the middle of a message looks like anyway.
        let mut goodbye = Vec::with_capacity(16);
        goodbye.put_u64_le(0);
        goodbye.put_u64_le(GOODBYE);
        for writer in self.writers.iter().flatten().filter(|_| self.goodbye) {
            if let Ok(writer) = writer.try_lock()
                && writer.broken.is_none()
            {
                let _ = writer.half.try_write(&goodbye);
            }
        }
        // The write halves shut down as they drop; the read halves go with their tasks.
        for reader in &self.readers {
            reader.abort();
        }
        self.mailbox.clear();
    }
}

impl std::fmt::Debug for TcpTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpTransport")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

/// Buffers every frame from `peer` into `mailbox` until the connection ends; then the peer is
/// gone: it left when it said goodbye first, else it died.
async fn read_loop(mut read: OwnedReadHalf, peer: u32, mailbox: Arc<Mailbox>) {
    let mut said_goodbye = false;
    loop {
        let mut header = [0u8; 16];
        if let Err(e) = read.read_exact(&mut header).await {
            if said_goodbye {
                mailbox.peer_gone(
                    peer,
                    format!(
                        "rank {peer} left (its load ended, done or failed: its own error says why)"
                    ),
                );
            } else if e.kind() == std::io::ErrorKind::UnexpectedEof {
                mailbox.peer_died(
                    peer,
                    format!(
                        "rank {peer} closed its connection without a goodbye (its process was killed or crashed)"
                    ),
                );
            } else if e.kind() == std::io::ErrorKind::ConnectionReset {
                // A killed process's kernel resets, instead of closing, a connection that still
                // had bytes it never read (a peer's share or digest in flight): the same death.
                mailbox.peer_died(
                    peer,
                    format!(
                        "rank {peer} closed its connection without a goodbye (its process was killed or crashed): {e}"
                    ),
                );
            } else {
                mailbox.peer_died(peer, format!("the connection to rank {peer} failed: {e}"));
            }
            return;
        }
        let mut fields = &header[..];
        let (tag, len) = (fields.get_u64_le(), fields.get_u64_le());
        if len == GOODBYE {
            said_goodbye = true;
            continue;
        }
        if len > MAX_FRAME {
            mailbox.peer_gone(
                peer,
                format!("rank {peer} sent a {len}-byte frame (tag {tag:#x}), over the {MAX_FRAME}-byte cap: corrupt stream"),
            );
            return;
        }
        // Read into uninitialized capacity: zero-filling a buffer the socket then overwrites
        // cost a pass over every exchanged byte (issue 16).
        let mut data = Vec::with_capacity(len as usize);
        if let Err(e) = read_frame_body(&mut read, &mut data, len).await {
            mailbox.peer_gone(
                peer,
                format!("the connection to rank {peer} broke in the middle of a {len}-byte message (tag {tag:#x}): {e}"),
            );
            return;
        }
        mailbox.deliver(peer, tag, Bytes::from(data));
    }
}

/// Appends exactly `len` bytes from `read` to `data` (which has the capacity), without zeroing
/// them first; an end of stream before that is `UnexpectedEof`.
async fn read_frame_body<R: AsyncRead + Unpin>(
    read: &mut R,
    data: &mut Vec<u8>,
    len: u64,
) -> std::io::Result<()> {
    while (data.len() as u64) < len {
        let left = len - data.len() as u64;
        if (&mut *read).take(left).read_buf(data).await? == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!("the stream ended {left} bytes short"),
            ));
        }
    }
    Ok(())
}

/// A per-process value that tells this job's connections from stale ones (a previous job on the
/// same ports).
fn new_session(port: u16) -> u64 {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut z = nanos ^ (u64::from(std::process::id()) << 32) ^ u64::from(port);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

async fn read_magic<R: AsyncRead + Unpin>(r: &mut R, magic: &[u8; 4]) -> std::io::Result<bool> {
    let mut got = [0u8; 4];
    r.read_exact(&mut got).await?;
    Ok(&got == magic)
}

async fn read_addr<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Option<SocketAddr>> {
    let len = r.read_u16_le().await?;
    if len > MAX_ADDR_LEN {
        return Ok(None);
    }
    let mut text = vec![0u8; usize::from(len)];
    r.read_exact(&mut text).await?;
    Ok(std::str::from_utf8(&text).ok().and_then(|t| t.parse().ok()))
}

fn put_addr(out: &mut Vec<u8>, addr: &SocketAddr) {
    let text = addr.to_string();
    out.put_u16_le(text.len() as u16);
    out.put_slice(text.as_bytes());
}

/// What a rank said when checking in with the master.
struct Hello {
    rank: u32,
    world: u32,
    job: u64,
    addr: SocketAddr,
    /// Its plan's options ([`RendezvousConfig::plan`]).
    plan: Vec<(String, String)>,
    /// Where the connection came from, to name it in errors.
    peer: Option<SocketAddr>,
    stream: TcpStream,
}

/// What came in on the master's port.
enum Incoming {
    /// A tessera hello, to be checked against this job.
    Hello(Hello),
    /// Something that is not a hello this master can take (`what` it was). `stream` is kept
    /// when the peer speaks tessera's rendezvous, so that it can be told why it is refused.
    Foreign {
        peer: Option<SocketAddr>,
        what: String,
        stream: Option<TcpStream>,
    },
    /// A connection that closed or failed before sending a byte (a port probe): nothing to
    /// refuse, nothing to say.
    Silent,
}

/// Reads what a new connection on the master's port says.
async fn read_hello(mut stream: TcpStream) -> Incoming {
    let peer = stream.peer_addr().ok();
    let mut magic = [0u8; 4];
    let mut got = 0;
    while got < magic.len() {
        match stream.read(&mut magic[got..]).await {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    if got == 0 {
        return Incoming::Silent;
    }
    if &magic[..got] != HELLO {
        return Incoming::Foreign {
            peer,
            what: format!(
                "it sent \"{}\" where a tessera rendezvous hello starts with \"TSRH\" (another program on this port?)",
                magic[..got].escape_ascii()
            ),
            stream: None,
        };
    }
    let body = async {
        let version = stream.read_u32_le().await?;
        if version != VERSION {
            return Ok(Err(format!(
                "it speaks rendezvous version {version}, rank 0 version {VERSION} (ranks of different tessera versions?)"
            )));
        }
        let rank = stream.read_u32_le().await?;
        let world = stream.read_u32_le().await?;
        let job = stream.read_u64_le().await?;
        let Some(addr) = read_addr(&mut stream).await? else {
            return Ok(Err(
                "its hello has no listener address this master can read".to_string(),
            ));
        };
        let Some(plan) = read_terms(&mut stream).await? else {
            return Ok(Err(format!(
                "its hello has more than {MAX_PLAN_TERMS} plan options or one longer than {MAX_TERM_LEN} bytes"
            )));
        };
        Ok::<_, std::io::Error>(Ok((rank, world, job, addr, plan)))
    };
    match body.await {
        Ok(Ok((rank, world, job, addr, plan))) => Incoming::Hello(Hello {
            rank,
            world,
            job,
            addr,
            plan,
            peer,
            stream,
        }),
        Ok(Err(what)) => Incoming::Foreign {
            peer,
            what,
            stream: Some(stream),
        },
        Err(e) => Incoming::Foreign {
            peer,
            what: format!("its hello broke off: {e}"),
            stream: None,
        },
    }
}

/// A refusal of `kind` ([`TURNED_AWAY`], [`CALLED_OFF`]) saying `reason`.
fn refusal(kind: u8, reason: &str) -> Vec<u8> {
    let mut text = reason.as_bytes();
    if text.len() > usize::from(MAX_REASON_LEN) {
        text = &text[..usize::from(MAX_REASON_LEN)];
    }
    let mut message = Vec::with_capacity(11 + text.len());
    message.put_slice(REFUSE);
    message.put_u32_le(VERSION);
    message.put_u8(kind);
    message.put_u16_le(text.len() as u16);
    message.put_slice(text);
    message
}

/// Tells a peer that rank 0 turns it away, and why, then closes the connection. On its own
/// task, bounded: a peer that does not read its refusal must neither hold up the rendezvous nor
/// keep the task alive.
fn refuse(mut stream: TcpStream, reason: &str) {
    let message = refusal(TURNED_AWAY, reason);
    tokio::spawn(async move {
        let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, async {
            stream.write_all(&message).await?;
            stream.shutdown().await
        })
        .await;
    });
}

/// Hands `message` (a refusal of the whole job) to every rank that checked in, and closes their
/// connections. Every rank is told before rank 0 fails (its process may end right after), each
/// write bounded so that a rank that does not read cannot hold the others' news up.
async fn tell_all(checked_in: &mut [Option<Hello>], message: &[u8]) {
    futures::future::join_all(checked_in.iter_mut().flatten().map(|hello| async {
        let _ = tokio::time::timeout(REFUSAL_WRITE_TIMEOUT, async {
            hello.stream.write_all(message).await?;
            hello.stream.shutdown().await
        })
        .await;
    }))
    .await;
}

/// A refusal's kind and reason, after its magic; `None` when it is not one this rank can read.
async fn read_refusal<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Option<(u8, String)>> {
    if r.read_u32_le().await? != VERSION {
        return Ok(None);
    }
    let kind = r.read_u8().await?;
    let len = r.read_u16_le().await?;
    if len > MAX_REASON_LEN {
        return Ok(None);
    }
    let mut text = vec![0u8; usize::from(len)];
    r.read_exact(&mut text).await?;
    Ok(Some((kind, String::from_utf8_lossy(&text).into_owned())))
}

/// Appends `terms` to a hello; an error names what is over the caps (a front end's mistake,
/// found before the rank checks in).
fn put_terms(out: &mut Vec<u8>, terms: &[(String, String)]) -> Result<(), String> {
    if terms.len() > usize::from(MAX_PLAN_TERMS) {
        return Err(format!(
            "{} plan options, more than the {MAX_PLAN_TERMS} a hello carries",
            terms.len()
        ));
    }
    out.put_u16_le(terms.len() as u16);
    for (name, value) in terms {
        for text in [name, value] {
            if text.len() > usize::from(MAX_TERM_LEN) {
                return Err(format!(
                    "plan option {name} is longer than the {MAX_TERM_LEN} bytes a hello carries"
                ));
            }
            out.put_u16_le(text.len() as u16);
            out.put_slice(text.as_bytes());
        }
    }
    Ok(())
}

/// Reads the terms of a hello; `None` when they are over the caps.
async fn read_terms<R: AsyncRead + Unpin>(
    r: &mut R,
) -> std::io::Result<Option<Vec<(String, String)>>> {
    let count = r.read_u16_le().await?;
    if count > MAX_PLAN_TERMS {
        return Ok(None);
    }
    let mut terms = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let mut pair = [String::new(), String::new()];
        for text in &mut pair {
            let len = r.read_u16_le().await?;
            if len > MAX_TERM_LEN {
                return Ok(None);
            }
            let mut bytes = vec![0u8; usize::from(len)];
            r.read_exact(&mut bytes).await?;
            *text = String::from_utf8_lossy(&bytes).into_owned();
        }
        let [name, value] = pair;
        terms.push((name, value));
    }
    Ok(Some(terms))
}

/// The hellos rank 0 turned away while waiting for its job's ranks: each is said on stderr as
/// it happens (a misconfigured port is worth seeing before the deadline), and named again in
/// the error should the job's own ranks not all come.
#[derive(Default)]
struct Refused {
    /// The first [`MAX_REFUSALS_NAMED`], one line each.
    named: Vec<String>,
    count: usize,
}

/// Refusals named in warnings and errors: the first few say what is wrong; a flood of them
/// (a port scanner, a job restarted in a loop) must not flood stderr or the error.
const MAX_REFUSALS_NAMED: usize = 8;

impl Refused {
    fn note(&mut self, line: String) {
        self.count += 1;
        if self.named.len() < MAX_REFUSALS_NAMED {
            eprintln!("rank 0: {line}; still waiting for this job's ranks");
            self.named.push(line);
        } else if self.count == MAX_REFUSALS_NAMED + 1 {
            eprintln!(
                "rank 0: refusing more connections that are not this job's (not named); still waiting for this job's ranks"
            );
        }
    }

    /// `, 2 refused` for the progress line; empty when none was.
    fn progress_note(&self) -> String {
        match self.count {
            0 => String::new(),
            n => format!(", {n} refused"),
        }
    }

    /// What the error of a rendezvous that ran out of time adds: the refusals, which often
    /// explain the missing ranks (a rank started with another world size, job or port).
    fn in_error(&self, port: u16) -> String {
        if self.count == 0 {
            return String::new();
        }
        let more = self.count - self.named.len();
        format!(
            "; it refused {} that {} not this job's (a rank of another job, or one started with other settings, on port {port}?): {}{}",
            plural(self.count, "connection"),
            if self.count == 1 { "was" } else { "were" },
            self.named.join("; "),
            if more > 0 {
                format!("; and {more} more")
            } else {
                String::new()
            }
        )
    }
}

/// `1 connection`, `2 connections`.
fn plural(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}

/// How the plan options of the ranks in `checked_in` differ from rank 0's (`ours`), rank by rank.
fn disagreements(checked_in: &[Option<Hello>], ours: &[(String, String)]) -> Vec<String> {
    checked_in
        .iter()
        .flatten()
        .flat_map(|hello| plan_differences(hello.rank, &hello.plan, ours))
        .collect()
}

/// Whether the connection of a rank that checked in is still open: it says nothing after its
/// hello until the table comes, so readable means closed (end of stream) or reset.
fn still_open(stream: &TcpStream) -> bool {
    let mut probe = [0u8; 1];
    match stream.try_read(&mut probe) {
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        Ok(n) => n > 0,
    }
}

/// `127.0.0.1:4242`, or `an unknown address`.
fn from(peer: Option<SocketAddr>) -> String {
    peer.map_or_else(|| "an unknown address".to_string(), |p| p.to_string())
}

/// `rank 2` or `ranks 2,3`.
fn ranks_text(ranks: &[u32]) -> String {
    let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(",")),
    }
}

/// Ticks every [`TransportOptions::progress_every`]; never, without it.
struct Progress {
    interval: Option<tokio::time::Interval>,
    started: Instant,
    total: Duration,
}

impl Progress {
    fn new(options: &TransportOptions) -> Self {
        let interval = options.progress_every.map(|every| {
            let every = every.max(Duration::from_millis(100));
            let mut interval = tokio::time::interval_at(Instant::now() + every, every);
            interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            interval
        });
        Self {
            interval,
            started: Instant::now(),
            total: options.connect_timeout,
        }
    }

    async fn tick(&mut self) {
        match &mut self.interval {
            Some(interval) => {
                interval.tick().await;
            }
            None => std::future::pending().await,
        }
    }

    /// Runs `work`, saying every tick that `rank` is waiting for `what`.
    async fn saying<T>(&mut self, work: impl Future<Output = T>, rank: u32, what: String) -> T {
        tokio::pin!(work);
        loop {
            tokio::select! {
                done = &mut work => return done,
                () = self.tick() => self.say(rank, &what),
            }
        }
    }

    /// Prints `rank R: waiting for WHAT (E s of T s)` to stderr.
    fn say(&self, rank: u32, what: &str) {
        self.say_with(rank, what, "");
    }

    /// Prints `rank R: waiting for WHAT (NOTE, E s of T s)` to stderr.
    fn say_with(&self, rank: u32, what: &str, note: &str) {
        let note = if note.is_empty() {
            String::new()
        } else {
            format!("{note}, ")
        };
        eprintln!(
            "rank {rank}: waiting for {what} ({note}{} s of {} s)",
            self.started.elapsed().as_secs(),
            self.total.as_secs_f64().round()
        );
    }
}

fn missing(have: &[bool], below: u32) -> Vec<u32> {
    (0..below)
        .filter(|&r| !have.get(r as usize).copied().unwrap_or(false))
        .collect()
}

/// Rank 0: collects every rank's listener address and sends everyone the table.
async fn master(
    config: &RendezvousConfig,
    options: &TransportOptions,
    deadline: Instant,
) -> Result<(u64, Vec<SocketAddr>, TcpListener), LoaderError> {
    let world = config.world;
    let (master, own, own_addr) = master_listeners(config).await?;
    let mut ins = CheckIns::new(world);
    let mut pending = FuturesUnordered::new();
    let sleep = tokio::time::sleep_until(deadline);
    tokio::pin!(sleep);
    let mut progress = Progress::new(options);
    loop {
        if ins.count == world {
            ins.drop_closed();
            if ins.count == world {
                break;
            }
        }
        // Ranks in and ranks missing are this job's; its ranks' plan options are compared only
        // once all are in, when every one of them can be told.
        tokio::select! {
            () = progress.tick() => {
                // Where they should connect and how many are in: a rank started with another
                // address or port shows up here as the one never counted.
                progress.say_with(
                    0,
                    &format!(
                        "{} to join at {}:{}",
                        ranks_text(&missing(&ins.have, world)),
                        config.master_addr,
                        config.master_port
                    ),
                    &format!("{} of {world} in{}", ins.count, ins.refused.progress_note()),
                );
            }
            accepted = master.accept() => {
                // A failed accept (a connection reset before it was taken) only loses that one.
                if let Ok((stream, _)) = accepted {
                    let _ = stream.set_nodelay(true);
                    pending.push(read_hello(stream));
                }
            }
            Some(incoming) = pending.next(), if !pending.is_empty() => {
                ins.take(incoming, config);
            }
            () = &mut sleep => {
                let disagree = disagreements(&ins.checked_in, &config.plan);
                let detail = format!(
                    "rank 0: only {} of {world} ranks checked in within {:?}; missing ranks {:?}{}{}",
                    ins.count,
                    options.connect_timeout,
                    missing(&ins.have, world),
                    ins.refused.in_error(config.master_port),
                    if disagree.is_empty() {
                        String::new()
                    } else {
                        format!("; and ranks that are in plan with other options: {}", disagree.join("; "))
                    }
                );
                // The ranks that did check in learn which did not now, instead of waiting out
                // their own deadline for a table that will not come.
                tell_all(&mut ins.checked_in, &refusal(GAVE_UP, &detail)).await;
                return Err(rendezvous(detail));
            }
        }
    }

    let mut checked_in = ins.checked_in;
    let disagree = disagreements(&checked_in, &config.plan);
    if !disagree.is_empty() {
        let detail = disagree.join("; ");
        tell_all(&mut checked_in, &refusal(CALLED_OFF, &detail)).await;
        return Err(LoaderError::RanksDisagree { rank: 0, detail });
    }
    drop(pending);
    drop(master);

    let session = new_session(config.master_port);
    let mut table = vec![own_addr; world as usize];
    for hello in checked_in.iter().flatten() {
        table[hello.rank as usize] = hello.addr;
    }
    send_table(&mut checked_in, session, &table, deadline).await?;
    Ok((session, table, own))
}

/// Rank 0's listeners: the rendezvous address the other ranks check in at, and its own mesh
/// listener (with its address) on the same interface.
async fn master_listeners(
    config: &RendezvousConfig,
) -> Result<(TcpListener, TcpListener, SocketAddr), LoaderError> {
    let master = TcpListener::bind((config.master_addr.as_str(), config.master_port))
        .await
        .map_err(|e| {
            rendezvous(format!(
                "rank 0 could not listen on {}:{} (the rendezvous address: --master-addr and --master-port; from Python master_addr and master_port, or MASTER_ADDR with TESSERA_PORT or MASTER_PORT + 1): {e}",
                config.master_addr, config.master_port
            ))
        })?;
    let master_ip = master
        .local_addr()
        .map_err(|e| rendezvous(format!("rank 0: the master listener has no address: {e}")))?
        .ip();
    let own = TcpListener::bind((master_ip, 0))
        .await
        .map_err(|e| rendezvous(format!("rank 0 could not listen on {master_ip}: {e}")))?;
    let own_addr = own
        .local_addr()
        .map_err(|e| rendezvous(format!("rank 0: its listener has no address: {e}")))?;
    Ok((master, own, own_addr))
}

/// The ranks that have checked in with rank 0 (their hellos, by rank), and the connections
/// refused meanwhile.
struct CheckIns {
    world: u32,
    checked_in: Vec<Option<Hello>>,
    /// Ranks in (rank 0 from the start).
    have: Vec<bool>,
    count: u32,
    refused: Refused,
}

impl CheckIns {
    fn new(world: u32) -> Self {
        let mut have = vec![false; world as usize];
        have[0] = true;
        CheckIns {
            world,
            checked_in: (0..world).map(|_| None).collect(),
            have,
            count: 1,
            refused: Refused::default(),
        }
    }

    /// Once every rank is in: a hello whose connection closed since (a stray that said hello and
    /// left, a rank that died) would get a table it cannot use and fail the mesh, so its place
    /// is open again and the wait goes on. (A close still in flight is not seen here; the mesh
    /// then fails on that rank, naming it.)
    fn drop_closed(&mut self) {
        for slot in 1..self.world as usize {
            if let Some(gone) = self.checked_in[slot].take_if(|hello| !still_open(&hello.stream)) {
                self.refused.note(format!(
                    "dropped rank {slot} from {}: its connection closed after its hello",
                    from(gone.peer)
                ));
                self.have[slot] = false;
                self.count -= 1;
            }
        }
    }

    /// Takes in what a connection said. Whatever is wrong with one connection (another job's
    /// rank on this port, a misconfigured rank, a stranger) is that connection's trouble: it is
    /// refused and said, and the job's own ranks are still waited for until the deadline.
    fn take(&mut self, incoming: Incoming, config: &RendezvousConfig) {
        let hello = match incoming {
            Incoming::Hello(hello) => hello,
            Incoming::Silent => return,
            Incoming::Foreign { peer, what, stream } => {
                if let Some(stream) = stream {
                    refuse(stream, &what);
                }
                self.refused
                    .note(format!("refused a connection from {}: {what}", from(peer)));
                return;
            }
        };
        if let Some(why) = self.wrong(&hello, config) {
            self.refused.note(format!(
                "refused a hello from {} as rank {}: {why}",
                from(hello.peer),
                hello.rank
            ));
            refuse(hello.stream, &why);
            return;
        }
        let slot = hello.rank as usize;
        if !self.have[slot] {
            self.have[slot] = true;
            self.count += 1;
        }
        self.checked_in[slot] = Some(hello);
    }

    /// Why `hello` is not a rank of this job that can check in now, if it is not: another world
    /// size, rank or job, or a rank already in (whose place a new hello takes only when the
    /// first one's connection closed).
    fn wrong(&mut self, hello: &Hello, config: &RendezvousConfig) -> Option<String> {
        let world = self.world;
        let slot = hello.rank as usize;
        if hello.world != world {
            Some(format!(
                "it says the world has {} ranks but rank 0 has WORLD_SIZE={world}",
                hello.world
            ))
        } else if hello.rank == 0 {
            Some(
                "it checked in as rank 0, which is the master's own rank (two ranks 0?)"
                    .to_string(),
            )
        } else if hello.rank >= world {
            Some(format!(
                "it checked in as rank {} but the world has ranks 0..{world}",
                hello.rank
            ))
        } else if hello.job != config.job {
            Some(format!(
                "it loads job {:016x} but rank 0 loads job {:016x} (another checkpoint, layout or option, or another job on port {})",
                hello.job, config.job, config.master_port
            ))
        } else {
            match &self.checked_in[slot] {
                // The rank that checked in first left (a restarted rank comes back with a new
                // connection): the new one takes its place.
                Some(first) if !still_open(&first.stream) => {
                    self.refused.note(format!(
                        "dropped rank {slot} from {}: its connection closed after its hello",
                        from(first.peer)
                    ));
                    None
                }
                Some(first) => Some(format!(
                    "rank {} already checked in from {} (two processes with the same RANK?)",
                    hello.rank,
                    from(first.peer)
                )),
                None => None,
            }
        }
    }
}

/// Sends every rank that checked in the session and the address table, by `deadline`.
async fn send_table(
    checked_in: &mut [Option<Hello>],
    session: u64,
    table: &[SocketAddr],
    deadline: Instant,
) -> Result<(), LoaderError> {
    let mut message = Vec::new();
    message.put_slice(TABLE);
    message.put_u32_le(VERSION);
    message.put_u64_le(session);
    message.put_u32_le(table.len() as u32);
    for addr in table {
        put_addr(&mut message, addr);
    }
    for hello in checked_in.iter_mut().flatten() {
        let sent = tokio::time::timeout_at(deadline, hello.stream.write_all(&message)).await;
        if !matches!(sent, Ok(Ok(()))) {
            return Err(rendezvous(format!(
                "rank 0 could not send the address table to rank {} (it left during rendezvous?)",
                hello.rank
            )));
        }
    }
    Ok(())
}

/// Ranks other than 0: reach the master, report this rank's listener, receive the table.
async fn worker(
    config: &RendezvousConfig,
    options: &TransportOptions,
    deadline: Instant,
) -> Result<(u64, Vec<SocketAddr>, TcpListener), LoaderError> {
    let (rank, world) = (config.rank, config.world);
    let mut progress = Progress::new(options);
    let reach = connect_retrying(
        (config.master_addr.as_str(), config.master_port),
        deadline,
        |last| {
            rendezvous(format!(
                "rank {rank} could not reach the master {}:{} (the rendezvous address) within {:?}: {last}",
                config.master_addr, config.master_port, options.connect_timeout
            ))
        },
    );
    let what = format!(
        "rank 0 to listen on {}:{}",
        config.master_addr, config.master_port
    );
    let mut stream = progress.saying(reach, rank, what).await?;
    let local_ip = stream
        .local_addr()
        .map_err(|e| {
            rendezvous(format!(
                "rank {rank}: the master connection has no local address: {e}"
            ))
        })?
        .ip();
    let listener = TcpListener::bind((local_ip, 0))
        .await
        .map_err(|e| rendezvous(format!("rank {rank} could not listen on {local_ip}: {e}")))?;
    let own = listener
        .local_addr()
        .map_err(|e| rendezvous(format!("rank {rank}: its listener has no address: {e}")))?;

    let mut hello = Vec::new();
    hello.put_slice(HELLO);
    hello.put_u32_le(VERSION);
    hello.put_u32_le(rank);
    hello.put_u32_le(world);
    hello.put_u64_le(config.job);
    put_addr(&mut hello, &own);
    put_terms(&mut hello, &config.plan).map_err(|e| rendezvous(format!("rank {rank}: {e}")))?;
    /// What the master answered.
    enum Answer {
        Table(u64, Vec<SocketAddr>),
        Refused(u8, String),
        Foreign,
    }
    let talk = async {
        stream.write_all(&hello).await?;
        let mut magic = [0u8; 4];
        stream.read_exact(&mut magic).await?;
        if &magic == REFUSE {
            return Ok(read_refusal(&mut stream)
                .await?
                .map_or(Answer::Foreign, |(kind, why)| Answer::Refused(kind, why)));
        }
        if &magic != TABLE || stream.read_u32_le().await? != VERSION {
            return Ok(Answer::Foreign);
        }
        let session = stream.read_u64_le().await?;
        let table_world = stream.read_u32_le().await?;
        if table_world != world {
            return Ok(Answer::Foreign);
        }
        let mut table = Vec::with_capacity(world as usize);
        for _ in 0..world {
            let Some(addr) = read_addr(&mut stream).await? else {
                return Ok(Answer::Foreign);
            };
            table.push(addr);
        }
        Ok::<_, std::io::Error>(Answer::Table(session, table))
    };
    let talk = progress.saying(
        talk,
        rank,
        format!(
            "rank 0 at {}:{} to send the address table (all {world} ranks must join)",
            config.master_addr, config.master_port
        ),
    );
    // Rank 0 names the ranks that never came when its own deadline passes; a rank that started
    // a little before it waits that much longer to hear which, rather than time out blind.
    match tokio::time::timeout_at(deadline + VERDICT_GRACE, talk).await {
        Ok(Ok(Answer::Table(session, table))) => Ok((session, table, listener)),
        Ok(Ok(Answer::Refused(CALLED_OFF, detail))) => {
            Err(LoaderError::RanksDisagree { rank, detail })
        }
        Ok(Ok(Answer::Refused(GAVE_UP, why))) => Err(rendezvous(format!(
            "rank {rank}: the master gave up the rendezvous: {why}"
        ))),
        Ok(Ok(Answer::Refused(_, why))) => Err(rendezvous(format!(
            "rank {rank}: the master at {}:{} turned this rank away: {why}",
            config.master_addr, config.master_port
        ))),
        Ok(Ok(Answer::Foreign)) => Err(rendezvous(format!(
            "rank {rank}: the master at {}:{} answered with something that is not a tessera address table",
            config.master_addr, config.master_port
        ))),
        Ok(Err(e)) => Err(rendezvous(format!(
            "rank {rank}: the master closed the rendezvous before sending the address table ({e}); \
             it gave up (its own error says why)"
        ))),
        Err(_) => Err(rendezvous(format!(
            "rank {rank}: the master did not send the address table within {:?} (are all {world} ranks started?)",
            options.connect_timeout + VERDICT_GRACE
        ))),
    }
}

/// Connects to `addr`, retrying with backoff ([`connect_backoff`]; the other side may not be
/// listening yet) until `deadline`.
async fn connect_retrying<A: tokio::net::ToSocketAddrs + Clone>(
    addr: A,
    deadline: Instant,
    fail: impl Fn(&str) -> LoaderError,
) -> Result<TcpStream, LoaderError> {
    /// Why one connection attempt failed.
    enum Failure {
        /// Refused or unreachable: the peer may not be listening yet.
        Refused(String),
        /// The deadline passed during the attempt.
        Deadline,
    }
    let attempt = || async {
        match tokio::time::timeout_at(deadline, TcpStream::connect(addr.clone())).await {
            Ok(Ok(stream)) => Ok(stream),
            Ok(Err(e)) => Err(Failure::Refused(e.to_string())),
            Err(_) => Err(Failure::Deadline),
        }
    };
    let mut last = "no attempt made".to_string();
    let connected = attempt
        .retry(connect_backoff())
        .when(|failure| matches!(failure, Failure::Refused(_)))
        // The deadline, not a number of attempts, ends the retries: no wait that would end past it.
        .adjust(|_, wait| wait.filter(|wait| Instant::now() + *wait < deadline))
        .notify(|failure, _| {
            if let Failure::Refused(e) = failure {
                last.clone_from(e);
            }
        })
        .await;
    match connected {
        Ok(stream) => {
            let _ = stream.set_nodelay(true);
            Ok(stream)
        }
        Err(Failure::Refused(e)) => Err(fail(&e)),
        Err(Failure::Deadline) => Err(fail(&format!("last attempt: {last}"))),
    }
}

/// The backoff between connection attempts: tessera's [`RetryPolicy`] with a short first wait
/// (10 ms: a peer that is about to listen is reached at once) and a short cap (250 ms, at most
/// 500 ms with jitter: a rank that started late is found within half a second), and no limit on
/// the attempts, since peers start in any order and only the connect deadline says how long to
/// wait for them. The jitter keeps a thousand ranks waiting for the master from knocking at once.
fn connect_backoff() -> ExponentialBuilder {
    RetryPolicy {
        first_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(250),
        ..RetryPolicy::default()
    }
    .backoff()
    .without_max_times()
}

/// A peer's handshake, read on this rank's listener.
struct Shake {
    session: u64,
    from: u32,
    to: u32,
    world: u32,
    stream: TcpStream,
}

async fn read_shake(mut stream: TcpStream) -> std::io::Result<Option<Shake>> {
    if !read_magic(&mut stream, SHAKE).await? || stream.read_u32_le().await? != VERSION {
        return Ok(None);
    }
    let session = stream.read_u64_le().await?;
    let from = stream.read_u32_le().await?;
    let to = stream.read_u32_le().await?;
    let world = stream.read_u32_le().await?;
    Ok(Some(Shake {
        session,
        from,
        to,
        world,
        stream,
    }))
}

/// Connects to every higher rank and accepts every lower one.
async fn build_mesh(
    rank: u32,
    world: u32,
    session: u64,
    table: &[SocketAddr],
    listener: &TcpListener,
    options: &TransportOptions,
    deadline: Instant,
) -> Result<Vec<(u32, TcpStream)>, LoaderError> {
    let connects = futures::future::try_join_all((rank + 1..world).map(|peer| async move {
        let addr = table[peer as usize];
        let fail = |last: &str| {
            rendezvous(format!(
                "rank {rank} could not connect to rank {peer} at {addr} within {:?}: {last}",
                options.connect_timeout
            ))
        };
        let mut stream = connect_retrying(addr, deadline, fail).await?;
        let mut shake = Vec::with_capacity(28);
        shake.put_slice(SHAKE);
        shake.put_u32_le(VERSION);
        shake.put_u64_le(session);
        shake.put_u32_le(rank);
        shake.put_u32_le(peer);
        shake.put_u32_le(world);
        let talk = async {
            stream.write_all(&shake).await?;
            let ok = read_magic(&mut stream, ACK).await? && stream.read_u32_le().await? == peer;
            Ok::<_, std::io::Error>(ok)
        };
        match tokio::time::timeout_at(deadline, talk).await {
            Ok(Ok(true)) => Ok((peer, stream)),
            Ok(Ok(false)) => Err(fail("it answered the handshake with something else")),
            Ok(Err(e)) => Err(fail(&format!("handshake failed: {e}"))),
            Err(_) => Err(fail("no handshake answer")),
        }
    }));

    let accepts = async {
        let mut accepted: Vec<(u32, TcpStream)> = Vec::with_capacity(rank as usize);
        let mut have = vec![false; rank as usize];
        let mut pending = FuturesUnordered::new();
        let sleep = tokio::time::sleep_until(deadline);
        tokio::pin!(sleep);
        let mut progress = Progress::new(options);
        while accepted.len() < rank as usize {
            tokio::select! {
                () = progress.tick() => {
                    progress.say(rank, &format!("{} to connect", ranks_text(&missing(&have, rank))));
                }
                incoming = listener.accept() => {
                    if let Ok((stream, _)) = incoming {
                        let _ = stream.set_nodelay(true);
                        pending.push(read_shake(stream));
                    }
                }
                Some(shake) = pending.next(), if !pending.is_empty() => {
                    // Stale sessions and strangers are turned away by dropping the connection.
                    let Ok(Some(mut shake)) = shake else { continue };
                    if shake.session != session || shake.to != rank || shake.world != world || shake.from >= rank {
                        continue;
                    }
                    if have[shake.from as usize] {
                        return Err(rendezvous(format!("rank {rank}: rank {} connected twice", shake.from)));
                    }
                    let mut ack = Vec::with_capacity(8);
                    ack.put_slice(ACK);
                    ack.put_u32_le(rank);
                    if shake.stream.write_all(&ack).await.is_err() {
                        continue;
                    }
                    have[shake.from as usize] = true;
                    accepted.push((shake.from, shake.stream));
                }
                () = &mut sleep => {
                    return Err(rendezvous(format!(
                        "rank {rank}: ranks {:?} did not connect within {:?}",
                        missing(&have, rank),
                        options.connect_timeout
                    )));
                }
            }
        }
        Ok(accepted)
    };

    let (mut up, down) = futures::future::try_join(connects, accepts).await?;
    up.extend(down);
    Ok(up)
}
