//! A pickle virtual machine of our own: it executes the opcodes of protocols 0–5 into a graph of
//! plain values and never runs code. `GLOBAL`/`STACK_GLOBAL` yield a [`Obj::Global`] name, `REDUCE`
//! and `NEWOBJ` yield an [`Obj::Instance`] that records the callable and its arguments, `BUILD`
//! stores the state on it, and persistent ids stay [`Obj::PersistentId`]. What an instance *means*
//! (a `torch.Size`, a dataclass, `_rebuild_tensor_v2`) is decided by the reader of the result.
//!
//! Objects live in an arena ([`Pickle::obj`]) and values refer to them by id, so the memo shares
//! them the way Python does (an object is memoized before it is filled, then filled in place) and
//! `BINGET` is O(1): no value is ever deep-copied, which keeps "billion laughs" inputs linear.
//!
//! The input is untrusted: its size, the mark nesting, the stack, the memo, the number of
//! objects and the bytes they take are capped ([`Limits`]), all arithmetic is checked, and every
//! failure is an error that names the byte offset, never a panic.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;

/// Caps on what one pickle may make the VM do.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Largest input accepted, in bytes.
    pub max_input: usize,
    /// Deepest `MARK` nesting (Python's own recursion limit is 1000; real metadata nests < 20).
    pub max_depth: usize,
    /// Most values on the stack at once (the pickler batches dict and list items by 1000).
    pub max_stack: usize,
    /// Most memo entries.
    pub max_memo: usize,
    /// Most objects (tuples, lists, dicts, instances, ...) created.
    pub max_objects: usize,
    /// Most bytes the values built may take: each object's own size, its items, the memo's
    /// slots, and the length of every str, bytes and long int. An object count alone does not
    /// bound memory: one-byte opcodes build objects of tens of bytes, and a list can grow by
    /// 24 bytes per two input bytes.
    pub max_bytes: u64,
}

impl Limits {
    /// Caps for a DCP `.metadata` file. A 1 GiB pickle describes millions of chunks (about 300
    /// bytes and a dozen objects each, roughly a KiB once built); the byte cap keeps what the VM
    /// builds under 4 GiB whatever the input (the object cap alone allowed about 17 GB).
    pub const METADATA: Limits = Limits {
        max_input: 1 << 30,
        max_depth: 1000,
        max_stack: 1 << 20,
        max_memo: 1 << 27,
        max_objects: 1 << 26,
        max_bytes: 4 << 30,
    };

    /// Caps for a `data.pkl` of a torch.save blob: a tensor's is ~160 bytes, a Python value's
    /// (optimizer param groups, configs) a few KiB.
    pub const BLOB: Limits = Limits {
        max_input: 16 << 20,
        max_depth: 1000,
        max_stack: 1 << 20,
        max_memo: 1 << 20,
        max_objects: 1 << 20,
        max_bytes: 256 << 20,
    };
}

impl Default for Limits {
    fn default() -> Self {
        Limits::METADATA
    }
}

/// Why a pickle could not be executed: the byte offset of the opcode and what went wrong.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PickleError {
    /// Offset of the failing opcode in the input.
    pub offset: usize,
    /// What went wrong.
    pub detail: String,
}

impl fmt::Display for PickleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "pickle byte {}: {}", self.offset, self.detail)
    }
}

impl std::error::Error for PickleError {}

/// Id of an object in [`Pickle`]'s arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ObjId(u32);

/// A value on the VM's stack or inside an object. Immutable scalars inline, everything else a
/// reference into the arena.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An int that fits 64 bits.
    Int(i64),
    /// A longer int: little-endian two's complement bytes, as `LONG1`/`LONG4` carry them.
    BigInt(Arc<[u8]>),
    /// A float.
    Float(f64),
    /// A str.
    Str(Arc<str>),
    /// A bytes (or bytearray) object.
    Bytes(Arc<[u8]>),
    /// Any other object.
    Ref(ObjId),
}

/// How an [`Instance`] came to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Creation {
    /// `NEWOBJ`/`NEWOBJ_EX`/`OBJ`/`INST`: `cls.__new__(cls, *args)`.
    New,
    /// `REDUCE`: `callable(*args)`.
    Call,
}

/// The record of a class instantiation or a call: what would have run, with what.
#[derive(Clone, Debug, PartialEq)]
pub struct Instance {
    /// The class or callable (normally a [`Obj::Global`]).
    pub class: Value,
    /// How it was created.
    pub creation: Creation,
    /// Positional arguments.
    pub args: Vec<Value>,
    /// Keyword arguments (`NEWOBJ_EX`).
    pub kwargs: Vec<(Value, Value)>,
    /// The `BUILD` state, if any (a later `BUILD` of two dicts merges them).
    pub state: Option<Value>,
    /// Items `SETITEM(S)` put into it (e.g. an `OrderedDict()`).
    pub items: Vec<(Value, Value)>,
    /// Items `APPEND(S)` added to it.
    pub appended: Vec<Value>,
}

/// An object in the arena.
#[derive(Clone, Debug, PartialEq)]
pub enum Obj {
    /// A tuple.
    Tuple(Vec<Value>),
    /// A list.
    List(Vec<Value>),
    /// A dict, in insertion order; a repeated key keeps its first position and its last value.
    Dict(Vec<(Value, Value)>),
    /// A set or frozenset.
    Set(Vec<Value>),
    /// A global name (`module.name`), never imported.
    Global {
        /// Module.
        module: Arc<str>,
        /// Qualified name inside the module.
        name: Arc<str>,
    },
    /// A class instance or a call's result (boxed: most objects are small tuples and strings).
    Instance(Box<Instance>),
    /// A persistent id (`PERSID`/`BINPERSID`): a reference the pickler resolved out of band.
    PersistentId(Value),
}

