//! The two pickles a DeepSpeed save writes, read into plain structs: the model states
//! (`*_model_states.pt`: `param_shapes`, the module's state dict, frozen parameters, config and
//! client state) and the ZeRO optimizer states (`*_optim_states.pt`: this data-parallel rank's
//! flat fp32 partition of every parameter group, the base optimizer's state of those partitions,
//! `partition_count`, `param_slice_mappings`). Nothing here reads storage: the input is the
//! `data.pkl` bytes, so the fuzz target and the tests drive it directly.

use serde_json::Value as Json;

use crate::formats::dcp::value_to_json;
use crate::formats::torch::blob::{PickledTensor, pickled_tensor};
use crate::formats::torch::pickle::{Limits, Obj, Pickle, Value, unpickle};

/// Caps of the VM for a DeepSpeed `data.pkl`. The model states of a large model list every
/// parameter twice (module state dict, `param_shapes`), about 200 bytes each: 64 MiB is room for
/// a few hundred thousand parameters; what the VM builds stays under 1 GiB whatever the input.
pub const LIMITS: Limits = Limits {
    max_input: 64 << 20,
    max_depth: 1000,
    max_stack: 1 << 20,
    max_memo: 1 << 22,
    max_objects: 1 << 22,
    max_bytes: 1 << 30,
};

/// Keys of the model states that are tensors or layouts, not objects.
const NOT_OBJECTS: [&str; 5] = [
    "module",
    "param_shapes",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "optimizer",
];

/// What a `*_model_states.pt` holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ModelStates {
    /// DeepSpeed version that wrote it.
    pub ds_version: Option<String>,
    /// Per parameter group: the trainable parameters in the order of the flat buffers.
    pub param_shapes: Vec<Vec<(String, Vec<u64>)>>,
    /// Frozen (non-trainable) parameters with their full shapes.
    pub frozen_param_shapes: Vec<(String, Vec<u64>)>,
    /// Frozen parameters' values: whole (ZeRO-1/2) or this rank's partition (ZeRO-3).
    pub frozen_param_fragments: Vec<(String, PickledTensor)>,
    /// `alias -> parameter` of tied parameters.
    pub shared_params: Vec<(String, String)>,
    /// Names of the module's buffers.
    pub buffer_names: Vec<String>,
    /// The module's state dict (16-bit weights in mixed precision; ZeRO-3 placeholders).
    pub module: Vec<(String, PickledTensor)>,
    /// `global_steps`, when recorded.
    pub global_steps: Option<u64>,
    /// Every other top-level entry: its key and its value as JSON when it is a simple value.
    pub objects: Vec<(String, Option<Json>)>,
}

/// What a `*_optim_states.pt` holds.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimStates {
    /// ZeRO stage (`None` for the bf16 optimizer, which records none: it is ZeRO-1).
    pub zero_stage: Option<u64>,
    /// Ranks each parameter group is partitioned over.
    pub partition_count: Vec<u64>,
    /// This rank's flat fp32 partitions: one per parameter group (ZeRO-1/2), one per sub-group
    /// (ZeRO-3).
    pub flat_groups: Vec<PickledTensor>,
    /// Padding at the end of each group's partition (ZeRO-1/2).
    pub group_paddings: Vec<u64>,
    /// Per group: parameter name -> (numel, start) of its fragment inside this partition.
    pub slice_mappings: Vec<Vec<(String, u64, u64)>>,
    /// Per flat group: the base optimizer's tensors of that partition (`exp_avg`, ...).
    pub moments: Vec<Vec<(String, PickledTensor)>>,
    /// The base optimizer's parameter groups (hyper-parameters), as JSON when simple.
    pub param_groups: Option<Json>,
    /// DeepSpeed version, when recorded.
    pub ds_version: Option<String>,
}

/// Unpickles a `data.pkl`.
pub fn load(bytes: &[u8]) -> Result<Pickle, String> {
    unpickle(bytes, &LIMITS).map_err(|e| format!("data.pkl: {e}"))
}

/// The pairs of a dict or an `OrderedDict`.
fn pairs<'a>(p: &'a Pickle, value: &Value) -> Option<&'a [(Value, Value)]> {
    match p.obj(value)? {
        Obj::Dict(pairs) => Some(pairs),
        Obj::Instance(instance) => match p.global(&instance.class) {
            Some((_, "OrderedDict")) => Some(&instance.items),
            _ => None,
        },
        _ => None,
    }
}

