//! The DCP `.metadata` pickle read into plain structs: what [`crate::formats::torch::pickle`] executed, given the
//! meaning torch 2.1–2.15 (and Megatron-Core) give it. Classes are matched by name, not module
//! (`TensorProperties` moved between modules in 2.3); unknown keys and classes are ignored. The
//! root may be a `Metadata` subclass with extra fields (matched by its fields); what
//! Megatron-Core adds is read by [`super::megatron::read_pickle`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

use crate::formats::torch::pickle::{Limits, Pickle, Value, unpickle};
use crate::{DType, MetadataError};

/// Where one entry's blob lies: `_StorageInfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StorageInfo {
    /// Data file, relative to the checkpoint directory.
    pub relative_path: String,
    /// Byte offset of the blob in the file.
    pub offset: u64,
    /// Byte length of the blob.
    pub length: u64,
    /// Transforms applied to the whole blob (torch ≥2.7), e.g. `stream.zstd/1`.
    pub transforms: Vec<String>,
}

/// One saved chunk of a tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DcpChunk {
    /// Global element offsets.
    pub offsets: Vec<u64>,
    /// Element counts.
    pub sizes: Vec<u64>,
    /// Its blob.
    pub storage: StorageInfo,
}

/// A tensor entry of `state_dict_metadata`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DcpTensor {
    /// Flattened key.
    pub fqn: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape.
    pub shape: Vec<u64>,
    /// Saved chunks.
    pub chunks: Vec<DcpChunk>,
}

/// A bytes entry of `state_dict_metadata` (a pickled Python object).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DcpObject {
    /// Flattened key.
    pub fqn: String,
    /// Its blob.
    pub storage: StorageInfo,
}

/// What a DCP `.metadata` says.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct DcpMetadata {
    /// Tensors, in `state_dict_metadata` order.
    pub tensors: Vec<DcpTensor>,
    /// Non-tensor entries, in `state_dict_metadata` order.
    pub objects: Vec<DcpObject>,
    /// `version` (torch ≥2.9 writes "1.0.0").
    pub version: Option<String>,
    /// `storage_meta.checkpoint_id` (a path or a string).
    pub checkpoint_id: Option<String>,
    /// `storage_meta.save_id`.
    pub save_id: Option<String>,
    /// `planner_data`: flattened key → original state-dict path (str and int parts), where the
    /// planner recorded one.
    pub planner_data: BTreeMap<String, Vec<serde_json::Value>>,
    /// Objects the VM created (a size measure).
    pub pickle_objects: usize,
    /// `module.qualname` of the pickled root: `torch.distributed.checkpoint.metadata.Metadata`,
    /// or a subclass that adds fields (Megatron-Core 0.15's `MCoreMetadata`).
    pub class: Option<String>,
    /// What Megatron-Core added to the pickle (`mcore_data`, `all_local_plans`), when present.
    pub mcore: Option<super::megatron::McorePickle>,
}

/// Parses the `.metadata` pickle at `path` (for messages).
pub fn parse_metadata(
    bytes: &[u8],
    path: &str,
    limits: &Limits,
) -> Result<DcpMetadata, MetadataError> {
    let pickle = unpickle(bytes, limits).map_err(|e| decode(path, e.to_string()))?;
    Reader { p: &pickle, path }.metadata()
}

fn decode(path: &str, detail: String) -> MetadataError {
    MetadataError::Decode {
        path: path.to_string(),
        what: "DCP metadata",
        detail,
    }
}

struct Reader<'a> {
    p: &'a Pickle,
    path: &'a str,
}

type Pairs<'a> = &'a [(Value, Value)];
/// `storage_data` by `MetadataIndex` identity: (fqn, chunk offsets; `None` for bytes entries).
type StorageMap = HashMap<(String, Option<Vec<u64>>), StorageInfo>;

impl<'a> Reader<'a> {
    fn err<T>(&self, detail: impl Into<String>) -> Result<T, MetadataError> {
        Err(decode(self.path, detail.into()))
    }

