//! DeepSpeed ZeRO-1/2/3 checkpoints (`engine.save_checkpoint`) read in place, without DeepSpeed's
//! offline `zero_to_fp32` step:
//!
//! ```text
//! <dir>/latest                                    text: the tag, e.g. "global_step1000"
//! <dir>/<tag>/mp_rank_00_model_states.pt          ZeRO-1/2: param_shapes, module, config, client state
//! <dir>/<tag>/zero_pp_rank_R_mp_rank_00_model_states.pt   ZeRO-3: one per data-parallel rank
//! <dir>/<tag>/[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt
//!                                                 rank R's flat fp32 partition of every group,
//!                                                 its optimizer moments, partition_count, ...
//! ```
//!
//! Every file is a `torch.save` zip: its directory and `data.pkl` are read, never the storage
//! records (`data/N`), whose positions come from their local headers ([`torchfile`]). Which
//! elements of which parameter lie where in the flat partitions follows `zero_to_fp32.py`
//! ([`layout`]); each run is a flat-range chunk ([`crate::flat_range_chunks`]), so the planner
//! reads any rank's box of a parameter straight from the partitions.
//!
//! Exposed: the fp32 master weights under the parameter names (what `zero_to_fp32` gives), frozen
//! parameters and buffers likewise, tied parameters under both names; the optimizer's
//! per-partition tensors as `optimizer.state.<name>.<key>` (`exp_avg`, `exp_avg_sq`, ...); the
//! module's state dict as saved (16-bit weights in mixed precision) as `module.<name>`; the other
//! model-state entries (`ds_config`, `ds_version`, `global_steps`, client state) and the optimizer's
//! `param_groups` as objects. See `docs/formats/deepspeed.md`.

pub mod layout;
pub mod states;
pub mod torchfile;
mod verify;

use std::collections::{BTreeMap, HashMap};

use futures::StreamExt;
use object_store::ObjectStore;
use object_store::path::Path;
use serde_json::Value as Json;

use crate::formats::native::{read_whole, resolve};
use crate::formats::torch::blob::{PickledTensor, TensorBlob};
use crate::formats::{Format, Listing, list_dir};
use crate::identity::IdentityHasher;
use crate::{
    ByteMeta, CheckpointMeta, DType, DataFile, MetadataError, ObjectMeta, SavedChunk, TensorBox,
    TensorMeta, flat_range_chunks, row_major_strides, validate,
};
use layout::Piece;
use states::{ModelStates, OptimStates};
use torchfile::{Record, TorchFile};

pub use verify::{DeepSpeedVerifyReport, verify_deepspeed};

/// The file naming the newest tag.
pub const LATEST_FILE: &str = "latest";
/// Largest `latest` file read (a tag is a directory name).
const MAX_LATEST: u64 = 4096;
/// Files opened at once.
const CONCURRENCY: usize = 16;
/// FQN prefix of the module's state dict as saved.
pub const MODULE_PREFIX: &str = "module.";
/// FQN prefix of optimizer state: `optimizer.state.<param>.<key>`.
pub const OPTIMIZER_PREFIX: &str = "optimizer.state.";

/// What is DeepSpeed-specific about an opened checkpoint.
#[derive(Clone, Debug)]
pub struct DeepSpeedDetails {
    /// The tag directory read (from `latest`), when the location was the save directory.
    pub tag: Option<String>,
    /// ZeRO stage (0 when there are no optimizer state files).
    pub zero_stage: u64,
    /// Data-parallel ranks (optimizer state files).
    pub dp_world_size: usize,
    /// DeepSpeed version recorded in the model states.
    pub ds_version: Option<String>,
    /// Object values (decoded when simple), by key, in [`CheckpointMeta::objects`] order.
    pub objects: Vec<(String, Option<Json>)>,
    /// Every storage record and pickle of every file, for [`verify_deepspeed`].
    pub records: Vec<(u32, Record)>,
    /// Requests made and bytes read at open.
    pub requests: u64,
    /// Bytes read at open.
    pub bytes_read: u64,
}

/// A DeepSpeed checkpoint, opened.
#[derive(Clone, Debug)]
pub struct DeepSpeedCheckpoint {
    /// The checkpoint model.
    pub meta: CheckpointMeta,
    /// The rest.
    pub details: DeepSpeedDetails,
}

/// What a file name in a tag directory is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    /// `mp_rank_XX_model_states.pt` (dp `None`) or `zero_pp_rank_R_mp_rank_XX_model_states.pt`.
    Model { dp: Option<usize>, mp: usize },
    /// `[bf16_]zero_pp_rank_R_mp_rank_XX_optim_states.pt`.
    Optim { dp: usize, mp: usize, bf16: bool },
    /// Another `*_states.pt`: pipeline layers, MoE experts.
    Other,
}

fn digits(s: &str) -> Option<usize> {
    (!s.is_empty() && s.len() <= 9 && s.bytes().all(|b| b.is_ascii_digit()))
        .then(|| s.parse().ok())
        .flatten()
}

