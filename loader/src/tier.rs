//! A node's memory tier: copies of a checkpoint's data files that a save leaves under a
//! node-local directory (e.g. `/dev/shm/tessera/<run>`) which outlives the training process, so
//! that a job restarting, with any layout, reads what survives there instead of storage.
//!
//! The format, written and read only here:
//!
//! ```text
//! <dir>/<copy>/                    one copy per saved checkpoint: step-<step>-<12 hex of its identity>
//!     .tessera-tier-copy.json      its marker (CopyMarker), there from the moment the folder is
//!     data/rank-3.bin              a rank's data file, its entries at the same offsets as in storage
//!     data/rank-3.bin.tier.json    its record (TierRecord), written last, only after the commit
//! ```
//!
//! The marker is what makes a folder a copy tessera may delete ([`is_copy_dir`]): a tier is
//! often a shared directory (`/dev/shm`), and a folder without it is never pruned, whatever it
//! holds. A copy folder is created under a temporary name with its marker inside and renamed
//! into place, so no copy folder is ever seen without one, and an existing folder of that name
//! without a marker is refused instead of written into.
//!
//! Copies are opened only when they are regular files ([`open_regular`]): without blocking and
//! without following a symbolic link, so that a FIFO or a device put in a copy's place is
//! ignored (and read from storage) instead of holding the load in `open(2)`.
//!
//! A copy counts only when its record names the identity of the checkpoint being loaded (so a
//! copy of another step, another run or an uncommitted save never does) and every box of the
//! file verifies against the checkpoint's own crc32c: [`find_copies`] reads and checks them all
//! before a rank offers them, and says why it ignored each one it did not take. Ranks that see the
//! same directory on the same host are on one node; each offers what it found, and the planner
//! reads each held file there once ([`tessera_planner::ReadSources`]).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path as FsPath, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use object_store::path::Path;
use object_store::{GetOptions, GetResult, ObjectStore};
use serde::{Deserialize, Serialize};
use tessera_metadata::{BoxChecksum, CheckpointMeta};

use crate::LoaderError;
use crate::read::overlay::{Overlay, OverlayStore};

/// `format` of a record.
pub const TIER_FORMAT: &str = "tessera-memory-tier";
/// `version` of a record this build writes and reads.
pub const TIER_VERSION: u32 = 1;
/// A record's name: its data file's name plus this.
pub const RECORD_SUFFIX: &str = ".tier.json";
/// The marker file in every copy folder tessera creates ([`CopyMarker`]).
pub const COPY_MARKER: &str = ".tessera-tier-copy.json";
/// Bytes a marker may have (it is a few dozen): a bigger file there is not tessera's.
const MAX_MARKER_BYTES: u64 = 4096;

/// Bytes a copy is read in while it is verified (1 MiB: stays in a core's cache while its
/// checksum is taken).
const VERIFY_PIECE: usize = 1 << 20;

/// What a save records next to a data file it left in the tier.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierRecord {
    /// Always [`TIER_FORMAT`].
    pub format: String,
    /// [`TIER_VERSION`].
    pub version: u32,
    /// Where the durable checkpoint is, as the saving job named it.
    pub checkpoint: String,
    /// The durable checkpoint's identity (of its committed manifest).
    pub identity: String,
    /// Its training step, when known.
    pub step: Option<u64>,
    /// The data file, relative to the checkpoint root (`data/rank-3.bin`).
    pub file: String,
    /// The data file's size.
    pub size: u64,
    /// Every entry of the file (tensor boxes and plain values): where it is and its crc32c, as
    /// the checkpoint's metadata records them. With the zero padding between them, the copy is
    /// the durable file byte for byte, so a read verified by whole checksum blocks checks out.
    pub entries: Vec<TierEntry>,
    /// When the copy was completed (ms since the epoch): the pruning order.
    pub saved_unix_ms: u64,
}

/// One entry (a tensor box or a plain value) of a tier copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TierEntry {
    /// Byte offset in the file.
    pub offset: u64,
    /// Bytes.
    pub length: u64,
    /// crc32c of its bytes.
    pub crc32c: u32,
}

