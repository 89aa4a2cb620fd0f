//! The packed form written straight from a typed value: the value is serialized once into a flat
//! tree (nodes, children and object entries in three vectors, strings in one buffer), then
//! walked once, writing the packed JSON text as [`super::pack`] would reshape it and
//! `serde_json` print it, byte for byte. The [`serde_json::Value`] route allocates a map, a key
//! and a value per field of every record, then moves each into its column: for a rank plan of a
//! million fields that allocation was nearly all of the coordinator's time.
//!
//! The text is the same as the value route's because every decision reads the same facts: an
//! object's keys sorted as a `serde_json::Map` iterates them, an integer that fits an `i64`, an
//! array's length and its items' kinds.

use serde::Serialize;
use serde::ser::{self, Error as _};
use serde_json::{Error, Value};

use super::{MARK, MARK_COLUMNS, MARK_DELTA, MARK_LEN, MARK_LENGTHS, MARK_MASK, MARK_RAGGED};
use super::{MARK_TUPLES, MAX_MESSAGE_BYTES};

/// The packed JSON text of `value` (what `serde_json::to_vec(&pack(to_value(value)))` writes).
pub(super) fn packed_json<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>, Error> {
    let mut tree = Tree::default();
    let root = value.serialize(NodeSer { tree: &mut tree })?;
    let mut writer = Writer {
        tree: &tree,
        out: Vec::with_capacity(tree.text.len() + 4 * tree.nodes.len() + 64),
    };
    writer.value(root);
    Ok(writer.out)
}

/// One serialized value. Indices are `u32`: a message is at most [`MAX_MESSAGE_BYTES`] of text,
/// and every node but an empty string's takes at least one byte of it.
#[derive(Clone, Copy, Debug)]
enum Node {
    Null,
    Bool(bool),
    /// An integer that fits an `i64` (what [`Value::as_i64`] answers for).
    Int(i64),
    /// An integer above `i64::MAX`.
    Big(u64),
    /// A finite float (`serde_json` turns the others into null).
    Float(f64),
    /// Bytes `[start, start + len)` of [`Tree::text`].
    Str(u32, u32),
    /// Children `[start, start + len)` of [`Tree::kids`].
    Arr(u32, u32),
    /// Entries `[start, start + len)` of [`Tree::entries`], sorted by key, no key twice.
    Obj(u32, u32),
}

/// An object's key: a field's name, or a map's key in [`Tree::text`].
#[derive(Clone, Copy, Debug)]
enum Key {
    Static(&'static str),
    Text(u32, u32),
}

#[derive(Default)]
struct Tree {
    nodes: Vec<Node>,
    kids: Vec<u32>,
    entries: Vec<(Key, u32)>,
    text: String,
    /// Children of the arrays being serialized, innermost last.
    open_kids: Vec<u32>,
    /// Entries of the objects being serialized, innermost last.
    open_entries: Vec<(Key, u32)>,
}

fn index(n: usize) -> Result<u32, Error> {
    u32::try_from(n).map_err(|_| {
        Error::custom(format!(
            "a message of more than {} values (at most {MAX_MESSAGE_BYTES} bytes travel)",
            u32::MAX
        ))
    })
}

impl Tree {
    fn push(&mut self, node: Node) -> Result<u32, Error> {
        let id = index(self.nodes.len())?;
        self.nodes.push(node);
        Ok(id)
    }

    fn text(&mut self, text: &str) -> Result<(u32, u32), Error> {
        let start = index(self.text.len())?;
        self.text.push_str(text);
        Ok((start, index(text.len())?))
    }

    fn key(&self, key: Key) -> &str {
        match key {
            Key::Static(name) => name,
            Key::Text(start, len) => &self.text[start as usize..(start + len) as usize],
        }
    }

    fn str(&self, start: u32, len: u32) -> &str {
        &self.text[start as usize..(start + len) as usize]
    }

    fn close_array(&mut self, mark: usize) -> Result<u32, Error> {
        let start = index(self.kids.len())?;
        let len = index(self.open_kids.len() - mark)?;
        self.kids.extend(self.open_kids.drain(mark..));
        self.push(Node::Arr(start, len))
    }