fn classify(name: &str) -> Option<Kind> {
    if let Some(rest) = name.strip_suffix("_model_states.pt") {
        if let Some(mp) = rest.strip_prefix("mp_rank_").and_then(digits) {
            return Some(Kind::Model { dp: None, mp });
        }
        if let Some((dp, mp)) = rest
            .strip_prefix("zero_pp_rank_")
            .and_then(|r| r.split_once("_mp_rank_"))
            && let (Some(dp), Some(mp)) = (digits(dp), digits(mp))
        {
            return Some(Kind::Model { dp: Some(dp), mp });
        }
        return Some(Kind::Other);
    }
    if name.ends_with("model_states.pt") {
        return Some(Kind::Other);
    }
    if let Some(rest) = name.strip_suffix("_optim_states.pt") {
        let (bf16, rest) = match rest.strip_prefix("bf16_") {
            Some(rest) => (true, rest),
            None => (false, rest),
        };
        if let Some((dp, mp)) = rest
            .strip_prefix("zero_pp_rank_")
            .and_then(|r| r.split_once("_mp_rank_"))
            && let (Some(dp), Some(mp)) = (digits(dp), digits(mp))
        {
            return Some(Kind::Optim { dp, mp, bf16 });
        }
        return Some(Kind::Other);
    }
    name.ends_with("optim_states.pt").then_some(Kind::Other)
}

/// True when `listing` is a DeepSpeed tag directory: model states and optimizer states files.
pub fn is_deepspeed(listing: &Listing) -> bool {
    let model = listing
        .files
        .keys()
        .any(|n| n.ends_with("_model_states.pt"));
    let optim = listing
        .files
        .keys()
        .any(|n| n.ends_with("_optim_states.pt"));
    model && optim
}

/// Where the DeepSpeed files of the location with `listing` are: the location itself (a tag
/// directory), or the tag its `latest` file names. `None` when neither holds DeepSpeed files.
pub async fn locate(
    store: &dyn ObjectStore,
    prefix: &Path,
    listing: &Listing,
) -> Result<Option<(Option<String>, Listing)>, MetadataError> {
    if is_deepspeed(listing) {
        return Ok(Some((None, listing.clone())));
    }
    let Some(&size) = listing.files.get(LATEST_FILE) else {
        return Ok(None);
    };
    let path = prefix.clone().join(LATEST_FILE);
    if size > MAX_LATEST {
        return Ok(None);
    }
    let bytes = read_whole(store, &path).await?;
    let Ok(text) = std::str::from_utf8(&bytes) else {
        return Ok(None);
    };
    let tag = text.trim();
    // A tag is one directory name; anything else is not DeepSpeed's pointer.
    if tag.is_empty() || tag.contains('/') || tag == "." || tag == ".." {
        return Ok(None);
    }
    if !listing.dirs.contains(tag) {
        return Ok(None);
    }
    let tag_prefix = resolve(prefix, tag)?;
    let inner = list_dir(store, &tag_prefix).await?;
    let has_model = inner.files.keys().any(|n| n.ends_with("_model_states.pt"));
    Ok(has_model.then(|| (Some(tag.to_string()), inner)))
}

/// A tensor of a torch.save file located: the byte of its element `i` (for contiguous 1-D
/// tensors) or its whole span.
struct Located<'a> {
    file: u32,
    torch: &'a TorchFile,
    record: &'a Record,
    tensor: &'a PickledTensor,
    what: String,
}

impl<'a> Located<'a> {
    fn new(
        file: u32,
        torch: &'a TorchFile,
        tensor: &'a PickledTensor,
        what: String,
    ) -> Result<Self, MetadataError> {
        let Some(record) = torch.records.get(&tensor.key) else {
            return Err(torch.error(format!(
                "{what}: data.pkl refers to storage data/{}, which is not in the archive",
                tensor.key
            )));
        };
        let len = record.range.end - record.range.start;
        if len != tensor.storage_bytes {
            return Err(torch.error(format!(
                "{what}: storage {} holds {len} bytes but data.pkl says {} (a truncated or mismatched partition)",
                record.member, tensor.storage_bytes
            )));
        }
        let located = Located {
            file,
            torch,
            record,
            tensor,
            what,
        };
        located.blob().span_bytes().map_err(|e| located.error(e))?;
        Ok(located)
    }

    fn error(&self, detail: impl std::fmt::Display) -> MetadataError {
        MetadataError::Blob {
            path: self.torch.path.to_string(),
            start: self.record.range.start,
            end: self.record.range.end,
            entry: self.what.clone(),
            detail: detail.to_string(),
        }
    }

    fn blob(&self) -> TensorBlob {
        TensorBlob {
            dtype: self.tensor.dtype,
            size: self.tensor.size.clone(),
            stride: self.tensor.stride.clone(),
            storage_offset: self.tensor.storage_offset,
            data_offset: self.record.range.start,
            data_len: self.record.range.end - self.record.range.start,
            data_crc32: Some(self.record.crc32),
        }
    }

