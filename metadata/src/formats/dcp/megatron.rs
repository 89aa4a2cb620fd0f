//! Megatron-Core `dist_checkpointing` with the `torch_dist` backend: a DCP directory plus what
//! Megatron adds to it, read from the writer's format rules (megatron/core/dist_checkpointing,
//! `strategies/torch.py`, `core.py`, `serialization.py`, releases 0.8 to 0.19):
//!
//! ```text
//! <dir>/metadata.json   {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
//!                        "common_backend": "torch", ...}   (common_backend up to 0.18)
//! <dir>/common.pt       torch.save of the common (non-sharded) state            (up to 0.18)
//! <dir>/.metadata       DCP Metadata, with Megatron's extras in its state:
//!                         mcore_data       {key: {"nd_reformulated_orig_global_shape": G}}
//!                                          as an attribute of Metadata (0.8–0.14) or a field of
//!                                          the subclass MCoreMetadata (0.15 only)
//!                         all_local_plans  every rank's SavePlan (MCoreSavePlan with its own
//!                                          mcore_data up to 0.15)
//! common_state/shard_0_1  the common state as a DCP bytes entry                (0.19 on)
//! ```
//!
//! **Reformulated tensors** (distributed-optimizer states saved with `flattened_range`, ≤0.15):
//! a tensor of global shape `G` whose TP-local shape is `L` (`L_i = G_i / F_i`, `F` the axis
//! fragmentations) is stored as a tensor of shape `S = F ++ [prod(L)]`, and each rank's chunk at
//! offsets `(f…, s)` with sizes `(1…, len)` is the flat range `[s, s+len)` of the row-major
//! flattening of TP-local box `f` (`offsets f_i·L_i`, lengths `L`). tessera exposes such a tensor
//! with its original shape `G` (what Megatron's own load returns) and each stored chunk as the
//! boxes that tile its flat range ([`crate::flat_range_chunks`]); anything that does not fit
//! this rule is refused, naming the tensor and the chunk.

use std::collections::BTreeMap;

use serde::Serialize;

use super::metadata::{DcpMetadata, DcpTensor};
use crate::formats::torch::pickle::{Pickle, Value};
use crate::formats::{Listing, Writer};
use crate::{MetadataError, TensorBox};

/// Megatron's backend configuration file.
pub const CONFIG_FILE: &str = "metadata.json";
/// The common state of releases up to 0.18.
pub const COMMON_FILE: &str = "common.pt";
/// Key prefix of the common state saved as a DCP bytes entry (0.19 on).
pub const COMMON_STATE_PREFIX: &str = "common_state/";
/// Most bytes of `metadata.json` read: Megatron writes about 120; a bigger file is not its.
pub const MAX_CONFIG_BYTES: u64 = 64 * 1024;
/// The `mcore_data` field with a reformulated tensor's original global shape.
const ORIG_SHAPE: &str = "nd_reformulated_orig_global_shape";

type Pairs<'a> = &'a [(Value, Value)];

/// What Megatron-Core put into the `.metadata` pickle.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct McorePickle {
    /// Original global shape of every tensor stored reformulated, by key (`mcore_data` of the
    /// Metadata, completed from the save plans' own `mcore_data`).
    pub orig_shapes: BTreeMap<String, Vec<u64>>,
    /// Keys `mcore_data` lists (a tensor with `{}` is stored in its own shape).
    pub mcore_keys: usize,
    /// `mcore_data` was on the Metadata itself.
    pub on_metadata: bool,
    /// `mcore_data` was on the save plans.
    pub on_plans: bool,
    /// Number of `all_local_plans`.
    pub plans: usize,
    /// `module.qualname` of the first plan.
    pub plan_class: Option<String>,
}