/// What a copy folder's marker ([`COPY_MARKER`]) holds: proof that tessera created the folder,
/// and so may remove it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CopyMarker {
    /// Always [`TIER_FORMAT`].
    pub format: String,
    /// [`TIER_VERSION`].
    pub version: u32,
    /// The folder's name ([`copy_dir_name`]): a marker copied elsewhere does not count there.
    pub copy: String,
}

/// Whether `path` is a copy folder tessera created in a tier: a real directory (not a symbolic
/// link) whose marker is a regular file naming this folder. A folder being created (its
/// temporary name, `.<copy>.<…>.partial`) counts too, so that one a killed save left is pruned.
/// Everything else in a tier is someone else's and is never removed.
pub fn is_copy_dir(path: &FsPath) -> bool {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return false;
    };
    let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
        return false;
    };
    if !meta.is_dir() {
        return false;
    }
    let Ok(file) = open_regular(&path.join(COPY_MARKER)) else {
        return false;
    };
    let mut bytes = Vec::new();
    if std::io::Read::read_to_end(
        &mut std::io::Read::take(&file, MAX_MARKER_BYTES + 1),
        &mut bytes,
    )
    .is_err()
        || bytes.len() as u64 > MAX_MARKER_BYTES
    {
        return false;
    }
    let Ok(marker) = serde_json::from_slice::<CopyMarker>(&bytes) else {
        return false;
    };
    let partial = name
        .strip_prefix('.')
        .and_then(|n| n.strip_suffix(".partial"))
        .and_then(|n| n.strip_prefix(marker.copy.as_str()))
        .is_some_and(|rest| rest.starts_with('.'));
    marker.format == TIER_FORMAT
        && marker.version == TIER_VERSION
        && (marker.copy == name || partial)
        && is_copy_name(&marker.copy)
}

/// Whether `name` is one [`copy_dir_name`] gives.
fn is_copy_name(name: &str) -> bool {
    let hex = match name.strip_prefix("nostep-") {
        Some(hex) => hex,
        None => match name
            .strip_prefix("step-")
            .and_then(|rest| rest.split_once('-'))
        {
            Some((step, hex)) if !step.is_empty() && step.bytes().all(|b| b.is_ascii_digit()) => {
                hex
            }
            _ => return false,
        },
    };
    !hex.is_empty() && hex.len() <= 12 && hex.bytes().all(|b| b.is_ascii_alphanumeric())
}

/// Opens `path` for reading if it is a regular file, and refuses anything else: opened with
/// `O_NONBLOCK` (a FIFO would otherwise block `open(2)` until some writer opens it, past every
/// deadline of a load) and `O_NOFOLLOW` (a symbolic link in a copy's place is not what a save
/// wrote), then checked by the descriptor it got, so nothing swapped in between a check and the
/// open is read. Tier copies, their records and markers are opened only through here.
pub fn open_regular(path: &FsPath) -> std::io::Result<File> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            if e.raw_os_error() == Some(libc::ELOOP) {
                std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    "a symbolic link, not a file tessera wrote",
                )
            } else {
                e
            }
        })?;
    let kind = file.metadata()?.file_type();
    if kind.is_file() {
        return Ok(file);
    }
    let what = if kind.is_fifo() {
        "a FIFO"
    } else if kind.is_dir() {
        "a directory"
    } else if kind.is_socket() {
        "a socket"
    } else if kind.is_block_device() || kind.is_char_device() {
        "a device"
    } else {
        "not a regular file"
    };
    Err(std::io::Error::new(
        std::io::ErrorKind::InvalidInput,
        format!("{what}, not a regular file tessera wrote"),
    ))
}

/// The folder of the copy of the checkpoint with `identity` (saved at `step`) under a tier.
pub fn copy_dir_name(identity: &str, step: Option<u64>) -> String {
    let hex: String = identity
        .rsplit(':')
        .next()
        .unwrap_or(identity)
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(12)
        .collect();
    match step {
        Some(step) => format!("step-{step}-{hex}"),
        None => format!("nostep-{hex}"),
    }
}

