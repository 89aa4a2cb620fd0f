//! An index over the disjoint saved boxes of one tensor, so that "which saved boxes does this
//! requested box touch" costs O(log n + hits) instead of a scan of every saved box.
//!
//! Saved layouts are products or nestings of 1-d partitions (TP/DP/PP sharding, DCP chunks), so
//! the index is a recursive partition tree: at each node it picks the dimension along which the
//! boxes fall into the most pairwise-disjoint slabs, and recurses into each slab. Sets that cannot
//! be split that way (only irregular or overlapping input) end in a leaf that is scanned.

use std::borrow::Borrow;

use crate::TensorBox;

/// Leaves at most this large are scanned rather than split: a scan of a few boxes is cheaper than
/// another level of binary search.
const LEAF_SIZE: usize = 8;

/// A partition tree over boxes of one tensor. Empty boxes are not indexed: they hold no element.
/// `B` is the box or a reference to it, so callers can index boxes they keep elsewhere.
#[derive(Clone, Debug)]
pub struct BoxIndex<B = TensorBox> {
    boxes: Vec<B>,
    root: Node,
}

#[derive(Clone, Debug)]
enum Node {
    Leaf(Vec<u32>),
    Split {
        dim: usize,
        starts: Vec<u64>,
        ends: Vec<u64>,
        children: Vec<Node>,
    },
}

impl<B: Borrow<TensorBox>> BoxIndex<B> {
    /// Builds the index; ids returned by queries are positions in `boxes`.
    pub fn build(boxes: Vec<B>) -> Self {
        let ids: Vec<u32> = (0..boxes.len() as u32)
            .filter(|&i| !boxes[i as usize].borrow().is_empty())
            .collect();
        let root = build_node(&boxes, ids);
        Self { boxes, root }
    }

    /// The indexed boxes.
    pub fn boxes(&self) -> &[B] {
        &self.boxes
    }

    /// Appends to `out` the id of every box that shares an element with `query`, in ascending
    /// order of position along the split dimensions (deterministic for a given input).
    pub fn query(&self, query: &TensorBox, out: &mut Vec<u32>) {
        if query.is_empty() {
            return;
        }
        self.query_node(&self.root, query, out);
    }

    fn query_node(&self, node: &Node, query: &TensorBox, out: &mut Vec<u32>) {
        match node {
            Node::Leaf(ids) => {
                out.extend(
                    ids.iter()
                        .copied()
                        .filter(|&id| self.boxes[id as usize].borrow().overlaps(query)),
                );
            }
            Node::Split {
                dim,
                starts,
                ends,
                children,
            } => {
                let q_start = query.offsets[*dim];
                let q_end = query.end(*dim);
                let first = ends.partition_point(|&end| end <= q_start);
                for i in first..starts.len() {
                    if starts[i] >= q_end {
                        break;
                    }
                    self.query_node(&children[i], query, out);
                }
            }
        }
    }

    /// Finds two indexed boxes that share an element, if any. Boxes in different slabs of a split
    /// are disjoint by construction, so only leaves need a pairwise check.
    pub fn find_overlap(&self) -> Option<(u32, u32)> {
        let mut stack = vec![&self.root];
        while let Some(node) = stack.pop() {
            match node {
                Node::Leaf(ids) => {
                    for (i, &a) in ids.iter().enumerate() {
                        for &b in &ids[i + 1..] {
                            if self.boxes[a as usize]
                                .borrow()
                                .overlaps(self.boxes[b as usize].borrow())
                            {
                                return Some((a.min(b), a.max(b)));
                            }
                        }
                    }
                }
                Node::Split { children, .. } => stack.extend(children.iter()),
            }
        }
        None
    }
}

/// A slab of boxes sharing one interval `[start, end)` along a dimension.
type Slab = (u64, u64, Vec<u32>);

fn build_node<B: Borrow<TensorBox>>(boxes: &[B], ids: Vec<u32>) -> Node {
    if ids.len() <= LEAF_SIZE {
        return Node::Leaf(ids);
    }
    let ndim = boxes[ids[0] as usize].borrow().ndim();
    // (dim, slabs as (start, end, members)) of the dimension with the most disjoint slabs.
    let mut best: Option<(usize, Vec<Slab>)> = None;
    for dim in 0..ndim {
        let mut sorted = ids.clone();
        sorted.sort_by_key(|&id| {
            let b = boxes[id as usize].borrow();
            (b.offsets[dim], b.end(dim), id)
        });
        let mut slabs: Vec<Slab> = Vec::new();
        let mut disjoint = true;
        for id in sorted {
            let b = boxes[id as usize].borrow();
            let (start, end) = (b.offsets[dim], b.end(dim));
            match slabs.last_mut() {
                Some(last) if last.0 == start && last.1 == end => last.2.push(id),
                Some(last) if start < last.1 => {
                    disjoint = false;
                    break;
                }
                _ => slabs.push((start, end, vec![id])),
            }
        }
        if disjoint && slabs.len() > 1 && best.as_ref().is_none_or(|(_, b)| slabs.len() > b.len()) {
            best = Some((dim, slabs));
        }
    }
    let Some((dim, slabs)) = best else {
        return Node::Leaf(ids);
    };
    let mut starts = Vec::with_capacity(slabs.len());
    let mut ends = Vec::with_capacity(slabs.len());
    let mut children = Vec::with_capacity(slabs.len());
    for (start, end, members) in slabs {
        starts.push(start);
        ends.push(end);
        children.push(build_node(boxes, members));
    }
    Node::Split {
        dim,
        starts,
        ends,
        children,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn grid(rows: &[(u64, u64)], cols: &[(u64, u64)]) -> Vec<TensorBox> {
        let mut out = Vec::new();
        for &(r0, r1) in rows {
            for &(c0, c1) in cols {
                out.push(TensorBox::new(vec![r0, c0], vec![r1 - r0, c1 - c0]));
            }
        }
        out
    }

    fn all_pairs(boxes: &[TensorBox], q: &TensorBox) -> Vec<u32> {
        let mut v: Vec<u32> = (0..boxes.len() as u32)
            .filter(|&i| boxes[i as usize].overlaps(q))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn grid_queries_match_a_scan() {
        let rows: Vec<(u64, u64)> = (0..20).map(|i| (i * 5, i * 5 + 5)).collect();
        let cols: Vec<(u64, u64)> = (0..4).map(|i| (i * 16, i * 16 + 16)).collect();
        let boxes = grid(&rows, &cols);
        let index = BoxIndex::build(boxes.clone());
        for q in [
            TensorBox::new(vec![3, 10], vec![9, 30]),
            TensorBox::new(vec![0, 0], vec![100, 64]),
            TensorBox::new(vec![99, 63], vec![1, 1]),
            TensorBox::new(vec![50, 0], vec![0, 64]),
        ] {
            let mut got = Vec::new();
            index.query(&q, &mut got);
            got.sort();
            assert_eq!(got, all_pairs(&boxes, &q), "query {q}");
        }
        assert_eq!(index.find_overlap(), None);
    }

    #[test]
    fn overlap_is_found_across_and_inside_leaves() {
        let mut boxes = grid(
            &(0..12).map(|i| (i * 2, i * 2 + 2)).collect::<Vec<_>>(),
            &[(0, 4)],
        );
        boxes.push(TensorBox::new(vec![5, 1], vec![2, 2]));
        let index = BoxIndex::build(boxes);
        let (a, b) = index.find_overlap().expect("overlap");
        assert_eq!((a, b), (2, 12));
    }
}