/// Reads Megatron's extras from the state of the `.metadata` root (`None` when there are
/// none). `mcore_data` may be on the Metadata (0.8–0.15) and on each `MCoreSavePlan` of
/// `all_local_plans` (≤0.15); the Metadata's is the plans' merged (Megatron's `ChainMap`, first
/// plan first), so a key missing there is taken from the plans, and a key on which they disagree
/// is refused.
pub(super) fn read_pickle(
    p: &Pickle,
    root: Pairs<'_>,
    path: &str,
) -> Result<Option<McorePickle>, MetadataError> {
    let mut out = McorePickle::default();
    let mut keys = BTreeMap::new();
    if let Some(data) = field(root, "mcore_data")
        && *data != Value::None
    {
        out.on_metadata = true;
        read_mcore_data(p, data, path, "mcore_data", &mut keys)?;
    }
    let mut from_plans = BTreeMap::new();
    if let Some(plans) = field(root, "all_local_plans") {
        let plans = p.sequence(plans).unwrap_or(&[]);
        out.plans = plans.len();
        out.plan_class = plans
            .first()
            .and_then(|plan| p.class_of(plan))
            .map(|(module, name)| format!("{module}.{name}"));
        for (r, plan) in plans.iter().enumerate() {
            let state = p
                .instance(plan)
                .and_then(|i| i.state.as_ref())
                .and_then(|s| {
                    p.dict(s)
                        .or_else(|| p.sequence(s)?.first().and_then(|d| p.dict(d)))
                });
            if let Some(data) = state.and_then(|s| field(s, "mcore_data"))
                && *data != Value::None
            {
                out.on_plans = true;
                let what = format!("all_local_plans[{r}].mcore_data");
                let mut plan_keys = BTreeMap::new();
                read_mcore_data(p, data, path, &what, &mut plan_keys)?;
                for (key, shape) in plan_keys {
                    // ChainMap: the first plan that has a key gives it.
                    from_plans.entry(key).or_insert(shape);
                }
            }
        }
    }
    if !out.on_metadata && !out.on_plans && out.plans == 0 {
        return Ok(None);
    }
    for (key, shape) in from_plans {
        match keys.get(&key) {
            Some(on_metadata) if *on_metadata != shape => {
                return Err(decode(
                    path,
                    format!(
                        "tensor {key}: mcore_data of the metadata says {} but the save plans say {}",
                        describe_entry(on_metadata),
                        describe_entry(&shape)
                    ),
                ));
            }
            Some(_) => {}
            None => {
                keys.insert(key, shape);
            }
        }
    }
    out.mcore_keys = keys.len();
    out.orig_shapes = keys
        .into_iter()
        .filter_map(|(key, shape)| Some((key, shape?)))
        .collect();
    Ok(Some(out))
}

fn describe_entry(shape: &Option<Vec<u64>>) -> String {
    match shape {
        Some(shape) => format!("original shape {shape:?}"),
        None => "no original shape".to_string(),
    }
}

fn decode(path: &str, detail: String) -> MetadataError {
    MetadataError::Decode {
        path: path.to_string(),
        what: "Megatron-Core mcore_data",
        detail,
    }
}

fn field<'a>(pairs: Pairs<'a>, key: &str) -> Option<&'a Value> {
    pairs
        .iter()
        .rev()
        .find(|(k, _)| matches!(k, Value::Str(s) if &**s == key))
        .map(|(_, v)| v)
}

/// One `mcore_data` dict: key → `{ORIG_SHAPE: tuple}` or `{}` (other fields are ignored: a
/// later release may add some).
fn read_mcore_data(
    p: &Pickle,
    value: &Value,
    path: &str,
    what: &str,
    into: &mut BTreeMap<String, Option<Vec<u64>>>,
) -> Result<(), MetadataError> {
    let Some(pairs) = p.dict(value) else {
        return Err(decode(
            path,
            format!("{what} is a {}, not a dict", p.describe(value)),
        ));
    };
    for (key, entry) in pairs {
        let Value::Str(key) = key else {
            return Err(decode(
                path,
                format!("{what} has a {} key, not a str", p.describe(key)),
            ));
        };
        let shape = match entry {
            Value::None => None,
            _ => {
                let Some(fields) = p.dict(entry) else {
                    return Err(decode(
                        path,
                        format!(
                            "tensor {key}: {what}[{key:?}] is a {}, not a dict",
                            p.describe(entry)
                        ),
                    ));
                };
                match field(fields, ORIG_SHAPE) {
                    None | Some(Value::None) => None,
                    Some(shape) => Some(p.uints(shape).ok_or_else(|| {
                        decode(
                            path,
                            format!(
                                "tensor {key}: {what}[{key:?}][{ORIG_SHAPE:?}] is a {}, not a tuple of non-negative ints",
                                p.describe(shape)
                            ),
                        )
                    })?),
                }
            }
        };
        into.insert(key.to_string(), shape);
    }
    Ok(())
}

