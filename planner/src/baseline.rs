//! The all-pairs planning DCP used until torch 2.10, kept as the benchmark baseline and as a
//! cross-check in tests: every rank plans for itself, testing each of its request boxes against
//! every saved chunk of the tensor and emitting a read item per overlap (no index, no dedup).

use tessera_metadata::{CheckpointMeta, TensorBox};

use crate::RequestSet;
use crate::plan::target_boxes;

/// One overlap as DCP's per-rank planner records it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadItem {
    /// Index into the rank's requests.
    pub request: u32,
    /// Index into [`CheckpointMeta::chunks`].
    pub chunk: u32,
    /// The overlap in global coordinates.
    pub region: TensorBox,
    /// Where the overlap starts inside the saved chunk.
    pub chunk_offsets: Vec<u64>,
    /// Bytes of the overlap.
    pub bytes: u64,
}

/// Every rank's read items, found by scanning all (request box, saved chunk) pairs.
pub fn all_pairs_read_items(meta: &CheckpointMeta, requests: &RequestSet) -> Vec<Vec<ReadItem>> {
    let tensors = meta.tensors();
    requests
        .ranks
        .iter()
        .map(|rank_requests| {
            let mut items = Vec::new();
            for (r, request) in rank_requests.iter().enumerate() {
                let tensor = &tensors[request.tensor as usize];
                let first = meta.first_chunk_index(request.tensor) as u32;
                for sub in target_boxes(tensor, &request.target) {
                    for (c, chunk) in meta.chunks_of(request.tensor).iter().enumerate() {
                        if let Some(region) = chunk.region.intersect(&sub) {
                            items.push(ReadItem {
                                request: r as u32,
                                chunk: first + c as u32,
                                chunk_offsets: chunk.region.relative_offsets(&region).to_vec(),
                                bytes: region.numel() * tensor.dtype.size(),
                                region,
                            });
                        }
                    }
                }
            }
            items
        })
        .collect()
}

/// Number of overlaps and the bytes they cover, over all ranks.
pub fn all_pairs_overlaps(meta: &CheckpointMeta, requests: &RequestSet) -> (u64, u64) {
    let items = all_pairs_read_items(meta, requests);
    let count = items.iter().map(|r| r.len() as u64).sum();
    let bytes = items.iter().flatten().map(|i| i.bytes).sum();
    (count, bytes)
}
