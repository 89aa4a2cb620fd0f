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

use bytes::Bytes;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use serde::{Deserialize, Serialize};
use tessera_metadata::formats::native::Created;
use tessera_storage::{Location, StorageError};

use crate::OpsError;

/// Name of the claim object inside the output location.
pub const CLAIM_FILE: &str = ".tessera-claim.json";

/// Creates of the claim tried when each one is refused by a claim that is gone by the time its
/// holder is read (see [`Claim::take`]).
const CREATE_ATTEMPTS: u32 = 3;

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
        let body = Bytes::from(serde_json::to_vec_pretty(&holder).map_err(|source| {
            OpsError::Message {
                what: "the write claim".to_string(),
                source,
            }
        })?);
        let mut attempt = 1;
        loop {
            let created = store
                .put_opts(
                    &path,
                    PutPayload::from(body.clone()),
                    PutOptions::from(PutMode::Create),
                )
                .await;
            match created {
                Ok(_) => break,
                Err(object_store::Error::AlreadyExists { .. }) => {
                    let holder = match read_holder(store, &path).await {
                        Ok(Some(holder)) => holder,
                        // The holder released its claim between the refused create and this
                        // read (it committed or failed: a round trip on an object store, where
                        // two writers racing meet it): the location is free, so the create is
                        // tried again instead of naming a claim that is gone. A writer that
                        // comes after a commit then fails on the manifest it finds. Bounded:
                        // writers taking and releasing claims there nonstop would never end it.
                        Ok(None) if attempt < CREATE_ATTEMPTS => {
                            attempt += 1;
                            continue;
                        }
                        Ok(None) => format!(
                            "other writers (their claims came and went {CREATE_ATTEMPTS} times while this one tried to take it)"
                        ),
                        Err(_) => "an unknown writer (the claim is unreadable)".to_string(),
                    };
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

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use object_store::memory::InMemory;
    use tessera_storage::testing::HookedStore;

    use super::*;

    /// A location in `store` at `out`.
    fn location(store: Arc<dyn ObjectStore>, out: &str) -> Location {
        Location {
            store,
            prefix: Path::from(out),
            display: format!("memory:///{out}"),
            local_root: None,
            shared_files: Default::default(),
        }
    }

    /// Two writers racing on an object store: this one's create is refused by the other's
    /// claim, which the other releases (it committed) before this one reads who holds it. The
    /// claim was free by then, so this writer takes it rather than failing on "an unknown
    /// writer (the claim is unreadable)", a claim that no longer existed (moto, issue 44).
    #[tokio::test]
    async fn a_claim_released_between_the_refusal_and_the_read_is_taken() {
        let inner: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let refusals = Arc::new(AtomicU32::new(0));
        let seen = Arc::clone(&refusals);
        // The other writer's claim exists at the first create and is gone right after: the hook
        // answers that create as the store would have, then lets the next one through.
        let hooked = HookedStore::new(Arc::clone(&inner), move |path| {
            let first =
                path.filename() == Some(CLAIM_FILE) && seen.fetch_add(1, Ordering::SeqCst) == 0;
            Box::pin(async move {
                if first {
                    Err(object_store::Error::AlreadyExists {
                        path: CLAIM_FILE.to_string(),
                        source: "held by the other writer".into(),
                    })
                } else {
                    Ok(())
                }
            })
        });
        let at = location(Arc::new(hooked), "run/step-1");
        let claim = Claim::take(&at, "tessera.save", &ClaimOptions::default())
            .await
            .unwrap();
        assert_eq!(
            refusals.load(Ordering::SeqCst),
            2,
            "refused once, then created"
        );
        let body = inner
            .get(claim.path())
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        let holder: ClaimHolder = serde_json::from_slice(&body).unwrap();
        assert_eq!(holder, claim.holder);
        claim.release().await.unwrap();
    }

    /// A claim that stays refused but is never there to read (writers taking and releasing it
    /// nonstop) ends after a bounded number of creates, saying so.
    #[tokio::test]
    async fn claims_that_keep_coming_and_going_end_the_attempts() {
        let inner: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
        let hooked = HookedStore::new(inner, |path| {
            let claim = path.filename() == Some(CLAIM_FILE);
            Box::pin(async move {
                if claim {
                    Err(object_store::Error::AlreadyExists {
                        path: CLAIM_FILE.to_string(),
                        source: "held by another writer".into(),
                    })
                } else {
                    Ok(())
                }
            })
        });
        let at = location(Arc::new(hooked), "run/step-1");
        let error = Claim::take(&at, "tessera.save", &ClaimOptions::default())
            .await
            .unwrap_err();
        let text = error.to_string();
        assert!(
            text.contains("their claims came and went 3 times"),
            "{text}"
        );
    }
}
