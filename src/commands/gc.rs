//! `tessera gc ROOT`: removes what failed or killed saves left under a storage root: a local
//! directory, or a prefix of an object store (`s3://`, `gs://`, `az://`).
//!
//! A save that fails commits nothing, and one killed mid-write (`kill -9`, a lost host) also
//! leaves its data files, its write claim and, on local disk, object_store's staging files
//! (`<name>#<n>`, hidden from the store's own listings). None of it is ever visible as a
//! checkpoint (no `manifest.json`), but it takes space forever. A *leftover* is a directory
//! without `manifest.json` that holds a write claim (`.tessera-claim.json`), native metadata
//! (`metadata.arrow`, `checksums.arrow`) or native data files (`data/*.bin`, `data/*.bin#<n>`).
//! Committed checkpoints and foreign-format directories (DCP, safetensors without a claim) are
//! never touched, and gc does not descend into them.
//!
//! An object store has no directories: its root is listed once and the keys are grouped at their
//! `/` into the directories a local root would have, then the same rules apply. (A killed
//! writer's unfinished multipart uploads are not objects and no listing shows them; the store's
//! own lifecycle rules, such as S3's AbortIncompleteMultipartUpload, remove those.)
//!
//! A leftover whose claim is held by a live writer is a save in progress and is kept: a claim
//! names the holder's pid and host, so one from this host whose process is gone (or a zombie) is
//! stale; one from another host cannot be checked from here and is kept too. `--break-claims`
//! removes those anyway (only when their writers are surely gone, as for `--break-claim`).

use std::collections::BTreeSet;
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use futures::TryStreamExt;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::Serialize;
use tessera_metadata::formats::native::MANIFEST_FILE;
use tessera_ops::claim::{CLAIM_FILE, ClaimHolder, host_name};
use tessera_storage::{RetryPolicy, RetryingStore};

use crate::human;

/// What gc does: `dry_run` lists without removing; `break_claims` removes leftovers whose claim
/// may still be held.
#[derive(Clone, Debug, Default)]
pub struct GcOptions {
    /// List what would be removed, remove nothing.
    pub dry_run: bool,
    /// Remove leftovers whose claim names a live writer or a writer on another host.
    pub break_claims: bool,
}

/// One leftover directory.
#[derive(Clone, Debug, Serialize)]
pub struct Leftover {
    /// Its path, relative to the root (`.` for the root itself).
    pub path: String,
    /// Files under it.
    pub files: u64,
    /// Their bytes.
    pub bytes: u64,
    /// The claim's holder, as its body says, if it has a claim.
    pub holder: Option<String>,
    /// Why it is removed or kept.
    pub reason: String,
}

/// What gc found and did.
#[derive(Clone, Debug, Serialize)]
pub struct GcReport {
    /// The root as given.
    pub root: String,
    /// Nothing was removed, only listed.
    pub dry_run: bool,
    /// Removed (or, with `dry_run`, to be removed).
    pub removed: Vec<Leftover>,
    /// Kept: a live (or unverifiable) writer holds their claim.
    pub kept: Vec<Leftover>,
    /// Bytes of the removed leftovers.
    pub bytes_removed: u64,
}

/// Whether the writer a claim names may still be writing.
enum ClaimState {
    /// No claim: the save failed and released it, or never took one.
    None,
    /// Its process is gone: `reason`.
    Stale { holder: String, reason: String },
    /// It may be running: `reason`.
    Held { holder: String, reason: String },
}

