//! The crc of a message from parts read by different ranks, in any order, for both checksums
//! saved boxes record ([`Crc`]): crc32c (tessera's native format) and CRC-32 (a DCP blob's zip
//! entry). They differ only in the polynomial.
//!
//! Without its initial and final inversion, such a crc is linear over GF(2): `raw(A ^ B) = raw(A) ^
//! raw(B)` for messages of equal length, and a zero byte in front changes nothing. So the raw crc
//! of a box of `L` bytes is the XOR, over any partition of it into segments, of each segment's
//! raw crc shifted past the bytes after it (`shift(raw(seg), L - seg_end)`: multiplying by
//! `x^(8 (L - seg_end))` modulo the polynomial, zlib's `crc32_combine` operator). Each rank folds
//! the segments it read into one such value ([`Fold`]); the XOR of the ranks' folds, corrected by
//! the inversions ([`crc_of_folds`]), is the box's crc.

use tessera_metadata::BoxChecksum;

/// A 32-bit crc algorithm a saved box's checksum uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crc {
    /// crc32c (Castagnoli).
    Crc32c,
    /// CRC-32 (IEEE 802.3, zlib's and zip's).
    Crc32,
}

impl Crc {
    /// The algorithm of a recorded checksum.
    pub fn of(checksum: BoxChecksum) -> Crc {
        match checksum {
            BoxChecksum::Crc32c(_) => Crc::Crc32c,
            BoxChecksum::Crc32(_) => Crc::Crc32,
        }
    }

    /// The polynomial, bit-reflected.
    fn poly(self) -> u32 {
        match self {
            Crc::Crc32c => 0x82F6_3B78,
            Crc::Crc32 => 0xEDB8_8320,
        }
    }

    /// The crc of `data` continued from the crc `crc` of the bytes before it.
    pub fn append(self, crc: u32, data: &[u8]) -> u32 {
        match self {
            Crc::Crc32c => crc32c::crc32c_append(crc, data),
            Crc::Crc32 => {
                let mut hasher = crc32fast::Hasher::new_with_initial(crc);
                hasher.update(data);
                hasher.finalize()
            }
        }
    }

    /// The crc of `data`.
    pub fn checksum(self, data: &[u8]) -> u32 {
        self.append(0, data)
    }

    /// The crc of `A ‖ B` from `crc(A)`, `crc(B)` and `B`'s length (zlib's `crc32_combine`).
    pub fn combine(self, a: u32, b: u32, len_b: u64) -> u32 {
        Shifter::new(self).shift(a, len_b) ^ b
    }

    /// The raw crc (no inversions) of `data`.
    pub fn raw(self, data: &[u8]) -> u32 {
        // `append(c, ..)` starts from the register `!c` and returns the register inverted.
        !self.append(u32::MAX, data)
    }
}

/// `a * b` modulo `poly` (all reflected; zlib's `multmodp`).
fn mult_mod_p(poly: u32, a: u32, mut b: u32) -> u32 {
    let mut m = 1u32 << 31;
    let mut product = 0u32;
    while m != 0 {
        if a & m != 0 {
            product ^= b;
            if a & (m - 1) == 0 {
                break;
            }
        }
        m >>= 1;
        b = if b & 1 != 0 { (b >> 1) ^ poly } else { b >> 1 };
    }
    product
}

/// `x^(2^k)` modulo the polynomial for k = 0..32 (zlib's `x2n_table`), one table per algorithm.
fn x2n_table(crc: Crc) -> &'static [u32; 32] {
    static CRC32C: std::sync::OnceLock<[u32; 32]> = std::sync::OnceLock::new();
    static CRC32: std::sync::OnceLock<[u32; 32]> = std::sync::OnceLock::new();
    let cell = match crc {
        Crc::Crc32c => &CRC32C,
        Crc::Crc32 => &CRC32,
    };
    cell.get_or_init(|| {
        let poly = crc.poly();
        let mut table = [0u32; 32];
        let mut p = 1u32 << 30; // x^1
        table[0] = p;
        for entry in table.iter_mut().skip(1) {
            p = mult_mod_p(poly, p, p);
            *entry = p;
        }
        table
    })
}

