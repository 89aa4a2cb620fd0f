//! DCP blobs saved compressed (`stream.zstd/1`) whose decoded bytes are built to exhaust memory
//! or time: a 1 GiB `data.pkl` of zeros that compresses to a few KiB, and a stream that is no zip
//! at all. Opening (what `inspect`, `verify` and `load` all do first) refuses them naming the file
//! and the cap, decoding no further than the cap, in bounded memory.
//!
//! Its own test binary: the memory check reads this process's peak RSS, which no other test may
//! share.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::io::Write;
use std::path::{Path, PathBuf};

use dcp_support::{MetadataStyle, TensorSpec, dcp_metadata, open};

/// The cap on a tensor blob's `data.pkl` (`Limits::BLOB.max_input`).
const CAP: u64 = 16 << 20;

/// A zstd writer into `out` that also tracks the decoded offset and the CRC-32 of the member
/// being written.
struct ZipStream<W: Write> {
    encoder: zstd::stream::write::Encoder<'static, W>,
    at: u64,
}

impl<W: Write> ZipStream<W> {
    fn new(out: W) -> Self {
        ZipStream {
            encoder: zstd::stream::write::Encoder::new(out, 1).unwrap(),
            at: 0,
        }
    }

    fn write(&mut self, bytes: &[u8]) {
        self.encoder.write_all(bytes).unwrap();
        self.at += bytes.len() as u64;
    }

    /// A local header as torch.save writes it: stored, flag bit 3, sizes only in the directory.
    fn local_header(&mut self, name: &str) -> u64 {
        let at = self.at;
        let mut h = Vec::new();
        h.extend_from_slice(&0x0403_4b50u32.to_le_bytes());
        h.extend_from_slice(&20u16.to_le_bytes());
        h.extend_from_slice(&0x0808u16.to_le_bytes());
        h.extend_from_slice(&[0; 2 + 2 + 2 + 4 + 4 + 4]);
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        self.write(&h);
        at
    }

    /// Ends the archive: a central directory of `members` (name, local header offset, size,
    /// crc32) and the end record; returns the compressed bytes.
    fn finish(mut self, members: &[(&str, u64, u64, u32)]) -> W {
        let cd_at = self.at;
        let mut central = Vec::new();
        for (name, offset, size, crc) in members {
            central.extend_from_slice(&0x0201_4b50u32.to_le_bytes());
            central.extend_from_slice(&[0x1e, 0x03, 20, 0]);
            central.extend_from_slice(&0x0808u16.to_le_bytes());
            central.extend_from_slice(&[0; 2 + 2 + 2]);
            central.extend_from_slice(&crc.to_le_bytes());
            central.extend_from_slice(&(*size as u32).to_le_bytes());
            central.extend_from_slice(&(*size as u32).to_le_bytes());
            central.extend_from_slice(&(name.len() as u16).to_le_bytes());
            central.extend_from_slice(&[0; 2 + 2 + 2 + 2 + 4]);
            central.extend_from_slice(&(*offset as u32).to_le_bytes());
            central.extend_from_slice(name.as_bytes());
        }
        self.write(&central.clone());
        let mut end = Vec::new();
        end.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
        end.extend_from_slice(&[0; 4]);
        end.extend_from_slice(&(members.len() as u16).to_le_bytes());
        end.extend_from_slice(&(members.len() as u16).to_le_bytes());
        end.extend_from_slice(&(central.len() as u32).to_le_bytes());
        end.extend_from_slice(&(cd_at as u32).to_le_bytes());
        end.extend_from_slice(&[0; 2]);
        self.write(&end);
        self.encoder.finish().unwrap()
    }
}

/// A torch.save-like zip whose `data.pkl` is `prefix` then zero bytes, `pkl_len` in all (one
/// float32 storage of 4 elements after it), compressed as one zstd stream, streamed (never held
/// whole).
fn pickle_bomb(prefix: &[u8], pkl_len: u64) -> Vec<u8> {
    let mut z = ZipStream::new(Vec::new());
    let pkl_at = z.local_header("archive/data.pkl");
    let zeros = vec![0u8; 1 << 20];
    let mut crc = crc32fast::Hasher::new();
    z.write(prefix);
    crc.update(prefix);
    let mut left = pkl_len - prefix.len() as u64;
    while left > 0 {
        let n = left.min(zeros.len() as u64) as usize;
        z.write(&zeros[..n]);
        crc.update(&zeros[..n]);
        left -= n as u64;
    }
    let pkl_crc = crc.finalize();
    let data_at = z.local_header("archive/data/0");
    let storage = [0u8; 16];
    z.write(&storage);
    z.finish(&[
        ("archive/data.pkl", pkl_at, pkl_len, pkl_crc),
        ("archive/data/0", data_at, 16, crc32fast::hash(&storage)),
    ])
}