/// Scans `root` (a local directory or an object-store prefix) and removes leftovers of failed
/// saves.
pub fn run(root: &str, options: &GcOptions) -> Result<GcReport> {
    let Some(dir) = tessera_storage::local_directory(root) else {
        // gc is not called inside the command's runtime (a local root needs none).
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .context("starting the runtime for gc's storage requests")?;
        return runtime.block_on(run_store(root, options));
    };
    let meta =
        std::fs::symlink_metadata(&dir).with_context(|| format!("reading {}", dir.display()))?;
    if !meta.is_dir() {
        bail!("{} is not a directory", dir.display());
    }
    let mut leftovers = Vec::new();
    find_leftovers(&dir, &mut leftovers)?;
    let this_host = host_name();
    let mut report = GcReport {
        root: root.to_string(),
        dry_run: options.dry_run,
        removed: Vec::new(),
        kept: Vec::new(),
        bytes_removed: 0,
    };
    for path in leftovers {
        let (files, bytes) = usage(&path)?;
        let relative = match path.strip_prefix(&dir) {
            Ok(r) if r.as_os_str().is_empty() => ".".to_string(),
            Ok(r) => r.display().to_string(),
            Err(_) => path.display().to_string(),
        };
        let claim = path.join(CLAIM_FILE);
        let body = std::fs::read(&claim).ok();
        let state = claim_state(body.as_deref(), &claim.display().to_string(), &this_host);
        let (entry, keep) = leftover(relative, files, bytes, state, options);
        if keep {
            report.kept.push(entry);
            continue;
        }
        if !options.dry_run {
            std::fs::remove_dir_all(&path)
                .with_context(|| format!("removing the leftover save {}", path.display()))?;
        }
        report.bytes_removed += bytes;
        report.removed.push(entry);
    }
    Ok(report)
}

/// Collects the leftover directories at or under `dir`, not descending into committed
/// checkpoints or leftovers.
fn find_leftovers(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if dir.join(MANIFEST_FILE).exists() {
        return Ok(());
    }
    if is_leftover(dir)? {
        out.push(dir.to_path_buf());
        return Ok(());
    }
    let mut children: Vec<PathBuf> = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
        // Symlinks are not followed: gc removes what is under the root, nothing it points to.
        if entry
            .file_type()
            .with_context(|| format!("reading {}", entry.path().display()))?
            .is_dir()
        {
            children.push(entry.path());
        }
    }
    children.sort();
    for child in children {
        find_leftovers(&child, out)?;
    }
    Ok(())
}

