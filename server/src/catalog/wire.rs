//! The catalog's API types: what `/v1/checkpoints` and its sub-routes answer (serde for the
//! JSON, utoipa for the OpenAPI document), and their rows built from checkpoint metadata.

use serde::{Deserialize, Serialize};
use tessera_metadata::CheckpointMeta;
use tessera_metadata::formats::native::step_from_dir_name;
use utoipa::ToSchema;

use crate::CheckpointId;

/// Whether a checkpoint can be loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointStatus {
    /// The manifest is there: loadable.
    Committed,
    /// A `step-<N>` directory without a manifest: a save that did not finish.
    Incomplete,
    /// A manifest that cannot be read (see `error`).
    Invalid,
}

/// One checkpoint of the catalog.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CheckpointEntry {
    /// `<run>/<name>`.
    pub id: String,
    /// Run (directory under the root).
    pub run: String,
    /// Checkpoint directory name.
    pub name: String,
    /// Training step: the manifest's, else the one in the directory name (`step-<N>`,
    /// `iter_<N>`, `global_step<N>`, `checkpoint-<N>`).
    pub step: Option<u64>,
    /// Committed, incomplete or invalid.
    pub status: CheckpointStatus,
    /// Whether it is committed (loadable).
    pub committed: bool,
    /// Whether the run's `latest` pointer names it.
    pub latest: bool,
    /// Checkpoint format: `native`, `dcp` or `safetensors`; absent when not committed.
    pub format: Option<String>,
    /// The software that wrote it and its version as far as the files tell
    /// (`Megatron-Core torch_dist (version 1)`, `PyTorch DCP (version 1.0.0)`, …).
    pub writer: Option<String>,
    /// Commit time, RFC 3339 (or Unix seconds as a decimal string, when recorded so).
    pub created: Option<String>,
    /// `present`, or `absent` for a metadata-only checkpoint.
    pub data: Option<String>,
    /// Bytes stored: data files (when present) plus the metadata files.
    pub bytes: Option<u64>,
    /// Bytes of all tensors, each element counted once.
    pub tensor_bytes: Option<u64>,
    /// Number of tensors.
    pub tensors: Option<u64>,
    /// Why an invalid checkpoint cannot be read.
    pub error: Option<String>,
    /// The checkpoint's identity, `<format>:<hex digest>` of its metadata bytes as read (a native
    /// manifest; DCP `.metadata`; safetensors headers): it changes when the checkpoint is saved
    /// again at the same place, and every plan made for it carries it. In the listing only for
    /// native checkpoints (the others are known once opened).
    pub identity: Option<String>,
}

impl CheckpointEntry {
    /// The row of a directory without a readable checkpoint: incomplete, with only what its id
    /// says (callers override the status and the rest for the other cases).
    pub(crate) fn incomplete(id: &CheckpointId, latest: bool) -> Self {
        Self {
            id: id.to_string(),
            run: id.run().to_string(),
            name: id.step().to_string(),
            step: step_from_dir_name(id.step()),
            status: CheckpointStatus::Incomplete,
            committed: false,
            latest,
            format: None,
            writer: None,
            created: None,
            data: None,
            bytes: None,
            tensor_bytes: None,
            tensors: None,
            error: None,
            identity: None,
        }
    }
}

/// One run of the catalog.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct RunEntry {
    /// Run name.
    pub run: String,
    /// Id of the checkpoint its `latest` pointer names.
    pub latest: Option<String>,
    /// Checkpoints listed (any status).
    pub checkpoints: u64,
}

/// An entry of the catalog root that could not be read and was skipped (a symlink loop, an
/// entry the OS refuses), so that the rest of the catalog is still listed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct CatalogProblem {
    /// The entry, relative to the catalog root (`loop`, `gpt/step-000100`).
    pub path: String,
    /// What is wrong with it.
    pub error: String,
}

/// `GET /v1/checkpoints`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CatalogResponse {
    /// Runs, by name.
    pub runs: Vec<RunEntry>,
    /// Checkpoints, by run then step.
    pub checkpoints: Vec<CheckpointEntry>,
    /// Entries skipped because they cannot be read (empty when all is well).
    #[serde(default)]
    pub problems: Vec<CatalogProblem>,
    /// The live publications of the server's registry (`--registry`), each with its newest
    /// complete step in brief (`/v1/live/{name}` lists its steps); absent without a registry.
    #[serde(default)]
    pub live: Option<crate::LiveListing>,
}

/// `GET /v1/checkpoints/{run}/{step}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct CheckpointSummary {
    /// The catalog entry (for `<run>/latest`, the checkpoint it resolves to).
    #[serde(flatten)]
    pub entry: CheckpointEntry,
    /// Number of saved boxes.
    pub chunks: Option<u64>,
    /// Number of non-tensor objects.
    pub objects: Option<u64>,
    /// Number of data files.
    pub files: Option<u64>,
    /// Checksum block size in bytes (native checkpoints).
    pub block_size: Option<u64>,
    /// The layout the checkpoint was saved with (layout JSON), when recorded.
    #[schema(value_type = Option<Object>)]
    pub source_layout: Option<serde_json::Value>,
    /// Tensors, elements and bytes split into model and optimizer state (committed only).
    pub composition: Option<Composition>,
    /// The non-tensor objects (the first [`MAX_OBJECTS_LISTED`], by key; `objects` counts
    /// them all). Committed only.
    pub object_list: Option<Vec<ObjectEntry>>,
}

/// Most non-tensor objects a summary lists: a checkpoint has a handful (RNG states, configs,
/// the step), and a bound keeps a pathological one from bloating every summary.
pub const MAX_OBJECTS_LISTED: usize = 1000;

