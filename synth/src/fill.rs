//! Generating and checking the formula's bytes for a box or a flat range of a tensor.
//!
//! A box is walked as a sequence of contiguous runs of global flat indices: one run per row, or
//! longer when the box spans whole trailing dimensions (then consecutive rows are adjacent in the
//! tensor too). Each run is one tight loop in `formula.rs`.

use crate::error::{SynthError, ValueMismatch};
use crate::formula::{element_seed, fill_run, seed_base};
use tessera_metadata::{TensorBox, TensorMeta, row_major_strides, shape_to_string};

/// Elements generated per step while checking, so the expected bytes stay in cache and the
/// scratch buffer stays small however large the box is.
const CHECK_CHUNK_ELEMS: u64 = 16 * 1024;

/// Writes the formula's values of `region` of `tensor` into `out`: row-major over the box,
/// little-endian, `out.len() == region.numel() * dtype.size()`.
pub fn fill_box(tensor: &TensorMeta, region: &TensorBox, out: &mut [u8]) -> Result<(), SynthError> {
    let runs = Runs::new(tensor, region)?;
    check_buffer_len(tensor, &region.to_string(), runs.numel(), out.len())?;
    let base = seed_base(element_seed(&tensor.fqn));
    let size = elem_size(tensor);
    let mut pos = 0usize;
    for (start, len) in runs {
        let bytes = to_usize(len) * size;
        fill_run(tensor.dtype, base, start, &mut out[pos..pos + bytes]);
        pos += bytes;
    }
    Ok(())
}

/// Writes the formula's values of the global row-major flat range `start..end` of `tensor` into
/// `out` (`out.len() == (end - start) * dtype.size()`).
pub fn fill_flat(
    tensor: &TensorMeta,
    start: u64,
    end: u64,
    out: &mut [u8],
) -> Result<(), SynthError> {
    check_flat_range(tensor, start, end)?;
    check_buffer_len(tensor, &flat_what(start, end), end - start, out.len())?;
    fill_run(
        tensor.dtype,
        seed_base(element_seed(&tensor.fqn)),
        start,
        out,
    );
    Ok(())
}

/// The formula's bytes of `region` of `tensor`, freshly allocated.
pub fn box_bytes(tensor: &TensorMeta, region: &TensorBox) -> Result<Vec<u8>, SynthError> {
    let numel = Runs::new(tensor, region)?.numel();
    let mut out = vec![0u8; byte_len(tensor, numel)?];
    fill_box(tensor, region, &mut out)?;
    Ok(out)
}

/// The formula's bytes of the flat range `start..end` of `tensor`, freshly allocated.
pub fn flat_bytes(tensor: &TensorMeta, start: u64, end: u64) -> Result<Vec<u8>, SynthError> {
    check_flat_range(tensor, start, end)?;
    let mut out = vec![0u8; byte_len(tensor, end - start)?];
    fill_flat(tensor, start, end, &mut out)?;
    Ok(out)
}

/// Checks that `bytes` holds exactly the formula's values of `region` of `tensor` (row-major over
/// the box, little-endian). The first differing element comes back as
/// [`SynthError::Mismatch`] with its global index and coordinates.
pub fn check_box(tensor: &TensorMeta, region: &TensorBox, bytes: &[u8]) -> Result<(), SynthError> {
    let runs = Runs::new(tensor, region)?;
    check_buffer_len(tensor, &region.to_string(), runs.numel(), bytes.len())?;
    let mut checker = Checker::new(tensor);
    let mut pos = 0usize;
    for (start, len) in runs {
        let run_bytes = to_usize(len) * checker.size;
        checker.check_run(start, &bytes[pos..pos + run_bytes], pos)?;
        pos += run_bytes;
    }
    Ok(())
}

/// Checks that `bytes` holds exactly the formula's values of the flat range `start..end` of
/// `tensor`; see [`check_box`].
pub fn check_flat(
    tensor: &TensorMeta,
    start: u64,
    end: u64,
    bytes: &[u8],
) -> Result<(), SynthError> {
    check_flat_range(tensor, start, end)?;
    check_buffer_len(tensor, &flat_what(start, end), end - start, bytes.len())?;
    Checker::new(tensor).check_run(start, bytes, 0)
}

/// Compares runs against the formula, a bounded chunk at a time.
struct Checker<'a> {
    tensor: &'a TensorMeta,
    base: u32,
    size: usize,
    scratch: Vec<u8>,
}

