//! Non-tensor DCP entries (`BytesStorageMetadata`): each is a `torch.save(obj)` zip; simple Python
//! values in it (ints, floats, strings, bytes, bools, None, and lists, tuples, dicts and sets of
//! them) decode to JSON.

use bytes::Bytes;
use serde_json::{Map, Number, Value as Json};

use crate::MetadataError;
use crate::formats::torch::pickle::{Limits, Obj, Pickle, Value, unpickle};
use crate::formats::torch::zip::{self, Segments};

/// Deepest nesting decoded (Python's own recursion limit).
const MAX_DEPTH: usize = 1000;
/// Most JSON nodes produced: a pickle can reference one list many times, and JSON has no
/// references, so the output is capped rather than allowed to grow exponentially.
const MAX_NODES: usize = 1 << 20;

/// Decodes the blob of a non-tensor entry (a `torch.save` zip) into JSON. Python values map as:
/// None → null; bool; int → number (ints wider than 64 bits are refused); float → number (NaN
/// and the infinities as the strings `"NaN"`, `"Infinity"`, `"-Infinity"`); str → string; bytes
/// → `{"__bytes__": "<lower-case hex>"}`; list, tuple, set → array; dict and
/// `collections.OrderedDict` → object (keys that are not strings are written as their JSON text,
/// e.g. `1` → `"1"`). Anything else (class instances, tensors) is [`MetadataError::Unsupported`]
/// naming what was found.
pub fn decode_object(blob: &[u8]) -> Result<Json, MetadataError> {
    let fail = |detail: String| MetadataError::Unsupported {
        path: "object".to_string(),
        detail,
    };
    let seg = Segments::whole(Bytes::copy_from_slice(blob));
    let dir = zip::read_directory(&seg)
        .map_err(|e| fail(format!("not a readable torch.save zip: {e}")))?;
    let Some(pkl) = dir.entries.iter().find(|e| e.name.ends_with("data.pkl")) else {
        return Err(fail("the torch.save zip has no data.pkl".to_string()));
    };
    let bytes = zip::read_member(&seg, &dir, pkl)
        .map_err(|e| fail(format!("not a readable torch.save zip: {e}")))?;
    decode_pickle(bytes)
}

/// Decodes a bare pickle (a `data.pkl`) into JSON, as [`decode_object`] does with the one inside
/// a torch.save zip.
pub fn decode_pickle(bytes: &[u8]) -> Result<Json, MetadataError> {
    let fail = |detail: String| MetadataError::Unsupported {
        path: "object".to_string(),
        detail,
    };
    let pickle = unpickle(bytes, &Limits::BLOB).map_err(|e| fail(format!("data.pkl: {e}")))?;
    let mut nodes = 0usize;
    to_json(&pickle, pickle.root(), 0, &mut nodes).map_err(fail)
}

/// One value inside an executed pickle as JSON, by the rules of [`decode_object`] (an error
/// naming what has no JSON form).
pub fn value_to_json(p: &Pickle, value: &Value) -> Result<Json, String> {
    let mut nodes = 0usize;
    to_json(p, value, 0, &mut nodes)
}

fn to_json(p: &Pickle, value: &Value, depth: usize, nodes: &mut usize) -> Result<Json, String> {
    *nodes += 1;
    if *nodes > MAX_NODES {
        return Err(format!("the value has more than {MAX_NODES} parts"));
    }
    if depth > MAX_DEPTH {
        return Err(format!("the value nests deeper than {MAX_DEPTH}"));
    }
    Ok(match value {
        Value::None => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::Int(i) => Json::from(*i),
        Value::BigInt(_) => return Err("an int wider than 64 bits".to_string()),
        Value::Float(f) => float(*f),
        Value::Str(s) => Json::String(s.to_string()),
        Value::Bytes(b) => bytes_json(b),
        Value::Ref(_) => match p.obj(value) {
            Some(Obj::Tuple(items)) | Some(Obj::List(items)) | Some(Obj::Set(items)) => {
                Json::Array(
                    items
                        .iter()
                        .map(|v| to_json(p, v, depth + 1, nodes))
                        .collect::<Result<_, _>>()?,
                )
            }
            Some(Obj::Dict(pairs)) => dict(p, pairs, depth, nodes)?,
            Some(Obj::Instance(instance)) => {
                let class = p.global(&instance.class);
                match class {
                    Some(("collections", "OrderedDict")) => dict(p, &instance.items, depth, nodes)?,
                    // Protocol 2 pickles bytes as `_codecs.encode(text, 'latin1')`.
                    Some(("_codecs", "encode")) => match instance.args.as_slice() {
                        [Value::Str(text), Value::Str(codec)]
                            if matches!(&**codec, "latin1" | "latin-1" | "iso-8859-1") =>
                        {
                            let mut raw = Vec::with_capacity(text.len());
                            for c in text.chars() {
                                let Ok(b) = u8::try_from(u32::from(c)) else {
                                    return Err("_codecs.encode of a non-latin-1 text".to_string());
                                };
                                raw.push(b);
                            }
                            bytes_json(&raw)
                        }
                        _ => {
                            return Err("a _codecs.encode call tessera does not decode".to_string());
                        }
                    },
                    Some(("builtins" | "__builtin__", "set" | "frozenset" | "list" | "tuple")) => {
                        match instance.args.first() {
                            None => Json::Array(Vec::new()),
                            Some(items) => to_json(p, items, depth + 1, nodes)?,
                        }
                    }
                    Some(("builtins" | "__builtin__", "bytearray" | "bytes")) => {
                        match instance.args.first() {
                            None => bytes_json(&[]),
                            Some(v) => to_json(p, v, depth + 1, nodes)?,
                        }
                    }
                    Some((module, name)) if name.starts_with("_rebuild_") => {
                        return Err(format!(
                            "a tensor ({module}.{name}), which has no JSON form"
                        ));
                    }
                    _ => return Err(format!("a {}, which has no JSON form", p.describe(value))),
                }
            }
            Some(Obj::PersistentId(_)) => {
                return Err(
                    "a tensor or storage (a persistent id), which has no JSON form".to_string(),
                );
            }
            _ => return Err(format!("a {}, which has no JSON form", p.describe(value))),
        },
    })
}

fn dict(
    p: &Pickle,
    pairs: &[(Value, Value)],
    depth: usize,
    nodes: &mut usize,
) -> Result<Json, String> {
    let mut map = Map::new();
    for (k, v) in pairs {
        let key = match to_json(p, k, depth + 1, nodes)? {
            Json::String(s) => s,
            other => other.to_string(),
        };
        map.insert(key, to_json(p, v, depth + 1, nodes)?);
    }
    Ok(Json::Object(map))
}

fn float(f: f64) -> Json {
    match Number::from_f64(f) {
        Some(n) => Json::Number(n),
        None if f.is_nan() => Json::String("NaN".to_string()),
        None if f > 0.0 => Json::String("Infinity".to_string()),
        None => Json::String("-Infinity".to_string()),
    }
}

fn bytes_json(bytes: &[u8]) -> Json {
    let mut hex = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        hex.push_str(&format!("{b:02x}"));
    }
    let mut map = Map::new();
    map.insert("__bytes__".to_string(), Json::String(hex));
    Json::Object(map)
}
