//! ByteCheckpoint (ByteDance-Seed/ByteCheckpoint 0.0.x) saves read in place.
//!
//! ```text
//! <root>/latest_checkpointed_iteration.txt   "N", when saved with global_steps=N
//! <root>/global_step_N/                      the save (or <root> itself without global_steps)
//!   model/.metadata        pickle of bytecheckpoint.checkpointer.meta_type.Metadata
//!   model/__<rank>_0.distcp   per writing rank: bytes entries (torch.save zips) first, then the
//!                             RAW storage bytes of every tensor chunk, back to back
//!   optimizer/.metadata, optimizer/__<rank>_0.distcp   the same for the optimizer state
//!   extra_state/extra_state_rank_<r>.pt                torch.save of each rank's extra dict
//!   loader_ckpt/*.pt                                   data loader states, the same way
//!
//!   file byte  info.offset                              info.offset + info.length
//!   ─────┬─────┬──────────────────────────────────────────┬──────
//!   ...  │ ... │ storage bytes (storage_numel · esize)     │ next
//!   ─────┴─────┴────────▲─────────────────────────────────┴──────
//!                       │ element idx at info.offset + esize·(soff + Σ idx_k·stride_k)
//!   soff, sizes, strides and the dtype (from the storage class) come from the chunk's pickled
//!   `torch._utils._rebuild_tensor_v2` descriptor in `all_tensor_metadata`, not from the file.
//! ```
//!
//! `.metadata` keeps torch DCP's fields (`state_dict_metadata`, `storage_data` keyed by
//! `MetadataIndex`, `planner_data`), read by the DCP reader, and adds `all_tensor_metadata`,
//! `bytecheckpoint_version` and `user_defined_dict` ([`metadata`]).
//!
//! Names. A save's root opens as ONE checkpoint whose tensors and objects are namespaced by
//! component: `model.<fqn>`, `optimizer.<fqn>` (e.g. `optimizer.state.l1.weight.exp_avg`,
//! `optimizer.param_groups`), `extra_state.rank_<r>`; that is what a user loading "the
//! checkpoint" into one job wants, and the components' own names would clash
//! (`state.<p>.step` is not unique across roles). Each component directory also opens on its
//! own with the names ByteCheckpoint's own load uses for it (`ckpt/model` has `emb.weight`), so
//! a model-only load reads only the model's metadata. Names are kept as saved: a DDP save's
//! `module.` prefix and its optimizer's integer parameter ids stay, since that is what
//! ByteCheckpoint's own load into the same wrapper expects.
//!
//! Irregular shards. A decomposed FSDP save (`save_decomposed_model_optimizer=True`) stores each
//! FSDP unit's flat parameter (`<module>._flat_param`, 1-D, even splits over ranks) and the
//! optimizer's per-parameter pieces of flat states; the model's `user_defined_dict` records the
//! slot layout. Each saved range is cut at the slots and becomes flat-range chunks of the
//! original parameters ([`crate::flat_range_chunks`]), so loads need no merge step.
//!
//! ByteCheckpoint records no checksums of the raw storage bytes: loads read without verification,
//! and [`verify_bytecheckpoint`] checks the zip CRC-32 of what is stored as torch.save zips (bytes
//! entries, extra state), besides the structure checked when opening.

pub mod metadata;
mod verify;

use std::collections::{BTreeMap, HashMap};

use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt};

use crate::formats::dcp::{
    DcpMetadata, DcpOptions, DcpTensor, METADATA_FILE, StorageInfo, check_range, parse_metadata,
};
use crate::formats::native::{read_whole, resolve, store_error};
use crate::formats::torch::blob::{TensorBlob, TensorDescriptor, parse_tensor_descriptor};
use crate::formats::torch::pickle::Limits;
use crate::formats::{Format, Listing, list_dir};
use crate::identity::IdentityHasher;
use crate::{
    ByteMeta, CheckpointMeta, DataFile, MetadataError, ObjectMeta, SavedChunk, TensorBox,
    TensorMeta, flat_range_chunks, row_major_strides, validate,
};
pub use metadata::{BcFields, FlatParams, FlatSlot, METADATA_MODULE, parse_bc_fields};
pub use verify::{BcVerifyReport, verify_bytecheckpoint};