/// `x^(8 bytes)` modulo the polynomial: the operator that moves a raw crc past `bytes` zero
/// bytes.
fn shift_operator(crc: Crc, mut bytes: u64) -> u32 {
    let (table, poly) = (x2n_table(crc), crc.poly());
    let mut p = 1u32 << 31; // x^0
    let mut k = 3usize; // 8 = 2^3 bits per byte
    while bytes != 0 {
        if bytes & 1 != 0 {
            p = mult_mod_p(poly, table[k & 31], p);
        }
        bytes >>= 1;
        k += 1;
    }
    p
}

/// Moves raw crcs past runs of zero bytes, remembering the last operator (a rank's segments of
/// a column slice are one row apart, so the same distance comes again and again).
#[derive(Debug)]
pub struct Shifter {
    crc: Crc,
    last: Option<(u64, u32)>,
}

impl Shifter {
    /// A shifter for `crc`'s polynomial.
    pub fn new(crc: Crc) -> Shifter {
        Shifter { crc, last: None }
    }

    /// `raw` moved past `bytes` zero bytes.
    pub fn shift(&mut self, raw: u32, bytes: u64) -> u32 {
        if raw == 0 || bytes == 0 {
            return raw;
        }
        let op = match self.last {
            Some((b, op)) if b == bytes => op,
            _ => {
                let op = shift_operator(self.crc, bytes);
                self.last = Some((bytes, op));
                op
            }
        };
        mult_mod_p(self.crc.poly(), op, raw)
    }
}

/// One rank's fold of the segments it read of a box `len` bytes long (offsets relative to the
/// box): the raw crc of the box with every other byte zero. Segments are added in ascending
/// runs ([`Fold::run`]); runs may come in any order.
#[derive(Debug)]
pub struct Fold {
    len: u64,
    value: u32,
    bytes: u64,
    shifter: Shifter,
}

/// An ascending run of segments being folded (see [`Fold::run`]).
#[derive(Debug)]
pub struct Run<'a> {
    fold: &'a mut Fold,
    acc: u32,
    end: Option<u64>,
}

impl Fold {
    /// An empty fold of a box of `len` bytes checked by `crc`.
    pub fn new(crc: Crc, len: u64) -> Fold {
        Fold {
            len,
            value: 0,
            bytes: 0,
            shifter: Shifter::new(crc),
        }
    }

    /// Starts a run of segments at ascending offsets (one part's bytes of the box, say).
    pub fn run(&mut self) -> Run<'_> {
        Run {
            fold: self,
            acc: 0,
            end: None,
        }
    }

    /// The fold so far.
    pub fn value(&self) -> u32 {
        self.value
    }

    /// Bytes folded so far.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Adds `other`'s segments, folded apart (on another thread) from disjoint bytes of the
    /// same box: folds of disjoint segments combine by XOR.
    pub fn absorb(&mut self, value: u32, bytes: u64) {
        self.value ^= value;
        self.bytes += bytes;
    }
}

impl Run<'_> {
    /// Adds the segment `data` at box offset `at`, after (not overlapping) the run's previous
    /// segments. Panics in debug builds when it does not come after them.
    pub fn add(&mut self, at: u64, data: &[u8]) {
        let end = at + data.len() as u64;
        debug_assert!(end <= self.fold.len);
        debug_assert!(self.end.is_none_or(|e| e <= at));
        let gap = end - self.end.unwrap_or(end);
        self.acc = self.fold.shifter.shift(self.acc, gap) ^ self.fold.shifter.crc.raw(data);
        self.end = Some(end);
        self.fold.bytes += data.len() as u64;
    }
}