    fn numel(&self) -> u64 {
        self.tensor.size.iter().product()
    }

    /// Checks that the tensor is contiguous (row-major) and returns the file byte of its first
    /// element: a flat partition is addressed element by element.
    fn contiguous_start(&self) -> Result<u64, MetadataError> {
        let row_major = row_major_strides(&self.tensor.size);
        let same = self
            .tensor
            .size
            .iter()
            .zip(&self.tensor.stride)
            .zip(&row_major)
            .all(|((&n, s), r)| n <= 1 || s == r);
        if !same {
            return Err(self.error(format!(
                "is stored with strides {:?}, not contiguously",
                self.tensor.stride
            )));
        }
        Ok(self.record.range.start + self.tensor.storage_offset * self.tensor.dtype.size())
    }

    /// The whole tensor as one saved chunk of `tensor` (its own strides when not row-major).
    fn whole_chunk(&self, tensor: u32) -> Result<SavedChunk, MetadataError> {
        let blob = self.blob();
        let span = blob.span_bytes().map_err(|e| self.error(e))?;
        let sizes = &self.tensor.size;
        let row_major = row_major_strides(sizes);
        let same = sizes
            .iter()
            .zip(&self.tensor.stride)
            .zip(&row_major)
            .all(|((&n, s), r)| n <= 1 || s == r);
        Ok(SavedChunk {
            tensor,
            region: TensorBox::whole(sizes),
            bytes: ByteMeta {
                file: self.file,
                offset: self.record.range.start + self.tensor.storage_offset * blob.dtype.size(),
                length: span,
                strides: (!same && !sizes.contains(&0)).then(|| self.tensor.stride.clone()),
            },
            crc32c: None,
            crc32: None,
        })
    }
}

/// Collects tensors and chunks, refusing a name given twice.
#[derive(Default)]
struct Builder {
    tensors: Vec<TensorMeta>,
    chunks: Vec<SavedChunk>,
    index: HashMap<String, u32>,
}

impl Builder {
    fn add(&mut self, fqn: &str, dtype: DType, shape: Vec<u64>) -> Result<u32, MetadataError> {
        if self.index.contains_key(fqn) {
            return Err(MetadataError::Invalid {
                what: format!("tensor {fqn} is named twice by the DeepSpeed files"),
            });
        }
        let t = self.tensors.len() as u32;
        self.tensors.push(TensorMeta::new(fqn, dtype, shape));
        self.index.insert(fqn.to_string(), t);
        Ok(t)
    }
}

fn numel(shape: &[u64]) -> Result<u64, MetadataError> {
    shape
        .iter()
        .try_fold(1u64, |a, &n| a.checked_mul(n))
        .ok_or_else(|| MetadataError::Invalid {
            what: format!("shape {shape:?} overflows"),
        })
}

/// Unpickles a file's `data.pkl` and reads it with `parse`; errors name the file.
fn decode<T>(
    file: &TorchFile,
    what: &'static str,
    parse: fn(&crate::formats::torch::pickle::Pickle) -> Result<T, String>,
) -> Result<T, MetadataError> {
    states::load(&file.pkl)
        .and_then(|p| parse(&p))
        .map_err(|detail| MetadataError::Decode {
            path: file.path.to_string(),
            what,
            detail,
        })
}

/// Opens the DeepSpeed checkpoint at `prefix` whose files `located` found (the tag and the tag
/// directory's listing). Errors name the file (and the tensor): [`MetadataError::Decode`] for a
/// pickle that cannot be read, [`MetadataError::Blob`] for a damaged archive or a partition that
/// does not hold what the layout needs, [`MetadataError::Unsupported`] for what is not read
/// (model/pipeline parallelism, MoE expert groups).
pub async fn open_deepspeed(
    store: &dyn ObjectStore,
    prefix: &Path,
    tag: Option<String>,
    listing: &Listing,
) -> Result<DeepSpeedCheckpoint, MetadataError> {
    let dir = match &tag {
        Some(tag) => resolve(prefix, tag)?,
        None => prefix.clone(),
    };
    let roles = FileRoles::classify(&dir, listing)?;
    let names = roles.read_order();
    let files = read_files(store, &dir, tag.as_deref(), &names, listing).await?;
    let file_of: HashMap<&str, u32> = names
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i as u32))
        .collect();

    let model_file = &files[0];
    let model: ModelStates = decode(model_file, "DeepSpeed model states", states::model_states)?;
    let mut ranks: Vec<(u32, OptimStates)> = Vec::with_capacity(roles.optims.len());
    for (name, _) in roles.optims.values() {
        let f = file_of[name.as_str()];
        let o: OptimStates = decode(
            &files[f as usize],
            "DeepSpeed optimizer states",
            states::optim_states,
        )?;
        ranks.push((f, o));
    }
    let bf16 = roles.optims.values().any(|(_, b)| *b);
    let stage = zero_stage(&files, &ranks, bf16)?;

    let mut b = Builder::default();
    let parts = Partitions::locate(&files, &ranks, stage, &model, model_file)?;
    parts.check_slice_mappings()?;
    parts.add_params(&mut b)?;
    parts.add_moments(&mut b)?;
    let model_files = model_files(&dir, &roles, &file_of, &files, &model, stage)?;
    add_frozen(&mut b, &model, &files, &model_files)?;
    add_module(&mut b, &model, model_file, stage)?;
    add_tied(&mut b, &model)?;
    let (objects, values) = objects(&model, model_file, &files, &ranks);

    let table = FileTable::of(tag.as_deref(), &files);
    let Builder {
        tensors, chunks, ..
    } = b;
    let meta = CheckpointMeta::new(tensors, chunks, objects, table.data_files)?
        .with_identity(table.identity);
    validate(&meta)?;
    Ok(DeepSpeedCheckpoint {
        meta,
        details: DeepSpeedDetails {
            tag,
            zero_stage: stage,
            dp_world_size: roles.optims.len(),
            ds_version: model.ds_version.clone(),
            objects: values,
            records: table.records,
            requests: table.requests,
            bytes_read: table.bytes_read,
        },
    })
}

