//! One test per error of `validate`, `CheckpointMeta::new` and the metadata decoder, each asserting
//! the exact message a user sees: it must name the tensor, box, file and (for decoding) the row and
//! column at fault.
#![allow(clippy::unwrap_used)]

use std::sync::Arc;

use arrow_array::builder::{
    ListBuilder, StringDictionaryBuilder, UInt8Builder, UInt32Builder, UInt64Builder,
};
use arrow_array::types::{Int8Type, Int32Type};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_ipc::writer::StreamWriter;
use arrow_schema::{DataType, Field, Schema};
use tessera_metadata::formats::native::{
    BlockChecksums, FileBlocks, decode_metadata, encode_metadata,
};
use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, MetadataError, ObjectMeta, SavedChunk, TensorBox,
    TensorMeta, validate,
};

fn chunk(offsets: &[u64], lengths: &[u64], offset: u64, length: u64) -> SavedChunk {
    SavedChunk {
        tensor: 0,
        region: TensorBox::new(offsets.to_vec(), lengths.to_vec()),
        bytes: ByteMeta {
            file: 0,
            offset,
            length,
            strides: None,
        },
        crc32c: None,
        crc32: None,
    }
}

fn file(size: Option<u64>) -> Vec<DataFile> {
    vec![DataFile {
        path: "data/rank0.bin".to_string(),
        size,
        encoded: None,
    }]
}

/// `w`, f32 [4, 4], saved as `chunks` in one data file of `size` bytes.
fn meta(chunks: Vec<SavedChunk>, size: Option<u64>) -> CheckpointMeta {
    let tensors = vec![TensorMeta::new("w", DType::F32, vec![4, 4])];
    CheckpointMeta::new(tensors, chunks, vec![], file(size)).unwrap()
}

fn validate_error(meta: &CheckpointMeta) -> String {
    validate(meta).unwrap_err().to_string()
}

#[test]
fn a_valid_checkpoint_passes() {
    let m = meta(
        vec![
            chunk(&[0, 0], &[2, 4], 0, 32),
            chunk(&[2, 0], &[2, 4], 4096, 32),
        ],
        Some(4128),
    );
    validate(&m).unwrap();
}

#[test]
fn box_outside_shape() {
    let m = meta(
        vec![
            chunk(&[0, 0], &[4, 2], 0, 32),
            chunk(&[0, 2], &[4, 4], 4096, 64),
        ],
        None,
    );
    let err = validate(&m).unwrap_err();
    assert!(matches!(err, MetadataError::BoxOutsideShape { dim: 1, .. }));
    assert_eq!(
        err.to_string(),
        "tensor w: saved box [0..4, 2..6] lies outside the shape [4, 4] in dim 1 (2..6 > 4)"
    );
}

#[test]
fn overlapping_boxes() {
    let m = meta(
        vec![
            chunk(&[0, 0], &[3, 4], 0, 48),
            chunk(&[2, 0], &[2, 4], 4096, 32),
        ],
        None,
    );
    assert_eq!(
        validate_error(&m),
        "tensor w: saved boxes [0..3, 0..4] and [2..4, 0..4] overlap"
    );
}

#[test]
fn hole() {
    let m = meta(
        vec![
            chunk(&[0, 0], &[2, 4], 0, 32),
            chunk(&[3, 0], &[1, 4], 4096, 16),
        ],
        None,
    );
    assert_eq!(
        validate_error(&m),
        "tensor w: saved boxes cover 12 of 16 elements (a hole)"
    );
}

#[test]
fn byte_range_past_file_end() {
    let m = meta(
        vec![
            chunk(&[0, 0], &[2, 4], 0, 32),
            chunk(&[2, 0], &[2, 4], 4096, 32),
        ],
        Some(4100),
    );
    assert_eq!(
        validate_error(&m),
        "tensor w: chunk [2..4, 0..4] reads bytes 4096..4128 of data/rank0.bin, past its end (4100 bytes)"
    );
}

#[test]
fn object_past_file_end() {
    let tensors = vec![TensorMeta::new("s", DType::U8, vec![])];
    let chunks = vec![SavedChunk {
        tensor: 0,
        ..chunk(&[], &[], 0, 1)
    }];
    let objects = vec![ObjectMeta {
        key: "extra.config".to_string(),
        file: 0,
        offset: 4096,
        length: 100,
        crc32c: None,
    }];
    let m = CheckpointMeta::new(tensors, chunks, objects, file(Some(4100))).unwrap();
    assert_eq!(
        validate_error(&m),
        "tensor extra.config: chunk (object) reads bytes 4096..4196 of data/rank0.bin, past its end (4100 bytes)"
    );
}

