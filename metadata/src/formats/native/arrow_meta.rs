//! `metadata.arrow`: the checkpoint's global metadata as an Arrow IPC stream, one row per saved
//! box and one per object. Columns are built from plain vectors (no per-row builder calls or
//! allocations) and written in batches of [`BATCH_ROWS`] that share their dictionaries, so a
//! 10^7-row checkpoint encodes and decodes in a few seconds with bounded intermediate memory.
//!
//! Decoding treats the bytes as untrusted: every column's type is checked, every dictionary key
//! and list slice is bounds-checked, and every sum or product that `validate` or the planner will
//! compute later is checked for overflow here, so that malformed input is an error naming the file,
//! row and column, never a panic.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use arrow_array::types::{Int8Type, Int32Type};
use arrow_array::{
    Array, ArrayRef, DictionaryArray, Int8Array, Int32Array, ListArray, RecordBatch, StringArray,
    UInt8Array, UInt32Array, UInt64Array,
};
use arrow_buffer::{NullBuffer, OffsetBuffer, ScalarBuffer};
use arrow_ipc::reader::StreamReader;
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{DataType, Field, Schema, SchemaRef};

use crate::{
    ByteMeta, CheckpointMeta, DType, DataFile, Dims, MetadataError, ObjectMeta, SavedChunk,
    TensorBox, TensorMeta,
};

/// Rows per record batch. Large enough that per-batch overhead vanishes, small enough that the
/// encoder's column vectors for one batch stay in the tens of MiB.
const BATCH_ROWS: usize = 1 << 20;

/// Row kind of a saved tensor box.
const KIND_BOX: u8 = 0;
/// Row kind of a non-tensor object.
const KIND_OBJECT: u8 = 1;

/// Schema metadata key holding the metadata layout version.
const VERSION_KEY: &str = "tessera.metadata_version";

const WHAT: &str = "checkpoint metadata";

fn u64_list() -> DataType {
    DataType::List(Arc::new(Field::new_list_field(DataType::UInt64, false)))
}

fn dictionary(key: DataType) -> DataType {
    DataType::Dictionary(Box::new(key), Box::new(DataType::Utf8))
}

/// The schema of `metadata.arrow`.
fn schema() -> SchemaRef {
    let fields = vec![
        Field::new("kind", DataType::UInt8, false),
        Field::new("fqn", dictionary(DataType::Int32), false),
        Field::new("dtype", dictionary(DataType::Int8), true),
        Field::new("shape", u64_list(), false),
        Field::new("offsets", u64_list(), false),
        Field::new("lengths", u64_list(), false),
        Field::new("file", dictionary(DataType::Int32), false),
        Field::new("byte_offset", DataType::UInt64, false),
        Field::new("byte_length", DataType::UInt64, false),
        Field::new("strides", u64_list(), true),
        Field::new("crc32c", DataType::UInt32, true),
    ];
    let metadata = HashMap::from([(VERSION_KEY.to_string(), super::FORMAT_VERSION.to_string())]);
    Arc::new(Schema::new_with_metadata(fields, metadata))
}

fn encode_error(detail: impl std::fmt::Display) -> MetadataError {
    MetadataError::Invalid {
        what: format!("cannot encode {}: {detail}", super::METADATA_FILE),
    }
}