/// Which file of a tag directory is which: model states by data-parallel rank (`None` for
/// ZeRO-1/2's one file), optimizer states by rank (with whether they are bf16's), and the model
/// states file read first (its pickle names the parameters).
struct FileRoles {
    models: BTreeMap<Option<usize>, String>,
    optims: BTreeMap<usize, (String, bool)>,
    first_model: String,
}

impl FileRoles {
    /// Sorts the listing's files into roles, refusing model-parallel, pipeline and MoE saves,
    /// two optimizer states files of one rank, ranks missing, and a save without model states.
    fn classify(dir: &Path, listing: &Listing) -> Result<Self, MetadataError> {
        let mut models: BTreeMap<Option<usize>, String> = BTreeMap::new();
        let mut optims: BTreeMap<usize, (String, bool)> = BTreeMap::new();
        for name in listing.files.keys() {
            match classify(name) {
                None => {}
                Some(Kind::Model { mp, .. } | Kind::Optim { mp, .. }) if mp != 0 => {
                    return Err(MetadataError::Unsupported {
                        path: dir.clone().join(name.as_str()).to_string(),
                        detail: format!(
                            "a model-parallel DeepSpeed save (mp_rank_{mp:02}): its tensor-parallel shards \
                             do not record how they split each parameter (convert it with DeepSpeed's \
                             ds_to_universal.py first)"
                        ),
                    });
                }
                Some(Kind::Other) => {
                    return Err(MetadataError::Unsupported {
                        path: dir.clone().join(name.as_str()).to_string(),
                        detail:
                            "a pipeline-layer or MoE expert states file: DeepSpeed pipeline and \
                                 expert-parallel saves are not read (only ZeRO data parallelism)"
                                .to_string(),
                    });
                }
                Some(Kind::Model { dp, .. }) => {
                    models.insert(dp, name.clone());
                }
                Some(Kind::Optim { dp, bf16, .. }) => {
                    if let Some((other, _)) = optims.insert(dp, (name.clone(), bf16)) {
                        return Err(MetadataError::Invalid {
                            what: format!(
                                "{dir}: {other} and {name} are both optimizer states of data-parallel rank {dp}"
                            ),
                        });
                    }
                }
            }
        }
        let world = optims.len();
        if let Some((&last, _)) = optims.last_key_value()
            && last + 1 != world
        {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{dir}: optimizer states of data-parallel ranks {:?}: ranks 0..{} expected (a save that did not finish on every rank?)",
                    optims.keys().collect::<Vec<_>>(),
                    last + 1
                ),
            });
        }
        let Some(first_model) = models.get(&None).or_else(|| models.get(&Some(0))) else {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{dir}: no mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt"
                ),
            });
        };
        let first_model = first_model.clone();
        Ok(FileRoles {
            models,
            optims,
            first_model,
        })
    }

    /// The files to read, the first model states first (file 0), then the other model states,
    /// then the optimizer states in rank order: the order of the checkpoint's data files.
    fn read_order(&self) -> Vec<String> {
        let mut names: Vec<String> = vec![self.first_model.clone()];
        names.extend(
            self.models
                .values()
                .filter(|n| **n != self.first_model)
                .cloned(),
        );
        names.extend(self.optims.values().map(|(n, _)| n.clone()));
        names
    }
}

/// Reads every file's zip directory and pickle, [`CONCURRENCY`] at a time, in `names` order.
async fn read_files(
    store: &dyn ObjectStore,
    dir: &Path,
    tag: Option<&str>,
    names: &[String],
    listing: &Listing,
) -> Result<Vec<TorchFile>, MetadataError> {
    let relative = |name: &str| match tag {
        Some(tag) => format!("{tag}/{name}"),
        None => name.to_string(),
    };
    let files: Vec<Result<TorchFile, MetadataError>> =
        futures::stream::iter(names.iter().map(|name| {
            let relative = &relative;
            async move {
                let path = resolve(dir, name)?;
                let size = listing.files.get(name).copied().unwrap_or(0);
                torchfile::read(store, path, relative(name), size).await
            }
        }))
        .buffered(CONCURRENCY)
        .collect()
        .await;
    files.into_iter().collect()
}

