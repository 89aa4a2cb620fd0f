//! A JSON value reshaped so that a compressor sees a plan's regularity: arrays of records become
//! records of columns, arrays of equal-length integer tuples become columns, and integer columns
//! become first value plus differences. A rank plan lists piece after piece whose ids, offsets
//! and file positions step by the same amount (an all-to-all reshard gives a rank one piece per
//! saved shard of every tensor): as rows of JSON numbers each piece costs zstd about twenty
//! bytes, as differences the steps repeat and cost next to nothing, so a rank's answer grows with
//! what is irregular in its plan, not with the world.
//!
//! The reshaping is exact ([`unpack`] of [`pack`] is the value) and says nothing about the
//! schema: it works on any JSON value. Marker keys start with U+0001; an object key that starts
//! with it is escaped by one more.
//!
//! Messages travel by the typed route ([`to_wire`], [`from_wire`]): `writer` writes the packed
//! text straight from the typed value and `reader` reads it straight into one, the same text
//! and the same rules as [`pack`] and [`unpack`] over a [`serde_json::Value`], which stay as the
//! definition of the form (the tests hold each route to the other). The typed route spares the
//! allocation of a map, a key and a value per field of every record: on a rank plan of a
//! million fields that was nearly all of the time.

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Number, Value};

use crate::OpsError;

mod reader;
mod writer;

/// Marks `{MARK_DELTA: [first, d1, d2, ...]}`: an integer array as differences.
const MARK_DELTA: &str = "\u{1}d";
/// Marks `{MARK_COLUMNS: {key: column, ...}, MARK_LEN: n}`: n records, a column per key (with
/// `MARK_MASK: {key: [0 or 1 per record]}` for keys some records lack).
const MARK_COLUMNS: &str = "\u{1}c";
/// Marks `{MARK_TUPLES: [column, ...], MARK_LEN: n}`: n integer tuples of one length.
const MARK_TUPLES: &str = "\u{1}t";
/// Marks `{MARK_RAGGED: [all items' elements], MARK_LENGTHS: [each item's length]}`: arrays of
/// any lengths, flattened (so that one-element lists of records become one column of records).
const MARK_RAGGED: &str = "\u{1}r";
/// The lengths of a ragged record's arrays.
const MARK_LENGTHS: &str = "\u{1}l";
/// Which records have a column's key (columns some records lack).
const MARK_MASK: &str = "\u{1}m";
/// The row count of a columns or tuples record.
const MARK_LEN: &str = "\u{1}n";
/// The first character of every marker key.
const MARK: char = '\u{1}';

/// The largest message a rank takes, unpacked (a rank plan of a few million pieces).
const MAX_MESSAGE_BYTES: u64 = 4 << 30;

/// `value` as it travels between ranks: the length of its packed JSON (8 bytes, little-endian),
/// then that JSON zstd-compressed. `what` names it in errors.
pub fn to_wire<T: Serialize>(value: &T, what: &str) -> Result<Bytes, OpsError> {
    let message = |source| OpsError::Message {
        what: what.to_string(),
        source,
    };
    let text = writer::packed_json(value).map_err(message)?;
    let packed = zstd::bulk::compress(&text, 3)
        .map_err(|e| OpsError::invalid(format!("compressing {what}: {e}")))?;
    let mut out = BytesMut::with_capacity(8 + packed.len());
    out.put_u64_le(text.len() as u64);
    out.extend_from_slice(&packed);
    Ok(out.freeze())
}

/// The value [`to_wire`] sent; an error names `what` (whose message it is) and what is wrong.
pub fn from_wire<T: DeserializeOwned>(bytes: &[u8], what: &str) -> Result<T, OpsError> {
    let bad = |why: String| OpsError::invalid(format!("{what}: {why}"));
    let (mut head, packed) = bytes
        .split_at_checked(8)
        .ok_or_else(|| bad(format!("{} bytes, shorter than its header", bytes.len())))?;
    let len = head.get_u64_le();
    if len > MAX_MESSAGE_BYTES {
        return Err(bad(format!(
            "it says it holds {len} bytes, more than {MAX_MESSAGE_BYTES}"
        )));
    }
    let text = zstd::bulk::decompress(packed, len as usize)
        .map_err(|e| bad(format!("it does not decompress: {e}")))?;
    if text.len() as u64 != len {
        return Err(bad(format!(
            "{} bytes decompressed where its header says {len}",
            text.len()
        )));
    }
    reader::from_packed_json(&text).map_err(|refusal| match refusal {
        reader::Refusal::Json(source) => OpsError::Message {
            what: what.to_string(),
            source,
        },
        reader::Refusal::Shape(why) => bad(why),
    })
}

