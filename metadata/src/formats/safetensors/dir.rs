//! safetensors checkpoints read in place: a single file, a directory of files, an HF sharded
//! directory (`model.safetensors.index.json`), and DCP's HF writer layout (per-rank files in
//! `sharded/` whose `__metadata__.DCP_SHARDING_INFO` gives each tensor's `saved_offsets`). Only
//! headers are read (with ranges, capped); data stays where it is.

use std::collections::{BTreeMap, HashMap};

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use serde_json::Value;

use super::{Header, header_len, parse_header};
use crate::formats::native::{read_whole, resolve, store_error};
use crate::formats::{Format, Listing, list_dir};
use crate::identity::IdentityHasher;
use crate::{
    ByteMeta, CheckpointMeta, DataFile, MetadataError, SavedChunk, TensorBox, TensorMeta, validate,
};

/// Name of the HF index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Folder of the per-rank files DCP's HF writer writes with `save_distributed=True`.
pub const SHARDED_DIR: &str = "sharded";
/// `__metadata__` key of DCP's HF writer: JSON `{fqn: {"saved_offsets": [...]}}`.
pub const SHARDING_INFO_KEY: &str = "DCP_SHARDING_INFO";
/// Largest index file read.
const MAX_INDEX_BYTES: u64 = 256 << 20;
/// First read of a file: most headers fit, so one request gets the header length and the header.
const FIRST_READ: u64 = 16 << 10;

/// How the safetensors files were found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SafetensorsLayout {
    /// The location is one `.safetensors` file.
    SingleFile,
    /// Every `.safetensors` file of a directory.
    Directory,
    /// The files `model.safetensors.index.json` names.
    Index,
    /// DCP's HF writer: the `sharded/` per-rank files.
    DcpSharded,
}

/// One safetensors file with its parsed header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SafetensorsFile {
    /// Path relative to the checkpoint root.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Its header.
    pub header: Header,
}

/// A safetensors checkpoint, opened: the checkpoint model and what is specific to safetensors.
#[derive(Clone, Debug)]
pub struct SafetensorsCheckpoint {
    /// The checkpoint model (whole tensors, or DCP-sharded chunks).
    pub meta: CheckpointMeta,
    /// The rest.
    pub details: SafetensorsDetails,
}

/// What is specific to safetensors about an opened checkpoint.
#[derive(Clone, Debug)]
pub struct SafetensorsDetails {
    /// How the files were found.
    pub layout: SafetensorsLayout,
    /// The files, with their headers.
    pub files: Vec<SafetensorsFile>,
    /// Header bytes read to open it.
    pub header_bytes: u64,
    /// Files in the directory that are not part of the checkpoint: an earlier DCP distributed HF
    /// save's files that the newest save (by more ranks before, fewer now) did not overwrite.
    pub ignored: Vec<String>,
}

/// True when `listing` holds safetensors files or an index, or a `sharded/` folder.
pub fn is_safetensors(listing: &Listing) -> bool {
    listing.files.contains_key(INDEX_FILE)
        || listing.files.keys().any(|n| n.ends_with(".safetensors"))
        || listing.dirs.contains(SHARDED_DIR)
}

/// Reads and checks the header of the safetensors file `path` of `size` bytes with at most two
/// range reads; returns it with the bytes read.
pub async fn read_header(
    store: &dyn ObjectStore,
    path: &Path,
    size: u64,
) -> Result<(Header, u64), MetadataError> {
    read_header_raw(store, path, size)
        .await
        .map(|(header, read, _)| (header, read))
}

/// [`read_header`], also returning the header's JSON bytes as read (for the identity).
async fn read_header_raw(
    store: &dyn ObjectStore,
    path: &Path,
    size: u64,
) -> Result<(Header, u64, bytes::Bytes), MetadataError> {
    let name = path.to_string();
    if size < 8 {
        return Err(MetadataError::Decode {
            path: name,
            what: "safetensors header",
            detail: format!("file is {size} bytes, shorter than the 8-byte header length"),
        });
    }
    let first = store
        .get_range(path, 0..size.min(FIRST_READ))
        .await
        .map_err(store_error("reading", path))?;
    let n = header_len(&first, &name)?;
    let mut read = first.len() as u64;
    let end = 8 + n;
    if end > size {
        return Err(MetadataError::Decode {
            path: name,
            what: "safetensors header",
            detail: format!(
                "header of {n} bytes but the file has {} bytes after the length",
                size.saturating_sub(8)
            ),
        });
    }
    let json = if end <= first.len() as u64 {
        first.slice(8..end as usize)
    } else {
        let json = store
            .get_range(path, 8..end)
            .await
            .map_err(store_error("reading", path))?;
        read += json.len() as u64;
        json
    };
    let header = parse_header(&json, size, &name)?;
    Ok((header, read, json))
}