/// `<tmp>/ckpt` holding `blob` as the one compressed chunk of tensor `w` (float32 [4]).
fn checkpoint(tmp: &Path, blob: &[u8]) -> PathBuf {
    let dir = tmp.join("ckpt");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("__0_0.distcp"), blob).unwrap();
    let tensors = [TensorSpec {
        fqn: "w",
        dtype: "float32",
        shape: vec![4],
        chunks: vec![(
            vec![0],
            vec![4],
            "__0_0.distcp",
            0,
            blob.len() as u64,
            vec!["stream.zstd/1"],
        )],
    }];
    std::fs::write(
        dir.join(".metadata"),
        dcp_metadata(MetadataStyle::TORCH_2_15, &tensors, &[]),
    )
    .unwrap();
    dir
}

/// This process's peak resident memory in bytes (Linux: `VmHWM`), `None` elsewhere.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib << 10)
}

/// Not valid zstd: decoding that reaches these bytes fails with "not a valid zstd stream", so a
/// refusal that names something else proves decoding stopped before them.
const GARBAGE: &[u8] = b"this is not a zstd frame, and decoding must never reach it";

#[test]
fn compressed_blobs_built_to_exhaust_memory_are_refused_at_the_cap() {
    let tmp = tempfile::tempdir().unwrap();

    // 1. A 1 GiB data.pkl of zeros in a few KiB: refused naming the file, the member and the cap,
    //    with peak memory far below the decoded size.
    let blob = pickle_bomb(b"", 1 << 30);
    assert!(blob.len() < 256 << 10, "{} compressed bytes", blob.len());
    let dir = checkpoint(&tmp.path().join("big"), &blob);
    let err = open(&dir).unwrap_err().to_string();
    assert!(err.contains("ckpt/__0_0.distcp"), "{err}");
    assert!(err.contains("tensor w chunk [0..4]"), "{err}");
    assert!(err.contains("data.pkl"), "{err}");
    assert!(err.contains(&format!("{CAP}-byte cap")), "{err}");
    if let Some(peak) = peak_rss() {
        assert!(
            peak < 256 << 20,
            "peak RSS {} MiB while refusing a 1 GiB data.pkl",
            peak >> 20
        );
    }

    // 2. The same with a zip record's signature forged at the start of data.pkl, so that the
    //    stream looks like a small pickle followed by a record: decoded to its end (nothing kept
    //    but the head and tail), then refused by the size the directory gives data.pkl, before
    //    any of it is collected.
    let blob = pickle_bomb(b"PK\x03\x04", 512 << 20);
    let dir = checkpoint(&tmp.path().join("forged"), &blob);
    let err = open(&dir).unwrap_err().to_string();
    assert!(err.contains("ckpt/__0_0.distcp"), "{err}");
    assert!(
        err.contains(&format!(
            "archive/data.pkl of {} bytes exceeds the {CAP}-byte cap",
            512 << 20
        )),
        "{err}"
    );
    if let Some(peak) = peak_rss() {
        assert!(
            peak < 256 << 20,
            "peak RSS {} MiB while refusing a 512 MiB data.pkl with a forged record",
            peak >> 20
        );
    }

    // 3. Decoding stops once data.pkl passes the cap: the stream breaks off after 20 MiB of it,
    //    and what is reported is the cap, not the broken stream.
    let mut blob = {
        let mut z = ZipStream::new(Vec::new());
        z.local_header("archive/data.pkl");
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..20 {
            z.write(&zeros);
        }
        z.encoder.finish().unwrap()
    };
    blob.extend_from_slice(GARBAGE);
    let dir = checkpoint(&tmp.path().join("cut"), &blob);
    let err = open(&dir).unwrap_err().to_string();
    assert!(err.contains("ckpt/__0_0.distcp"), "{err}");
    assert!(err.contains(&format!("{CAP}-byte cap")), "{err}");
    assert!(!err.contains("not a valid zstd stream"), "{err}");

    // 4. A stream that does not start as a zip (nor safetensors) stops at its first bytes.
    let mut blob = zstd::bulk::compress(&vec![b'X'; 1 << 20], 1).unwrap();
    blob.extend_from_slice(GARBAGE);
    let dir = checkpoint(&tmp.path().join("notzip"), &blob);
    let err = open(&dir).unwrap_err().to_string();
    assert!(err.contains("ckpt/__0_0.distcp"), "{err}");
    assert!(err.contains("neither a torch.save zip"), "{err}");
    assert!(!err.contains("not a valid zstd stream"), "{err}");
}
