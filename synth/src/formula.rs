//! The per-element value formula (`hash32_v1`) and the tight loops that write runs of it.
//!
//! Everything here works on one contiguous run of global flat indices at a time; the box and
//! range walking lives in `fill.rs`.

use tessera_metadata::DType;

/// Golden-ratio multiplier that spreads the seed over the 32-bit index space.
const SEED_MULTIPLIER: u32 = 0x9E37_79B9;

/// Multiplier of the `i64` (and `u64`) formula: `x * 1000003 - 2^41`.
const INT64_MULTIPLIER: i64 = 1_000_003;

/// Offset of the `i64` (and `u64`) formula.
const INT64_OFFSET: i64 = 1 << 41;

/// The seed of a tensor: zlib/IEEE CRC-32 of its FQN's UTF-8 bytes (Python `zlib.crc32`).
pub fn element_seed(fqn: &str) -> u32 {
    crc32fast::hash(fqn.as_bytes())
}

/// The xorshift-multiply finaliser of `hash32_v1`.
#[inline(always)]
pub fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^= x >> 16;
    x
}

/// `x` of `hash32_v1` for element `index` of a tensor with `seed`:
/// `mix32((index + seed * 0x9E3779B9) mod 2^32)`.
pub fn hash32(seed: u32, index: u64) -> u32 {
    mix32(run_start(seed_base(seed), index))
}

/// `seed * 0x9E3779B9 mod 2^32`, the part of `x` that does not depend on the index.
#[inline]
pub(crate) fn seed_base(seed: u32) -> u32 {
    seed.wrapping_mul(SEED_MULTIPLIER)
}

/// The pre-mix `x` of element `index`: only `index mod 2^32` matters, by the formula's definition.
#[inline]
fn run_start(base: u32, index: u64) -> u32 {
    // Truncation is the formula: `(i + seed * C) mod 2^32`.
    base.wrapping_add(index as u32)
}

/// `m * 2^(e - scale_shift)` with `m = (x mod 2^mant_bits) - 2^(mant_bits-1)` and
/// `e = (x >> 24) & 7`. Exact in f32 for every `mant_bits <= 24`.
#[inline(always)]
fn scaled_value(x: u32, mant_bits: u32, scale_shift: i32) -> f32 {
    let half = 1i32 << (mant_bits - 1);
    let m = (x & ((1u32 << mant_bits) - 1)) as i32 - half;
    let e = ((x >> 24) & 7) as i32;
    // 2^(e - scale_shift) built from its exponent bits: branch-free and exact, so the loop
    // vectorises instead of indexing a table.
    let scale = f32::from_bits(((e - scale_shift + 127) as u32) << 23);
    m as f32 * scale
}

/// The f32 value of `hash32_v1` (mantissa 20 bits, scale shift 16).
#[inline(always)]
fn f32_value(x: u32) -> f32 {
    scaled_value(x, 20, 16)
}

/// The bf16 bits of `hash32_v1` (8/4). The value has at most 8 significant bits, so dropping the
/// low half of the f32 is exact (no rounding).
#[inline(always)]
fn bf16_bits(x: u32) -> u16 {
    (scaled_value(x, 8, 4).to_bits() >> 16) as u16
}

/// The f16 bits of `hash32_v1` (11/10). Every non-zero value lies in `[2^-10, 128]` with at most
/// 11 significant bits, i.e. is a normal f16, so re-biasing the f32 exponent (127 -> 15) and
/// dropping 13 mantissa bits is exact.
#[inline(always)]
fn f16_bits(x: u32) -> u16 {
    let bits = scaled_value(x, 11, 10).to_bits();
    let sign = (bits >> 16) & 0x8000;
    let magnitude = bits & 0x7FFF_FFFF;
    let half = if magnitude == 0 {
        0
    } else {
        (magnitude >> 13) - ((127 - 15) << 10)
    };
    (sign | half) as u16
}

/// The 64-bit integer value: `x * 1000003 - 2^41`. `x < 2^32`, so the product is below 2^52 and
/// nothing wraps; `u64` tensors store the same eight bytes.
#[inline(always)]
fn int64_value(x: u32) -> i64 {
    i64::from(x) * INT64_MULTIPLIER - INT64_OFFSET
}

/// Low byte of `x`, with the patterns each 8-bit float type reserves for NaN/inf replaced by a
/// finite neighbour, so every value survives a round trip through float arithmetic.
#[inline(always)]
fn f8_bits(x: u32, dtype: DType) -> u8 {
    let b = x as u8;
    match dtype {
        // S.1111.111 is NaN: clear the last mantissa bit (-> +/-448).
        DType::F8E4m3fn if b & 0x7F == 0x7F => b & !0x01,
        // Exponent 11111 is inf/NaN: clear the lowest exponent bit (-> exponent 11110).
        DType::F8E5m2 if b & 0x7C == 0x7C => b & !0x04,
        // The "negative zero" pattern is the only NaN: make it +0.
        DType::F8E4m3fnuz | DType::F8E5m2fnuz if b == 0x80 => 0,
        _ => b,
    }
}