/// Opens the safetensors checkpoint in the directory `prefix` (whose listing is `listing`), or
/// the single file `file` inside it when given.
pub async fn open_safetensors(
    store: &dyn ObjectStore,
    prefix: &Path,
    listing: &Listing,
    file: Option<&str>,
) -> Result<SafetensorsCheckpoint, MetadataError> {
    // Which files, and what the index says each tensor is in.
    let mut weight_map: Option<BTreeMap<String, String>> = None;
    // When each file was last written (by file name): what tells the newest save's files from
    // an earlier save's left in the same directory.
    let mut modified = listing.modified.clone();
    let mut index_bytes: Option<bytes::Bytes> = None;
    let (layout, names): (SafetensorsLayout, Vec<(String, Option<u64>)>) = if let Some(file) = file
    {
        (
            SafetensorsLayout::SingleFile,
            vec![(file.to_string(), listing.files.get(file).copied())],
        )
    } else if listing.files.contains_key(INDEX_FILE) {
        let (map, bytes) = read_index(store, prefix, listing).await?;
        index_bytes = Some(bytes);
        let mut names: Vec<String> = map.values().cloned().collect();
        names.sort();
        names.dedup();
        weight_map = Some(map);
        (
            SafetensorsLayout::Index,
            names
                .into_iter()
                .map(|n| {
                    let size = listing.files.get(&n).copied();
                    (n, size)
                })
                .collect(),
        )
    } else if listing.files.keys().any(|n| n.ends_with(".safetensors")) {
        let names: Vec<(String, Option<u64>)> = listing
            .files
            .iter()
            .filter(|(n, _)| n.ends_with(".safetensors"))
            .map(|(n, s)| (n.clone(), Some(*s)))
            .collect();
        check_shard_sets(prefix, names.iter().map(|(n, _)| n.as_str()))?;
        (SafetensorsLayout::Directory, names)
    } else {
        let sharded = list_dir(store, &prefix.clone().join(SHARDED_DIR)).await?;
        modified.clone_from(&sharded.modified);
        let names: Vec<(String, Option<u64>)> = sharded
            .files
            .iter()
            .filter(|(n, _)| n.ends_with(".safetensors"))
            .map(|(n, s)| (format!("{SHARDED_DIR}/{n}"), Some(*s)))
            .collect();
        if names.is_empty() {
            return Err(MetadataError::Unsupported {
                path: prefix.to_string(),
                detail: format!("{SHARDED_DIR}/ holds no .safetensors files"),
            });
        }
        (SafetensorsLayout::DcpSharded, names)
    };

    let mut files = Vec::with_capacity(names.len());
    let mut header_bytes = 0u64;
    let mut headers_read: Vec<bytes::Bytes> = Vec::with_capacity(names.len());
    for (name, size) in names {
        let path = resolve(prefix, &name)?;
        let size = match size {
            Some(size) => size,
            None => match store.head(&path).await {
                Ok(meta) => meta.size,
                Err(object_store::Error::NotFound { .. }) => {
                    return Err(MetadataError::Invalid {
                        what: format!(
                            "safetensors file {path} does not exist{}",
                            if weight_map.is_some() {
                                format!(" ({INDEX_FILE} names it)")
                            } else {
                                String::new()
                            }
                        ),
                    });
                }
                Err(e) => return Err(store_error("reading", &path)(e)),
            },
        };
        let (header, read, json) = read_header_raw(store, &path, size).await?;
        header_bytes += read;
        headers_read.push(json);
        files.push(SafetensorsFile {
            path: name,
            size,
            header,
        });
    }
    // A directory DCP's HF writer saved into twice keeps the files of the earlier save that the
    // later one did not overwrite: only the later save's files are the checkpoint.
    let mut ignored = Vec::new();
    if weight_map.is_none()
        && let Some(keep) = newest_dcp_save(prefix, &files, &modified)?
    {
        let mut kept_files = Vec::with_capacity(keep.len());
        let mut kept_headers = Vec::with_capacity(keep.len());
        for (i, (file, json)) in files.into_iter().zip(headers_read).enumerate() {
            // `keep` is sorted: a lookup per file, not a scan.
            if keep.binary_search(&i).is_ok() {
                kept_files.push(file);
                kept_headers.push(json);
            } else {
                ignored.push(file.path);
            }
        }
        files = kept_files;
        headers_read = kept_headers;
    }
    // The checkpoint's identity: the index (when there is one), then every file's name, size and
    // header as read.
    let mut identity = IdentityHasher::new(Format::Safetensors);
    if let Some(index) = &index_bytes {
        identity.part(INDEX_FILE.as_bytes()).part(index);
    }
    for (file, json) in files.iter().zip(&headers_read) {
        identity
            .part(file.path.as_bytes())
            .part(&file.size.to_le_bytes())
            .part(json);
    }
    let meta = build_meta(prefix, &files, weight_map.as_ref())?.with_identity(identity.finish());
    Ok(SafetensorsCheckpoint {
        meta,
        details: SafetensorsDetails {
            layout,
            files,
            header_bytes,
            ignored,
        },
    })
}

