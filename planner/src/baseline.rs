//! The all-pairs intersection DCP used until torch 2.10: every request box against every saved
//! chunk of its tensor. Kept as the benchmark baseline and as a cross-check in tests.

use tessera_metadata::CheckpointMeta;

use crate::RequestSet;
use crate::plan::target_boxes;

/// Number of (request box, saved chunk) overlaps found by scanning all pairs, and the bytes they
/// cover. No dedup: every rank counts its own.
pub fn all_pairs_overlaps(meta: &CheckpointMeta, requests: &RequestSet) -> (u64, u64) {
    let tensors = meta.tensors();
    let (mut count, mut bytes) = (0u64, 0u64);
    for rank_requests in &requests.ranks {
        for request in rank_requests {
            let tensor = &tensors[request.tensor as usize];
            for sub in target_boxes(tensor, &request.target) {
                for chunk in meta.chunks_of(request.tensor) {
                    if let Some(overlap) = chunk.region.intersect(&sub) {
                        count += 1;
                        bytes += overlap.numel() * tensor.dtype.size();
                    }
                }
            }
        }
    }
    (count, bytes)
}