    /// The object of the entries opened since `mark`, sorted by key; of a key given twice the
    /// last value stays (as a map's insert keeps it).
    fn close_object(&mut self, mark: usize) -> Result<u32, Error> {
        let mut open = std::mem::take(&mut self.open_entries);
        let entries = &mut open[mark..];
        let sorted = entries
            .windows(2)
            .all(|pair| self.key(pair[0].0) < self.key(pair[1].0));
        if !sorted {
            // Stable: of equal keys the last given is last.
            entries.sort_by(|a, b| self.key(a.0).cmp(self.key(b.0)));
        }
        let start = index(self.entries.len())?;
        let mut drained = open.drain(mark..).peekable();
        while let Some(entry) = drained.next() {
            if drained
                .peek()
                .is_some_and(|next| self.key(next.0) == self.key(entry.0))
            {
                continue;
            }
            self.entries.push(entry);
        }
        drop(drained);
        self.open_entries = open;
        let len = index(self.entries.len())? - start;
        self.push(Node::Obj(start, len))
    }

    /// `{variant: value}`, how an enum's variant with content is written.
    fn variant(&mut self, variant: &'static str, value: u32) -> Result<u32, Error> {
        let start = index(self.entries.len())?;
        self.entries.push((Key::Static(variant), value));
        self.push(Node::Obj(start, 1))
    }
}

/// Serializes one value into the tree; `Ok` is its node.
struct NodeSer<'t> {
    tree: &'t mut Tree,
}

impl<'t> ser::Serializer for NodeSer<'t> {
    type Ok = u32;
    type Error = Error;
    type SerializeSeq = ArraySer<'t>;
    type SerializeTuple = ArraySer<'t>;
    type SerializeTupleStruct = ArraySer<'t>;
    type SerializeTupleVariant = ArraySer<'t>;
    type SerializeMap = ObjectSer<'t>;
    type SerializeStruct = ObjectSer<'t>;
    type SerializeStructVariant = ObjectSer<'t>;