/// Which of the files of a directory DCP's HF writer saved into (`save_distributed=True`, each
/// file's `DCP_SHARDING_INFO` giving its boxes) are the newest save's, when an earlier save's
/// files are still there: `None` when every file belongs (no two boxes overlap), else the
/// positions to keep.
///
/// Such a save writes no index and no commit record, and it leaves alone every file it does not
/// write: a save by fewer ranks than the last one, or one in which some ranks have nothing to
/// write (replicas are written once), keeps the earlier save's other files next to its own, and
/// their boxes overlap the new ones. The files' modification times are then the only record of
/// which save is newest: files are taken newest first, each unless one of its boxes overlaps a
/// box taken already; what is taken must tile every tensor (nothing missing) and no file left
/// out may be as new as one it overlaps (a tie says nothing). Otherwise the files are left as
/// they are, and the overlap is refused when the model is built.
fn newest_dcp_save(
    prefix: &Path,
    files: &[SafetensorsFile],
    modified: &BTreeMap<String, i64>,
) -> Result<Option<Vec<usize>>, MetadataError> {
    let mut boxes: Vec<Vec<(String, TensorBox)>> = Vec::with_capacity(files.len());
    for file in files {
        let info = sharding_info(file, prefix)?;
        if info.is_empty() {
            return Ok(None);
        }
        boxes.push(
            file.header
                .tensors
                .iter()
                .map(|entry| {
                    let offsets = info
                        .get(&entry.name)
                        .cloned()
                        .unwrap_or_else(|| vec![0; entry.shape.len()]);
                    (
                        entry.name.clone(),
                        TensorBox::new(offsets, entry.shape.clone()),
                    )
                })
                .collect(),
        );
    }
    let by_tensor = |chosen: &[usize]| {
        let mut tensors: BTreeMap<&str, Vec<&TensorBox>> = BTreeMap::new();
        for &f in chosen {
            for (name, region) in &boxes[f] {
                tensors.entry(name.as_str()).or_default().push(region);
            }
        }
        tensors
    };
    let all: Vec<usize> = (0..files.len()).collect();
    let everything = by_tensor(&all);
    let overlapping = |tensors: &BTreeMap<&str, Vec<&TensorBox>>| {
        tensors
            .values()
            .any(|b| crate::BoxIndex::build(b.clone()).find_overlap().is_some())
    };
    if !overlapping(&everything) {
        return Ok(None);
    }
    let mut times = Vec::with_capacity(files.len());
    for file in files {
        let name = file.path.rsplit('/').next().unwrap_or(&file.path);
        let Some(&time) = modified.get(name) else {
            return Ok(None);
        };
        times.push(time);
    }
    let mut order = all.clone();
    order.sort_by_key(|&f| std::cmp::Reverse(times[f]));
    let mut chosen: Vec<usize> = Vec::new();
    let mut left: Vec<usize> = Vec::new();
    for f in order {
        let clash = chosen.iter().find(|&&c| {
            boxes[f].iter().any(|(name, region)| {
                boxes[c]
                    .iter()
                    .any(|(other, taken)| other == name && region.overlaps(taken))
            })
        });
        match clash {
            // A tie: nothing says which of the two saves is newer.
            Some(&c) if times[c] == times[f] => return Ok(None),
            Some(_) => left.push(f),
            None => chosen.push(f),
        }
    }
    // The files taken must hold every element of every tensor they hold (the tensors' shapes as
    // all files together give them).
    let taken = by_tensor(&chosen);
    let complete = taken.iter().all(|(name, regions)| {
        let all = &everything[name];
        let ndim = all[0].ndim();
        if all.iter().any(|b| b.ndim() != ndim) {
            return false;
        }
        let volume: u128 = (0..ndim)
            .map(|d| u128::from(all.iter().map(|b| b.end(d)).max().unwrap_or(0)))
            .product();
        regions.iter().map(|b| u128::from(b.numel())).sum::<u128>() == volume
    });
    if !complete || overlapping(&taken) {
        return Ok(None);
    }
    chosen.sort_unstable();
    Ok(Some(chosen))
}