/// Leaves a copy of one data file in the tier at `dir`: its entries (`entries[i]` at
/// `record.entries[i].offset`), then its record, each written to a temporary name and renamed, so
/// that a copy is never seen with its record before all its bytes are there. Call only after the
/// checkpoint committed: the record is what makes the copy count. Returns the data file's path.
pub fn write_copy(
    dir: &FsPath,
    record: &TierRecord,
    entries: &[&[u8]],
) -> Result<PathBuf, LoaderError> {
    if entries.len() != record.entries.len() {
        return Err(LoaderError::InvalidPlan {
            detail: format!(
                "tier copy of {}: {} entries recorded but {} given",
                record.file,
                record.entries.len(),
                entries.len()
            ),
        });
    }
    let name = copy_dir_name(&record.identity, record.step);
    let copy = dir.join(&name);
    create_copy_dir(dir, &name)?;
    let target = copy.join(&record.file);
    let parent = target.parent().unwrap_or(&copy).to_path_buf();
    std::fs::create_dir_all(&parent).map_err(|e| io("creating", &parent, e))?;
    let partial = with_suffix(&target, ".partial");
    let file = File::create(&partial).map_err(|e| io("creating", &partial, e))?;
    file.set_len(record.size)
        .map_err(|e| io("sizing", &partial, e))?;
    for (b, bytes) in record.entries.iter().zip(entries) {
        if bytes.len() as u64 != b.length || b.offset + b.length > record.size {
            return Err(LoaderError::InvalidPlan {
                detail: format!(
                    "tier copy of {}: the entry at {} is {} bytes long but {} were given",
                    record.file,
                    b.offset,
                    b.length,
                    bytes.len()
                ),
            });
        }
        file.write_all_at(bytes, b.offset)
            .map_err(|e| io("writing", &partial, e))?;
    }
    drop(file);
    std::fs::rename(&partial, &target).map_err(|e| io("renaming", &partial, e))?;
    let record_path = with_suffix(&target, RECORD_SUFFIX);
    let record_partial = with_suffix(&record_path, ".partial");
    let json = serde_json::to_vec_pretty(record).map_err(|e| LoaderError::InvalidPlan {
        detail: format!("encoding the tier record of {}: {e}", record.file),
    })?;
    let mut out = File::create(&record_partial).map_err(|e| io("creating", &record_partial, e))?;
    out.write_all(&json)
        .map_err(|e| io("writing", &record_partial, e))?;
    drop(out);
    std::fs::rename(&record_partial, &record_path)
        .map_err(|e| io("renaming", &record_partial, e))?;
    Ok(target)
}

/// Makes sure the copy folder `name` under `dir` exists and is tessera's: created under a
/// temporary name with its marker inside and renamed into place (the ranks of a node race to
/// create it; the loser finds the winner's, marked). A folder of that name without a marker is
/// someone else's: refused, never written into (and so never made prunable).
fn create_copy_dir(dir: &FsPath, name: &str) -> Result<(), LoaderError> {
    let copy = dir.join(name);
    let refuse = || LoaderError::InvalidPlan {
        detail: format!(
            "memory tier: {} exists but is not a copy tessera made (no {COPY_MARKER} naming it): \
             it is left alone and no copy is written there",
            copy.display()
        ),
    };
    if std::fs::symlink_metadata(&copy).is_ok() {
        return if is_copy_dir(&copy) {
            Ok(())
        } else {
            Err(refuse())
        };
    }
    std::fs::create_dir_all(dir).map_err(|e| io("creating", dir, e))?;
    // Unique among the ranks of a node: processes by pid, threads of one by a counter.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let temporary = dir.join(format!(
        ".{name}.{}.{}.partial",
        std::process::id(),
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir(&temporary).map_err(|e| io("creating", &temporary, e))?;
    let marker = CopyMarker {
        format: TIER_FORMAT.into(),
        version: TIER_VERSION,
        copy: name.to_string(),
    };
    let json = serde_json::to_vec(&marker).map_err(|e| LoaderError::InvalidPlan {
        detail: format!("encoding the marker of tier copy {name}: {e}"),
    })?;
    let marker_path = temporary.join(COPY_MARKER);
    std::fs::write(&marker_path, json).map_err(|e| io("writing", &marker_path, e))?;
    match std::fs::rename(&temporary, &copy) {
        Ok(()) => Ok(()),
        // Another rank of this node put its marked folder there first (a non-empty target:
        // ENOTEMPTY or EEXIST); ours goes.
        Err(_) if std::fs::symlink_metadata(&copy).is_ok() => {
            let _ = std::fs::remove_dir_all(&temporary);
            if is_copy_dir(&copy) {
                Ok(())
            } else {
                Err(refuse())
            }
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&temporary);
            Err(io("renaming", &temporary, e))
        }
    }
}

