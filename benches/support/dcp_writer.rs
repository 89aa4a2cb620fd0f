//! A test-only writer of PyTorch DCP checkpoints in torch 2.15's byte format
//! (`/work/shared/formats/dcp.md`): a `.metadata` pickle (protocol 4, dataclasses as
//! `NEWOBJ` + `BUILD`, `TensorProperties` as a 6-tuple state, `storage_data` keyed by
//! `MetadataIndex` objects) and `__<rank>_0.distcp` files holding one stored `torch.save` zip per
//! saved chunk (`archive/data.pkl` in protocol 2, member data 64-byte aligned relative to the blob
//! start, data descriptors, zip64 end records). Values come from
//! `tessera_synth::box_bytes`; files are streamed, so only one chunk is in memory at a
//! time per writing rank. Only for benchmarks and tests: it is not part of the library.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use tessera_metadata::{DType, TensorBox, TensorMeta};
use tessera_planner::WriteItem;
use tessera_synth as synth;

/// Where one chunk's blob was written.
#[derive(Clone, Debug)]
pub struct BlobExtent {
    /// `__<rank>_0.distcp`.
    pub file: String,
    /// First byte of the blob in the file.
    pub offset: u64,
    /// Bytes of the blob.
    pub length: u64,
}

/// What [`write_dcp`] wrote.
#[derive(Debug, Default)]
pub struct WrittenDcp {
    /// Every chunk's blob, by (fqn, chunk offsets).
    pub blobs: HashMap<(String, Vec<u64>), BlobExtent>,
    /// Data file names and sizes.
    pub files: Vec<(String, u64)>,
    /// Bytes of `.metadata`.
    pub metadata_bytes: u64,
}

/// One saved chunk, as recorded for `.metadata`.
struct Saved {
    tensor: u32,
    region: TensorBox,
    extent: BlobExtent,
}