/// The ZeRO stage every optimizer states file agrees on (0 without any), after checking that
/// each rank's file fits the others: same stage, partition counts equal to the files found, the
/// same number of flat groups.
fn zero_stage(
    files: &[TorchFile],
    ranks: &[(u32, OptimStates)],
    bf16: bool,
) -> Result<u64, MetadataError> {
    let world = ranks.len();
    let stage = match ranks.first() {
        None => 0,
        Some((f, o)) => match o.zero_stage {
            Some(s) => s,
            // The bf16 optimizer records no stage: it partitions like ZeRO-1.
            None if bf16 => 1,
            None => {
                return Err(files[*f as usize]
                    .error("optimizer_state_dict has no zero_stage: not a ZeRO checkpoint"));
            }
        },
    };
    for (f, o) in ranks {
        let file = &files[*f as usize];
        if o.zero_stage.unwrap_or(stage) != stage {
            return Err(file.error(format!(
                "zero_stage {:?} but rank 0's is {stage}",
                o.zero_stage
            )));
        }
        if let Some(&count) = o.partition_count.iter().find(|&&c| c as usize > world) {
            return Err(file.error(format!(
                "partition_count is {count}, but there are {world} optimizer states files: \
                 ranks are missing (a save that did not finish on every rank?)"
            )));
        }
        if let Some(&count) = o.partition_count.iter().find(|&&c| (c as usize) < world) {
            return Err(MetadataError::Unsupported {
                path: file.path.to_string(),
                detail: format!(
                    "partition_count {count} differs from the {world} optimizer states files \
                     (MoE expert groups partitioned over fewer ranks are not read)"
                ),
            });
        }
        if o.flat_groups.len() != ranks[0].1.flat_groups.len() {
            return Err(file.error(format!(
                "{} flat groups but rank 0 has {}",
                o.flat_groups.len(),
                ranks[0].1.flat_groups.len()
            )));
        }
    }
    if stage > 3 {
        return Err(files[ranks[0].0 as usize].error(format!("unknown zero_stage {stage}")));
    }
    Ok(stage)
}

/// The flat partitions of every rank, located, and which elements of which trainable parameter
/// each holds: what the steps adding the parameters and their optimizer moments share.
struct Partitions<'f> {
    files: &'f [TorchFile],
    /// Each rank's optimizer states file (its index in `files`) and decoded states.
    ranks: &'f [(u32, OptimStates)],
    stage: u64,
    /// Each rank's flat fp32 groups.
    flats: Vec<Vec<Located<'f>>>,
    /// Trainable parameters (name, shape) in `param_shapes` order.
    params: Vec<(String, Vec<u64>)>,
    /// Runs of a parameter's elements in a rank's flat group.
    pieces: Vec<Piece>,
}

impl<'f> Partitions<'f> {
    /// Locates every rank's flat groups (1-D, contiguous) and lays the parameters of
    /// `param_shapes` out over them as `zero_to_fp32.py` does.
    fn locate(
        files: &'f [TorchFile],
        ranks: &'f [(u32, OptimStates)],
        stage: u64,
        model: &ModelStates,
        model_file: &TorchFile,
    ) -> Result<Self, MetadataError> {
        let mut flats: Vec<Vec<Located<'f>>> = Vec::with_capacity(ranks.len());
        for (r, (f, o)) in ranks.iter().enumerate() {
            let torch = &files[*f as usize];
            let mut located = Vec::with_capacity(o.flat_groups.len());
            for (g, t) in o.flat_groups.iter().enumerate() {
                let l = Located::new(*f, torch, t, format!("rank {r} flat fp32 group {g}"))?;
                if l.tensor.size.len() != 1 {
                    return Err(l.error(format!(
                        "is a tensor of size {:?}, not a flat partition",
                        l.tensor.size
                    )));
                }
                l.contiguous_start()?;
                located.push(l);
            }
            flats.push(located);
        }
        let mut parts = Partitions {
            files,
            ranks,
            stage,
            flats,
            params: Vec::new(),
            pieces: Vec::new(),
        };
        if stage >= 1 {
            parts.lay_out(model, model_file)?;
        }
        Ok(parts)
    }

