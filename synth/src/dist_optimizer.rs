//! Which rank writes what when optimizer states are saved the way Megatron-Core's distributed
//! optimizer saves them (`flattened_range` sharded tensors, Megatron-Core ≤ 0.15 and the
//! `fully_sharded_model_space`-less formats after it).
//!
//! In Megatron, every model-parallel rank (one coordinate on each mesh dim but data-parallel)
//! lays the TP-local boxes of its parameters end to end in one flat buffer, in reverse model
//! order (the order gradients become ready), and splits that buffer into equal contiguous parts,
//! one per data-parallel rank (`ceil(N / dp)` elements each, the last ones shorter). Each DP
//! rank owns the optimizer states (fp32 master weights and Adam moments) of its part only, and
//! saves, for every parameter its part touches, the flat range of that parameter's TP-local box
//! that falls in its part. So a large parameter is split at arbitrary element positions (mid-row)
//! over several DP ranks, and a small one (a norm) may lie whole in one rank's part.
//!
//! Here the "parameters" of one buffer are the saved boxes of one optimizer state (`master`,
//! `exp_avg`, `exp_avg_sq`): each state has its own buffer with the same layout, as Megatron's
//! per-state tensors do. A box replicated over other mesh dims too (a norm over TP) is written
//! once, by the model-parallel rank with the lowest rank number, like Megatron's replica ids.

use std::collections::{BTreeMap, HashMap};

use tessera_metadata::{TensorBox, TensorMeta};
use tessera_planner::{Layout, RequestSet, Target, WriteItem, assign_writers};

use crate::SynthError;

/// FQN prefix of the optimizer states in synthetic models.
const STATE_PREFIX: &str = "optim.state.";

/// One thing a rank writes: a box, or a flat range of a box.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WriteEntry {
    /// A whole box.
    Box(WriteItem),
    /// Elements `[start, end)` of `parent`'s row-major flattening.
    Flat {
        /// Index into the tensors.
        tensor: u32,
        /// The TP-local box.
        parent: TensorBox,
        /// First element of the range in the box's flattening.
        start: u64,
        /// One past its last.
        end: u64,
    },
}

