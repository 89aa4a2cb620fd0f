//! Direct copies between ranks on one host: a receiver copies a share straight out of the
//! sender's buffers into its own destinations with one `process_vm_readv` (Linux cross-memory
//! attach, the single-copy path MPI libraries use between local processes), instead of the
//! sender gathering it into a message, the socket copying it twice and the receiver placing it.
//! One copy per exchanged byte, as many as reading it from the page cache costs.
//!
//! Safety of the bytes rests on a token: every exchange exposes a fresh random 128-bit value in
//! the sender's memory and announces (pid, address, value) in its hello. A receiver copies from a
//! peer only if it reads that value there before the copy (the process is the peer, not another
//! one under the same pid or on another host, and ptrace rules let it read) and again after it
//! (the sender had not ended or failed meanwhile: its [`Exposure`] zeroes the token before its
//! buffers can be released or reused). A sender keeps its buffers until every receiver
//! acknowledged its copy. Where the kernel refuses (another host, container, seccomp, Yama),
//! the hand-shake says so and that pair exchanges bytes over the transport as before.

#![allow(unsafe_code)]

use std::hash::BuildHasher;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::{Buf, BufMut};

const HELLO_MAGIC: &[u8; 4] = b"TSCH";
const SHARE_MAGIC: &[u8; 4] = b"TSCS";
const VERSION: u8 = 1;

/// Most iovecs one `process_vm_readv` takes on each side (Linux's `IOV_MAX`).
const IOV_MAX: usize = 1024;

/// Transport tag of the hand-shake's hello: a sender's [`Exposure::hello`] (or
/// [`declining_hello`]) to each rank it sends shares to. Exchange tags keep their top two bits
/// clear ([`crate::exchange::MAX_GROUPS`]), so these never meet a share's tag.
pub const HELLO_TAG: u64 = 0b11 << 62;
/// Transport tag of the answer to a hello: one byte, 1 when the receiver can read the sender's
/// memory (its token read back as announced) and will copy its shares, 0 for bytes.
pub const ANSWER_TAG: u64 = HELLO_TAG | 1;

/// Transport tag of the [`ShareDescriptor`] a sender sends instead of the bytes of the share
/// under exchange tag `tag`.
pub fn descriptor_tag(tag: u64) -> u64 {
    tag | 1 << 63
}

/// Transport tag of the receiver's acknowledgement (one byte, 1) that it copied the share under
/// exchange tag `tag`; the sender keeps its buffers until it arrives.
pub fn ack_tag(tag: u64) -> u64 {
    tag | 1 << 62
}

/// This rank's side of one exchange: the token peers check around every copy out of its memory.
/// Dropping it (the exchange ended, succeeded or not) zeroes the token first, so a peer still
/// copying sees the change and fails instead of keeping bytes from released buffers.
pub struct Exposure {
    token: &'static [AtomicU64; 2],
    value: [u64; 2],
}

/// Token slots of ended exchanges, for reuse. A slot is never freed: a peer that reads it late
/// reads zero or another exchange's token, never a byte of something else.
static FREE_SLOTS: std::sync::Mutex<Vec<&'static [AtomicU64; 2]>> =
    std::sync::Mutex::new(Vec::new());

impl Exposure {
    /// A fresh token (never zero: zero marks an ended exchange).
    pub fn new() -> Exposure {
        let seed = std::hash::RandomState::new();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let pid = std::process::id();
        let value = [
            seed.hash_one((pid, now, 0u8)).max(1),
            seed.hash_one((pid, now, 1u8)).max(1),
        ];
        let reused = FREE_SLOTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .pop();
        let token =
            reused.unwrap_or_else(|| Box::leak(Box::new([AtomicU64::new(0), AtomicU64::new(0)])));
        token[0].store(value[0], Ordering::SeqCst);
        token[1].store(value[1], Ordering::SeqCst);
        Exposure { token, value }
    }

    /// The hello this process sends its peers: this exposure's ([`Exposure::hello`]) when it
    /// offers direct copies (`enabled`: [`crate::load::LoadOptions::cross_memory`]), else
    /// [`declining_hello`]. A rank that does not offer says so, so ranks with different
    /// settings still agree on every pair.
    pub fn offer(&self, enabled: bool) -> Vec<u8> {
        if enabled {
            self.hello()
        } else {
            declining_hello()
        }
    }