/// The tracker file a save with `global_steps` updates in the root.
pub const TRACKER_FILE: &str = "latest_checkpointed_iteration.txt";
/// Prefix of the step directories (`global_step_{N}`).
pub const STEP_DIR_PREFIX: &str = "global_step_";
/// Components with a `.metadata` and `.distcp` files.
pub const TENSOR_COMPONENTS: [&str; 2] = ["model", "optimizer"];
/// Components saved as one torch.save file per rank.
pub const OBJECT_COMPONENTS: [&str; 2] = ["extra_state", "loader_ckpt"];

/// Bytes of a `.metadata` read to tell ByteCheckpoint's from torch's: the class's module name
/// is the first string of the pickle (after a protocol and frame header of 11 bytes).
const SNIFF_BYTES: u64 = 256;
/// Largest tracker file read: it holds one decimal number.
const MAX_TRACKER_BYTES: u64 = 64;
/// Caps of the VM that runs one chunk's descriptor pickle (a real one is ~155 bytes).
const DESCRIPTOR_LIMITS: Limits = Limits {
    max_input: 64 << 10,
    max_depth: 64,
    max_stack: 4096,
    max_memo: 4096,
    max_objects: 4096,
    max_bytes: 1 << 20,
};

/// One component of a save, as found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BcComponent {
    /// `model`, `optimizer`, `extra_state`, `loader_ckpt`.
    pub name: String,
    /// Its directory relative to the checkpoint root (`model`), empty when the component was
    /// opened on its own.
    pub dir: String,
    /// Prefix of its names (`model.`), empty when opened on its own.
    pub namespace: String,
    /// What is directly in its directory.
    pub listing: Listing,
}

/// A ByteCheckpoint save found at a location by [`detect`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BcLocation {
    /// The prefix data file paths are relative to (the save, or the component directory).
    pub root: Path,
    /// The components to read.
    pub components: Vec<BcComponent>,
    /// The step, from a `global_step_N` directory (or the tracker).
    pub step: Option<u64>,
    /// The `global_step_N` directory followed from the tracker, when the location was a root
    /// of several saves.
    pub followed: Option<String>,
}

/// What is ByteCheckpoint-specific about an opened checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct BcDetails {
    /// `bytecheckpoint_version` of the first component with a `.metadata`.
    pub version: Option<String>,
    /// Per component read: what its `.metadata` said.
    pub components: Vec<BcComponentDetails>,
    /// The `global_step_N` directory followed, if any.
    pub followed: Option<String>,
}

/// One component as read.
#[derive(Clone, Debug, PartialEq)]
pub struct BcComponentDetails {
    /// `model`, `optimizer`, `extra_state`, `loader_ckpt`.
    pub name: String,
    /// Its directory relative to the root (empty when opened on its own).
    pub dir: String,
    /// Its `.metadata` file relative to the root (`None` for object components).
    pub metadata_file: Option<String>,
    /// The torch part of its `.metadata`.
    pub metadata: DcpMetadata,
    /// `bytecheckpoint_version`.
    pub version: Option<String>,
    /// Keys of `user_defined_dict`.
    pub user_defined_keys: Vec<String>,
    /// Bytes of its `.metadata`.
    pub metadata_bytes: u64,
}

/// A ByteCheckpoint save, opened.
#[derive(Clone, Debug)]
pub struct BcCheckpoint {
    /// The checkpoint model.
    pub meta: CheckpointMeta,
    /// The rest.
    pub details: BcDetails,
}

/// True when the start of a `.metadata` names ByteCheckpoint's `Metadata` class.
pub fn is_bytecheckpoint_metadata(head: &[u8]) -> bool {
    head.windows(METADATA_MODULE.len())
        .any(|w| w == METADATA_MODULE.as_bytes())
}

