//! One DCP tensor blob taken apart without reading its data: a `torch.save` zip (its `data.pkl`
//! says which storage member holds the tensor, with what dtype, storage offset, size and strides)
//! or, from torch 2.8 with `SerializationFormat.SAFETENSORS`, a safetensors file.

use serde::{Deserialize, Serialize};

use super::pickle::{self, Limits, Obj, Pickle, Value};
use super::zip::{self, Segments, ZipError};
use crate::DType;

/// Where a chunk's tensor lies inside its blob, and how it is laid out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorBlob {
    /// Element type of the storage.
    pub dtype: DType,
    /// Shape of the saved tensor.
    pub size: Vec<u64>,
    /// Element strides of the saved tensor (not normalized: a transposed view keeps `(1, n)`).
    pub stride: Vec<u64>,
    /// Offset of the tensor's first element in its storage, in elements.
    pub storage_offset: u64,
    /// Offset of the storage's first byte, relative to the blob start.
    pub data_offset: u64,
    /// Bytes of the storage.
    pub data_len: u64,
    /// CRC-32 (IEEE) of the storage bytes as the zip records it (`None` for safetensors blobs).
    pub data_crc32: Option<u32>,
}

impl TensorBlob {
    /// Checks that every element the size and strides address lies inside the storage, in
    /// checked arithmetic; returns the bytes from the first element to one past the last (0 for
    /// an empty tensor).
    pub fn span_bytes(&self) -> Result<u64, String> {
        if self.size.len() != self.stride.len() {
            return Err(format!(
                "size has {} dims but stride has {}",
                self.size.len(),
                self.stride.len()
            ));
        }
        let esize = self.dtype.size();
        if self.size.contains(&0) {
            return Ok(0);
        }
        let overflow = || "size and strides overflow".to_string();
        let last = self
            .size
            .iter()
            .zip(&self.stride)
            .try_fold(0u64, |acc, (n, s)| {
                acc.checked_add((n - 1).checked_mul(*s)?)
            })
            .ok_or_else(overflow)?;
        let span = last
            .checked_add(1)
            .and_then(|n| n.checked_mul(esize))
            .ok_or_else(overflow)?;
        let end = self
            .storage_offset
            .checked_mul(esize)
            .and_then(|o| o.checked_add(span))
            .ok_or_else(overflow)?;
        if end > self.data_len {
            return Err(format!(
                "size {:?} with strides {:?} from storage offset {} reaches byte {end} of a {}-byte storage",
                self.size, self.stride, self.storage_offset, self.data_len
            ));
        }
        Ok(span)
    }
}

/// Takes a tensor blob apart from the `seg`ments fetched so far ([`ZipError::Need`] asks for
/// more).
pub fn parse_tensor_blob(seg: &Segments) -> Result<TensorBlob, ZipError> {
    let magic = seg.get(0, 4.min(seg.len()), "the blob's first bytes")?;
    if magic == b"PK\x03\x04" {
        return parse_zip_blob(seg);
    }
    if seg.len() >= 9 && seg.get(8, 1, "the blob's first bytes")? == b"{" {
        return parse_safetensors_blob(seg);
    }
    Err(ZipError::Bad(format!(
        "starts with {magic:02x?}: neither a torch.save zip (PK\\x03\\x04) nor safetensors"
    )))
}

fn bad<T>(detail: impl Into<String>) -> Result<T, ZipError> {
    Err(ZipError::Bad(detail.into()))
}

/// The most bytes a `byteorder` member may have: torch writes `little` or `big`.
const MAX_BYTEORDER: u64 = 64;

/// Bytes after a member's data within which the next zip record's signature must begin: a data
/// descriptor without its optional signature (at most 20 bytes with zip64 sizes) comes first.
const RECORD_SLACK: u64 = 64;