/// Writes `tensors` saved as `writes` (per rank, from `assign_writers`) as a DCP checkpoint in
/// `dir` (created if needed). Ranks are written by concurrent threads.
pub fn write_dcp(
    dir: &Path,
    tensors: &[TensorMeta],
    writes: &[Vec<WriteItem>],
) -> std::io::Result<WrittenDcp> {
    std::fs::create_dir_all(dir)?;
    let per_rank: Vec<std::io::Result<(Vec<Saved>, u64)>> = std::thread::scope(|s| {
        let handles: Vec<_> = writes
            .iter()
            .enumerate()
            .map(|(rank, items)| s.spawn(move || write_rank(dir, rank, tensors, items)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("a writer thread panicked"))
            .collect()
    });
    let mut out = WrittenDcp::default();
    let mut saved: Vec<Saved> = Vec::new();
    for (rank, result) in per_rank.into_iter().enumerate() {
        let (chunks, size) = result?;
        out.files.push((format!("__{rank}_0.distcp"), size));
        saved.extend(chunks);
    }
    // Chunks by tensor (stable: rank order within a tensor).
    saved.sort_by_key(|s| s.tensor);
    let metadata = metadata_pickle(tensors, &saved, dir);
    let tmp = dir.join(".metadata.tmp");
    std::fs::write(&tmp, &metadata)?;
    std::fs::rename(&tmp, dir.join(".metadata"))?;
    out.metadata_bytes = metadata.len() as u64;
    for s in saved {
        out.blobs.insert(
            (
                tensors[s.tensor as usize].fqn.clone(),
                s.region.offsets.to_vec(),
            ),
            s.extent,
        );
    }
    Ok(out)
}

fn write_rank(
    dir: &Path,
    rank: usize,
    tensors: &[TensorMeta],
    items: &[WriteItem],
) -> std::io::Result<(Vec<Saved>, u64)> {
    let name = format!("__{rank}_0.distcp");
    let mut file = BufWriter::with_capacity(8 << 20, File::create(dir.join(&name))?);
    let mut at = 0u64;
    let mut saved = Vec::with_capacity(items.len());
    for item in items {
        let tensor = &tensors[item.tensor as usize];
        let data = synth::box_bytes(tensor, &item.region)
            .map_err(|e| std::io::Error::other(e.to_string()))?;
        let serialization_id = serialization_id(rank, &tensor.fqn, &item.region);
        let length = write_tensor_blob(
            &mut file,
            tensor.dtype,
            &item.region.lengths,
            &data,
            &serialization_id,
        )?;
        saved.push(Saved {
            tensor: item.tensor,
            region: item.region.clone(),
            extent: BlobExtent {
                file: name.clone(),
                offset: at,
                length,
            },
        });
        at += length;
    }
    file.flush()?;
    Ok((saved, at))
}

/// 40 decimal digits, as torch writes in `.data/serialization_id` (deterministic here).
fn serialization_id(rank: usize, fqn: &str, region: &TensorBox) -> String {
    let mut h = crc32fast::Hasher::new();
    h.update(fqn.as_bytes());
    h.update(region.to_string().as_bytes());
    let a = u64::from(h.finalize());
    format!("{:020}{:020}", a * 1_000_003 + rank as u64, a ^ 0x5eed)
}

// ---------------------------------------------------------------------------------------------
// Pickles.

/// A pickle being written: opcodes, with a memo for repeated globals and strings (as Python's
/// pickler shares them).
struct Pickler {
    out: Vec<u8>,
    memo: HashMap<String, u32>,
    next: u32,
    protocol4: bool,
}

impl Pickler {
    fn new(protocol: u8) -> Pickler {
        Pickler {
            out: vec![0x80, protocol],
            memo: HashMap::new(),
            next: 0,
            protocol4: protocol >= 4,
        }
    }

    fn op(&mut self, op: u8) {
        self.out.push(op);
    }

    /// Memoizes the top of the stack; returns its memo index.
    fn memoize(&mut self) -> u32 {
        let id = self.next;
        self.next += 1;
        if self.protocol4 {
            self.op(0x94); // MEMOIZE
        } else if id < 256 {
            self.out.extend([b'q', id as u8]); // BINPUT
        } else {
            self.op(b'r'); // LONG_BINPUT
            self.out.extend(id.to_le_bytes());
        }
        id
    }

    fn get(&mut self, id: u32) {
        if id < 256 {
            self.out.extend([b'h', id as u8]); // BINGET
        } else {
            self.op(b'j'); // LONG_BINGET
            self.out.extend(id.to_le_bytes());
        }
    }

    fn raw_str(&mut self, s: &str) {
        if self.protocol4 && s.len() < 256 {
            self.out.extend([0x8c, s.len() as u8]); // SHORT_BINUNICODE
        } else {
            self.op(b'X'); // BINUNICODE
            self.out.extend((s.len() as u32).to_le_bytes());
        }
        self.out.extend(s.as_bytes());
    }

    /// A string, shared through the memo after its first occurrence.
    fn str(&mut self, s: &str) {
        let key = format!("s:{s}");
        if let Some(&id) = self.memo.get(&key) {
            self.get(id);
        } else {
            self.raw_str(s);
            let id = self.memoize();
            self.memo.insert(key, id);
        }
    }

    /// A string that is not memoized (values seen once).
    fn str_once(&mut self, s: &str) {
        self.raw_str(s);
        self.memoize();
    }

    fn int(&mut self, v: u64) {
        if v < 256 {
            self.out.extend([b'K', v as u8]); // BININT1
        } else if v < 65536 {
            self.op(b'M'); // BININT2
            self.out.extend((v as u16).to_le_bytes());
        } else if v < (1 << 31) {
            self.op(b'J'); // BININT
            self.out.extend((v as i32).to_le_bytes());
        } else {
            // LONG1: little-endian two's complement, with a sign byte when the top bit is set.
            let mut bytes = v.to_le_bytes().to_vec();
            while bytes.len() > 1 && bytes[bytes.len() - 1] == 0 && bytes[bytes.len() - 2] < 0x80 {
                bytes.pop();
            }
            self.op(0x8a);
            self.out.push(bytes.len() as u8);
            self.out.extend(bytes);
        }
    }

    fn none(&mut self) {
        self.op(b'N');
    }

    fn bool(&mut self, v: bool) {
        self.op(if v { 0x88 } else { 0x89 });
    }

    fn mark(&mut self) {
        self.op(b'(');
    }

    /// A tuple of the items pushed since `mark` (`n` of them).
    fn tuple_of(&mut self, n: usize, marked: bool) {
        match (n, marked) {
            (_, true) => self.op(b't'),
            (0, false) => self.op(b')'),
            (1, false) => self.op(0x85),
            (2, false) => self.op(0x86),
            (3, false) => self.op(0x87),
            _ => unreachable!("longer tuples are marked"),
        }
    }

    fn int_tuple(&mut self, values: &[u64]) {
        let marked = values.len() > 3;
        if marked {
            self.mark();
        }
        for &v in values {
            self.int(v);
        }
        self.tuple_of(values.len(), marked);
        if self.protocol4 || !values.is_empty() {
            self.memoize();
        }
    }

    /// `module.name`, through the memo after its first use.
    fn global(&mut self, module: &str, name: &str) {
        let key = format!("g:{module}\n{name}");
        if let Some(&id) = self.memo.get(&key) {
            self.get(id);
            return;
        }
        if self.protocol4 {
            self.str(module);
            self.str(name);
            self.op(0x93); // STACK_GLOBAL
        } else {
            self.op(b'c'); // GLOBAL
            self.out.extend(format!("{module}\n{name}\n").as_bytes());
        }
        let id = self.memoize();
        self.memo.insert(key, id);
    }

    /// `cls.__new__(cls)` of a dataclass, memoized (its `BUILD` follows).
    fn new_object(&mut self, module: &str, name: &str) {
        self.global(module, name);
        self.op(b')'); // EMPTY_TUPLE
        self.op(0x81); // NEWOBJ
        self.memoize();
    }

    /// `torch.Size(values)`.
    fn torch_size(&mut self, values: &[u64]) {
        self.global("torch", "Size");
        self.int_tuple(values);
        self.tuple_of(1, false);
        self.memoize();
        self.op(b'R'); // REDUCE
        self.memoize();
    }

    fn empty_dict(&mut self) {
        self.op(b'}');
        self.memoize();
    }

    fn empty_list(&mut self) {
        self.op(b']');
        self.memoize();
    }

    fn setitems(&mut self) {
        self.op(b'u');
    }

    fn build(&mut self) {
        self.op(b'b');
    }

    fn finish(mut self) -> Vec<u8> {
        self.op(b'.');
        self.out
    }
}

const METADATA_MODULE: &str = "torch.distributed.checkpoint.metadata";

fn torch_dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::Bf16 => "bfloat16",
        DType::F16 => "float16",
        DType::F64 => "float64",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::I16 => "int16",
        DType::I8 => "int8",
        DType::U8 => "uint8",
        DType::Bool => "bool",
        other => panic!("the test DCP writer does not write {other}"),
    }
}