/// The executed pickle: the arena and the value `STOP` returned.
#[derive(Clone, Debug)]
pub struct Pickle {
    objects: Vec<Obj>,
    root: Value,
}

impl Pickle {
    /// The pickled value.
    pub fn root(&self) -> &Value {
        &self.root
    }

    /// The object `value` refers to (`None` for scalars).
    pub fn obj(&self, value: &Value) -> Option<&Obj> {
        match value {
            Value::Ref(id) => self.objects.get(id.0 as usize),
            _ => None,
        }
    }

    /// Number of objects created.
    pub fn num_objects(&self) -> usize {
        self.objects.len()
    }

    /// `(module, name)` when `value` is a global.
    pub fn global(&self, value: &Value) -> Option<(&str, &str)> {
        match self.obj(value)? {
            Obj::Global { module, name } => Some((module, name)),
            _ => None,
        }
    }

    /// The instance `value` refers to.
    pub fn instance(&self, value: &Value) -> Option<&Instance> {
        match self.obj(value)? {
            Obj::Instance(instance) => Some(instance),
            _ => None,
        }
    }

    /// `(module, name)` of the class (or callable) of the instance `value` refers to.
    pub fn class_of(&self, value: &Value) -> Option<(&str, &str)> {
        self.global(&self.instance(value)?.class)
    }

    /// The items of a tuple or list.
    pub fn sequence(&self, value: &Value) -> Option<&[Value]> {
        match self.obj(value)? {
            Obj::Tuple(items) | Obj::List(items) => Some(items),
            _ => None,
        }
    }

    /// A `torch.Size` (an instance whose first argument is the tuple), tuple or list of
    /// non-negative ints; `None` for anything else.
    pub fn uints(&self, value: &Value) -> Option<Vec<u64>> {
        let items = match self.sequence(value) {
            Some(items) => items,
            None => match self.instance(value)?.args.first() {
                None => &[][..],
                Some(arg) => self.sequence(arg)?,
            },
        };
        items
            .iter()
            .map(|v| match v {
                Value::Int(i) if *i >= 0 => Some(*i as u64),
                _ => None,
            })
            .collect()
    }

    /// The pairs of a dict.
    pub fn dict(&self, value: &Value) -> Option<&[(Value, Value)]> {
        match self.obj(value)? {
            Obj::Dict(pairs) => Some(pairs),
            _ => None,
        }
    }

    /// A short description of a value for error messages: `int 3`, `str 'x'`, `dict`,
    /// `torch.Size instance`.
    pub fn describe(&self, value: &Value) -> String {
        match value {
            Value::None => "None".to_string(),
            Value::Bool(b) => format!("bool {}", if *b { "True" } else { "False" }),
            Value::Int(i) => format!("int {i}"),
            Value::BigInt(_) => "long int".to_string(),
            Value::Float(f) => format!("float {f}"),
            Value::Str(s) => {
                let short: String = s.chars().take(40).collect();
                format!("str {short:?}")
            }
            Value::Bytes(b) => format!("bytes of length {}", b.len()),
            Value::Ref(_) => match self.obj(value) {
                Some(Obj::Tuple(items)) => format!("tuple of {}", items.len()),
                Some(Obj::List(items)) => format!("list of {}", items.len()),
                Some(Obj::Dict(pairs)) => format!("dict of {}", pairs.len()),
                Some(Obj::Set(items)) => format!("set of {}", items.len()),
                Some(Obj::Global { module, name }) => format!("global {module}.{name}"),
                Some(Obj::Instance(instance)) => match self.global(&instance.class) {
                    Some((module, name)) => format!("{module}.{name} instance"),
                    None => "instance of a non-global".to_string(),
                },
                Some(Obj::PersistentId(_)) => "persistent id".to_string(),
                None => "dangling reference".to_string(),
            },
        }
    }
}

/// Executes `data` and returns the pickled value. Fails on anything malformed, truncated, over
/// `limits`, or that would need code (extension registry, out-of-band buffers).
pub fn unpickle(data: &[u8], limits: &Limits) -> std::result::Result<Pickle, PickleError> {
    if data.len() > limits.max_input {
        return Err(PickleError {
            offset: 0,
            detail: format!(
                "input of {} bytes exceeds the {}-byte cap",
                data.len(),
                limits.max_input
            ),
        });
    }
    let mut vm = Vm {
        data,
        pos: 0,
        op_start: 0,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: Vec::new(),
        memo_sparse: HashMap::new(),
        memo_count: 0,
        objects: Vec::new(),
        built: 0,
        limits,
    };
    let root = vm.run()?;
    Ok(Pickle {
        objects: vm.objects,
        root,
    })
}