/// `value` reshaped into columns and differences (see the module doc). It takes the value:
/// every part moves into its column once, nothing is copied.
pub fn pack(value: Value) -> Value {
    match value {
        Value::Array(items) => pack_array(items),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(key, value)| (escape(&key), pack(value)))
                .collect(),
        ),
        scalar => scalar,
    }
}

/// The value [`pack`] was given; an error names what is not one of its shapes.
pub fn unpack(value: Value) -> Result<Value, String> {
    match value {
        Value::Array(items) => items.into_iter().map(unpack).collect::<Result<_, _>>(),
        Value::Object(map) => unpack_object(map),
        scalar => Ok(scalar),
    }
}

fn pack_array(items: Vec<Value>) -> Value {
    if items.len() < 2 {
        return Value::Array(items.into_iter().map(pack).collect());
    }
    if let Some(ints) = integers(&items) {
        return delta(&ints);
    }
    if let Some(keys) = record_keys(&items) {
        return pack_records(items, keys);
    }
    if let Some(width) = tuple_width(&items) {
        let columns: Vec<Value> = (0..width)
            .map(|i| {
                let column: Vec<i64> = items
                    .iter()
                    .map(|item| item[i].as_i64().unwrap_or_default())
                    .collect();
                delta(&column)
            })
            .collect();
        return marked(MARK_TUPLES, Value::Array(columns), items.len());
    }
    if items.iter().all(Value::is_array) {
        let lengths: Vec<i64> = items
            .iter()
            .map(|item| item.as_array().map_or(0, Vec::len) as i64)
            .collect();
        let flat: Vec<Value> = items
            .into_iter()
            .flat_map(|item| match item {
                Value::Array(inner) => inner,
                _ => Vec::new(),
            })
            .collect();
        let mut map = Map::new();
        map.insert(MARK_RAGGED.to_string(), pack_array(flat));
        map.insert(MARK_LENGTHS.to_string(), delta(&lengths));
        return Value::Object(map);
    }
    Value::Array(items.into_iter().map(pack).collect())
}

fn marked(mark: &str, body: Value, len: usize) -> Value {
    let mut map = Map::new();
    map.insert(mark.to_string(), body);
    map.insert(MARK_LEN.to_string(), Value::from(len as u64));
    Value::Object(map)
}

/// The items as integers when every one is an integer that fits an `i64` (so every difference
/// fits an `i128` and is written exactly).
fn integers(items: &[Value]) -> Option<Vec<i64>> {
    items.iter().map(|item| item.as_i64()).collect()
}

/// Every key of the items, sorted, when every item is an object (and some has a key). Most
/// arrays are records of one shape: an item whose keys are the first's costs one comparison per
/// key (a map's keys iterate sorted).
fn record_keys(items: &[Value]) -> Option<Vec<String>> {
    let first = items.first()?.as_object()?;
    let mut keys: Vec<String> = first.keys().cloned().collect();
    let mut merged = false;
    for item in &items[1..] {
        let map = item.as_object()?;
        if map.len() == keys.len() && map.keys().zip(&keys).all(|(a, b)| a == b) {
            continue;
        }
        keys.extend(map.keys().cloned());
        merged = true;
    }
    if merged {
        keys.sort_unstable();
        keys.dedup();
    }
    (!keys.is_empty()).then_some(keys)
}

