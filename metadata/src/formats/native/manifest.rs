//! `manifest.json`: the small JSON file whose presence makes a directory a committed checkpoint.
//! It names every data file with its size and carries the checksums of the two metadata files, so
//! a reader trusts nothing it has not checked against the manifest.

use std::time::{SystemTime, UNIX_EPOCH};

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};

use super::{FORMAT_NAME, FORMAT_VERSION, MANIFEST_FILE, store_error};
use crate::MetadataError;

/// A manifest larger than this is refused unread: even 10^5 data files stay far below it.
const MAX_MANIFEST_BYTES: u64 = 64 * 1024 * 1024;

/// Whether a checkpoint's data files were written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DataPresence {
    /// Data files are there.
    Present,
    /// Metadata-only checkpoint: the metadata says where bytes would lie, but no data file exists.
    Absent,
}

/// When the checkpoint was committed: an RFC 3339 UTC timestamp (what tessera writes) or Unix
/// seconds (accepted when reading).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Created {
    /// E.g. `2025-01-31T12:00:00Z`.
    Rfc3339(String),
    /// Seconds since the Unix epoch.
    UnixSeconds(u64),
}

impl Created {
    /// The current time as an RFC 3339 UTC timestamp with second precision.
    pub fn now() -> Self {
        let secs = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Created::Rfc3339(rfc3339_utc(secs))
    }

    /// The instant `secs` after the Unix epoch as an RFC 3339 UTC timestamp (what a listing
    /// shows a file's time as, next to the manifests' times).
    pub fn at_unix_seconds(secs: u64) -> Self {
        Created::Rfc3339(rfc3339_utc(secs))
    }
}

/// Formats Unix seconds as `YYYY-MM-DDTHH:MM:SSZ` (civil-from-days, proleptic Gregorian).
fn rfc3339_utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (h, m, s) = (rem / 3600, rem % 3600 / 60, rem % 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}Z")
}

/// A data file as the manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestFile {
    /// Path relative to the checkpoint root.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
}

/// A metadata file (metadata or checksums) with its size and crc32c.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestBlob {
    /// Path relative to the checkpoint root.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// crc32c of the whole file.
    pub crc32c: u32,
}

/// The manifest of a native checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Always `"tessera"`.
    pub format: String,
    /// Format version, [`FORMAT_VERSION`].
    pub format_version: u32,
    /// Training step, when known.
    pub step: Option<u64>,
    /// Commit time.
    pub created: Created,
    /// The layout the checkpoint was saved with (layout JSON), when known.
    pub source_layout: Option<serde_json::Value>,
    /// Whether the data files exist.
    pub data: DataPresence,
    /// Block size of the block checksums.
    pub block_size: u64,
    /// Every data file with its size.
    pub files: Vec<ManifestFile>,
    /// `metadata.arrow`.
    pub metadata: ManifestBlob,
    /// `checksums.arrow`; absent for a metadata-only checkpoint.
    pub checksums: Option<ManifestBlob>,
    /// Number of tensors.
    pub tensors: u64,
    /// Number of saved boxes.
    pub chunks: u64,
    /// Number of non-tensor objects.
    pub objects: u64,
    /// Bytes of all tensors, each element counted once.
    pub tensor_bytes: u64,
}

impl Manifest {
    /// Parses manifest JSON and checks format, version and block size. `path_for_errors` names the
    /// file in errors.
    pub fn from_json(bytes: &[u8], path_for_errors: &str) -> Result<Self, MetadataError> {
        let manifest: Manifest =
            serde_json::from_slice(bytes).map_err(|e| MetadataError::Decode {
                path: path_for_errors.to_string(),
                what: "manifest",
                detail: e.to_string(),
            })?;
        let invalid = |detail: String| MetadataError::Decode {
            path: path_for_errors.to_string(),
            what: "manifest",
            detail,
        };
        if manifest.format != FORMAT_NAME {
            return Err(invalid(format!(
                "format {:?}, expected {FORMAT_NAME:?}",
                manifest.format
            )));
        }
        if manifest.format_version != FORMAT_VERSION {
            return Err(invalid(format!(
                "format version {}, this reader knows {FORMAT_VERSION}",
                manifest.format_version
            )));
        }
        if manifest.block_size == 0 {
            return Err(invalid("block size 0".to_string()));
        }
        if manifest.data == DataPresence::Present && manifest.checksums.is_none() {
            return Err(invalid(
                "data is present but no checksums file is listed".to_string(),
            ));
        }
        Ok(manifest)
    }

    /// Pretty JSON, as written to storage.
    pub fn to_json(&self) -> Result<Vec<u8>, MetadataError> {
        serde_json::to_vec_pretty(self).map_err(|e| MetadataError::Invalid {
            what: format!("cannot encode the manifest: {e}"),
        })
    }

    /// Size of the data file at `path`, if the manifest lists it.
    pub fn file_size(&self, path: &str) -> Option<u64> {
        self.files.iter().find(|f| f.path == path).map(|f| f.size)
    }
}

/// Reads and checks the manifest of the checkpoint at `prefix`. A prefix without one is
/// [`MetadataError::MissingManifest`]: not a committed checkpoint.
pub async fn read_manifest(
    store: &dyn ObjectStore,
    prefix: &Path,
) -> Result<Manifest, MetadataError> {
    Ok(read_manifest_identified(store, prefix).await?.0)
}

/// [`read_manifest`], also returning the checkpoint's identity
/// ([`native_identity`](crate::native_identity) of the manifest bytes as read).
pub async fn read_manifest_identified(
    store: &dyn ObjectStore,
    prefix: &Path,
) -> Result<(Manifest, String), MetadataError> {
    let path = prefix.clone().join(MANIFEST_FILE);
    let result = match store.get(&path).await {
        Ok(result) => result,
        Err(object_store::Error::NotFound { .. }) => {
            return Err(MetadataError::MissingManifest {
                path: prefix.to_string(),
            });
        }
        Err(e) => return Err(store_error("reading", &path)(e)),
    };
    if result.meta.size > MAX_MANIFEST_BYTES {
        return Err(MetadataError::Decode {
            path: path.to_string(),
            what: "manifest",
            detail: format!(
                "{} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may have",
                result.meta.size
            ),
        });
    }
    let bytes = result
        .bytes()
        .await
        .map_err(store_error("reading", &path))?;
    let manifest = Manifest::from_json(&bytes, path.as_ref())?;
    Ok((manifest, crate::native_identity(&bytes)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rfc3339_of_known_instants() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339_utc(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339_utc(1_735_689_599), "2024-12-31T23:59:59Z");
    }
}