impl<'a> Checker<'a> {
    fn new(tensor: &'a TensorMeta) -> Self {
        let size = elem_size(tensor);
        Self {
            tensor,
            base: seed_base(element_seed(&tensor.fqn)),
            size,
            scratch: vec![0u8; to_usize(CHECK_CHUNK_ELEMS) * size],
        }
    }

    /// `found` holds the elements from global flat index `start` on; it sits at byte
    /// `buffer_offset` of the caller's buffer.
    fn check_run(
        &mut self,
        start: u64,
        found: &[u8],
        buffer_offset: usize,
    ) -> Result<(), SynthError> {
        let chunk_bytes = self.scratch.len();
        for (k, piece) in found.chunks(chunk_bytes).enumerate() {
            let first = start + (k * to_usize(CHECK_CHUNK_ELEMS)) as u64;
            let expected = &mut self.scratch[..piece.len()];
            fill_run(self.tensor.dtype, self.base, first, expected);
            if expected != piece {
                let byte = expected
                    .iter()
                    .zip(piece)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                let elem = byte / self.size;
                let at = elem * self.size;
                let index = first + elem as u64;
                return Err(SynthError::Mismatch(Box::new(ValueMismatch {
                    fqn: self.tensor.fqn.clone(),
                    dtype: self.tensor.dtype,
                    index,
                    coords: unravel(index, &self.tensor.shape),
                    byte_offset: buffer_offset + k * chunk_bytes + at,
                    expected: expected[at..at + self.size].to_vec(),
                    found: piece[at..at + self.size].to_vec(),
                })));
            }
        }
        Ok(())
    }
}

/// The contiguous runs of a box, as (global flat start index, elements), in row-major box order.
struct Runs {
    /// Global strides of the outer (iterated) dimensions.
    strides: Vec<u64>,
    /// Box offsets of the outer dimensions.
    offsets: Vec<u64>,
    /// Box lengths of the outer dimensions.
    lengths: Vec<u64>,
    /// Odometer over the outer dimensions.
    counter: Vec<u64>,
    /// Flat index contributed by the run's own (inner) dimensions.
    inner_start: u64,
    /// Elements per run.
    run_len: u64,
    /// Runs still to yield.
    remaining: u64,
}

impl Runs {
    /// Validates `region` against `tensor` and prepares the walk.
    fn new(tensor: &TensorMeta, region: &TensorBox) -> Result<Self, SynthError> {
        let shape = &tensor.shape;
        let ndim = shape.len();
        if region.offsets.len() != ndim || region.lengths.len() != ndim {
            return Err(SynthError::RegionRank {
                fqn: tensor.fqn.clone(),
                region: describe(region),
                ndim,
            });
        }
        let inside = (0..ndim).all(|d| {
            region.offsets[d]
                .checked_add(region.lengths[d])
                .is_some_and(|end| end <= shape[d])
        });
        if !inside {
            return Err(SynthError::RegionOutsideShape {
                fqn: tensor.fqn.clone(),
                region: describe(region),
                shape: shape_to_string(shape),
            });
        }
        let global = row_major_strides(shape);
        // The run starts at dim `k`: every dim after it is covered whole, so the run is
        // contiguous in the tensor.
        let mut k = ndim.saturating_sub(1);
        while k > 0 && region.offsets[k] == 0 && region.lengths[k] == shape[k] {
            k -= 1;
        }
        let (run_len, inner_start) = if ndim == 0 {
            (1, 0)
        } else {
            (
                saturating_product(&region.lengths[k..]),
                region.offsets[k] * global[k],
            )
        };
        let outer = k;
        let remaining = if region.is_empty() {
            0
        } else {
            saturating_product(&region.lengths[..outer])
        };
        Ok(Self {
            strides: global[..outer].to_vec(),
            offsets: region.offsets[..outer].to_vec(),
            lengths: region.lengths[..outer].to_vec(),
            counter: vec![0; outer],
            inner_start,
            run_len,
            remaining,
        })
    }

    /// Elements of the whole box (saturated: an absurd box then fails the buffer-length check
    /// instead of overflowing).
    fn numel(&self) -> u64 {
        self.remaining.saturating_mul(self.run_len)
    }
}

impl Iterator for Runs {
    type Item = (u64, u64);

