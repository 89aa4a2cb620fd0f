//! The ZIP archives `torch.save` writes, read from their directory inward: end of central
//! directory (classic and zip64), central directory, local headers. Only those bytes are needed to
//! locate a member's data, so a blob is read through [`Segments`]: the parts of it fetched so far.
//! When a structure lies outside them the reader answers [`ZipError::Need`] with the byte range to
//! fetch, and the caller tries again with it; an in-memory archive is one segment.
//!
//! ```text
//! blob byte 0                                                              blob length
//! ┌──────────┬──────────┬─────┬──────────┬────────────────┬─────┬────────────┬─────┬──────┬─────┐
//! │ local hdr│ data.pkl │ ... │ local hdr│ data/0 (raw,   │ ... │ central    │zip64│zip64 │ EOCD│
//! │ 30+n+e   │          │     │ + "FB"   │ 64-B aligned)  │     │ directory  │ EOCD│locatr│ 22 B│
//! └──────────┴──────────┴─────┴──────────┴────────────────┴─────┴────────────┴─────┴──────┴─────┘
//!  every entry STORED; flag bit 3 (data descriptor) set, so the local header's crc and sizes are
//!  0: sizes and crc32 come from the central directory
//! ```
//!
//! Input is untrusted: every offset and size is checked against the blob's length with checked
//! arithmetic, and nothing panics.

use std::ops::Range;

use bytes::Bytes;

const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const LOCAL_SIG: u32 = 0x0403_4b50;
const EOCD_LEN: u64 = 22;
const ZIP64_LOCATOR_LEN: u64 = 20;
const ZIP64_EOCD_LEN: u64 = 56;
const CENTRAL_LEN: u64 = 46;
const LOCAL_LEN: u64 = 30;
/// Longest archive comment, hence how far before the end the end record can be.
const MAX_COMMENT: u64 = 65535;

/// Why an archive cannot be read (yet).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ZipError {
    /// These bytes of the blob are needed and not among the segments: fetch them and retry.
    Need(Range<u64>),
    /// The archive is damaged or not what torch.save writes.
    Bad(String),
}

impl std::fmt::Display for ZipError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ZipError::Need(range) => write!(f, "needs bytes {}..{}", range.start, range.end),
            ZipError::Bad(detail) => f.write_str(detail),
        }
    }
}

fn bad<T>(detail: impl Into<String>) -> Result<T, ZipError> {
    Err(ZipError::Bad(detail.into()))
}

/// The parts of one blob fetched so far.
#[derive(Clone, Debug, Default)]
pub struct Segments {
    len: u64,
    parts: Vec<(u64, Bytes)>,
}

impl Segments {
    /// No bytes yet of a blob of `len` bytes.
    pub fn new(len: u64) -> Segments {
        Segments {
            len,
            parts: Vec::new(),
        }
    }

    /// A blob held whole in memory.
    pub fn whole(bytes: Bytes) -> Segments {
        Segments {
            len: bytes.len() as u64,
            parts: vec![(0, bytes)],
        }
    }

    /// Length of the blob.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True for a 0-byte blob.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Adds the bytes at `start` (clipped to the blob).
    pub fn add(&mut self, start: u64, bytes: Bytes) {
        if start >= self.len {
            return;
        }
        let keep = (self.len - start).min(bytes.len() as u64) as usize;
        self.parts.push((start, bytes.slice(..keep)));
    }

    /// Bytes fetched so far (for statistics).
    pub fn bytes_held(&self) -> u64 {
        self.parts.iter().map(|(_, b)| b.len() as u64).sum()
    }

    /// Bytes `start..start+len`: from one segment, [`ZipError::Need`] when no segment holds them
    /// all, [`ZipError::Bad`] when they lie past the blob's end.
    pub fn get(&self, start: u64, len: u64, what: &str) -> Result<&[u8], ZipError> {
        let Some(end) = start.checked_add(len).filter(|&e| e <= self.len) else {
            return bad(format!(
                "{what} at bytes {start}..{} lies past the end of the {}-byte blob",
                start.saturating_add(len),
                self.len
            ));
        };
        if len == 0 {
            return Ok(&[]);
        }
        for (at, bytes) in &self.parts {
            if *at <= start && end <= at + bytes.len() as u64 {
                let from = (start - at) as usize;
                return Ok(&bytes[from..from + len as usize]);
            }
        }
        Err(ZipError::Need(start..end))
    }
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut le = [0u8; 8];
    le.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(le)
}