/// Checks a tensor blob's bytes as they come out of a decoder, before anything is kept, so that a
/// compressed blob built to decode to far more than a blob can hold (a `data.pkl` of a GiB of
/// zeros in a few KiB) is stopped at the cap, not decoded to its end: the blob must start as a
/// torch.save zip (`PK\x03\x04`) or a safetensors file (a length, then `{`), and when its first
/// member is `data.pkl` (torch.save writes it first, and its local header carries no size: flag
/// bit 3) the next zip record must begin within [`Limits::BLOB`]'s input cap of its start. A
/// `data.pkl` that passes this (a forged record signature inside it) is still refused by its
/// size in the directory before any of it is kept.
#[derive(Debug, Default)]
pub struct StreamGuard {
    /// The first bytes, until the first local header is whole.
    head: Vec<u8>,
    /// Decoded bytes seen.
    seen: u64,
    state: GuardState,
}

#[derive(Debug, Default)]
enum GuardState {
    /// Reading the first bytes.
    #[default]
    Start,
    /// Looking for the record after `data.pkl`, whose data starts at `from`.
    Pickle {
        name: String,
        from: u64,
        /// The last (up to 3) bytes seen, for a signature cut between two stretches.
        carry: Vec<u8>,
    },
    /// Nothing more to check while streaming.
    Done,
}

/// A zip record signature: local header, central directory entry, data descriptor, or an end
/// record (classic or zip64).
fn is_record_signature(w: &[u8]) -> bool {
    w.len() >= 4
        && w[0] == b'P'
        && w[1] == b'K'
        && matches!(
            (w[2], w[3]),
            (1, 2) | (3, 4) | (5, 6) | (6, 6) | (6, 7) | (7, 8)
        )
}

impl StreamGuard {
    /// A guard for a blob's decoded stream, from its first byte.
    pub fn new() -> StreamGuard {
        StreamGuard::default()
    }

    /// Checks the next decoded `bytes` (in stream order); an error says why decoding should stop.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), String> {
        self.seen += bytes.len() as u64;
        if matches!(self.state, GuardState::Start) {
            self.head.extend_from_slice(bytes);
            let Some((name, from)) = self.first_member()? else {
                return Ok(());
            };
            let head = std::mem::take(&mut self.head);
            if !name.ends_with("data.pkl") {
                self.state = GuardState::Done;
                return Ok(());
            }
            self.state = GuardState::Pickle {
                name,
                from,
                carry: Vec::new(),
            };
            // What of the head lies past the pickle's start is scanned as if it came now.
            self.seen = from;
            return self.feed(&head[from as usize..]);
        }
        let GuardState::Pickle { name, from, carry } = &mut self.state else {
            return Ok(());
        };
        let mut edge = std::mem::take(carry);
        edge.extend_from_slice(&bytes[..bytes.len().min(3)]);
        if edge.windows(4).any(is_record_signature) || bytes.windows(4).any(is_record_signature) {
            self.state = GuardState::Done;
            return Ok(());
        }
        let cap = Limits::BLOB.max_input as u64;
        if self.seen > *from + cap + RECORD_SLACK {
            return Err(format!(
                "{name} runs on for more than {cap} bytes with no zip record after it: it \
                 exceeds the {cap}-byte cap on a tensor blob's pickle (decoding stopped after \
                 {} bytes)",
                self.seen
            ));
        }
        let last = if bytes.len() >= 3 { bytes } else { &edge[..] };
        *carry = last[last.len().saturating_sub(3)..].to_vec();
        Ok(())
    }

    /// The first local header's member name and data start once the head holds them whole;
    /// an error when the head is neither a zip nor safetensors.
    fn first_member(&mut self) -> Result<Option<(String, u64)>, String> {
        let head = &self.head;
        if head.len() < 4 {
            return Ok(None);
        }
        if &head[..4] != b"PK\x03\x04" {
            if head.len() < 9 {
                return Ok(None);
            }
            if head[8] == b'{' {
                self.state = GuardState::Done;
                self.head = Vec::new();
                return Ok(None);
            }
            return Err(format!(
                "starts with {:02x?}: neither a torch.save zip (PK\\x03\\x04) nor safetensors \
                 (decoding stopped there)",
                &head[..4]
            ));
        }
        if head.len() < 30 {
            return Ok(None);
        }
        let name_len = u16::from_le_bytes([head[26], head[27]]) as usize;
        let extra_len = u16::from_le_bytes([head[28], head[29]]) as usize;
        let from = 30 + name_len + extra_len;
        if head.len() < from {
            return Ok(None);
        }
        let name = String::from_utf8_lossy(&head[30..30 + name_len]).into_owned();
        Ok(Some((name, from as u64)))
    }
}

