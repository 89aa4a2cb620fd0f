//! The capped safetensors header parser never panics (random bytes, mutated real files, random
//! headers with extreme numbers), and whatever it accepts is sound: entries sorted by offset,
//! back to back from 0 (no hole, no overlap), each `numel × dtype size` bytes, inside the file.
//! The same entry point as the cargo-fuzz target in `fuzz/`.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::sync::OnceLock;

use dcp_support::fixtures;
use proptest::prelude::*;
use proptest::sample::Index;
use tessera_metadata::formats::safetensors::{Header, parse, parse_header};

/// The first 4 KiB of fixture f's first file (header and some data) and a small whole file.
fn samples() -> &'static Vec<Vec<u8>> {
    static SAMPLES: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    SAMPLES.get_or_init(|| {
        let f = std::fs::read(fixtures().join("f_hf_w1_full/model-00001-of-00002.safetensors"))
            .unwrap();
        let small = tessera_metadata::formats::safetensors::serialize(
            &[
                tessera_metadata::formats::safetensors::TensorView {
                    name: "a",
                    dtype: tessera_metadata::DType::Bf16,
                    shape: &[2, 3],
                    data: &[1; 12],
                },
                tessera_metadata::formats::safetensors::TensorView {
                    name: "b",
                    dtype: tessera_metadata::DType::I64,
                    shape: &[0, 4],
                    data: &[],
                },
            ],
            None,
        )
        .unwrap();
        vec![f[..4096].to_vec(), small]
    })
}

fn check_sound(header: &Header, file_size: u64) {
    let mut expected = 0u64;
    for t in &header.tensors {
        let (begin, end) = t.data_offsets;
        assert_eq!(begin, expected, "{}: no hole, no overlap", t.name);
        let numel: u64 = t.shape.iter().product();
        assert_eq!(end - begin, numel * t.dtype.size(), "{}", t.name);
        assert!(header.data_start + end <= file_size, "{}", t.name);
        expected = end;
    }
}

fn number() -> impl Strategy<Value = String> {
    prop_oneof![
        (0u64..64).prop_map(|n| n.to_string()),
        any::<u64>().prop_map(|n| n.to_string()),
        Just("18446744073709551615".to_string()),
        Just("-1".to_string()),
        Just("1.5".to_string()),
        Just("\"3\"".to_string()),
    ]
}

fn entry() -> impl Strategy<Value = String> {
    let dtype = prop::sample::select(vec![
        "F32", "BF16", "U8", "I64", "F8_E4M3", "BOOL", "C64", "", "f32",
    ]);
    (
        dtype,
        prop::collection::vec(number(), 0..4),
        prop::collection::vec(number(), 0..3),
        any::<Index>(),
    )
        .prop_map(|(dtype, shape, offsets, name)| {
            format!(
                r#""t{}":{{"dtype":"{dtype}","shape":[{}],"data_offsets":[{}]}}"#,
                name.index(4),
                shape.join(","),
                offsets.join(",")
            )
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(data in prop::collection::vec(any::<u8>(), 0..256)) {
        if let Ok(header) = parse(&data, "fuzz") {
            check_sound(&header, data.len() as u64);
        }
    }

    #[test]
    fn random_headers_never_panic_and_accepted_ones_are_sound(
        entries in prop::collection::vec(entry(), 0..6),
        metadata in prop::option::of(prop::sample::select(vec![r#"{"format":"pt"}"#, r#"{"x":1}"#, "[]"])),
        size in prop_oneof![0u64..4096, Just(u64::MAX)],
    ) {
        let mut parts = entries;
        if let Some(m) = metadata {
            parts.push(format!(r#""__metadata__":{m}"#));
        }
        let json = format!("{{{}}}", parts.join(","));
        if let Ok(header) = parse_header(json.as_bytes(), size, "fuzz") {
            check_sound(&header, size);
        }
    }

    #[test]
    fn mutated_files_never_panic(
        which in 0usize..2,
        edits in prop::collection::vec((any::<Index>(), any::<u8>()), 1..8),
        cut in prop::option::of(any::<Index>()),
    ) {
        let mut data = samples()[which].clone();
        for (at, byte) in edits {
            let k = at.index(data.len());
            data[k] = byte;
        }
        if let Some(cut) = cut {
            let k = cut.index(data.len());
            data.truncate(k);
        }
        if let Ok(header) = parse(&data, "fuzz") {
            check_sound(&header, data.len() as u64);
        }
    }
}

#[test]
fn the_samples_parse() {
    let small = &samples()[1];
    check_sound(&parse(small, "small").unwrap(), small.len() as u64);
}