/// One central directory entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Member name, e.g. `archive/data/0`.
    pub name: String,
    /// Compression method (0 = stored).
    pub method: u16,
    /// General-purpose flags.
    pub flags: u16,
    /// CRC-32 (IEEE) of the uncompressed data.
    pub crc32: u32,
    /// Compressed size.
    pub compressed_size: u64,
    /// Uncompressed size.
    pub size: u64,
    /// Offset of the member's local header in the blob.
    pub local_header_offset: u64,
}

/// The central directory of an archive.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Directory {
    /// Entries in directory order.
    pub entries: Vec<Entry>,
    /// Where the central directory starts: member data must end before it.
    pub start: u64,
}

impl Directory {
    /// The entry named `name`.
    pub fn find(&self, name: &str) -> Option<&Entry> {
        self.entries.iter().find(|e| e.name == name)
    }

    /// The `data.pkl` of a `torch.save` archive: the one in its top folder (torch names it
    /// `<archive>/data.pkl`), with the folder prefix its other members share.
    pub fn torch_data_pkl(&self) -> Option<(&Entry, &str)> {
        let pkl = self
            .entries
            .iter()
            .filter(|e| e.name.ends_with("/data.pkl") || e.name == "data.pkl")
            .min_by_key(|e| e.name.len())?;
        Some((pkl, &pkl.name[..pkl.name.len() - "data.pkl".len()]))
    }
}