    fn serialize_bool(self, v: bool) -> Result<u32, Error> {
        self.tree.push(Node::Bool(v))
    }
    fn serialize_i8(self, v: i8) -> Result<u32, Error> {
        self.serialize_i64(v.into())
    }
    fn serialize_i16(self, v: i16) -> Result<u32, Error> {
        self.serialize_i64(v.into())
    }
    fn serialize_i32(self, v: i32) -> Result<u32, Error> {
        self.serialize_i64(v.into())
    }
    fn serialize_i64(self, v: i64) -> Result<u32, Error> {
        self.tree.push(Node::Int(v))
    }
    fn serialize_i128(self, v: i128) -> Result<u32, Error> {
        match (i64::try_from(v), u64::try_from(v)) {
            (Ok(small), _) => self.serialize_i64(small),
            (_, Ok(big)) => self.serialize_u64(big),
            _ => Err(Error::custom(format!("number {v} out of range"))),
        }
    }
    fn serialize_u8(self, v: u8) -> Result<u32, Error> {
        self.serialize_i64(v.into())
    }
    fn serialize_u16(self, v: u16) -> Result<u32, Error> {
        self.serialize_i64(v.into())
    }
    fn serialize_u32(self, v: u32) -> Result<u32, Error> {
        self.serialize_i64(v.into())
    }
    fn serialize_u64(self, v: u64) -> Result<u32, Error> {
        match i64::try_from(v) {
            Ok(small) => self.serialize_i64(small),
            Err(_) => self.tree.push(Node::Big(v)),
        }
    }
    fn serialize_u128(self, v: u128) -> Result<u32, Error> {
        let big =
            u64::try_from(v).map_err(|_| Error::custom(format!("number {v} out of range")))?;
        self.serialize_u64(big)
    }
    fn serialize_f32(self, v: f32) -> Result<u32, Error> {
        // As `serde_json::Value` holds it: widened to an f64.
        self.serialize_f64(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<u32, Error> {
        self.tree.push(if v.is_finite() {
            Node::Float(v)
        } else {
            Node::Null
        })
    }
    fn serialize_char(self, v: char) -> Result<u32, Error> {
        self.serialize_str(v.encode_utf8(&mut [0; 4]))
    }
    fn serialize_str(self, v: &str) -> Result<u32, Error> {
        let (start, len) = self.tree.text(v)?;
        self.tree.push(Node::Str(start, len))
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<u32, Error> {
        let mark = self.tree.open_kids.len();
        for &byte in v {
            let id = self.tree.push(Node::Int(byte.into()))?;
            self.tree.open_kids.push(id);
        }
        self.tree.close_array(mark)
    }
    fn serialize_none(self) -> Result<u32, Error> {
        self.tree.push(Node::Null)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<u32, Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<u32, Error> {
        self.tree.push(Node::Null)
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<u32, Error> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
    ) -> Result<u32, Error> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        value: &T,
    ) -> Result<u32, Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<u32, Error> {
        let inner = value.serialize(NodeSer {
            tree: &mut *self.tree,
        })?;
        self.tree.variant(variant, inner)
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<ArraySer<'t>, Error> {
        Ok(ArraySer::open(self.tree, None))
    }
    fn serialize_tuple(self, _len: usize) -> Result<ArraySer<'t>, Error> {
        Ok(ArraySer::open(self.tree, None))
    }
    fn serialize_tuple_struct(
        self,
        _name: &'static str,
        _len: usize,
    ) -> Result<ArraySer<'t>, Error> {
        Ok(ArraySer::open(self.tree, None))
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<ArraySer<'t>, Error> {
        Ok(ArraySer::open(self.tree, Some(variant)))
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<ObjectSer<'t>, Error> {
        Ok(ObjectSer::open(self.tree, None))
    }
    fn serialize_struct(self, _name: &'static str, _len: usize) -> Result<ObjectSer<'t>, Error> {
        Ok(ObjectSer::open(self.tree, None))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<ObjectSer<'t>, Error> {
        Ok(ObjectSer::open(self.tree, Some(variant)))
    }
}

/// An array being serialized; `variant`: it is a tuple variant's content.
struct ArraySer<'t> {
    tree: &'t mut Tree,
    mark: usize,
    variant: Option<&'static str>,
}

impl<'t> ArraySer<'t> {
    fn open(tree: &'t mut Tree, variant: Option<&'static str>) -> Self {
        let mark = tree.open_kids.len();
        Self {
            tree,
            mark,
            variant,
        }
    }

    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        let id = value.serialize(NodeSer {
            tree: &mut *self.tree,
        })?;
        self.tree.open_kids.push(id);
        Ok(())
    }

    fn close(self) -> Result<u32, Error> {
        let array = self.tree.close_array(self.mark)?;
        match self.variant {
            Some(variant) => self.tree.variant(variant, array),
            None => Ok(array),
        }
    }
}

impl ser::SerializeSeq for ArraySer<'_> {
    type Ok = u32;
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<u32, Error> {
        self.close()
    }
}

impl ser::SerializeTuple for ArraySer<'_> {
    type Ok = u32;
    type Error = Error;
    fn serialize_element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<u32, Error> {
        self.close()
    }
}

impl ser::SerializeTupleStruct for ArraySer<'_> {
    type Ok = u32;
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<u32, Error> {
        self.close()
    }
}

impl ser::SerializeTupleVariant for ArraySer<'_> {
    type Ok = u32;
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        self.element(value)
    }
    fn end(self) -> Result<u32, Error> {
        self.close()
    }
}

/// An object being serialized; `variant`: it is a struct variant's content.
struct ObjectSer<'t> {
    tree: &'t mut Tree,
    mark: usize,
    variant: Option<&'static str>,
    key: Option<Key>,
}

impl<'t> ObjectSer<'t> {
    fn open(tree: &'t mut Tree, variant: Option<&'static str>) -> Self {
        let mark = tree.open_entries.len();
        Self {
            tree,
            mark,
            variant,
            key: None,
        }
    }

