//! What ByteCheckpoint adds to torch's `Metadata` fields in its own
//! `bytecheckpoint.checkpointer.meta_type.Metadata` dataclass: `all_tensor_metadata` (one pickled
//! `_rebuild_tensor_v2` descriptor per saved tensor chunk), `bytecheckpoint_version` and
//! `user_defined_dict`. The torch part (`state_dict_metadata`, `storage_data`, `planner_data`) is
//! read by the DCP reader ([`crate::formats::dcp::parse_metadata`]), which matches classes by
//! name, so it reads this class too.

use std::collections::HashMap;
use std::sync::Arc;

use crate::MetadataError;
use crate::formats::torch::pickle::{Limits, Pickle, Value, unpickle};

/// The module ByteCheckpoint's `Metadata` class lives in; its name is the first string of every
/// `.metadata` it pickles, which is how a ByteCheckpoint directory is told from a torch DCP one.
pub const METADATA_MODULE: &str = "bytecheckpoint.checkpointer.meta_type";

/// `all_tensor_metadata` keyed like `storage_data`: (fqn, chunk offsets); `None` for the entries
/// of bytes objects, which have no descriptor.
pub type Descriptors = HashMap<(String, Option<Vec<u64>>), Option<Arc<[u8]>>>;

/// The ByteCheckpoint-only fields of a `.metadata`.
#[derive(Clone, Debug, Default)]
pub struct BcFields {
    /// `bytecheckpoint_version`, e.g. `0.0.2`.
    pub version: Option<String>,
    /// Per saved chunk, the pickled tensor descriptor.
    pub descriptors: Descriptors,
    /// Keys of `user_defined_dict` (its values are whatever the user saved; only the names are
    /// shown).
    pub user_defined_keys: Vec<String>,
    /// A decomposed FSDP save's flat-parameter layouts (`user_defined_dict`'s `fsdp_*` entries).
    pub flat_params: FlatParams,
}

/// One slot of an FSDP flat parameter, in flat order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FlatSlot {
    /// Elements of the slot.
    pub numel: u64,
    /// The parameter it holds (its name relative to the flat parameter's module) and shape;
    /// `None` for alignment padding.
    pub param: Option<(String, Vec<u64>)>,
}

/// Flat parameter key (`_flat_param`, `layers.0._flat_param`) → its slots, from a decomposed
/// FSDP save's `user_defined_dict` (`fsdp_flat_param_to_fqns`, `fsdp_is_padding_mask`,
/// `fsdp_numels_with_padding`, `fsdp_shapes`). Empty for every other save.
pub type FlatParams = HashMap<String, Vec<FlatSlot>>;

/// Reads the ByteCheckpoint-only fields of the `.metadata` pickle at `path` (for messages).
pub fn parse_bc_fields(
    bytes: &[u8],
    path: &str,
    limits: &Limits,
) -> Result<BcFields, MetadataError> {
    let pickle = unpickle(bytes, limits).map_err(|e| decode(path, e.to_string()))?;
    let p = &pickle;
    let root = p.root();
    match p.class_of(root) {
        Some((module, "Metadata")) if module == METADATA_MODULE => {}
        Some((module, name)) => {
            return Err(decode(
                path,
                format!(
                    "the pickled object is a {module}.{name}, not a {METADATA_MODULE}.Metadata"
                ),
            ));
        }
        None => {
            return Err(decode(
                path,
                format!(
                    "the pickled object is a {}, not a Metadata",
                    p.describe(root)
                ),
            ));
        }
    }
    let fields = state(p, root).ok_or_else(|| decode(path, "Metadata has no field dict".into()))?;
    let mut out = BcFields::default();
    if let Some(Value::Str(v)) = field(fields, "bytecheckpoint_version") {
        out.version = Some(v.to_string());
    }
    if let Some(dict) = field(fields, "user_defined_dict").and_then(|v| p.dict(v)) {
        out.user_defined_keys = dict
            .iter()
            .map(|(k, _)| match k {
                Value::Str(s) => s.to_string(),
                other => p.describe(other),
            })
            .collect();
    }
    if let Some(user) = field(fields, "user_defined_dict").and_then(|v| p.dict(v)) {
        out.flat_params = flat_params(p, user).map_err(|e| decode(path, e))?;
    }
    let Some(all) = field(fields, "all_tensor_metadata") else {
        return Err(decode(path, "Metadata has no all_tensor_metadata".into()));
    };
    let Some(pairs) = p.dict(all) else {
        return Err(decode(
            path,
            format!("all_tensor_metadata is a {}, not a dict", p.describe(all)),
        ));
    };
    out.descriptors.reserve(pairs.len());
    for (key, value) in pairs {
        let Some(index) = state(p, key).filter(|_| {
            p.class_of(key)
                .is_some_and(|(_, name)| name == "MetadataIndex")
        }) else {
            return Err(decode(
                path,
                format!("an all_tensor_metadata key is a {}", p.describe(key)),
            ));
        };
        let Some(Value::Str(fqn)) = field(index, "fqn") else {
            return Err(decode(path, "an all_tensor_metadata key has no fqn".into()));
        };
        let offset = match field(index, "offset") {
            None | Some(Value::None) => None,
            Some(v) => Some(p.uints(v).ok_or_else(|| {
                decode(
                    path,
                    format!(
                        "the all_tensor_metadata key of {fqn} has offset {}",
                        p.describe(v)
                    ),
                )
            })?),
        };
        let descriptor = match value {
            Value::Bytes(b) => Some(Arc::clone(b)),
            Value::None => None,
            other => {
                return Err(decode(
                    path,
                    format!(
                        "all_tensor_metadata of {fqn} is a {}, not bytes",
                        p.describe(other)
                    ),
                ));
            }
        };
        out.descriptors
            .insert((fqn.to_string(), offset), descriptor);
    }
    Ok(out)
}