/// Reads the end records and the central directory.
pub fn read_directory(seg: &Segments) -> Result<Directory, ZipError> {
    let len = seg.len();
    if len < EOCD_LEN {
        return bad(format!(
            "{len} bytes are too few for a zip archive (the end record alone is 22)"
        ));
    }
    let eocd_at = find_end_record(seg)?;
    let eocd = seg.get(eocd_at, EOCD_LEN, "the end of central directory record")?;
    let classic_entries = u64::from(u16_at(eocd, 10));
    let classic_size = u64::from(u32_at(eocd, 12));
    let classic_offset = u64::from(u32_at(eocd, 16));
    let has_locator = eocd_at >= ZIP64_LOCATOR_LEN
        && u32_at(
            seg.get(eocd_at - ZIP64_LOCATOR_LEN, 4, "the zip64 locator")?,
            0,
        ) == ZIP64_LOCATOR_SIG;
    let (entries, size, offset, records_start) = if has_locator {
        let locator = seg.get(
            eocd_at - ZIP64_LOCATOR_LEN,
            ZIP64_LOCATOR_LEN,
            "the zip64 locator",
        )?;
        let record_at = u64_at(locator, 8);
        if record_at
            .checked_add(ZIP64_EOCD_LEN)
            .is_none_or(|e| e > eocd_at - ZIP64_LOCATOR_LEN)
        {
            return bad(format!(
                "the zip64 end record offset {record_at} does not lie before its locator"
            ));
        }
        let record = seg.get(record_at, ZIP64_EOCD_LEN, "the zip64 end record")?;
        if u32_at(record, 0) != ZIP64_EOCD_SIG {
            return bad(format!("no zip64 end record signature at byte {record_at}"));
        }
        (
            u64_at(record, 32),
            u64_at(record, 40),
            u64_at(record, 48),
            record_at,
        )
    } else {
        if classic_entries == 0xffff || classic_size == 0xffff_ffff || classic_offset == 0xffff_ffff
        {
            return bad("zip64 sizes without a zip64 locator");
        }
        (classic_entries, classic_size, classic_offset, eocd_at)
    };
    if offset.checked_add(size).is_none_or(|e| e > records_start) {
        return bad(format!(
            "the central directory at bytes {offset}..{} overlaps the end records at {records_start}",
            offset.saturating_add(size)
        ));
    }
    if entries > size / CENTRAL_LEN {
        return bad(format!(
            "{entries} entries cannot fit a {size}-byte central directory"
        ));
    }
    let cd = seg.get(offset, size, "the central directory")?;
    let mut parsed = Vec::with_capacity(entries as usize);
    let mut at = 0usize;
    for k in 0..entries {
        let Some(fixed) = cd.get(at..at + CENTRAL_LEN as usize) else {
            return bad(format!("central directory entry {k} is truncated"));
        };
        if u32_at(fixed, 0) != CENTRAL_SIG {
            return bad(format!(
                "central directory entry {k} has no signature (byte {})",
                offset + at as u64
            ));
        }
        let flags = u16_at(fixed, 8);
        let method = u16_at(fixed, 10);
        let crc32 = u32_at(fixed, 16);
        let mut compressed_size = u64::from(u32_at(fixed, 20));
        let mut size = u64::from(u32_at(fixed, 24));
        let name_len = u16_at(fixed, 28) as usize;
        let extra_len = u16_at(fixed, 30) as usize;
        let comment_len = u16_at(fixed, 32) as usize;
        let mut local_header_offset = u64::from(u32_at(fixed, 42));
        let name_at = at + CENTRAL_LEN as usize;
        let extra_at = name_at + name_len;
        let next = extra_at + extra_len + comment_len;
        let (Some(name), Some(extra)) = (
            cd.get(name_at..extra_at),
            cd.get(extra_at..extra_at + extra_len),
        ) else {
            return bad(format!("central directory entry {k} is truncated"));
        };
        if next > cd.len() {
            return bad(format!("central directory entry {k} is truncated"));
        }
        let Ok(name) = std::str::from_utf8(name) else {
            return bad(format!(
                "central directory entry {k} has a name that is not UTF-8"
            ));
        };
        // zip64 extended information: the 64-bit values of exactly the fields that are all ones.
        let mut fields = Vec::new();
        if size == 0xffff_ffff {
            fields.push(&mut size);
        }
        if compressed_size == 0xffff_ffff {
            fields.push(&mut compressed_size);
        }
        if local_header_offset == 0xffff_ffff {
            fields.push(&mut local_header_offset);
        }
        if !fields.is_empty() {
            let Some(zip64) = find_extra(extra, 0x0001) else {
                return bad(format!(
                    "entry {name} needs a zip64 extra field and has none"
                ));
            };
            if zip64.len() < 8 * fields.len() {
                return bad(format!("entry {name}: zip64 extra field is too short"));
            }
            for (i, field) in fields.into_iter().enumerate() {
                *field = u64_at(zip64, 8 * i);
            }
        }
        parsed.push(Entry {
            name: name.to_string(),
            method,
            flags,
            crc32,
            compressed_size,
            size,
            local_header_offset,
        });
        at = next;
    }
    Ok(Directory {
        entries: parsed,
        start: offset,
    })
}

/// The data of extra field `id` in an extra block.
fn find_extra(mut extra: &[u8], id: u16) -> Option<&[u8]> {
    while extra.len() >= 4 {
        let field = u16_at(extra, 0);
        let len = u16_at(extra, 2) as usize;
        let data = extra.get(4..4 + len)?;
        if field == id {
            return Some(data);
        }
        extra = &extra[4 + len..];
    }
    None
}

/// Offset of the end of central directory record: where its signature is and its comment length
/// reaches exactly to the end of the blob.
fn find_end_record(seg: &Segments) -> Result<u64, ZipError> {
    let len = seg.len();
    // torch.save writes no comment, so the record is the last 22 bytes.
    let last = seg.get(
        len - EOCD_LEN,
        EOCD_LEN,
        "the end of central directory record",
    )?;
    if u32_at(last, 0) == EOCD_SIG && u16_at(last, 20) == 0 {
        return Ok(len - EOCD_LEN);
    }
    let from = len.saturating_sub(EOCD_LEN + MAX_COMMENT);
    let window = seg.get(from, len - from, "the end of the archive")?;
    let mut at = window.len() - EOCD_LEN as usize;
    loop {
        if u32_at(window, at) == EOCD_SIG
            && at + EOCD_LEN as usize + u16_at(window, at + 20) as usize == window.len()
        {
            return Ok(from + at as u64);
        }
        if at == 0 {
            return bad("no end of central directory record (not a zip archive, or truncated)");
        }
        at -= 1;
    }
}