    /// Trainable parameters: names, shapes and where their elements are (per group for
    /// ZeRO-1/2, across all groups for ZeRO-3).
    fn lay_out(
        &mut self,
        model: &ModelStates,
        model_file: &TorchFile,
    ) -> Result<(), MetadataError> {
        let rank0 = &self.files[self.ranks[0].0 as usize];
        let lens: Vec<Vec<u64>> = self
            .flats
            .iter()
            .map(|g| g.iter().map(Located::numel).collect())
            .collect();
        if self.stage <= 2 {
            if model.param_shapes.len() != lens[0].len() {
                return Err(rank0.error(format!(
                    "{} flat groups but param_shapes in {} lists {} groups",
                    lens[0].len(),
                    model_file.name,
                    model.param_shapes.len()
                )));
            }
            for (g, group) in model.param_shapes.iter().enumerate() {
                let base = self.params.len();
                let mut numels = Vec::with_capacity(group.len());
                for (name, shape) in group {
                    numels.push(numel(shape)?);
                    self.params.push((name.clone(), shape.clone()));
                }
                let saved: Vec<u64> = lens.iter().map(|l| l[g]).collect();
                let group_pieces =
                    layout::zero12_pieces(g, &numels, &saved).map_err(|e| rank0.error(e))?;
                self.pieces.extend(group_pieces.into_iter().map(|mut p| {
                    p.param += base;
                    p
                }));
            }
        } else {
            let mut numels = Vec::new();
            for group in &model.param_shapes {
                for (name, shape) in group {
                    numels.push(numel(shape)?);
                    self.params.push((name.clone(), shape.clone()));
                }
            }
            self.pieces = layout::zero3_pieces(&numels, &lens).map_err(|e| rank0.error(e))?;
        }
        Ok(())
    }

    /// `param_slice_mappings`, where saved (ZeRO-1/2), must agree with the layout.
    fn check_slice_mappings(&self) -> Result<(), MetadataError> {
        if self.stage > 2 {
            return Ok(());
        }
        for (r, (f, o)) in self.ranks.iter().enumerate() {
            for (g, mapping) in o.slice_mappings.iter().enumerate() {
                for (name, n, start) in mapping {
                    if *n == 0 {
                        continue;
                    }
                    let found = self
                        .pieces
                        .iter()
                        .find(|p| p.rank == r && p.group == g && self.params[p.param].0 == *name);
                    let ok = found.is_some_and(|p| p.end - p.start == *n && p.at == *start);
                    if !ok {
                        return Err(self.files[*f as usize].error(format!(
                            "tensor {name}: param_slice_mappings[{g}] puts {n} elements at {start} of this partition, but param_shapes order puts {}",
                            found.map_or("none here".to_string(), |p| format!("{} at {}", p.end - p.start, p.at))
                        )));
                    }
                }
            }
        }
        Ok(())
    }

    /// Adds every trainable parameter (the fp32 master weights) and the flat-range chunks of its
    /// pieces.
    fn add_params(&self, b: &mut Builder) -> Result<(), MetadataError> {
        let mut param_tensor = Vec::with_capacity(self.params.len());
        for (i, (name, shape)) in self.params.iter().enumerate() {
            let dtype = self
                .pieces
                .iter()
                .find(|p| p.param == i)
                .map_or(DType::F32, |p| self.flats[p.rank][p.group].tensor.dtype);
            param_tensor.push(b.add(name, dtype, shape.clone())?);
        }
        for p in &self.pieces {
            let flat = &self.flats[p.rank][p.group];
            let t = param_tensor[p.param];
            if flat.tensor.dtype != b.tensors[t as usize].dtype {
                return Err(flat.error(format!(
                    "holds {} but other ranks hold tensor {} as {}",
                    flat.tensor.dtype, self.params[p.param].0, b.tensors[t as usize].dtype
                )));
            }
            let start = flat.contiguous_start()?;
            let esize = flat.tensor.dtype.size();
            b.chunks.extend(flat_range_chunks(
                t,
                &TensorBox::whole(&self.params[p.param].1),
                p.start,
                p.end,
                flat.file,
                start + p.at * esize,
                esize,
            ));
        }
        Ok(())
    }