fn parse_zip_blob(seg: &Segments) -> Result<TensorBlob, ZipError> {
    let dir = zip::read_directory(seg)?;
    let Some(pkl) = dir.entries.iter().find(|e| e.name.ends_with("data.pkl")) else {
        return bad("no data.pkl member");
    };
    let prefix = &pkl.name[..pkl.name.len() - "data.pkl".len()];
    // Sizes are checked before a member is read: an encoded blob's members cost decoding, and
    // the directory may claim a GiB.
    let pkl_cap = Limits::BLOB.max_input as u64;
    if pkl.size > pkl_cap {
        return bad(format!(
            "{} of {} bytes exceeds the {pkl_cap}-byte cap on a tensor blob's pickle",
            pkl.name, pkl.size
        ));
    }
    if let Some(order) = dir.find(&format!("{prefix}byteorder")) {
        if order.size > MAX_BYTEORDER {
            return bad(format!(
                "{} has {} bytes; torch writes \"little\" or \"big\"",
                order.name, order.size
            ));
        }
        let order = zip::read_member(seg, &dir, order)?;
        if order != b"little" {
            return bad(format!(
                "byteorder is {:?}; only little-endian storages are read",
                String::from_utf8_lossy(order)
            ));
        }
    }
    let pkl_bytes = zip::read_member(seg, &dir, pkl)?;
    let pickle = pickle::unpickle(pkl_bytes, &Limits::BLOB)
        .map_err(|e| ZipError::Bad(format!("{}: {e}", pkl.name)))?;
    let rebuilt = rebuild(&pickle, pickle.root(), 0)
        .map_err(|e| ZipError::Bad(format!("{}: {e}", pkl.name)))?;
    let member = format!("{prefix}data/{}", rebuilt.key);
    let Some(entry) = dir.find(&member) else {
        return bad(format!(
            "data.pkl refers to storage {member}, which is not in the archive"
        ));
    };
    zip::check_stored(entry)?;
    let range = zip::data_range(seg, &dir, entry)?;
    let esize = rebuilt.dtype.size();
    let expected = rebuilt
        .storage_numel
        .checked_mul(if rebuilt.untyped { 1 } else { esize });
    if expected != Some(entry.size) {
        return bad(format!(
            "storage {member} holds {} bytes but data.pkl says {} {}",
            entry.size,
            rebuilt.storage_numel,
            if rebuilt.untyped {
                "bytes".to_string()
            } else {
                format!("elements of {}", rebuilt.dtype)
            }
        ));
    }
    let blob = TensorBlob {
        dtype: rebuilt.dtype,
        size: rebuilt.size,
        stride: rebuilt.stride,
        storage_offset: rebuilt.storage_offset,
        data_offset: range.start,
        data_len: entry.size,
        data_crc32: Some(entry.crc32),
    };
    blob.span_bytes().map_err(ZipError::Bad)?;
    Ok(blob)
}

fn parse_safetensors_blob(seg: &Segments) -> Result<TensorBlob, ZipError> {
    let first8 = seg.get(0, 8, "the safetensors header length")?;
    let n = crate::formats::safetensors::header_len(first8, "blob")
        .map_err(|e| ZipError::Bad(e.to_string()))?;
    let json = seg.get(8, n, "the safetensors header")?;
    let header = crate::formats::safetensors::parse_header(json, seg.len(), "blob")
        .map_err(|e| ZipError::Bad(e.to_string()))?;
    let [entry] = header.tensors.as_slice() else {
        return bad(format!(
            "a safetensors blob with {} tensors (one expected)",
            header.tensors.len()
        ));
    };
    let stride = crate::row_major_strides(&entry.shape);
    Ok(TensorBlob {
        dtype: entry.dtype,
        size: entry.shape.clone(),
        stride,
        storage_offset: 0,
        data_offset: header.data_start + entry.data_offsets.0,
        data_len: entry.data_offsets.1 - entry.data_offsets.0,
        data_crc32: None,
    })
}

