//! The packed form read straight into a typed value: the packed JSON text is parsed into a tree
//! that keeps every column as a column (an integer column as one `Vec<i64>`), and a
//! [`serde::Deserializer`] walks it, handing each record its row of every column. The
//! [`serde_json::Value`] route rebuilt every record as a map of values first ([`super::unpack`])
//! and then read the typed value out of them; a rank spent most of its answer's decode there.
//!
//! What is a packed shape and what is refused is [`super::unpack`]'s rule, tested against it.

use std::borrow::Cow;
use std::fmt;

use serde::de::value::StrDeserializer;
use serde::de::{
    self, DeserializeSeed, Deserializer, EnumAccess, Error as _, IntoDeserializer, MapAccess,
    SeqAccess, VariantAccess, Visitor,
};
use serde_json::Error;

use super::MARK_TUPLES;
use super::{MARK, MARK_COLUMNS, MARK_DELTA, MARK_LEN, MARK_LENGTHS, MARK_MASK, MARK_RAGGED};

/// Why packed JSON did not read as a value.
pub(super) enum Refusal {
    /// Not JSON, or not a `T`.
    Json(Error),
    /// Not one of the packed shapes (what is wrong).
    Shape(String),
}

/// `T` from packed JSON `text` (what [`super::unpack`] and `serde_json::from_value` make of it).
pub(super) fn from_packed_json<T: de::DeserializeOwned>(text: &[u8]) -> Result<T, Refusal> {
    let raw: Raw<'_> = serde_json::from_slice(text).map_err(Refusal::Json)?;
    let value = resolve(raw).map_err(Refusal::Shape)?;
    T::deserialize(Elem::Val(&value)).map_err(Refusal::Json)
}

/// JSON as parsed, before any packed shape is recognized.
enum Raw<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Big(u64),
    Float(f64),
    Str(Cow<'a, str>),
    Arr(Vec<Raw<'a>>),
    Obj(Vec<(Cow<'a, str>, Raw<'a>)>),
}

impl Raw<'_> {
    fn as_u64(&self) -> Option<u64> {
        match *self {
            Raw::Int(v) => u64::try_from(v).ok(),
            Raw::Big(v) => Some(v),
            _ => None,
        }
    }
}

impl fmt::Display for Raw<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Raw::Null => write!(f, "null"),
            Raw::Bool(v) => write!(f, "{v}"),
            Raw::Int(v) => write!(f, "{v}"),
            Raw::Big(v) => write!(f, "{v}"),
            Raw::Float(v) => write!(f, "{v}"),
            Raw::Str(v) => write!(f, "{v:?}"),
            Raw::Arr(items) => write!(f, "an array of {} values", items.len()),
            Raw::Obj(entries) => write!(f, "an object of {} keys", entries.len()),
        }
    }
}

/// Borrows a string from the text where it has no escapes.
struct CowStr<'a>(Cow<'a, str>);

impl<'de> de::Deserialize<'de> for CowStr<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct CowVisitor;
        impl<'de> Visitor<'de> for CowVisitor {
            type Value = CowStr<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<CowStr<'de>, E> {
                Ok(CowStr(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<CowStr<'de>, E> {
                Ok(CowStr(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<CowStr<'de>, E> {
                Ok(CowStr(Cow::Owned(v)))
            }
        }
        deserializer.deserialize_str(CowVisitor)
    }
}

impl<'de> de::Deserialize<'de> for Raw<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct RawVisitor;
        impl<'de> Visitor<'de> for RawVisitor {
            type Value = Raw<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_unit<E>(self) -> Result<Raw<'de>, E> {
                Ok(Raw::Null)
            }
            fn visit_bool<E>(self, v: bool) -> Result<Raw<'de>, E> {
                Ok(Raw::Bool(v))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Raw<'de>, E> {
                Ok(Raw::Int(v))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Raw<'de>, E> {
                Ok(i64::try_from(v).map_or(Raw::Big(v), Raw::Int))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Raw<'de>, E> {
                Ok(Raw::Float(v))
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Raw<'de>, E> {
                Ok(Raw::Str(Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Raw<'de>, E> {
                Ok(Raw::Str(Cow::Owned(v.to_string())))
            }
            fn visit_string<E>(self, v: String) -> Result<Raw<'de>, E> {
                Ok(Raw::Str(Cow::Owned(v)))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Raw<'de>, A::Error> {
                let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(4096));
                while let Some(item) = seq.next_element()? {
                    items.push(item);
                }
                Ok(Raw::Arr(items))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Raw<'de>, A::Error> {
                let mut entries: Vec<(Cow<'de, str>, Raw<'de>)> = Vec::new();
                while let Some(CowStr(key)) = map.next_key()? {
                    entries.push((key, map.next_value()?));
                }
                // Sorted as a `serde_json::Map` iterates: the value route sees fields in this
                // order, and so does this one.
                Ok(Raw::Obj(sorted_last_wins(entries)))
            }
        }
        deserializer.deserialize_any(RawVisitor)
    }
}