/// Encodes `meta` as the bytes of `metadata.arrow`. Fails when a tensor has no saved box (the
/// format describes tensors through their rows) or when the metadata is too large for one batch's
/// 32-bit list offsets.
pub fn encode_metadata(meta: &CheckpointMeta) -> Result<Vec<u8>, MetadataError> {
    for (t, tensor) in meta.tensors().iter().enumerate() {
        if meta.chunks_of(t as u32).is_empty() {
            return Err(encode_error(format_args!(
                "tensor {} has no saved box; the native format needs at least one (possibly empty) box per tensor",
                tensor.fqn
            )));
        }
    }
    let names = meta.tensors().len() + meta.objects().len();
    if i32::try_from(names).is_err() || i32::try_from(meta.files().len()).is_err() {
        return Err(encode_error("more than 2^31 names or files"));
    }
    // Dictionaries shared by every batch: the IPC writer sends a dictionary once as long as the
    // batches share the same values array.
    let fqn_values: ArrayRef = Arc::new(StringArray::from_iter_values(
        meta.tensors()
            .iter()
            .map(|t| t.fqn.as_str())
            .chain(meta.objects().iter().map(|o| o.key.as_str())),
    ));
    let dtype_values: ArrayRef = Arc::new(StringArray::from_iter_values(
        DType::ALL.iter().map(|d| d.name()),
    ));
    let file_values: ArrayRef = Arc::new(StringArray::from_iter_values(
        meta.files().iter().map(|f| f.path.as_str()),
    ));
    let dicts = Dictionaries {
        fqn: fqn_values,
        dtype: dtype_values,
        file: file_values,
    };

    let schema = schema();
    let mut writer = StreamWriter::try_new(Vec::new(), &schema).map_err(encode_error)?;
    let rows = meta.chunks().len() + meta.objects().len();
    let mut start = 0;
    loop {
        let end = (start + BATCH_ROWS).min(rows);
        let batch = encode_batch(meta, &schema, &dicts, start..end)?;
        writer.write(&batch).map_err(encode_error)?;
        start = end;
        if start >= rows {
            break;
        }
    }
    writer.finish().map_err(encode_error)?;
    writer.into_inner().map_err(encode_error)
}

struct Dictionaries {
    fqn: ArrayRef,
    dtype: ArrayRef,
    file: ArrayRef,
}

/// A `List<UInt64>` column under construction: offsets, values and (for nullable lists) validity.
#[derive(Default)]
struct ListColumn {
    offsets: Vec<i32>,
    values: Vec<u64>,
    valid: Vec<bool>,
    nulls: usize,
}

impl ListColumn {
    fn with_rows(rows: usize) -> Self {
        let mut offsets = Vec::with_capacity(rows + 1);
        offsets.push(0);
        Self {
            offsets,
            values: Vec::with_capacity(rows),
            valid: Vec::new(),
            nulls: 0,
        }
    }

    fn push(&mut self, values: Option<&[u64]>) -> Result<(), MetadataError> {
        if let Some(values) = values {
            self.values.extend_from_slice(values);
        } else {
            self.nulls += 1;
        }
        self.valid.push(values.is_some());
        let end = i32::try_from(self.values.len())
            .map_err(|_| encode_error("a list column has more than 2^31 values in one batch"))?;
        self.offsets.push(end);
        Ok(())
    }

    fn finish(self) -> Result<ArrayRef, MetadataError> {
        let nulls = (self.nulls > 0).then(|| NullBuffer::from(self.valid));
        let list = ListArray::try_new(
            Arc::new(Field::new_list_field(DataType::UInt64, false)),
            OffsetBuffer::new(ScalarBuffer::from(self.offsets)),
            Arc::new(UInt64Array::from(self.values)),
            nulls,
        )
        .map_err(encode_error)?;
        Ok(Arc::new(list))
    }
}

