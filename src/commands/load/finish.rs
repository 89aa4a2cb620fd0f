//! After a rank loaded: `--check` (every byte against the synthetic value formula) and `--dump`
//! (`DIR/rank-<r>.safetensors`, written whole then renamed).

use std::collections::{HashMap, HashSet};

use anyhow::{Context, Result};
use tessera_metadata::formats::safetensors::{self, TensorView};
use tessera_planner::{RankPlan, Target};
use tessera_synth as synth;

use super::LoadArgs;

/// Per-rank work after loading: the value check (`--check`) and the dump (`--dump`) of `buffers`,
/// one per destination of `plan`.
pub(super) fn finish_rank(args: &LoadArgs, plan: &RankPlan, buffers: &[Vec<u8>]) -> Result<()> {
    if args.check {
        for (dest, buffer) in plan.destinations.iter().zip(buffers) {
            let tensor = &plan.tensors[dest.tensor as usize];
            let checked = match &dest.target {
                Target::Box(region) => synth::check_box(tensor, region, buffer),
                Target::Flat { start, end } => synth::check_flat(tensor, *start, *end, buffer),
            };
            // Kept as the synth error, so that a mismatch exits as a verification failure (4);
            // the drivers of several ranks put the rank in front.
            checked?;
        }
    }
    if let Some(dir) = &args.dump {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {dir}"))?;
        let shapes: Vec<Vec<u64>> = plan
            .destinations
            .iter()
            .map(|d| d.target.buffer_shape())
            .collect();
        let names = dump_names(
            plan.destinations
                .iter()
                .map(|d| plan.tensors[d.tensor as usize].fqn.as_str()),
        );
        let views: Vec<TensorView<'_>> = plan
            .destinations
            .iter()
            .enumerate()
            .map(|(i, dest)| TensorView {
                name: &names[i],
                dtype: plan.tensors[dest.tensor as usize].dtype,
                shape: &shapes[i],
                data: &buffers[i],
            })
            .collect();
        let bytes = safetensors::serialize(&views, None)?;
        let path = std::path::Path::new(dir).join(format!("rank-{}.safetensors", plan.rank));
        let tmp = path.with_extension("safetensors.tmp");
        std::fs::write(&tmp, bytes).with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("renaming {}", tmp.display()))?;
    }
    Ok(())
}

/// Unique safetensors names for a rank's destinations, in order: a tensor's FQN, or `FQN#k` (the
/// first free k) when the rank holds several boxes of it. Linear in the number of destinations:
/// a hash set of the names taken and, per FQN, the last k tried (a name once taken stays taken,
/// so the search for the next free k can start there); the list scan it replaces made a 100k
/// tensor dump take about a minute.
pub fn dump_names<'a>(fqns: impl Iterator<Item = &'a str>) -> Vec<String> {
    let fqns = fqns.collect::<Vec<_>>();
    let mut taken: HashSet<String> = HashSet::with_capacity(fqns.len());
    let mut next_k: HashMap<&str, u64> = HashMap::new();
    let mut names = Vec::with_capacity(fqns.len());
    for fqn in fqns {
        let mut name = fqn.to_string();
        if taken.contains(&name) {
            let k = next_k.entry(fqn).or_insert(1);
            name = format!("{fqn}#{k}");
            while taken.contains(&name) {
                *k += 1;
                name = format!("{fqn}#{k}");
            }
        }
        taken.insert(name.clone());
        names.push(name);
    }
    names
}