/// Whether `dir` (without a manifest) holds what only a native save writes.
fn is_leftover(dir: &Path) -> Result<bool> {
    if dir.join(CLAIM_FILE).exists()
        || dir.join("metadata.arrow").exists()
        || dir.join("checksums.arrow").exists()
    {
        return Ok(true);
    }
    let data = dir.join("data");
    if !data.is_dir() {
        return Ok(false);
    }
    for entry in std::fs::read_dir(&data).with_context(|| format!("listing {}", data.display()))? {
        let name = entry
            .with_context(|| format!("listing {}", data.display()))?
            .file_name();
        let name = name.to_string_lossy();
        let base = name.rsplit_once('#').map_or(&*name, |(base, _)| base);
        if base.ends_with(".bin") {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Files and bytes under `dir`.
fn usage(dir: &Path) -> Result<(u64, u64)> {
    let (mut files, mut bytes) = (0, 0);
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let entry = entry.with_context(|| format!("listing {}", dir.display()))?;
        let meta = entry
            .metadata()
            .with_context(|| format!("reading {}", entry.path().display()))?;
        if meta.is_dir() {
            let (f, b) = usage(&entry.path())?;
            files += f;
            bytes += b;
        } else {
            files += 1;
            bytes += meta.len();
        }
    }
    Ok((files, bytes))
}

/// The report entry of a leftover and whether it is kept, from the state of its claim.
fn leftover(
    path: String,
    files: u64,
    bytes: u64,
    state: ClaimState,
    options: &GcOptions,
) -> (Leftover, bool) {
    let (holder, reason, keep) = match state {
        ClaimState::None => (
            None,
            "no manifest and no write claim: a failed save".to_string(),
            false,
        ),
        ClaimState::Stale { holder, reason } => (Some(holder), reason, false),
        ClaimState::Held { holder, reason } if options.break_claims => (
            Some(holder),
            format!("{reason}; removed anyway (--break-claims)"),
            false,
        ),
        ClaimState::Held { holder, reason } => (
            Some(holder),
            format!("{reason}; --break-claims removes it once that writer is surely gone"),
            true,
        ),
    };
    let entry = Leftover {
        path,
        files,
        bytes,
        holder,
        reason,
    };
    (entry, keep)
}

/// `run` on an object-store root: one listing, grouped into directories at the keys' `/`.
async fn run_store(root: &str, options: &GcOptions) -> Result<GcReport> {
    let retry = RetryPolicy::default();
    // `create_with`: it refuses the read-only http(s):// stores before anything is listed.
    let location = tessera_storage::create_with(root, &super::storage_options(&retry))?;
    let store: Arc<dyn ObjectStore> = Arc::new(RetryingStore::new(location.store, retry));
    let objects: Vec<object_store::ObjectMeta> = store
        .list(Some(&location.prefix))
        .try_collect()
        .await
        .with_context(|| format!("listing {root}"))?;
    // Every object as (its key relative to the root, its size, its key).
    let mut files: Vec<(String, u64, object_store::path::Path)> = Vec::new();
    for object in objects {
        let Some(parts) = object.location.prefix_match(&location.prefix) else {
            continue;
        };
        let relative = parts
            .map(|part| part.as_ref().to_string())
            .collect::<Vec<_>>()
            .join("/");
        files.push((relative, object.size, object.location));
    }
    let (committed, marked) = store_directories(files.iter().map(|(key, ..)| key.as_str()));
    let this_host = host_name();
    let mut report = GcReport {
        root: root.to_string(),
        dry_run: options.dry_run,
        removed: Vec::new(),
        kept: Vec::new(),
        bytes_removed: 0,
    };
    for dir in &marked {
        let inside: Vec<&(String, u64, object_store::path::Path)> = files
            .iter()
            .filter(|(key, ..)| dir.is_empty() || key.starts_with(&format!("{dir}/")))
            .collect();
        // A leftover inside a committed checkpoint or inside another leftover is not one of its
        // own (a local root is not descended into there either).
        if ancestors(dir).any(|a| committed.contains(a))
            || ancestors(dir).any(|a| a.len() < dir.len() && marked.contains(a))
        {
            continue;
        }
        let claim_key = if dir.is_empty() {
            CLAIM_FILE.to_string()
        } else {
            format!("{dir}/{CLAIM_FILE}")
        };
        let body = match inside.iter().find(|(key, ..)| *key == claim_key) {
            None => None,
            Some((_, _, path)) => match store.get(path).await {
                Ok(got) => Some(
                    got.bytes()
                        .await
                        .with_context(|| format!("reading {path}"))?,
                ),
                // Released since the listing: the writer finished or failed.
                Err(object_store::Error::NotFound { .. }) => None,
                Err(e) => return Err(e).with_context(|| format!("reading {path}")),
            },
        };
        let shown = format!("{}/{claim_key}", root.trim_end_matches('/'));
        let state = claim_state(body.as_deref(), &shown, &this_host);
        let relative = if dir.is_empty() { "." } else { dir.as_str() };
        let bytes = inside.iter().map(|(_, size, _)| size).sum();
        let (entry, keep) = leftover(
            relative.to_string(),
            inside.len() as u64,
            bytes,
            state,
            options,
        );
        if keep {
            report.kept.push(entry);
            continue;
        }
        if !options.dry_run {
            // The claim last: no other writer can take the location while its files go.
            let mut order = inside.clone();
            order.sort_by_key(|(key, ..)| *key == claim_key);
            for (_, _, path) in order {
                match store.delete(path).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                    Err(e) => {
                        return Err(e)
                            .with_context(|| format!("removing the leftover save {root}/{dir}"));
                    }
                }
            }
        }
        report.bytes_removed += bytes;
        report.removed.push(entry);
    }
    Ok(report)
}

/// The directories (`""` for the root) of an object-store root's keys that hold a committed
/// checkpoint, and those that hold what only a native save writes ([`is_leftover`]'s rule).
fn store_directories<'a>(
    keys: impl Iterator<Item = &'a str>,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let (mut committed, mut marked) = (BTreeSet::new(), BTreeSet::new());
    for key in keys {
        let (dir, name) = key.rsplit_once('/').unwrap_or(("", key));
        if name == MANIFEST_FILE {
            committed.insert(dir.to_string());
        } else if name == CLAIM_FILE || name == "metadata.arrow" || name == "checksums.arrow" {
            marked.insert(dir.to_string());
        } else if let Some(parent) = (dir == "data")
            .then_some("")
            .or_else(|| dir.strip_suffix("/data"))
        {
            let base = name.rsplit_once('#').map_or(name, |(base, _)| base);
            if base.ends_with(".bin") {
                marked.insert(parent.to_string());
            }
        }
    }
    (committed, marked)
}

/// `dir` and every directory above it up to the root (`""`).
fn ancestors(dir: &str) -> impl Iterator<Item = &str> {
    std::iter::once("")
        .chain(dir.match_indices('/').map(move |(at, _)| &dir[..at]))
        .chain((!dir.is_empty()).then_some(dir))
}