/// Records as one column per key (`keys` sorted, as a map's keys iterate); a key some records
/// lack has a column of the values present and a mask (1: present) under [`MARK_MASK`].
fn pack_records(items: Vec<Value>, keys: Vec<String>) -> Value {
    let len = items.len();
    let mut columns: Vec<Vec<Value>> = keys.iter().map(|_| Vec::with_capacity(len)).collect();
    let mut present: Vec<Vec<i64>> = keys.iter().map(|_| Vec::with_capacity(len)).collect();
    for item in items {
        let Value::Object(mut map) = item else {
            continue;
        };
        // serde_json's maps iterate sorted unless a crate in the build turns on its
        // `preserve_order`: then look each key up.
        let mut rest = keys.iter();
        if map.keys().all(|name| rest.any(|key| key == name)) {
            let mut entries = map.into_iter().peekable();
            for (k, key) in keys.iter().enumerate() {
                let here = entries.next_if(|(name, _)| name == key);
                present[k].push(i64::from(here.is_some()));
                columns[k].extend(here.map(|(_, value)| value));
            }
        } else {
            for (k, key) in keys.iter().enumerate() {
                let here = map.remove(key);
                present[k].push(i64::from(here.is_some()));
                columns[k].extend(here);
            }
        }
    }
    let mut packed = Map::new();
    let mut masks = Map::new();
    for ((key, column), present) in keys.iter().zip(columns).zip(present) {
        if column.len() < len {
            masks.insert(escape(key), delta(&present));
        }
        packed.insert(escape(key), pack_array(column));
    }
    let mut map = Map::new();
    map.insert(MARK_COLUMNS.to_string(), Value::Object(packed));
    map.insert(MARK_LEN.to_string(), Value::from(len as u64));
    if !masks.is_empty() {
        map.insert(MARK_MASK.to_string(), Value::Object(masks));
    }
    Value::Object(map)
}

/// The tuples' length, when every item is a non-empty array of that many `i64` integers.
fn tuple_width(items: &[Value]) -> Option<usize> {
    let width = items.first()?.as_array()?.len();
    (width > 0
        && items.iter().all(|item| {
            item.as_array().is_some_and(|tuple| {
                tuple.len() == width && tuple.iter().all(|v| v.as_i64().is_some())
            })
        }))
    .then_some(width)
}

fn delta(ints: &[i64]) -> Value {
    let mut previous = 0i128;
    let steps: Vec<Value> = ints
        .iter()
        .map(|&value| {
            let step = i128::from(value) - previous;
            previous = i128::from(value);
            number(step)
        })
        .collect();
    let mut map = Map::new();
    map.insert(MARK_DELTA.to_string(), Value::Array(steps));
    Value::Object(map)
}

/// An `i128` difference as JSON (within `i64` or `u64` since both ends fit an `i64`).
fn number(value: i128) -> Value {
    match i64::try_from(value) {
        Ok(small) => Value::from(small),
        // Differences of two i64 values lie in (-2^64, 2^64): above i64::MAX they fit a u64;
        // below i64::MIN JSON has no exact number for them, so they travel as text.
        Err(_) => {
            u64::try_from(value).map_or_else(|_| Value::String(value.to_string()), Value::from)
        }
    }
}

fn undelta(steps: Vec<Value>) -> Result<Vec<i64>, String> {
    let mut previous = 0i128;
    steps
        .into_iter()
        .map(|step| {
            let step = match &step {
                Value::Number(n) => n
                    .as_i64()
                    .map(i128::from)
                    .or_else(|| n.as_u64().map(i128::from)),
                Value::String(text) => text.parse::<i128>().ok(),
                _ => None,
            }
            .ok_or_else(|| format!("a difference {step} that is not an integer"))?;
            previous += step;
            i64::try_from(previous).map_err(|_| format!("an integer {previous} out of range"))
        })
        .collect()
}

fn unpack_object(mut map: Map<String, Value>) -> Result<Value, String> {
    if map.len() == 1
        && let Some(steps) = map.remove(MARK_DELTA)
    {
        let Value::Array(steps) = steps else {
            return Err("differences that are not an array".to_string());
        };
        return Ok(Value::Array(
            undelta(steps)?
                .into_iter()
                .map(|v| Value::Number(Number::from(v)))
                .collect(),
        ));
    }
    if map.len() == 2 && map.contains_key(MARK_RAGGED) && map.contains_key(MARK_LENGTHS) {
        let flat = map.remove(MARK_RAGGED).unwrap_or_default();
        let lengths = map.remove(MARK_LENGTHS).unwrap_or_default();
        return ragged(flat, lengths);
    }
    if let Some(len) = map.get(MARK_LEN).and_then(Value::as_u64) {
        let len = len as usize;
        if map.len() == 2 && map.contains_key(MARK_TUPLES) {
            return match map.remove(MARK_TUPLES) {
                Some(Value::Array(columns)) => tuples(columns, len),
                other => Err(format!("tuples that are not columns: {other:?}")),
            };
        }
        let masked = map.contains_key(MARK_MASK);
        if map.len() == 2 + usize::from(masked) && map.contains_key(MARK_COLUMNS) {
            let Some(Value::Object(columns)) = map.remove(MARK_COLUMNS) else {
                return Err("records whose columns are not an object".to_string());
            };
            let masks = match map.remove(MARK_MASK) {
                Some(Value::Object(masks)) => masks,
                None => Map::new(),
                Some(other) => return Err(format!("record masks that are not an object: {other}")),
            };
            return records(columns, masks, len);
        }
    }
    map.into_iter()
        .map(|(key, value)| Ok((unescape(key), unpack(value)?)))
        .collect::<Result<Map<_, _>, String>>()
        .map(Value::Object)
}

