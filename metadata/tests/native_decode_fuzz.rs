//! Malformed bytes never panic the decoders of the native format: random bytes, truncations and
//! bit flips of a valid `metadata.arrow`, extreme numbers that would overflow later arithmetic,
//! and garbage block checksum and manifest files. Whatever decodes must also validate without
//! panicking, since readers run `validate` next.
#![allow(clippy::unwrap_used)]

use proptest::prelude::*;
use tessera_metadata::formats::native::{
    Manifest, decode_block_checksums, decode_metadata, encode_metadata,
};
use tessera_metadata::{
    ByteMeta, CheckpointMeta, DType, DataFile, ObjectMeta, SavedChunk, TensorBox, TensorMeta,
    validate,
};

/// A small but varied valid metadata file to mutate.
fn sample() -> Vec<u8> {
    let tensors = vec![
        TensorMeta::new("a.weight", DType::Bf16, vec![4, 6]),
        TensorMeta::new("b.step", DType::I64, vec![]),
        TensorMeta::new("c.empty", DType::F32, vec![0]),
    ];
    let chunk =
        |tensor, offsets: Vec<u64>, lengths: Vec<u64>, offset, length, strides| SavedChunk {
            tensor,
            region: TensorBox::new(offsets, lengths),
            bytes: ByteMeta {
                file: (offset / 4096 % 2) as u32,
                offset,
                length,
                strides,
            },
            crc32c: (length % 3 == 0).then_some(length as u32),
            crc32: None,
        };
    let chunks = vec![
        chunk(0, vec![0, 0], vec![2, 6], 0, 24, None),
        chunk(0, vec![2, 0], vec![2, 6], 4096, 24, Some(vec![1, 2])),
        chunk(1, vec![], vec![], 8192, 8, None),
        chunk(2, vec![0], vec![0], 8200, 0, None),
    ];
    let objects = vec![ObjectMeta {
        key: "extra.config".to_string(),
        file: 1,
        offset: 12288,
        length: 17,
        crc32c: None,
    }];
    let files = ["data/a.bin", "data/b.bin"]
        .map(|p| DataFile {
            path: p.to_string(),
            size: None,
            encoded: None,
        })
        .to_vec();
    let meta = CheckpointMeta::new(tensors, chunks, objects, files).unwrap();
    encode_metadata(&meta).unwrap()
}

/// Decodes, and when that succeeds validates and re-encodes: none of it may panic.
fn exercise(bytes: &[u8]) {
    if let Ok(meta) = decode_metadata(bytes, "metadata.arrow") {
        let _ = validate(&meta);
        let _ = encode_metadata(&meta);
        let _ = meta.tensor_bytes();
    }
}

fn number() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..6u64,
        Just(u64::MAX),
        Just(u64::MAX / 2 + 1),
        Just(1 << 32),
        any::<u64>(),
    ]
}

fn dims(rank: usize) -> impl Strategy<Value = Vec<u64>> {
    proptest::collection::vec(number(), rank)
}

/// One tensor with one box, every number drawn from a mix of small and extreme values.
fn extreme_meta() -> impl Strategy<Value = CheckpointMeta> {
    (0..4usize)
        .prop_flat_map(|rank| {
            (
                dims(rank),
                dims(rank),
                dims(rank),
                proptest::option::of(dims(rank)),
                number(),
                number(),
                proptest::sample::select(DType::ALL.to_vec()),
            )
        })
        .prop_map(
            |(shape, offsets, lengths, strides, offset, length, dtype)| {
                let tensors = vec![TensorMeta::new("t", dtype, shape)];
                let chunks = vec![
                    SavedChunk {
                        tensor: 0,
                        region: TensorBox::new(offsets.clone(), lengths.clone()),
                        bytes: ByteMeta {
                            file: 0,
                            offset,
                            length,
                            strides: strides.clone(),
                        },
                        crc32c: None,
                        crc32: None,
                    },
                    SavedChunk {
                        tensor: 0,
                        region: TensorBox::new(offsets, lengths),
                        bytes: ByteMeta {
                            file: 0,
                            offset: length,
                            length: offset,
                            strides,
                        },
                        crc32c: Some(1),
                        crc32: None,
                    },
                ];
                let files = vec![DataFile {
                    path: "data/x.bin".to_string(),
                    size: None,
                    encoded: None,
                }];
                CheckpointMeta::new(tensors, chunks, vec![], files).unwrap()
            },
        )
}