fn decode(path: &str, detail: String) -> MetadataError {
    MetadataError::Decode {
        path: path.to_string(),
        what: "ByteCheckpoint metadata",
        detail,
    }
}

/// The BUILD state of an instance, as dict pairs (a dataclass pickles its `__dict__`).
fn state<'a>(p: &'a Pickle, value: &Value) -> Option<&'a [(Value, Value)]> {
    let state = p.instance(value)?.state.as_ref()?;
    p.dict(state)
        .or_else(|| p.sequence(state)?.first().and_then(|d| p.dict(d)))
}

fn field<'a>(pairs: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    pairs
        .iter()
        .rev()
        .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
        .map(|(_, v)| v)
}

/// The `fsdp_*` entries of `user_defined_dict` (what ByteCheckpoint's FSDP hack records for every
/// flat parameter when saving decomposed), as slots in flat order.
fn flat_params(p: &Pickle, user: &[(Value, Value)]) -> Result<FlatParams, String> {
    let table = |name: &str| field(user, name).and_then(|v| p.dict(v));
    let (Some(fqns), Some(padding), Some(numels), Some(shapes)) = (
        table("fsdp_flat_param_to_fqns"),
        table("fsdp_is_padding_mask"),
        table("fsdp_numels_with_padding"),
        table("fsdp_shapes"),
    ) else {
        return Ok(FlatParams::new());
    };
    let mut out = FlatParams::new();
    for (key, names) in fqns {
        let Value::Str(key) = key else {
            return Err(format!(
                "a fsdp_flat_param_to_fqns key is a {}",
                p.describe(key)
            ));
        };
        let list = |table: &'_ [(Value, Value)], what: &str| -> Result<Vec<Value>, String> {
            field(table, key)
                .and_then(|v| p.sequence(v))
                .map(<[Value]>::to_vec)
                .ok_or_else(|| format!("user_defined_dict has no {what} list for {key}"))
        };
        let names = p
            .sequence(names)
            .ok_or_else(|| format!("fsdp_flat_param_to_fqns[{key}] is not a list"))?;
        let padding = list(padding, "fsdp_is_padding_mask")?;
        let numels = list(numels, "fsdp_numels_with_padding")?;
        let shapes = list(shapes, "fsdp_shapes")?;
        if padding.len() != numels.len() || names.len() != shapes.len() {
            return Err(format!(
                "{key}: {} padding flags for {} slot sizes, {} names for {} shapes",
                padding.len(),
                numels.len(),
                names.len(),
                shapes.len()
            ));
        }
        let mut slots = Vec::with_capacity(numels.len());
        let mut next = 0usize;
        for (flag, numel) in padding.iter().zip(&numels) {
            let Value::Int(numel) = numel else {
                return Err(format!("{key}: a slot size is a {}", p.describe(numel)));
            };
            let numel = u64::try_from(*numel).map_err(|_| format!("{key}: slot size {numel}"))?;
            let param = match flag {
                Value::Bool(true) => None,
                Value::Bool(false) => {
                    let (Some(Value::Str(name)), Some(shape)) = (names.get(next), shapes.get(next))
                    else {
                        return Err(format!("{key}: more parameter slots than names"));
                    };
                    next += 1;
                    let shape = p.uints(shape).ok_or_else(|| {
                        format!("{key}: the shape of {name} is a {}", p.describe(shape))
                    })?;
                    if shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)) != Some(numel) {
                        return Err(format!(
                            "{key}: {name} has shape {shape:?} but a {numel}-element slot"
                        ));
                    }
                    Some((name.to_string(), shape))
                }
                other => return Err(format!("{key}: a padding flag is a {}", p.describe(other))),
            };
            slots.push(FlatSlot { numel, param });
        }
        out.insert(key.to_string(), slots);
    }
    Ok(out)
}