/// A value with its packed shapes recognized ([`super::unpack`]'s result, columns kept).
enum Val<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Big(u64),
    Float(f64),
    Str(Cow<'a, str>),
    Obj(Vec<(Cow<'a, str>, Val<'a>)>),
    Arr(Col<'a>),
}

/// An array, as columns where it was packed as columns.
enum Col<'a> {
    Plain(Vec<Val<'a>>),
    Ints(Vec<i64>),
    /// `len` records; a field's value of record i is its column's `rows[i]`th (all records have
    /// it when `rows` is `None`; `u32::MAX`: record i lacks it).
    Records {
        len: usize,
        fields: Vec<Field<'a>>,
    },
    Tuples {
        len: usize,
        columns: Vec<Col<'a>>,
    },
    /// Item i is elements `starts[i]..starts[i + 1]` of `flat`.
    Ragged {
        starts: Vec<usize>,
        flat: Box<Col<'a>>,
    },
}

struct Field<'a> {
    key: Cow<'a, str>,
    column: Col<'a>,
    rows: Option<Vec<u32>>,
}

const ABSENT: u32 = u32::MAX;

impl Field<'_> {
    fn row(&self, i: usize) -> Option<usize> {
        match &self.rows {
            None => Some(i),
            Some(rows) => rows.get(i).filter(|&&r| r != ABSENT).map(|&r| r as usize),
        }
    }
}

impl<'a> Col<'a> {
    fn len(&self) -> usize {
        match self {
            Col::Plain(items) => items.len(),
            Col::Ints(ints) => ints.len(),
            Col::Records { len, .. } | Col::Tuples { len, .. } => *len,
            Col::Ragged { starts, .. } => starts.len().saturating_sub(1),
        }
    }

    /// Element `i` (`i < self.len()`).
    fn at<'b>(&'b self, i: usize) -> Elem<'b, 'a> {
        match self {
            Col::Plain(items) => Elem::Val(&items[i]),
            Col::Ints(ints) => Elem::Int(ints[i]),
            Col::Records { fields, .. } => Elem::Row(fields, i),
            Col::Tuples { columns, .. } => Elem::Tuple(columns, i),
            Col::Ragged { starts, flat } => Elem::Slice(flat, starts[i], starts[i + 1]),
        }
    }

    /// Element `i` as an unsigned integer, if it is one.
    fn u64_at(&self, i: usize) -> Option<u64> {
        match self.at(i) {
            Elem::Int(v) | Elem::Val(&Val::Int(v)) => u64::try_from(v).ok(),
            Elem::Val(&Val::Big(v)) => Some(v),
            _ => None,
        }
    }
}