    /// Adds the optimizer moments: the same positions in the moment tensors of the same
    /// partitions, one tensor per parameter and key rank 0 saves.
    fn add_moments(&self, b: &mut Builder) -> Result<(), MetadataError> {
        let mut moment_tensors: HashMap<(usize, String), u32> = HashMap::new();
        let mut moments_located: HashMap<(usize, usize, String), Located<'_>> = HashMap::new();
        for (r, (f, o)) in self.ranks.iter().enumerate() {
            for (g, keys) in o.moments.iter().enumerate() {
                for (key, t) in keys {
                    let l = Located::new(
                        *f,
                        &self.files[*f as usize],
                        t,
                        format!("rank {r} optimizer {key} of flat group {g}"),
                    )?;
                    let need = self.flats[r][g].numel();
                    if l.tensor.size.len() != 1 || l.numel() < need {
                        return Err(l.error(format!(
                            "has size {:?}, but the partition it belongs to has {need} elements",
                            l.tensor.size
                        )));
                    }
                    l.contiguous_start()?;
                    moments_located.insert((r, g, key.clone()), l);
                }
            }
        }
        if let Some((_, first)) = self.ranks.first() {
            for (i, (name, shape)) in self.params.iter().enumerate() {
                let Some(p0) = self.pieces.iter().find(|p| p.param == i) else {
                    continue;
                };
                for (key, t) in first.moments.get(p0.group).into_iter().flatten() {
                    let fqn = format!("{OPTIMIZER_PREFIX}{name}.{key}");
                    let tensor = b.add(&fqn, t.dtype, shape.clone())?;
                    moment_tensors.insert((i, key.clone()), tensor);
                }
            }
        }
        for p in &self.pieces {
            for ((i, key), &tensor) in &moment_tensors {
                if *i != p.param {
                    continue;
                }
                let Some(l) = moments_located.get(&(p.rank, p.group, key.clone())) else {
                    return Err(self.files[self.ranks[p.rank].0 as usize].error(format!(
                        "tensor {}: no optimizer {key} for flat group {}, which rank 0 has",
                        self.params[p.param].0, p.group
                    )));
                };
                if l.tensor.dtype != b.tensors[tensor as usize].dtype {
                    return Err(l.error(format!(
                        "holds {} but rank 0 holds {}",
                        l.tensor.dtype, b.tensors[tensor as usize].dtype
                    )));
                }
                let esize = l.tensor.dtype.size();
                b.chunks.extend(flat_range_chunks(
                    tensor,
                    &TensorBox::whole(&self.params[p.param].1),
                    p.start,
                    p.end,
                    l.file,
                    l.contiguous_start()? + p.at * esize,
                    esize,
                ));
            }
        }
        Ok(())
    }
}

/// The model states that hold the frozen parameters, with their file index: every rank's file
/// for ZeRO-3 (each holds its slice), the one file otherwise.
fn model_files(
    dir: &Path,
    roles: &FileRoles,
    file_of: &HashMap<&str, u32>,
    files: &[TorchFile],
    model: &ModelStates,
    stage: u64,
) -> Result<Vec<(u32, ModelStates)>, MetadataError> {
    if stage != 3 {
        return Ok(vec![(0, model.clone())]);
    }
    let mut out = Vec::new();
    for dp in 0..roles.optims.len() {
        let Some(name) = roles.models.get(&Some(dp)) else {
            return Err(MetadataError::Invalid {
                what: format!(
                    "{dir}: ZeRO-3 save without zero_pp_rank_{dp}_mp_rank_00_model_states.pt"
                ),
            });
        };
        let f = file_of[name.as_str()];
        let states = if f == 0 {
            model.clone()
        } else {
            decode(
                &files[f as usize],
                "DeepSpeed model states",
                states::model_states,
            )?
        };
        out.push((f, states));
    }
    Ok(out)
}

/// Adds the frozen parameters: whole in the model states (ZeRO-1/2), or each rank's slice
/// (ZeRO-3), in rank order.
fn add_frozen(
    b: &mut Builder,
    model: &ModelStates,
    files: &[TorchFile],
    model_files: &[(u32, ModelStates)],
) -> Result<(), MetadataError> {
    for (name, shape) in &model.frozen_param_shapes {
        let n = numel(shape)?;
        let mut located = Vec::new();
        for (f, states) in model_files {
            let Some((_, t)) = states
                .frozen_param_fragments
                .iter()
                .find(|(k, _)| k == name)
            else {
                return Err(files[*f as usize].error(format!(
                    "tensor {name}: in frozen_param_shapes but not in frozen_param_fragments"
                )));
            };
            located.push(Located::new(
                *f,
                &files[*f as usize],
                t,
                format!("frozen parameter {name}"),
            )?);
        }
        let dtype = located[0].tensor.dtype;
        let t = b.add(name, dtype, shape.clone())?;
        let mut at = 0u64;
        for l in &located {
            if at >= n {
                break;
            }
            let end = (at + l.numel()).min(n);
            if l.tensor.dtype != dtype {
                return Err(l.error(format!("holds {} but rank 0 holds {dtype}", l.tensor.dtype)));
            }
            b.chunks.extend(flat_range_chunks(
                t,
                &TensorBox::whole(shape),
                at,
                end,
                l.file,
                l.contiguous_start()?,
                dtype.size(),
            ));
            at = end;
        }
        if at < n {
            return Err(located[0].error(format!(
                "tensor {name}: the frozen fragments hold {at} of its {n} elements"
            )));
        }
    }
    Ok(())
}

/// Adds the module's state dict: buffers (and, without ZeRO, the parameters) by name,
/// everything as saved under `module.`; ZeRO-3's empty placeholders of partitioned parameters
/// are left out.
fn add_module(
    b: &mut Builder,
    model: &ModelStates,
    model_file: &TorchFile,
    stage: u64,
) -> Result<(), MetadataError> {
    let shapes: HashMap<&str, &Vec<u64>> = model
        .param_shapes
        .iter()
        .flatten()
        .chain(model.frozen_param_shapes.iter())
        .map(|(n, s)| (n.as_str(), s))
        .collect();
    for (name, t) in &model.module {
        let l = Located::new(0, model_file, t, format!("module tensor {name}"))?;
        if let Some(shape) = shapes.get(name.as_str())
            && **shape != t.size
        {
            continue;
        }
        let plain =
            stage == 0 || (model.buffer_names.contains(name) && !b.index.contains_key(name));
        if plain {
            let tensor = b.add(name, t.dtype, t.size.clone())?;
            b.chunks.push(l.whole_chunk(tensor)?);
        }
        if stage != 0 {
            let tensor = b.add(&format!("{MODULE_PREFIX}{name}"), t.dtype, t.size.clone())?;
            b.chunks.push(l.whole_chunk(tensor)?);
        }
    }
    Ok(())
}