    fn entry<T: Serialize + ?Sized>(&mut self, key: Key, value: &T) -> Result<(), Error> {
        let id = value.serialize(NodeSer {
            tree: &mut *self.tree,
        })?;
        self.tree.open_entries.push((key, id));
        Ok(())
    }

    fn close(self) -> Result<u32, Error> {
        let object = self.tree.close_object(self.mark)?;
        match self.variant {
            Some(variant) => self.tree.variant(variant, object),
            None => Ok(object),
        }
    }
}

/// A map's key as `serde_json` writes it (strings as they are, numbers and booleans as their
/// text, anything else refused), by asking `serde_json` itself: maps are rare in messages.
fn map_key<T: Serialize + ?Sized>(key: &T) -> Result<String, Error> {
    struct OneKey<'k, K: ?Sized>(&'k K);
    impl<K: Serialize + ?Sized> Serialize for OneKey<'_, K> {
        fn serialize<S: ser::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use ser::SerializeMap;
            let mut map = serializer.serialize_map(Some(1))?;
            map.serialize_entry(self.0, &())?;
            map.end()
        }
    }
    match serde_json::to_value(OneKey(key))? {
        Value::Object(map) => map
            .into_iter()
            .next()
            .map(|(key, _)| key)
            .ok_or_else(|| Error::custom("a map key that serializes to nothing")),
        other => Err(Error::custom(format!(
            "a map key that serializes to {other}"
        ))),
    }
}

impl ser::SerializeMap for ObjectSer<'_> {
    type Ok = u32;
    type Error = Error;
    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        let text = map_key(key)?;
        let (start, len) = self.tree.text(&text)?;
        self.key = Some(Key::Text(start, len));
        Ok(())
    }
    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        let key = self
            .key
            .take()
            .ok_or_else(|| Error::custom("a map value without a key"))?;
        self.entry(key, value)
    }
    fn end(self) -> Result<u32, Error> {
        self.close()
    }
}

impl ser::SerializeStruct for ObjectSer<'_> {
    type Ok = u32;
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.entry(Key::Static(key), value)
    }
    fn end(self) -> Result<u32, Error> {
        self.close()
    }
}

impl ser::SerializeStructVariant for ObjectSer<'_> {
    type Ok = u32;
    type Error = Error;
    fn serialize_field<T: Serialize + ?Sized>(
        &mut self,
        key: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.entry(Key::Static(key), value)
    }
    fn end(self) -> Result<u32, Error> {
        self.close()
    }
}

/// Walks the tree writing [`super::pack`]'s shapes as JSON text.
struct Writer<'t> {
    tree: &'t Tree,
    out: Vec<u8>,
}

impl<'t> Writer<'t> {
    fn node(&self, id: u32) -> Node {
        self.tree.nodes[id as usize]
    }