mod op {
    pub const MARK: u8 = b'(';
    pub const STOP: u8 = b'.';
    pub const POP: u8 = b'0';
    pub const POP_MARK: u8 = b'1';
    pub const DUP: u8 = b'2';
    pub const FLOAT: u8 = b'F';
    pub const INT: u8 = b'I';
    pub const BININT: u8 = b'J';
    pub const BININT1: u8 = b'K';
    pub const LONG: u8 = b'L';
    pub const BININT2: u8 = b'M';
    pub const NONE: u8 = b'N';
    pub const PERSID: u8 = b'P';
    pub const BINPERSID: u8 = b'Q';
    pub const REDUCE: u8 = b'R';
    pub const STRING: u8 = b'S';
    pub const BINSTRING: u8 = b'T';
    pub const SHORT_BINSTRING: u8 = b'U';
    pub const UNICODE: u8 = b'V';
    pub const BINUNICODE: u8 = b'X';
    pub const APPEND: u8 = b'a';
    pub const BUILD: u8 = b'b';
    pub const GLOBAL: u8 = b'c';
    pub const DICT: u8 = b'd';
    pub const EMPTY_DICT: u8 = b'}';
    pub const APPENDS: u8 = b'e';
    pub const GET: u8 = b'g';
    pub const BINGET: u8 = b'h';
    pub const INST: u8 = b'i';
    pub const LONG_BINGET: u8 = b'j';
    pub const LIST: u8 = b'l';
    pub const EMPTY_LIST: u8 = b']';
    pub const OBJ: u8 = b'o';
    pub const PUT: u8 = b'p';
    pub const BINPUT: u8 = b'q';
    pub const LONG_BINPUT: u8 = b'r';
    pub const SETITEM: u8 = b's';
    pub const TUPLE: u8 = b't';
    pub const EMPTY_TUPLE: u8 = b')';
    pub const SETITEMS: u8 = b'u';
    pub const BINFLOAT: u8 = b'G';
    pub const PROTO: u8 = 0x80;
    pub const NEWOBJ: u8 = 0x81;
    pub const EXT1: u8 = 0x82;
    pub const EXT2: u8 = 0x83;
    pub const EXT4: u8 = 0x84;
    pub const TUPLE1: u8 = 0x85;
    pub const TUPLE2: u8 = 0x86;
    pub const TUPLE3: u8 = 0x87;
    pub const NEWTRUE: u8 = 0x88;
    pub const NEWFALSE: u8 = 0x89;
    pub const LONG1: u8 = 0x8a;
    pub const LONG4: u8 = 0x8b;
    pub const BINBYTES: u8 = b'B';
    pub const SHORT_BINBYTES: u8 = b'C';
    pub const SHORT_BINUNICODE: u8 = 0x8c;
    pub const BINUNICODE8: u8 = 0x8d;
    pub const BINBYTES8: u8 = 0x8e;
    pub const EMPTY_SET: u8 = 0x8f;
    pub const ADDITEMS: u8 = 0x90;
    pub const FROZENSET: u8 = 0x91;
    pub const NEWOBJ_EX: u8 = 0x92;
    pub const STACK_GLOBAL: u8 = 0x93;
    pub const MEMOIZE: u8 = 0x94;
    pub const FRAME: u8 = 0x95;
    pub const BYTEARRAY8: u8 = 0x96;
    pub const NEXT_BUFFER: u8 = 0x97;
    pub const READONLY_BUFFER: u8 = 0x98;
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    op_start: usize,
    stack: Vec<Value>,
    marks: Vec<usize>,
    /// Memo slots 0..n written in order (what picklers do), `None` for a gap.
    memo: Vec<Option<Value>>,
    /// Memo slots written out of order, far past the dense part.
    memo_sparse: HashMap<u32, Value>,
    memo_count: usize,
    objects: Vec<Obj>,
    /// Bytes of the values built so far (see [`Limits::max_bytes`]).
    built: u64,
    limits: &'a Limits,
}

type Result<T> = std::result::Result<T, PickleError>;

/// Bytes of a value inside an object or the memo.
const VALUE: usize = std::mem::size_of::<Value>();

/// Bytes an `Arc<str>`/`Arc<[u8]>` allocation adds to its contents (the two reference counts).
const ARC_HEADER: usize = 16;