    /// The hello announcing this exposure to peers (pid, token address, token value).
    pub fn hello(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(4 + 1 + 1 + 4 + 8 + 16);
        out.put_slice(HELLO_MAGIC);
        out.put_u8(VERSION);
        out.put_u8(1);
        out.put_u32_le(std::process::id());
        out.put_u64_le(self.token.as_ptr() as u64);
        out.put_u64_le(self.value[0]);
        out.put_u64_le(self.value[1]);
        out
    }
}

impl Default for Exposure {
    fn default() -> Self {
        Exposure::new()
    }
}

impl Drop for Exposure {
    fn drop(&mut self) {
        self.token[0].store(0, Ordering::SeqCst);
        self.token[1].store(0, Ordering::SeqCst);
        FREE_SLOTS
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .push(self.token);
    }
}

/// The hello of a rank that does not offer direct copies.
pub fn declining_hello() -> Vec<u8> {
    let mut out = Vec::with_capacity(6);
    out.put_slice(HELLO_MAGIC);
    out.put_u8(VERSION);
    out.put_u8(0);
    out
}

/// A peer's exposure, as its hello announced it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerMemory {
    pid: u32,
    token_addr: u64,
    token: [u64; 2],
}

impl PeerMemory {
    /// Decodes a hello: `Ok(None)` when the peer declines direct copies.
    pub fn from_hello(bytes: &[u8]) -> Result<Option<PeerMemory>, String> {
        let mut r = Reader::new(bytes, "hello");
        r.magic(HELLO_MAGIC)?;
        if r.u8()? == 0 {
            return r.end().map(|()| None);
        }
        let pid = r.u32()?;
        let token_addr = r.u64()?;
        let token = [r.u64()?, r.u64()?];
        r.end()?;
        Ok(Some(PeerMemory {
            pid,
            token_addr,
            token,
        }))
    }

    /// The peer's memory if this process copies from it: the peer offers (its hello), this
    /// process does too (`enabled`), and the peer's token reads back from here.
    pub fn accept(hello: &[u8], enabled: bool) -> Result<Option<PeerMemory>, String> {
        let memory = PeerMemory::from_hello(hello)?;
        Ok(memory.filter(|m| enabled && m.reachable()))
    }

    /// Whether this process can copy out of the peer's memory: its token reads back as
    /// announced. False on another host, in another pid namespace, or where the kernel refuses.
    pub fn reachable(&self) -> bool {
        self.check_token().is_ok()
    }

    fn check_token(&self) -> Result<(), String> {
        let mut seen = [0u64; 2];
        let local = [(seen.as_mut_ptr().cast::<u8>(), 16usize)];
        // SAFETY: `local` is the 16 bytes of `seen`, alive and exclusively ours for the call.
        unsafe { read_process(self.pid, &[(self.token_addr, 16)], &local)? };
        if seen != self.token {
            return Err(format!(
                "its exchange token at {:#x} in process {} no longer reads as announced: its exchange ended (finished or failed), or another process holds its pid",
                self.token_addr, self.pid
            ));
        }
        Ok(())
    }

    /// Copies the peer's `remote` spans (addresses and lengths in its memory, one stream) into
    /// `local` (one stream of the same total length), checking the token before and after.
    ///
    /// # Safety
    /// Every `local` span must be valid for writes of its length and not accessed otherwise
    /// during the call.
    pub unsafe fn copy(
        &self,
        remote: &[(u64, u64)],
        local: &[(*mut u8, usize)],
    ) -> Result<(), String> {
        let want: u64 = local.iter().map(|&(_, n)| n as u64).sum();
        let have: u64 = remote.iter().map(|&(_, n)| n).sum();
        if want != have {
            return Err(format!(
                "the share spans {have} bytes of its memory but {want} are expected"
            ));
        }
        self.check_token()?;
        // SAFETY: passed on from the caller.
        unsafe { read_process(self.pid, remote, local)? };
        self.check_token()
    }
}

impl PeerMemory {
    /// Copies the peer's `remote` spans into this rank's `buffers` at `local` spans
    /// (`(buffer, offset, length)`, one stream), each checked to lie inside its buffer.
    pub fn copy_into<B: AsMut<[u8]>>(
        &self,
        remote: &[(u64, u64)],
        buffers: &mut [B],
        local: &[(usize, u64, u64)],
    ) -> Result<(), String> {
        // One pointer per buffer, taken once: every span below is derived from it.
        let bases: Vec<(*mut u8, usize)> = buffers
            .iter_mut()
            .map(|b| {
                let b = b.as_mut();
                (b.as_mut_ptr(), b.len())
            })
            .collect();
        let mut spans = Vec::with_capacity(local.len());
        for &(buffer, offset, len) in local {
            let Some(&(base, size)) = bases.get(buffer) else {
                return Err(format!("destination {buffer} does not exist"));
            };
            if offset.checked_add(len).is_none_or(|end| end > size as u64) {
                return Err(format!(
                    "bytes {offset}..+{len} lie outside destination {buffer} of {size} bytes"
                ));
            }
            spans.push((base.wrapping_add(offset as usize), len as usize));
        }
        // SAFETY: every span lies inside a buffer this function holds exclusively (`&mut`),
        // checked above; nothing else touches them during the call.
        unsafe { self.copy(remote, &spans) }
    }
}