/// Milliseconds since the epoch, for [`TierRecord::saved_unix_ms`].
pub fn now_unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

fn with_suffix(path: &FsPath, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

fn io(action: &'static str, path: &FsPath, source: std::io::Error) -> LoaderError {
    LoaderError::Io {
        action,
        path: path.display().to_string(),
        source,
    }
}

/// The tier copies of one checkpoint found on this node, each verified.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TierCopies {
    /// Verified copies: data file (an index into the checkpoint's files) → the local file.
    pub files: BTreeMap<u32, PathBuf>,
    /// Bytes of the verified copies' entries.
    pub bytes: u64,
    /// Copies seen and not taken, each with why (another checkpoint, a damaged box, …).
    pub ignored: Vec<String>,
}

impl TierCopies {
    /// Data files this node holds, for the planner's sources.
    pub fn file_indices(&self) -> Vec<u32> {
        self.files.keys().copied().collect()
    }
}

/// Finds the copies of the checkpoint `meta` (whose identity is `identity`) in the tier at
/// `dir`, and verifies every box of each against the checkpoint's recorded checksum. A copy that
/// is of another checkpoint, incomplete, or damaged is not taken; [`TierCopies::ignored`] says
/// why. A missing `dir` holds nothing. Reads every byte of the copies it takes. (Ranks of one
/// node split this: [`find_candidates`], each verifies its share, then [`TierCandidates::accept`].)
pub fn find_copies(dir: &FsPath, meta: &CheckpointMeta, identity: &str) -> TierCopies {
    let candidates = find_candidates(dir, meta, identity);
    let checked = candidates.verify(meta, |_| true);
    let mut found = candidates.accept(&checked.files);
    found.ignored = checked.ignored;
    found
}

/// The copies of one checkpoint a tier holds, found by their records but not yet verified.
#[derive(Clone, Debug, Default)]
pub struct TierCandidates {
    /// Data file (an index into the checkpoint's files) → its copy and record.
    files: BTreeMap<u32, (PathBuf, TierRecord)>,
    /// Records seen and not taken (unreadable, naming a file the checkpoint lacks).
    ignored: Vec<String>,
}

/// What verifying some candidates found.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verified {
    /// Data files whose copy verified, box by box.
    pub files: Vec<u32>,
    /// Copies not taken, each with why.
    pub ignored: Vec<String>,
}

impl TierCandidates {
    /// Data files with a candidate copy, ascending.
    pub fn file_indices(&self) -> Vec<u32> {
        self.files.keys().copied().collect()
    }

    /// Verifies the candidates `select` picks (by data file) against `meta`'s checksums; the
    /// records not taken when the candidates were found are reported here too.
    pub fn verify(&self, meta: &CheckpointMeta, select: impl Fn(u32) -> bool) -> Verified {
        let mut out = Verified {
            files: Vec::new(),
            ignored: self.ignored.clone(),
        };
        for (&file, (local, record)) in &self.files {
            if !select(file) {
                continue;
            }
            match verify_copy(local, file, record, meta) {
                Ok(_) => out.files.push(file),
                Err(why) => out.ignored.push(format!(
                    "{}: {why}; read from storage instead",
                    local.display()
                )),
            }
        }
        out
    }

    /// The copies of `files` (verified, by this rank or another of its node) as a rank reads
    /// them; files without a candidate here are left out.
    pub fn accept(&self, files: &[u32]) -> TierCopies {
        let mut copies = TierCopies::default();
        for file in files {
            if let Some((local, record)) = self.files.get(file) {
                copies.bytes += record.entries.iter().map(|b| b.length).sum::<u64>();
                copies.files.insert(*file, local.clone());
            }
        }
        copies
    }
}

