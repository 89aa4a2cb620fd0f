//! Save planning: which rank writes which box when a layout saves a checkpoint. Replicated boxes
//! are written once, by the holder with the fewest bytes so far (worst-fit, largest first), rather
//! than always by the lowest rank.

use std::collections::HashMap;

use tessera_metadata::{TensorBox, TensorMeta};

use crate::{PlanError, RequestSet, Target};

/// One box a rank writes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriteItem {
    /// Index into the tensors.
    pub tensor: u32,
    /// The box.
    pub region: TensorBox,
}

/// For every rank, the boxes it writes (in tensor order). Every distinct box held by any rank is
/// written exactly once; empty boxes are kept (they record the layout) and cost nothing.
pub fn assign_writers(
    tensors: &[TensorMeta],
    holdings: &RequestSet,
) -> Result<Vec<Vec<WriteItem>>, PlanError> {
    let world = holdings.world_size() as usize;
    let mut distinct: Vec<(u32, TensorBox, Vec<u32>)> = Vec::new();
    let mut ids: HashMap<(u32, &TensorBox), usize> = HashMap::new();
    for (rank, requests) in holdings.ranks.iter().enumerate() {
        for request in requests {
            let Target::Box(region) = &request.target else {
                return Err(PlanError::Preset {
                    preset: "save",
                    detail: format!(
                        "rank {rank}: tensor {} is held as a flat range; saving needs boxes",
                        tensors
                            .get(request.tensor as usize)
                            .map_or("?", |t| t.fqn.as_str())
                    ),
                });
            };
            let id = *ids.entry((request.tensor, region)).or_insert_with(|| {
                distinct.push((request.tensor, region.clone(), Vec::new()));
                distinct.len() - 1
            });
            distinct[id].2.push(rank as u32);
        }
    }
    let bytes = |i: usize| distinct[i].1.numel() * tensors[distinct[i].0 as usize].dtype.size();
    let mut order: Vec<usize> = (0..distinct.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(bytes(i)), i));
    let mut load = vec![0u64; world];
    let mut writer = vec![0u32; distinct.len()];
    for i in order {
        let holders = &distinct[i].2;
        let mut best = holders[0];
        for &h in &holders[1..] {
            if load[h as usize] < load[best as usize] {
                best = h;
            }
        }
        writer[i] = best;
        load[best as usize] += bytes(i);
    }
    let mut out: Vec<Vec<WriteItem>> = vec![Vec::new(); world];
    for (i, (tensor, region, _)) in distinct.into_iter().enumerate() {
        out[writer[i] as usize].push(WriteItem { tensor, region });
    }
    for items in &mut out {
        items.sort_by(|a, b| (a.tensor, &a.region).cmp(&(b.tensor, &b.region)));
    }
    Ok(out)
}