/// For every rank, what it writes: the parameters and other tensors as [`assign_writers`] picks
/// (replicas once, balanced), the optimizer states (`optim.state.*`) as flat ranges split over
/// the mesh dim `dp_dim` (module docs).
pub(crate) fn dist_optimizer_writes(
    tensors: &[TensorMeta],
    layout: &Layout,
    holdings: &RequestSet,
    dp_dim: &str,
) -> Result<Vec<Vec<WriteEntry>>, SynthError> {
    let refuse = |detail: String| SynthError::DistOptimizer {
        dim: dp_dim.to_string(),
        detail,
    };
    let Some(axis) = layout.mesh.iter().position(|d| d.name == dp_dim) else {
        return Err(refuse(format!(
            "the save layout's mesh has no such dim (it has {})",
            layout
                .mesh
                .iter()
                .map(|d| d.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )));
    };
    let dp = u64::from(layout.mesh[axis].size);
    // Rank numbering is row-major over the mesh: the dp coordinate moves ranks by this stride.
    let stride: u64 = layout.mesh[axis + 1..]
        .iter()
        .map(|d| u64::from(d.size))
        .product();
    let dp_coord = |rank: u32| (u64::from(rank) / stride) % dp;
    let group_base = |rank: u32| u64::from(rank) - dp_coord(rank) * stride;

    let is_state = |t: u32| tensors[t as usize].fqn.starts_with(STATE_PREFIX);
    let plain = RequestSet {
        ranks: holdings
            .ranks
            .iter()
            .map(|requests| {
                requests
                    .iter()
                    .filter(|r| !is_state(r.tensor))
                    .cloned()
                    .collect()
            })
            .collect(),
        disjoint: holdings.disjoint,
    };
    let mut out: Vec<Vec<WriteEntry>> = assign_writers(tensors, &plain)?
        .into_iter()
        .map(|items| items.into_iter().map(WriteEntry::Box).collect())
        .collect();

    // Every distinct optimizer-state box and the ranks holding it (ascending).
    let mut holders: BTreeMap<(u32, &TensorBox), Vec<u32>> = BTreeMap::new();
    for (rank, requests) in holdings.ranks.iter().enumerate() {
        for request in requests.iter().filter(|r| is_state(r.tensor)) {
            let Target::Box(region) = &request.target else {
                return Err(refuse(format!(
                    "rank {rank} holds tensor {} as a flat range; a save layout gives boxes",
                    tensors[request.tensor as usize].fqn
                )));
            };
            holders
                .entry((request.tensor, region))
                .or_default()
                .push(rank as u32);
        }
    }

    // Per (model-parallel group, state): the buffer's boxes, in reverse model order.
    let mut buffers: HashMap<(u64, &str), Vec<(u32, &TensorBox)>> = HashMap::new();
    for ((tensor, region), ranks) in holders.iter().rev() {
        let fqn = &tensors[*tensor as usize].fqn;
        let base = group_base(ranks[0]);
        let missing: Vec<u64> = (0..dp)
            .map(|i| base + i * stride)
            .filter(|r| ranks.binary_search(&(*r as u32)).is_err())
            .collect();
        if !missing.is_empty() {
            return Err(refuse(format!(
                "tensor {fqn} box {region} is held by rank {} but not by its data-parallel peers {missing:?}; replicate optimizer states over {dp_dim:?} in the save layout (the distributed optimizer splits them itself)",
                ranks[0]
            )));
        }
        if region.numel() == 0 {
            // Nothing to split; the box still records the layout (and keeps the tensor listed).
            out[base as usize].push(WriteEntry::Box(WriteItem {
                tensor: *tensor,
                region: (*region).clone(),
            }));
            continue;
        }
        let state = fqn.rsplit_once('.').map_or(fqn.as_str(), |(_, s)| s);
        buffers
            .entry((base, state))
            .or_default()
            .push((*tensor, region));
    }

    let mut keys: Vec<(u64, &str)> = buffers.keys().copied().collect();
    keys.sort_unstable();
    for key in keys {
        let boxes = &buffers[&key];
        let (base, _) = key;
        let total: u64 = boxes.iter().map(|(_, r)| r.numel()).sum();
        let part = total.div_ceil(dp);
        let mut at = 0u64;
        for (tensor, region) in boxes {
            let n = region.numel();
            // The DP ranks whose parts [i·part, (i+1)·part) meet this box's [at, at + n).
            let first = at / part;
            let last = (at + n - 1) / part;
            for i in first..=last {
                let lo = (i * part).max(at);
                let hi = ((i + 1) * part).min(at + n);
                out[(base + i * stride) as usize].push(WriteEntry::Flat {
                    tensor: *tensor,
                    parent: (*region).clone(),
                    start: lo - at,
                    end: hi - at,
                });
            }
            at += n;
        }
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tessera_metadata::DType;
    use tessera_planner::presets::{MegatronGpt, megatron_gpt};

    fn megatron(tp: u32, dp: u32, zero1: bool) -> Layout {
        megatron_gpt(MegatronGpt {
            tp,
            pp: 1,
            dp,
            num_layers: 1,
            zero1,
        })
        .unwrap()
    }

    #[test]
    fn each_dp_rank_writes_its_contiguous_part_of_the_buffer() {
        // One layer's column-parallel weight (tp2: [3, 5] each) and a norm (replicated over tp).
        let tensors = vec![
            TensorMeta::new("model.layers.0.mlp.fc1.weight", DType::Bf16, vec![6, 5]),
            TensorMeta::new("model.layers.0.input_norm.weight", DType::Bf16, vec![4]),
            TensorMeta::new(
                "optim.state.model.layers.0.mlp.fc1.weight.exp_avg",
                DType::F32,
                vec![6, 5],
            ),
            TensorMeta::new(
                "optim.state.model.layers.0.input_norm.weight.exp_avg",
                DType::F32,
                vec![4],
            ),
        ];
        let layout = megatron(2, 3, false);
        let holdings = layout.resolve(&tensors).unwrap();
        let writes = dist_optimizer_writes(&tensors, &layout, &holdings, "dp").unwrap();
        let flat = |rank: usize| {
            writes[rank]
                .iter()
                .filter_map(|w| match w {
                    WriteEntry::Flat {
                        tensor,
                        parent,
                        start,
                        end,
                    } => Some((*tensor, parent.offsets[0], *start, *end)),
                    WriteEntry::Box(_) => None,
                })
                .collect::<Vec<_>>()
        };
        // Mesh (pp 1, dp 3, tp 2): ranks 0, 2, 4 are tp 0 and 1, 3, 5 tp 1. tp 0's buffer is the
        // norm (4, written here: lowest holder) then its fc1 box (15): 19 elements, parts of 7.
        assert_eq!(flat(0), vec![(3, 0, 0, 4), (2, 0, 0, 3)]);
        assert_eq!(flat(2), vec![(2, 0, 3, 10)]);
        assert_eq!(flat(4), vec![(2, 0, 10, 15)]);
        // tp 1's buffer is its fc1 box alone (rows 3..6): parts of 5.
        assert_eq!(flat(1), vec![(2, 3, 0, 5)]);
        assert_eq!(flat(3), vec![(2, 3, 5, 10)]);
        assert_eq!(flat(5), vec![(2, 3, 10, 15)]);
        // The parameters stay boxes.
        assert_eq!(
            writes
                .iter()
                .flatten()
                .filter(|w| matches!(w, WriteEntry::Box(_)))
                .count(),
            3
        );
    }

    #[test]
    fn states_sharded_over_dp_or_an_unknown_dim_are_refused_by_name() {
        let tensors = vec![
            TensorMeta::new("model.layers.0.mlp.fc1.weight", DType::Bf16, vec![6, 5]),
            TensorMeta::new(
                "optim.state.model.layers.0.mlp.fc1.weight.master",
                DType::F32,
                vec![6, 5],
            ),
        ];
        let layout = megatron(2, 2, true);
        let holdings = layout.resolve(&tensors).unwrap();
        let err = dist_optimizer_writes(&tensors, &layout, &holdings, "dp").unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("optim.state.model.layers.0.mlp.fc1.weight.master")
                && text.contains("data-parallel peers"),
            "{text}"
        );
        let err = dist_optimizer_writes(&tensors, &layout, &holdings, "data").unwrap_err();
        assert!(
            err.to_string()
                .contains("has no such dim (it has pp, dp, tp)"),
            "{err}"
        );
    }
}