/// Tensors of one kind and their totals.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TensorTotals {
    /// Tensors.
    pub tensors: u64,
    /// Elements (for model tensors: the parameter count).
    pub elements: u64,
    /// Bytes, each element counted once.
    pub bytes: u64,
}

/// A checkpoint's tensors split into model and optimizer state. Optimizer state is a tensor
/// whose FQN starts with a segment beginning `optim` (`optim.state.…`, `optimizer.state.…`,
/// `optimizer_state_dict.…`), which is how every format tessera reads names them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct Composition {
    /// Model tensors (parameters and buffers).
    pub model: TensorTotals,
    /// Optimizer state tensors.
    pub optimizer: TensorTotals,
}

impl Composition {
    /// The composition of `meta`'s tensors.
    pub(crate) fn of(meta: &CheckpointMeta) -> Self {
        let mut c = Self::default();
        for t in meta.tensors() {
            let part = if is_optimizer_state(&t.fqn) {
                &mut c.optimizer
            } else {
                &mut c.model
            };
            part.tensors += 1;
            part.elements = part
                .elements
                .saturating_add(t.shape.iter().product::<u64>());
            part.bytes = part.bytes.saturating_add(t.nbytes());
        }
        c
    }
}

/// Whether `fqn` names optimizer state (see [`Composition`]).
fn is_optimizer_state(fqn: &str) -> bool {
    fqn.split('.')
        .next()
        .is_some_and(|s| s.starts_with("optim"))
}

/// A non-tensor object of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct ObjectEntry {
    /// Flattened key (`extra.config`, `rng_state`).
    pub key: String,
    /// Bytes of its serialized value.
    pub bytes: u64,
}

impl ObjectEntry {
    /// The first [`MAX_OBJECTS_LISTED`] objects of `meta`, by key.
    pub(crate) fn list(meta: &CheckpointMeta) -> Vec<Self> {
        let mut objects: Vec<Self> = meta
            .objects()
            .iter()
            .map(|o| Self {
                key: o.key.clone(),
                bytes: o.length,
            })
            .collect();
        objects.sort_by(|a, b| a.key.cmp(&b.key));
        objects.truncate(MAX_OBJECTS_LISTED);
        objects
    }
}

impl CheckpointSummary {
    /// The summary of a checkpoint that is not committed: only its entry.
    pub(crate) fn incomplete(entry: CheckpointEntry) -> Self {
        Self {
            entry,
            chunks: None,
            objects: None,
            files: None,
            block_size: None,
            source_layout: None,
            composition: None,
            object_list: None,
        }
    }
}

/// A tensor of a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TensorEntry {
    /// Fully-qualified name.
    pub fqn: String,
    /// Element type (`bf16`, `f32`, ...).
    pub dtype: String,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Bytes of the whole tensor.
    pub bytes: u64,
    /// Saved boxes.
    pub boxes: u64,
}

impl TensorEntry {
    /// The row of tensor `index` of `meta`.
    pub(crate) fn new(meta: &CheckpointMeta, index: u32) -> Self {
        let tensor = &meta.tensors()[index as usize];
        Self {
            fqn: tensor.fqn.clone(),
            dtype: tensor.dtype.to_string(),
            shape: tensor.shape.clone(),
            bytes: tensor.nbytes(),
            boxes: meta.chunks_of(index).len() as u64,
        }
    }
}

/// `GET /v1/checkpoints/{run}/{step}/tensors`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TensorPage {
    /// Checkpoint id.
    pub checkpoint: String,
    /// Tensors matching the filter.
    pub total: u64,
    /// Index of the first tensor returned.
    pub offset: u64,
    /// Most tensors returned.
    pub limit: u64,
    /// This page, in checkpoint order.
    pub tensors: Vec<TensorEntry>,
}

/// A saved box of a tensor and where its bytes are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct SavedBox {
    /// Box start in global coordinates.
    pub offsets: Vec<u64>,
    /// Box extent.
    pub lengths: Vec<u64>,
    /// Data file, relative to the checkpoint.
    pub file: String,
    /// First byte in the file.
    pub byte_offset: u64,
    /// Bytes (`byte_offset..byte_offset + byte_length`).
    pub byte_length: u64,
    /// Element strides; absent for row-major.
    pub strides: Option<Vec<u64>>,
    /// crc32c of the box's bytes, when recorded.
    pub crc32c: Option<u32>,
}

impl SavedBox {
    /// The saved boxes of tensor `index` of `meta`, with their files and byte ranges.
    pub(crate) fn of_tensor(meta: &CheckpointMeta, index: u32) -> Vec<Self> {
        meta.chunks_of(index)
            .iter()
            .map(|chunk| Self {
                offsets: chunk.region.offsets.to_vec(),
                lengths: chunk.region.lengths.to_vec(),
                file: meta
                    .files()
                    .get(chunk.bytes.file as usize)
                    .map(|f| f.path.clone())
                    .unwrap_or_default(),
                byte_offset: chunk.bytes.offset,
                byte_length: chunk.bytes.length,
                strides: chunk.bytes.strides.clone(),
                crc32c: chunk.crc32c,
            })
            .collect()
    }
}

/// `GET /v1/checkpoints/{run}/{step}/tensors/{fqn}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
pub struct TensorDetail {
    /// Checkpoint id.
    pub checkpoint: String,
    /// The tensor.
    #[serde(flatten)]
    pub tensor: TensorEntry,
    /// Its saved boxes.
    pub saved: Vec<SavedBox>,
}