#[test]
fn byte_length_not_numel_times_dtype_size() {
    let m = meta(
        vec![
            chunk(&[0, 0], &[2, 4], 0, 32),
            chunk(&[2, 0], &[2, 4], 4096, 30),
        ],
        None,
    );
    assert_eq!(
        validate_error(&m),
        "tensor w: chunk [2..4, 0..4] has byte length 30 but 8 elements of f32 need 32"
    );
}

#[test]
fn strided_chunk_shorter_than_its_span() {
    let mut strided = chunk(&[0, 0], &[4, 4], 0, 60);
    // Column-major 4x4: the last element is at 3 * 1 + 3 * 4 = 15, so 16 elements of span.
    strided.bytes.strides = Some(vec![1, 4]);
    let m = meta(vec![strided], None);
    assert_eq!(
        validate_error(&m),
        "tensor w: chunk [0..4, 0..4] has byte length 60 but 16 elements of f32 need 64"
    );
}

#[test]
fn rank_mismatch() {
    let tensors = vec![TensorMeta::new("w", DType::F32, vec![4, 4])];
    let err = CheckpointMeta::new(tensors, vec![chunk(&[0], &[4], 0, 16)], vec![], file(None))
        .unwrap_err();
    assert!(matches!(err, MetadataError::RankMismatch { ndim: 2, .. }));
    assert_eq!(
        err.to_string(),
        "tensor w: saved box [0..4] does not have the tensor's 2 dimensions"
    );
}

#[test]
fn chunk_of_a_tensor_that_does_not_exist() {
    let tensors = vec![TensorMeta::new("w", DType::F32, vec![4])];
    let mut c = chunk(&[0], &[4], 0, 16);
    c.tensor = 3;
    let err = CheckpointMeta::new(tensors, vec![c], vec![], file(None)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: saved chunk [0..4] refers to tensor #3 but there are 1 tensors"
    );
}

#[test]
fn chunk_in_a_file_that_does_not_exist() {
    let tensors = vec![TensorMeta::new("w", DType::F32, vec![4])];
    let mut c = chunk(&[0], &[4], 0, 16);
    c.bytes.file = 2;
    let err = CheckpointMeta::new(tensors, vec![c], vec![], file(None)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: tensor w: chunk [0..4] refers to file #2 but there are 1 files"
    );
}

#[test]
fn object_in_a_file_that_does_not_exist() {
    let objects = vec![ObjectMeta {
        key: "extra.rng".to_string(),
        file: 1,
        offset: 0,
        length: 1,
        crc32c: None,
    }];
    let err = CheckpointMeta::new(vec![], vec![], objects, file(None)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "invalid checkpoint metadata: object extra.rng refers to file #1 but there are 1 files"
    );
}

#[test]
fn checksum_mismatch() {
    let data: Vec<u8> = (0..48).collect();
    let crcs = data.chunks(16).map(crc32c::crc32c).collect();
    let checksums = BlockChecksums::new(
        16,
        vec![FileBlocks {
            path: "data/rank0.bin".to_string(),
            size: 48,
            crcs,
        }],
    )
    .unwrap();
    let mut read = data[16..48].to_vec();
    read[20] = 0;
    let err = checksums
        .verify_range("data/rank0.bin", 16, &read)
        .unwrap_err();
    assert_eq!(
        err.to_string(),
        format!(
            "checksum mismatch in data/rank0.bin bytes 32..48: expected crc32c {:08x}, found {:08x}",
            crc32c::crc32c(&data[32..48]),
            crc32c::crc32c(&read[16..32])
        )
    );
}

/// One row of a hand-made `metadata.arrow`, for inputs the encoder would never produce.
#[derive(Clone, Copy)]
struct Row<'a> {
    kind: u8,
    fqn: &'a str,
    dtype: Option<&'a str>,
    shape: &'a [u64],
    offsets: &'a [u64],
    lengths: &'a [u64],
    byte_offset: u64,
    byte_length: u64,
}