async fn sniff(
    store: &dyn ObjectStore,
    dir: &Path,
    listing: &Listing,
) -> Result<bool, MetadataError> {
    let Some(&size) = listing.files.get(METADATA_FILE) else {
        return Ok(false);
    };
    // An empty file names no class (and a range 0..0 is refused by the store as invalid, an
    // error that reads as storage trouble): whoever opens it as DCP metadata says it is empty.
    if size == 0 {
        return Ok(false);
    }
    let path = dir.clone().join(METADATA_FILE);
    let head = store
        .get_range(&path, 0..size.min(SNIFF_BYTES))
        .await
        .map_err(store_error("reading", &path))?;
    Ok(is_bytecheckpoint_metadata(&head))
}

/// `global_step_N` → N.
pub fn step_of_dir(name: &str) -> Option<u64> {
    let digits = name.strip_prefix(STEP_DIR_PREFIX)?;
    (!digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

fn is_object_file(name: &str) -> bool {
    name.ends_with(".pt")
}

/// Tells whether `prefix` (whose directory `listing` is) holds a ByteCheckpoint save, and which
/// parts: a component directory with ByteCheckpoint's `.metadata` (one small ranged read of it),
/// a save's root (`model/` or `optimizer/` holding one), an `extra_state/` directory, or a root
/// of `global_step_N` saves with the tracker file (followed to the step it names, or the highest
/// step without one). `None` when it is none of these.
pub async fn detect(
    store: &dyn ObjectStore,
    prefix: &Path,
    listing: &Listing,
) -> Result<Option<BcLocation>, MetadataError> {
    if listing.files.contains_key(METADATA_FILE) {
        if !sniff(store, prefix, listing).await? {
            return Ok(None);
        }
        let name = prefix.filename().unwrap_or("model").to_string();
        return Ok(Some(BcLocation {
            root: prefix.clone(),
            components: vec![BcComponent {
                name,
                dir: String::new(),
                namespace: String::new(),
                listing: listing.clone(),
            }],
            step: None,
            followed: None,
        }));
    }
    if let Some(found) = detect_root(store, prefix, listing).await? {
        return Ok(Some(BcLocation {
            step: prefix.filename().and_then(step_of_dir),
            ..found
        }));
    }
    // A root of several saves: follow the tracker (what ByteCheckpoint resumes from).
    let steps: BTreeMap<u64, &String> = listing
        .dirs
        .iter()
        .filter_map(|d| Some((step_of_dir(d)?, d)))
        .collect();
    if !steps.is_empty() {
        let chosen = match listing.files.get(TRACKER_FILE) {
            Some(&size) => {
                let path = prefix.clone().join(TRACKER_FILE);
                // Not asked for when empty: the store refuses the range 0..0 as invalid.
                let bytes = if size == 0 {
                    bytes::Bytes::new()
                } else {
                    store
                        .get_range(&path, 0..size.min(MAX_TRACKER_BYTES))
                        .await
                        .map_err(store_error("reading", &path))?
                };
                let text = String::from_utf8_lossy(&bytes);
                let step: u64 = text.trim().parse().map_err(|_| MetadataError::Decode {
                    path: path.to_string(),
                    what: "ByteCheckpoint tracker",
                    detail: format!("holds {:?}, not a step number", text.trim()),
                })?;
                match steps.get(&step) {
                    Some(dir) => (step, (*dir).clone()),
                    None => {
                        return Err(MetadataError::Invalid {
                            what: format!(
                                "{path} names step {step} but {prefix} has no {STEP_DIR_PREFIX}{step} directory"
                            ),
                        });
                    }
                }
            }
            None => match steps.last_key_value() {
                Some((&step, dir)) => (step, (*dir).clone()),
                None => return Ok(None),
            },
        };
        let dir = prefix.clone().join(chosen.1.as_str());
        let inner = list_dir(store, &dir).await?;
        if let Some(found) = detect_root(store, &dir, &inner).await? {
            return Ok(Some(BcLocation {
                step: Some(chosen.0),
                followed: Some(chosen.1),
                ..found
            }));
        }
        return Ok(None);
    }
    // An extra_state/ (or loader_ckpt/) directory on its own: only per-rank torch.save files.
    let name = prefix.filename().unwrap_or_default();
    if OBJECT_COMPONENTS.contains(&name)
        && !listing.files.is_empty()
        && listing.files.keys().all(|f| is_object_file(f))
    {
        return Ok(Some(BcLocation {
            root: prefix.clone(),
            components: vec![BcComponent {
                name: name.to_string(),
                dir: String::new(),
                namespace: String::new(),
                listing: listing.clone(),
            }],
            step: None,
            followed: None,
        }));
    }
    Ok(None)
}

/// A save's root: at least one tensor component holding ByteCheckpoint's `.metadata`.
async fn detect_root(
    store: &dyn ObjectStore,
    prefix: &Path,
    listing: &Listing,
) -> Result<Option<BcLocation>, MetadataError> {
    if !TENSOR_COMPONENTS.iter().any(|c| listing.dirs.contains(*c)) {
        return Ok(None);
    }
    let mut components = Vec::new();
    for name in TENSOR_COMPONENTS.iter().chain(OBJECT_COMPONENTS.iter()) {
        if !listing.dirs.contains(*name) {
            continue;
        }
        let dir = prefix.clone().join(*name);
        let inner = list_dir(store, &dir).await?;
        if TENSOR_COMPONENTS.contains(name) {
            if !sniff(store, &dir, &inner).await? {
                // A torch DCP (or anything else) under model/: not ByteCheckpoint's.
                return Ok(None);
            }
        } else if !inner.files.keys().any(|f| is_object_file(f)) {
            continue;
        }
        components.push(BcComponent {
            name: name.to_string(),
            dir: name.to_string(),
            namespace: format!("{name}."),
            listing: inner,
        });
    }
    Ok(Some(BcLocation {
        root: prefix.clone(),
        components,
        step: None,
        followed: None,
    }))
}

fn join(dir: &str, name: &str) -> String {
    if dir.is_empty() {
        name.to_string()
    } else {
        format!("{dir}/{name}")
    }
}

/// Opens the ByteCheckpoint save [`detect`] found: parses every component's `.metadata` (torch's
/// fields and ByteCheckpoint's), locates every tensor chunk's bytes from its storage info and
/// rebuild descriptor, lists bytes entries and per-rank files as objects, and validates the
/// model. No data byte is read. Errors name the file, the tensor and the chunk.
pub async fn open_bytecheckpoint(
    store: &dyn ObjectStore,
    location: &BcLocation,
    options: &DcpOptions,
) -> Result<BcCheckpoint, MetadataError> {
    let root = &location.root;
    let mut b = BcBuilder {
        identity: IdentityHasher::new(Format::ByteCheckpoint),
        tensors: Vec::new(),
        chunks: Vec::new(),
        objects: Vec::new(),
        files: Vec::new(),
        file_index: HashMap::new(),
        flat_params: FlatParams::new(),
        details: BcDetails {
            version: None,
            components: Vec::new(),
            followed: location.followed.clone(),
        },
    };
    for component in &location.components {
        let dir = resolve_dir(root, &component.dir)?;
        if component.listing.files.contains_key(METADATA_FILE) {
            b.add_component(store, component, &dir, options).await?;
        } else {
            b.add_object_files(component);
        }
    }
    if b.details.components.is_empty() {
        return Err(MetadataError::Invalid {
            what: format!(
                "{root}: no ByteCheckpoint component (model/, optimizer/, extra_state/) found"
            ),
        });
    }
    let BcBuilder {
        identity,
        tensors,
        chunks,
        objects,
        files,
        details,
        ..
    } = b;
    let meta =
        CheckpointMeta::new(tensors, chunks, objects, files)?.with_identity(identity.finish());
    validate(&meta)?;
    Ok(BcCheckpoint { meta, details })
}

/// The checkpoint model being built component by component, and its identity: every metadata
/// file read and every data file's name and size, in the order they are met.
struct BcBuilder {
    identity: IdentityHasher,
    tensors: Vec<TensorMeta>,
    chunks: Vec<SavedChunk>,
    objects: Vec<ObjectMeta>,
    files: Vec<DataFile>,
    /// Data file index by path relative to the root.
    file_index: HashMap<String, u32>,
    /// How a decomposed FSDP save's flat parameters split: from the model's `.metadata`, and
    /// used for the optimizer's too (read after it, at a save's root).
    flat_params: FlatParams,
    details: BcDetails,
}

/// A component with a `.metadata` being read: where it is and what its metadata says.
struct ComponentAt<'c> {
    component: &'c BcComponent,
    /// Its directory.
    dir: &'c Path,
    /// Its `.metadata` (for messages).
    path: &'c Path,
    fields: &'c BcFields,
}

impl BcBuilder {
    /// The index of the data file at `path` (relative to the root), added the first time.
    fn add_file(&mut self, path: String, size: u64) -> u32 {
        *self.file_index.entry(path.clone()).or_insert_with(|| {
            self.identity
                .part(path.as_bytes())
                .part(&size.to_le_bytes());
            self.files.push(DataFile {
                path,
                size: Some(size),
                encoded: None,
            });
            (self.files.len() - 1) as u32
        })
    }

    /// A component without a `.metadata`: per-rank torch.save files, each one object over the
    /// whole file.
    fn add_object_files(&mut self, component: &BcComponent) {
        for (name, &size) in &component.listing.files {
            if !is_object_file(name) {
                continue;
            }
            let stem = name.trim_end_matches(".pt");
            let stem = stem
                .strip_prefix(&format!("{}_", component.name))
                .unwrap_or(stem);
            let file = self.add_file(join(&component.dir, name), size);
            self.objects.push(ObjectMeta {
                key: format!("{}{stem}", namespace_or(component)),
                file,
                offset: 0,
                length: size,
                crc32c: None,
            });
        }
        self.details.components.push(BcComponentDetails {
            name: component.name.clone(),
            dir: component.dir.clone(),
            metadata_file: None,
            metadata: DcpMetadata::default(),
            version: None,
            user_defined_keys: Vec::new(),
            metadata_bytes: 0,
        });
    }

    /// A component with a `.metadata` (in `dir`): its tensors and objects.
    async fn add_component(
        &mut self,
        store: &dyn ObjectStore,
        component: &BcComponent,
        dir: &Path,
        options: &DcpOptions,
    ) -> Result<(), MetadataError> {
        let path = dir.clone().join(METADATA_FILE);
        let size = component.listing.files[METADATA_FILE];
        if size > options.limits.max_input as u64 {
            return Err(MetadataError::Decode {
                path: path.to_string(),
                what: "ByteCheckpoint metadata",
                detail: format!(
                    "{size} bytes exceed the {}-byte cap",
                    options.limits.max_input
                ),
            });
        }
        let bytes = read_whole(store, &path).await?;
        let metadata_name = join(&component.dir, METADATA_FILE);
        self.identity.part(metadata_name.as_bytes()).part(&bytes);
        // torch's fields through the DCP reader, ByteCheckpoint's here: two passes of the VM
        // over the same bytes keep the DCP reader unaware of this format.
        let metadata = parse_metadata(&bytes, path.as_ref(), &options.limits)?;
        let fields = parse_bc_fields(&bytes, path.as_ref(), &options.limits)?;
        if self.details.version.is_none() {
            self.details.version = fields.version.clone();
        }
        // A decomposed FSDP save: the model's `.metadata` says how its flat parameters split;
        // the optimizer's (read after it, at a save's root) uses the same layouts.
        if !fields.flat_params.is_empty() {
            self.flat_params = fields.flat_params.clone();
        }
        let at = ComponentAt {
            component,
            dir,
            path: &path,
            fields: &fields,
        };
        for tensor in &metadata.tensors {
            self.add_tensor(&at, tensor)?;
        }
        let ns = namespace_or(component);
        for object in &metadata.objects {
            let key = format!("{ns}{}", object.fqn);
            let info = &object.storage;
            let (file, full, size) = self.file_of(&at, &info.relative_path)?;
            check_range(&key, "(object)", &full, info, size)?;
            self.objects.push(ObjectMeta {
                key,
                file,
                offset: info.offset,
                length: info.length,
                crc32c: None,
            });
        }
        self.details.components.push(BcComponentDetails {
            name: component.name.clone(),
            dir: component.dir.clone(),
            metadata_file: Some(metadata_name),
            metadata,
            version: fields.version,
            user_defined_keys: fields.user_defined_keys,
            metadata_bytes: bytes.len() as u64,
        });
        Ok(())
    }

    /// The data file `relative` (to the component's directory) that the component's metadata
    /// names: its index, full path and size. A file not in the directory is refused.
    fn file_of(
        &mut self,
        at: &ComponentAt<'_>,
        relative: &str,
    ) -> Result<(u32, Path, u64), MetadataError> {
        let full = resolve(at.dir, relative)?;
        let Some(&size) = at.component.listing.files.get(relative) else {
            return Err(MetadataError::Invalid {
                what: format!("data file {full} (named in {}) does not exist", at.path),
            });
        };
        Ok((
            self.add_file(join(&at.component.dir, relative), size),
            full,
            size,
        ))
    }

    /// One saved tensor: each chunk located from its storage info and rebuild descriptor, then
    /// added as it is, or, for a flat parameter of a decomposed FSDP save, as the parameters
    /// it holds.
    fn add_tensor(
        &mut self,
        at: &ComponentAt<'_>,
        tensor: &DcpTensor,
    ) -> Result<(), MetadataError> {
        let ns = namespace_or(at.component);
        let path = at.path;
        let fqn = format!("{ns}{}", tensor.fqn);
        let mut located = Vec::with_capacity(tensor.chunks.len());
        for chunk in &tensor.chunks {
            let region = TensorBox::new(chunk.offsets.clone(), chunk.sizes.clone());
            let info = &chunk.storage;
            let (file, full, size) = self.file_of(at, &info.relative_path)?;
            check_range(&fqn, &region.to_string(), &full, info, size)?;
            let bad = |detail: String| MetadataError::Blob {
                path: full.to_string(),
                start: info.offset,
                end: info.offset.saturating_add(info.length),
                entry: format!("tensor {fqn} chunk {region}"),
                detail,
            };
            let key = (tensor.fqn.clone(), Some(chunk.offsets.clone()));
            let descriptor = match at.fields.descriptors.get(&key) {
                Some(Some(bytes)) => parse_tensor_descriptor(bytes, &DESCRIPTOR_LIMITS)
                    .map_err(|e| bad(format!("its rebuild descriptor in {path}: {e}")))?,
                Some(None) => {
                    return Err(bad(format!(
                        "{path} records no rebuild descriptor for it (None in all_tensor_metadata)"
                    )));
                }
                None => {
                    return Err(bad(format!(
                        "{path} has no all_tensor_metadata entry for it"
                    )));
                }
            };
            located.push(locate(&descriptor, tensor.dtype, 0, &region, info, file).map_err(bad)?);
        }
        match flat_param_of(&self.flat_params, &tensor.fqn) {
            Some((key, state)) if tensor.shape.len() == 1 => {
                let derived = unflatten(&self.flat_params[key], key, state, tensor, &located)
                    .map_err(|detail| MetadataError::Invalid {
                        what: format!("{path}: flat parameter {fqn}: {detail}"),
                    })?;
                for (name, shape, mut parts) in derived {
                    let t = self.tensors.len() as u32;
                    self.tensors
                        .push(TensorMeta::new(format!("{ns}{name}"), tensor.dtype, shape));
                    parts.iter_mut().for_each(|c| c.tensor = t);
                    self.chunks.extend(parts);
                }
            }
            _ => {
                let t = self.tensors.len() as u32;
                self.tensors.push(TensorMeta::new(
                    fqn.clone(),
                    tensor.dtype,
                    tensor.shape.clone(),
                ));
                self.chunks
                    .extend(located.into_iter().map(|c| SavedChunk { tensor: t, ..c }));
            }
        }
        Ok(())
    }
}

/// Name of the FSDP flat parameter in keys (`torch.distributed.fsdp._unshard_param_utils.FLAT_PARAM`).
const FLAT_PARAM: &str = "_flat_param";

/// The flat parameter a saved tensor is, or the optimizer state of: `<key>` (model) or
/// `state.<key>.<state>` (optimizer), with the state's name.
fn flat_param_of<'a>(flat: &'a FlatParams, fqn: &'a str) -> Option<(&'a str, Option<&'a str>)> {
    if flat.is_empty() {
        return None;
    }
    if let Some((key, _)) = flat.get_key_value(fqn) {
        return Some((key.as_str(), None));
    }
    let rest = fqn.strip_prefix("state.")?;
    flat.keys().find_map(|key| {
        let state = rest.strip_prefix(key.as_str())?.strip_prefix('.')?;
        Some((key.as_str(), Some(state)))
    })
}

