//! Flat ranges: elements `[start, end)` of the row-major flattening of a tensor or of a box.
//!
//! Several writers save *irregular* chunks this way: Megatron-Core's distributed optimizer
//! (`flattened_range` of each TP-local box, split over DP ranks), DeepSpeed ZeRO's flat fp32
//! partitions, ByteCheckpoint's irregular sharding. A flat range of a box tiles into at most
//! 2·ndim − 1 boxes (a partial leading row, whole rows, a partial trailing row, recursively), and
//! each of those boxes is contiguous and row-major inside the range's bytes. So a flat-range chunk
//! is modelled as the few [`SavedChunk`]s that tile it ([`flat_range_chunks`]): the planner and the
//! loader intersect them like any other box, without ever enumerating elements.

use crate::{ByteMeta, SavedChunk, TensorBox};

/// Splits the flat row-major range `[start, end)` of a tensor of `shape` into at most 2·ndim − 1
/// boxes, in flat order: a partial leading row, whole rows, a partial trailing row, recursively.
pub fn flat_range_to_boxes(shape: &[u64], start: u64, end: u64) -> Vec<TensorBox> {
    let mut out = Vec::new();
    let mut prefix = Vec::new();
    split_flat(shape, start, end, &mut prefix, &mut out);
    out
}

/// The boxes (in global coordinates) that tile elements `[start, end)` of `parent`'s row-major
/// flattening, each with the position of its first element inside the range (`0` for the first
/// box). `end` must not pass `parent.numel()`.
pub fn flat_range_of_box(parent: &TensorBox, start: u64, end: u64) -> Vec<(u64, TensorBox)> {
    debug_assert!(start <= end && end <= parent.numel());
    let mut position = 0;
    flat_range_to_boxes(&parent.lengths, start, end)
        .into_iter()
        .map(|local| {
            let at = position;
            position += local.numel();
            let offsets = local
                .offsets
                .iter()
                .zip(&parent.offsets)
                .map(|(l, o)| l + o)
                .collect::<Vec<_>>();
            (at, TensorBox::new(offsets, local.lengths))
        })
        .collect()
}

/// The saved chunks of tensor `tensor` that a flat-range chunk is made of: elements
/// `[start, end)` of `parent`'s row-major flattening, stored contiguously in `file` from byte
/// `byte_offset` on, `element_size` bytes an element. None carries a checksum: the formats that
/// write such chunks checksum the whole range, if anything.
pub fn flat_range_chunks(
    tensor: u32,
    parent: &TensorBox,
    start: u64,
    end: u64,
    file: u32,
    byte_offset: u64,
    element_size: u64,
) -> Vec<SavedChunk> {
    flat_range_of_box(parent, start, end)
        .into_iter()
        .map(|(at, region)| SavedChunk {
            tensor,
            bytes: ByteMeta {
                file,
                offset: byte_offset + at * element_size,
                length: region.numel() * element_size,
                strides: None,
            },
            region,
            crc32c: None,
            crc32: None,
        })
        .collect()
}

fn split_flat(
    shape: &[u64],
    start: u64,
    end: u64,
    prefix: &mut Vec<u64>,
    out: &mut Vec<TensorBox>,
) {
    if start >= end {
        return;
    }
    let push = |prefix: &[u64],
                offsets_rest: Vec<u64>,
                lengths_rest: Vec<u64>,
                out: &mut Vec<TensorBox>| {
        let mut offsets = prefix.to_vec();
        let mut lengths = vec![1; prefix.len()];
        offsets.extend(offsets_rest);
        lengths.extend(lengths_rest);
        out.push(TensorBox::new(offsets, lengths));
    };
    let Some((_, inner_shape)) = shape.split_first() else {
        push(prefix, Vec::new(), Vec::new(), out);
        return;
    };
    let inner: u64 = inner_shape.iter().product();
    if inner == 0 {
        // A tensor with a zero-length inner dimension has no elements: nothing to tile.
        return;
    }
    let (mut r0, r1) = (start / inner, end / inner);
    if r0 == r1 {
        prefix.push(r0);
        split_flat(
            inner_shape,
            start - r0 * inner,
            end - r0 * inner,
            prefix,
            out,
        );
        prefix.pop();
        return;
    }
    if !start.is_multiple_of(inner) {
        prefix.push(r0);
        split_flat(inner_shape, start % inner, inner, prefix, out);
        prefix.pop();
        r0 += 1;
    }
    if r1 > r0 {
        let mut offsets_rest = vec![r0];
        offsets_rest.extend(std::iter::repeat_n(0, inner_shape.len()));
        let mut lengths_rest = vec![r1 - r0];
        lengths_rest.extend_from_slice(inner_shape);
        push(prefix, offsets_rest, lengths_rest, out);
    }
    if !end.is_multiple_of(inner) {
        prefix.push(r1);
        split_flat(inner_shape, 0, end % inner, prefix, out);
        prefix.pop();
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use crate::row_major_strides;

    /// The flat indices (in a tensor of `shape`) of every element of `boxes`, box by box, each
    /// box in row-major order.
    fn expand(shape: &[u64], boxes: &[TensorBox]) -> Vec<u64> {
        let strides = row_major_strides(shape);
        let mut out = Vec::new();
        for b in boxes {
            let bs = row_major_strides(&b.lengths);
            for i in 0..b.numel() {
                out.push(
                    (0..b.ndim())
                        .map(|d| (b.offsets[d] + (i / bs[d]) % b.lengths[d]) * strides[d])
                        .sum(),
                );
            }
        }
        out
    }

    #[test]
    fn flat_ranges_split_into_boxes_in_flat_order() {
        let shape = [4, 3, 5];
        for start in 0..=60 {
            for end in start..=60 {
                let boxes = flat_range_to_boxes(&shape, start, end);
                assert!(boxes.len() <= 5, "{start}..{end}: {boxes:?}");
                assert_eq!(
                    expand(&shape, &boxes),
                    (start..end).collect::<Vec<_>>(),
                    "{start}..{end}"
                );
            }
        }
        assert_eq!(flat_range_to_boxes(&[], 0, 1), vec![TensorBox::whole(&[])]);
        assert!(flat_range_to_boxes(&[3, 0, 2], 0, 0).is_empty());
    }

    #[test]
    fn a_flat_range_of_a_box_is_contiguous_bytes_in_global_coordinates() {
        // Box rows 2..5, columns 4..8 of a [6, 10] tensor; elements 3..10 of its flattening.
        let parent = TensorBox::new(vec![2, 4], vec![3, 4]);
        let pieces = flat_range_of_box(&parent, 3, 10);
        assert_eq!(
            pieces,
            vec![
                (0, TensorBox::new(vec![2, 7], vec![1, 1])),
                (1, TensorBox::new(vec![3, 4], vec![1, 4])),
                (5, TensorBox::new(vec![4, 4], vec![1, 2])),
            ]
        );
        let chunks = flat_range_chunks(7, &parent, 3, 10, 2, 1000, 4);
        assert_eq!(chunks.len(), 3);
        assert_eq!(
            chunks
                .iter()
                .map(|c| (c.tensor, c.bytes.file, c.bytes.offset, c.bytes.length))
                .collect::<Vec<_>>(),
            vec![(7, 2, 1000, 4), (7, 2, 1004, 16), (7, 2, 1020, 8)]
        );
    }
}