/// The value of `key` in a dict's pairs, `None` when absent or `None`.
fn get<'a>(dict: &'a [(Value, Value)], key: &str) -> Option<&'a Value> {
    dict.iter()
        .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
        .map(|(_, v)| v)
        .filter(|v| !matches!(v, Value::None))
}

fn int(p: &Pickle, value: &Value, what: &str) -> Result<u64, String> {
    match value {
        Value::Int(i) if *i >= 0 => Ok(*i as u64),
        // An IntEnum (`ZeroStageEnum.gradients`) pickles as `ZeroStageEnum(2)`.
        Value::Ref(_) => match p.instance(value).map(|i| i.args.as_slice()) {
            Some([Value::Int(i)]) if *i >= 0 => Ok(*i as u64),
            _ => Err(format!("{what} is a {}, not an int", p.describe(value))),
        },
        _ => Err(format!("{what} is a {}, not an int", p.describe(value))),
    }
}

fn string(p: &Pickle, value: &Value, what: &str) -> Result<String, String> {
    match value {
        Value::Str(s) => Ok(s.to_string()),
        _ => Err(format!("{what} is a {}, not a str", p.describe(value))),
    }
}

fn list<'a>(p: &'a Pickle, value: &Value, what: &str) -> Result<&'a [Value], String> {
    p.sequence(value)
        .ok_or_else(|| format!("{what} is a {}, not a list", p.describe(value)))
}

fn dict<'a>(p: &'a Pickle, value: &Value, what: &str) -> Result<&'a [(Value, Value)], String> {
    pairs(p, value).ok_or_else(|| format!("{what} is a {}, not a dict", p.describe(value)))
}

/// A shape: a tuple or list of ints, or a `torch.Size((...))`.
fn shape(p: &Pickle, value: &Value, what: &str) -> Result<Vec<u64>, String> {
    let items = match p.sequence(value) {
        Some(items) => items,
        None => match p.instance(value).and_then(|i| i.args.first()) {
            Some(args) => p
                .sequence(args)
                .ok_or_else(|| format!("{what} is a {}", p.describe(value)))?,
            None => return Err(format!("{what} is a {}, not a shape", p.describe(value))),
        },
    };
    items.iter().map(|v| int(p, v, what)).collect()
}

fn tensor(p: &Pickle, value: &Value, what: &str) -> Result<PickledTensor, String> {
    pickled_tensor(p, value).map_err(|e| format!("{what}: {e}"))
}

fn named_tensors(
    p: &Pickle,
    value: Option<&Value>,
    what: &str,
) -> Result<Vec<(String, PickledTensor)>, String> {
    let Some(value) = value else {
        return Ok(Vec::new());
    };
    let mut out = Vec::new();
    for (k, v) in dict(p, value, what)? {
        let name = string(p, k, &format!("a key of {what}"))?;
        let t = tensor(p, v, &format!("{what}[{name:?}]"))?;
        out.push((name, t));
    }
    Ok(out)
}

fn named_shapes(p: &Pickle, value: &Value, what: &str) -> Result<Vec<(String, Vec<u64>)>, String> {
    let mut out = Vec::new();
    for (k, v) in dict(p, value, what)? {
        let name = string(p, k, &format!("a key of {what}"))?;
        let s = shape(p, v, &format!("{what}[{name:?}]"))?;
        out.push((name, s));
    }
    Ok(out)
}