/// What a sender announces instead of sending a share's bytes: the pieces (plan-wide id and
/// bytes, in message order) and where their wire bytes lie in its memory, one stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareDescriptor {
    /// `(piece id, bytes)` in message order.
    pub pieces: Vec<(u32, u64)>,
    /// `(address, length)` in the sender's memory, in wire order.
    pub spans: Vec<(u64, u64)>,
}

impl ShareDescriptor {
    /// Encodes it for the transport.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + self.pieces.len() * 12 + self.spans.len() * 16);
        out.put_slice(SHARE_MAGIC);
        out.put_u8(VERSION);
        out.put_u64_le(self.pieces.len() as u64);
        for &(id, bytes) in &self.pieces {
            out.put_u32_le(id);
            out.put_u64_le(bytes);
        }
        out.put_u64_le(self.spans.len() as u64);
        for &(addr, len) in &self.spans {
            out.put_u64_le(addr);
            out.put_u64_le(len);
        }
        out
    }

    /// Decodes what [`ShareDescriptor::encode`] wrote.
    pub fn decode(bytes: &[u8]) -> Result<ShareDescriptor, String> {
        let mut r = Reader::new(bytes, "share descriptor");
        r.magic(SHARE_MAGIC)?;
        let n = r.len(12)?;
        let mut pieces = Vec::with_capacity(n);
        for _ in 0..n {
            pieces.push((r.u32()?, r.u64()?));
        }
        let n = r.len(16)?;
        let mut spans = Vec::with_capacity(n);
        for _ in 0..n {
            spans.push((r.u64()?, r.u64()?));
        }
        r.end()?;
        Ok(ShareDescriptor { pieces, spans })
    }
}

/// Appends `(addr, len)` to `spans`, merging it into the last span when adjacent.
pub fn push_span(spans: &mut Vec<(u64, u64)>, addr: u64, len: u64) {
    if len == 0 {
        return;
    }
    match spans.last_mut() {
        Some(last) if last.0 + last.1 == addr => last.1 += len,
        _ => spans.push((addr, len)),
    }
}

/// Little-endian reader of the hand-shake's messages (`bytes::Buf` over the untrusted bytes,
/// `try_get_*` only), with errors naming what it reads and where it ran out.
struct Reader<'a> {
    rest: &'a [u8],
    len: usize,
    what: &'static str,
}

impl<'a> Reader<'a> {
    fn new(bytes: &'a [u8], what: &'static str) -> Self {
        Reader {
            rest: bytes,
            len: bytes.len(),
            what,
        }
    }

    /// The error of a read of `n` more bytes than are left.
    fn short(&self, n: usize) -> String {
        format!(
            "a {}-byte {} ends early (byte {} of {})",
            self.len,
            self.what,
            self.len - self.rest.remaining() + n,
            self.len
        )
    }

    fn magic(&mut self, magic: &[u8; 4]) -> Result<(), String> {
        if self.rest.remaining() < 5 {
            return Err(self.short(5));
        }
        let got = &self.rest[..5];
        if &got[..4] != magic || got[4] != VERSION {
            return Err(format!(
                "not a version-{VERSION} {} (it starts {got:02x?})",
                self.what
            ));
        }
        self.rest.advance(5);
        Ok(())
    }

    fn u8(&mut self) -> Result<u8, String> {
        self.rest.try_get_u8().map_err(|_| self.short(1))
    }

    fn u32(&mut self) -> Result<u32, String> {
        self.rest.try_get_u32_le().map_err(|_| self.short(4))
    }

    fn u64(&mut self) -> Result<u64, String> {
        self.rest.try_get_u64_le().map_err(|_| self.short(8))
    }

