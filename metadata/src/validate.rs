//! Geometric and byte-level validation of checkpoint metadata, with errors that name the tensor,
//! box and file at fault. Readers of every format run this before a checkpoint is planned against.

use crate::{BoxIndex, CheckpointMeta, MetadataError, shape_to_string};

/// Checks every tensor and object of `meta`:
/// saved boxes inside the shape, no two overlapping, together covering the tensor (no hole),
/// byte lengths matching element counts, byte ranges inside their files (where sizes are known).
pub fn validate(meta: &CheckpointMeta) -> Result<(), MetadataError> {
    for (t, tensor) in meta.tensors().iter().enumerate() {
        let chunks = meta.chunks_of(t as u32);
        let esize = tensor.dtype.size();
        let mut covered = 0u64;
        for chunk in chunks {
            let region = &chunk.region;
            for dim in 0..region.ndim() {
                if region.end(dim) > tensor.shape[dim] {
                    return Err(MetadataError::BoxOutsideShape {
                        fqn: tensor.fqn.clone(),
                        region: region.to_string(),
                        shape: shape_to_string(&tensor.shape),
                        dim,
                        start: region.offsets[dim],
                        end: region.end(dim),
                        size: tensor.shape[dim],
                    });
                }
            }
            let numel = region.numel();
            let needed = match &chunk.bytes.strides {
                None => numel * esize,
                // A strided chunk needs the span from its first to its last element.
                Some(strides) if numel > 0 => {
                    let last: u64 = region
                        .lengths
                        .iter()
                        .zip(strides)
                        .map(|(len, stride)| (len - 1) * stride)
                        .sum();
                    (last + 1) * esize
                }
                Some(_) => 0,
            };
            let length_ok = match chunk.bytes.strides {
                None => chunk.bytes.length == needed,
                Some(_) => chunk.bytes.length >= needed,
            };
            if !length_ok {
                return Err(MetadataError::ByteLengthMismatch {
                    fqn: tensor.fqn.clone(),
                    region: region.to_string(),
                    numel,
                    dtype: tensor.dtype.to_string(),
                    expected: needed,
                    actual: chunk.bytes.length,
                });
            }
            let file = &meta.files()[chunk.bytes.file as usize];
            let end = chunk.bytes.offset + chunk.bytes.length;
            if let Some(size) = file.size
                && end > size
            {
                return Err(MetadataError::ByteRangePastEnd {
                    fqn: tensor.fqn.clone(),
                    region: region.to_string(),
                    file: file.path.clone(),
                    start: chunk.bytes.offset,
                    end,
                    size,
                });
            }
            covered += numel;
        }
        let index = BoxIndex::build(chunks.iter().map(|c| &c.region).collect::<Vec<_>>());
        if let Some((a, b)) = index.find_overlap() {
            return Err(MetadataError::OverlappingBoxes {
                fqn: tensor.fqn.clone(),
                first: chunks[a as usize].region.to_string(),
                second: chunks[b as usize].region.to_string(),
            });
        }
        // In bounds and pairwise disjoint, so the boxes cover the tensor exactly when their
        // element counts add up to the tensor's.
        if covered != tensor.numel() {
            return Err(MetadataError::Hole {
                fqn: tensor.fqn.clone(),
                covered,
                numel: tensor.numel(),
            });
        }
    }
    for object in meta.objects() {
        let file = &meta.files()[object.file as usize];
        let end = object.offset + object.length;
        if let Some(size) = file.size
            && end > size
        {
            return Err(MetadataError::ByteRangePastEnd {
                fqn: object.key.clone(),
                region: "(object)".to_string(),
                file: file.path.clone(),
                start: object.offset,
                end,
                size,
            });
        }
    }
    Ok(())
}