/// Where the data of `entry` lies in the blob, from its local header (whose extra field, with
/// torch's alignment padding, can differ from the central directory's). Checks that the local
/// header names the same member and that the data ends before the central directory.
pub fn data_range(seg: &Segments, dir: &Directory, entry: &Entry) -> Result<Range<u64>, ZipError> {
    let at = entry.local_header_offset;
    let header = seg.get(at, LOCAL_LEN, "a local header")?;
    if u32_at(header, 0) != LOCAL_SIG {
        return bad(format!(
            "member {}: no local header signature at byte {at}",
            entry.name
        ));
    }
    let name_len = u64::from(u16_at(header, 26));
    let extra_len = u64::from(u16_at(header, 28));
    let name = seg.get(at + LOCAL_LEN, name_len, "a local header's name")?;
    if name != entry.name.as_bytes() {
        return bad(format!(
            "member {}: the local header at byte {at} names {:?}",
            entry.name,
            String::from_utf8_lossy(name)
        ));
    }
    let start = at + LOCAL_LEN + name_len + extra_len;
    let Some(end) = start
        .checked_add(entry.compressed_size)
        .filter(|&e| e <= dir.start)
    else {
        return bad(format!(
            "member {}: its {} bytes at byte {start} run into the central directory at {}",
            entry.name, entry.compressed_size, dir.start
        ));
    };
    Ok(start..end)
}

/// The bytes of a stored (uncompressed) member.
pub fn read_member<'a>(
    seg: &'a Segments,
    dir: &Directory,
    entry: &Entry,
) -> Result<&'a [u8], ZipError> {
    check_stored(entry)?;
    let range = data_range(seg, dir, entry)?;
    seg.get(range.start, range.end - range.start, &entry.name)
}

/// Refuses compressed members: tessera reads member bytes in place.
pub fn check_stored(entry: &Entry) -> Result<(), ZipError> {
    if entry.method != 0 || entry.compressed_size != entry.size {
        return bad(format!(
            "member {} is compressed (method {}); torch.save stores members uncompressed",
            entry.name, entry.method
        ));
    }
    Ok(())
}

/// A whole archive in memory, every member's bytes checked against its CRC-32: what
/// [`read_directory`] and [`read_member`] do, for fuzzing and for small blobs.
pub fn read_archive(bytes: &[u8]) -> Result<Vec<(String, Vec<u8>)>, ZipError> {
    let seg = Segments::whole(Bytes::copy_from_slice(bytes));
    let dir = read_directory(&seg)?;
    let mut members = Vec::with_capacity(dir.entries.len());
    for entry in &dir.entries {
        let data = read_member(&seg, &dir, entry)?;
        let actual = crc32fast::hash(data);
        if actual != entry.crc32 {
            return bad(format!(
                "member {}: crc32 {actual:08x} but the directory says {:08x}",
                entry.name, entry.crc32
            ));
        }
        members.push((entry.name.clone(), data.to_vec()));
    }
    Ok(members)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn segments_answer_need_for_missing_bytes_and_nothing_for_empty_ranges() {
        let mut seg = Segments::new(100);
        seg.add(0, Bytes::from_static(&[1; 10]));
        assert_eq!(seg.get(2, 3, "x").unwrap(), &[1, 1, 1]);
        assert_eq!(seg.get(8, 4, "x"), Err(ZipError::Need(8..12)));
        assert_eq!(seg.get(50, 0, "x").unwrap(), &[] as &[u8]);
        assert_eq!(
            seg.get(98, 4, "the thing"),
            Err(ZipError::Bad(
                "the thing at bytes 98..102 lies past the end of the 100-byte blob".to_string()
            ))
        );
        let empty = Segments::new(0);
        assert_eq!(empty.get(0, 0, "x").unwrap(), &[] as &[u8]);
    }

    #[test]
    fn too_short_and_garbage_archives_are_refused() {
        assert_eq!(
            read_archive(b"PK"),
            Err(ZipError::Bad(
                "2 bytes are too few for a zip archive (the end record alone is 22)".to_string()
            ))
        );
        assert_eq!(
            read_archive(&[7u8; 64]),
            Err(ZipError::Bad(
                "no end of central directory record (not a zip archive, or truncated)".to_string()
            ))
        );
    }
}