/// How a reformulated tensor's stored shape maps onto its original one.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reformulation {
    /// Original global shape `G` (what tessera exposes).
    pub shape: Vec<u64>,
    /// Axis fragmentations `F` (the stored shape without its last dim).
    pub fragments: Vec<u64>,
    /// TP-local shape `L`, `L_i = G_i / F_i`.
    pub local: Vec<u64>,
}

impl Reformulation {
    /// Checks that a tensor stored as `stored` can be the reformulation of `orig`
    /// (`stored = F ++ [prod(G_i / F_i)]`, every `F_i` dividing `G_i`).
    pub fn new(stored: &[u64], orig: &[u64]) -> Result<Self, String> {
        let fits = || {
            format!(
                "the stored shape {stored:?} is not the reformulation [G_0/L_0, …, prod(L)] of the original shape {orig:?} ({ORIG_SHAPE} in mcore_data)"
            )
        };
        let Some((&flat, fragments)) = stored.split_last() else {
            return Err(fits());
        };
        if fragments.len() != orig.len() {
            return Err(fits());
        }
        let mut local = Vec::with_capacity(orig.len());
        let mut numel = 1u64;
        for (&g, &f) in orig.iter().zip(fragments) {
            if f == 0 || g % f != 0 {
                return Err(fits());
            }
            local.push(g / f);
            numel = numel.checked_mul(g / f).ok_or_else(fits)?;
        }
        if numel != flat {
            return Err(fits());
        }
        Ok(Reformulation {
            shape: orig.to_vec(),
            fragments: fragments.to_vec(),
            local,
        })
    }

    /// The TP-local box (in original coordinates) and the flat range `[start, end)` of it that
    /// a stored chunk at `offsets` with `sizes` holds: `offsets = (f…, s)`, `sizes = (1…, len)`.
    pub fn chunk(&self, offsets: &[u64], sizes: &[u64]) -> Result<(TensorBox, u64, u64), String> {
        let n = self.fragments.len();
        if offsets.len() != n + 1 || sizes.len() != n + 1 {
            return Err(format!(
                "has {} dims, the stored shape {}",
                offsets.len(),
                n + 1
            ));
        }
        let mut box_offsets = Vec::with_capacity(n);
        for i in 0..n {
            if sizes[i] != 1 || offsets[i] >= self.fragments[i] {
                return Err(format!(
                    "is not a flat range of one TP-local box: dim {i} covers {}..{} of {} fragments (a flattened chunk has size 1 there)",
                    offsets[i],
                    offsets[i].saturating_add(sizes[i]),
                    self.fragments[i]
                ));
            }
            box_offsets.push(offsets[i] * self.local[i]);
        }
        let numel: u64 = self.local.iter().product();
        let (start, len) = (offsets[n], sizes[n]);
        let end = start.checked_add(len).filter(|&end| end <= numel);
        let Some(end) = end else {
            return Err(format!(
                "holds elements {start}..{} of a TP-local box of {numel} elements {:?}",
                start.saturating_add(len),
                self.local
            ));
        };
        Ok((TensorBox::new(box_offsets, self.local.clone()), start, end))
    }
}

/// The reformulation of every tensor of `metadata` that `mcore_data` gives an original shape
/// (`None` for the others), every chunk checked against the rule. Errors name `path` (the
/// `.metadata`), the tensor and the chunk.
pub fn reformulations(
    metadata: &DcpMetadata,
    path: &str,
) -> Result<Vec<Option<Reformulation>>, MetadataError> {
    let Some(mcore) = &metadata.mcore else {
        return Ok(vec![None; metadata.tensors.len()]);
    };
    metadata
        .tensors
        .iter()
        .map(|tensor| {
            let Some(orig) = mcore.orig_shapes.get(&tensor.fqn) else {
                return Ok(None);
            };
            let refused = |detail: String| MetadataError::Decode {
                path: path.to_string(),
                what: "Megatron-Core reformulated tensor",
                detail: format!("tensor {}: {detail}", tensor.fqn),
            };
            let r = Reformulation::new(&tensor.shape, orig).map_err(refused)?;
            check_chunks(tensor, &r).map_err(refused)?;
            Ok(Some(r))
        })
        .collect()
}

fn check_chunks(tensor: &DcpTensor, r: &Reformulation) -> Result<(), String> {
    for chunk in &tensor.chunks {
        r.chunk(&chunk.offsets, &chunk.sizes).map_err(|e| {
            format!(
                "chunk at offsets {:?} sizes {:?} {e}",
                chunk.offsets, chunk.sizes
            )
        })?;
    }
    Ok(())
}

