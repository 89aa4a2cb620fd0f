//! The synthetic value formula against the real DCP fixtures (bit-exact), and box / flat-range
//! generation and checking against slices of whole tensors.

#![allow(clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use proptest::prelude::*;
use serde_json::Value;
use sha2::{Digest, Sha256};
use tessera_metadata::{DType, TensorBox, TensorMeta, row_major_strides};
use tessera_synth::{
    SynthError, box_bytes, check_box, check_flat, element_seed, fill_box, fill_flat, flat_bytes,
    hash32,
};

const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/fixtures/dcp");

/// One tensor of a safetensors file: its meta and raw bytes.
struct Stored {
    meta: TensorMeta,
    bytes: Vec<u8>,
}

/// A minimal safetensors reader: 8-byte LE header length, JSON header, data.
fn read_safetensors(path: &str) -> BTreeMap<String, Stored> {
    let file = std::fs::read(path).unwrap();
    let header_len = usize::try_from(u64::from_le_bytes(file[..8].try_into().unwrap())).unwrap();
    let header: BTreeMap<String, Value> = serde_json::from_slice(&file[8..8 + header_len]).unwrap();
    let data = &file[8 + header_len..];
    let mut out = BTreeMap::new();
    for (name, entry) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype = DType::parse(entry["dtype"].as_str().unwrap()).unwrap();
        let shape: Vec<u64> = entry["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        let range: Vec<usize> = entry["data_offsets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|o| usize::try_from(o.as_u64().unwrap()).unwrap())
            .collect();
        let bytes = data[range[0]..range[1]].to_vec();
        out.insert(
            name.clone(),
            Stored {
                meta: TensorMeta::new(name, dtype, shape),
                bytes,
            },
        );
    }
    out
}

fn read_json(path: &str) -> Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Every tensor of the reference file, keyed by flattened DCP fqn (all 51 are formula-based).
fn reference() -> &'static BTreeMap<String, Stored> {
    static REFERENCE: OnceLock<BTreeMap<String, Stored>> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        read_safetensors(&format!(
            "{FIXTURES}/h_reference_full_safetensors/all_tensors_dcp_fqns.safetensors"
        ))
    })
}

fn dtype_of_torch_name(name: &str) -> DType {
    DType::parse(name).unwrap()
}

#[test]
fn reproduces_every_formula_tensor_of_the_dcp_fixtures_bit_exactly() {
    let expected = read_json(&format!(
        "{FIXTURES}/h_reference_full_safetensors/expected.json"
    ));
    let entries = expected["entries"].as_object().unwrap();
    let tensors = reference();
    let mut checked = 0;
    let mut dtypes = std::collections::BTreeSet::new();
    for (fqn, entry) in entries {
        let formula = &entry["formula"];
        assert_eq!(formula["name"], "hash32_v1", "{fqn}");
        assert_eq!(formula["seed_source"], "zlib.crc32(fqn utf-8)", "{fqn}");
        assert_eq!(
            u64::from(element_seed(fqn)),
            formula["seed"].as_u64().unwrap(),
            "{fqn}"
        );
        let stored = &tensors[fqn.as_str()];
        assert_eq!(
            stored.meta.dtype,
            dtype_of_torch_name(entry["dtype"].as_str().unwrap())
        );
        let ours = box_bytes(&stored.meta, &stored.meta.full_box()).unwrap();
        assert!(ours == stored.bytes, "{fqn}: bytes differ from the fixture");
        assert_eq!(
            sha256_hex(&ours),
            entry["sha256"].as_str().unwrap(),
            "{fqn}"
        );
        check_box(&stored.meta, &stored.meta.full_box(), &stored.bytes).unwrap();
        dtypes.insert(stored.meta.dtype);
        checked += 1;
    }
    assert_eq!(checked, 51);
    assert_eq!(checked, tensors.len());
    assert_eq!(
        dtypes.into_iter().collect::<Vec<_>>(),
        vec![DType::I64, DType::F16, DType::Bf16, DType::F32]
    );
}

