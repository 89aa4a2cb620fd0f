//! Opening a checkpoint in whatever format it is: tessera's native format, a PyTorch DCP
//! directory, or safetensors (a file, a directory, an HF index, DCP's HF writer). One listing of
//! the location tells them apart ([`open_any`]); every format ends as the same [`CheckpointMeta`].

pub mod bytecheckpoint;
pub mod dcp;
pub mod deepspeed;
pub mod native;
pub mod safetensors;
pub mod torch;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};
use serde::{Deserialize, Serialize};

use crate::{CheckpointMeta, MetadataError};
use dcp::{DcpDetails, DcpOptions};
use native::{BlockChecksums, DataPresence, Manifest, store_error};

pub use safetensors::{
    SafetensorsCheckpoint, SafetensorsDetails, SafetensorsFile, SafetensorsLayout,
};

/// The formats tessera reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// tessera's own (manifest, Arrow metadata, block checksums).
    Native,
    /// PyTorch Distributed Checkpoint (`.metadata` + `.distcp`).
    Dcp,
    /// safetensors files.
    Safetensors,
    /// DeepSpeed ZeRO checkpoints (`latest`, `global_stepN/*_states.pt`).
    #[serde(rename = "deepspeed")]
    DeepSpeed,
    /// ByteCheckpoint saves (`model/`, `optimizer/`, `extra_state/`; raw storage bytes).
    ByteCheckpoint,
}

impl Format {
    /// Lower-case name: `native`, `dcp`, `safetensors`, `deepspeed`, `bytecheckpoint`.
    pub fn name(self) -> &'static str {
        match self {
            Format::Native => "native",
            Format::Dcp => "dcp",
            Format::Safetensors => "safetensors",
            Format::DeepSpeed => "deepspeed",
            Format::ByteCheckpoint => "bytecheckpoint",
        }
    }
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The objects and folders directly under a prefix.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Listing {
    /// File name → size.
    pub files: BTreeMap<String, u64>,
    /// Folder names.
    pub dirs: BTreeSet<String>,
    /// File name → last modified, microseconds since the epoch, where the store says.
    pub modified: BTreeMap<String, i64>,
}

/// Lists what is directly under `prefix` (an absent prefix lists as empty).
pub async fn list_dir(store: &dyn ObjectStore, prefix: &Path) -> Result<Listing, MetadataError> {
    let result = match store.list_with_delimiter(Some(prefix)).await {
        Ok(result) => result,
        Err(object_store::Error::NotFound { .. }) => return Ok(Listing::default()),
        Err(e) => return Err(store_error("listing", prefix)(e)),
    };
    let mut listing = Listing::default();
    for object in result.objects {
        if let Some(name) = object.location.filename() {
            listing.files.insert(name.to_string(), object.size);
            listing
                .modified
                .insert(name.to_string(), object.last_modified.timestamp_micros());
        }
    }
    for dir in result.common_prefixes {
        if let Some(name) = dir.filename() {
            listing.dirs.insert(name.to_string());
        }
    }
    Ok(listing)
}

/// Options of [`open_any`].
#[derive(Clone, Debug)]
pub struct OpenOptions {
    /// Read a native checkpoint's block checksums (needed to verify loads; `inspect` and `plan`
    /// do without).
    pub block_checksums: bool,
    /// DCP index caching and limits.
    pub dcp: DcpOptions,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            block_checksums: true,
            dcp: DcpOptions::default(),
        }
    }
}

/// What is format-specific about an opened checkpoint.
#[derive(Clone, Debug)]
pub enum FormatDetails {
    /// tessera's native format.
    Native {
        /// Its manifest.
        manifest: Box<Manifest>,
    },
    /// PyTorch DCP.
    Dcp(Box<DcpDetails>),
    /// safetensors.
    Safetensors(Box<SafetensorsDetails>),
    /// DeepSpeed ZeRO.
    DeepSpeed(Box<deepspeed::DeepSpeedDetails>),
    /// ByteCheckpoint.
    ByteCheckpoint(Box<bytecheckpoint::BcDetails>),
}