/// The original parameter's name from a flat parameter's key and a slot's name, the way
/// ByteCheckpoint's merge tool forms it: the key without `_flat_param`, then the slot's name
/// without the longest overlap between the two (older saves repeat the module path).
fn param_name(key: &str, slot: &str) -> String {
    let prefix = key.replace(FLAT_PARAM, "");
    let overlap = (1..=prefix.len())
        .rev()
        .find(|&n| {
            prefix.is_char_boundary(prefix.len() - n)
                && slot.starts_with(&prefix[prefix.len() - n..])
        })
        .unwrap_or(0);
    format!("{prefix}{}", &slot[overlap.min(slot.len())..])
}

/// One original parameter (or its optimizer state) out of a flat tensor: name, shape, chunks.
type Unflattened = (String, Vec<u64>, Vec<SavedChunk>);

/// A decomposed FSDP save's flat tensor (a flat parameter, or an optimizer state of one) split
/// into the original parameters: every saved chunk is a range `[s, e)` of the flat tensor,
/// stored contiguously; the part of it inside a parameter's slot `[a, b)` is the flat range
/// `[max(a,s) − a, min(b,e) − a)` of that parameter, saved as the few boxes that tile it. Padding
/// slots are dropped, and a parameter no chunk touches (frozen, or on no optimizer) is not
/// exposed. Returns (name, shape, chunks) per parameter.
fn unflatten(
    slots: &[FlatSlot],
    key: &str,
    state: Option<&str>,
    tensor: &crate::formats::dcp::DcpTensor,
    located: &[SavedChunk],
) -> Result<Vec<Unflattened>, String> {
    let total: u64 = slots.iter().map(|s| s.numel).sum();
    if tensor.shape != [total] {
        return Err(format!(
            "shape {:?} but its {} slots hold {total} elements",
            tensor.shape,
            slots.len()
        ));
    }
    let esize = tensor.dtype.size();
    let mut out = Vec::new();
    let mut start = 0u64;
    for slot in slots {
        let (a, b) = (start, start + slot.numel);
        start = b;
        let Some((name, shape)) = &slot.param else {
            continue;
        };
        let whole = TensorBox::whole(shape);
        let mut parts = Vec::new();
        for chunk in located {
            if chunk.bytes.strides.is_some() {
                return Err(format!("chunk {} is not stored contiguously", chunk.region));
            }
            let (s, e) = (
                chunk.region.offsets[0],
                chunk.region.offsets[0] + chunk.region.lengths[0],
            );
            let (lo, hi) = (a.max(s), b.min(e));
            if lo < hi {
                parts.extend(flat_range_chunks(
                    0,
                    &whole,
                    lo - a,
                    hi - a,
                    chunk.bytes.file,
                    chunk.bytes.offset + (lo - s) * esize,
                    esize,
                ));
            }
        }
        if parts.is_empty() {
            continue;
        }
        let param = param_name(key, name);
        let name = match state {
            None => param,
            Some(state) => format!("state.{param}.{state}"),
        };
        out.push((name, shape.clone(), parts));
    }
    Ok(out)
}