/// Finds the copies of the checkpoint `meta` (identity `identity`) in the tier at `dir` by their
/// records, without reading their data: records of another checkpoint are skipped (a tier keeps
/// several steps), unreadable ones and ones naming a file the checkpoint lacks are reported.
pub fn find_candidates(dir: &FsPath, meta: &CheckpointMeta, identity: &str) -> TierCandidates {
    let mut found = TierCandidates::default();
    // The copies' paths are used long after this (reads by position, the tier's store): made
    // absolute now, so a relative tier (`memory_tier="tier"`) means where it was when found.
    let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    let Ok(copies) = std::fs::read_dir(&dir) else {
        return found;
    };
    let by_path: HashMap<&str, u32> = meta
        .files()
        .iter()
        .enumerate()
        .map(|(i, f)| (f.path.as_str(), i as u32))
        .collect();
    let mut records: Vec<PathBuf> = Vec::new();
    for copy in copies.flatten() {
        collect_records(&copy.path(), &mut records, 0);
    }
    records.sort();
    for path in records {
        let record = match read_record(&path) {
            Ok(record) => record,
            Err(why) => {
                found.ignored.push(format!("{}: {why}", path.display()));
                continue;
            }
        };
        if record.identity != identity {
            continue;
        }
        let local = PathBuf::from(
            path.to_string_lossy()
                .strip_suffix(RECORD_SUFFIX)
                .unwrap_or_default(),
        );
        let Some(&file) = by_path.get(record.file.as_str()) else {
            found.ignored.push(format!(
                "{}: names data file {} which checkpoint {identity} does not have",
                path.display(),
                record.file
            ));
            continue;
        };
        found.files.insert(file, (local, record));
    }
    found
}

/// Records under `dir` (at most two levels down: `data/<file>`).
fn collect_records(dir: &FsPath, out: &mut Vec<PathBuf>, depth: u32) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        match entry.file_type() {
            Ok(t) if t.is_dir() && depth < 2 => collect_records(&path, out, depth + 1),
            Ok(t) if t.is_file() && path.to_string_lossy().ends_with(RECORD_SUFFIX) => {
                out.push(path);
            }
            _ => {}
        }
    }
}

fn read_record(path: &FsPath) -> Result<TierRecord, String> {
    let mut bytes = Vec::new();
    open_regular(path)
        .and_then(|mut file| std::io::Read::read_to_end(&mut file, &mut bytes))
        .map_err(|e| format!("unreadable record: {e}"))?;
    let record: TierRecord =
        serde_json::from_slice(&bytes).map_err(|e| format!("not a tier record: {e}"))?;
    if record.format != TIER_FORMAT || record.version != TIER_VERSION {
        return Err(format!(
            "a record of format {} version {}, not {TIER_FORMAT} version {TIER_VERSION}",
            record.format, record.version
        ));
    }
    Ok(record)
}

