//! Tensors and boxes: the (FQN, offsets, lengths) vocabulary every other part speaks.

use std::fmt;

use serde::{Deserialize, Serialize};
use smallvec::SmallVec;

use crate::DType;

/// A tensor of the checkpoint: fully-qualified name, element type and global shape.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Fully-qualified name, e.g. `model.layers.3.attn.qkv.weight`.
    pub fqn: String,
    /// Element type.
    pub dtype: DType,
    /// Global shape; empty for a 0-dim (scalar) tensor.
    pub shape: Vec<u64>,
}

impl TensorMeta {
    /// Creates a tensor description.
    pub fn new(fqn: impl Into<String>, dtype: DType, shape: Vec<u64>) -> Self {
        Self {
            fqn: fqn.into(),
            dtype,
            shape,
        }
    }

    /// Number of elements of the whole tensor (1 for a 0-dim tensor).
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// Bytes of the whole tensor.
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.size()
    }

    /// The box that covers the whole tensor.
    pub fn full_box(&self) -> TensorBox {
        TensorBox::whole(&self.shape)
    }
}

/// Per-dimension numbers of a box. Four dimensions are stored inline (no heap allocation), which
/// covers every tensor of an LLM checkpoint; plans hold millions of boxes, so this matters.
pub type Dims = SmallVec<[u64; 4]>;

/// An N-d box of a tensor in global coordinates. A length may be 0 (an empty box, which holds no
/// element but still says where it sits, as DCP and DTensor do for trailing ranks).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TensorBox {
    /// Start of the box in every dimension.
    pub offsets: Dims,
    /// Extent of the box in every dimension.
    pub lengths: Dims,
}

impl TensorBox {
    /// Creates a box; `offsets` and `lengths` must have the same length.
    pub fn new(offsets: impl Into<Dims>, lengths: impl Into<Dims>) -> Self {
        let (offsets, lengths) = (offsets.into(), lengths.into());
        debug_assert_eq!(offsets.len(), lengths.len());
        Self { offsets, lengths }
    }

    /// The box covering a whole tensor of `shape`.
    pub fn whole(shape: &[u64]) -> Self {
        Self {
            offsets: smallvec::smallvec![0; shape.len()],
            lengths: Dims::from_slice(shape),
        }
    }

    /// Number of dimensions.
    pub fn ndim(&self) -> usize {
        self.lengths.len()
    }

    /// Number of elements (1 for a 0-dim box, 0 when any length is 0).
    pub fn numel(&self) -> u64 {
        self.lengths.iter().product()
    }

    /// True when the box holds no element.
    pub fn is_empty(&self) -> bool {
        self.lengths.contains(&0)
    }

    /// Exclusive end in dimension `dim`.
    pub fn end(&self, dim: usize) -> u64 {
        self.offsets[dim] + self.lengths[dim]
    }

    /// The common part of two boxes of the same tensor, or `None` when they share no element.
    pub fn intersect(&self, other: &TensorBox) -> Option<TensorBox> {
        debug_assert_eq!(self.ndim(), other.ndim());
        let mut offsets = Dims::new();
        let mut lengths = Dims::new();
        for d in 0..self.ndim() {
            let start = self.offsets[d].max(other.offsets[d]);
            let end = self.end(d).min(other.end(d));
            if end <= start {
                return None;
            }
            offsets.push(start);
            lengths.push(end - start);
        }
        Some(TensorBox { offsets, lengths })
    }

    /// True when the two boxes share at least one element.
    pub fn overlaps(&self, other: &TensorBox) -> bool {
        (0..self.ndim())
            .all(|d| self.offsets[d].max(other.offsets[d]) < self.end(d).min(other.end(d)))
    }

    /// True when `inner` lies entirely inside this box (an empty `inner` is inside when its
    /// offsets are within bounds).
    pub fn contains(&self, inner: &TensorBox) -> bool {
        (0..self.ndim()).all(|d| inner.offsets[d] >= self.offsets[d] && inner.end(d) <= self.end(d))
    }

    /// `inner`'s offsets relative to this box's origin.
    pub fn relative_offsets(&self, inner: &TensorBox) -> Dims {
        inner
            .offsets
            .iter()
            .zip(&self.offsets)
            .map(|(i, o)| i - o)
            .collect()
    }
}

impl fmt::Display for TensorBox {
    /// `[0..25, 0..64]`: half-open ranges per dimension; `[]` for a 0-dim box.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for d in 0..self.ndim() {
            if d > 0 {
                f.write_str(", ")?;
            }
            // Wide: this prints boxes that error messages reject for reaching past u64::MAX,
            // and must show their true end rather than a wrapped one (or panic).
            let end = u128::from(self.offsets[d]) + u128::from(self.lengths[d]);
            write!(f, "{}..{end}", self.offsets[d])?;
        }
        f.write_str("]")
    }
}

/// Row-major (C-order) element strides of a box with `lengths`.
pub fn row_major_strides(lengths: &[u64]) -> Vec<u64> {
    let mut strides = vec![1; lengths.len()];
    for d in (0..lengths.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * lengths[d + 1];
    }
    strides
}

/// Displays a shape as `[98, 64]`.
pub fn shape_to_string(shape: &[u64]) -> String {
    let parts: Vec<String> = shape.iter().map(u64::to_string).collect();
    format!("[{}]", parts.join(", "))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn intersection_of_overlapping_and_disjoint_boxes() {
        let a = TensorBox::new(vec![0, 0], vec![25, 64]);
        let b = TensorBox::new(vec![20, 32], vec![10, 64]);
        assert_eq!(
            a.intersect(&b),
            Some(TensorBox::new(vec![20, 32], vec![5, 32]))
        );
        let c = TensorBox::new(vec![25, 0], vec![25, 64]);
        assert_eq!(a.intersect(&c), None);
        assert!(!a.overlaps(&c));
        assert_eq!(a.to_string(), "[0..25, 0..64]");
    }

    #[test]
    fn zero_dim_boxes_intersect_and_hold_one_element() {
        let s = TensorBox::whole(&[]);
        assert_eq!(s.numel(), 1);
        assert_eq!(s.intersect(&s), Some(s.clone()));
        assert_eq!(s.to_string(), "[]");
    }

    #[test]
    fn display_of_a_box_past_u64_max_shows_its_true_end() {
        let b = TensorBox::new(vec![u64::MAX, 3], vec![2, u64::MAX]);
        assert_eq!(
            b.to_string(),
            "[18446744073709551615..18446744073709551617, 3..18446744073709551618]"
        );
    }

    #[test]
    fn row_major_strides_are_c_order() {
        assert_eq!(row_major_strides(&[2, 3, 4]), vec![12, 4, 1]);
        assert_eq!(row_major_strides(&[]), Vec::<u64>::new());
    }
}