/// The software that wrote a checkpoint, as far as its files tell: `PyTorch DCP`,
/// `Megatron-Core torch_dist`, `tessera`, … and its version when recorded.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Writer {
    /// Name of the writer.
    pub name: String,
    /// Its version (or the version of the format it wrote), when the files record one.
    pub version: Option<String>,
}

impl Writer {
    /// A writer with an optional version.
    pub fn new(name: impl Into<String>, version: Option<String>) -> Self {
        Writer {
            name: name.into(),
            version,
        }
    }
}

impl fmt::Display for Writer {
    /// `Megatron-Core torch_dist (version 1)`, or the bare name when no version is known.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.version {
            Some(version) => write!(f, "{} (version {version})", self.name),
            None => f.write_str(&self.name),
        }
    }
}

/// A checkpoint opened in whatever format it is in.
#[derive(Clone, Debug)]
pub struct OpenedCheckpoint {
    /// Its format.
    pub format: Format,
    /// The prefix its data file paths are relative to: the location itself, or for a single
    /// safetensors file, the folder holding it.
    pub root: Path,
    /// The checkpoint model.
    pub meta: CheckpointMeta,
    /// Training step, when known (native manifest; a `step-N`, `iter_N`, `global_stepN` or
    /// `checkpoint-N` directory name otherwise).
    pub step: Option<u64>,
    /// Whether the checkpoint is complete as far as the format can tell: a native manifest, a
    /// DCP `.metadata` (written last, by rename), safetensors headers that parse and index entries
    /// that resolve.
    pub committed: bool,
    /// Whether the data files are there (a native metadata-only checkpoint has none).
    pub has_data: bool,
    /// Block checksums of the data (native only; the other formats record none a partial read
    /// can be checked against, so their loads read unverified).
    pub block_checksums: Option<BlockChecksums>,
    /// Who wrote it, as far as the files tell.
    pub writer: Option<Writer>,
    /// Format-specific details.
    pub details: FormatDetails,
}

impl OpenedCheckpoint {
    /// What a person loading it should know that is not an error: files in its directory that
    /// are not part of it (an earlier save's, left behind). Front ends print them as warnings.
    pub fn warnings(&self) -> Vec<String> {
        match &self.details {
            FormatDetails::Safetensors(details) if !details.ignored.is_empty() => {
                let shown: Vec<&str> = details.ignored.iter().take(4).map(String::as_str).collect();
                let more = details.ignored.len() - shown.len();
                vec![format!(
                    "{}: ignored {} file(s) of an earlier DCP save into the same directory: {}{} (a save by W ranks writes shard-1..W; the newest save's files tile every tensor without these)",
                    self.root,
                    details.ignored.len(),
                    shown.join(", "),
                    if more > 0 {
                        format!(" and {more} more")
                    } else {
                        String::new()
                    }
                )]
            }
            _ => Vec::new(),
        }
    }

    /// The native manifest, for native checkpoints.
    pub fn manifest(&self) -> Option<&Manifest> {
        match &self.details {
            FormatDetails::Native { manifest } => Some(manifest),
            _ => None,
        }
    }

    /// The DCP details, for DCP checkpoints.
    pub fn dcp(&self) -> Option<&DcpDetails> {
        match &self.details {
            FormatDetails::Dcp(dcp) => Some(dcp),
            _ => None,
        }
    }

    /// The DeepSpeed details, for DeepSpeed checkpoints.
    pub fn deepspeed(&self) -> Option<&deepspeed::DeepSpeedDetails> {
        match &self.details {
            FormatDetails::DeepSpeed(ds) => Some(ds),
            _ => None,
        }
    }

