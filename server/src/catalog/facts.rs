//! [`CheckpointFacts`]: what the catalog says about a committed checkpoint, whatever its format.
//! A native checkpoint's come from its manifest alone (the listing reads nothing else); a DCP or
//! safetensors checkpoint's from what opening it found. The catalog rows, summaries, cache
//! weights and plan ids are all built from these, so no format has to pose as another.

use serde_json::Value;
use tessera_metadata::formats::native::{Created, DataPresence, Manifest};
use tessera_metadata::formats::step_from_name;
use tessera_metadata::{Format, OpenedCheckpoint, Writer};

use super::wire::{CheckpointEntry, CheckpointStatus, CheckpointSummary};
use crate::CheckpointId;

/// What is known of a committed checkpoint, in any format.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct CheckpointFacts {
    /// Its format.
    pub format: Format,
    /// Who wrote it (`Megatron-Core torch_dist (version 1)`, `PyTorch DCP (version 1.0.0)`, …),
    /// when the files tell.
    pub writer: Option<String>,
    /// Training step: recorded (native manifest), else the one in the directory name.
    pub step: Option<u64>,
    /// Whether it is complete as far as its format can tell.
    pub committed: bool,
    /// Whether the data files are there (a native metadata-only checkpoint has none).
    pub has_data: bool,
    /// Number of tensors.
    pub tensors: u64,
    /// Number of saved boxes.
    pub chunks: u64,
    /// Number of non-tensor objects.
    pub objects: u64,
    /// Number of data files.
    pub files: u64,
    /// Bytes stored: the data files when present, plus the metadata files whose sizes the
    /// format records (native: manifest-listed metadata and checksums; the others: none).
    pub bytes: u64,
    /// Bytes of all tensors, each element counted once.
    pub tensor_bytes: u64,
    /// Commit time as recorded (native only: the other formats record none).
    pub created: Option<String>,
    /// Checksum block size (native only).
    pub block_size: Option<u64>,
    /// The layout it was saved with (native, when recorded).
    pub source_layout: Option<Value>,
    /// The checkpoint's identity (`CheckpointMeta::identity`: a digest of the metadata bytes as
    /// read), which changes when the checkpoint is saved again at the same place: plan ids and
    /// rank plans carry it, so that a plan of the old save is never served or loaded for the new
    /// one.
    pub identity: String,
}

impl CheckpointFacts {
    /// The facts of a native checkpoint in directory `dir_name`, from its manifest and the
    /// identity of the manifest's bytes.
    pub(crate) fn from_manifest(manifest: &Manifest, identity: &str, dir_name: &str) -> Self {
        let has_data = manifest.data == DataPresence::Present;
        let metadata_bytes =
            manifest.metadata.size + manifest.checksums.as_ref().map_or(0, |c| c.size);
        let data_bytes: u64 = if has_data {
            manifest.files.iter().map(|f| f.size).sum()
        } else {
            0
        };
        let created = match &manifest.created {
            Created::Rfc3339(text) => text.clone(),
            Created::UnixSeconds(secs) => secs.to_string(),
        };
        Self {
            format: Format::Native,
            writer: Some(
                Writer::new("tessera", Some(manifest.format_version.to_string())).to_string(),
            ),
            step: manifest.step.or_else(|| step_from_name(dir_name)),
            committed: true,
            has_data,
            tensors: manifest.tensors,
            chunks: manifest.chunks,
            objects: manifest.objects,
            files: manifest.files.len() as u64,
            bytes: data_bytes + metadata_bytes,
            tensor_bytes: manifest.tensor_bytes,
            created: Some(created),
            block_size: Some(manifest.block_size),
            source_layout: manifest.source_layout.clone(),
            identity: identity.to_string(),
        }
    }