    fn kids(&self, start: u32, len: u32) -> &'t [u32] {
        &self.tree.kids[start as usize..(start + len) as usize]
    }

    fn entries(&self, start: u32, len: u32) -> &'t [(Key, u32)] {
        &self.tree.entries[start as usize..(start + len) as usize]
    }

    fn string(&mut self, text: &str) {
        // Writing to a Vec cannot fail; serde_json escapes as its own writer does.
        let _ = serde_json::to_writer(&mut self.out, text);
    }

    /// A key as [`super::escape`] writes it.
    fn key(&mut self, key: &str) {
        if key.starts_with(MARK) {
            self.string(&format!("{MARK}{key}"));
        } else {
            self.string(key);
        }
    }

    fn integer(&mut self, value: i128) {
        let mut digits = [0u8; 40];
        let mut at = digits.len();
        let mut rest = value.unsigned_abs();
        loop {
            at -= 1;
            digits[at] = b'0' + (rest % 10) as u8;
            rest /= 10;
            if rest == 0 {
                break;
            }
        }
        if value < 0 {
            at -= 1;
            digits[at] = b'-';
        }
        self.out.extend_from_slice(&digits[at..]);
    }

    /// [`super::pack`] of one value.
    fn value(&mut self, id: u32) {
        match self.node(id) {
            Node::Null => self.out.extend_from_slice(b"null"),
            Node::Bool(true) => self.out.extend_from_slice(b"true"),
            Node::Bool(false) => self.out.extend_from_slice(b"false"),
            Node::Int(v) => self.integer(v.into()),
            Node::Big(v) => self.integer(v.into()),
            Node::Float(v) => {
                let _ = serde_json::to_writer(&mut self.out, &v);
            }
            Node::Str(start, len) => {
                let tree = self.tree;
                self.string(tree.str(start, len));
            }
            Node::Arr(start, len) => self.array(self.kids(start, len)),
            Node::Obj(start, len) => {
                self.out.push(b'{');
                for (i, &(key, value)) in self.entries(start, len).iter().enumerate() {
                    if i > 0 {
                        self.out.push(b',');
                    }
                    let tree = self.tree;
                    self.key(tree.key(key));
                    self.out.push(b':');
                    self.value(value);
                }
                self.out.push(b'}');
            }
        }
    }

    fn plain(&mut self, items: &[u32]) {
        self.out.push(b'[');
        for (i, &item) in items.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            self.value(item);
        }
        self.out.push(b']');
    }

    fn int(&self, id: u32) -> Option<i64> {
        match self.node(id) {
            Node::Int(v) => Some(v),
            _ => None,
        }
    }

    /// [`super::pack_array`]: the same tests in the same order.
    fn array(&mut self, items: &[u32]) {
        if items.len() < 2 {
            return self.plain(items);
        }
        if items.iter().all(|&item| self.int(item).is_some()) {
            let ints: Vec<i64> = items.iter().filter_map(|&item| self.int(item)).collect();
            return self.delta(&ints);
        }
        if let Some(keys) = self.record_keys(items) {
            return self.records(items, &keys);
        }
        if let Some(width) = self.tuple_width(items) {
            return self.tuples(items, width);
        }
        if items
            .iter()
            .all(|&item| matches!(self.node(item), Node::Arr(..)))
        {
            return self.ragged(items);
        }
        self.plain(items)
    }

    /// `{MARK_DELTA: [first, d1, ...]}`.
    fn delta(&mut self, ints: &[i64]) {
        self.out.push(b'{');
        self.string(MARK_DELTA);
        self.out.extend_from_slice(b":[");
        let mut previous = 0i128;
        for (i, &value) in ints.iter().enumerate() {
            if i > 0 {
                self.out.push(b',');
            }
            let step = i128::from(value) - previous;
            previous = i128::from(value);
            if step < i128::from(i64::MIN) {
                // As `super::number` writes it: JSON has no exact number below i64::MIN.
                self.out.push(b'"');
                self.integer(step);
                self.out.push(b'"');
            } else {
                self.integer(step);
            }
        }
        self.out.extend_from_slice(b"]}");
    }

    /// [`super::record_keys`]: the union of the keys, sorted, when every item is an object.
    fn record_keys(&self, items: &[u32]) -> Option<Vec<&'t str>> {
        let tree = self.tree;
        let Node::Obj(start, len) = self.node(items[0]) else {
            return None;
        };
        let mut keys: Vec<&'t str> = self
            .entries(start, len)
            .iter()
            .map(|&(key, _)| tree.key(key))
            .collect();
        let mut merged = false;
        for &item in &items[1..] {
            let Node::Obj(start, len) = self.node(item) else {
                return None;
            };
            let entries = self.entries(start, len);
            if entries.len() == keys.len()
                && entries
                    .iter()
                    .zip(&keys)
                    .all(|(&(key, _), name)| tree.key(key) == *name)
            {
                continue;
            }
            keys.extend(entries.iter().map(|&(key, _)| tree.key(key)));
            merged = true;
        }
        if merged {
            keys.sort_unstable();
            keys.dedup();
        }
        (!keys.is_empty()).then_some(keys)
    }

    /// [`super::pack_records`]: `{MARK_COLUMNS: {key: column}, MARK_MASK: {key: mask},
    /// MARK_LEN: n}` (keys in that order, as a map iterates them).
    fn records(&mut self, items: &[u32], keys: &[&str]) {
        let tree = self.tree;
        let mut columns: Vec<Vec<u32>> = keys
            .iter()
            .map(|_| Vec::with_capacity(items.len()))
            .collect();
        // Per key, which records have it; filled only once some record lacks it.
        let mut present: Vec<Vec<i64>> = keys.iter().map(|_| Vec::new()).collect();
        for (row, &item) in items.iter().enumerate() {
            let Node::Obj(start, len) = self.node(item) else {
                continue;
            };
            // Both sorted: one pass matches a record's entries to the keys.
            let mut entries = self.entries(start, len).iter().peekable();
            for (k, key) in keys.iter().enumerate() {
                let here = entries.next_if(|&&(name, _)| tree.key(name) == *key);
                match here {
                    Some(&(_, value)) => {
                        columns[k].push(value);
                        if !present[k].is_empty() {
                            present[k].push(1);
                        }
                    }
                    None => {
                        if present[k].is_empty() {
                            present[k] = vec![1; row];
                        }
                        present[k].push(0);
                    }
                }
            }
        }
        self.out.push(b'{');
        self.string(MARK_COLUMNS);
        self.out.extend_from_slice(b":{");
        for (k, (key, column)) in keys.iter().zip(&columns).enumerate() {
            if k > 0 {
                self.out.push(b',');
            }
            self.key(key);
            self.out.push(b':');
            self.array(column);
        }
        self.out.push(b'}');
        if columns.iter().any(|column| column.len() < items.len()) {
            self.out.push(b',');
            self.string(MARK_MASK);
            self.out.extend_from_slice(b":{");
            let mut first = true;
            for ((key, column), present) in keys.iter().zip(&columns).zip(&present) {
                if column.len() == items.len() {
                    continue;
                }
                if !first {
                    self.out.push(b',');
                }
                first = false;
                self.key(key);
                self.out.push(b':');
                self.delta(present);
            }
            self.out.push(b'}');
        }
        self.out.push(b',');
        self.string(MARK_LEN);
        self.out.push(b':');
        self.integer(items.len() as i128);
        self.out.push(b'}');
    }

    /// [`super::tuple_width`].
    fn tuple_width(&self, items: &[u32]) -> Option<usize> {
        let Node::Arr(_, width) = self.node(items[0]) else {
            return None;
        };
        (width > 0
            && items.iter().all(|&item| match self.node(item) {
                Node::Arr(start, len) => {
                    len == width && self.kids(start, len).iter().all(|&v| self.int(v).is_some())
                }
                _ => false,
            }))
        .then_some(width as usize)
    }

    /// `{MARK_LEN: n, MARK_TUPLES: [column, ...]}`.
    fn tuples(&mut self, items: &[u32], width: usize) {
        self.out.push(b'{');
        self.string(MARK_LEN);
        self.out.push(b':');
        self.integer(items.len() as i128);
        self.out.push(b',');
        self.string(MARK_TUPLES);
        self.out.extend_from_slice(b":[");
        for i in 0..width {
            if i > 0 {
                self.out.push(b',');
            }
            let column: Vec<i64> = items
                .iter()
                .map(|&item| match self.node(item) {
                    Node::Arr(start, _) => self.int(self.tree.kids[start as usize + i]),
                    _ => None,
                })
                .map(Option::unwrap_or_default)
                .collect();
            self.delta(&column);
        }
        self.out.extend_from_slice(b"]}");
    }

    /// `{MARK_LENGTHS: lengths, MARK_RAGGED: every item's elements}`.
    fn ragged(&mut self, items: &[u32]) {
        let mut lengths = Vec::with_capacity(items.len());
        let mut flat = Vec::new();
        for &item in items {
            if let Node::Arr(start, len) = self.node(item) {
                lengths.push(i64::from(len));
                flat.extend_from_slice(self.kids(start, len));
            }
        }
        self.out.push(b'{');
        self.string(MARK_LENGTHS);
        self.out.push(b':');
        self.delta(&lengths);
        self.out.push(b',');
        self.string(MARK_RAGGED);
        self.out.push(b':');
        self.array(&flat);
        self.out.push(b'}');
    }
}