/// Reads the model states pickle.
pub fn model_states(p: &Pickle) -> Result<ModelStates, String> {
    let root = dict(p, p.root(), "the model states")?;
    let mut out = ModelStates::default();
    let Some(shapes) = get(root, "param_shapes") else {
        return Err("the model states have no param_shapes".to_string());
    };
    // ZeRO-1/2 save a list of per-group dicts; some versions a single dict.
    if let Some(groups) = p.sequence(shapes) {
        for (g, group) in groups.iter().enumerate() {
            out.param_shapes
                .push(named_shapes(p, group, &format!("param_shapes[{g}]"))?);
        }
    } else {
        out.param_shapes
            .push(named_shapes(p, shapes, "param_shapes")?);
    }
    if let Some(frozen) = get(root, "frozen_param_shapes") {
        out.frozen_param_shapes = named_shapes(p, frozen, "frozen_param_shapes")?;
    }
    out.frozen_param_fragments = named_tensors(
        p,
        get(root, "frozen_param_fragments"),
        "frozen_param_fragments",
    )?;
    if let Some(shared) = get(root, "shared_params") {
        for (k, v) in dict(p, shared, "shared_params")? {
            out.shared_params.push((
                string(p, k, "a key of shared_params")?,
                string(p, v, "a value of shared_params")?,
            ));
        }
    }
    if let Some(buffers) = get(root, "buffer_names") {
        for v in list(p, buffers, "buffer_names")? {
            out.buffer_names
                .push(string(p, v, "an entry of buffer_names")?);
        }
    }
    out.module = named_tensors(p, get(root, "module"), "module")?;
    if let Some(v) = get(root, "ds_version") {
        out.ds_version = Some(string(p, v, "ds_version")?);
    }
    if let Some(v) = get(root, "global_steps") {
        out.global_steps = Some(int(p, v, "global_steps")?);
    }
    for (k, v) in root {
        let Value::Str(key) = k else {
            continue;
        };
        if NOT_OBJECTS.contains(&&**key) {
            continue;
        }
        out.objects
            .push((key.to_string(), value_to_json(p, v).ok()));
    }
    Ok(out)
}

/// A `fragment_address(numel, start)`: a dataclass (state `{numel, start}`) or a tuple.
fn fragment(p: &Pickle, value: &Value, what: &str) -> Result<(u64, u64), String> {
    if let Some([numel, start]) = p.sequence(value) {
        return Ok((int(p, numel, what)?, int(p, start, what)?));
    }
    let Some(instance) = p.instance(value) else {
        return Err(format!("{what} is a {}", p.describe(value)));
    };
    if let Some(state) = &instance.state
        && let Some(fields) = pairs(p, state)
        && let (Some(numel), Some(start)) = (get(fields, "numel"), get(fields, "start"))
    {
        return Ok((int(p, numel, what)?, int(p, start, what)?));
    }
    match instance.args.as_slice() {
        [numel, start] => Ok((int(p, numel, what)?, int(p, start, what)?)),
        _ => Err(format!(
            "{what} is a {} without numel and start",
            p.describe(value)
        )),
    }
}

/// Reads the optimizer states pickle.
pub fn optim_states(p: &Pickle) -> Result<OptimStates, String> {
    let root = dict(p, p.root(), "the optimizer states")?;
    let Some(osd) = get(root, "optimizer_state_dict") else {
        return Err("the optimizer states have no optimizer_state_dict".to_string());
    };
    let osd = dict(p, osd, "optimizer_state_dict")?;
    let mut out = OptimStates {
        ds_version: match get(osd, "ds_version").or_else(|| get(root, "ds_version")) {
            Some(v) => Some(string(p, v, "ds_version")?),
            None => None,
        },
        ..OptimStates::default()
    };
    if let Some(stage) = get(osd, "zero_stage") {
        out.zero_stage = Some(int(p, stage, "zero_stage")?);
    }
    match get(osd, "partition_count") {
        None => return Err("optimizer_state_dict has no partition_count".to_string()),
        Some(v @ Value::Int(_)) => out.partition_count.push(int(p, v, "partition_count")?),
        Some(v) => {
            for c in list(p, v, "partition_count")? {
                out.partition_count.push(int(p, c, "partition_count")?);
            }
        }
    }
    let key = if out.zero_stage == Some(3) {
        "fp32_flat_groups"
    } else {
        "single_partition_of_fp32_groups"
    };
    let Some(groups) = get(osd, key) else {
        return Err(format!("optimizer_state_dict has no {key}"));
    };
    for (g, v) in list(p, groups, key)?.iter().enumerate() {
        out.flat_groups.push(tensor(p, v, &format!("{key}[{g}]"))?);
    }
    if let Some(v) = get(osd, "group_paddings") {
        for c in list(p, v, "group_paddings")? {
            out.group_paddings.push(int(p, c, "group_paddings")?);
        }
    }
    if let Some(v) = get(osd, "param_slice_mappings") {
        for (g, group) in list(p, v, "param_slice_mappings")?.iter().enumerate() {
            let what = format!("param_slice_mappings[{g}]");
            let mut mapping = Vec::new();
            for (k, v) in dict(p, group, &what)? {
                let name = string(p, k, &what)?;
                let (numel, start) = fragment(p, v, &format!("{what}[{name:?}]"))?;
                mapping.push((name, numel, start));
            }
            out.slice_mappings.push(mapping);
        }
    }
    out.moments = vec![Vec::new(); out.flat_groups.len()];
    let base = get(osd, "base_optimizer_state").or_else(|| get(osd, "optimizer_state_dict"));
    if let Some(base) = base {
        base_state(p, base, &mut out)?;
    }
    Ok(out)
}