fn storage_class(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "FloatStorage",
        DType::Bf16 => "BFloat16Storage",
        DType::F16 => "HalfStorage",
        DType::F64 => "DoubleStorage",
        DType::I64 => "LongStorage",
        DType::I32 => "IntStorage",
        DType::I16 => "ShortStorage",
        DType::I8 => "CharStorage",
        DType::U8 => "ByteStorage",
        DType::Bool => "BoolStorage",
        other => panic!("the test DCP writer does not write {other}"),
    }
}

/// `planner_data`'s path of a flattened key: dot-separated parts, list indices as ints.
fn planner_path(p: &mut Pickler, fqn: &str) {
    let parts: Vec<&str> = fqn.split('.').collect();
    let marked = parts.len() > 3;
    if marked {
        p.mark();
    }
    for part in &parts {
        match part.parse::<u64>() {
            Ok(i) => p.int(i),
            Err(_) => p.str(part),
        }
    }
    p.tuple_of(parts.len(), marked);
    p.memoize();
}

/// The `.metadata` pickle: `Metadata(state_dict_metadata, planner_data, storage_data,
/// storage_meta, version)`, built as torch 2.15's pickler builds it.
fn metadata_pickle(tensors: &[TensorMeta], saved: &[Saved], dir: &Path) -> Vec<u8> {
    let mut p = Pickler::new(4);
    p.new_object(METADATA_MODULE, "Metadata");
    p.empty_dict();
    p.mark();

    p.str("state_dict_metadata");
    p.empty_dict();
    p.mark();
    let mut s = 0usize;
    for (t, tensor) in tensors.iter().enumerate() {
        let first = s;
        while s < saved.len() && saved[s].tensor as usize == t {
            s += 1;
        }
        p.str(&tensor.fqn);
        p.new_object(METADATA_MODULE, "TensorStorageMetadata");
        p.empty_dict();
        p.mark();
        p.str("properties");
        p.new_object(METADATA_MODULE, "TensorProperties");
        // BUILD state: (dtype, layout, requires_grad, memory_format, pin_memory, strides).
        p.mark();
        p.global("torch", torch_dtype_name(tensor.dtype));
        let layout_key = "v:layout".to_string();
        if let Some(&id) = p.memo.get(&layout_key) {
            p.get(id);
        } else {
            p.global("torch.serialization", "_get_layout");
            p.str("torch.strided");
            p.tuple_of(1, false);
            p.memoize();
            p.op(b'R');
            let id = p.memoize();
            p.memo.insert(layout_key, id);
        }
        p.bool(false);
        let format_key = "v:memformat".to_string();
        if let Some(&id) = p.memo.get(&format_key) {
            p.get(id);
        } else {
            p.global(METADATA_MODULE, "_MEM_FORMAT_ENCODING");
            p.int(0);
            p.tuple_of(1, false);
            p.memoize();
            p.op(b'R');
            let id = p.memoize();
            p.memo.insert(format_key, id);
        }
        p.bool(false);
        // The writing rank's local strides: row-major over the first chunk.
        let local = saved[first..s]
            .first()
            .map_or_else(|| tensor.shape.clone(), |c| c.region.lengths.to_vec());
        p.int_tuple(&tessera_metadata::row_major_strides(&local));
        p.tuple_of(6, true);
        p.memoize();
        p.build();
        p.str("size");
        p.torch_size(&tensor.shape);
        p.str("chunks");
        p.empty_list();
        p.mark();
        for chunk in &saved[first..s] {
            p.new_object(METADATA_MODULE, "ChunkStorageMetadata");
            p.empty_dict();
            p.mark();
            p.str("offsets");
            p.torch_size(&chunk.region.offsets);
            p.str("sizes");
            p.torch_size(&chunk.region.lengths);
            p.setitems();
            p.build();
        }
        p.op(b'e'); // APPENDS
        p.setitems();
        p.build();
    }
    p.setitems();

    p.str("planner_data");
    p.empty_dict();
    p.mark();
    for tensor in tensors {
        p.str(&tensor.fqn);
        planner_path(&mut p, &tensor.fqn);
    }
    p.setitems();

    p.str("storage_data");
    p.empty_dict();
    p.mark();
    for chunk in saved {
        p.new_object(METADATA_MODULE, "MetadataIndex");
        p.empty_dict();
        p.mark();
        p.str("fqn");
        p.str(&tensors[chunk.tensor as usize].fqn);
        p.str("offset");
        p.torch_size(&chunk.region.offsets);
        p.str("index");
        p.int(0);
        p.setitems();
        p.build();
        p.new_object("torch.distributed.checkpoint.filesystem", "_StorageInfo");
        p.empty_dict();
        p.mark();
        p.str("relative_path");
        p.str(&chunk.extent.file);
        p.str("offset");
        p.int(chunk.extent.offset);
        p.str("length");
        p.int(chunk.extent.length);
        p.setitems();
        p.build();
    }
    p.setitems();

    p.str("storage_meta");
    p.new_object(METADATA_MODULE, "StorageMeta");
    p.empty_dict();
    p.mark();
    p.str("checkpoint_id");
    p.global("pathlib", "PosixPath");
    let parts: Vec<String> = std::iter::once("/".to_string())
        .chain(dir.components().filter_map(|c| match c {
            std::path::Component::Normal(s) => Some(s.to_string_lossy().into_owned()),
            _ => None,
        }))
        .collect();
    p.mark();
    for part in &parts {
        p.str_once(part);
    }
    p.tuple_of(parts.len(), true);
    p.memoize();
    p.op(b'R');
    p.memoize();
    p.str("save_id");
    p.str_once("00000000-0000-4000-8000-000000000000");
    p.str("load_id");
    p.none();
    p.str("modules");
    p.empty_list();
    p.setitems();
    p.build();

    p.str("version");
    p.str("1.0.0");
    p.setitems();
    p.build();
    p.finish()
}