fn unescape(key: Cow<'_, str>) -> Cow<'_, str> {
    match key {
        Cow::Borrowed(text) => Cow::Borrowed(text.strip_prefix(MARK).unwrap_or(text)),
        Cow::Owned(text) => match text.strip_prefix(MARK) {
            Some(rest) => Cow::Owned(rest.to_string()),
            None => Cow::Owned(text),
        },
    }
}

/// [`super::unpack`], keeping columns.
fn resolve(raw: Raw<'_>) -> Result<Val<'_>, String> {
    Ok(match raw {
        Raw::Null => Val::Null,
        Raw::Bool(v) => Val::Bool(v),
        Raw::Int(v) => Val::Int(v),
        Raw::Big(v) => Val::Big(v),
        Raw::Float(v) => Val::Float(v),
        Raw::Str(v) => Val::Str(v),
        Raw::Arr(items) => Val::Arr(Col::Plain(
            items.into_iter().map(resolve).collect::<Result<_, _>>()?,
        )),
        Raw::Obj(entries) => resolve_object(entries)?,
    })
}

fn take<'a>(entries: &mut Vec<(Cow<'a, str>, Raw<'a>)>, key: &str) -> Option<Raw<'a>> {
    let at = entries.iter().position(|(k, _)| k == key)?;
    Some(entries.remove(at).1)
}

fn has(entries: &[(Cow<'_, str>, Raw<'_>)], key: &str) -> bool {
    entries.iter().any(|(k, _)| k == key)
}

/// [`super::unpack_object`].
fn resolve_object<'a>(mut map: Vec<(Cow<'a, str>, Raw<'a>)>) -> Result<Val<'a>, String> {
    if map.len() == 1
        && let Some(steps) = take(&mut map, MARK_DELTA)
    {
        let Raw::Arr(steps) = steps else {
            return Err("differences that are not an array".to_string());
        };
        return Ok(Val::Arr(Col::Ints(undelta(steps)?)));
    }
    if map.len() == 2 && has(&map, MARK_RAGGED) && has(&map, MARK_LENGTHS) {
        let flat = take(&mut map, MARK_RAGGED).unwrap_or(Raw::Null);
        let lengths = take(&mut map, MARK_LENGTHS).unwrap_or(Raw::Null);
        return ragged(flat, lengths);
    }
    let len = map
        .iter()
        .find(|(k, _)| k == MARK_LEN)
        .and_then(|(_, v)| v.as_u64());
    if let Some(len) = len {
        let len = usize::try_from(len).map_err(|_| format!("{len} records"))?;
        if map.len() == 2 && has(&map, MARK_TUPLES) {
            return match take(&mut map, MARK_TUPLES) {
                Some(Raw::Arr(columns)) => tuples(columns, len),
                other => Err(format!(
                    "tuples that are not columns: {}",
                    other.unwrap_or(Raw::Null)
                )),
            };
        }
        let masked = has(&map, MARK_MASK);
        if map.len() == 2 + usize::from(masked) && has(&map, MARK_COLUMNS) {
            let Some(Raw::Obj(columns)) = take(&mut map, MARK_COLUMNS) else {
                return Err("records whose columns are not an object".to_string());
            };
            let masks = match take(&mut map, MARK_MASK) {
                Some(Raw::Obj(masks)) => masks,
                None => Vec::new(),
                Some(other) => return Err(format!("record masks that are not an object: {other}")),
            };
            return records(columns, masks, len);
        }
    }
    let entries = map
        .into_iter()
        .map(|(key, value)| Ok((unescape(key), resolve(value)?)))
        .collect::<Result<Vec<_>, String>>()?;
    Ok(Val::Obj(sorted_last_wins(entries)))
}

/// Entries sorted by key, of a key given twice the last: what a `serde_json::Map` built by
/// inserting them in order iterates.
fn sorted_last_wins<'a, V>(mut entries: Vec<(Cow<'a, str>, V)>) -> Vec<(Cow<'a, str>, V)> {
    if entries.windows(2).all(|pair| pair[0].0 < pair[1].0) {
        return entries;
    }
    // Stable: of equal keys the last given stays last.
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out: Vec<(Cow<'a, str>, V)> = Vec::with_capacity(entries.len());
    for entry in entries {
        match out.last_mut() {
            Some(last) if last.0 == entry.0 => *last = entry,
            _ => out.push(entry),
        }
    }
    out
}

/// [`super::undelta`].
fn undelta(steps: Vec<Raw<'_>>) -> Result<Vec<i64>, String> {
    let mut previous = 0i128;
    steps
        .into_iter()
        .map(|step| {
            let step = match &step {
                Raw::Int(v) => Some(i128::from(*v)),
                Raw::Big(v) => Some(i128::from(*v)),
                Raw::Str(text) => text.parse::<i128>().ok(),
                _ => None,
            }
            .ok_or_else(|| format!("a difference {step} that is not an integer"))?;
            previous = previous
                .checked_add(step)
                .ok_or_else(|| format!("an integer past {previous} out of range"))?;
            i64::try_from(previous).map_err(|_| format!("an integer {previous} out of range"))
        })
        .collect()
}

/// [`super::column`]: `values` must unpack to an array of `len` values.
fn column<'a>(values: Raw<'a>, len: usize, what: &str) -> Result<Col<'a>, String> {
    match resolve(values)? {
        Val::Arr(column) if column.len() == len => Ok(column),
        Val::Arr(column) => Err(format!(
            "{what}: a column that is not {len} values: {} values",
            column.len()
        )),
        _ => Err(format!(
            "{what}: a column that is not {len} values: not an array"
        )),
    }
}