/// A tensor inside a pickle (a `torch.save` of a dict, say), as `_rebuild_tensor_v2(...)` and
/// friends would have built it: other readers of torch.save files (DeepSpeed's `*.pt`) locate its
/// bytes through the storage record `data/<key>` of the same archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PickledTensor {
    /// Key of the storage record (`data/<key>` in the archive).
    pub key: String,
    /// Element type.
    pub dtype: DType,
    /// Bytes of the storage the record must hold.
    pub storage_bytes: u64,
    /// Offset of the tensor's first element in its storage, in elements.
    pub storage_offset: u64,
    /// Shape.
    pub size: Vec<u64>,
    /// Element strides.
    pub stride: Vec<u64>,
}

/// The tensor `value` of pickle `p` rebuilds (an error saying what it is instead).
pub fn pickled_tensor(p: &Pickle, value: &Value) -> Result<PickledTensor, String> {
    let rebuilt = rebuild(p, value, 0)?;
    let storage_bytes = if rebuilt.untyped {
        rebuilt.storage_numel
    } else {
        rebuilt
            .storage_numel
            .checked_mul(rebuilt.dtype.size())
            .ok_or("storage size overflows")?
    };
    Ok(PickledTensor {
        key: rebuilt.key,
        dtype: rebuilt.dtype,
        storage_bytes,
        storage_offset: rebuilt.storage_offset,
        size: rebuilt.size,
        stride: rebuilt.stride,
    })
}

/// What `_rebuild_tensor_v2(...)` and friends would have built.
struct Rebuilt {
    key: String,
    dtype: DType,
    untyped: bool,
    storage_numel: u64,
    storage_offset: u64,
    size: Vec<u64>,
    stride: Vec<u64>,
}

fn rebuild(p: &Pickle, value: &Value, depth: usize) -> Result<Rebuilt, String> {
    if depth > 8 {
        return Err("tensor rebuild calls nested too deeply".to_string());
    }
    let Some(instance) = p.instance(value) else {
        return Err(format!("holds a {}, not a tensor", p.describe(value)));
    };
    let Some((module, name)) = p.global(&instance.class) else {
        return Err("rebuilds the tensor with a non-global callable".to_string());
    };
    call(p, module, name, &instance.args, depth)
}

fn call(
    p: &Pickle,
    module: &str,
    name: &str,
    args: &[Value],
    depth: usize,
) -> Result<Rebuilt, String> {
    let arg = |i: usize| {
        args.get(i)
            .ok_or_else(|| format!("{name} has {} arguments, fewer than {}", args.len(), i + 1))
    };
    match name {
        "_rebuild_tensor_v2" | "_rebuild_tensor_v3" | "_rebuild_tensor" => {
            let storage = storage(p, arg(0)?)?;
            let storage_offset = int(p, arg(1)?, "storage offset")?;
            let size = ints(p, arg(2)?, "size")?;
            let stride = ints(p, arg(3)?, "stride")?;
            let dtype = if name == "_rebuild_tensor_v3" {
                let dtype = arg(6)?;
                match p.global(dtype) {
                    Some(("torch", dtype)) => DType::parse(dtype).map_err(|e| e.to_string())?,
                    _ => return Err(format!("dtype argument is a {}", p.describe(dtype))),
                }
            } else {
                storage
                    .dtype
                    .ok_or("an untyped storage needs _rebuild_tensor_v3's dtype")?
            };
            if let Some(typed) = storage.dtype
                && typed != dtype
            {
                return Err(format!("storage of {typed} rebuilt as {dtype}"));
            }
            Ok(Rebuilt {
                key: storage.key,
                dtype,
                untyped: storage.dtype.is_none(),
                storage_numel: storage.numel,
                storage_offset,
                size,
                stride,
            })
        }
        "_rebuild_parameter" | "_rebuild_parameter_with_state" => rebuild(p, arg(0)?, depth + 1),
        "_rebuild_from_type_v2" => {
            let func = arg(0)?;
            let Some((m, n)) = p.global(func) else {
                return Err(format!(
                    "_rebuild_from_type_v2 calls a {}",
                    p.describe(func)
                ));
            };
            let inner = p
                .sequence(arg(2)?)
                .ok_or("_rebuild_from_type_v2's arguments are not a tuple")?;
            call(p, m, n, inner, depth + 1)
        }
        _ => Err(format!(
            "rebuilds the tensor with {module}.{name}, which tessera cannot read in place"
        )),
    }
}