fn column(values: Value, len: usize, what: &str) -> Result<Vec<Value>, String> {
    match unpack(values)? {
        Value::Array(column) if column.len() == len => Ok(column),
        other => Err(format!(
            "{what}: a column that is not {len} values: {other}"
        )),
    }
}

fn records(
    columns: Map<String, Value>,
    mut masks: Map<String, Value>,
    len: usize,
) -> Result<Value, String> {
    let mut rows = vec![Map::new(); len];
    for (key, values) in columns {
        let present: Vec<bool> = match masks.remove(&key) {
            Some(mask) => match unpack(mask)? {
                Value::Array(mask) if mask.len() == len => {
                    mask.iter().map(|bit| bit.as_u64() == Some(1)).collect()
                }
                other => return Err(format!("a mask that is not {len} values: {other}")),
            },
            None => vec![true; len],
        };
        let key = unescape(key);
        let count = present.iter().filter(|&&p| p).count();
        let mut values = column(values, count, &key)?.into_iter();
        for (row, _) in rows.iter_mut().zip(&present).filter(|(_, p)| **p) {
            if let Some(value) = values.next() {
                row.insert(key.clone(), value);
            }
        }
    }
    if let Some(key) = masks.keys().next() {
        return Err(format!("a mask for {key}, which has no column"));
    }
    Ok(Value::Array(rows.into_iter().map(Value::Object).collect()))
}

fn tuples(columns: Vec<Value>, len: usize) -> Result<Value, String> {
    let mut rows = vec![Vec::with_capacity(columns.len()); len];
    for values in columns {
        for (row, value) in rows.iter_mut().zip(column(values, len, "tuples")?) {
            row.push(value);
        }
    }
    Ok(Value::Array(rows.into_iter().map(Value::Array).collect()))
}

fn ragged(flat: Value, lengths: Value) -> Result<Value, String> {
    let Value::Array(lengths) = unpack(lengths)? else {
        return Err("ragged lengths that are not an array".to_string());
    };
    let lengths: Vec<usize> = lengths
        .iter()
        .map(|len| len.as_u64().map(|len| len as usize))
        .collect::<Option<_>>()
        .ok_or("ragged lengths that are not counts")?;
    let total = lengths.iter().sum();
    let mut flat = column(flat, total, "ragged arrays")?.into_iter();
    Ok(Value::Array(
        lengths
            .into_iter()
            .map(|len| Value::Array(flat.by_ref().take(len).collect()))
            .collect(),
    ))
}

fn escape(key: &str) -> String {
    if key.starts_with(MARK) {
        format!("{MARK}{key}")
    } else {
        key.to_string()
    }
}