/// `archive/data.pkl` of a chunk: `torch._utils._rebuild_tensor_v2(persistent_id(('storage',
/// torch.<X>Storage, '0', 'cpu', numel)), 0, size, stride, False, OrderedDict())`, protocol 2.
fn data_pkl(dtype: DType, size: &[u64]) -> Vec<u8> {
    let mut p = Pickler::new(2);
    p.global("torch._utils", "_rebuild_tensor_v2");
    p.mark();
    p.mark();
    p.str("storage");
    p.global("torch", storage_class(dtype));
    p.str("0");
    p.str("cpu");
    p.int(size.iter().product());
    p.op(b't');
    p.memoize();
    p.op(b'Q'); // BINPERSID
    p.int(0);
    p.int_tuple(size);
    p.int_tuple(&tessera_metadata::row_major_strides(size));
    p.bool(false);
    p.global("collections", "OrderedDict");
    p.op(b')');
    p.op(b'R');
    p.memoize();
    p.op(b't');
    p.memoize();
    p.op(b'R');
    p.memoize();
    p.finish()
}

// ---------------------------------------------------------------------------------------------
// The torch.save zip.

const ALIGN: u64 = 64;

struct Member {
    name: String,
    crc: u32,
    size: u64,
    header_offset: u64,
}

/// Writes one member (local header with the "FB" padding field so that its data starts 64-byte
/// aligned relative to the blob start, data, data descriptor); returns its directory entry.
fn write_member(
    out: &mut impl Write,
    at: &mut u64,
    name: &str,
    data: &[u8],
) -> std::io::Result<Member> {
    assert!(
        (data.len() as u64) < 0xffff_ffff,
        "the test DCP writer writes no zip64 members"
    );
    let header_offset = *at;
    let unpadded = header_offset + 30 + name.len() as u64 + 4;
    let pad = (ALIGN - unpadded % ALIGN) % ALIGN;
    let crc = crc32fast::hash(data);
    let mut header = Vec::with_capacity(30 + name.len() + 4 + pad as usize);
    header.extend(0x0403_4b50u32.to_le_bytes());
    header.extend(20u16.to_le_bytes()); // version needed
    header.extend(0x0808u16.to_le_bytes()); // data descriptor + UTF-8
    header.extend(0u16.to_le_bytes()); // stored
    header.extend(0u16.to_le_bytes()); // time
    header.extend(0x21u16.to_le_bytes()); // date (1980-01-01)
    header.extend([0u8; 12]); // crc and sizes: in the descriptor
    header.extend((name.len() as u16).to_le_bytes());
    header.extend(((4 + pad) as u16).to_le_bytes());
    header.extend(name.as_bytes());
    header.extend(0x4246u16.to_le_bytes()); // "FB"
    header.extend((pad as u16).to_le_bytes());
    header.resize(header.len() + pad as usize, b'Z');
    out.write_all(&header)?;
    out.write_all(data)?;
    let mut descriptor = Vec::with_capacity(16);
    descriptor.extend(0x0807_4b50u32.to_le_bytes());
    descriptor.extend(crc.to_le_bytes());
    descriptor.extend((data.len() as u32).to_le_bytes());
    descriptor.extend((data.len() as u32).to_le_bytes());
    out.write_all(&descriptor)?;
    *at += header.len() as u64 + data.len() as u64 + 16;
    Ok(Member {
        name: name.to_string(),
        crc,
        size: data.len() as u64,
        header_offset,
    })
}