#[test]
fn matches_the_sha256_of_every_formula_tensor_of_the_plain_dcp_fixture() {
    let expected = read_json(&format!("{FIXTURES}/a_w1_plain/expected.json"));
    let mut checked = 0;
    for (fqn, entry) in expected["entries"].as_object().unwrap() {
        if entry["kind"] != "tensor" || entry["formula"]["name"] != "hash32_v1" {
            continue;
        }
        assert_eq!(
            u64::from(element_seed(fqn)),
            entry["formula"]["seed"].as_u64().unwrap()
        );
        let shape = entry["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap())
            .collect();
        let meta = TensorMeta::new(
            fqn.clone(),
            dtype_of_torch_name(entry["dtype"].as_str().unwrap()),
            shape,
        );
        let ours = box_bytes(&meta, &meta.full_box()).unwrap();
        assert_eq!(
            sha256_hex(&ours),
            entry["sha256"].as_str().unwrap(),
            "{fqn}"
        );
        checked += 1;
    }
    assert_eq!(checked, 51);
}

#[test]
fn reproduces_the_hf_named_model_file_with_model_prefixed_seeds() {
    let tensors = read_safetensors(&format!(
        "{FIXTURES}/h_reference_full_safetensors/model.safetensors"
    ));
    assert_eq!(tensors.len(), 32);
    for (name, stored) in tensors {
        assert!(!name.starts_with("model."), "{name}");
        let meta = TensorMeta::new(
            format!("model.{name}"),
            stored.meta.dtype,
            stored.meta.shape.clone(),
        );
        let ours = box_bytes(&meta, &meta.full_box()).unwrap();
        assert!(ours == stored.bytes, "{name}");
    }
}

#[test]
fn hash32_follows_the_formula_step_by_step() {
    let seed = element_seed("model.tok_emb.weight");
    assert_eq!(seed, 1_728_698_188);
    // The fixture's first f32 element recomputed by hand from x.
    let x = hash32(seed, 0);
    let m = i64::from(x % (1 << 20)) - (1 << 19);
    let e = i32::try_from((x >> 24) & 7).unwrap();
    let value = m as f64 * 2f64.powi(e - 16);
    let stored = &reference()["model.tok_emb.weight"];
    let first = f32::from_le_bytes(stored.bytes[..4].try_into().unwrap());
    assert_eq!(f64::from(first), value);
    // i64: x * 1000003 - 2^41.
    let step = &reference()["train_step"];
    let x = hash32(element_seed("train_step"), 0);
    assert_eq!(
        i64::from_le_bytes(step.bytes[..8].try_into().unwrap()),
        i64::from(x) * 1_000_003 - (1 << 41)
    );
    // Only the index mod 2^32 matters.
    assert_eq!(hash32(seed, 5), hash32(seed, 5 + (1 << 32)));
}

/// Bytes of `region` cut out of a whole tensor's row-major bytes, element by element.
fn extract(meta: &TensorMeta, full: &[u8], region: &TensorBox) -> Vec<u8> {
    let size = usize::try_from(meta.dtype.size()).unwrap();
    let strides = row_major_strides(&meta.shape);
    let mut out = Vec::new();
    let numel = region.numel();
    let box_strides = row_major_strides(&region.lengths);
    for k in 0..numel {
        let mut flat = 0;
        for d in 0..region.ndim() {
            let c = (k / box_strides[d]) % region.lengths[d];
            flat += (region.offsets[d] + c) * strides[d];
        }
        let at = usize::try_from(flat).unwrap() * size;
        out.extend_from_slice(&full[at..at + size]);
    }
    out
}

#[test]
fn fill_box_equals_sub_boxes_of_the_fixture_tensors() {
    let cases: [(&str, &[u64], &[u64]); 10] = [
        ("model.pos_emb.weight", &[25, 0], &[25, 64]),
        ("model.pos_emb.weight", &[75, 0], &[23, 64]),
        ("model.pos_emb.weight", &[10, 7], &[31, 33]),
        ("model.layers.0.attn.qkv.weight", &[96, 32], &[96, 32]),
        ("model.layers.1.mlp.fc2.weight", &[0, 128], &[64, 128]),
        ("model.router.histogram", &[3, 2], &[7, 5]),
        ("model.tiny.weight", &[3, 0], &[0, 5]),
        ("model.tiny.weight", &[1, 4], &[2, 1]),
        ("model.token_counts", &[50], &[46]),
        ("train_step", &[], &[]),
    ];
    for (fqn, offsets, lengths) in cases {
        let stored = &reference()[fqn];
        let region = TensorBox::new(offsets.to_vec(), lengths.to_vec());
        let want = extract(&stored.meta, &stored.bytes, &region);
        let mut got = vec![0xAA; want.len()];
        fill_box(&stored.meta, &region, &mut got).unwrap();
        assert!(got == want, "{fqn} {region}");
        check_box(&stored.meta, &region, &want).unwrap();
    }
}

#[test]
fn fill_flat_equals_flat_ranges_of_the_fixture_tensors() {
    let cases = [
        ("model.pos_emb.weight", 0, 6272),
        ("model.pos_emb.weight", 1000, 1001),
        ("model.pos_emb.weight", 6271, 6272),
        ("model.layers.0.mlp.fc1.weight", 333, 9999),
        ("model.layers.0.attn.qkv.bias", 17, 17),
        ("model.router.histogram", 5, 69),
    ];
    for (fqn, start, end) in cases {
        let stored = &reference()[fqn];
        let size = usize::try_from(stored.meta.dtype.size()).unwrap();
        let want = &stored.bytes[start * size..end * size];
        let mut got = vec![0x55; want.len()];
        fill_flat(&stored.meta, start as u64, end as u64, &mut got).unwrap();
        assert!(got == want, "{fqn} {start}..{end}");
        assert!(flat_bytes(&stored.meta, start as u64, end as u64).unwrap() == want);
        check_flat(&stored.meta, start as u64, end as u64, want).unwrap();
    }
}

#[test]
fn check_box_names_the_first_flipped_element() {
    let stored = &reference()["model.layers.0.mlp.fc2.weight"]; // f16 [64, 256]
    let region = TensorBox::new(vec![10, 100], vec![20, 50]);
    let mut bytes = box_bytes(&stored.meta, &region).unwrap();
    // Element (row 3, col 7) of the box = global [13, 107]; flip the high byte of the f16.
    let at = (3 * 50 + 7) * 2 + 1;
    let expected_pair = [bytes[at - 1], bytes[at]];
    bytes[at] ^= 0x01;
    // A later corruption must not be the one reported.
    let last = bytes.len() - 1;
    bytes[last] ^= 0x80;
    let err = check_box(&stored.meta, &region, &bytes).unwrap_err();
    let m = err.mismatch().unwrap();
    assert_eq!(m.fqn, "model.layers.0.mlp.fc2.weight");
    assert_eq!(m.dtype, DType::F16);
    assert_eq!(m.coords, vec![13, 107]);
    assert_eq!(m.index, 13 * 256 + 107);
    assert_eq!(m.byte_offset, at - 1);
    assert_eq!(m.expected, expected_pair.to_vec());
    assert_eq!(m.found, vec![expected_pair[0], expected_pair[1] ^ 0x01]);
    let text = err.to_string();
    assert_eq!(
        text,
        format!(
            "tensor model.layers.0.mlp.fc2.weight (f16): element [13, 107] (flat index 3435, \
             buffer byte {}): expected bytes [{:02x} {:02x}], found [{:02x} {:02x}]",
            at - 1,
            expected_pair[0],
            expected_pair[1],
            expected_pair[0],
            expected_pair[1] ^ 0x01
        )
    );
    // The full fixture tensor is byte-identical, so the same flip there reports the same element.
    let mut full = stored.bytes.clone();
    full[(13 * 256 + 107) * 2] ^= 0x10;
    let err = check_box(&stored.meta, &stored.meta.full_box(), &full).unwrap_err();
    assert_eq!(err.mismatch().unwrap().coords, vec![13, 107]);
}

#[test]
fn check_flat_reports_mismatches_past_the_first_scratch_chunk() {
    // 40_000 elements: the checker works in 16 Ki-element pieces, the flip lies in the third.
    let meta = TensorMeta::new("optim.state.x.exp_avg", DType::F32, vec![200, 400]);
    let mut bytes = flat_bytes(&meta, 100, 40_100).unwrap();
    let elem = 35_001usize;
    bytes[elem * 4 + 2] ^= 0x04;
    let err = check_flat(&meta, 100, 40_100, &bytes).unwrap_err();
    let m = err.mismatch().unwrap();
    assert_eq!(m.index, 35_101);
    assert_eq!(m.coords, vec![87, 301]);
    assert_eq!(m.byte_offset, elem * 4);
}

#[test]
fn bad_requests_are_errors_not_panics() {
    let meta = TensorMeta::new("model.tiny.weight", DType::F32, vec![3, 5]);
    let region = TensorBox::new(vec![1, 1], vec![2, 3]);
    let mut short = vec![0u8; 23];
    let err = fill_box(&meta, &region, &mut short).unwrap_err();
    assert!(matches!(
        err,
        SynthError::BufferLength {
            expected: 24,
            actual: 23,
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        "tensor model.tiny.weight: [1..3, 1..4] needs a buffer of 24 bytes, got 23"
    );
    let outside = TensorBox::new(vec![2, 0], vec![2, 5]);
    let err = box_bytes(&meta, &outside).unwrap_err();
    assert_eq!(
        err.to_string(),
        "tensor model.tiny.weight: box [2..4, 0..5] lies outside the shape [3, 5]"
    );
    let huge = TensorBox::new(vec![u64::MAX, 0], vec![2, 5]);
    assert!(matches!(
        check_box(&meta, &huge, &[]),
        Err(SynthError::RegionOutsideShape { .. })
    ));
    let wrong_rank = TensorBox::new(vec![0], vec![3]);
    assert!(matches!(
        fill_box(&meta, &wrong_rank, &mut []),
        Err(SynthError::RegionRank { ndim: 2, .. })
    ));
    assert!(matches!(
        fill_flat(&meta, 4, 16, &mut [0u8; 48]),
        Err(SynthError::FlatRange { numel: 15, .. })
    ));
    assert!(matches!(
        flat_bytes(&meta, 5, 4),
        Err(SynthError::FlatRange { .. })
    ));
    assert!(matches!(
        check_flat(&meta, 0, 2, &[0u8; 7]),
        Err(SynthError::BufferLength { .. })
    ));
    // An empty box at the end of a dim is fine and holds nothing.
    let empty = TensorBox::new(vec![3, 0], vec![0, 5]);
    fill_box(&meta, &empty, &mut []).unwrap();
    check_box(&meta, &empty, &[]).unwrap();
}

/// The dtypes the fixtures do not cover follow the documented definitions, derived from `x`.
#[test]
fn other_dtypes_follow_their_documented_definitions() {
    let fqn = "model.layers.0.extra";
    let seed = element_seed(fqn);
    let n = 4096u64;
    let xs: Vec<u32> = (0..n).map(|i| hash32(seed, i)).collect();
    let f32_meta = TensorMeta::new(fqn, DType::F32, vec![n]);
    let f32s = flat_bytes(&f32_meta, 0, n).unwrap();
    let i64_meta = TensorMeta::new(fqn, DType::I64, vec![n]);
    let i64s = flat_bytes(&i64_meta, 0, n).unwrap();
    for dtype in DType::ALL {
        let meta = TensorMeta::new(fqn, dtype, vec![n]);
        let bytes = flat_bytes(&meta, 0, n).unwrap();
        let size = usize::try_from(dtype.size()).unwrap();
        for (i, x) in xs.iter().copied().enumerate() {
            let got = &bytes[i * size..(i + 1) * size];
            let b = x.to_le_bytes();
            let want: Vec<u8> = match dtype {
                DType::Bool => vec![u8::from(x & 1 == 1)],
                DType::U8 | DType::I8 => vec![b[0]],
                DType::U16 | DType::I16 => b[..2].to_vec(),
                DType::U32 | DType::I32 => b.to_vec(),
                DType::U64 | DType::I64 => (i64::from(x) * 1_000_003 - (1 << 41))
                    .to_le_bytes()
                    .to_vec(),
                DType::F64 => {
                    let v = f32::from_le_bytes(f32s[i * 4..i * 4 + 4].try_into().unwrap());
                    f64::from(v).to_le_bytes().to_vec()
                }
                DType::F8E4m3fn => vec![if b[0] & 0x7F == 0x7F { b[0] - 1 } else { b[0] }],
                DType::F8E5m2 => vec![if b[0] & 0x7C == 0x7C { b[0] - 4 } else { b[0] }],
                DType::F8E4m3fnuz | DType::F8E5m2fnuz => {
                    vec![if b[0] == 0x80 { 0 } else { b[0] }]
                }
                DType::F32 | DType::F16 | DType::Bf16 => continue,
            };
            assert_eq!(got, want.as_slice(), "{dtype} element {i}");
        }
        if matches!(dtype, DType::U64) {
            assert!(bytes == i64s);
        }
    }
}

/// Pins the bytes of every dtype (including tessera's own extensions) so that a change of the
/// formula cannot go unnoticed. The digests were recorded from this implementation after the
/// fixture and definition tests above passed; they guard against regressions, not correctness.
#[test]
fn every_dtype_has_pinned_bytes() {
    let pinned: BTreeMap<DType, &str> = PINNED_SHA256
        .iter()
        .map(|(name, sha)| (DType::parse(name).unwrap(), *sha))
        .collect();
    let got: Vec<(DType, String)> = DType::ALL
        .iter()
        .map(|&dtype| {
            let meta = TensorMeta::new("synth.pinned", dtype, vec![33, 31]);
            (
                dtype,
                sha256_hex(&box_bytes(&meta, &meta.full_box()).unwrap()),
            )
        })
        .collect();
    for (dtype, sha) in &got {
        assert_eq!(sha, pinned[dtype], "{dtype}");
    }
}

const PINNED_SHA256: [(&str, &str); 17] = [
    (
        "bool",
        "a0861158e735dcd9d9a13b44138849e5a8e4e4ce6180caa9ea5f8b540c3a7d31",
    ),
    (
        "u8",
        "92e2f63d1eb6e0137615edf9e4eabcd90cf4a9afe6da4ac1e42938595a42bca8",
    ),
    (
        "u16",
        "acfce0f1c0c51be9e85556e331d5fe25794305e940ac4c026a0e73a6d827d8ff",
    ),
    (
        "u32",
        "4ec0829ce0a514b7904b9b4279cdcb9a324842e282d22b8864c97b241c0c84e7",
    ),
    (
        "u64",
        "44d3b6d80238cde9e115d2a12d177be3caed3ecad7d7c99430d59f4240a534bd",
    ),
    (
        "i8",
        "92e2f63d1eb6e0137615edf9e4eabcd90cf4a9afe6da4ac1e42938595a42bca8",
    ),
    (
        "i16",
        "acfce0f1c0c51be9e85556e331d5fe25794305e940ac4c026a0e73a6d827d8ff",
    ),
    (
        "i32",
        "4ec0829ce0a514b7904b9b4279cdcb9a324842e282d22b8864c97b241c0c84e7",
    ),
    (
        "i64",
        "44d3b6d80238cde9e115d2a12d177be3caed3ecad7d7c99430d59f4240a534bd",
    ),
    (
        "f16",
        "2c4cc980a8e244d02ccf7f13352f886b95c60ed7507904187b4cb12f565c14f7",
    ),
    (
        "bf16",
        "0a7c03fac6700784eb2fa35acfac0ab17f624bdd8bec41420ac3380fb0091eb6",
    ),
    (
        "f32",
        "14bfa404c0bbf2c1b145bff2a32678f28182d9e8f4962358a02ba9a733f5e614",
    ),
    (
        "f64",
        "4efe8b2489f8e3275b9d8179516232a0ad1e320a8425c21a2177c7ad314f925c",
    ),
    (
        "f8_e4m3fn",
        "9523eebc60e33f32f531a4e16a9e9f6c908f96f0a2d82b27551908d46ff357a7",
    ),
    (
        "f8_e5m2",
        "cdacde318ed1a9e8b6c5cd00112847d1b791c04f3a1a7e1ab25ab2e0e2cc93a6",
    ),
    (
        "f8_e4m3fnuz",
        "35a47df88a3d170fa153149c176ea1b90060d3d808886f0b3658eb7212c7c398",
    ),
    (
        "f8_e5m2fnuz",
        "35a47df88a3d170fa153149c176ea1b90060d3d808886f0b3658eb7212c7c398",
    ),
];

fn tensor_and_box() -> impl Strategy<Value = (String, TensorBox)> {
    let names: Vec<String> = reference().keys().cloned().collect();
    proptest::sample::select(names).prop_flat_map(|fqn| {
        let shape = reference()[fqn.as_str()].meta.shape.clone();
        let dims: Vec<_> = shape
            .iter()
            .map(|&n| (0..=n).prop_flat_map(move |start| (Just(start), 0..=n - start)))
            .collect();
        (Just(fqn), dims).prop_map(|(fqn, ranges)| {
            let (offsets, lengths): (Vec<u64>, Vec<u64>) = ranges.into_iter().unzip();
            (fqn, TensorBox::new(offsets, lengths))
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn any_box_of_any_fixture_tensor_is_generated_and_checked((fqn, region) in tensor_and_box()) {
        let stored = &reference()[fqn.as_str()];
        let want = extract(&stored.meta, &stored.bytes, &region);
        let got = box_bytes(&stored.meta, &region).unwrap();
        prop_assert!(got == want, "{} {}", fqn, region);
        prop_assert!(check_box(&stored.meta, &region, &want).is_ok());
    }
}

/// Release-mode throughput of the generator, printed (no timed assertion):
/// `cargo test --release -p tessera-metadata --test synth_formula -- --ignored --nocapture`.
#[test]
#[ignore = "measurement; run in release with --nocapture"]
fn fill_throughput() {
    for dtype in [DType::Bf16, DType::F32, DType::F16, DType::I64] {
        let meta = TensorMeta::new("model.layers.0.mlp.fc1.weight", dtype, vec![4096, 4096]);
        let numel = meta.numel();
        let mut out = vec![0u8; usize::try_from(meta.nbytes()).unwrap()];
        fill_flat(&meta, 0, numel, &mut out).unwrap(); // warm up, page in
        let rounds = 5;
        let start = std::time::Instant::now();
        for _ in 0..rounds {
            fill_box(&meta, &meta.full_box(), &mut out).unwrap();
        }
        let flat = start.elapsed().as_secs_f64();
        // A column half: 4096 runs of 2048 elements.
        let half = TensorBox::new(vec![0, 2048], vec![4096, 2048]);
        let mut half_out = vec![0u8; out.len() / 2];
        let start = std::time::Instant::now();
        for _ in 0..rounds {
            fill_box(&meta, &half, &mut half_out).unwrap();
        }
        let boxed = start.elapsed().as_secs_f64();
        let start = std::time::Instant::now();
        for _ in 0..rounds {
            check_box(&meta, &meta.full_box(), &out).unwrap();
        }
        let checked = start.elapsed().as_secs_f64();
        let melems = |n: u64, s: f64| (n * rounds) as f64 / s / 1e6;
        println!(
            "{dtype}: fill whole {:.0} M elem/s, fill column half {:.0} M elem/s, check {:.0} M elem/s",
            melems(numel, flat),
            melems(numel / 2, boxed),
            melems(numel, checked),
        );
    }
}