/// Checks the copy at `local` of data file `file` entry by entry (tensor boxes and plain values)
/// against `meta`'s checksums; returns the bytes of its entries.
fn verify_copy(
    local: &FsPath,
    file: u32,
    record: &TierRecord,
    meta: &CheckpointMeta,
) -> Result<u64, String> {
    let expected_size = meta.files()[file as usize].size;
    let handle = open_regular(local).map_err(|e| format!("cannot open the copy: {e}"))?;
    let size = handle
        .metadata()
        .map_err(|e| format!("cannot stat the copy: {e}"))?
        .len();
    if let Some(expected) = expected_size.filter(|&s| s != size) {
        return Err(format!(
            "the copy has {size} bytes but the checkpoint's {} has {expected}",
            record.file
        ));
    }
    if size != record.size {
        return Err(format!(
            "the copy has {size} bytes but its record says {} (of the checkpoint's {})",
            record.size, record.file
        ));
    }
    // Every entry of the file, tensor boxes and plain values, each named for messages.
    let tensors = meta.tensors();
    let mut entries: Vec<(u64, u64, Option<BoxChecksum>, String)> = meta
        .chunks()
        .iter()
        .filter(|c| c.bytes.file == file)
        .map(|c| {
            let name = format!("box {} of {}", c.region, tensors[c.tensor as usize].fqn);
            (c.bytes.offset, c.bytes.length, c.checksum(), name)
        })
        .collect();
    entries.extend(meta.objects().iter().filter(|o| o.file == file).map(|o| {
        let sum = o.crc32c.map(BoxChecksum::Crc32c);
        (o.offset, o.length, sum, format!("value {}", o.key))
    }));
    // Read in pieces small enough to stay in cache while their checksum is taken: one pass over
    // memory, and no buffer the size of a box to allocate and fault in.
    let mut buffer = vec![0u8; VERIFY_PIECE];
    let mut bytes = 0;
    for (offset, length, sum, name) in entries {
        let Some(sum) = sum else {
            return Err(format!("{name} has no checksum to check the copy against"));
        };
        let (mut crc32c, mut crc32) = (0u32, crc32fast::Hasher::new());
        let mut at = offset;
        while at < offset + length {
            let n = (offset + length - at).min(VERIFY_PIECE as u64) as usize;
            let piece = &mut buffer[..n];
            handle
                .read_exact_at(piece, at)
                .map_err(|e| format!("{name} unreadable: {e}"))?;
            match sum {
                BoxChecksum::Crc32c(_) => crc32c = crc32c::crc32c_append(crc32c, piece),
                BoxChecksum::Crc32(_) => crc32.update(piece),
            }
            at += n as u64;
        }
        let actual = match sum {
            BoxChecksum::Crc32c(_) => crc32c,
            BoxChecksum::Crc32(_) => crc32.finalize(),
        };
        if actual != sum.value() {
            return Err(format!(
                "{name} (bytes {offset}..{}) does not match the checkpoint's checksum \
                 ({actual:#010x}, expected {:#010x})",
                offset + length,
                sum.value()
            ));
        }
        bytes += length;
    }
    Ok(bytes)
}

/// The store a load reads through when this node holds tier copies: each held file's store
/// path is served from its copy, everything else from the checkpoint's store. Writes to a held
/// file's path are refused. A copy is opened only if it is a regular file ([`open_regular`]);
/// errors name the copy, not the durable file it stands for.
pub struct TierStore {
    inner: Arc<dyn ObjectStore>,
    /// Store path → the copy's local path.
    files: HashMap<Path, PathBuf>,
}

impl fmt::Debug for TierStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TierStore")
            .field("files", &self.files.len())
            .finish_non_exhaustive()
    }
}

impl fmt::Display for TierStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TierStore({} copies over {})",
            self.files.len(),
            self.inner
        )
    }
}

impl TierStore {
    /// Serves `files` (store path → local copy; a relative one is taken from the current
    /// directory now) over `inner`.
    pub fn new(
        inner: Arc<dyn ObjectStore>,
        files: &HashMap<String, PathBuf>,
    ) -> Result<OverlayStore<Self>, LoaderError> {
        let mut mapped = HashMap::with_capacity(files.len());
        for (path, local) in files {
            let copy = std::path::absolute(local).map_err(|e| io("naming", local, e))?;
            mapped.insert(Path::from(path.as_str()), copy);
        }
        Ok(OverlayStore(Self {
            inner,
            files: mapped,
        }))
    }

    /// The bytes `options` asks of the copy at `copy` (standing for store path `location`).
    fn get_copy(
        location: &Path,
        copy: &FsPath,
        options: &GetOptions,
    ) -> object_store::Result<GetResult> {
        let failed = |what: String| object_store::Error::Generic {
            store: "memory tier",
            source: format!("memory-tier copy {} of {location}: {what}", copy.display()).into(),
        };
        let file = open_regular(copy).map_err(|e| failed(format!("cannot open it: {e}")))?;
        tessera_storage::local_file_get(location, file, copy.to_path_buf(), options, "copy")
            .map_err(failed)
    }
}

#[async_trait::async_trait]
impl Overlay for TierStore {
    fn inner(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    fn serves(&self, location: &Path) -> bool {
        self.files.contains_key(location)
    }

    async fn get_served(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        match self.files.get(location) {
            Some(copy) => Self::get_copy(location, copy, &options),
            None => self.inner.get_opts(location, options).await,
        }
    }

    fn refuse_write(&self, location: &Path) -> object_store::Error {
        object_store::Error::NotSupported {
            source: format!("{location} is read from a memory-tier copy; it cannot be written")
                .into(),
        }
    }
}
