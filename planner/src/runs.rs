//! Byte runs: an N-d strided copy between two byte spaces (a source file, a wire buffer, a
//! destination buffer), kept as a descriptor rather than a list. A 16384-row slice of a
//! column-sharded weight is one descriptor, not 16384 entries, which keeps whole-cluster plans
//! small; [`StridedRuns::iter`] expands it when the loader needs the runs.

use serde::{Deserialize, Serialize};

/// `count` runs of `run_bytes` contiguous bytes each. Run `i` (an odometer over `counts`, last
/// dim fastest) starts at `src_offset + Σ idx[d]·src_strides[d]` and lands at
/// `dst_offset + Σ idx[d]·dst_strides[d]`. Contiguous dimensions are merged into the run, so a
/// fully contiguous copy has empty `counts`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct StridedRuns {
    /// Bytes of one contiguous run.
    pub run_bytes: u64,
    /// Outer extents (after merging), outermost first.
    pub counts: Vec<u64>,
    /// Byte offset of the first run in the source.
    pub src_offset: u64,
    /// Source byte strides of the outer dims.
    pub src_strides: Vec<u64>,
    /// Byte offset of the first run in the destination.
    pub dst_offset: u64,
    /// Destination byte strides of the outer dims.
    pub dst_strides: Vec<u64>,
}

/// One side of a copy: where element `(0, …, 0)` of the box is, and the element strides.
#[derive(Clone, Copy, Debug)]
pub struct Side<'a> {
    /// Byte offset of the box's first element.
    pub origin: u64,
    /// Element strides of the side's layout.
    pub strides: &'a [u64],
}

impl StridedRuns {
    /// The runs that copy a box of `lengths` elements of `esize` bytes from `src` to `dst`.
    pub fn new(esize: u64, lengths: &[u64], src: Side<'_>, dst: Side<'_>) -> StridedRuns {
        if lengths.contains(&0) {
            return StridedRuns {
                run_bytes: 0,
                counts: vec![0],
                src_offset: src.origin,
                src_strides: vec![0],
                dst_offset: dst.origin,
                dst_strides: vec![0],
            };
        }
        // Dims of extent 1 move nothing; drop them first so they cannot block merging.
        let mut dims: Vec<(u64, u64, u64)> = lengths
            .iter()
            .zip(src.strides.iter().zip(dst.strides))
            .filter(|(len, _)| **len != 1)
            .map(|(len, (s, d))| (*len, *s, *d))
            .collect();
        let mut run_elems = 1u64;
        while let Some(&(len, s, d)) = dims.last() {
            if s == run_elems && d == run_elems {
                run_elems *= len;
                dims.pop();
            } else {
                break;
            }
        }
        // Merge outer dims that are contiguous over their inner neighbour on both sides.
        let mut merged: Vec<(u64, u64, u64)> = Vec::with_capacity(dims.len());
        for (len, s, d) in dims {
            match merged.last_mut() {
                Some(prev) if prev.1 == len * s && prev.2 == len * d => {
                    *prev = (prev.0 * len, s, d);
                }
                _ => merged.push((len, s, d)),
            }
        }
        StridedRuns {
            run_bytes: run_elems * esize,
            counts: merged.iter().map(|m| m.0).collect(),
            src_offset: src.origin,
            src_strides: merged.iter().map(|m| m.1 * esize).collect(),
            dst_offset: dst.origin,
            dst_strides: merged.iter().map(|m| m.2 * esize).collect(),
        }
    }

    /// Number of runs.
    pub fn num_runs(&self) -> u64 {
        self.counts.iter().product()
    }

    /// Bytes moved.
    pub fn total_bytes(&self) -> u64 {
        self.num_runs() * self.run_bytes
    }

    /// True when the source side is one contiguous range.
    pub fn src_is_contiguous(&self) -> bool {
        self.num_runs() <= 1
    }

    /// `[first byte, last byte + 1)` touched on the source side (empty range for no bytes).
    pub fn src_span(&self) -> (u64, u64) {
        span(
            self.src_offset,
            &self.counts,
            &self.src_strides,
            self.run_bytes,
        )
    }

    /// `[first byte, last byte + 1)` touched on the destination side.
    pub fn dst_span(&self) -> (u64, u64) {
        span(
            self.dst_offset,
            &self.counts,
            &self.dst_strides,
            self.run_bytes,
        )
    }

    /// The same copy in the other direction.
    pub fn reversed(&self) -> StridedRuns {
        StridedRuns {
            run_bytes: self.run_bytes,
            counts: self.counts.clone(),
            src_offset: self.dst_offset,
            src_strides: self.dst_strides.clone(),
            dst_offset: self.src_offset,
            dst_strides: self.src_strides.clone(),
        }
    }

