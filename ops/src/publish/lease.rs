//! Consumers' leases on a live step: a load's claim that it reads the step, which keeps the
//! publisher from retiring it meanwhile. Written and read only here, for every front end (the
//! CLI's `tessera load live://`, Python's `tessera.load` and the publisher's retire decision):
//!
//! ```text
//! <step>/leases/<host>-<pid>-<16 hex>.json   {"taken": T, "until": U, "pid": P}   (unix seconds)
//! ```
//!
//! A lease is written atomically (a temporary file renamed) before the load opens the step and
//! removed when the load ends, however it ends ([`Lease`] removes it on drop). A lease counts
//! until its `until` and never longer than [`MAX_LEASE_SECONDS`] after it was taken: a consumer
//! that died holding one costs the publisher that much memory time, no more.

use std::hash::BuildHasher;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::OpsError;

/// The folder of a step's leases.
pub const LEASES_DIR: &str = "leases";
/// The longest a lease keeps a superseded step served, whatever its deadline says.
pub const MAX_LEASE_SECONDS: f64 = 900.0;

/// A lease file's contents.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct LeaseFile {
    /// When it was taken (unix seconds).
    taken: f64,
    /// Its deadline (unix seconds).
    until: f64,
    /// The consumer's process.
    pid: u32,
}

/// A lease held by this process on one step; removed on [`Lease::release`] or drop.
#[derive(Debug)]
pub struct Lease {
    path: Option<PathBuf>,
}

impl Lease {
    /// Takes a lease on the step in `step_dir` for `seconds` (capped at [`MAX_LEASE_SECONDS`]).
    /// An error names the lease file: a registry this consumer may only read cannot hold one.
    pub fn take(step_dir: &Path, seconds: f64) -> Result<Lease, OpsError> {
        let now = unix_seconds();
        let pid = std::process::id();
        let nonce = std::hash::RandomState::new().hash_one((pid, now.to_bits(), step_dir));
        let dir = step_dir.join(LEASES_DIR);
        let path = dir.join(format!("{}-{pid}-{nonce:016x}.json", host_name()));
        let failed = |what: &str, e: std::io::Error| {
            OpsError::invalid(format!(
                "no lease on {} ({what} {}: {e})",
                step_dir.display(),
                path.display()
            ))
        };
        let lease = LeaseFile {
            taken: now,
            until: now + seconds.clamp(0.0, MAX_LEASE_SECONDS),
            pid,
        };
        std::fs::create_dir_all(&dir).map_err(|e| failed("creating the folder of", e))?;
        let temp = path.with_extension("json.tmp");
        let text = serde_json::to_vec(&lease).map_err(|source| OpsError::Message {
            what: "a lease".to_string(),
            source,
        })?;
        std::fs::write(&temp, text).map_err(|e| failed("writing", e))?;
        if let Err(e) = std::fs::rename(&temp, &path) {
            let _ = std::fs::remove_file(&temp);
            return Err(failed("renaming into", e));
        }
        Ok(Lease { path: Some(path) })
    }

    /// The lease file.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Removes the lease file (one already gone is fine: a cleaner took an expired lease).
    pub fn release(mut self) -> Result<(), OpsError> {
        match self.path.take().map(std::fs::remove_file) {
            Some(Err(e)) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(OpsError::invalid(format!("releasing the lease: {e}")))
            }
            _ => Ok(()),
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if let Some(path) = self.path.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Whether some consumer's lease on the step in `step_dir` still runs at `now` (unix seconds).
/// Files that are not leases, or do not parse, do not count.
pub fn step_leased(step_dir: &Path, now: f64) -> bool {
    lease_paths(step_dir).any(|path| {
        std::fs::read(path)
            .ok()
            .and_then(|bytes| serde_json::from_slice::<LeaseFile>(&bytes).ok())
            .is_some_and(|l| now < l.until.min(l.taken + MAX_LEASE_SECONDS))
    })
}

/// Lease files (running or not) on the step in `step_dir`.
pub fn lease_files(step_dir: &Path) -> u64 {
    lease_paths(step_dir).count() as u64
}

/// The lease files (`*.json`) in the step's leases folder; none when it has none.
fn lease_paths(step_dir: &Path) -> impl Iterator<Item = PathBuf> {
    std::fs::read_dir(step_dir.join(LEASES_DIR))
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.ends_with(".json")))
        .map(|e| e.path())
}

