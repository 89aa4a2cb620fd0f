//! safetensors: a header parser with caps (untrusted input: size limits, checked arithmetic, no
//! overlap, no hole), checkpoints read in place ([`dir`]: a file, a directory, an HF index, DCP's HF
//! writer), and a writer (for `tessera load --dump` and consolidated exports).
//!
//! Layout: `u64` little-endian header length N, N bytes of JSON header (padded with spaces to a
//! multiple of 8), then the data. The header maps each tensor name to
//! `{"dtype", "shape", "data_offsets": [begin, end]}` relative to the data start, plus an optional
//! `"__metadata__"` map of strings.

pub mod dir;

use std::collections::BTreeMap;

use serde_json::{Map, Value, json};

pub use dir::{
    INDEX_FILE, SHARDED_DIR, SHARDING_INFO_KEY, SafetensorsCheckpoint, SafetensorsDetails,
    SafetensorsFile, SafetensorsLayout, is_safetensors, open_safetensors, read_header,
};

use crate::{DType, MetadataError};

/// Largest header accepted (the safetensors reference implementation's cap).
pub const MAX_HEADER_BYTES: u64 = 100 * 1024 * 1024;

/// The safetensors name of a dtype (`BF16`, `F32`, `F8_E4M3`, …).
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::Bool => "BOOL",
        DType::U8 => "U8",
        DType::U16 => "U16",
        DType::U32 => "U32",
        DType::U64 => "U64",
        DType::I8 => "I8",
        DType::I16 => "I16",
        DType::I32 => "I32",
        DType::I64 => "I64",
        DType::F16 => "F16",
        DType::Bf16 => "BF16",
        DType::F32 => "F32",
        DType::F64 => "F64",
        DType::F8E4m3fn => "F8_E4M3",
        DType::F8E5m2 => "F8_E5M2",
        DType::F8E4m3fnuz => "F8_E4M3FNUZ",
        DType::F8E5m2fnuz => "F8_E5M2FNUZ",
    }
}

/// One tensor to write: name, dtype, shape and its row-major little-endian bytes.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    /// Name in the header.
    pub name: &'a str,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: &'a [u64],
    /// Bytes (numel × dtype size of them).
    pub data: &'a [u8],
}