/// [`super::records`].
fn records<'a>(
    columns: Vec<(Cow<'a, str>, Raw<'a>)>,
    mut masks: Vec<(Cow<'a, str>, Raw<'a>)>,
    len: usize,
) -> Result<Val<'a>, String> {
    let mut fields: Vec<Field<'a>> = Vec::with_capacity(columns.len());
    for (key, values) in columns {
        let (rows, count) = match take(&mut masks, &key) {
            Some(mask) => {
                let mask = match resolve(mask)? {
                    Val::Arr(mask) if mask.len() == len => mask,
                    _ => return Err(format!("a mask that is not {len} values")),
                };
                let mut count = 0u32;
                let rows: Vec<u32> = (0..len)
                    .map(|i| {
                        if mask.u64_at(i) == Some(1) {
                            count += 1;
                            count - 1
                        } else {
                            ABSENT
                        }
                    })
                    .collect();
                (Some(rows), count as usize)
            }
            None => (None, len),
        };
        let key = unescape(key);
        let column = column(values, count, &key)?;
        // Two keys that unescape alike: the later stays, as a map's insert keeps it.
        fields.retain(|field| field.key != key);
        fields.push(Field { key, column, rows });
    }
    if let Some((key, _)) = masks.first() {
        return Err(format!("a mask for {key}, which has no column"));
    }
    // A record's fields in key order, as a map of its values would iterate them.
    fields.sort_by(|a, b| a.key.cmp(&b.key));
    Ok(Val::Arr(Col::Records { len, fields }))
}

/// [`super::tuples`].
fn tuples(columns: Vec<Raw<'_>>, len: usize) -> Result<Val<'_>, String> {
    let columns = columns
        .into_iter()
        .map(|values| column(values, len, "tuples"))
        .collect::<Result<_, _>>()?;
    Ok(Val::Arr(Col::Tuples { len, columns }))
}

/// [`super::ragged`].
fn ragged<'a>(flat: Raw<'a>, lengths: Raw<'a>) -> Result<Val<'a>, String> {
    let Val::Arr(lengths) = resolve(lengths)? else {
        return Err("ragged lengths that are not an array".to_string());
    };
    let mut starts = Vec::with_capacity(lengths.len() + 1);
    let mut total = 0usize;
    starts.push(0);
    for i in 0..lengths.len() {
        let len = lengths
            .u64_at(i)
            .and_then(|len| usize::try_from(len).ok())
            .ok_or("ragged lengths that are not counts")?;
        total = total
            .checked_add(len)
            .ok_or("ragged lengths that add up past any array")?;
        starts.push(total);
    }
    let flat = column(flat, total, "ragged arrays")?;
    Ok(Val::Arr(Col::Ragged {
        starts,
        flat: Box::new(flat),
    }))
}

/// One value to deserialize: a value, or element i of a column.
#[derive(Clone, Copy)]
enum Elem<'b, 'a> {
    Val(&'b Val<'a>),
    Int(i64),
    /// Record i of columns.
    Row(&'b [Field<'a>], usize),
    /// Tuple i of columns.
    Tuple(&'b [Col<'a>], usize),
    /// Elements `[start, end)` of a column.
    Slice(&'b Col<'a>, usize, usize),
}