    /// The ByteCheckpoint details, for ByteCheckpoint saves.
    pub fn bytecheckpoint(&self) -> Option<&bytecheckpoint::BcDetails> {
        match &self.details {
            FormatDetails::ByteCheckpoint(bc) => Some(bc),
            _ => None,
        }
    }

    /// The safetensors details, for safetensors checkpoints.
    pub fn safetensors(&self) -> Option<&SafetensorsDetails> {
        match &self.details {
            FormatDetails::Safetensors(st) => Some(st),
            _ => None,
        }
    }
}

/// The step in a checkpoint directory name: `step-100`, `step_100`, `iter_0000100` (Megatron),
/// `global_step100` (DeepSpeed), `checkpoint-100` (HF Trainer).
pub fn step_from_name(name: &str) -> Option<u64> {
    [
        "step-",
        "step_",
        "iter_",
        "global_step",
        "checkpoint-",
        "step",
    ]
    .iter()
    .find_map(|p| {
        let digits = name.strip_prefix(p)?;
        (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
            .then(|| digits.parse().ok())
            .flatten()
    })
}

/// Opens the checkpoint at `prefix`, whatever its format: lists the location once, then
///
/// - `manifest.json` (or a native-looking directory without one: `metadata.arrow`, `data/`): the
///   native reader, with its errors ([`MetadataError::MissingManifest`] for an incomplete save);
/// - a ByteCheckpoint save (its root, a component directory, a root of `global_step_N` saves):
///   [`bytecheckpoint::open_bytecheckpoint`];
/// - `.metadata` (or per-rank `__<r>.metadata`): [`dcp::open_dcp`];
/// - `model.safetensors.index.json`, `*.safetensors`, or a `sharded/` folder: [`safetensors::open_safetensors`];
/// - a location that is itself a `.safetensors` file: that file;
/// - `*_model_states.pt` + `*_optim_states.pt`, or a `latest` naming a directory of them:
///   [`deepspeed::open_deepspeed`].
///
/// Anything else is [`MetadataError::Unsupported`], naming the location.
pub async fn open_any(
    store: &dyn ObjectStore,
    prefix: &Path,
    options: &OpenOptions,
) -> Result<OpenedCheckpoint, MetadataError> {
    let listing = match list_dir(store, prefix).await {
        Ok(listing) => listing,
        // A store that allows reads but not listings can still serve a native checkpoint.
        Err(list_error) => {
            return match open_native(store, prefix, options).await {
                Err(MetadataError::MissingManifest { .. }) => Err(list_error),
                other => other,
            };
        }
    };
    let step = prefix.filename().and_then(step_from_name);
    if listing.files.contains_key(native::MANIFEST_FILE)
        || listing.files.contains_key(native::METADATA_FILE)
        || listing.dirs.contains(native::DATA_DIR)
    {
        return open_native(store, prefix, options).await;
    }
    // Before DCP: ByteCheckpoint's `.metadata` looks like torch's from the listing (one small
    // ranged read of it tells them apart), and a save's root is only folders.
    if let Some(found) = bytecheckpoint::detect(store, prefix, &listing).await? {
        let opened = bytecheckpoint::open_bytecheckpoint(store, &found, &options.dcp).await?;
        return Ok(OpenedCheckpoint {
            format: Format::ByteCheckpoint,
            root: found.root,
            meta: opened.meta,
            step: found.step.or(step),
            committed: true,
            has_data: true,
            block_checksums: None,
            writer: Some(Writer::new(
                "ByteCheckpoint",
                opened.details.version.clone(),
            )),
            details: FormatDetails::ByteCheckpoint(Box::new(opened.details)),
        });
    }
    if dcp::is_dcp(&listing) {
        let opened = dcp::open_dcp(store, prefix, &listing, &options.dcp).await?;
        return Ok(OpenedCheckpoint {
            format: Format::Dcp,
            root: prefix.clone(),
            meta: opened.meta,
            step,
            committed: true,
            has_data: true,
            block_checksums: None,
            writer: Some(opened.details.writer()),
            details: FormatDetails::Dcp(Box::new(opened.details)),
        });
    }
    if safetensors::is_safetensors(&listing) {
        let opened = safetensors::open_safetensors(store, prefix, &listing, None).await?;
        return Ok(safetensors_opened(prefix.clone(), step, opened));
    }
    // The location may be a single file.
    if listing.files.is_empty()
        && listing.dirs.is_empty()
        && let Some(name) = prefix.filename()
        && name.ends_with(".safetensors")
        && let Ok(head) = store.head(prefix).await
    {
        let root = prefix.parent().unwrap_or_default();
        let mut single = Listing::default();
        single.files.insert(name.to_string(), head.size);
        let opened = safetensors::open_safetensors(store, &root, &single, Some(name)).await?;
        let step = root.filename().and_then(step_from_name);
        return Ok(safetensors_opened(root, step, opened));
    }
    // DeepSpeed: a tag directory, or a save directory whose `latest` names one.
    if let Some((tag, inner)) = deepspeed::locate(store, prefix, &listing).await? {
        let step = tag.as_deref().and_then(step_from_name).or(step);
        let opened = deepspeed::open_deepspeed(store, prefix, tag, &inner).await?;
        let details = opened.details;
        return Ok(OpenedCheckpoint {
            format: Format::DeepSpeed,
            root: prefix.clone(),
            meta: opened.meta,
            step,
            committed: true,
            has_data: true,
            block_checksums: None,
            writer: Some(Writer::new(
                format!("DeepSpeed ZeRO-{}", details.zero_stage),
                details.ds_version.clone(),
            )),
            details: FormatDetails::DeepSpeed(Box::new(details)),
        });
    }
    if listing.files.keys().any(|n| n.ends_with(".distcp")) {
        return Err(MetadataError::Unsupported {
            path: prefix.to_string(),
            detail: format!(
                ".distcp files but no {}: an incomplete PyTorch DCP save (torch writes it last)",
                dcp::METADATA_FILE
            ),
        });
    }
    // An object store lists a prefix that does not exist as empty: that is a wrong location,
    // not a checkpoint in an unknown format.
    if listing.files.is_empty() && listing.dirs.is_empty() {
        return Err(MetadataError::NotFound {
            path: prefix.to_string(),
        });
    }
    // A run directory: its steps are the checkpoints, so name them rather than refuse it.
    if let Some(detail) = run_directory_steps(prefix, &listing) {
        return Err(MetadataError::Unsupported {
            path: prefix.to_string(),
            detail,
        });
    }
    Err(MetadataError::Unsupported {
        path: prefix.to_string(),
        detail: "not a checkpoint tessera can read: no manifest.json (tessera), .metadata \
                 (PyTorch DCP), model.safetensors.index.json or *.safetensors files"
            .to_string(),
    })
}

/// Most step names a run directory's error lists (a long run has thousands).
const STEPS_LISTED: usize = 8;

/// What to say about a directory whose folders are steps (`step-100`, `iter_0000200`, ...): it
/// is a run, each step a checkpoint; lists them (the last [`STEPS_LISTED`] when there are many,
/// as the latest are the likely ones wanted) and the latest. `None` when no folder is a step.
fn run_directory_steps(prefix: &Path, listing: &Listing) -> Option<String> {
    let mut steps: Vec<(u64, &str)> = listing
        .dirs
        .iter()
        .filter_map(|name| Some((step_from_name(name)?, name.as_str())))
        .collect();
    steps.sort_unstable();
    let &(_, latest) = steps.last()?;
    let shown = &steps[steps.len().saturating_sub(STEPS_LISTED)..];
    let names: Vec<&str> = shown.iter().map(|(_, name)| *name).collect();
    let earlier = steps.len() - shown.len();
    let list = if earlier > 0 {
        format!("{earlier} earlier, then {}", names.join(", "))
    } else {
        names.join(", ")
    };
    let count = match steps.len() {
        1 => "1 step".to_string(),
        n => format!("{n} steps"),
    };
    let latest_path = if prefix.as_ref().is_empty() {
        latest.to_string()
    } else {
        format!("{prefix}/{latest}")
    };
    Some(format!(
        "a run directory, not a checkpoint: it holds {count} ({list}); the latest is {latest} \
         (give a step's directory, e.g. {latest_path})"
    ))
}

fn safetensors_opened(
    root: Path,
    step: Option<u64>,
    opened: SafetensorsCheckpoint,
) -> OpenedCheckpoint {
    OpenedCheckpoint {
        format: Format::Safetensors,
        root,
        meta: opened.meta.clone(),
        step,
        committed: true,
        has_data: true,
        block_checksums: None,
        writer: None,
        details: FormatDetails::Safetensors(Box::new(opened.details)),
    }
}

async fn open_native(
    store: &dyn ObjectStore,
    prefix: &Path,
    options: &OpenOptions,
) -> Result<OpenedCheckpoint, MetadataError> {
    let opened = native::open_checkpoint(store, prefix).await?;
    let has_data = opened.manifest.data == DataPresence::Present;
    let block_checksums = match (&opened.manifest.checksums, options.block_checksums) {
        (Some(_), true) => {
            Some(native::read_block_checksums(store, prefix, &opened.manifest).await?)
        }
        _ => None,
    };
    Ok(OpenedCheckpoint {
        format: Format::Native,
        root: prefix.clone(),
        meta: opened.meta,
        step: opened.manifest.step,
        committed: true,
        has_data,
        block_checksums,
        writer: Some(Writer::new(
            "tessera",
            Some(opened.manifest.format_version.to_string()),
        )),
        details: FormatDetails::Native {
            manifest: Box::new(opened.manifest),
        },
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use object_store::memory::InMemory;
    use object_store::{ObjectStoreExt, PutPayload};

    use super::*;

    async fn open_error(store: &InMemory, prefix: &str) -> MetadataError {
        open_any(store, &Path::from(prefix), &OpenOptions::default())
            .await
            .err()
            .unwrap()
    }

    #[tokio::test]
    async fn a_prefix_with_nothing_under_it_does_not_exist() {
        let store = InMemory::new();
        let err = open_error(&store, "runs/typo").await;
        assert!(
            matches!(&err, MetadataError::NotFound { path } if path == "runs/typo"),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "runs/typo: does not exist (nothing is stored there)"
        );
    }

    #[tokio::test]
    async fn a_run_directory_lists_its_steps_and_the_latest() {
        let store = InMemory::new();
        // Numeric order, not name order: step-900 comes before step-1000.
        for step in ["step-1000", "step-900", "step-100"] {
            store
                .put(
                    &Path::from(format!("runs/a/{step}/manifest.json")),
                    PutPayload::from_static(b"{}"),
                )
                .await
                .unwrap();
        }
        assert_eq!(
            open_error(&store, "runs/a").await.to_string(),
            "runs/a: a run directory, not a checkpoint: it holds 3 steps (step-100, step-900, \
             step-1000); the latest is step-1000 (give a step's directory, e.g. \
             runs/a/step-1000)"
        );

        // A long run: the latest few, and how many came before.
        let store = InMemory::new();
        for step in 1..=20 {
            store
                .put(
                    &Path::from(format!("run/iter_{step:07}/x.pt")),
                    PutPayload::from_static(b"x"),
                )
                .await
                .unwrap();
        }
        assert_eq!(
            open_error(&store, "run").await.to_string(),
            "run: a run directory, not a checkpoint: it holds 20 steps (12 earlier, then \
             iter_0000013, iter_0000014, iter_0000015, iter_0000016, iter_0000017, iter_0000018, \
             iter_0000019, iter_0000020); the latest is iter_0000020 (give a step's directory, \
             e.g. run/iter_0000020)"
        );
    }
}