/// The base optimizer's state of the flat partitions: torch's `{state: {i: {...}}, param_groups:
/// [{params: [i, ...]}]}` (the i-th parameter in param-group order is flat group i), or, for an
/// elastic checkpoint, a list with one state dict per group.
fn base_state(p: &Pickle, base: &Value, out: &mut OptimStates) -> Result<(), String> {
    let mut put = |position: usize, state: &Value, what: &str| -> Result<(), String> {
        let Some(slot) = out.moments.get_mut(position) else {
            return Err(format!(
                "{what} belongs to flat group {position}, but there are {} groups",
                out.flat_groups.len()
            ));
        };
        for (k, v) in dict(p, state, what)? {
            let Value::Str(name) = k else { continue };
            // Scalars (`step`) and non-tensors stay out; every tensor with elements is a moment.
            if let Ok(t) = pickled_tensor(p, v)
                && !t.size.is_empty()
            {
                slot.push((name.to_string(), t));
            }
        }
        Ok(())
    };
    if let Some(groups) = p.sequence(base) {
        for (g, state) in groups.iter().enumerate() {
            put(g, state, &format!("base_optimizer_state[{g}]"))?;
        }
        return Ok(());
    }
    let base = dict(p, base, "base_optimizer_state")?;
    let mut order: Vec<u64> = Vec::new();
    if let Some(groups) = get(base, "param_groups") {
        out.param_groups = value_to_json(p, groups).ok();
        for group in list(p, groups, "base_optimizer_state param_groups")? {
            let group = dict(p, group, "a base optimizer param group")?;
            if let Some(params) = get(group, "params") {
                for i in list(p, params, "a param group's params")? {
                    order.push(int(p, i, "a param group's params")?);
                }
            }
        }
    }
    if let Some(state) = get(base, "state") {
        for (k, v) in dict(p, state, "base_optimizer_state state")? {
            let index = int(p, k, "a base optimizer state key")?;
            let position = order
                .iter()
                .position(|&i| i == index)
                .unwrap_or(index as usize);
            put(position, v, &format!("base_optimizer_state state[{index}]"))?;
        }
    }
    Ok(())
}

/// Reads a whole torch.save file held in memory the way the reader does (zip directory,
/// `data.pkl`, model or optimizer states, every tensor's storage record present and long enough):
/// the entry point of the fuzz target and the mutation tests. Never panics.
pub fn parse_states_file(bytes: &[u8]) -> Result<(), String> {
    use crate::formats::torch::zip::{self, Segments};
    let seg = Segments::whole(bytes::Bytes::copy_from_slice(bytes));
    let dir = zip::read_directory(&seg).map_err(|e| e.to_string())?;
    let Some((pkl, prefix)) = dir.torch_data_pkl() else {
        return Err("no data.pkl".to_string());
    };
    let data = zip::read_member(&seg, &dir, pkl).map_err(|e| e.to_string())?;
    let p = load(data)?;
    let tensors: Vec<PickledTensor> = if p
        .dict(p.root())
        .is_some_and(|d| get(d, "param_shapes").is_some())
    {
        let m = model_states(&p)?;
        m.module
            .into_iter()
            .chain(m.frozen_param_fragments)
            .map(|(_, t)| t)
            .collect()
    } else {
        let o = optim_states(&p)?;
        o.flat_groups
            .into_iter()
            .chain(o.moments.into_iter().flatten().map(|(_, t)| t))
            .collect()
    };
    for t in tensors {
        let Some(entry) = dir.find(&format!("{prefix}data/{}", t.key)) else {
            return Err(format!("no record data/{}", t.key));
        };
        let range = zip::data_range(&seg, &dir, entry).map_err(|e| e.to_string())?;
        if range.end - range.start != t.storage_bytes {
            return Err(format!("record data/{} has the wrong size", t.key));
        }
    }
    Ok(())
}