/// Writes one chunk as a `torch.save` zip; returns its length.
fn write_tensor_blob(
    out: &mut impl Write,
    dtype: DType,
    size: &[u64],
    data: &[u8],
    serialization_id: &str,
) -> std::io::Result<u64> {
    let mut at = 0u64;
    let pkl = data_pkl(dtype, size);
    let members = [
        ("archive/data.pkl", &pkl[..]),
        ("archive/.format_version", &b"1"[..]),
        ("archive/.storage_alignment", &b"64"[..]),
        ("archive/byteorder", &b"little"[..]),
        ("archive/data/0", data),
        ("archive/version", &b"3\n"[..]),
        (
            "archive/.data/serialization_id",
            serialization_id.as_bytes(),
        ),
    ];
    let mut written = Vec::with_capacity(members.len());
    for (name, bytes) in members {
        written.push(write_member(out, &mut at, name, bytes)?);
    }
    // Central directory.
    let cd_start = at;
    let mut cd = Vec::new();
    for m in &written {
        cd.extend(0x0201_4b50u32.to_le_bytes());
        cd.extend(0x031eu16.to_le_bytes()); // made by: unix, 3.0
        cd.extend(20u16.to_le_bytes());
        cd.extend(0x0808u16.to_le_bytes());
        cd.extend(0u16.to_le_bytes());
        cd.extend(0u16.to_le_bytes());
        cd.extend(0x21u16.to_le_bytes());
        cd.extend(m.crc.to_le_bytes());
        cd.extend((m.size as u32).to_le_bytes());
        cd.extend((m.size as u32).to_le_bytes());
        cd.extend((m.name.len() as u16).to_le_bytes());
        cd.extend(0u16.to_le_bytes()); // extra
        cd.extend(0u16.to_le_bytes()); // comment
        cd.extend(0u16.to_le_bytes()); // disk
        cd.extend(0u16.to_le_bytes()); // internal attributes
        cd.extend(0u32.to_le_bytes()); // external attributes
        cd.extend((m.header_offset as u32).to_le_bytes());
        cd.extend(m.name.as_bytes());
    }
    let cd_len = cd.len() as u64;
    at += cd_len;
    // zip64 end record, its locator, the classic end record.
    let zip64_at = at;
    let entries = written.len() as u64;
    cd.extend(0x0606_4b50u32.to_le_bytes());
    cd.extend(44u64.to_le_bytes());
    cd.extend(0x031eu16.to_le_bytes());
    cd.extend(45u16.to_le_bytes());
    cd.extend(0u32.to_le_bytes());
    cd.extend(0u32.to_le_bytes());
    cd.extend(entries.to_le_bytes());
    cd.extend(entries.to_le_bytes());
    cd.extend(cd_len.to_le_bytes());
    cd.extend(cd_start.to_le_bytes());
    cd.extend(0x0706_4b50u32.to_le_bytes());
    cd.extend(0u32.to_le_bytes());
    cd.extend(zip64_at.to_le_bytes());
    cd.extend(1u32.to_le_bytes());
    cd.extend(0x0605_4b50u32.to_le_bytes());
    cd.extend(0u16.to_le_bytes());
    cd.extend(0u16.to_le_bytes());
    cd.extend((entries as u16).to_le_bytes());
    cd.extend((entries as u16).to_le_bytes());
    cd.extend((cd_len.min(0xffff_ffff) as u32).to_le_bytes());
    cd.extend((cd_start.min(0xffff_ffff) as u32).to_le_bytes());
    cd.extend(0u16.to_le_bytes());
    out.write_all(&cd)?;
    at += 56 + 20 + 22;
    Ok(at)
}