    /// The BUILD state of the instance of class `class` as a dict.
    fn state(
        &self,
        value: &Value,
        class: &str,
        what: impl fmt::Display,
    ) -> Result<Pairs<'a>, MetadataError> {
        let p = self.p;
        let Some((_, name)) = p.class_of(value) else {
            return self.err(format!("{what} is a {}, not a {class}", p.describe(value)));
        };
        if name != class {
            return self.err(format!("{what} is a {name}, not a {class}"));
        }
        let Some(instance) = p.instance(value) else {
            return self.err(format!("{what} is not an instance"));
        };
        match &instance.state {
            None => Ok(&[]),
            Some(state) => match p.dict(state) {
                Some(pairs) => Ok(pairs),
                // `(dict, slots)` from a class with both.
                None => match p
                    .sequence(state)
                    .and_then(|s| s.first())
                    .and_then(|d| p.dict(d))
                {
                    Some(pairs) => Ok(pairs),
                    None => self.err(format!(
                        "{what} ({class}) has a {} as state",
                        p.describe(state)
                    )),
                },
            },
        }
    }

    fn field(pairs: Pairs<'a>, key: &str) -> Option<&'a Value> {
        pairs
            .iter()
            .rev()
            .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
            .map(|(_, v)| v)
    }

    fn required(
        &self,
        pairs: Pairs<'a>,
        key: &str,
        what: impl fmt::Display,
    ) -> Result<&'a Value, MetadataError> {
        match Self::field(pairs, key) {
            Some(v) => Ok(v),
            None => self.err(format!("{what} has no {key}")),
        }
    }

    fn string(&self, value: &Value, what: impl fmt::Display) -> Result<String, MetadataError> {
        match value {
            Value::Str(s) => Ok(s.to_string()),
            _ => self.err(format!("{what} is a {}, not a str", self.p.describe(value))),
        }
    }

    fn uint(&self, value: &Value, what: impl fmt::Display) -> Result<u64, MetadataError> {
        match value {
            Value::Int(i) if *i >= 0 => Ok(*i as u64),
            _ => self.err(format!(
                "{what} is a {}, not a non-negative int",
                self.p.describe(value)
            )),
        }
    }

    /// A `torch.Size`, tuple or list of non-negative ints.
    fn uints(&self, value: &Value, what: impl fmt::Display) -> Result<Vec<u64>, MetadataError> {
        let p = self.p;
        let items = match p.sequence(value) {
            Some(items) => items,
            None => match p.instance(value) {
                Some(instance) => match instance.args.first() {
                    None => &[][..],
                    Some(arg) => match p.sequence(arg) {
                        Some(items) => items,
                        None => return self.err(format!("{what} is a {}", p.describe(value))),
                    },
                },
                None => return self.err(format!("{what} is a {}", p.describe(value))),
            },
        };
        items.iter().map(|v| self.uint(v, &what)).collect()
    }

    /// The state of the root: a `Metadata`, or an instance of any class whose state has
    /// `Metadata`'s fields (a subclass adding its own, like Megatron-Core 0.15's
    /// `MCoreMetadata`): matched by fields, since a subclass may have any name.
    fn root_state(&self) -> Result<Pairs<'a>, MetadataError> {
        let p = self.p;
        let root = p.root();
        if matches!(p.class_of(root), Some((_, "Metadata"))) {
            return self.state(root, "Metadata", "the pickled object");
        }
        let state = p.instance(root).and_then(|i| i.state.as_ref());
        match state.and_then(|s| p.dict(s)) {
            Some(pairs)
                if Self::field(pairs, "state_dict_metadata").is_some()
                    && Self::field(pairs, "storage_data").is_some() =>
            {
                Ok(pairs)
            }
            _ => self.err(format!(
                "the pickled object is a {}, not a Metadata",
                match p.class_of(root) {
                    Some((_, name)) => name.to_string(),
                    None => p.describe(root),
                }
            )),
        }
    }

    fn metadata(&self) -> Result<DcpMetadata, MetadataError> {
        let p = self.p;
        let root = self.root_state()?;
        let storage = self.storage_data(self.required(root, "storage_data", "Metadata")?)?;
        let sdm = self.required(root, "state_dict_metadata", "Metadata")?;
        let Some(entries) = p.dict(sdm) else {
            return self.err(format!("state_dict_metadata is a {}", p.describe(sdm)));
        };
        let mut out = DcpMetadata {
            pickle_objects: p.num_objects(),
            class: p
                .class_of(p.root())
                .map(|(module, name)| format!("{module}.{name}")),
            mcore: super::megatron::read_pickle(p, root, self.path)?,
            ..DcpMetadata::default()
        };
        let mut seen: HashSet<String> = HashSet::with_capacity(entries.len());
        for (key, entry) in entries {
            let fqn = self.string(key, "a state_dict_metadata key")?;
            if !seen.insert(fqn.clone()) {
                return self.err(format!("state_dict_metadata lists {fqn} twice"));
            }
            match p.class_of(entry).map(|(_, name)| name) {
                Some("TensorStorageMetadata") => {
                    out.tensors.push(self.tensor(fqn, entry, &storage)?);
                }
                Some("BytesStorageMetadata") => {
                    let Some(info) = storage.get(&(fqn.clone(), None)) else {
                        return self.err(format!("bytes entry {fqn} has no storage_data entry"));
                    };
                    out.objects.push(DcpObject {
                        fqn,
                        storage: info.clone(),
                    });
                }
                _ => {
                    return self.err(format!(
                        "state_dict_metadata[{fqn:?}] is a {}",
                        p.describe(entry)
                    ));
                }
            }
        }
        out.version = match Self::field(root, "version") {
            Some(Value::Str(v)) => Some(v.to_string()),
            _ => None,
        };
        if let Some(meta) = Self::field(root, "storage_meta")
            && *meta != Value::None
            && let Ok(meta) = self.state(meta, "StorageMeta", "storage_meta")
        {
            out.checkpoint_id = Self::field(meta, "checkpoint_id").and_then(|v| self.path_text(v));
            out.save_id = match Self::field(meta, "save_id") {
                Some(Value::Str(s)) => Some(s.to_string()),
                _ => None,
            };
        }
        if let Some(planner) = Self::field(root, "planner_data").and_then(|v| p.dict(v)) {
            for (key, path) in planner {
                let (Value::Str(key), Some(parts)) = (key, p.sequence(path)) else {
                    continue;
                };
                let parts: Option<Vec<serde_json::Value>> = parts
                    .iter()
                    .map(|part| match part {
                        Value::Str(s) => Some(serde_json::Value::from(s.to_string())),
                        Value::Int(i) => Some(serde_json::Value::from(*i)),
                        _ => None,
                    })
                    .collect();
                if let Some(parts) = parts {
                    out.planner_data.insert(key.to_string(), parts);
                }
            }
        }
        Ok(out)
    }

    /// `checkpoint_id`: a str, or `PosixPath(*parts)`.
    fn path_text(&self, value: &Value) -> Option<String> {
        match value {
            Value::Str(s) => Some(s.to_string()),
            _ => {
                let instance = self.p.instance(value)?;
                let parts: Option<Vec<String>> = instance
                    .args
                    .iter()
                    .map(|a| match a {
                        Value::Str(s) => Some(s.to_string()),
                        _ => None,
                    })
                    .collect();
                let parts = parts?;
                let mut text = String::new();
                for part in parts {
                    if !text.is_empty() && !text.ends_with('/') {
                        text.push('/');
                    }
                    text.push_str(&part);
                }
                Some(text)
            }
        }
    }

    fn storage_data(&self, value: &Value) -> Result<StorageMap, MetadataError> {
        let p = self.p;
        let Some(pairs) = p.dict(value) else {
            return self.err(format!("storage_data is a {}", p.describe(value)));
        };
        let mut out = HashMap::with_capacity(pairs.len());
        for (key, info) in pairs {
            let index = self.state(key, "MetadataIndex", "a storage_data key")?;
            let fqn = self.string(
                self.required(index, "fqn", "a MetadataIndex")?,
                "MetadataIndex.fqn",
            )?;
            let offset = match Self::field(index, "offset") {
                None | Some(Value::None) => None,
                Some(v) => Some(self.uints(v, format_args!("MetadataIndex.offset of {fqn}"))?),
            };
            let what = format!("the storage_data entry of {fqn}");
            let fields = self.state(info, "_StorageInfo", &what)?;
            let relative_path = self.string(
                self.required(fields, "relative_path", &what)?,
                format_args!("{what}: relative_path"),
            )?;
            let start = self.uint(
                self.required(fields, "offset", &what)?,
                format_args!("{what}: offset"),
            )?;
            let length = self.uint(
                self.required(fields, "length", &what)?,
                format_args!("{what}: length"),
            )?;
            let transforms = match Self::field(fields, "transform_descriptors") {
                None | Some(Value::None) => Vec::new(),
                Some(v) => match p.sequence(v) {
                    Some(items) => items
                        .iter()
                        .map(|t| self.string(t, format_args!("{what}: a transform descriptor")))
                        .collect::<Result<_, _>>()?,
                    None => {
                        return self.err(format!(
                            "{what}: transform_descriptors is a {}",
                            p.describe(v)
                        ));
                    }
                },
            };
            out.insert(
                (fqn, offset),
                StorageInfo {
                    relative_path,
                    offset: start,
                    length,
                    transforms,
                },
            );
        }
        Ok(out)
    }

    fn tensor(
        &self,
        fqn: String,
        entry: &Value,
        storage: &StorageMap,
    ) -> Result<DcpTensor, MetadataError> {
        let p = self.p;
        let what = format!("tensor {fqn}");
        let state = self.state(entry, "TensorStorageMetadata", &what)?;
        let shape = self.uints(
            self.required(state, "size", &what)?,
            format_args!("{what}: size"),
        )?;
        let properties = self.required(state, "properties", &what)?;
        let dtype = self.dtype(properties, &what)?;
        let chunks_value = self.required(state, "chunks", &what)?;
        let Some(chunk_values) = p.sequence(chunks_value) else {
            return self.err(format!("{what}: chunks is a {}", p.describe(chunks_value)));
        };
        let mut chunks = Vec::with_capacity(chunk_values.len());
        for chunk in chunk_values {
            let fields = self.state(
                chunk,
                "ChunkStorageMetadata",
                format_args!("{what}: a chunk"),
            )?;
            let offsets = self.uints(
                self.required(fields, "offsets", &what)?,
                format_args!("{what}: chunk offsets"),
            )?;
            let sizes = self.uints(
                self.required(fields, "sizes", &what)?,
                format_args!("{what}: chunk sizes"),
            )?;
            if offsets.len() != shape.len() || sizes.len() != shape.len() {
                return self.err(format!(
                    "{what}: a chunk with offsets {offsets:?} and sizes {sizes:?} for shape {shape:?}"
                ));
            }
            let Some(info) = storage.get(&(fqn.clone(), Some(offsets.clone()))) else {
                return self.err(format!(
                    "{what}: the chunk at offsets {offsets:?} has no storage_data entry"
                ));
            };
            chunks.push(DcpChunk {
                offsets,
                sizes,
                storage: info.clone(),
            });
        }
        Ok(DcpTensor {
            fqn,
            dtype,
            shape,
            chunks,
        })
    }

    /// The dtype of `TensorProperties`: a tuple state `(dtype, layout, requires_grad,
    /// memory_format, pin_memory[, strides])`, or a dict state in older releases.
    fn dtype(&self, properties: &Value, what: &str) -> Result<DType, MetadataError> {
        let p = self.p;
        let Some(instance) = p.instance(properties) else {
            return self.err(format!(
                "{what}: properties is a {}",
                p.describe(properties)
            ));
        };
        let dtype = match &instance.state {
            Some(state) => match (p.sequence(state), p.dict(state)) {
                (Some(items), _) => items.first(),
                (None, Some(pairs)) => Self::field(pairs, "dtype"),
                _ => None,
            },
            // A properties object built from constructor arguments.
            None => instance.args.first(),
        };
        let Some(dtype) = dtype else {
            return self.err(format!("{what}: TensorProperties without a dtype"));
        };
        match p.global(dtype) {
            Some(("torch", name)) => DType::parse(name).map_err(|_| MetadataError::Unsupported {
                path: self.path.to_string(),
                detail: format!("{what} has dtype torch.{name}, which tessera does not support"),
            }),
            _ => self.err(format!("{what}: dtype is a {}", p.describe(dtype))),
        }
    }
}
