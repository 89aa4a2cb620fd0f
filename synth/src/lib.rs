//! Synthetic checkpoints: model definitions (which tensors, which shapes) and one deterministic
//! value per element, so that any box of any tensor can be generated, or checked, on its own.
//!
//! # Models
//!
//! [`Model`] names a size (`gpt-tiny`, `gpt-small`, `llama3-8b`, `llama3-70b`, `llama3-405b`);
//! [`tensors`] lists its [`TensorMeta`](tessera_metadata::TensorMeta)s: bf16 parameters in model
//! (state-dict) order, then optionally f32 optimizer states `optim.state.<param>.{master, exp_avg,
//! exp_avg_sq}`, then `train.step` (i64, 0-dim).
//!
//! # Value formula (`hash32_v1`)
//!
//! The value of element `i` (global row-major flat index) of tensor `fqn` is, for f32, bf16, f16
//! and i64, **exactly the `hash32_v1` formula of the DCP test fixtures**
//! (`shared/fixtures/dcp/README.md`; the tests reproduce the fixtures' bytes):
//!
//! ```text
//! seed = crc32(fqn)                      # zlib / IEEE CRC-32 of the UTF-8 fqn (element_seed)
//! x    = (i + seed * 0x9E3779B9) mod 2^32
//! x   ^= x >> 16;  x = (x * 0x7FEB352D) mod 2^32
//! x   ^= x >> 15;  x = (x * 0x846CA68B) mod 2^32
//! x   ^= x >> 16                          # hash32(seed, i)
//! float: M = 2^mant_bits; m = (x mod M) - M/2; e = (x >> 24) & 7; value = m * 2^(e - scale_shift)
//!        f32: mant_bits 20, scale_shift 16;  bf16: 8/4;  f16: 11/10   (all exactly representable)
//! i64:   value = x * 1000003 - 2^41         (x < 2^32, so this never wraps)
//! ```
//!
//! The other dtypes are tessera's own extension (not in the fixtures), chosen so that every byte
//! of an element depends on `x` where the width allows and no value is NaN or infinite:
//!
//! | dtype | value |
//! |---|---|
//! | f64 | the f32 value, widened (exact) |
//! | u64 | the i64 value's eight bytes (two's complement) |
//! | i32, u32 | `x` |
//! | i16, u16 | `x mod 2^16` (bit pattern) |
//! | i8, u8 | `x mod 2^8` (bit pattern) |
//! | bool | `x & 1` |
//! | f8_e4m3fn | `x mod 2^8`; the NaN patterns `0x7f`/`0xff` become `0x7e`/`0xfe` |
//! | f8_e5m2 | `x mod 2^8`; inf/NaN patterns (exponent `11111`) get exponent `11110` (clear bit 2) |
//! | f8_e4m3fnuz, f8_e5m2fnuz | `x mod 2^8`; the NaN pattern `0x80` becomes `0x00` |
//!
//! Bytes are little-endian. A hash rather than `arange` keeps low-precision tensors from repeating
//! with a short period, which would let an off-by-N-rows bug go unnoticed.
//!
//! # Writing
//!
//! [`synthesize`] writes a model saved with a layout as a native checkpoint (or its metadata only,
//! for models too large to materialize). With [`SynthOptions::dist_optimizer`] the optimizer
//! states are saved as Megatron-Core's distributed optimizer saves them: flat ranges of each
//! TP-local box, split contiguously over the data-parallel ranks.
//!
//! # Generating and checking
//!
//! [`fill_box`] / [`fill_flat`] write a box (row-major over the box) or a flat range of a tensor,
//! [`check_box`] / [`check_flat`] compare a buffer against the formula and report the first
//! differing element ([`ValueMismatch`]: global index, coordinates, expected and found bytes).
//! A box is generated as contiguous runs of flat indices, each a tight loop of integer ops.

mod dist_optimizer;
mod error;
mod fill;
mod formula;
mod model;
mod write;

pub use error::{SynthError, ValueMismatch};
pub use fill::{box_bytes, check_box, check_flat, fill_box, fill_flat, flat_bytes};
pub use formula::{element_seed, hash32, mix32};
pub use model::{
    Model, ModelConfig, OPTIM_DTYPE, OPTIM_STATES, PARAM_DTYPE, TRAIN_STEP_FQN, tensors,
    total_bytes,
};
pub use write::{FileWritten, ProgressFn, SynthOptions, synthesize};