proptest! {
    #[test]
    fn random_bytes_do_not_panic(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        exercise(&bytes);
        let _ = decode_block_checksums(&bytes, "checksums.arrow");
        let _ = Manifest::from_json(&bytes, "manifest.json");
    }

    #[test]
    fn truncations_do_not_panic(cut in any::<prop::sample::Index>()) {
        let valid = sample();
        let at = cut.index(valid.len());
        exercise(&valid[..at]);
    }

    #[test]
    fn bit_flips_do_not_panic(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 1..=255u8), 1..6)
    ) {
        let mut bytes = sample();
        for (at, mask) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= mask;
        }
        exercise(&bytes);
    }

    #[test]
    fn extreme_numbers_decode_to_errors_or_validate_without_overflow(meta in extreme_meta()) {
        let bytes = encode_metadata(&meta).unwrap();
        exercise(&bytes);
    }

    #[test]
    fn checksum_files_survive_flips(
        flips in proptest::collection::vec((any::<prop::sample::Index>(), 1..=255u8), 1..4)
    ) {
        let checksums = tessera_metadata::formats::native::BlockChecksums::new(
            16,
            vec![tessera_metadata::formats::native::FileBlocks {
                path: "data/a.bin".to_string(),
                size: 40,
                crcs: vec![1, 2, 3],
            }],
        )
        .unwrap();
        let mut bytes = tessera_metadata::formats::native::encode_block_checksums(&checksums).unwrap();
        for (at, mask) in flips {
            let i = at.index(bytes.len());
            bytes[i] ^= mask;
        }
        if let Ok(decoded) = decode_block_checksums(&bytes, "checksums.arrow") {
            for file in decoded.files() {
                let _ = decoded.blocks_covering(&file.path, 0, file.size);
                let _ = decoded.covering_byte_range(&file.path, file.size / 2, file.size);
            }
        }
    }
}

#[test]
fn every_truncation_of_a_valid_file_is_handled() {
    let valid = sample();
    for at in 0..valid.len() {
        exercise(&valid[..at]);
    }
    // Cutting inside the stream is an error that names the file.
    let err = decode_metadata(&valid[..valid.len() / 2], "run/metadata.arrow").unwrap_err();
    assert!(
        err.to_string()
            .starts_with("run/metadata.arrow: cannot decode checkpoint metadata: "),
        "{err}"
    );
}

#[test]
fn every_byte_of_valid_files_flipped_is_handled() {
    let valid = sample();
    for at in 0..valid.len() {
        for mask in [0x01, 0x80, 0xff] {
            let mut bytes = valid.clone();
            bytes[at] ^= mask;
            exercise(&bytes);
        }
    }
    let checksums = tessera_metadata::formats::native::BlockChecksums::new(
        16,
        vec![tessera_metadata::formats::native::FileBlocks {
            path: "data/a.bin".to_string(),
            size: 40,
            crcs: vec![1, 2, 3],
        }],
    )
    .unwrap();
    let valid = tessera_metadata::formats::native::encode_block_checksums(&checksums).unwrap();
    for at in 0..valid.len() {
        for mask in [0x01, 0x80, 0xff] {
            let mut bytes = valid.clone();
            bytes[at] ^= mask;
            let _ = decode_block_checksums(&bytes, "checksums.arrow");
        }
    }
}