struct Storage {
    key: String,
    dtype: Option<DType>,
    numel: u64,
}

fn storage(p: &Pickle, value: &Value) -> Result<Storage, String> {
    let Some(Obj::PersistentId(id)) = p.obj(value) else {
        return Err(format!(
            "storage argument is a {}, not a persistent id",
            p.describe(value)
        ));
    };
    let Some(fields) = p.sequence(id) else {
        return Err(format!("persistent id is a {}", p.describe(id)));
    };
    let [Value::Str(kind), class, Value::Str(key), _location, numel] = fields else {
        return Err(format!(
            "persistent id has {} fields, not ('storage', type, key, location, numel)",
            fields.len()
        ));
    };
    if &**kind != "storage" {
        return Err(format!("persistent id of kind {kind:?}"));
    }
    let Some((_, class)) = p.global(class) else {
        return Err(format!("storage type is a {}", p.describe(class)));
    };
    let dtype = match class {
        "UntypedStorage" => None,
        "DoubleStorage" => Some(DType::F64),
        "FloatStorage" => Some(DType::F32),
        "HalfStorage" => Some(DType::F16),
        "BFloat16Storage" => Some(DType::Bf16),
        "LongStorage" => Some(DType::I64),
        "IntStorage" => Some(DType::I32),
        "ShortStorage" => Some(DType::I16),
        "CharStorage" => Some(DType::I8),
        "ByteStorage" => Some(DType::U8),
        "BoolStorage" => Some(DType::Bool),
        other => return Err(format!("storage type {other} is not supported")),
    };
    Ok(Storage {
        key: key.to_string(),
        dtype,
        numel: int(p, numel, "storage size")?,
    })
}

fn int(p: &Pickle, value: &Value, what: &str) -> Result<u64, String> {
    match value {
        Value::Int(i) if *i >= 0 => Ok(*i as u64),
        _ => Err(format!(
            "{what} is a {}, not a non-negative int",
            p.describe(value)
        )),
    }
}

fn ints(p: &Pickle, value: &Value, what: &str) -> Result<Vec<u64>, String> {
    let items = match p.sequence(value) {
        Some(items) => items,
        // `torch.Size((…))` in a REDUCE.
        None => match p.instance(value) {
            Some(instance) => match instance.args.first().and_then(|a| p.sequence(a)) {
                Some(items) => items,
                None => return Err(format!("{what} is a {}", p.describe(value))),
            },
            None => return Err(format!("{what} is a {}", p.describe(value))),
        },
    };
    items.iter().map(|v| int(p, v, what)).collect()
}

/// What a bare tensor-descriptor pickle says: `torch._utils._rebuild_tensor_v2(persistent_id(
/// ('storage', <T>Storage, key, location, numel)), storage_offset, size, stride, ...)`, the
/// `data.pkl` of a one-tensor `torch.save` without the zip around it. ByteCheckpoint records one
/// per saved chunk and writes the storage's raw bytes elsewhere.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorDescriptor {
    /// Element type.
    pub dtype: DType,
    /// Whether the storage is untyped (its numel counts bytes, not elements).
    pub untyped: bool,
    /// Size of the storage, in elements (bytes for an untyped storage).
    pub storage_numel: u64,
    /// Offset of the tensor's first element in its storage, in elements.
    pub storage_offset: u64,
    /// Shape of the tensor.
    pub size: Vec<u64>,
    /// Element strides of the tensor.
    pub stride: Vec<u64>,
}

