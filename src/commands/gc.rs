//! `tessera gc ROOT`: removes what failed or killed saves left under a local storage root.
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
//! A leftover whose claim is held by a live writer is a save in progress and is kept: a claim
//! names the holder's pid and host, so one from this host whose process is gone (or a zombie) is
//! stale; one from another host cannot be checked from here and is kept too. `--break-claims`
//! removes those anyway (only when their writers are surely gone, as for `--break-claim`).

use std::fmt::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use serde::Serialize;
use tessera_ops::claim::{CLAIM_FILE, ClaimHolder, host_name};

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

/// Scans `root` (a local directory) and removes leftovers of failed saves.
pub fn run(root: &str, options: &GcOptions) -> Result<GcReport> {
    let Some(dir) = tessera_storage::local_directory(root) else {
        bail!(
            "tessera gc works on local directories (a path or file:// URL), not {root}: on an object store, list the prefixes without manifest.json and delete them with the store's own tools"
        );
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
        let (holder, reason, keep) = match claim_state(&path, &this_host) {
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
            path: relative,
            files,
            bytes,
            holder,
            reason,
        };
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
    if dir
        .join(tessera_metadata::formats::native::MANIFEST_FILE)
        .exists()
    {
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

fn claim_state(dir: &Path, this_host: &str) -> ClaimState {
    let path = dir.join(CLAIM_FILE);
    let Ok(body) = std::fs::read(&path) else {
        return ClaimState::None;
    };
    let Ok(holder) = serde_json::from_slice::<ClaimHolder>(&body) else {
        return ClaimState::Held {
            holder: "an unknown writer".to_string(),
            reason: format!("its claim {} is unreadable", path.display()),
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
