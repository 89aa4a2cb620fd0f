//! Explicit per-rank requests, the general form underneath layouts: a box of a tensor, or a flat
//! row-major range of it (what ZeRO / FSDP1 / distributed-optimizer buffers hold).

use std::collections::HashMap;

use serde::{Deserialize, Serialize};
use tessera_metadata::{TensorBox, TensorMeta, row_major_strides, shape_to_string};

use crate::PlanError;

/// What a rank wants of one tensor.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// A box in global coordinates; the destination buffer is the box, row-major.
    Box(TensorBox),
    /// Elements `[start, end)` of the tensor's row-major flattening; the destination is 1-d.
    Flat {
        /// First element.
        start: u64,
        /// One past the last element.
        end: u64,
    },
}

impl Target {
    /// Elements wanted.
    pub fn numel(&self) -> u64 {
        match self {
            Target::Box(b) => b.numel(),
            Target::Flat { start, end } => end - start,
        }
    }

    /// Shape of the destination buffer: the box lengths, or `[end - start]` for a flat range.
    pub fn buffer_shape(&self) -> Vec<u64> {
        match self {
            Target::Box(b) => b.lengths.to_vec(),
            Target::Flat { start, end } => vec![end - start],
        }
    }
}

/// One request of one rank: a tensor (index into the checkpoint's tensors) and what of it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Request {
    /// Index into the checkpoint's tensors.
    pub tensor: u32,
    /// The wanted part.
    pub target: Target,
}

/// Every rank's requests: `ranks[r]` is rank r's list.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RequestSet {
    /// Per-rank requests.
    pub ranks: Vec<Vec<Request>>,
    /// Promise that, per tensor, any two requests are identical or disjoint (true for layouts,
    /// whose shards partition each tensor). Lets the planner skip its overlap check; leave it
    /// false for explicit requests.
    pub disjoint: bool,
}

impl RequestSet {
    /// Number of ranks.
    pub fn world_size(&self) -> u32 {
        self.ranks.len() as u32
    }
}

/// One request as JSON: `{"fqn", "offsets", "lengths"}` or `{"fqn", "flat": [start, end]}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ExplicitRequest {
    /// A box.
    Box {
        /// Tensor FQN.
        fqn: String,
        /// Box start.
        offsets: Vec<u64>,
        /// Box extent.
        lengths: Vec<u64>,
    },
    /// A flat row-major range.
    Flat {
        /// Tensor FQN.
        fqn: String,
        /// `[start, end)`.
        flat: [u64; 2],
    },
}

/// Explicit requests for every rank, as JSON: `{"ranks": [[request, ...], ...]}`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExplicitRequests {
    /// `ranks[r]` holds rank r's requests.
    pub ranks: Vec<Vec<ExplicitRequest>>,
}

impl ExplicitRequests {
    /// Parses request JSON.
    pub fn from_json(text: &str) -> Result<Self, PlanError> {
        serde_json::from_str(text).map_err(|e| PlanError::Json {
            what: "requests",
            detail: e.to_string(),
        })
    }

    /// The explicit form of resolved `requests` (`tensors`: what their indices name): what a
    /// rank sends when its requests come from a layout, by name, as a user would write them.
    pub fn of(requests: &RequestSet, tensors: &[TensorMeta]) -> Self {
        let explicit = |r: &Request| {
            let fqn = tensors
                .get(r.tensor as usize)
                .map(|t| t.fqn.clone())
                .unwrap_or_default();
            match &r.target {
                Target::Box(b) => ExplicitRequest::Box {
                    fqn,
                    offsets: b.offsets.to_vec(),
                    lengths: b.lengths.to_vec(),
                },
                Target::Flat { start, end } => ExplicitRequest::Flat {
                    fqn,
                    flat: [*start, *end],
                },
            }
        };
        Self {
            ranks: requests
                .ranks
                .iter()
                .map(|mine| mine.iter().map(explicit).collect())
                .collect(),
        }
    }

    /// Resolves FQNs against the checkpoint's tensors and checks every request fits its tensor.
    pub fn resolve(&self, tensors: &[TensorMeta]) -> Result<RequestSet, PlanError> {
        // Rank numbers are u32 everywhere downstream: refuse a list they cannot number.
        if self.ranks.len() > crate::MAX_WORLD as usize {
            return Err(PlanError::WorldTooLarge {
                field: "requests \"ranks\"".to_string(),
                ranks: self.ranks.len() as u128,
                limit: crate::MAX_WORLD,
            });
        }
        let by_name: HashMap<&str, u32> = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.fqn.as_str(), i as u32))
            .collect();
        let mut ranks = Vec::with_capacity(self.ranks.len());
        for (rank, requests) in self.ranks.iter().enumerate() {
            let rank = rank as u32;
            let mut resolved = Vec::with_capacity(requests.len());
            for request in requests {
                let fqn = match request {
                    ExplicitRequest::Box { fqn, .. } | ExplicitRequest::Flat { fqn, .. } => fqn,
                };
                let Some(&t) = by_name.get(fqn.as_str()) else {
                    return Err(PlanError::UnknownTensor {
                        rank,
                        fqn: fqn.clone(),
                    });
                };
                let target = match request {
                    ExplicitRequest::Box {
                        offsets, lengths, ..
                    } => Target::Box(TensorBox::new(offsets.clone(), lengths.clone())),
                    ExplicitRequest::Flat { flat, .. } => Target::Flat {
                        start: flat[0],
                        end: flat[1],
                    },
                };
                check_target(rank, &tensors[t as usize], &target)?;
                resolved.push(Request { tensor: t, target });
            }
            ranks.push(resolved);
        }
        Ok(RequestSet {
            ranks,
            disjoint: false,
        })
    }
}

/// Checks that `target` lies inside `tensor`.
pub fn check_target(rank: u32, tensor: &TensorMeta, target: &Target) -> Result<(), PlanError> {
    match target {
        Target::Box(region) => {
            let fits = region.offsets.len() == tensor.shape.len()
                && region.lengths.len() == tensor.shape.len()
                && (0..region.ndim()).all(|d| {
                    region.offsets[d]
                        .checked_add(region.lengths[d])
                        .is_some_and(|end| end <= tensor.shape[d])
                });
            if !fits {
                let region = if region.offsets.len() == region.lengths.len() {
                    region.to_string()
                } else {
                    format!("offsets {:?} lengths {:?}", region.offsets, region.lengths)
                };
                return Err(PlanError::RequestOutsideShape {
                    rank,
                    fqn: tensor.fqn.clone(),
                    region,
                    shape: shape_to_string(&tensor.shape),
                });
            }
        }
        Target::Flat { start, end } => {
            if start > end || *end > tensor.numel() {
                return Err(PlanError::FlatOutOfRange {
                    rank,
                    fqn: tensor.fqn.clone(),
                    start: *start,
                    end: *end,
                    numel: tensor.numel(),
                });
            }
        }
    }
    Ok(())
}

pub use tessera_metadata::flat_range_to_boxes;

/// Flat row-major index of the element at `coords` in a tensor whose row-major strides are given.
pub fn flat_index(coords: &[u64], strides: &[u64]) -> u64 {
    coords.iter().zip(strides).map(|(c, s)| c * s).sum()
}

/// Row-major strides of a tensor's global shape (re-exported for destination mapping).
pub fn global_strides(shape: &[u64]) -> Vec<u64> {
    row_major_strides(shape)
}