    /// A count of entries of `entry` bytes each, checked against what is left.
    fn len(&mut self, entry: usize) -> Result<usize, String> {
        let n = self.u64()?;
        let left = self.rest.remaining() / entry;
        if n > left as u64 {
            return Err(format!(
                "a {} lists {n} entries but holds at most {left}",
                self.what
            ));
        }
        Ok(n as usize)
    }

    fn end(&self) -> Result<(), String> {
        if self.rest.has_remaining() {
            return Err(format!(
                "a {} has {} bytes after its end",
                self.what,
                self.rest.remaining()
            ));
        }
        Ok(())
    }
}

/// Copies the `remote` stream of process `pid` into the `local` stream, at most [`IOV_MAX`]
/// spans a side per call, resuming after partial copies.
///
/// # Safety
/// Every `local` span must be valid for writes of its length and not accessed otherwise during
/// the call.
#[cfg(target_os = "linux")]
unsafe fn read_process(
    pid: u32,
    remote: &[(u64, u64)],
    local: &[(*mut u8, usize)],
) -> Result<(), String> {
    let total: u64 = local.iter().map(|&(_, n)| n as u64).sum();
    let (mut li, mut lo, mut ri, mut ro) = (0usize, 0usize, 0usize, 0u64);
    let mut copied = 0u64;
    let mut lv: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX);
    let mut rv: Vec<libc::iovec> = Vec::with_capacity(IOV_MAX);
    while copied < total {
        lv.clear();
        rv.clear();
        let (mut i, mut o) = (li, lo);
        while lv.len() < IOV_MAX && i < local.len() {
            let (base, len) = local[i];
            if len > o {
                lv.push(libc::iovec {
                    // SAFETY: `o < len`: inside the caller's span.
                    iov_base: unsafe { base.add(o) }.cast(),
                    iov_len: len - o,
                });
            }
            i += 1;
            o = 0;
        }
        let (mut i, mut o) = (ri, ro);
        while rv.len() < IOV_MAX && i < remote.len() {
            let (addr, len) = remote[i];
            if len > o {
                rv.push(libc::iovec {
                    // The peer's address: never dereferenced here, only passed to the kernel.
                    iov_base: (addr + o) as usize as *mut libc::c_void,
                    iov_len: (len - o) as usize,
                });
            }
            i += 1;
            o = 0;
        }
        // SAFETY: `lv` points into the caller's writable spans; the kernel checks `rv` against
        // the peer's mappings and fails with EFAULT rather than touching anything else.
        let n = unsafe {
            libc::process_vm_readv(
                pid as libc::pid_t,
                lv.as_ptr(),
                lv.len() as libc::c_ulong,
                rv.as_ptr(),
                rv.len() as libc::c_ulong,
                0,
            )
        };
        if n < 0 {
            let err = std::io::Error::last_os_error();
            let why = match err.raw_os_error() {
                Some(libc::ESRCH) => "its process is gone".to_string(),
                Some(libc::EPERM) => {
                    "the kernel does not let this process read it (ptrace rules)".to_string()
                }
                Some(libc::EFAULT) => "its memory no longer holds the share".to_string(),
                Some(libc::ENOSYS) => "process_vm_readv is not available".to_string(),
                _ => err.to_string(),
            };
            return Err(format!(
                "copying out of process {pid} after {copied} of {total} bytes: {why}"
            ));
        }
        if n == 0 {
            return Err(format!(
                "copying out of process {pid}: nothing copied after {copied} of {total} bytes"
            ));
        }
        let mut n = n as u64;
        copied += n;
        // Advance both cursors by what was copied.
        let mut left = n;
        while left > 0 && li < local.len() {
            let room = (local[li].1 - lo) as u64;
            if left >= room {
                left -= room;
                li += 1;
                lo = 0;
            } else {
                lo += left as usize;
                left = 0;
            }
        }
        while n > 0 && ri < remote.len() {
            let room = remote[ri].1 - ro;
            if n >= room {
                n -= room;
                ri += 1;
                ro = 0;
            } else {
                ro += n;
                n = 0;
            }
        }
    }
    Ok(())
}