/// Writes every element of `out` (chunks of `N` bytes) from consecutive `x` values.
#[inline(always)]
fn write_run<const N: usize>(out: &mut [u8], first_x: u32, value: impl Fn(u32) -> [u8; N]) {
    let mut x = first_x;
    for chunk in out.chunks_exact_mut(N) {
        chunk.copy_from_slice(&value(mix32(x)));
        x = x.wrapping_add(1);
    }
}

/// Fills `out` with the little-endian bytes of the consecutive elements starting at global flat
/// index `start` of a tensor whose [`seed_base`] is `base`. `out.len()` must be a multiple of the
/// dtype's size (the caller checks; a trailing partial element is left untouched).
pub(crate) fn fill_run(dtype: DType, base: u32, start: u64, out: &mut [u8]) {
    let x0 = run_start(base, start);
    match dtype {
        DType::Bool => write_run(out, x0, |x| [(x & 1) as u8]),
        DType::U8 | DType::I8 => write_run(out, x0, |x| [x as u8]),
        DType::U16 | DType::I16 => write_run(out, x0, |x| (x as u16).to_le_bytes()),
        DType::U32 | DType::I32 => write_run(out, x0, |x| x.to_le_bytes()),
        DType::U64 | DType::I64 => write_run(out, x0, |x| int64_value(x).to_le_bytes()),
        DType::F16 => write_run(out, x0, |x| f16_bits(x).to_le_bytes()),
        DType::Bf16 => write_run(out, x0, |x| bf16_bits(x).to_le_bytes()),
        DType::F32 => write_run(out, x0, |x| f32_value(x).to_le_bytes()),
        DType::F64 => write_run(out, x0, |x| f64::from(f32_value(x)).to_le_bytes()),
        DType::F8E4m3fn => write_run(out, x0, |x| [f8_bits(x, DType::F8E4m3fn)]),
        DType::F8E5m2 => write_run(out, x0, |x| [f8_bits(x, DType::F8E5m2)]),
        DType::F8E4m3fnuz => write_run(out, x0, |x| [f8_bits(x, DType::F8E4m3fnuz)]),
        DType::F8E5m2fnuz => write_run(out, x0, |x| [f8_bits(x, DType::F8E5m2fnuz)]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_is_zlib_crc32() {
        // zlib.crc32(b"model.tok_emb.weight") == 1728698188 (fixture expected.json).
        assert_eq!(element_seed("model.tok_emb.weight"), 1_728_698_188);
        assert_eq!(element_seed("train_step"), 710_023_364);
    }

    #[test]
    fn float_values_are_exact_and_in_range() {
        for x in [
            0u32,
            1,
            0x7F,
            0x80,
            0xFF,
            0x0700_0000,
            0xFFFF_FFFF,
            0x1234_5678,
        ] {
            let m16 = i64::from(x & 0x7FF) - 1024;
            let e = i32::try_from((x >> 24) & 7).unwrap_or(0);
            let expected = m16 as f64 * 2f64.powi(e - 10);
            let bits = f16_bits(x);
            // Decode the f16 by hand (normal or zero only).
            let exp = i32::from((bits >> 10) & 0x1F);
            let mant = f64::from(bits & 0x3FF);
            let mag = if exp == 0 {
                0.0
            } else {
                (1.0 + mant / 1024.0) * 2f64.powi(exp - 15)
            };
            let decoded = if bits & 0x8000 != 0 { -mag } else { mag };
            assert_eq!(decoded, expected, "x = {x:#x}");

            let m8 = i64::from(x & 0xFF) - 128;
            let bf = f32::from_bits(u32::from(bf16_bits(x)) << 16);
            assert_eq!(f64::from(bf), m8 as f64 * 2f64.powi(e - 4), "x = {x:#x}");
        }
    }

    #[test]
    fn f8_patterns_are_never_nan() {
        for x in 0u32..256 {
            assert_ne!(f8_bits(x, DType::F8E4m3fn) & 0x7F, 0x7F);
            assert_ne!(f8_bits(x, DType::F8E5m2) & 0x7C, 0x7C);
            assert_ne!(f8_bits(x, DType::F8E4m3fnuz), 0x80);
            assert_ne!(f8_bits(x, DType::F8E5m2fnuz), 0x80);
        }
    }
}