fn encode_batch(
    meta: &CheckpointMeta,
    schema: &SchemaRef,
    dicts: &Dictionaries,
    rows: std::ops::Range<usize>,
) -> Result<RecordBatch, MetadataError> {
    let n = rows.len();
    let n_tensors = meta.tensors().len();
    let mut kind = Vec::with_capacity(n);
    let mut fqn = Vec::with_capacity(n);
    let mut dtype = Vec::with_capacity(n);
    let mut dtype_valid = Vec::with_capacity(n);
    let mut shape = ListColumn::with_rows(n);
    let mut offsets = ListColumn::with_rows(n);
    let mut lengths = ListColumn::with_rows(n);
    let mut file = Vec::with_capacity(n);
    let mut byte_offset = Vec::with_capacity(n);
    let mut byte_length = Vec::with_capacity(n);
    let mut strides = ListColumn::with_rows(n);
    let mut crc = Vec::with_capacity(n);
    let mut crc_valid = Vec::with_capacity(n);
    let chunks = meta.chunks();
    for row in rows {
        // Rows are the chunks (grouped by tensor, in tensor order) followed by the objects.
        if let Some(chunk) = chunks.get(row) {
            let tensor = &meta.tensors()[chunk.tensor as usize];
            kind.push(KIND_BOX);
            fqn.push(chunk.tensor as i32);
            dtype.push(dtype_key(tensor.dtype));
            dtype_valid.push(true);
            shape.push(Some(&tensor.shape))?;
            offsets.push(Some(&chunk.region.offsets))?;
            lengths.push(Some(&chunk.region.lengths))?;
            file.push(chunk.bytes.file as i32);
            byte_offset.push(chunk.bytes.offset);
            byte_length.push(chunk.bytes.length);
            strides.push(chunk.bytes.strides.as_deref())?;
            crc.push(chunk.crc32c.unwrap_or(0));
            crc_valid.push(chunk.crc32c.is_some());
        } else {
            let o = row - chunks.len();
            let object = &meta.objects()[o];
            kind.push(KIND_OBJECT);
            fqn.push((n_tensors + o) as i32);
            dtype.push(0);
            dtype_valid.push(false);
            shape.push(Some(&[]))?;
            offsets.push(Some(&[]))?;
            lengths.push(Some(&[]))?;
            file.push(object.file as i32);
            byte_offset.push(object.offset);
            byte_length.push(object.length);
            strides.push(None)?;
            crc.push(object.crc32c.unwrap_or(0));
            crc_valid.push(object.crc32c.is_some());
        }
    }
    let dtype_nulls = dtype_valid
        .contains(&false)
        .then(|| NullBuffer::from(dtype_valid));
    let crc_nulls = crc_valid
        .contains(&false)
        .then(|| NullBuffer::from(crc_valid));
    let columns: Vec<ArrayRef> = vec![
        Arc::new(UInt8Array::from(kind)),
        Arc::new(
            DictionaryArray::<Int32Type>::try_new(Int32Array::from(fqn), dicts.fqn.clone())
                .map_err(encode_error)?,
        ),
        Arc::new(
            DictionaryArray::<Int8Type>::try_new(
                Int8Array::new(ScalarBuffer::from(dtype), dtype_nulls),
                dicts.dtype.clone(),
            )
            .map_err(encode_error)?,
        ),
        shape.finish()?,
        offsets.finish()?,
        lengths.finish()?,
        Arc::new(
            DictionaryArray::<Int32Type>::try_new(Int32Array::from(file), dicts.file.clone())
                .map_err(encode_error)?,
        ),
        Arc::new(UInt64Array::from(byte_offset)),
        Arc::new(UInt64Array::from(byte_length)),
        strides.finish()?,
        Arc::new(UInt32Array::new(ScalarBuffer::from(crc), crc_nulls)),
    ];
    RecordBatch::try_new(schema.clone(), columns).map_err(encode_error)
}

fn dtype_key(dtype: DType) -> i8 {
    DType::ALL.iter().position(|&d| d == dtype).unwrap_or(0) as i8
}

/// Decodes the bytes of `metadata.arrow`. `path_for_errors` names the file in errors. Bad input
/// is a [`MetadataError::Decode`] naming the file and, where one is at fault, the row and column.
/// The result is structurally sound (indices in range, no arithmetic overflow); run
/// [`crate::validate`] for the geometric checks.
pub fn decode_metadata(
    bytes: &[u8],
    path_for_errors: &str,
) -> Result<CheckpointMeta, MetadataError> {
    decode_metadata_with_sizes(bytes, path_for_errors, None)
}