const W_ROW: Row<'static> = Row {
    kind: 0,
    fqn: "w",
    dtype: Some("f32"),
    shape: &[4, 4],
    offsets: &[0, 0],
    lengths: &[4, 4],
    byte_offset: 0,
    byte_length: 64,
};

fn u64_list() -> ListBuilder<UInt64Builder> {
    ListBuilder::new(UInt64Builder::new())
        .with_field(Field::new_list_field(DataType::UInt64, false))
}

/// Writes `rows` with the schema of `metadata.arrow`.
fn raw_metadata(rows: &[Row<'_>]) -> Vec<u8> {
    let mut kind = UInt8Builder::new();
    let mut fqn = StringDictionaryBuilder::<Int32Type>::new();
    let mut dtype = StringDictionaryBuilder::<Int8Type>::new();
    let (mut shape, mut offsets, mut lengths, mut strides) =
        (u64_list(), u64_list(), u64_list(), u64_list());
    let mut file = StringDictionaryBuilder::<Int32Type>::new();
    let (mut byte_offset, mut byte_length) = (UInt64Builder::new(), UInt64Builder::new());
    let mut crc = UInt32Builder::new();
    for row in rows {
        kind.append_value(row.kind);
        fqn.append_value(row.fqn);
        match row.dtype {
            Some(d) => dtype.append_value(d),
            None => dtype.append_null(),
        }
        shape.append_value(row.shape.iter().map(|&v| Some(v)));
        offsets.append_value(row.offsets.iter().map(|&v| Some(v)));
        lengths.append_value(row.lengths.iter().map(|&v| Some(v)));
        file.append_value("data/rank0.bin");
        byte_offset.append_value(row.byte_offset);
        byte_length.append_value(row.byte_length);
        strides.append_null();
        crc.append_null();
    }
    let columns: Vec<ArrayRef> = vec![
        Arc::new(kind.finish()),
        Arc::new(fqn.finish()),
        Arc::new(dtype.finish()),
        Arc::new(shape.finish()),
        Arc::new(offsets.finish()),
        Arc::new(lengths.finish()),
        Arc::new(file.finish()),
        Arc::new(byte_offset.finish()),
        Arc::new(byte_length.finish()),
        Arc::new(strides.finish()),
        Arc::new(crc.finish()),
    ];
    let names = [
        "kind",
        "fqn",
        "dtype",
        "shape",
        "offsets",
        "lengths",
        "file",
        "byte_offset",
        "byte_length",
        "strides",
        "crc32c",
    ];
    let fields: Vec<Field> = names
        .iter()
        .zip(&columns)
        .map(|(name, c)| Field::new(*name, c.data_type().clone(), true))
        .collect();
    let schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(schema.clone(), columns).unwrap();
    let mut writer = StreamWriter::try_new(Vec::new(), &schema).unwrap();
    writer.write(&batch).unwrap();
    writer.finish().unwrap();
    writer.into_inner().unwrap()
}

fn decode_error(rows: &[Row<'_>]) -> MetadataError {
    decode_metadata(&raw_metadata(rows), "ckpt/metadata.arrow").unwrap_err()
}

#[test]
fn hand_made_metadata_decodes() {
    let meta = decode_metadata(&raw_metadata(&[W_ROW]), "ckpt/metadata.arrow").unwrap();
    assert_eq!(
        meta.tensors(),
        [TensorMeta::new("w", DType::F32, vec![4, 4])]
    );
    assert_eq!(meta.chunks(), [chunk(&[0, 0], &[4, 4], 0, 64)]);
}

#[test]
fn unknown_dtype_via_decode() {
    let err = decode_error(&[Row {
        dtype: Some("complex32"),
        ..W_ROW
    }]);
    assert!(matches!(err, MetadataError::Decode { .. }));
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 0, column dtype: unknown dtype \"complex32\""
    );
}

#[test]
fn rank_mismatch_via_decode() {
    let err = decode_error(&[
        W_ROW,
        Row {
            offsets: &[0],
            lengths: &[4],
            ..W_ROW
        },
    ]);
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 1, column offsets: tensor w has 2 dimensions but the box has 1 offsets"
    );
}