/// Now, in unix seconds.
pub fn unix_seconds() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This host's name, for lease file names (who holds a lease, when a person looks).
fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|name| {
            name.trim()
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'))
                .collect::<String>()
        })
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "host".to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn write_lease(step: &Path, name: &str, taken: f64, until: f64) {
        std::fs::create_dir_all(step.join(LEASES_DIR)).unwrap();
        let text = serde_json::to_vec(&LeaseFile {
            taken,
            until,
            pid: 1,
        })
        .unwrap();
        std::fs::write(step.join(LEASES_DIR).join(name), text).unwrap();
    }

    #[test]
    fn a_lease_holds_the_step_until_released_or_dropped() {
        let step = tempfile::tempdir().unwrap();
        assert!(!step_leased(step.path(), unix_seconds()));
        let lease = Lease::take(step.path(), 60.0).unwrap();
        let path = lease.path().unwrap().to_path_buf();
        assert!(path.starts_with(step.path().join(LEASES_DIR)), "{path:?}");
        let written: LeaseFile = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(written.pid, std::process::id());
        assert!(
            (written.until - written.taken - 60.0).abs() < 1e-6,
            "{written:?}"
        );
        assert!(step_leased(step.path(), unix_seconds()));
        assert!(!step_leased(step.path(), written.taken + 61.0));
        assert_eq!(lease_files(step.path()), 1);
        lease.release().unwrap();
        assert!(!path.exists());
        assert!(!step_leased(step.path(), unix_seconds()));

        let dropped = Lease::take(step.path(), 60.0).unwrap();
        let path = dropped.path().unwrap().to_path_buf();
        drop(dropped);
        assert!(!path.exists(), "a dropped lease is removed");
        assert_eq!(lease_files(step.path()), 0);
    }

    #[test]
    fn a_lease_counts_at_most_the_cap_and_bad_files_never_count() {
        let step = tempfile::tempdir().unwrap();
        let now = unix_seconds();
        // Taken long ago with a deadline far ahead: the cap ends it.
        write_lease(
            step.path(),
            "old.json",
            now - MAX_LEASE_SECONDS - 1.0,
            now + 3600.0,
        );
        std::fs::write(
            step.path().join(LEASES_DIR).join("torn.json"),
            b"{\"taken\":",
        )
        .unwrap();
        std::fs::write(step.path().join(LEASES_DIR).join("notes.txt"), b"x").unwrap();
        assert!(!step_leased(step.path(), now));
        assert_eq!(lease_files(step.path()), 2, "lease files, running or not");
        write_lease(step.path(), "new.json", now - 1.0, now + 30.0);
        assert!(step_leased(step.path(), now));
        // A longer lease than the cap is written capped.
        let long = Lease::take(step.path(), 1e9).unwrap();
        let written: LeaseFile =
            serde_json::from_slice(&std::fs::read(long.path().unwrap()).unwrap()).unwrap();
        assert!((written.until - written.taken - MAX_LEASE_SECONDS).abs() < 1e-6);
    }

    #[test]
    fn a_registry_that_cannot_hold_a_lease_is_named() {
        let dir = tempfile::tempdir().unwrap();
        // A file where the step's leases folder would go.
        std::fs::write(dir.path().join(LEASES_DIR), b"").unwrap();
        let err = Lease::take(dir.path(), 10.0).unwrap_err().to_string();
        assert!(
            err.contains(&format!("no lease on {}", dir.path().display()))
                && err.contains("creating the folder of"),
            "{err}"
        );
    }
}