impl<'de> Deserializer<'de> for Elem<'_, '_> {
    type Error = Error;

    fn deserialize_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self {
            Elem::Val(value) => match value {
                Val::Null => visitor.visit_unit(),
                Val::Bool(v) => visitor.visit_bool(*v),
                Val::Int(v) => Elem::Int(*v).deserialize_any(visitor),
                Val::Big(v) => visitor.visit_u64(*v),
                Val::Float(v) => visitor.visit_f64(*v),
                Val::Str(v) => visitor.visit_str(v),
                Val::Obj(entries) => {
                    let mut access = ObjAccess {
                        entries: entries.iter(),
                        value: None,
                    };
                    let value = visitor.visit_map(&mut access)?;
                    finished(
                        access.entries.len(),
                        entries.len(),
                        "fewer keys in the object",
                    )?;
                    Ok(value)
                }
                Val::Arr(col) => Elem::Slice(col, 0, col.len()).deserialize_any(visitor),
            },
            // As `serde_json::Value` hands integers out: non-negative ones as u64.
            Elem::Int(v) => match u64::try_from(v) {
                Ok(v) => visitor.visit_u64(v),
                Err(_) => visitor.visit_i64(v),
            },
            Elem::Row(fields, row) => {
                let mut access = RowAccess {
                    fields: fields.iter(),
                    row,
                    value: None,
                };
                visitor.visit_map(&mut access)
            }
            Elem::Tuple(columns, row) => {
                let mut access = TupleAccess {
                    columns: columns.iter(),
                    row,
                };
                let value = visitor.visit_seq(&mut access)?;
                finished(
                    access.columns.len(),
                    columns.len(),
                    "fewer elements in array",
                )?;
                Ok(value)
            }
            Elem::Slice(col, start, end) => {
                let mut access = SliceAccess {
                    col,
                    next: start,
                    end,
                };
                let value = visitor.visit_seq(&mut access)?;
                finished(end - access.next, end - start, "fewer elements in array")?;
                Ok(value)
            }
        }
    }

    fn deserialize_option<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        match self {
            Elem::Val(Val::Null) => visitor.visit_none(),
            other => visitor.visit_some(other),
        }
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        visitor: V,
    ) -> Result<V::Value, Error> {
        visitor.visit_newtype_struct(self)
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        match self {
            Elem::Val(Val::Str(variant)) => {
                let unit: StrDeserializer<'_, Error> = variant.as_ref().into_deserializer();
                visitor.visit_enum(unit)
            }
            Elem::Val(Val::Obj(entries)) if entries.len() == 1 => {
                let (variant, value) = &entries[0];
                visitor.visit_enum(Variant {
                    variant: variant.as_ref(),
                    value: Elem::Val(value),
                })
            }
            Elem::Row(fields, row) => {
                let mut present = fields
                    .iter()
                    .filter_map(|field| field.row(row).map(|at| (field, at)));
                match (present.next(), present.next()) {
                    (Some((field, at)), None) => visitor.visit_enum(Variant {
                        variant: field.key.as_ref(),
                        value: field.column.at(at),
                    }),
                    _ => Err(Error::custom(
                        "expected an enum: an object with one key or a string",
                    )),
                }
            }
            _ => Err(Error::custom(
                "expected an enum: an object with one key or a string",
            )),
        }
    }

    fn deserialize_ignored_any<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, Error> {
        visitor.visit_unit()
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes byte_buf
        unit unit_struct seq tuple tuple_struct map struct identifier
    }
}

/// Refuses elements or keys a visitor left unread (as `serde_json::Value` does).
fn finished(left: usize, len: usize, expected: &'static str) -> Result<(), Error> {
    if left == 0 {
        Ok(())
    } else {
        Err(Error::invalid_length(len, &expected))
    }
}