/// Megatron's `metadata.json` (`CheckpointingConfig`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MegatronConfig {
    /// `sharded_backend` (`torch_dist`).
    pub sharded_backend: String,
    /// `sharded_backend_version`.
    pub sharded_backend_version: Option<i64>,
    /// `common_backend` (written up to 0.18).
    pub common_backend: Option<String>,
    /// `common_backend_version`.
    pub common_backend_version: Option<i64>,
}

/// Parses `metadata.json`: `None` when it is JSON but not Megatron's (no `sharded_backend`),
/// an error naming `path` when it is not JSON at all.
pub fn parse_config(bytes: &[u8], path: &str) -> Result<Option<MegatronConfig>, MetadataError> {
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| MetadataError::Decode {
            path: path.to_string(),
            what: "Megatron-Core metadata.json",
            detail: e.to_string(),
        })?;
    let Some(backend) = value.get("sharded_backend").and_then(|b| b.as_str()) else {
        return Ok(None);
    };
    Ok(Some(MegatronConfig {
        sharded_backend: backend.to_string(),
        sharded_backend_version: value
            .get("sharded_backend_version")
            .and_then(|v| v.as_i64()),
        common_backend: value
            .get("common_backend")
            .and_then(|v| v.as_str())
            .map(str::to_string),
        common_backend_version: value.get("common_backend_version").and_then(|v| v.as_i64()),
    }))
}

/// What is Megatron-specific about an opened torch_dist checkpoint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MegatronDetails {
    /// `metadata.json`, when present and Megatron's.
    pub config: Option<MegatronConfig>,
    /// Class of the `.metadata` root.
    pub metadata_class: Option<String>,
    /// Class of the save plans in `all_local_plans`.
    pub plan_class: Option<String>,
    /// Where `mcore_data` was: `metadata`, `plans`, `metadata and plans`.
    pub mcore_data: Option<&'static str>,
    /// Tensors stored reformulated, exposed in their original shapes.
    pub reformulated: Vec<String>,
    /// Where the common state is: `common.pt` or the key of its DCP bytes entry.
    pub common_state: Option<String>,
    /// Releases of megatron-core that write what the files hold, e.g. `0.15`, `≥0.19`.
    pub releases: Option<&'static str>,
    /// What told the releases apart, e.g. `MCoreMetadata, common.pt`.
    pub evidence: Vec<String>,
}

impl MegatronDetails {
    /// Recognises a Megatron-Core torch_dist checkpoint from its listing, `metadata.json`
    /// (parsed) and `.metadata`; `None` for a DCP checkpoint written by anything else.
    pub fn detect(
        listing: &Listing,
        config: Option<MegatronConfig>,
        metadata: &DcpMetadata,
        reformulations: &[Option<Reformulation>],
    ) -> Option<MegatronDetails> {
        let class_name = metadata
            .class
            .as_deref()
            .map(|c| c.rsplit('.').next().unwrap_or(c));
        let mcore_class = class_name == Some("MCoreMetadata");
        let common_file = listing.files.contains_key(COMMON_FILE);
        let common_entry = metadata
            .objects
            .iter()
            .find(|o| o.fqn.starts_with(COMMON_STATE_PREFIX))
            .map(|o| o.fqn.clone());
        if config.is_none() && metadata.mcore.is_none() && !mcore_class && !common_file {
            return None;
        }
        let mcore = metadata.mcore.clone().unwrap_or_default();
        let plan_class = mcore.plan_class.clone();
        let mcore_plans = plan_class
            .as_deref()
            .is_some_and(|c| c.ends_with("MCoreSavePlan"));
        let mut evidence = Vec::new();
        let releases = if mcore_class {
            // Only 0.15 pickles the Metadata subclass; 0.16 on keep a dummy to unpickle it.
            evidence.push("MCoreMetadata".to_string());
            Some("0.15")
        } else if mcore.on_metadata || mcore_plans {
            evidence.push("mcore_data".to_string());
            Some("0.8–0.14")
        } else if common_entry.is_some() {
            evidence.push("common_state in DCP".to_string());
            Some("≥0.19")
        } else if common_file || config.as_ref().is_some_and(|c| c.common_backend.is_some()) {
            // common.pt without mcore_data: 0.16–0.18 (plain SavePlans), or an older save
            // whose coordinator reused cached metadata.
            if mcore.plans > 0 {
                Some("0.16–0.18")
            } else {
                Some("≤0.18")
            }
        } else if config.is_some() {
            Some("≥0.19")
        } else {
            None
        };
        if common_file {
            evidence.push(COMMON_FILE.to_string());
        }
        let mcore_data = match (mcore.on_metadata, mcore.on_plans) {
            (true, true) => Some("metadata and plans"),
            (true, false) => Some("metadata"),
            (false, true) => Some("plans"),
            (false, false) => None,
        };
        Some(MegatronDetails {
            config,
            metadata_class: metadata.class.clone(),
            plan_class,
            mcore_data,
            reformulated: metadata
                .tensors
                .iter()
                .zip(reformulations)
                .filter(|(_, r)| r.is_some())
                .map(|(t, _)| t.fqn.clone())
                .collect(),
            common_state: if common_file {
                Some(COMMON_FILE.to_string())
            } else {
                common_entry
            },
            releases,
            evidence,
        })
    }