impl Vm<'_> {
    fn fail<T>(&self, detail: impl Into<String>) -> Result<T> {
        Err(PickleError {
            offset: self.op_start,
            detail: detail.into(),
        })
    }

    /// Counts `bytes` more of built values against [`Limits::max_bytes`].
    fn charge(&mut self, bytes: usize) -> Result<()> {
        self.built = self.built.saturating_add(bytes as u64);
        if self.built > self.limits.max_bytes {
            return self.fail(format!(
                "the values built take more than the {}-byte cap (counting objects, their items, memo slots and string lengths)",
                self.limits.max_bytes
            ));
        }
        Ok(())
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&[u8]> {
        let Some(end) = self.pos.checked_add(n).filter(|&e| e <= self.data.len()) else {
            return self.fail(format!(
                "truncated: {what} needs {n} bytes but {} remain",
                self.data.len() - self.pos
            ));
        };
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1, "a 1-byte argument")?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2, "a 2-byte argument")?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4, "a 4-byte argument")?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8, "an 8-byte argument")?;
        let mut le = [0u8; 8];
        le.copy_from_slice(b);
        Ok(u64::from_le_bytes(le))
    }

    /// A text line (protocol 0 arguments), without its `\n`.
    fn line(&mut self) -> Result<&str> {
        let rest = &self.data[self.pos..];
        let Some(n) = rest.iter().position(|&b| b == b'\n') else {
            return self.fail("truncated: a text argument has no end of line");
        };
        self.pos += n + 1;
        match std::str::from_utf8(&rest[..n]) {
            Ok(text) => Ok(text),
            Err(_) => self.fail("a text argument is not UTF-8"),
        }
    }

    /// The text line of `len` bytes that [`Self::line`] just read (it is UTF-8: checked there).
    fn line_before(&self, len: usize) -> &str {
        let start = self.pos - 1 - len;
        std::str::from_utf8(&self.data[start..start + len]).unwrap_or_default()
    }

    fn sized(&mut self, n: u64, what: &str) -> Result<&[u8]> {
        let Ok(n) = usize::try_from(n) else {
            return self.fail(format!("{what} of {n} bytes is too long"));
        };
        self.take(n, what)
    }

    fn string(&mut self, n: u64) -> Result<Value> {
        let bytes = self.sized(n, "a string")?.len();
        self.charge(bytes + ARC_HEADER)?;
        let bytes = &self.data[self.pos - bytes..self.pos];
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Value::Str(Arc::from(s))),
            Err(e) => self.fail(format!("a string is not UTF-8 ({e})")),
        }
    }

    fn bytes(&mut self, n: u64) -> Result<Value> {
        let len = self.sized(n, "a bytes object")?.len();
        self.charge(len + ARC_HEADER)?;
        Ok(Value::Bytes(Arc::from(
            &self.data[self.pos - len..self.pos],
        )))
    }

    fn push(&mut self, value: Value) -> Result<()> {
        if self.stack.len() >= self.limits.max_stack {
            return self.fail(format!(
                "more than {} values on the stack",
                self.limits.max_stack
            ));
        }
        self.stack.push(value);
        Ok(())
    }

    fn pop(&mut self) -> Result<Value> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return self.fail("stack underflow");
        }
        match self.stack.pop() {
            Some(value) => Ok(value),
            None => self.fail("stack underflow"),
        }
    }

    fn top_mut(&mut self) -> Result<&mut Value> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return self.fail("stack underflow");
        }
        match self.stack.last_mut() {
            Some(value) => Ok(value),
            None => Err(PickleError {
                offset: self.op_start,
                detail: "stack underflow".to_string(),
            }),
        }
    }

    fn pop_mark(&mut self) -> Result<Vec<Value>> {
        let Some(mark) = self.marks.pop() else {
            return self.fail("no MARK to pop to");
        };
        Ok(self.stack.split_off(mark.min(self.stack.len())))
    }

    fn alloc(&mut self, obj: Obj) -> Result<Value> {
        if self.objects.len() >= self.limits.max_objects {
            return self.fail(format!("more than {} objects", self.limits.max_objects));
        }
        let items = match &obj {
            Obj::Tuple(v) | Obj::List(v) | Obj::Set(v) => v.capacity() * VALUE,
            Obj::Dict(v) => v.capacity() * 2 * VALUE,
            Obj::Global { module, name } => module.len() + name.len() + 2 * ARC_HEADER,
            Obj::Instance(i) => {
                std::mem::size_of::<Instance>()
                    + i.args.capacity() * VALUE
                    + i.kwargs.capacity() * 2 * VALUE
            }
            Obj::PersistentId(_) => 0,
        };
        self.charge(std::mem::size_of::<Obj>() + items)?;
        let id = ObjId(self.objects.len() as u32);
        self.objects.push(obj);
        Ok(Value::Ref(id))
    }

    fn obj_mut(&mut self, value: &Value) -> Option<&mut Obj> {
        match value {
            Value::Ref(id) => self.objects.get_mut(id.0 as usize),
            _ => None,
        }
    }

    fn memo_put(&mut self, index: u64, value: Value) -> Result<()> {
        let Ok(index) = u32::try_from(index) else {
            return self.fail(format!("memo index {index} is too large"));
        };
        let i = index as usize;
        let new = if i < self.memo.len() {
            self.memo[i].replace(value).is_none()
        } else if i == self.memo.len() && self.memo_sparse.is_empty() {
            self.memo.push(Some(value));
            true
        } else {
            self.memo_sparse.insert(index, value).is_none()
        };
        if new {
            // A dense slot is one value; a sparse one a hash map entry (key, value, control).
            self.charge(if i < self.memo.len() {
                VALUE
            } else {
                2 * VALUE
            })?;
            self.memo_count += 1;
            if self.memo_count > self.limits.max_memo {
                return self.fail(format!("more than {} memo entries", self.limits.max_memo));
            }
        }
        Ok(())
    }

    fn memo_get(&mut self, index: u64) -> Result<()> {
        let found = u32::try_from(index).ok().and_then(|i| {
            self.memo
                .get(i as usize)
                .and_then(Option::as_ref)
                .or_else(|| self.memo_sparse.get(&i))
                .cloned()
        });
        match found {
            Some(value) => self.push(value),
            None => self.fail(format!("memo index {index} was never stored")),
        }
    }

    fn int_from_le(&mut self, bytes: &[u8]) -> Value {
        if bytes.is_empty() {
            return Value::Int(0);
        }
        if bytes.len() <= 8 {
            let negative = bytes[bytes.len() - 1] & 0x80 != 0;
            let mut le = [if negative { 0xff } else { 0 }; 8];
            le[..bytes.len()].copy_from_slice(bytes);
            return Value::Int(i64::from_le_bytes(le));
        }
        Value::BigInt(Arc::from(bytes))
    }

    /// [`Self::int_from_le`], counting a long int's bytes.
    fn charged_int(&mut self, bytes_at: std::ops::Range<usize>) -> Result<Value> {
        if bytes_at.len() > 8 {
            self.charge(bytes_at.len() + ARC_HEADER)?;
        }
        let data = self.data;
        Ok(self.int_from_le(&data[bytes_at]))
    }

    /// A protocol 0 decimal int (`INT`/`LONG`). Wider than 64 bits is refused: the binary
    /// protocols DCP uses carry those as `LONG1` ([`Value::BigInt`]).
    fn decimal_int(&mut self, text: &str) -> Result<Value> {
        let text = text.trim().trim_end_matches('L');
        match text.parse::<i64>() {
            Ok(i) => Ok(Value::Int(i)),
            Err(_) => self.fail(format!("{text:?} is not a 64-bit integer")),
        }
    }

    fn global(&mut self, module: &str, name: &str) -> Result<Value> {
        self.alloc(Obj::Global {
            module: Arc::from(module),
            name: Arc::from(name),
        })
    }

    fn tuple(&mut self, items: Vec<Value>) -> Result<Value> {
        self.alloc(Obj::Tuple(items))
    }

    fn instance(
        &mut self,
        class: Value,
        creation: Creation,
        args: Vec<Value>,
        kwargs: Vec<(Value, Value)>,
    ) -> Result<Value> {
        self.alloc(Obj::Instance(Box::new(Instance {
            class,
            creation,
            args,
            kwargs,
            state: None,
            items: Vec::new(),
            appended: Vec::new(),
        })))
    }

    /// The items of a tuple value (arguments of `REDUCE`/`NEWOBJ`).
    fn tuple_items(&self, value: &Value, what: &str) -> Result<Vec<Value>> {
        match value {
            Value::Ref(id) => match self.objects.get(id.0 as usize) {
                Some(Obj::Tuple(items)) | Some(Obj::List(items)) => Ok(items.clone()),
                _ => self.fail(format!("{what} are not a tuple")),
            },
            _ => self.fail(format!("{what} are not a tuple")),
        }
    }

    fn set_items(&mut self, target: &Value, pairs: Vec<(Value, Value)>) -> Result<()> {
        self.charge(pairs.len() * 2 * VALUE)?;
        match self.obj_mut(target) {
            Some(Obj::Dict(existing)) => {
                for (key, value) in pairs {
                    // Python dicts keep one entry per key; real pickles never repeat one, so a
                    // linear check only on small dicts keeps this O(n) for the big ones.
                    if existing.len() <= 64
                        && let Some(slot) = existing.iter_mut().find(|(k, _)| *k == key)
                    {
                        slot.1 = value;
                    } else {
                        existing.push((key, value));
                    }
                }
                Ok(())
            }
            Some(Obj::Instance(instance)) => {
                instance.items.extend(pairs);
                Ok(())
            }
            _ => self.fail("SETITEM on something that is not a dict"),
        }
    }

    fn append_items(&mut self, target: &Value, items: Vec<Value>) -> Result<()> {
        self.charge(items.len() * VALUE)?;
        match self.obj_mut(target) {
            Some(Obj::List(existing)) => {
                existing.extend(items);
                Ok(())
            }
            Some(Obj::Instance(instance)) => {
                instance.appended.extend(items);
                Ok(())
            }
            _ => self.fail("APPEND on something that is not a list"),
        }
    }

    fn add_items(&mut self, target: &Value, items: Vec<Value>) -> Result<()> {
        self.charge(items.len() * VALUE)?;
        match self.obj_mut(target) {
            Some(Obj::Set(existing)) => {
                existing.extend(items);
                Ok(())
            }
            Some(Obj::Instance(instance)) => {
                instance.appended.extend(items);
                Ok(())
            }
            _ => self.fail("ADDITEMS on something that is not a set"),
        }
    }

    fn obj_ref(&self, value: &Value) -> Option<&Obj> {
        match value {
            Value::Ref(id) => self.objects.get(id.0 as usize),
            _ => None,
        }
    }

    fn build(&mut self, target: &Value, state: Value) -> Result<()> {
        let previous = match self.obj_ref(target) {
            Some(Obj::Instance(instance)) => instance.state.clone(),
            _ => return self.fail("BUILD on something that is not an instance"),
        };
        // A second dict state merges into the first (what `__dict__.update` does); anything else
        // replaces it.
        if let Some(previous) = previous
            && previous != state
            && matches!(self.obj_ref(&previous), Some(Obj::Dict(_)))
            && let Some(Obj::Dict(pairs)) = self.obj_ref(&state)
        {
            let pairs = pairs.clone();
            return self.set_items(&previous, pairs);
        }
        if let Some(Obj::Instance(instance)) = self.obj_mut(target) {
            instance.state = Some(state);
        }
        Ok(())
    }

    fn run(&mut self) -> Result<Value> {
        loop {
            self.op_start = self.pos;
            let Some(&opcode) = self.data.get(self.pos) else {
                return self.fail("truncated: no STOP opcode");
            };
            self.pos += 1;
            match opcode {
                op::PROTO => {
                    let version = self.u8()?;
                    if version > 5 {
                        return self.fail(format!("unsupported pickle protocol {version}"));
                    }
                }
                op::FRAME => {
                    // Frames only group opcodes for buffered reading; their content follows.
                    let n = self.u64()?;
                    if n > (self.data.len() - self.pos) as u64 {
                        return self.fail(format!("frame of {n} bytes runs past the end"));
                    }
                }
                op::STOP => {
                    let value = self.pop()?;
                    return Ok(value);
                }
                op::MARK => {
                    if self.marks.len() >= self.limits.max_depth {
                        return self.fail(format!(
                            "MARKs nested deeper than {}",
                            self.limits.max_depth
                        ));
                    }
                    self.marks.push(self.stack.len());
                }
                op::POP => {
                    if self.marks.last() == Some(&self.stack.len()) {
                        // Popping a bare mark, as Python does.
                        self.marks.pop();
                    } else {
                        self.pop()?;
                    }
                }
                op::POP_MARK => {
                    self.pop_mark()?;
                }
                op::DUP => {
                    let top = self.top_mut()?.clone();
                    self.push(top)?;
                }
                op::NONE => self.push(Value::None)?,
                op::NEWTRUE => self.push(Value::Bool(true))?,
                op::NEWFALSE => self.push(Value::Bool(false))?,
                op::BININT => {
                    let v = self.u32()? as i32;
                    self.push(Value::Int(i64::from(v)))?;
                }
                op::BININT1 => {
                    let v = self.u8()?;
                    self.push(Value::Int(i64::from(v)))?;
                }
                op::BININT2 => {
                    let v = self.u16()?;
                    self.push(Value::Int(i64::from(v)))?;
                }
                op::LONG1 => {
                    let n = self.u8()?;
                    let start = self.pos;
                    self.take(n as usize, "a LONG1")?;
                    let v = self.charged_int(start..self.pos)?;
                    self.push(v)?;
                }
                op::LONG4 => {
                    let n = self.u32()? as i32;
                    if n < 0 {
                        return self.fail("LONG4 with a negative length");
                    }
                    let start = self.pos;
                    self.take(n as usize, "a LONG4")?;
                    let v = self.charged_int(start..self.pos)?;
                    self.push(v)?;
                }
                op::INT => {
                    let text = self.line()?.to_string();
                    let v = match text.as_str() {
                        "00" => Value::Bool(false),
                        "01" => Value::Bool(true),
                        _ => self.decimal_int(&text)?,
                    };
                    self.push(v)?;
                }
                op::LONG => {
                    let text = self.line()?.to_string();
                    let v = self.decimal_int(&text)?;
                    self.push(v)?;
                }
                op::FLOAT => {
                    let text = self.line()?.trim().to_string();
                    match text.parse::<f64>() {
                        Ok(f) => self.push(Value::Float(f))?,
                        Err(_) => return self.fail(format!("{text:?} is not a float")),
                    }
                }
                op::BINFLOAT => {
                    let b = self.take(8, "a BINFLOAT")?;
                    let mut be = [0u8; 8];
                    be.copy_from_slice(b);
                    self.push(Value::Float(f64::from_be_bytes(be)))?;
                }
                op::SHORT_BINUNICODE => {
                    let n = self.u8()?;
                    let v = self.string(u64::from(n))?;
                    self.push(v)?;
                }
                op::BINUNICODE => {
                    let n = self.u32()?;
                    let v = self.string(u64::from(n))?;
                    self.push(v)?;
                }
                op::BINUNICODE8 => {
                    let n = self.u64()?;
                    let v = self.string(n)?;
                    self.push(v)?;
                }
                op::SHORT_BINBYTES => {
                    let n = self.u8()?;
                    let v = self.bytes(u64::from(n))?;
                    self.push(v)?;
                }
                op::BINBYTES => {
                    let n = self.u32()?;
                    let v = self.bytes(u64::from(n))?;
                    self.push(v)?;
                }
                op::BINBYTES8 | op::BYTEARRAY8 => {
                    let n = self.u64()?;
                    let v = self.bytes(n)?;
                    self.push(v)?;
                }
                op::SHORT_BINSTRING => {
                    // Python 2 str: text when it decodes, bytes otherwise.
                    let n = self.u8()?;
                    let v = self.py2_string(u64::from(n))?;
                    self.push(v)?;
                }
                op::BINSTRING => {
                    let n = self.u32()? as i32;
                    if n < 0 {
                        return self.fail("BINSTRING with a negative length");
                    }
                    let v = self.py2_string(n as u64)?;
                    self.push(v)?;
                }
                op::STRING | op::UNICODE => {
                    return self.fail(format!(
                        "text string opcode {:?} (protocol 0) is not supported",
                        opcode as char
                    ));
                }
                op::EMPTY_TUPLE => {
                    let v = self.tuple(Vec::new())?;
                    self.push(v)?;
                }
                op::TUPLE1 | op::TUPLE2 | op::TUPLE3 => {
                    let n = (opcode - op::TUPLE1 + 1) as usize;
                    let mut items = vec![Value::None; n];
                    for slot in items.iter_mut().rev() {
                        *slot = self.pop()?;
                    }
                    let v = self.tuple(items)?;
                    self.push(v)?;
                }
                op::TUPLE => {
                    let items = self.pop_mark()?;
                    let v = self.tuple(items)?;
                    self.push(v)?;
                }
                op::EMPTY_LIST => {
                    let v = self.alloc(Obj::List(Vec::new()))?;
                    self.push(v)?;
                }
                op::LIST => {
                    let items = self.pop_mark()?;
                    let v = self.alloc(Obj::List(items))?;
                    self.push(v)?;
                }
                op::EMPTY_DICT => {
                    let v = self.alloc(Obj::Dict(Vec::new()))?;
                    self.push(v)?;
                }
                op::DICT => {
                    let items = self.pop_mark()?;
                    let pairs =
                        pairs(items).or_else(|()| self.fail("DICT with an odd number of items"))?;
                    let v = self.alloc(Obj::Dict(Vec::new()))?;
                    self.set_items(&v, pairs)?;
                    self.push(v)?;
                }
                op::EMPTY_SET => {
                    let v = self.alloc(Obj::Set(Vec::new()))?;
                    self.push(v)?;
                }
                op::FROZENSET => {
                    let items = self.pop_mark()?;
                    let v = self.alloc(Obj::Set(items))?;
                    self.push(v)?;
                }
                op::APPEND => {
                    let item = self.pop()?;
                    let target = self.top_mut()?.clone();
                    self.append_items(&target, vec![item])?;
                }
                op::APPENDS => {
                    let items = self.pop_mark()?;
                    let target = self.top_mut()?.clone();
                    self.append_items(&target, items)?;
                }
                op::ADDITEMS => {
                    let items = self.pop_mark()?;
                    let target = self.top_mut()?.clone();
                    self.add_items(&target, items)?;
                }
                op::SETITEM => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let target = self.top_mut()?.clone();
                    self.set_items(&target, vec![(key, value)])?;
                }
                op::SETITEMS => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(items)
                        .or_else(|()| self.fail("SETITEMS with an odd number of items"))?;
                    let target = self.top_mut()?.clone();
                    self.set_items(&target, pairs)?;
                }
                op::GLOBAL => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    let v = self.global(&module, &name)?;
                    self.push(v)?;
                }
                op::STACK_GLOBAL => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Value::Str(module), Value::Str(name)) = (module, name) else {
                        return self.fail("STACK_GLOBAL needs two strings");
                    };
                    let v = self.global(&module, &name)?;
                    self.push(v)?;
                }
                op::REDUCE => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let args = self.tuple_items(&args, "REDUCE arguments")?;
                    let v = self.instance(callable, Creation::Call, args, Vec::new())?;
                    self.push(v)?;
                }
                op::NEWOBJ => {
                    let args = self.pop()?;
                    let class = self.pop()?;
                    let args = self.tuple_items(&args, "NEWOBJ arguments")?;
                    let v = self.instance(class, Creation::New, args, Vec::new())?;
                    self.push(v)?;
                }
                op::NEWOBJ_EX => {
                    let kwargs = self.pop()?;
                    let args = self.pop()?;
                    let class = self.pop()?;
                    let args = self.tuple_items(&args, "NEWOBJ_EX arguments")?;
                    let kwargs = match self.obj_mut(&kwargs) {
                        Some(Obj::Dict(pairs)) => pairs.clone(),
                        _ => return self.fail("NEWOBJ_EX keyword arguments are not a dict"),
                    };
                    let v = self.instance(class, Creation::New, args, kwargs)?;
                    self.push(v)?;
                }
                op::OBJ => {
                    let mut items = self.pop_mark()?;
                    if items.is_empty() {
                        return self.fail("OBJ without a class");
                    }
                    let class = items.remove(0);
                    let v = self.instance(class, Creation::New, items, Vec::new())?;
                    self.push(v)?;
                }
                op::INST => {
                    let module = self.line()?.to_string();
                    let name = self.line()?.to_string();
                    let args = self.pop_mark()?;
                    let class = self.global(&module, &name)?;
                    let v = self.instance(class, Creation::New, args, Vec::new())?;
                    self.push(v)?;
                }
                op::BUILD => {
                    let state = self.pop()?;
                    let target = self.top_mut()?.clone();
                    self.build(&target, state)?;
                }
                op::PERSID => {
                    let len = self.line()?.len();
                    self.charge(len + ARC_HEADER)?;
                    let id = Value::Str(Arc::from(self.line_before(len)));
                    let v = self.alloc(Obj::PersistentId(id))?;
                    self.push(v)?;
                }
                op::BINPERSID => {
                    let id = self.pop()?;
                    let v = self.alloc(Obj::PersistentId(id))?;
                    self.push(v)?;
                }
                op::MEMOIZE => {
                    let top = self.top_mut()?.clone();
                    let index = self.memo_count as u64;
                    self.memo_put(index, top)?;
                }
                op::BINPUT => {
                    let index = self.u8()?;
                    let top = self.top_mut()?.clone();
                    self.memo_put(u64::from(index), top)?;
                }
                op::LONG_BINPUT => {
                    let index = self.u32()?;
                    let top = self.top_mut()?.clone();
                    self.memo_put(u64::from(index), top)?;
                }
                op::PUT => {
                    let text = self.line()?.trim().to_string();
                    let Ok(index) = text.parse::<u64>() else {
                        return self.fail(format!("PUT index {text:?} is not a number"));
                    };
                    let top = self.top_mut()?.clone();
                    self.memo_put(index, top)?;
                }
                op::BINGET => {
                    let index = self.u8()?;
                    self.memo_get(u64::from(index))?;
                }
                op::LONG_BINGET => {
                    let index = self.u32()?;
                    self.memo_get(u64::from(index))?;
                }
                op::GET => {
                    let text = self.line()?.trim().to_string();
                    let Ok(index) = text.parse::<u64>() else {
                        return self.fail(format!("GET index {text:?} is not a number"));
                    };
                    self.memo_get(index)?;
                }
                op::READONLY_BUFFER => {
                    self.top_mut()?;
                }
                op::EXT1 | op::EXT2 | op::EXT4 => {
                    return self.fail("extension registry opcodes (EXT1/2/4) are not supported");
                }
                op::NEXT_BUFFER => {
                    return self.fail("out-of-band buffers (NEXT_BUFFER) are not supported");
                }
                other => {
                    return self.fail(format!("unknown opcode 0x{other:02x}"));
                }
            }
        }
    }

    fn py2_string(&mut self, n: u64) -> Result<Value> {
        let bytes = self.sized(n, "a string")?;
        Ok(match std::str::from_utf8(bytes) {
            Ok(s) => Value::Str(Arc::from(s)),
            Err(_) => Value::Bytes(Arc::from(bytes)),
        })
    }
}