/// [`decode_metadata`], with data file sizes taken from `sizes` (the manifest's); a file the
/// metadata names but `sizes` lacks is an error.
pub(crate) fn decode_metadata_with_sizes(
    bytes: &[u8],
    path_for_errors: &str,
    sizes: Option<&HashMap<&str, u64>>,
) -> Result<CheckpointMeta, MetadataError> {
    let mut decoder = Decoder::new(path_for_errors, sizes);
    let reader = StreamReader::try_new(bytes, None).map_err(|e| decoder.error(e))?;
    decoder.check_schema(&reader.schema())?;
    // Before any batch is decoded: arrow-ipc trusts the buffer descriptors it finds.
    super::ipc::check_stream(bytes, &reader.schema()).map_err(|e| decoder.error(e))?;
    for batch in reader {
        let batch = batch.map_err(|e| decoder.error(e))?;
        decoder.batch(&batch)?;
    }
    decoder.finish()
}

/// The columns of one record batch, typed.
struct Columns<'a> {
    kind: &'a UInt8Array,
    fqn_keys: &'a Int32Array,
    fqn_values: &'a StringArray,
    dtype_keys: &'a Int8Array,
    dtype_values: &'a StringArray,
    shape: &'a ListArray,
    shape_values: &'a UInt64Array,
    offsets: &'a ListArray,
    offsets_values: &'a UInt64Array,
    lengths: &'a ListArray,
    lengths_values: &'a UInt64Array,
    file_keys: &'a Int32Array,
    file_values: &'a StringArray,
    byte_offset: &'a UInt64Array,
    byte_length: &'a UInt64Array,
    strides: &'a ListArray,
    strides_values: &'a UInt64Array,
    crc32c: &'a UInt32Array,
}

struct Decoder<'p> {
    path: &'p str,
    sizes: Option<&'p HashMap<&'p str, u64>>,
    /// Global row number of the current batch's first row.
    row_base: usize,
    tensors: Vec<TensorMeta>,
    tensor_ids: HashMap<String, u32>,
    /// Sum of the element counts of each tensor's boxes; kept so that `validate`'s own sum
    /// cannot overflow.
    covered: Vec<u64>,
    total_bytes: u64,
    chunks: Vec<SavedChunk>,
    objects: Vec<ObjectMeta>,
    object_keys: HashSet<String>,
    files: Vec<DataFile>,
    file_ids: HashMap<String, u32>,
}

/// Sentinel for "dictionary entry not resolved yet".
const UNRESOLVED: u32 = u32::MAX;

impl<'p> Decoder<'p> {
    fn new(path: &'p str, sizes: Option<&'p HashMap<&'p str, u64>>) -> Self {
        Self {
            path,
            sizes,
            row_base: 0,
            tensors: Vec::new(),
            tensor_ids: HashMap::new(),
            covered: Vec::new(),
            total_bytes: 0,
            chunks: Vec::new(),
            objects: Vec::new(),
            object_keys: HashSet::new(),
            files: Vec::new(),
            file_ids: HashMap::new(),
        }
    }

    fn error(&self, detail: impl std::fmt::Display) -> MetadataError {
        MetadataError::Decode {
            path: self.path.to_string(),
            what: WHAT,
            detail: detail.to_string(),
        }
    }

    fn row_error(&self, row: usize, column: &str, detail: impl std::fmt::Display) -> MetadataError {
        self.error(format_args!(
            "row {}, column {column}: {detail}",
            self.row_base + row
        ))
    }