/// Adds tied parameters under their second name too (the chunks of the first, copied).
fn add_tied(b: &mut Builder, model: &ModelStates) -> Result<(), MetadataError> {
    for (alias, source) in &model.shared_params {
        if b.index.contains_key(alias) {
            continue;
        }
        let Some(&s) = b.index.get(source) else {
            continue;
        };
        let meta = b.tensors[s as usize].clone();
        let t = b.add(alias, meta.dtype, meta.shape.clone())?;
        let copies: Vec<SavedChunk> = b
            .chunks
            .iter()
            .filter(|c| c.tensor == s)
            .map(|c| SavedChunk {
                tensor: t,
                ..c.clone()
            })
            .collect();
        b.chunks.extend(copies);
    }
    Ok(())
}

/// Objects: the other model-state entries and the optimizer's param groups, each pointing at
/// the pickle that holds it, and their values (decoded here: a pickle entry has no byte range of
/// its own).
fn objects(
    model: &ModelStates,
    model_file: &TorchFile,
    files: &[TorchFile],
    ranks: &[(u32, OptimStates)],
) -> (Vec<ObjectMeta>, Vec<(String, Option<Json>)>) {
    let mut objects = Vec::new();
    let mut values = Vec::new();
    for (key, value) in &model.objects {
        objects.push(ObjectMeta {
            key: key.clone(),
            file: 0,
            offset: model_file.pkl_record.range.start,
            length: model_file.pkl_record.range.end - model_file.pkl_record.range.start,
            crc32c: None,
        });
        values.push((key.clone(), value.clone()));
    }
    if let Some((f, o)) = ranks.first()
        && let Some(groups) = &o.param_groups
    {
        let file = &files[*f as usize];
        objects.push(ObjectMeta {
            key: "optimizer.param_groups".to_string(),
            file: *f,
            offset: file.pkl_record.range.start,
            length: file.pkl_record.range.end - file.pkl_record.range.start,
            crc32c: None,
        });
        values.push(("optimizer.param_groups".to_string(), Some(groups.clone())));
    }
    (objects, values)
}

/// What the checkpoint records of its files: the data files, every record for verification,
/// the identity (the tag, and every file's name, size and pickle), and what opening cost.
struct FileTable {
    data_files: Vec<DataFile>,
    records: Vec<(u32, Record)>,
    identity: String,
    requests: u64,
    bytes_read: u64,
}

impl FileTable {
    /// The table of `files` (in data file order) of the save under `tag`.
    fn of(tag: Option<&str>, files: &[TorchFile]) -> Self {
        let mut identity = IdentityHasher::new(Format::DeepSpeed);
        identity.part(tag.unwrap_or("").as_bytes());
        let mut data_files = Vec::with_capacity(files.len());
        let mut records = Vec::new();
        let (mut requests, mut bytes_read) = (0u64, 0u64);
        for (i, file) in files.iter().enumerate() {
            identity
                .part(file.name.as_bytes())
                .part(&file.size.to_le_bytes())
                .part(&file.pkl);
            data_files.push(DataFile {
                path: file.name.clone(),
                size: Some(file.size),
                encoded: None,
            });
            records.push((i as u32, file.pkl_record.clone()));
            let mut recs: Vec<&Record> = file.records.values().collect();
            recs.sort_by_key(|r| r.range.start);
            records.extend(recs.into_iter().map(|r| (i as u32, r.clone())));
            requests += file.requests;
            bytes_read += file.bytes_read;
        }
        FileTable {
            data_files,
            records,
            identity: identity.finish(),
            requests,
            bytes_read,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_are_classified_like_deepspeed_writes_them() {
        assert_eq!(
            classify("mp_rank_00_model_states.pt"),
            Some(Kind::Model { dp: None, mp: 0 })
        );
        assert_eq!(
            classify("zero_pp_rank_3_mp_rank_00_model_states.pt"),
            Some(Kind::Model { dp: Some(3), mp: 0 })
        );
        assert_eq!(
            classify("bf16_zero_pp_rank_12_mp_rank_01_optim_states.pt"),
            Some(Kind::Optim {
                dp: 12,
                mp: 1,
                bf16: true
            })
        );
        assert_eq!(
            classify("layer_01-model_00-model_states.pt"),
            Some(Kind::Other)
        );
        assert_eq!(classify("zero_to_fp32.py"), None);
    }
}
