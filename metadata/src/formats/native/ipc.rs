//! A bounds check of an Arrow IPC stream before `arrow-ipc` decodes it.
//!
//! `arrow-ipc` verifies each message's flatbuffer, but trusts the buffer descriptors inside it:
//! it panics (`Buffer::slice_with_length`, `Buffer::typed_data`) when a buffer points past the
//! message body or its length is not a whole number of elements. Our metadata files come from
//! storage, so each message is walked here first, the way the reader frames them, and every buffer
//! and field node is checked against the body and against the layout our schema implies.

use arrow_ipc::{MessageHeader, RecordBatch, root_as_message};
use arrow_schema::{DataType, Field, Schema};

const CONTINUATION: [u8; 4] = [0xff; 4];

/// The buffers and field nodes of one record batch of a schema, in IPC order.
struct Layout {
    /// Element width of each buffer in bytes (1 for validity bitmaps and byte data).
    widths: Vec<u64>,
    /// Number of field nodes (arrays, children included).
    nodes: usize,
}

impl Layout {
    fn of_fields<'f>(fields: impl IntoIterator<Item = &'f Field>) -> Result<Self, String> {
        let mut layout = Layout {
            widths: Vec::new(),
            nodes: 0,
        };
        for field in fields {
            layout.add(field.data_type())?;
        }
        Ok(layout)
    }

    fn add(&mut self, data_type: &DataType) -> Result<(), String> {
        self.nodes += 1;
        self.widths.push(1); // validity bitmap
        match data_type {
            DataType::Dictionary(key, _) => self.widths.push(width(key)?),
            DataType::Utf8 | DataType::Binary => self.widths.extend([4, 1]),
            DataType::List(child) => {
                self.widths.push(4);
                self.add(child.data_type())?;
            }
            other => self.widths.push(width(other)?),
        }
        Ok(())
    }
}

fn width(data_type: &DataType) -> Result<u64, String> {
    match data_type.primitive_width() {
        Some(width) => Ok(width as u64),
        None => Err(format!("type {data_type} is not expected in this file")),
    }
}

/// Checks the framing of every message of the stream in `bytes`, and that every record batch
/// and dictionary batch has the buffers and nodes `schema` implies, each inside its body.
/// Dictionaries must be `Utf8`. Returns a description of the first problem.
pub(crate) fn check_stream(bytes: &[u8], schema: &Schema) -> Result<(), String> {
    let batch_layout = Layout::of_fields(schema.fields().iter().map(|f| f.as_ref()))?;
    let dictionary_layout = Layout::of_fields([&Field::new("values", DataType::Utf8, true)])?;
    let mut pos = 0usize;
    let mut index = 0usize;
    loop {
        // Mirrors arrow-ipc's reader: end of input before a length is the end of the stream.
        let Some(mut prefix) = read4(bytes, pos) else {
            return Ok(());
        };
        pos += 4;
        if prefix == CONTINUATION {
            prefix = read4(bytes, pos)
                .ok_or_else(|| format!("message {index}: stream ends inside a length"))?;
            pos += 4;
        }
        let meta_len = i32::from_le_bytes(prefix);
        if meta_len == 0 {
            return Ok(());
        }
        let meta_len = usize::try_from(meta_len)
            .map_err(|_| format!("message {index}: negative metadata length {meta_len}"))?;
        let Some(meta) = pos
            .checked_add(meta_len)
            .and_then(|end| bytes.get(pos..end))
        else {
            return Err(format!(
                "message {index}: {meta_len} metadata bytes declared, {} left",
                bytes.len() - pos
            ));
        };
        pos += meta_len;
        let message = root_as_message(meta)
            .map_err(|e| format!("message {index}: invalid message header: {e}"))?;
        let body_len = u64::try_from(message.bodyLength())
            .map_err(|_| format!("message {index}: negative body length"))?;
        let left = (bytes.len() - pos) as u64;
        if body_len > left {
            return Err(format!(
                "message {index}: body of {body_len} bytes declared, {left} left"
            ));
        }
        match message.header_type() {
            MessageHeader::RecordBatch => {
                if let Some(batch) = message.header_as_record_batch() {
                    check_batch(&batch, body_len, &batch_layout)
                        .map_err(|e| format!("message {index}: {e}"))?;
                }
            }
            MessageHeader::DictionaryBatch => {
                if let Some(batch) = message.header_as_dictionary_batch().and_then(|d| d.data()) {
                    check_batch(&batch, body_len, &dictionary_layout)
                        .map_err(|e| format!("message {index}: {e}"))?;
                }
            }
            _ => {}
        }
        pos += body_len as usize;
        index += 1;
    }
}

fn read4(bytes: &[u8], pos: usize) -> Option<[u8; 4]> {
    bytes.get(pos..pos.checked_add(4)?)?.try_into().ok()
}

/// Every buffer aligned, a whole number of elements and inside the body; the counts of buffers
/// and nodes what the layout needs; every length at most the body size, since every column type
/// of our files takes at least one byte per element (a larger length is a lie that would only make
/// the decoder allocate).
fn check_batch(batch: &RecordBatch<'_>, body_len: u64, layout: &Layout) -> Result<(), String> {
    if batch.compression().is_some() {
        return Err("compressed record batches are not supported".to_string());
    }
    let length = u64::try_from(batch.length()).map_err(|_| "negative batch length".to_string())?;
    if length > body_len {
        return Err(format!(
            "batch of {length} rows in a body of {body_len} bytes"
        ));
    }
    let buffers = batch.buffers().map_or(0, |b| b.len());
    let nodes = batch.nodes().map_or(0, |n| n.len());
    if buffers != layout.widths.len() || nodes != layout.nodes {
        return Err(format!(
            "{buffers} buffers and {nodes} field nodes, the schema needs {} and {}",
            layout.widths.len(),
            layout.nodes
        ));
    }
    if let Some(buffers) = batch.buffers() {
        for ((i, buffer), &width) in buffers.iter().enumerate().zip(&layout.widths) {
            let (Ok(offset), Ok(len)) = (
                u64::try_from(buffer.offset()),
                u64::try_from(buffer.length()),
            ) else {
                return Err(format!("buffer {i} has a negative offset or length"));
            };
            // The format requires 8-byte aligned buffers, and arrow's typed views of a
            // misaligned one panic rather than fail.
            if !offset.is_multiple_of(8) {
                return Err(format!("buffer {i} at {offset} is not 8-byte aligned"));
            }
            if !len.is_multiple_of(width) {
                return Err(format!(
                    "buffer {i} of {len} bytes is not a whole number of {width}-byte elements"
                ));
            }
            if offset.checked_add(len).is_none_or(|end| end > body_len) {
                return Err(format!(
                    "buffer {i} at {offset}..{} lies outside the body of {body_len} bytes",
                    offset.saturating_add(len)
                ));
            }
        }
    }
    if let Some(nodes) = batch.nodes() {
        for (i, node) in nodes.iter().enumerate() {
            let (Ok(len), Ok(nulls)) = (
                u64::try_from(node.length()),
                u64::try_from(node.null_count()),
            ) else {
                return Err(format!(
                    "field node {i} has a negative length or null count"
                ));
            };
            if len > body_len || nulls > len {
                return Err(format!(
                    "field node {i}: {len} values with {nulls} nulls in a body of {body_len} bytes"
                ));
            }
        }
    }
    Ok(())
}