#[test]
fn rows_of_one_tensor_that_disagree_on_dtype_or_shape() {
    let err = decode_error(&[
        W_ROW,
        Row {
            dtype: Some("bf16"),
            ..W_ROW
        },
    ]);
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 1, column dtype: tensor w is bf16 here but f32 in its first row"
    );
    let err = decode_error(&[
        W_ROW,
        Row {
            shape: &[4, 5],
            ..W_ROW
        },
    ]);
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 1, column shape: tensor w has shape [4, 5] here but [4, 4] in its first row"
    );
}

#[test]
fn a_tensor_row_without_dtype_and_an_unknown_kind() {
    let err = decode_error(&[Row {
        dtype: None,
        ..W_ROW
    }]);
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 0, column dtype: a tensor box needs a dtype"
    );
    let err = decode_error(&[W_ROW, Row { kind: 7, ..W_ROW }]);
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 1, column kind: kind 7 is neither 0 (box) nor 1 (object)"
    );
}

#[test]
fn numbers_that_would_overflow_later_are_refused() {
    let err = decode_error(&[Row {
        shape: &[1 << 62, 8],
        offsets: &[0, 0],
        lengths: &[1, 1],
        ..W_ROW
    }]);
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 0, column shape: tensor w: shape [4611686018427387904, 8] of f32 overflows 64-bit byte counts"
    );
    let err = decode_error(&[Row {
        offsets: &[u64::MAX, 0],
        lengths: &[1, 4],
        ..W_ROW
    }]);
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 0, column lengths: tensor w: box end 18446744073709551615 + 1 overflows in dim 0"
    );
    let err = decode_error(&[Row {
        byte_offset: u64::MAX - 10,
        ..W_ROW
    }]);
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 0, column byte_length: byte range 18446744073709551605 + 64 overflows"
    );
}

#[test]
fn an_object_key_twice() {
    let object = Row {
        kind: 1,
        fqn: "extra.config",
        dtype: None,
        shape: &[],
        offsets: &[],
        lengths: &[],
        byte_offset: 0,
        byte_length: 3,
    };
    let err = decode_error(&[object, object]);
    assert_eq!(
        err.to_string(),
        "ckpt/metadata.arrow: cannot decode checkpoint metadata: row 1, column fqn: object extra.config appears twice"
    );
}

#[test]
fn a_missing_column_and_a_column_of_the_wrong_type() {
    let schema = Arc::new(Schema::new(vec![Field::new(
        "kind",
        DataType::UInt8,
        false,
    )]));
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![Arc::new(arrow_array::UInt8Array::from(vec![0u8])) as ArrayRef],
    )
    .unwrap();
    let mut writer = StreamWriter::try_new(Vec::new(), &schema).unwrap();
    writer.write(&batch).unwrap();
    writer.finish().unwrap();
    let err = decode_metadata(&writer.into_inner().unwrap(), "m.arrow").unwrap_err();
    assert_eq!(
        err.to_string(),
        "m.arrow: cannot decode checkpoint metadata: no column fqn"
    );

    let schema = Arc::new(Schema::new(vec![Field::new(
        "kind",
        DataType::UInt32,
        false,
    )]));
    let batch = RecordBatch::try_new(
        schema.clone(),
        vec![Arc::new(arrow_array::UInt32Array::from(vec![0u32])) as ArrayRef],
    )
    .unwrap();
    let mut writer = StreamWriter::try_new(Vec::new(), &schema).unwrap();
    writer.write(&batch).unwrap();
    writer.finish().unwrap();
    let err = decode_metadata(&writer.into_inner().unwrap(), "m.arrow").unwrap_err();
    assert_eq!(
        err.to_string(),
        "m.arrow: cannot decode checkpoint metadata: column kind has type UInt32, expected UInt8"
    );
}

#[test]
fn garbage_is_a_decode_error_naming_the_file() {
    let err = decode_metadata(b"definitely not arrow", "ckpt/metadata.arrow").unwrap_err();
    assert!(matches!(err, MetadataError::Decode { .. }));
    assert!(
        err.to_string()
            .starts_with("ckpt/metadata.arrow: cannot decode checkpoint metadata: "),
        "{err}"
    );
    // The encoder's own output decodes, as a control.
    let m = meta(vec![chunk(&[0, 0], &[4, 4], 0, 64)], None);
    assert_eq!(
        decode_metadata(&encode_metadata(&m).unwrap(), "x").unwrap(),
        m
    );
}