impl TensorDescriptor {
    /// Bytes the storage holds.
    pub fn storage_bytes(&self) -> Option<u64> {
        self.storage_numel
            .checked_mul(if self.untyped { 1 } else { self.dtype.size() })
    }
}

/// Reads a bare tensor-descriptor pickle (see [`TensorDescriptor`]) with the VM capped by
/// `limits`; the error says what is wrong in words.
pub fn parse_tensor_descriptor(bytes: &[u8], limits: &Limits) -> Result<TensorDescriptor, String> {
    let pickle = pickle::unpickle(bytes, limits).map_err(|e| e.to_string())?;
    let rebuilt = rebuild(&pickle, pickle.root(), 0)?;
    Ok(TensorDescriptor {
        dtype: rebuilt.dtype,
        untyped: rebuilt.untyped,
        storage_numel: rebuilt.storage_numel,
        storage_offset: rebuilt.storage_offset,
        size: rebuilt.size,
        stride: rebuilt.stride,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A local header for `name` as torch.save writes it (flag bit 3, no sizes), `extra` bytes
    /// of extra field.
    fn local_header(name: &str, extra: usize) -> Vec<u8> {
        let mut h = b"PK\x03\x04".to_vec();
        h.extend_from_slice(&[20, 0, 0x08, 0x08]);
        h.extend_from_slice(&[0; 18]);
        h.extend_from_slice(&(name.len() as u16).to_le_bytes());
        h.extend_from_slice(&(extra as u16).to_le_bytes());
        h.extend_from_slice(name.as_bytes());
        h.extend(std::iter::repeat_n(b'Z', extra));
        h
    }

    fn feed_in(pieces: usize, stream: &[u8]) -> Result<(), String> {
        let mut guard = StreamGuard::new();
        stream
            .chunks(pieces)
            .try_for_each(|piece| guard.feed(piece))
    }

    #[test]
    fn a_torch_zip_head_passes_however_it_is_cut() {
        let mut stream = local_header("archive/data.pkl", 18);
        stream.extend_from_slice(b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\nq\x00.");
        stream.extend_from_slice(&local_header("archive/byteorder", 0));
        stream.extend_from_slice(b"little");
        for pieces in [1, 2, 3, 5, 64, stream.len()] {
            assert_eq!(feed_in(pieces, &stream), Ok(()), "pieces of {pieces}");
        }
        // Safetensors: a length, then the header's `{`.
        let mut st = 20u64.to_le_bytes().to_vec();
        st.extend_from_slice(b"{\"w\":{}}            ");
        assert_eq!(feed_in(1, &st), Ok(()));
    }

    #[test]
    fn a_pickle_past_the_cap_and_a_stream_of_no_zip_stop_the_decoding() {
        let cap = Limits::BLOB.max_input as u64;
        let mut guard = StreamGuard::new();
        guard
            .feed(&local_header("archive/data.pkl", 0))
            .expect("a header");
        let zeros = vec![0u8; 1 << 20];
        let mut fed = 0u64;
        let err = loop {
            match guard.feed(&zeros) {
                Ok(()) => fed += zeros.len() as u64,
                Err(err) => break err,
            }
            assert!(fed <= cap + (2 << 20), "still decoding after {fed} bytes");
        };
        assert!(err.contains("archive/data.pkl"), "{err}");
        assert!(err.contains(&format!("{cap}-byte cap")), "{err}");
        // A pickle whose record after it comes in time is not stopped.
        let mut guard = StreamGuard::new();
        guard
            .feed(&local_header("archive/data.pkl", 0))
            .expect("in time");
        for _ in 0..cap >> 20 {
            guard.feed(&zeros).expect("in time");
        }
        guard.feed(b"P").expect("in time");
        guard.feed(b"K\x03").expect("in time");
        guard.feed(b"\x04").expect("in time");
        guard.feed(&zeros).expect("in time");
        // Neither a zip nor safetensors: stopped at the first bytes.
        let err = feed_in(1, b"XXXXXXXXXXXX").expect_err("not a zip");
        assert!(err.contains("neither a torch.save zip"), "{err}");
    }
}