struct ObjAccess<'b, 'a> {
    entries: std::slice::Iter<'b, (Cow<'a, str>, Val<'a>)>,
    value: Option<&'b Val<'a>>,
}

impl<'de> MapAccess<'de> for ObjAccess<'_, '_> {
    type Error = Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        let Some((key, value)) = self.entries.next() else {
            return Ok(None);
        };
        self.value = Some(value);
        let key: StrDeserializer<'_, Error> = key.as_ref().into_deserializer();
        seed.deserialize(key).map(Some)
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let value = self
            .value
            .take()
            .ok_or_else(|| Error::custom("a value asked for before its key"))?;
        seed.deserialize(Elem::Val(value))
    }
    fn size_hint(&self) -> Option<usize> {
        Some(self.entries.len())
    }
}

struct RowAccess<'b, 'a> {
    fields: std::slice::Iter<'b, Field<'a>>,
    row: usize,
    value: Option<Elem<'b, 'a>>,
}

impl<'de> MapAccess<'de> for RowAccess<'_, '_> {
    type Error = Error;
    fn next_key_seed<K: DeserializeSeed<'de>>(
        &mut self,
        seed: K,
    ) -> Result<Option<K::Value>, Error> {
        for field in self.fields.by_ref() {
            if let Some(at) = field.row(self.row) {
                self.value = Some(field.column.at(at));
                let key: StrDeserializer<'_, Error> = field.key.as_ref().into_deserializer();
                return seed.deserialize(key).map(Some);
            }
        }
        Ok(None)
    }
    fn next_value_seed<V: DeserializeSeed<'de>>(&mut self, seed: V) -> Result<V::Value, Error> {
        let value = self
            .value
            .take()
            .ok_or_else(|| Error::custom("a value asked for before its key"))?;
        seed.deserialize(value)
    }
}

struct TupleAccess<'b, 'a> {
    columns: std::slice::Iter<'b, Col<'a>>,
    row: usize,
}

impl<'de> SeqAccess<'de> for TupleAccess<'_, '_> {
    type Error = Error;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        match self.columns.next() {
            Some(column) => seed.deserialize(column.at(self.row)).map(Some),
            None => Ok(None),
        }
    }
    fn size_hint(&self) -> Option<usize> {
        Some(self.columns.len())
    }
}

struct SliceAccess<'b, 'a> {
    col: &'b Col<'a>,
    next: usize,
    end: usize,
}

impl<'de> SeqAccess<'de> for SliceAccess<'_, '_> {
    type Error = Error;
    fn next_element_seed<T: DeserializeSeed<'de>>(
        &mut self,
        seed: T,
    ) -> Result<Option<T::Value>, Error> {
        if self.next >= self.end {
            return Ok(None);
        }
        let at = self.next;
        self.next += 1;
        seed.deserialize(self.col.at(at)).map(Some)
    }
    fn size_hint(&self) -> Option<usize> {
        Some(self.end - self.next)
    }
}

/// An enum's variant and its content.
struct Variant<'k, 'b, 'a> {
    variant: &'k str,
    value: Elem<'b, 'a>,
}

impl<'de, 'k, 'b, 'a> EnumAccess<'de> for Variant<'k, 'b, 'a> {
    type Error = Error;
    type Variant = Elem<'b, 'a>;
    fn variant_seed<V: DeserializeSeed<'de>>(
        self,
        seed: V,
    ) -> Result<(V::Value, Elem<'b, 'a>), Error> {
        let key: StrDeserializer<'_, Error> = self.variant.into_deserializer();
        Ok((seed.deserialize(key)?, self.value))
    }
}

impl<'de> VariantAccess<'de> for Elem<'_, '_> {
    type Error = Error;
    fn unit_variant(self) -> Result<(), Error> {
        de::Deserialize::deserialize(self)
    }
    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, Error> {
        seed.deserialize(self)
    }
    fn tuple_variant<V: Visitor<'de>>(self, _len: usize, visitor: V) -> Result<V::Value, Error> {
        self.deserialize_any(visitor)
    }
    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, Error> {
        self.deserialize_any(visitor)
    }
}