/// A shard name `<stem>-<k>-of-<n>.safetensors` split into (stem, k, n as written).
fn shard_name(name: &str) -> Option<(&str, u64, &str)> {
    let base = name.strip_suffix(".safetensors")?;
    let (head, total) = base.rsplit_once("-of-")?;
    let (stem, index) = head.rsplit_once('-')?;
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    if !digits(total) || !digits(index) {
        return None;
    }
    Some((stem, index.parse().ok()?, total))
}

/// Without an index, files named `<stem>-<k>-of-<n>.safetensors` say how many shards there are:
/// every set must be complete. An export writes its index last, so shards without one may be an
/// interrupted export, and a set with a shard missing certainly is (or a partial copy): reading
/// it would serve a model with tensors silently absent.
fn check_shard_sets<'a>(
    prefix: &Path,
    names: impl Iterator<Item = &'a str>,
) -> Result<(), MetadataError> {
    let mut sets: BTreeMap<(&str, &str), Vec<u64>> = BTreeMap::new();
    for name in names {
        if let Some((stem, index, total)) = shard_name(name) {
            sets.entry((stem, total)).or_default().push(index);
        }
    }
    for ((stem, total), present) in sets {
        // A count too large to parse cannot be complete; cap what is listed as missing.
        let n: u64 = total.parse().unwrap_or(u64::MAX);
        let width = total.len();
        let missing: Vec<String> = (1..=n)
            .filter(|k| !present.contains(k))
            .take(3)
            .map(|k| format!("{stem}-{k:0width$}-of-{total}.safetensors"))
            .collect();
        let beyond = present.iter().find(|&&k| k == 0 || k > n);
        if missing.is_empty() && beyond.is_none() {
            continue;
        }
        let detail = match beyond {
            Some(k) if missing.is_empty() => {
                format!("{stem}-{k:0width$}-of-{total}.safetensors is not one of {n} shards")
            }
            _ => format!(
                "{} missing ({} of {n} shards of {stem}-*-of-{total}.safetensors present)",
                missing.join(", "),
                present.len()
            ),
        };
        return Err(MetadataError::Invalid {
            what: format!(
                "{prefix}: incomplete safetensors shard set: {detail}, and there is no {INDEX_FILE} (an interrupted export or a partial copy?)"
            ),
        });
    }
    Ok(())
}

async fn read_index(
    store: &dyn ObjectStore,
    prefix: &Path,
    listing: &Listing,
) -> Result<(BTreeMap<String, String>, bytes::Bytes), MetadataError> {
    let path = resolve(prefix, INDEX_FILE)?;
    let bad = |detail: String| MetadataError::Decode {
        path: path.to_string(),
        what: "safetensors index",
        detail,
    };
    if listing
        .files
        .get(INDEX_FILE)
        .is_some_and(|&s| s > MAX_INDEX_BYTES)
    {
        return Err(bad(format!("larger than the {MAX_INDEX_BYTES}-byte cap")));
    }
    let bytes = read_whole(store, &path).await?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| bad(e.to_string()))?;
    let Some(map) = value.get("weight_map").and_then(Value::as_object) else {
        return Err(bad("no weight_map object".to_string()));
    };
    let mut out = BTreeMap::new();
    for (name, file) in map {
        let Some(file) = file.as_str() else {
            return Err(bad(format!("weight_map[{name:?}] is not a file name")));
        };
        out.insert(name.clone(), file.to_string());
    }
    Ok((out, bytes))
}

/// The chunk offsets DCP's HF writer recorded in a file's `__metadata__`.
fn sharding_info(
    file: &SafetensorsFile,
    prefix: &Path,
) -> Result<HashMap<String, Vec<u64>>, MetadataError> {
    let Some(text) = file.header.metadata.get(SHARDING_INFO_KEY) else {
        return Ok(HashMap::new());
    };
    let bad = |detail: String| MetadataError::Decode {
        path: format!("{prefix}/{}", file.path),
        what: "DCP_SHARDING_INFO",
        detail,
    };
    let value: Value = serde_json::from_str(text).map_err(|e| bad(e.to_string()))?;
    let Some(map) = value.as_object() else {
        return Err(bad("not a JSON object".to_string()));
    };
    let mut out = HashMap::with_capacity(map.len());
    for (fqn, info) in map {
        let offsets = info
            .get("saved_offsets")
            .and_then(Value::as_array)
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| bad(format!("{fqn}: saved_offsets is not a list of integers")))?;
        out.insert(fqn.clone(), offsets);
    }
    Ok(out)
}

