//! Scale check of `metadata.arrow`: a million rows encode and decode well under a second in
//! release builds. Ignored by default (slow in debug); run with
//! `cargo test --release -p tessera-metadata --test native_perf -- --ignored --nocapture`.
#![allow(clippy::unwrap_used)]

use std::time::Instant;

use tessera_metadata::formats::native::{decode_metadata, encode_metadata};
use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, SavedChunk, TensorBox, TensorMeta, validate,
};

#[test]
#[ignore = "scale test (a million rows, slow in debug); run in release with --ignored --nocapture"]
fn a_million_rows_round_trip() {
    let rows = 1_000_000u64;
    let per = 1000u64;
    let tensors: Vec<TensorMeta> = (0..rows / per)
        .map(|i| {
            TensorMeta::new(
                format!("model.layers.{i}.mlp.fc1.weight"),
                DType::Bf16,
                vec![per * 8, 4096],
            )
        })
        .collect();
    let chunks: Vec<SavedChunk> = (0..rows)
        .map(|r| SavedChunk {
            tensor: (r / per) as u32,
            region: TensorBox::new(vec![(r % per) * 8, 0], vec![8, 4096]),
            bytes: ByteMeta {
                file: (r % 64) as u32,
                offset: r / 64 * 65536,
                length: 65536,
                strides: None,
            },
            crc32c: Some(r as u32),
            crc32: None,
        })
        .collect();
    let files = (0..64)
        .map(|i| DataFile {
            path: format!("data/rank{i}.bin"),
            size: None,
            encoded: None,
        })
        .collect();
    let meta = CheckpointMeta::new(tensors, chunks, vec![], files).unwrap();

    let start = Instant::now();
    let bytes = encode_metadata(&meta).unwrap();
    let encode = start.elapsed();
    let start = Instant::now();
    let decoded = decode_metadata(&bytes, "metadata.arrow").unwrap();
    let decode = start.elapsed();
    let start = Instant::now();
    validate(&decoded).unwrap();
    let validation = start.elapsed();
    eprintln!(
        "{rows} rows, {} bytes: encode {encode:?}, decode {decode:?}, validate {validation:?}",
        bytes.len()
    );
    assert_eq!(decoded.chunks().len() as u64, rows);
    assert_eq!(decoded, meta);
    // Timings are printed, never asserted: speed is the benchmarks' business.
}
