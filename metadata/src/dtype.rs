//! Element types of saved tensors.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::MetadataError;

/// The element type of a tensor. Names follow safetensors/torch conventions in lower case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DType {
    /// 1-byte boolean.
    Bool,
    /// Unsigned 8-bit integer.
    U8,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer.
    U64,
    /// Signed 8-bit integer.
    I8,
    /// Signed 16-bit integer.
    I16,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single precision.
    F32,
    /// IEEE double precision.
    F64,
    /// 8-bit float, 4 exponent bits, 3 mantissa bits, finite (torch `float8_e4m3fn`).
    F8E4m3fn,
    /// 8-bit float, 5 exponent bits, 2 mantissa bits (torch `float8_e5m2`).
    F8E5m2,
    /// 8-bit float e4m3, finite, unsigned zero (torch `float8_e4m3fnuz`).
    F8E4m3fnuz,
    /// 8-bit float e5m2, finite, unsigned zero (torch `float8_e5m2fnuz`).
    F8E5m2fnuz,
}

impl DType {
    /// Every dtype, in a stable order (used by property tests and docs).
    pub const ALL: [DType; 17] = [
        DType::Bool,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::F16,
        DType::Bf16,
        DType::F32,
        DType::F64,
        DType::F8E4m3fn,
        DType::F8E5m2,
        DType::F8E4m3fnuz,
        DType::F8E5m2fnuz,
    ];

    /// Size of one element in bytes.
    pub fn size(self) -> u64 {
        match self {
            DType::Bool
            | DType::U8
            | DType::I8
            | DType::F8E4m3fn
            | DType::F8E5m2
            | DType::F8E4m3fnuz
            | DType::F8E5m2fnuz => 1,
            DType::U16 | DType::I16 | DType::F16 | DType::Bf16 => 2,
            DType::U32 | DType::I32 | DType::F32 => 4,
            DType::U64 | DType::I64 | DType::F64 => 8,
        }
    }

    /// The canonical name written into tessera's metadata and layout files.
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::U8 => "u8",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::I8 => "i8",
            DType::I16 => "i16",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::F8E4m3fn => "f8_e4m3fn",
            DType::F8E5m2 => "f8_e5m2",
            DType::F8E4m3fnuz => "f8_e4m3fnuz",
            DType::F8E5m2fnuz => "f8_e5m2fnuz",
        }
    }

    /// Parses a dtype name: tessera's own names, safetensors' (`F32`, `BF16`, `F8_E4M3`) and torch's
    /// (`float32`, `torch.bfloat16`, `int64`).
    pub fn parse(name: &str) -> Result<DType, MetadataError> {
        let lower = name
            .trim()
            .trim_start_matches("torch.")
            .to_ascii_lowercase();
        let dtype = match lower.as_str() {
            "bool" => DType::Bool,
            "u8" | "uint8" => DType::U8,
            "u16" | "uint16" => DType::U16,
            "u32" | "uint32" => DType::U32,
            "u64" | "uint64" => DType::U64,
            "i8" | "int8" => DType::I8,
            "i16" | "int16" | "short" => DType::I16,
            "i32" | "int32" | "int" => DType::I32,
            "i64" | "int64" | "long" => DType::I64,
            "f16" | "float16" | "half" => DType::F16,
            "bf16" | "bfloat16" => DType::Bf16,
            "f32" | "float32" | "float" => DType::F32,
            "f64" | "float64" | "double" => DType::F64,
            "f8_e4m3fn" | "f8_e4m3" | "float8_e4m3fn" => DType::F8E4m3fn,
            "f8_e5m2" | "float8_e5m2" => DType::F8E5m2,
            "f8_e4m3fnuz" | "float8_e4m3fnuz" => DType::F8E4m3fnuz,
            "f8_e5m2fnuz" | "float8_e5m2fnuz" => DType::F8E5m2fnuz,
            _ => {
                return Err(MetadataError::UnknownDtype {
                    name: name.to_string(),
                });
            }
        };
        Ok(dtype)
    }

    /// True for floating-point types (including the 8-bit floats).
    pub fn is_float(self) -> bool {
        matches!(
            self,
            DType::F16
                | DType::Bf16
                | DType::F32
                | DType::F64
                | DType::F8E4m3fn
                | DType::F8E5m2
                | DType::F8E4m3fnuz
                | DType::F8E5m2fnuz
        )
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DType {
    type Err = MetadataError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::parse(s)
    }
}

impl TryFrom<String> for DType {
    type Error = MetadataError;
    fn try_from(value: String) -> Result<Self, Self::Error> {
        DType::parse(&value)
    }
}

impl From<DType> for String {
    fn from(value: DType) -> Self {
        value.name().to_string()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_sizes_are_right() {
        for dtype in DType::ALL {
            assert_eq!(DType::parse(dtype.name()).unwrap(), dtype);
        }
        assert_eq!(DType::parse("BF16").unwrap(), DType::Bf16);
        assert_eq!(DType::parse("torch.float32").unwrap(), DType::F32);
        assert_eq!(DType::parse("F8_E4M3").unwrap(), DType::F8E4m3fn);
        assert_eq!(DType::Bf16.size(), 2);
        assert_eq!(DType::I64.size(), 8);
        assert_eq!(DType::F8E5m2.size(), 1);
    }

    #[test]
    fn unknown_dtype_is_named_in_the_error() {
        let err = DType::parse("complex32").unwrap_err();
        assert_eq!(err.to_string(), "unknown dtype \"complex32\"");
    }
}