/// The state of a leftover's claim from its body (`None`: there is none); `shown` names the
/// claim in messages.
fn claim_state(body: Option<&[u8]>, shown: &str, this_host: &str) -> ClaimState {
    let Some(body) = body else {
        return ClaimState::None;
    };
    let Ok(holder) = serde_json::from_slice::<ClaimHolder>(body) else {
        return ClaimState::Held {
            holder: "an unknown writer".to_string(),
            reason: format!("its claim {shown} is unreadable"),
        };
    };
    let text = holder.to_string();
    if holder.host != this_host {
        return ClaimState::Held {
            holder: text,
            reason: format!(
                "its claim is held by a writer on host {}, which gc on {this_host} cannot check",
                holder.host
            ),
        };
    }
    match process_alive(holder.pid) {
        Some(false) => ClaimState::Stale {
            holder: text,
            reason: format!(
                "its claim is stale: pid {} is not running on this host",
                holder.pid
            ),
        },
        Some(true) => ClaimState::Held {
            holder: text,
            reason: format!("a live writer holds its claim (pid {} runs)", holder.pid),
        },
        None => ClaimState::Held {
            holder: text,
            reason: "its writer's process cannot be checked on this system".to_string(),
        },
    }
}

/// Whether process `pid` runs on this host (a zombie does not: it writes nothing more); `None`
/// where there is no `/proc` to tell.
fn process_alive(pid: u32) -> Option<bool> {
    if !Path::new("/proc/self").exists() {
        return None;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state is the first field after the parenthesized command name.
        Ok(stat) => Some(
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next())
                .is_none_or(|state| state != "Z" && state != "X"),
        ),
        Err(_) => Some(false),
    }
}

/// The text report: one line per leftover, then a summary.
pub fn text_report(report: &GcReport) -> String {
    let mut out = String::new();
    let verb = if report.dry_run {
        "would remove"
    } else {
        "removed"
    };
    for l in &report.removed {
        let _ = writeln!(
            out,
            "{verb} {}: {} files, {} ({})",
            l.path,
            l.files,
            human::bytes(l.bytes),
            l.reason
        );
    }
    for l in &report.kept {
        let _ = writeln!(
            out,
            "kept {}: {} files, {} ({})",
            l.path,
            l.files,
            human::bytes(l.bytes),
            l.reason
        );
    }
    let _ = writeln!(
        out,
        "gc {}: {verb} {} leftover save(s), {}; kept {}",
        report.root,
        report.removed.len(),
        human::bytes(report.bytes_removed),
        report.kept.len()
    );
    out
}

/// The `--json` document.
pub fn json_report(report: &GcReport) -> Result<String> {
    Ok(serde_json::to_string_pretty(report).context("encoding the gc report")? + "\n")
}

/// `tessera gc DIR --memory-tier`: prunes a node's memory tier to the newest `keep` copies and
/// at most `max_bytes` ([`tessera_ops::memory_tier::prune`]).
pub fn prune_memory_tier(
    root: &str,
    keep: usize,
    max_bytes: Option<u64>,
    dry_run: bool,
) -> Result<tessera_ops::memory_tier::Pruned> {
    if keep == 0 {
        bail!("--keep 0: a memory tier keeps at least its newest checkpoint");
    }
    let dir = Path::new(root.strip_prefix("file://").unwrap_or(root));
    if !dir.is_dir() {
        bail!("{root}: no such directory (a memory tier is a local directory)");
    }
    Ok(tessera_ops::memory_tier::prune(
        dir, keep, max_bytes, None, dry_run,
    )?)
}

/// The text report of [`prune_memory_tier`].
pub fn memory_tier_text(
    root: &str,
    pruned: &tessera_ops::memory_tier::Pruned,
    dry_run: bool,
) -> String {
    let mut out = String::new();
    let verb = if dry_run { "would remove" } else { "removed" };
    for path in &pruned.removed {
        let _ = writeln!(out, "{verb} {}", path.display());
    }
    let _ = writeln!(
        out,
        "memory tier {root}: {verb} {} copies ({}), kept {} ({})",
        pruned.removed.len(),
        human::bytes(pruned.bytes),
        pruned.kept.len(),
        human::bytes(pruned.kept_bytes)
    );
    out
}