fn namespace_or(component: &BcComponent) -> &str {
    &component.namespace
}

fn resolve_dir(root: &Path, dir: &str) -> Result<Path, MetadataError> {
    if dir.is_empty() {
        Ok(root.clone())
    } else {
        resolve(root, dir)
    }
}

/// The saved chunk a descriptor and its storage info give: the storage's bytes are
/// `[info.offset, info.offset + info.length)`, and must be exactly the storage the descriptor
/// names; the chunk's first element sits `storage_offset` elements in, with the descriptor's
/// strides.
fn locate(
    descriptor: &TensorDescriptor,
    dtype: crate::DType,
    tensor: u32,
    region: &TensorBox,
    info: &StorageInfo,
    file: u32,
) -> Result<SavedChunk, String> {
    if descriptor.dtype != dtype {
        return Err(format!(
            "its descriptor holds {} but .metadata says {dtype}",
            descriptor.dtype
        ));
    }
    if descriptor.size.as_slice() != region.lengths.as_slice() {
        return Err(format!(
            "its descriptor has size {:?} but .metadata says the chunk has sizes {:?}",
            descriptor.size,
            region.lengths.as_slice()
        ));
    }
    let storage = descriptor.storage_bytes();
    if storage != Some(info.length) {
        return Err(format!(
            "storage_data gives it {} bytes but its descriptor's storage is {} {} ({} bytes)",
            info.length,
            descriptor.storage_numel,
            if descriptor.untyped {
                "bytes".to_string()
            } else {
                format!("elements of {}", descriptor.dtype)
            },
            storage.map_or("too many".to_string(), |b| b.to_string())
        ));
    }
    let blob = TensorBlob {
        dtype,
        size: descriptor.size.clone(),
        stride: descriptor.stride.clone(),
        storage_offset: descriptor.storage_offset,
        data_offset: 0,
        data_len: info.length,
        data_crc32: None,
    };
    let span = blob.span_bytes()?;
    let offset = descriptor
        .storage_offset
        .checked_mul(dtype.size())
        .and_then(|o| o.checked_add(info.offset))
        .ok_or_else(|| "storage offset overflows".to_string())?;
    Ok(SavedChunk {
        tensor,
        region: region.clone(),
        bytes: ByteMeta {
            file,
            offset,
            length: span,
            strides: stored_strides(&descriptor.stride, &region.lengths),
        },
        crc32c: None,
        crc32: None,
    })
}