    fn check_schema(&self, schema: &Schema) -> Result<(), MetadataError> {
        if let Some(version) = schema.metadata().get(VERSION_KEY)
            && version != &super::FORMAT_VERSION.to_string()
        {
            return Err(self.error(format_args!(
                "metadata version {version}, this reader knows {}",
                super::FORMAT_VERSION
            )));
        }
        for expected in schema_fields() {
            let Ok(field) = schema.field_with_name(expected.name()) else {
                return Err(self.error(format_args!("no column {}", expected.name())));
            };
            if field.data_type() != expected.data_type() {
                return Err(self.error(format_args!(
                    "column {} has type {}, expected {}",
                    expected.name(),
                    field.data_type(),
                    expected.data_type()
                )));
            }
        }
        Ok(())
    }

    fn column<'b>(
        &self,
        batch: &'b RecordBatch,
        name: &str,
    ) -> Result<&'b ArrayRef, MetadataError> {
        batch
            .column_by_name(name)
            .ok_or_else(|| self.error(format_args!("no column {name}")))
    }

    fn typed<'b, T: 'static>(
        &self,
        array: &'b dyn Array,
        name: &str,
    ) -> Result<&'b T, MetadataError> {
        array
            .as_any()
            .downcast_ref::<T>()
            .ok_or_else(|| self.error(format_args!("column {name} has type {}", array.data_type())))
    }

    /// A non-nullable column must hold no null.
    fn no_nulls(&self, array: &dyn Array, name: &str) -> Result<(), MetadataError> {
        if array.null_count() == 0 {
            return Ok(());
        }
        let row = (0..array.len()).find(|&i| array.is_null(i)).unwrap_or(0);
        Err(self.row_error(row, name, "null in a column that allows none"))
    }

    fn dict<'b, K: arrow_array::types::ArrowDictionaryKeyType>(
        &self,
        batch: &'b RecordBatch,
        name: &str,
    ) -> Result<(&'b arrow_array::PrimitiveArray<K>, &'b StringArray), MetadataError> {
        let array = self.column(batch, name)?;
        let dict = self.typed::<DictionaryArray<K>>(array.as_ref(), name)?;
        let values = self.typed::<StringArray>(dict.values().as_ref(), name)?;
        if values.null_count() > 0 {
            return Err(self.error(format_args!("column {name}: null in the dictionary")));
        }
        Ok((dict.keys(), values))
    }

    fn list<'b>(
        &self,
        batch: &'b RecordBatch,
        name: &str,
    ) -> Result<(&'b ListArray, &'b UInt64Array), MetadataError> {
        let list = self.typed::<ListArray>(self.column(batch, name)?.as_ref(), name)?;
        let values = self.typed::<UInt64Array>(list.values().as_ref(), name)?;
        if values.null_count() > 0 {
            return Err(self.error(format_args!("column {name}: null list element")));
        }
        Ok((list, values))
    }

    fn columns<'b>(&self, batch: &'b RecordBatch) -> Result<Columns<'b>, MetadataError> {
        let (fqn_keys, fqn_values) = self.dict::<Int32Type>(batch, "fqn")?;
        let (dtype_keys, dtype_values) = self.dict::<Int8Type>(batch, "dtype")?;
        let (file_keys, file_values) = self.dict::<Int32Type>(batch, "file")?;
        let (shape, shape_values) = self.list(batch, "shape")?;
        let (offsets, offsets_values) = self.list(batch, "offsets")?;
        let (lengths, lengths_values) = self.list(batch, "lengths")?;
        let (strides, strides_values) = self.list(batch, "strides")?;
        let columns = Columns {
            kind: self.typed(self.column(batch, "kind")?.as_ref(), "kind")?,
            fqn_keys,
            fqn_values,
            dtype_keys,
            dtype_values,
            shape,
            shape_values,
            offsets,
            offsets_values,
            lengths,
            lengths_values,
            file_keys,
            file_values,
            byte_offset: self.typed(self.column(batch, "byte_offset")?.as_ref(), "byte_offset")?,
            byte_length: self.typed(self.column(batch, "byte_length")?.as_ref(), "byte_length")?,
            strides,
            strides_values,
            crc32c: self.typed(self.column(batch, "crc32c")?.as_ref(), "crc32c")?,
        };
        self.no_nulls(columns.kind, "kind")?;
        self.no_nulls(columns.fqn_keys, "fqn")?;
        self.no_nulls(columns.shape, "shape")?;
        self.no_nulls(columns.offsets, "offsets")?;
        self.no_nulls(columns.lengths, "lengths")?;
        self.no_nulls(columns.file_keys, "file")?;
        self.no_nulls(columns.byte_offset, "byte_offset")?;
        self.no_nulls(columns.byte_length, "byte_length")?;
        Ok(columns)
    }

    /// The `row`-th list of a `List<UInt64>` column as a slice.
    fn slice<'b>(
        &self,
        list: &ListArray,
        values: &'b UInt64Array,
        row: usize,
        name: &str,
    ) -> Result<&'b [u64], MetadataError> {
        let offsets = list.value_offsets();
        let (Some(&start), Some(&end)) = (offsets.get(row), offsets.get(row + 1)) else {
            return Err(self.row_error(row, name, "list offsets missing"));
        };
        let (Ok(start), Ok(end)) = (usize::try_from(start), usize::try_from(end)) else {
            return Err(self.row_error(row, name, "negative list offset"));
        };
        values
            .values()
            .get(start..end)
            .ok_or_else(|| self.row_error(row, name, "list offsets outside the values"))
    }

    fn batch(&mut self, batch: &RecordBatch) -> Result<(), MetadataError> {
        let c = self.columns(batch)?;
        // Per-batch caches from dictionary keys to tensor, dtype and file ids, filled on first use
        // so that each dictionary entry is looked up once per batch, not once per row.
        let mut tensor_of_key = vec![UNRESOLVED; c.fqn_values.len()];
        let mut dtype_of_key: Vec<Option<DType>> = vec![None; c.dtype_values.len()];
        let mut file_of_key = Vec::with_capacity(c.file_values.len());
        for path in c.file_values.iter().flatten() {
            file_of_key.push(self.file_id(path)?);
        }
        for row in 0..batch.num_rows() {
            let name_key = c.fqn_keys.value(row);
            let Some(name_index) = usize::try_from(name_key)
                .ok()
                .filter(|&k| k < c.fqn_values.len())
            else {
                return Err(self.row_error(
                    row,
                    "fqn",
                    format_args!("dictionary key {name_key} out of range"),
                ));
            };
            let file_key = c.file_keys.value(row);
            let Some(&file) = usize::try_from(file_key)
                .ok()
                .and_then(|k| file_of_key.get(k))
            else {
                return Err(self.row_error(
                    row,
                    "file",
                    format_args!("dictionary key {file_key} out of range"),
                ));
            };
            let offset = c.byte_offset.value(row);
            let length = c.byte_length.value(row);
            if offset.checked_add(length).is_none() {
                return Err(self.row_error(
                    row,
                    "byte_length",
                    format_args!("byte range {offset} + {length} overflows"),
                ));
            }
            let crc32c = c.crc32c.is_valid(row).then(|| c.crc32c.value(row));
            match c.kind.value(row) {
                KIND_BOX => {
                    let tensor = match tensor_of_key[name_index] {
                        UNRESOLVED => {
                            let dtype = self.row_dtype(&c, &mut dtype_of_key, row)?;
                            let shape = self.slice(c.shape, c.shape_values, row, "shape")?;
                            let id =
                                self.tensor_id(c.fqn_values.value(name_index), dtype, shape, row)?;
                            tensor_of_key[name_index] = id;
                            id
                        }
                        id => id,
                    };
                    self.box_row(&c, &mut dtype_of_key, row, tensor, file, crc32c)?;
                }
                KIND_OBJECT => {
                    let key = c.fqn_values.value(name_index);
                    if !self.object_keys.insert(key.to_string()) {
                        return Err(self.row_error(
                            row,
                            "fqn",
                            format_args!("object {key} appears twice"),
                        ));
                    }
                    self.objects.push(ObjectMeta {
                        key: key.to_string(),
                        file,
                        offset,
                        length,
                        crc32c,
                    });
                }
                other => {
                    return Err(self.row_error(
                        row,
                        "kind",
                        format_args!(
                            "kind {other} is neither {KIND_BOX} (box) nor {KIND_OBJECT} (object)"
                        ),
                    ));
                }
            }
        }
        self.row_base += batch.num_rows();
        Ok(())
    }

    fn row_dtype(
        &self,
        c: &Columns<'_>,
        cache: &mut [Option<DType>],
        row: usize,
    ) -> Result<DType, MetadataError> {
        if c.dtype_keys.is_null(row) {
            return Err(self.row_error(row, "dtype", "a tensor box needs a dtype"));
        }
        let key = c.dtype_keys.value(row);
        let Some(slot) = usize::try_from(key).ok().and_then(|k| cache.get_mut(k)) else {
            return Err(self.row_error(
                row,
                "dtype",
                format_args!("dictionary key {key} out of range"),
            ));
        };
        if let Some(dtype) = *slot {
            return Ok(dtype);
        }
        let name = c.dtype_values.value(key as usize);
        let dtype = DType::parse(name).map_err(|e| self.row_error(row, "dtype", e))?;
        *slot = Some(dtype);
        Ok(dtype)
    }

    fn file_id(&mut self, path: &str) -> Result<u32, MetadataError> {
        if let Some(&id) = self.file_ids.get(path) {
            return Ok(id);
        }
        let id = u32::try_from(self.files.len()).map_err(|_| self.error("more than 2^32 files"))?;
        let size = match self.sizes {
            None => None,
            Some(sizes) => match sizes.get(path) {
                Some(&size) => Some(size),
                None => {
                    return Err(self.error(format_args!(
                        "data file {path} is not listed in the manifest"
                    )));
                }
            },
        };
        self.files.push(DataFile {
            path: path.to_string(),
            size,
            encoded: None,
        });
        self.file_ids.insert(path.to_string(), id);
        Ok(id)
    }

    fn tensor_id(
        &mut self,
        fqn: &str,
        dtype: DType,
        shape: &[u64],
        row: usize,
    ) -> Result<u32, MetadataError> {
        if let Some(&id) = self.tensor_ids.get(fqn) {
            return Ok(id);
        }
        let nbytes = shape
            .iter()
            .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| {
                self.row_error(
                    row,
                    "shape",
                    format_args!(
                        "tensor {fqn}: shape {} of {dtype} overflows 64-bit byte counts",
                        crate::shape_to_string(shape)
                    ),
                )
            })?;
        self.total_bytes = self
            .total_bytes
            .checked_add(nbytes)
            .ok_or_else(|| self.row_error(row, "shape", "total tensor bytes overflow"))?;
        let id =
            u32::try_from(self.tensors.len()).map_err(|_| self.error("more than 2^32 tensors"))?;
        self.tensors
            .push(TensorMeta::new(fqn, dtype, shape.to_vec()));
        self.covered.push(0);
        self.tensor_ids.insert(fqn.to_string(), id);
        Ok(id)
    }

    fn box_row(
        &mut self,
        c: &Columns<'_>,
        dtype_cache: &mut [Option<DType>],
        row: usize,
        tensor: u32,
        file: u32,
        crc32c: Option<u32>,
    ) -> Result<(), MetadataError> {
        let meta = &self.tensors[tensor as usize];
        let fqn = &meta.fqn;
        let dtype = self.row_dtype(c, dtype_cache, row)?;
        if dtype != meta.dtype {
            return Err(self.row_error(
                row,
                "dtype",
                format_args!(
                    "tensor {fqn} is {dtype} here but {} in its first row",
                    meta.dtype
                ),
            ));
        }
        let shape = self.slice(c.shape, c.shape_values, row, "shape")?;
        if shape != meta.shape.as_slice() {
            return Err(self.row_error(
                row,
                "shape",
                format_args!(
                    "tensor {fqn} has shape {} here but {} in its first row",
                    crate::shape_to_string(shape),
                    crate::shape_to_string(&meta.shape)
                ),
            ));
        }
        let ndim = shape.len();
        let offsets = self.slice(c.offsets, c.offsets_values, row, "offsets")?;
        let lengths = self.slice(c.lengths, c.lengths_values, row, "lengths")?;
        if offsets.len() != ndim {
            return Err(self.row_error(
                row,
                "offsets",
                format_args!(
                    "tensor {fqn} has {ndim} dimensions but the box has {} offsets",
                    offsets.len()
                ),
            ));
        }
        if lengths.len() != ndim {
            return Err(self.row_error(
                row,
                "lengths",
                format_args!(
                    "tensor {fqn} has {ndim} dimensions but the box has {} lengths",
                    lengths.len()
                ),
            ));
        }
        if let Some(d) = (0..ndim).find(|&d| offsets[d].checked_add(lengths[d]).is_none()) {
            return Err(self.row_error(
                row,
                "lengths",
                format_args!(
                    "tensor {fqn}: box end {} + {} overflows in dim {d}",
                    offsets[d], lengths[d]
                ),
            ));
        }
        let esize = meta.dtype.size();
        let Some(numel) = lengths.iter().try_fold(1u64, |acc, &l| acc.checked_mul(l)) else {
            return Err(self.row_error(
                row,
                "lengths",
                format_args!("tensor {fqn}: box element count overflows"),
            ));
        };
        if numel.checked_mul(esize).is_none() {
            return Err(self.row_error(
                row,
                "lengths",
                format_args!("tensor {fqn}: box byte count overflows"),
            ));
        }
        let strides = if c.strides.is_valid(row) {
            let strides = self.slice(c.strides, c.strides_values, row, "strides")?;
            if strides.len() != ndim {
                return Err(self.row_error(
                    row,
                    "strides",
                    format_args!(
                        "tensor {fqn} has {ndim} dimensions but the box has {} strides",
                        strides.len()
                    ),
                ));
            }
            // The span validate computes: (sum of (len - 1) * stride + 1) * element size.
            let span = if numel == 0 {
                Some(0)
            } else {
                lengths
                    .iter()
                    .zip(strides)
                    .try_fold(1u64, |acc, (&l, &s)| {
                        acc.checked_add((l - 1).checked_mul(s)?)
                    })
                    .and_then(|elements| elements.checked_mul(esize))
            };
            if span.is_none() {
                return Err(self.row_error(
                    row,
                    "strides",
                    format_args!("tensor {fqn}: strided span overflows"),
                ));
            }
            Some(strides.to_vec())
        } else {
            None
        };
        let Some(sum) = self.covered[tensor as usize].checked_add(numel) else {
            return Err(self.row_error(
                row,
                "lengths",
                format_args!("tensor {fqn}: element count of its boxes overflows"),
            ));
        };
        self.covered[tensor as usize] = sum;
        self.chunks.push(SavedChunk {
            tensor,
            region: TensorBox {
                offsets: Dims::from_slice(offsets),
                lengths: Dims::from_slice(lengths),
            },
            bytes: ByteMeta {
                file,
                offset: c.byte_offset.value(row),
                length: c.byte_length.value(row),
                strides,
            },
            crc32c,
            crc32: None,
        });
        Ok(())
    }

    fn finish(self) -> Result<CheckpointMeta, MetadataError> {
        CheckpointMeta::new(self.tensors, self.chunks, self.objects, self.files)
    }
}

fn schema_fields() -> Vec<Field> {
    schema()
        .fields()
        .iter()
        .map(|f| f.as_ref().clone())
        .collect()
}