impl Drop for Run<'_> {
    fn drop(&mut self) {
        if let Some(end) = self.end {
            let tail = self.fold.len - end;
            self.fold.value ^= self.fold.shifter.shift(self.acc, tail);
        }
    }
}

/// The `crc` of a box of `len` bytes from the XOR of its readers' folds.
pub fn crc_of_folds(crc: Crc, len: u64, folds_xor: u32) -> u32 {
    // The standard crc starts its register at all ones: that initial value, shifted past the
    // whole box, is what the zero-initialised raw folds leave out.
    !(Shifter::new(crc).shift(u32::MAX, len) ^ folds_xor)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn bytes(n: usize, seed: u64) -> Vec<u8> {
        let mut z = seed;
        (0..n)
            .map(|_| {
                z = z.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                (z >> 33) as u8
            })
            .collect()
    }

    /// The standard implementations of each algorithm (crates `crc32c`, `crc32fast`).
    fn reference(crc: Crc, data: &[u8]) -> u32 {
        match crc {
            Crc::Crc32c => crc32c::crc32c(data),
            Crc::Crc32 => crc32fast::hash(data),
        }
    }

    #[test]
    fn shifting_is_the_combine_operator() {
        for crc in [Crc::Crc32c, Crc::Crc32] {
            let (a, b) = (bytes(1000, 1), bytes(777, 2));
            let whole: Vec<u8> = a.iter().chain(&b).copied().collect();
            let combined = Shifter::new(crc).shift(crc.raw(&a), b.len() as u64) ^ crc.raw(&b);
            assert_eq!(combined, crc.raw(&whole));
            assert_eq!(
                crc_of_folds(crc, whole.len() as u64, crc.raw(&whole)),
                reference(crc, &whole)
            );
            assert_eq!(crc_of_folds(crc, 0, 0), reference(crc, &[]));
            assert_eq!(crc.checksum(&whole), reference(crc, &whole));
            assert_eq!(
                crc.combine(reference(crc, &a), reference(crc, &b), b.len() as u64),
                reference(crc, &whole)
            );
        }
    }

    /// Column slices of a row-major box split over 3 "ranks", each folding its segments in runs
    /// of a few rows, runs in reverse order: the XOR of the folds gives the box's crc32c. A
    /// flipped bit, or a segment left out, does not.
    #[test]
    fn folds_of_a_partition_give_the_crc_of_the_box_and_a_flipped_bit_does_not() {
        for crc in [Crc::Crc32c, Crc::Crc32] {
            partition_folds(crc);
        }
    }

    fn partition_folds(crc: Crc) {
        let (rows, row) = (37usize, 96usize);
        let data = bytes(rows * row, 7);
        let cuts = [0usize, 20, 52, 96];
        let fold_all = |data: &[u8], skip: Option<(usize, usize)>| {
            let mut xor = 0u32;
            let mut folded = 0u64;
            for c in cuts.windows(2) {
                let mut fold = Fold::new(crc, data.len() as u64);
                let starts: Vec<usize> = (0..rows).step_by(5).collect();
                for &first in starts.iter().rev() {
                    let mut run = fold.run();
                    for r in first..(first + 5).min(rows) {
                        if skip == Some((r, c[0])) {
                            continue;
                        }
                        let at = r * row + c[0];
                        run.add(at as u64, &data[at..r * row + c[1]]);
                    }
                }
                folded += fold.bytes();
                xor ^= fold.value();
            }
            (crc_of_folds(crc, data.len() as u64, xor), folded)
        };
        assert_eq!(
            fold_all(&data, None),
            (reference(crc, &data), data.len() as u64)
        );
        let mut flipped = data.clone();
        flipped[row * 11 + 30] ^= 0x10;
        assert_ne!(fold_all(&flipped, None).0, reference(crc, &data));
        let (partial, folded) = fold_all(&data, Some((3, 20)));
        assert_ne!(partial, reference(crc, &data));
        assert_eq!(folded, data.len() as u64 - 32);
    }
}