    /// Every run as `(source offset, destination offset)`, in odometer order.
    pub fn iter(&self) -> RunIter<'_> {
        RunIter {
            runs: self,
            index: vec![0; self.counts.len()],
            done: self.run_bytes == 0 || self.counts.contains(&0),
        }
    }
}

fn span(origin: u64, counts: &[u64], strides: &[u64], run_bytes: u64) -> (u64, u64) {
    if run_bytes == 0 || counts.contains(&0) {
        return (origin, origin);
    }
    let last: u64 = counts.iter().zip(strides).map(|(c, s)| (c - 1) * s).sum();
    (origin, origin + last + run_bytes)
}

/// Iterator over the runs of a [`StridedRuns`].
#[derive(Debug)]
pub struct RunIter<'a> {
    runs: &'a StridedRuns,
    index: Vec<u64>,
    done: bool,
}

impl Iterator for RunIter<'_> {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        if self.done {
            return None;
        }
        let r = self.runs;
        let mut src = r.src_offset;
        let mut dst = r.dst_offset;
        for (d, i) in self.index.iter().enumerate() {
            src += i * r.src_strides[d];
            dst += i * r.dst_strides[d];
        }
        // Advance the odometer, last dim fastest.
        let mut d = self.index.len();
        loop {
            if d == 0 {
                self.done = true;
                break;
            }
            d -= 1;
            self.index[d] += 1;
            if self.index[d] < r.counts[d] {
                break;
            }
            self.index[d] = 0;
        }
        Some((src, dst))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use tessera_metadata::row_major_strides;

    #[test]
    fn contiguous_rows_merge_into_one_run() {
        // Rows 2..6 of a [10, 8] f32 box into a [4, 8] destination: one 128-byte run.
        let src_strides = row_major_strides(&[10, 8]);
        let dst_strides = row_major_strides(&[4, 8]);
        let runs = StridedRuns::new(
            4,
            &[4, 8],
            Side {
                origin: 2 * 8 * 4,
                strides: &src_strides,
            },
            Side {
                origin: 0,
                strides: &dst_strides,
            },
        );
        assert_eq!(runs.run_bytes, 128);
        assert!(runs.counts.is_empty());
        assert_eq!(runs.iter().collect::<Vec<_>>(), vec![(64, 0)]);
    }

    #[test]
    fn column_slices_become_one_run_per_row() {
        // Columns 4..8 of a [3, 8] bf16 source into a [3, 4] destination.
        let src_strides = row_major_strides(&[3, 8]);
        let dst_strides = row_major_strides(&[3, 4]);
        let runs = StridedRuns::new(
            2,
            &[3, 4],
            Side {
                origin: 8,
                strides: &src_strides,
            },
            Side {
                origin: 0,
                strides: &dst_strides,
            },
        );
        assert_eq!(runs.run_bytes, 8);
        assert_eq!(runs.counts, vec![3]);
        assert_eq!(
            runs.iter().collect::<Vec<_>>(),
            vec![(8, 0), (24, 8), (40, 16)]
        );
        assert_eq!(runs.src_span(), (8, 48));
        assert_eq!(runs.total_bytes(), 24);
    }

    #[test]
    fn transposed_source_reads_element_runs() {
        // A [2, 3] box stored transposed (strides (1, 2)) into row-major: six 4-byte runs.
        let runs = StridedRuns::new(
            4,
            &[2, 3],
            Side {
                origin: 0,
                strides: &[1, 2],
            },
            Side {
                origin: 0,
                strides: &[3, 1],
            },
        );
        assert_eq!(runs.run_bytes, 4);
        let srcs: Vec<u64> = runs.iter().map(|(s, _)| s).collect();
        assert_eq!(srcs, vec![0, 8, 16, 4, 12, 20]);
    }

    #[test]
    fn empty_and_scalar_boxes() {
        let empty = StridedRuns::new(
            4,
            &[0, 5],
            Side {
                origin: 0,
                strides: &[5, 1],
            },
            Side {
                origin: 0,
                strides: &[5, 1],
            },
        );
        assert_eq!(empty.total_bytes(), 0);
        assert_eq!(empty.iter().count(), 0);
        let scalar = StridedRuns::new(
            8,
            &[],
            Side {
                origin: 16,
                strides: &[],
            },
            Side {
                origin: 0,
                strides: &[],
            },
        );
        assert_eq!(scalar.iter().collect::<Vec<_>>(), vec![(16, 0)]);
        assert_eq!(scalar.total_bytes(), 8);
    }
}