fn pairs(items: Vec<Value>) -> std::result::Result<Vec<(Value, Value)>, ()> {
    if !items.len().is_multiple_of(2) {
        return Err(());
    }
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut iter = items.into_iter();
    while let (Some(key), Some(value)) = (iter.next(), iter.next()) {
        out.push((key, value));
    }
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn memo_shares_objects_filled_after_memoizing() {
        // [EMPTY_DICT MEMOIZE MARK 'a' 1 SETITEMS] then BINGET 0 in a tuple: the dict seen
        // through the memo has the item.
        let data = b"\x80\x04}\x94(\x8c\x01a\x94K\x01u0h\x00\x85.";
        let p = unpickle(data, &Limits::default()).unwrap();
        let items = p.sequence(p.root()).unwrap();
        let pairs = p.dict(&items[0]).unwrap();
        assert_eq!(pairs[0], (Value::Str(Arc::from("a")), Value::Int(1)));
    }

    #[test]
    fn globals_are_never_imported() {
        let data = b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00ls\x85R.";
        let p = unpickle(data, &Limits::default()).unwrap();
        assert_eq!(p.class_of(p.root()), Some(("os", "system")));
    }

    #[test]
    fn truncation_and_unknown_opcodes_name_the_offset() {
        let err = unpickle(b"\x80\x04\x8c\x05ab", &Limits::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pickle byte 2: truncated: a string needs 5 bytes but 2 remain"
        );
        let err = unpickle(b"\x80\x04\xff.", &Limits::default()).unwrap_err();
        assert_eq!(err.to_string(), "pickle byte 2: unknown opcode 0xff");
    }

    #[test]
    fn limits_hold() {
        let deep = [b'('; 2000];
        let err = unpickle(&deep, &Limits::default()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pickle byte 1000: MARKs nested deeper than 1000"
        );
        let limits = Limits {
            max_input: 4,
            ..Limits::default()
        };
        let err = unpickle(b"N.....", &limits).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pickle byte 0: input of 6 bytes exceeds the 4-byte cap"
        );
    }

    #[test]
    fn long1_sign_extends() {
        let p = unpickle(b"\x8a\x02\xff\x7f.", &Limits::default()).unwrap();
        assert_eq!(p.root(), &Value::Int(0x7fff));
        let p = unpickle(b"\x8a\x01\xff.", &Limits::default()).unwrap();
        assert_eq!(p.root(), &Value::Int(-1));
    }

    /// A list grown by `EMPTY_TUPLE APPEND` pairs: two input bytes build an object and a list
    /// slot each, far more than two bytes.
    fn amplifying(pairs: usize) -> Vec<u8> {
        let mut data = b"\x80\x04]".to_vec();
        for _ in 0..pairs {
            data.extend_from_slice(b")a");
        }
        data.push(b'.');
        data
    }

    #[test]
    fn the_byte_cap_bounds_what_small_opcodes_build() {
        let data = amplifying(100_000);
        let limits = Limits {
            max_bytes: 1 << 20,
            ..Limits::default()
        };
        // Far under the object cap, yet over the byte cap: the bytes built are what is bounded.
        assert!(100_000 < limits.max_objects);
        let err = unpickle(&data, &limits).unwrap_err();
        assert!(
            err.detail
                .contains("the values built take more than the 1048576-byte cap"),
            "{err}"
        );
        // Each pair builds at least an object and a slot: the cap is hit well before the end.
        let per_pair = std::mem::size_of::<Obj>() + VALUE;
        assert!(err.offset <= 3 + 2 * ((1 << 20) / per_pair + 1), "{err}");
        // The default cap leaves it alone.
        let p = unpickle(&data, &Limits::default()).unwrap();
        assert_eq!(p.sequence(p.root()).map(<[Value]>::len), Some(100_000));
    }

    #[test]
    fn the_byte_cap_counts_string_lengths() {
        // One 2 MiB str: a single object, but 2 MiB built.
        let mut data = b"\x80\x04X".to_vec();
        data.extend_from_slice(&(2u32 << 20).to_le_bytes());
        data.extend(std::iter::repeat_n(b'x', 2 << 20));
        data.push(b'.');
        let limits = Limits {
            max_bytes: 1 << 20,
            ..Limits::default()
        };
        let err = unpickle(&data, &limits).unwrap_err();
        assert!(err.detail.contains("1048576-byte cap"), "{err}");
    }

    #[test]
    fn a_metadata_file_over_the_byte_cap_is_named() {
        let limits = Limits {
            max_bytes: 1 << 20,
            ..Limits::default()
        };
        let err = crate::formats::dcp::metadata::parse_metadata(
            &amplifying(100_000),
            "run/step-1/.metadata",
            &limits,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("run/step-1/.metadata"), "{err}");
        assert!(err.contains("1048576-byte cap"), "{err}");
    }
}