    /// `Megatron-Core torch_dist` with the backend version and the releases the files point
    /// to, e.g. `backend v1, MCoreMetadata, common.pt: megatron-core 0.15`.
    pub fn writer(&self) -> Writer {
        let mut parts = Vec::new();
        if let Some(version) = self.config.as_ref().and_then(|c| c.sharded_backend_version) {
            parts.push(format!("backend v{version}"));
        }
        parts.extend(self.evidence.iter().cloned());
        let mut version = parts.join(", ");
        if let Some(releases) = self.releases {
            if !version.is_empty() {
                version.push_str(": ");
            }
            version.push_str("megatron-core ");
            version.push_str(releases);
        }
        Writer::new(
            "Megatron-Core torch_dist",
            (!version.is_empty()).then_some(version),
        )
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn a_layer_stacked_qkv_state_maps_onto_its_tp_local_boxes() {
        // [2, 192, 64] saved TP2 with one layer per fragment: F = [2, 2, 1], L = [1, 96, 64].
        let r = Reformulation::new(&[2, 2, 1, 6144], &[2, 192, 64]).unwrap();
        assert_eq!(r.local, vec![1, 96, 64]);
        let (parent, start, end) = r.chunk(&[1, 1, 0, 3008], &[1, 1, 1, 3136]).unwrap();
        assert_eq!(parent, TensorBox::new(vec![1, 96, 0], vec![1, 96, 64]));
        assert_eq!((start, end), (3008, 6144));
    }

    #[test]
    fn a_zero_dim_original_is_one_element() {
        let r = Reformulation::new(&[1], &[]).unwrap();
        let (parent, start, end) = r.chunk(&[0], &[1]).unwrap();
        assert_eq!((parent.ndim(), start, end), (0, 0, 1));
    }

    #[test]
    fn shapes_and_chunks_off_the_rule_are_refused() {
        assert!(Reformulation::new(&[3, 1, 2048], &[96, 64]).is_ok());
        for (stored, orig) in [
            // One dim short, a zero fragmentation, 96 not split in 5, prod(L) ≠ the last dim,
            // nothing at all.
            (&[2, 1, 3072][..], &[96][..]),
            (&[0, 1, 0][..], &[0, 64][..]),
            (&[5, 1, 1216][..], &[96, 64][..]),
            (&[3, 1, 3072][..], &[96, 64][..]),
            (&[][..], &[][..]),
        ] {
            let e = Reformulation::new(stored, orig).unwrap_err();
            assert!(e.contains("is not the reformulation"), "{e}");
        }
        let r = Reformulation::new(&[2, 1, 3072], &[96, 64]).unwrap();
        assert!(
            r.chunk(&[0, 0, 1536], &[1, 1, 1537])
                .unwrap_err()
                .contains("1536..3073")
        );
        assert!(
            r.chunk(&[0, 0, 0], &[2, 1, 10])
                .unwrap_err()
                .contains("dim 0")
        );
        assert!(
            r.chunk(&[2, 0, 0], &[1, 1, 10])
                .unwrap_err()
                .contains("dim 0")
        );
        assert!(r.chunk(&[0, 0], &[1, 10]).unwrap_err().contains("dims"));
        assert!(r.chunk(&[0, 0, u64::MAX], &[1, 1, 2]).is_err());
    }
}