    /// The facts of a checkpoint in directory `dir_name`, opened in whatever format it is.
    pub(crate) fn from_opened(opened: &OpenedCheckpoint, dir_name: &str) -> Self {
        let identity = opened.meta.identity().unwrap_or_default();
        if let Some(manifest) = opened.manifest() {
            return Self::from_manifest(manifest, identity, dir_name);
        }
        let meta = &opened.meta;
        let data_bytes: u64 = meta.files().iter().filter_map(|f| f.size).sum();
        Self {
            format: opened.format,
            writer: opened.writer.as_ref().map(ToString::to_string),
            step: opened.step.or_else(|| step_from_name(dir_name)),
            committed: opened.committed,
            has_data: opened.has_data,
            tensors: meta.tensors().len() as u64,
            chunks: meta.chunks().len() as u64,
            objects: meta.objects().len() as u64,
            files: meta.files().len() as u64,
            bytes: if opened.has_data { data_bytes } else { 0 },
            tensor_bytes: meta.tensor_bytes(),
            created: None,
            block_size: None,
            source_layout: None,
            identity: identity.to_string(),
        }
    }

    /// The catalog row of this checkpoint as `id`.
    pub(crate) fn entry(&self, id: &CheckpointId, latest: bool) -> CheckpointEntry {
        CheckpointEntry {
            step: self.step,
            status: if self.committed {
                CheckpointStatus::Committed
            } else {
                CheckpointStatus::Incomplete
            },
            committed: self.committed,
            format: Some(self.format.name().to_string()),
            writer: self.writer.clone(),
            created: self.created.clone(),
            data: Some(if self.has_data { "present" } else { "absent" }.to_string()),
            bytes: Some(self.bytes),
            tensor_bytes: Some(self.tensor_bytes),
            tensors: Some(self.tensors),
            identity: (!self.identity.is_empty()).then(|| self.identity.clone()),
            ..CheckpointEntry::incomplete(id, latest)
        }
    }

    /// The summary of this checkpoint as `id`.
    pub(crate) fn summary(&self, id: &CheckpointId, latest: bool) -> CheckpointSummary {
        CheckpointSummary {
            entry: self.entry(id, latest),
            chunks: Some(self.chunks),
            objects: Some(self.objects),
            files: Some(self.files),
            block_size: self.block_size,
            source_layout: self.source_layout.clone(),
            // Need the metadata, not just the facts: filled in by `Catalog::summary`.
            composition: None,
            object_list: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use tessera_metadata::formats::native::{ManifestBlob, ManifestFile};

    use super::*;

    fn manifest() -> Manifest {
        Manifest {
            format: "tessera".to_string(),
            format_version: 1,
            step: None,
            created: Created::UnixSeconds(1_700_000_000),
            source_layout: None,
            data: DataPresence::Present,
            block_size: 1 << 20,
            files: vec![ManifestFile {
                path: "data/rank-00000.bin".to_string(),
                size: 4096,
            }],
            metadata: ManifestBlob {
                path: "metadata.arrow".to_string(),
                size: 512,
                crc32c: 0xdead_beef,
            },
            checksums: Some(ManifestBlob {
                path: "checksums.arrow".to_string(),
                size: 64,
                crc32c: 1,
            }),
            tensors: 2,
            chunks: 4,
            objects: 1,
            tensor_bytes: 4096,
        }
    }

    #[test]
    fn native_facts_name_the_format_native_and_count_metadata_bytes() {
        let facts = CheckpointFacts::from_manifest(&manifest(), "native:00", "iter_0000100");
        assert_eq!(facts.format.name(), "native");
        assert_eq!(facts.step, Some(100), "from the directory name");
        assert_eq!(facts.bytes, 4096 + 512 + 64);
        assert_eq!(facts.created.as_deref(), Some("1700000000"));
        let id = CheckpointId::from_parts("gpt", "iter_0000100").expect("a valid id");
        let entry = facts.entry(&id, true);
        assert_eq!(entry.format.as_deref(), Some("native"));
        assert_eq!(entry.status, CheckpointStatus::Committed);
        assert!(entry.latest);
    }
}