#[cfg(not(target_os = "linux"))]
unsafe fn read_process(
    _pid: u32,
    _remote: &[(u64, u64)],
    _local: &[(*mut u8, usize)],
) -> Result<(), String> {
    Err("direct copies between processes need Linux (process_vm_readv)".to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn peer(exposure: &Exposure) -> PeerMemory {
        PeerMemory::from_hello(&exposure.hello())
            .expect("hello decodes")
            .expect("offers")
    }

    fn spans_of(buffers: &[&[u8]]) -> Vec<(u64, u64)> {
        buffers
            .iter()
            .map(|b| (b.as_ptr() as u64, b.len() as u64))
            .collect()
    }

    #[test]
    fn copies_a_stream_of_spans_into_another_across_iov_max() {
        let exposure = Exposure::new();
        let peer = peer(&exposure);
        assert!(peer.reachable(), "this process reads its own token");
        // 3,000 remote spans of 7 bytes into 2 local spans: batches of IOV_MAX on each side.
        let source: Vec<u8> = (0..3000 * 8).map(|i| (i % 251) as u8).collect();
        let remote: Vec<(u64, u64)> = (0..3000)
            .map(|i| (source.as_ptr() as u64 + i * 8, 7))
            .collect();
        let mut a = vec![0u8; 10_000];
        let mut b = vec![0u8; 11_000];
        let local = [(a.as_mut_ptr(), a.len()), (b.as_mut_ptr(), b.len())];
        // SAFETY: `a` and `b` are ours and untouched during the call.
        unsafe { peer.copy(&remote, &local) }.expect("copy");
        let expected: Vec<u8> = source
            .chunks(8)
            .flat_map(|c| c[..7].iter().copied())
            .collect();
        assert_eq!([a, b].concat(), expected);
    }

    #[test]
    fn a_copy_after_the_exchange_ended_fails_and_names_why() {
        let source = vec![7u8; 64];
        let exposure = Exposure::new();
        let peer = peer(&exposure);
        drop(exposure);
        let mut out = vec![0u8; 64];
        let local = [(out.as_mut_ptr(), out.len())];
        // SAFETY: `out` is ours and untouched during the call.
        let err = unsafe { peer.copy(&spans_of(&[&source]), &local) }.unwrap_err();
        assert!(err.contains("exchange ended"), "{err}");
        // The slot is reused by the next exchange, whose token differs.
        let next = Exposure::new();
        assert!(!peer.reachable());
        drop(next);
        assert!(!peer.reachable());
    }

    #[test]
    fn another_token_at_the_address_is_not_the_peer() {
        let exposure = Exposure::new();
        let mut other = peer(&exposure);
        other.token[1] ^= 1;
        assert!(!other.reachable());
        let mut out = [0u8; 4];
        let local = [(out.as_mut_ptr(), 4)];
        // SAFETY: `out` is ours and untouched during the call.
        let err = unsafe { other.copy(&[(exposure.hello().as_ptr() as u64, 4)], &local) };
        assert!(err.unwrap_err().contains("no longer reads as announced"));
    }

    #[test]
    fn a_process_that_does_not_exist_is_not_reachable() {
        let exposure = Exposure::new();
        let mut gone = peer(&exposure);
        gone.pid = u32::MAX / 2;
        assert!(!gone.reachable());
    }

    #[test]
    fn mismatched_lengths_are_refused_before_copying() {
        let exposure = Exposure::new();
        let peer = peer(&exposure);
        let source = [1u8; 8];
        let mut out = [0u8; 4];
        let local = [(out.as_mut_ptr(), 4)];
        // SAFETY: `out` is ours and untouched during the call.
        let err = unsafe { peer.copy(&spans_of(&[&source]), &local) }.unwrap_err();
        assert!(
            err.contains("8 bytes") && err.contains("4 are expected"),
            "{err}"
        );
        assert_eq!(out, [0u8; 4]);
    }

    #[test]
    fn hellos_and_descriptors_round_trip_and_bad_ones_are_named() {
        assert_eq!(PeerMemory::from_hello(&declining_hello()), Ok(None));
        let descriptor = ShareDescriptor {
            pieces: vec![(3, 100), (9, 28)],
            spans: vec![(0x1000, 64), (0x2000, 64)],
        };
        assert_eq!(
            ShareDescriptor::decode(&descriptor.encode()).as_ref(),
            Ok(&descriptor)
        );
        let mut truncated = descriptor.encode();
        truncated.pop();
        let err = ShareDescriptor::decode(&truncated).unwrap_err();
        assert!(err.contains("share descriptor"), "{err}");
        let err = PeerMemory::from_hello(b"nope!").unwrap_err();
        assert!(err.contains("not a version-1 hello"), "{err}");
        let mut spans = Vec::new();
        push_span(&mut spans, 10, 5);
        push_span(&mut spans, 15, 5);
        push_span(&mut spans, 30, 0);
        push_span(&mut spans, 40, 1);
        assert_eq!(spans, vec![(10, 10), (40, 1)]);
    }
}