fn unescape(key: String) -> String {
    match key.strip_prefix(MARK) {
        Some(rest) => rest.to_string(),
        None => key,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn round_trip(value: Value) {
        let packed = pack(value.clone());
        let text = serde_json::to_string(&packed).unwrap();
        let back = unpack(serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back, value, "packed as {text}");
    }

    #[test]
    fn every_shape_comes_back_exactly() {
        round_trip(json!(null));
        round_trip(json!([]));
        round_trip(json!([1]));
        round_trip(json!([1, 2, 3, 5, 8]));
        round_trip(json!([i64::MAX, i64::MIN, 0, i64::MIN, i64::MAX]));
        round_trip(json!([u64::MAX, 1, 2]));
        round_trip(json!([1.5, 2.5]));
        round_trip(json!([[1, 2], [3, 4], [5, 6]]));
        round_trip(json!([[1, 2], [3], [5, 6]]));
        round_trip(json!([[], []]));
        round_trip(json!([[{"a": 1}], [], [{"a": 2}, {"a": 3}], ["x"]]));
        round_trip(json!([[[1, 2]], [[3, 4], [5]]]));
        round_trip(json!({"\u{1}r": [1], "\u{1}l": [1]}));
        round_trip(json!([{}, {}]));
        round_trip(json!([{"a": 1, "b": [1, 2]}, {"a": 2, "b": [3, 4]}]));
        round_trip(json!([{"a": 1}, {"b": 2}]));
        round_trip(json!([{"a": 1}, {}, {"a": 3, "b": [1]}, {"b": [2, 3]}]));
        round_trip(json!([{"\u{1}m": 1}, {"\u{1}n": 2}]));
        round_trip(json!([{"a": 1}, {"a": 2, "b": 2}]));
        round_trip(json!([{"a": null}, {"a": {"x": [1, 2, 3]}}, {"a": 3}]));
        round_trip(json!({"\u{1}d": [1, 2], "\u{1}n": 2, "\u{1}\u{1}c": "x"}));
        round_trip(json!([{"\u{1}d": [1, 2]}, {"\u{1}d": [3]}]));
        round_trip(json!([{"\u{1}c": {}, "\u{1}n": 0}, {"\u{1}c": {}, "\u{1}n": 1}]));
        round_trip(
            json!({"pieces": [{"id": 3, "region": {"offsets": [0, 64], "lengths": [16, 64]}},
                                     {"id": 7, "region": {"offsets": [16, 64], "lengths": [16, 64]}}]}),
        );
    }

    /// Any JSON value: scalars (integers at the i64/u64 edges, floats, marker-like strings) in
    /// arrays and objects (keys that look like markers included), nested a few levels.
    fn any_value() -> impl Strategy<Value = Value> {
        let key = prop_oneof![
            Just("a".to_string()),
            Just("b".to_string()),
            Just("\u{1}d".to_string()),
            Just("\u{1}c".to_string()),
            Just("\u{1}n".to_string()),
            Just("\u{1}m".to_string()),
            Just("\u{1}r".to_string()),
            Just("\u{1}l".to_string()),
            Just("\u{1}t".to_string()),
        ];
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            (0i64..8).prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            prop_oneof![Just(i64::MIN), Just(i64::MAX)].prop_map(Value::from),
            // Quarters: JSON text carries them exactly (serde_json parses others to the nearest).
            (-4_000_000i64..4_000_000).prop_map(|q| Value::from(q as f64 / 4.0)),
            "[a-z\u{1}]{0,3}".prop_map(Value::from),
        ];
        leaf.prop_recursive(4, 64, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                prop::collection::vec((key.clone(), inner), 0..4)
                    .prop_map(|entries| Value::Object(entries.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn any_value_packs_and_unpacks_to_itself(value in any_value()) {
            let packed = pack(value.clone());
            let text = serde_json::to_string(&packed).unwrap();
            let back = unpack(serde_json::from_str(&text).unwrap()).unwrap();
            prop_assert_eq!(back, value, "packed as {}", text);
        }
    }

    /// The typed routes on `value`: the writer writes what [`pack`] and `serde_json` write, and
    /// the reader reads what [`unpack`] reads.
    fn typed_routes_agree(value: &Value) -> Result<(), TestCaseError> {
        let text = serde_json::to_string(&pack(value.clone())).unwrap();
        let typed = String::from_utf8(writer::packed_json(value).unwrap()).unwrap();
        prop_assert_eq!(&typed, &text);
        let back: Value = match reader::from_packed_json(text.as_bytes()) {
            Ok(back) => back,
            Err(reader::Refusal::Json(e)) => panic!("{e} reading {text}"),
            Err(reader::Refusal::Shape(e)) => panic!("{e} reading {text}"),
        };
        prop_assert_eq!(&back, value, "packed as {}", text);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]
        #[test]
        fn the_typed_routes_write_and_read_what_the_value_routes_do(value in any_value()) {
            typed_routes_agree(&value)?;
        }
    }

    #[test]
    fn the_typed_routes_agree_on_every_shape() {
        for value in [
            json!([i64::MAX, i64::MIN, 0, i64::MIN, i64::MAX]),
            json!([u64::MAX, 1, 2]),
            json!([1.5, 2.5, 1e300, -0.0]),
            json!([[1, 2], [3], [5, 6]]),
            json!([[{"a": 1}], [], [{"a": 2}, {"a": 3}], ["x"]]),
            json!([{"a": 1}, {}, {"a": 3, "b": [1]}, {"b": [2, 3]}]),
            json!({"\u{1}d": [1, 2], "\u{1}n": 2, "\u{1}\u{1}c": "x", "\n\"": "\u{0}"}),
            json!([{"\u{1}c": {}, "\u{1}n": 0}, {"\u{1}c": {}, "\u{1}n": 1}]),
            json!([null, {"a": 1}, {"a": 2}]),
        ] {
            typed_routes_agree(&value).unwrap();
        }
    }

    #[test]
    fn the_typed_reader_refuses_what_unpack_refuses() {
        let refused = |value: Value| {
            let text = serde_json::to_vec(&value).unwrap();
            match reader::from_packed_json::<Value>(&text) {
                Err(reader::Refusal::Shape(why)) => why,
                Err(reader::Refusal::Json(e)) => panic!("{value}: not a shape error: {e}"),
                Ok(back) => panic!("{value} read as {back}"),
            }
        };
        let error = refused(json!({"\u{1}d": [1, "x"]}));
        assert!(error.contains("not an integer"), "{error}");
        let error = refused(json!({"\u{1}c": [1, 2], "\u{1}n": 2}));
        assert!(error.contains("columns are not an object"), "{error}");
        let error = refused(json!({"\u{1}t": 5, "\u{1}n": 2}));
        assert!(error.contains("tuples that are not columns"), "{error}");
        let error = refused(json!({"\u{1}c": {"a": [1, 2]}, "\u{1}n": 3}));
        assert!(error.contains("not 3 values"), "{error}");
        let error = refused(
            json!({"\u{1}c": {"a": [1, 2]}, "\u{1}n": 3, "\u{1}m": {"a": {"\u{1}d": [1, -1, 0]}}}),
        );
        assert!(
            error.contains("a: a column that is not 1 values"),
            "{error}"
        );
        let error = refused(json!({"\u{1}r": [1, 2], "\u{1}l": {"\u{1}d": [1, 2]}}));
        assert!(error.contains("not 4 values"), "{error}");
        let error = refused(json!({"\u{1}c": {}, "\u{1}n": 1, "\u{1}m": {"a": [1]}}));
        assert!(
            error.contains("a mask for a, which has no column"),
            "{error}"
        );
    }

    #[test]
    fn a_regular_run_packs_to_repeated_steps() {
        let rows: Vec<Value> = (0..100)
            .map(|i| json!({"id": 4 * i + 1, "offsets": [16 * i, 64]}))
            .collect();
        let packed = serde_json::to_string(&pack(Value::Array(rows))).unwrap();
        assert!(packed.contains("[1,4,4,4"), "{packed}");
        assert!(packed.contains("[0,16,16,16"), "{packed}");
        assert!(packed.contains("[64,0,0,0"), "{packed}");
    }

    #[test]
    fn what_is_not_a_packed_shape_is_refused_naming_it() {
        let error = unpack(json!({"\u{1}d": [1, "x"]})).unwrap_err();
        assert!(error.contains("not an integer"), "{error}");
        let error = unpack(json!({"\u{1}c": [1, 2], "\u{1}n": 2})).unwrap_err();
        assert!(error.contains("columns are not an object"), "{error}");
        let error = unpack(json!({"\u{1}t": 5, "\u{1}n": 2})).unwrap_err();
        assert!(error.contains("tuples that are not columns"), "{error}");
        let error = unpack(json!({"\u{1}c": {"a": [1, 2]}, "\u{1}n": 3})).unwrap_err();
        assert!(error.contains("not 3 values"), "{error}");
        let error = unpack(
            json!({"\u{1}c": {"a": [1, 2]}, "\u{1}n": 3, "\u{1}m": {"a": {"\u{1}d": [1, -1, 0]}}}),
        )
        .unwrap_err();
        assert!(
            error.contains("a: a column that is not 1 values"),
            "{error}"
        );
        let error = unpack(json!({"\u{1}r": [1, 2], "\u{1}l": {"\u{1}d": [1, 2]}})).unwrap_err();
        assert!(error.contains("not 4 values"), "{error}");
    }
}