/// Serializes tensors (in the given order) into a safetensors file.
pub fn serialize(
    tensors: &[TensorView<'_>],
    metadata: Option<&BTreeMap<String, String>>,
) -> Result<Vec<u8>, MetadataError> {
    let mut header = Map::new();
    if let Some(metadata) = metadata {
        header.insert("__metadata__".to_string(), json!(metadata));
    }
    let mut offset = 0u64;
    for t in tensors {
        let numel: u64 = t.shape.iter().product();
        if numel * t.dtype.size() != t.data.len() as u64 {
            return Err(MetadataError::ByteLengthMismatch {
                fqn: t.name.to_string(),
                region: crate::shape_to_string(t.shape),
                numel,
                dtype: t.dtype.to_string(),
                expected: numel * t.dtype.size(),
                actual: t.data.len() as u64,
            });
        }
        if header.contains_key(t.name) {
            return Err(MetadataError::Invalid {
                what: format!("safetensors: tensor {} appears twice", t.name),
            });
        }
        let end = offset + t.data.len() as u64;
        header.insert(
            t.name.to_string(),
            json!({"dtype": dtype_name(t.dtype), "shape": t.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut text =
        serde_json::to_string(&Value::Object(header)).map_err(|e| MetadataError::Invalid {
            what: format!("safetensors header: {e}"),
        })?;
    // Pad so the data starts 8-byte aligned, as the reference writer does.
    while (8 + text.len()) % 8 != 0 {
        text.push(' ');
    }
    let mut out = Vec::with_capacity(8 + text.len() + offset as usize);
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    for t in tensors {
        out.extend_from_slice(t.data);
    }
    Ok(out)
}

/// One tensor entry of a parsed header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeaderEntry {
    /// Name.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// `[begin, end)` relative to the data start.
    pub data_offsets: (u64, u64),
}

/// A parsed safetensors header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Header {
    /// Bytes before the data (8 + header length).
    pub data_start: u64,
    /// Tensors in data order.
    pub tensors: Vec<HeaderEntry>,
    /// `__metadata__`, if any.
    pub metadata: BTreeMap<String, String>,
}

fn bad(path: &str, detail: impl Into<String>) -> MetadataError {
    MetadataError::Decode {
        path: path.to_string(),
        what: "safetensors header",
        detail: detail.into(),
    }
}

/// Reads the header length from a file's first 8 bytes (capped).
pub fn header_len(first8: &[u8], path: &str) -> Result<u64, MetadataError> {
    let Some(bytes) = first8.get(..8) else {
        return Err(bad(
            path,
            format!(
                "file is {} bytes, shorter than the 8-byte header length",
                first8.len()
            ),
        ));
    };
    let mut le = [0u8; 8];
    le.copy_from_slice(bytes);
    let n = u64::from_le_bytes(le);
    if n > MAX_HEADER_BYTES {
        return Err(bad(
            path,
            format!("header of {n} bytes exceeds the {MAX_HEADER_BYTES}-byte cap"),
        ));
    }
    Ok(n)
}

/// Parses a header (the JSON bytes after the length) of a file of `file_size` bytes, checking
/// every entry: known dtype, byte length = numel × dtype size, inside the file, no overlap and
/// no hole between entries.
pub fn parse_header(json: &[u8], file_size: u64, path: &str) -> Result<Header, MetadataError> {
    let data_start = 8 + json.len() as u64;
    let value: Value = serde_json::from_slice(json).map_err(|e| bad(path, e.to_string()))?;
    let Value::Object(map) = value else {
        return Err(bad(path, "header is not a JSON object"));
    };
    let mut tensors = Vec::new();
    let mut metadata = BTreeMap::new();
    for (name, entry) in map {
        if name == "__metadata__" {
            let Value::Object(m) = entry else {
                return Err(bad(path, "__metadata__ is not an object"));
            };
            for (k, v) in m {
                let Value::String(v) = v else {
                    return Err(bad(path, format!("__metadata__.{k} is not a string")));
                };
                metadata.insert(k, v);
            }
            continue;
        }
        let field = |key: &str| {
            entry
                .get(key)
                .ok_or_else(|| bad(path, format!("tensor {name}: no {key}")))
        };
        let dtype_text = field("dtype")?
            .as_str()
            .ok_or_else(|| bad(path, format!("tensor {name}: dtype is not a string")))?;
        let dtype = DType::parse(dtype_text)
            .map_err(|_| bad(path, format!("tensor {name}: unknown dtype {dtype_text:?}")))?;
        let shape: Vec<u64> = field("shape")?
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .ok_or_else(|| {
                bad(
                    path,
                    format!("tensor {name}: shape is not a list of integers"),
                )
            })?;
        let offsets: Vec<u64> = field("data_offsets")?
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>())
            .filter(|o| o.len() == 2)
            .ok_or_else(|| {
                bad(
                    path,
                    format!("tensor {name}: data_offsets is not [begin, end]"),
                )
            })?;
        let (begin, end) = (offsets[0], offsets[1]);
        let numel = shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| n.checked_mul(dtype.size()))
            .ok_or_else(|| bad(path, format!("tensor {name}: shape {shape:?} overflows")))?;
        if end < begin || end - begin != numel {
            return Err(bad(
                path,
                format!(
                    "tensor {name}: data_offsets [{begin}, {end}] hold {} bytes but shape {shape:?} of {dtype} needs {numel}",
                    end.saturating_sub(begin)
                ),
            ));
        }
        if data_start.checked_add(end).is_none_or(|e| e > file_size) {
            return Err(bad(
                path,
                format!(
                    "tensor {name}: bytes {begin}..{end} reach past the end of the {file_size}-byte file"
                ),
            ));
        }
        tensors.push(HeaderEntry {
            name,
            dtype,
            shape,
            data_offsets: (begin, end),
        });
    }
    tensors.sort_by_key(|t| (t.data_offsets, t.name.clone()));
    let mut expected = 0u64;
    for t in &tensors {
        let (begin, end) = t.data_offsets;
        if begin < expected {
            return Err(bad(
                path,
                format!(
                    "tensor {}: bytes {begin}..{end} overlap the previous tensor (ending at {expected})",
                    t.name
                ),
            ));
        }
        if begin > expected {
            return Err(bad(
                path,
                format!(
                    "bytes {expected}..{begin} before tensor {} belong to no tensor (a hole)",
                    t.name
                ),
            ));
        }
        expected = end;
    }
    Ok(Header {
        data_start,
        tensors,
        metadata,
    })
}

/// Parses a whole in-memory safetensors file.
pub fn parse(file: &[u8], path: &str) -> Result<Header, MetadataError> {
    let n = header_len(file, path)?;
    let Some(json) = file.get(8..8 + n as usize) else {
        return Err(bad(
            path,
            format!(
                "header of {n} bytes but the file has {} bytes after the length",
                file.len().saturating_sub(8)
            ),
        ));
    };
    parse_header(json, file.len() as u64, path)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_alignment() {
        let a = [1u8, 2, 3, 4, 5, 6, 7, 8];
        let b = [9u8, 10];
        let file = serialize(
            &[
                TensorView {
                    name: "a",
                    dtype: DType::F32,
                    shape: &[2],
                    data: &a,
                },
                TensorView {
                    name: "b",
                    dtype: DType::Bf16,
                    shape: &[1],
                    data: &b,
                },
            ],
            None,
        )
        .unwrap();
        let header = parse(&file, "x.safetensors").unwrap();
        assert_eq!(header.data_start % 8, 0);
        assert_eq!(header.tensors[1].name, "b");
        let (s, e) = header.tensors[1].data_offsets;
        assert_eq!(
            &file[(header.data_start + s) as usize..(header.data_start + e) as usize],
            &b
        );
    }

    #[test]
    fn bad_headers_are_named_errors() {
        let err = header_len(&(MAX_HEADER_BYTES + 1).to_le_bytes(), "big.safetensors").unwrap_err();
        assert_eq!(
            err.to_string(),
            "big.safetensors: cannot decode safetensors header: header of 104857601 bytes exceeds the 104857600-byte cap"
        );
        let overlap = br#"{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}"#;
        let err = parse_header(overlap, 1000, "o.safetensors").unwrap_err();
        assert_eq!(
            err.to_string(),
            "o.safetensors: cannot decode safetensors header: tensor b: bytes 2..4 overlap the previous tensor (ending at 4)"
        );
        let hole = br#"{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],"data_offsets":[4,6]}}"#;
        let err = parse_header(hole, 1000, "h.safetensors").unwrap_err();
        assert_eq!(
            err.to_string(),
            "h.safetensors: cannot decode safetensors header: bytes 2..4 before tensor b belong to no tensor (a hole)"
        );
    }
}
