//! The exclusive claim a writer takes on an output location before it writes any data.
//!
//! Two writers into one location interleave their data files and metadata, and whichever commits
//! last publishes a mix (the manifest is created exclusively, but the files before it are not).
//! So a writer first creates `<out>/.tessera-claim.json` with create-if-absent
//! (`PutMode::Create`: an exclusive hard link on local disk, a conditional PUT on S3, GCS and
//! Azure); the second writer's create fails at once and its error names the holder from the
//! claim's body (pid, host, start time, command). The claim is removed after the commit or the
//! failure.
//!
//! A writer killed with `kill -9` leaves its claim (and, on local disk, object_store's staging
//! files `<name>#<n>` of the uploads it had in flight). The claim is then stale: the next writer
//! is refused with a message saying so, and `--break-claim` (`ClaimOptions::break_existing`)
//! removes it and takes a new one. Whoever holds the claim also removes stale staging files under
//! the location, since no other writer can be uploading there.

use std::fmt;

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use tessera_metadata::formats::native::Created;
use tessera_storage::{Location, StorageError};

use crate::OpsError;

/// Name of the claim object inside the output location.
pub const CLAIM_FILE: &str = ".tessera-claim.json";

/// Who holds a claim: what its body records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimHolder {
    /// Process id of the writer.
    pub pid: u32,
    /// Host it runs on.
    pub host: String,
    /// When it took the claim.
    pub created: Created,
    /// What it was doing (`tessera convert`).
    pub command: String,
}

impl ClaimHolder {
    /// This process.
    pub fn this_process(command: &str) -> Self {
        ClaimHolder {
            pid: std::process::id(),
            host: host_name(),
            created: Created::now(),
            command: command.to_string(),
        }
    }
}

impl fmt::Display for ClaimHolder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let since = match &self.created {
            Created::Rfc3339(text) => text.clone(),
            Created::UnixSeconds(secs) => format!("{secs} (Unix seconds)"),
        };
        write!(
            f,
            "{} pid {} on host {} since {since}",
            self.command, self.pid, self.host
        )
    }
}

/// How to take a claim.
#[derive(Clone, Debug, Default)]
pub struct ClaimOptions {
    /// Remove an existing claim first (the `--break-claim` of a writer that is known to be dead).
    pub break_existing: bool,
    /// How the user of this front end breaks a stale claim, for the error of a refused claim
    /// (`rerun with --break-claim` when `None`, the CLI's flag): the Python save has a keyword
    /// argument instead.
    pub how_to_break: Option<String>,
}

/// A claim this process holds; [`Claim::release`] removes it.
#[derive(Debug)]
pub struct Claim {
    location: Location,
    path: Path,
    /// What the claim's body says.
    pub holder: ClaimHolder,
    /// The claim that was broken to take this one, if any.
    pub broke: Option<String>,
    /// Stale staging files removed (relative to the location), on local disk.
    pub removed_staged: Vec<String>,
}

impl Claim {
    /// Takes the claim on `location` for `command`: creates the claim object if absent, or fails
    /// with [`OpsError::Claimed`] naming the holder. Then removes stale staging uploads under the
    /// location (local disk).
    pub async fn take(
        location: &Location,
        command: &str,
        options: &ClaimOptions,
    ) -> Result<Claim, OpsError> {
        let path = location.prefix.clone().join(CLAIM_FILE);
        let store = location.store.as_ref();
        let mut broke = None;
        if options.break_existing {
            broke = match read_holder(store, &path).await {
                Ok(Some(holder)) => Some(holder),
                Ok(None) => None,
                Err(e) => return Err(e),
            };
            match store.delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(store_error("breaking the claim", &path, e)),
            }
        }
        let holder = ClaimHolder::this_process(command);
        let body = serde_json::to_vec_pretty(&holder).map_err(|source| OpsError::Message {
            what: "the write claim".to_string(),
            source,
        })?;
        let created = store
            .put_opts(
                &path,
                PutPayload::from(body),
                PutOptions::from(PutMode::Create),
            )
            .await;
        match created {
            Ok(_) => {}
            Err(object_store::Error::AlreadyExists { .. }) => {
                let holder = read_holder(store, &path)
                    .await
                    .ok()
                    .flatten()
                    .unwrap_or_else(|| "an unknown writer (the claim is unreadable)".to_string());
                return Err(OpsError::Claimed {
                    location: location.display.clone(),
                    claim: path.to_string(),
                    holder,
                    how_to_break: options
                        .how_to_break
                        .clone()
                        .unwrap_or_else(|| "rerun with --break-claim".to_string()),
                });
            }
            Err(e) => return Err(store_error("creating the claim", &path, e)),
        }
        let removed_staged = match tessera_storage::local_directory(&location.display) {
            // Not the claim's own staging files: another writer trying to take the claim right
            // now stages it there, and removing that file would fail its attempt with a
            // confusing error instead of "claimed".
            Some(dir) => tessera_storage::remove_staged_uploads(&dir, |relative| {
                !relative.starts_with(CLAIM_FILE)
            })?,
            None => Vec::new(),
        };
        Ok(Claim {
            location: location.clone(),
            path,
            holder,
            broke,
            removed_staged,
        })
    }

    /// The claim object's path in the store.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Removes the claim (after a commit or a failure). A claim already gone is fine.
    pub async fn release(self) -> Result<(), OpsError> {
        match self.location.store.delete(&self.path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(store_error("removing the claim", &self.path, e)),
        }
    }
}

/// The holder a claim's body names, as text; `None` when there is no claim.
async fn read_holder(store: &dyn ObjectStore, path: &Path) -> Result<Option<String>, OpsError> {
    let result = match store.get(path).await {
        Ok(result) => result,
        Err(object_store::Error::NotFound { .. }) => return Ok(None),
        Err(e) => return Err(store_error("reading the claim", path, e)),
    };
    let bytes = result
        .bytes()
        .await
        .map_err(|e| store_error("reading the claim", path, e))?;
    Ok(Some(match serde_json::from_slice::<ClaimHolder>(&bytes) {
        Ok(holder) => holder.to_string(),
        // Capped: the body is someone else's file.
        Err(_) => format!(
            "an unknown writer (the claim holds {:?})",
            String::from_utf8_lossy(&bytes[..bytes.len().min(200)])
        ),
    }))
}

fn store_error(action: &str, path: &Path, source: object_store::Error) -> OpsError {
    OpsError::Storage(StorageError::Store {
        action: action.to_string(),
        path: path.to_string(),
        source,
    })
}

/// The host name, for the claim body: the kernel's on Linux, `HOSTNAME` elsewhere. `tessera gc`
/// compares it with a claim's to tell whether it can check the holder's pid.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown".to_string())
}