fn build_meta(
    prefix: &Path,
    files: &[SafetensorsFile],
    weight_map: Option<&BTreeMap<String, String>>,
) -> Result<CheckpointMeta, MetadataError> {
    struct Pending {
        dtype: crate::DType,
        sharded: bool,
        shape: Vec<u64>,
        chunks: Vec<(TensorBox, ByteMeta, String)>,
    }
    let mut order: Vec<String> = Vec::new();
    let mut pending: HashMap<String, Pending> = HashMap::new();
    for (f, file) in files.iter().enumerate() {
        let info = sharding_info(file, prefix)?;
        for entry in &file.header.tensors {
            let offsets = match info.get(&entry.name) {
                Some(offsets) => {
                    if offsets.len() != entry.shape.len() {
                        return Err(MetadataError::Invalid {
                            what: format!(
                                "{prefix}/{}: tensor {} has shape {:?} but DCP_SHARDING_INFO gives offsets {offsets:?}",
                                file.path, entry.name, entry.shape
                            ),
                        });
                    }
                    offsets.clone()
                }
                None => vec![0; entry.shape.len()],
            };
            let sharded = info.contains_key(&entry.name);
            let region = TensorBox::new(offsets, entry.shape.clone());
            let bytes = ByteMeta {
                file: f as u32,
                offset: file.header.data_start + entry.data_offsets.0,
                length: entry.data_offsets.1 - entry.data_offsets.0,
                strides: None,
            };
            match pending.get_mut(&entry.name) {
                Some(p) => {
                    if !(p.sharded && sharded) {
                        return Err(MetadataError::Invalid {
                            what: format!(
                                "{prefix}: tensor {} is in both {} and {} (and neither says how it is sharded)",
                                entry.name, p.chunks[0].2, file.path
                            ),
                        });
                    }
                    if p.dtype != entry.dtype {
                        return Err(MetadataError::Invalid {
                            what: format!(
                                "{prefix}: tensor {} is {} in {} but {} in {}",
                                entry.name, p.dtype, p.chunks[0].2, entry.dtype, file.path
                            ),
                        });
                    }
                    p.chunks.push((region, bytes, file.path.clone()));
                }
                None => {
                    order.push(entry.name.clone());
                    pending.insert(
                        entry.name.clone(),
                        Pending {
                            dtype: entry.dtype,
                            sharded,
                            shape: Vec::new(),
                            chunks: vec![(region, bytes, file.path.clone())],
                        },
                    );
                }
            }
        }
    }
    if let Some(map) = weight_map {
        for (name, file) in map {
            let found = pending
                .get(name)
                .is_some_and(|p| p.chunks.iter().any(|c| &c.2 == file));
            if !found {
                return Err(MetadataError::Invalid {
                    what: format!(
                        "{prefix}/{INDEX_FILE} maps tensor {name} to {file}, but {file} has no tensor {name}"
                    ),
                });
            }
        }
    }
    let mut tensors = Vec::with_capacity(order.len());
    let mut chunks = Vec::new();
    for (t, name) in order.into_iter().enumerate() {
        let Some(mut p) = pending.remove(&name) else {
            continue;
        };
        // The global shape of a sharded tensor: the far corner of its chunks (what torch's HF
        // reader computes).
        let ndim = p.chunks[0].0.ndim();
        p.shape = vec![0; ndim];
        for (region, _, file) in &p.chunks {
            if region.ndim() != ndim {
                return Err(MetadataError::Invalid {
                    what: format!(
                        "{prefix}: tensor {name} has {ndim} dimensions in {} but {} in {file}",
                        p.chunks[0].2,
                        region.ndim()
                    ),
                });
            }
            for d in 0..ndim {
                p.shape[d] = p.shape[d].max(region.offsets[d].saturating_add(region.lengths[d]));
            }
        }
        for (region, bytes, _) in p.chunks {
            chunks.push(SavedChunk {
                tensor: t as u32,
                region,
                bytes,
                crc32c: None,
                crc32: None,
            });
        }
        tensors.push(TensorMeta::new(name, p.dtype, p.shape));
    }
    let data_files = files
        .iter()
        .map(|f| DataFile {
            path: f.path.clone(),
            size: Some(f.size),
            encoded: None,
        })
        .collect();
    let meta = CheckpointMeta::new(tensors, chunks, Vec::new(), data_files)?;
    validate(&meta)?;
    Ok(meta)
}