    fn next(&mut self) -> Option<(u64, u64)> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let start = self.inner_start
            + (0..self.counter.len())
                .map(|d| (self.offsets[d] + self.counter[d]) * self.strides[d])
                .sum::<u64>();
        for d in (0..self.counter.len()).rev() {
            self.counter[d] += 1;
            if self.counter[d] < self.lengths[d] {
                break;
            }
            self.counter[d] = 0;
        }
        Some((start, self.run_len))
    }
}

fn saturating_product(lengths: &[u64]) -> u64 {
    lengths.iter().fold(1, |acc, &n| acc.saturating_mul(n))
}

/// A box as `[0..25, 0..64]` when that can be written, else its raw offsets and lengths (a
/// malformed box may have mismatched ranks or an end past `u64::MAX`).
fn describe(region: &TensorBox) -> String {
    let well_formed = region.offsets.len() == region.lengths.len()
        && region
            .offsets
            .iter()
            .zip(&region.lengths)
            .all(|(o, l)| o.checked_add(*l).is_some());
    if well_formed {
        region.to_string()
    } else {
        format!(
            "(offsets {:?}, lengths {:?})",
            region.offsets, region.lengths
        )
    }
}

/// Global coordinates of flat index `index` in a tensor of `shape`.
fn unravel(mut index: u64, shape: &[u64]) -> Vec<u64> {
    let mut coords = vec![0; shape.len()];
    for d in (0..shape.len()).rev() {
        if shape[d] > 0 {
            coords[d] = index % shape[d];
            index /= shape[d];
        }
    }
    coords
}

fn check_flat_range(tensor: &TensorMeta, start: u64, end: u64) -> Result<(), SynthError> {
    let numel = tensor.numel();
    if start > end || end > numel {
        return Err(SynthError::FlatRange {
            fqn: tensor.fqn.clone(),
            start,
            end,
            numel,
        });
    }
    Ok(())
}

fn check_buffer_len(
    tensor: &TensorMeta,
    what: &str,
    numel: u64,
    actual: usize,
) -> Result<(), SynthError> {
    let expected = numel.checked_mul(tensor.dtype.size());
    if expected != Some(actual as u64) {
        return Err(SynthError::BufferLength {
            fqn: tensor.fqn.clone(),
            what: what.to_string(),
            expected: expected.unwrap_or(u64::MAX),
            actual,
        });
    }
    Ok(())
}

/// Bytes of `numel` elements as a `usize`, or the buffer-length error when that does not fit.
fn byte_len(tensor: &TensorMeta, numel: u64) -> Result<usize, SynthError> {
    numel
        .checked_mul(tensor.dtype.size())
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| SynthError::BufferLength {
            fqn: tensor.fqn.clone(),
            what: format!("{numel} elements"),
            expected: numel.saturating_mul(tensor.dtype.size()),
            actual: usize::MAX,
        })
}

fn flat_what(start: u64, end: u64) -> String {
    format!("flat range {start}..{end}")
}

fn elem_size(tensor: &TensorMeta) -> usize {
    to_usize(tensor.dtype.size())
}

/// Lossless here: every count converted was checked against a buffer length (a `usize`) first.
fn to_usize(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_metadata::DType;

    fn runs(shape: &[u64], offsets: &[u64], lengths: &[u64]) -> Vec<(u64, u64)> {
        let t = TensorMeta::new("t", DType::F32, shape.to_vec());
        let b = TensorBox::new(offsets.to_vec(), lengths.to_vec());
        Runs::new(&t, &b).map(Iterator::collect).unwrap_or_default()
    }

    #[test]
    fn runs_merge_whole_trailing_dims() {
        assert_eq!(runs(&[4, 5], &[1, 0], &[2, 5]), vec![(5, 10)]);
        assert_eq!(runs(&[4, 5], &[1, 1], &[2, 3]), vec![(6, 3), (11, 3)]);
        assert_eq!(
            runs(&[2, 3, 4], &[0, 1, 0], &[2, 2, 4]),
            vec![(4, 8), (16, 8)]
        );
        assert_eq!(runs(&[], &[], &[]), vec![(0, 1)]);
        assert_eq!(runs(&[7], &[2], &[3]), vec![(2, 3)]);
        assert_eq!(runs(&[3, 5], &[3, 0], &[0, 5]), Vec::new());
        assert_eq!(runs(&[3, 5], &[0, 2], &[3, 0]), Vec::new());
    }

    #[test]
    fn unravel_is_row_major() {
        assert_eq!(unravel(23, &[2, 3, 4]), vec![1, 2, 3]);
        assert_eq!(unravel(0, &[]), Vec::<u64>::new());
    }
}