/// The stored strides when they are not row-major over `sizes` (dims of extent 1 do not count).
fn stored_strides(stride: &[u64], sizes: &[u64]) -> Option<Vec<u64>> {
    if sizes.contains(&0) {
        return None;
    }
    let row_major = row_major_strides(sizes);
    let same = sizes
        .iter()
        .zip(stride)
        .zip(&row_major)
        .all(|((&n, s), r)| n <= 1 || s == r);
    (!same).then(|| stride.to_vec())
}

/// The components' names, for messages: `model, optimizer, extra_state`.
pub fn component_names(details: &BcDetails) -> String {
    details
        .components
        .iter()
        .map(|c| c.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_names_drop_the_overlap_of_key_and_slot_like_bytecheckpoints_merge_tool() {
        assert_eq!(param_name("_flat_param", "emb.weight"), "emb.weight");
        assert_eq!(
            param_name("layers.0._flat_param", "attn.w"),
            "layers.0.attn.w"
        );
        // Older saves repeat the module path in the slot's name.
        assert_eq!(
            param_name("layers.0._flat_param", "layers.0.attn.w"),
            "layers.0.attn.w"
        );
        assert_eq!(param_name("a.b._flat_param", "b.c"), "a.b.c");
    }

    #[test]
    fn tracker_steps_and_metadata_sniffing() {
        assert_eq!(step_of_dir("global_step_120"), Some(120));
        assert_eq!(step_of_dir("global_step_"), None);
        assert_eq!(step_of_dir("global_step120"), None);
        assert!(is_bytecheckpoint_metadata(
            b"\x80\x04\x95\x86\x16\x00\x00\x00\x00\x00\x00\x8c%bytecheckpoint.checkpointer.meta_type\x94"
        ));
        assert!(!is_bytecheckpoint_metadata(
            b"\x80\x04\x95\x86\x16\x00\x00\x00\x00\x00\x00\x8c%torch.distributed.checkpoint.metadata"
        ));
    }
}
