//! Megatron-Core's additions to DCP never panic the reader: the 0.15 `.metadata` (MCoreMetadata
//! with `mcore_data` and `MCoreSavePlan`s) mutated (byte flips, opcode bytes, insertions,
//! deletions, truncations) through `parse_metadata` and the reformulation check of every tensor;
//! `metadata.json` mutated; the reformulation rule fed arbitrary shapes and chunks (whatever it
//! accepts lies inside the original shape). The same entry points as the cargo-fuzz target
//! `fuzz/fuzz_targets/megatron.rs`.
#![allow(clippy::unwrap_used, missing_docs)]

mod mutation_support;

use mutation_support::{edit, mutate};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use tessera_metadata::formats::dcp::megatron::{Reformulation, parse_config, reformulations};
use tessera_metadata::formats::dcp::parse_metadata;
use tessera_metadata::formats::torch::pickle::Limits;

fn fixture() -> PathBuf {
    std::env::var_os("TESSERA_INTEROP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/interop")
        })
        .join("megatron_core_0.15.3_tp2dp2_flat/ckpt")
}

fn metadata() -> &'static Vec<u8> {
    static BYTES: OnceLock<Vec<u8>> = OnceLock::new();
    BYTES.get_or_init(|| std::fs::read(fixture().join(".metadata")).unwrap())
}

/// Where `mcore_data` starts in the pickle: mutations there hit Megatron's part.
fn mcore_start() -> usize {
    let bytes = metadata();
    bytes.windows(10).position(|w| w == b"mcore_data").unwrap()
}

/// What the reader does with a `.metadata` before any IO: parse, then check every tensor
/// against the reformulation rule.
fn read(bytes: &[u8]) {
    if let Ok(metadata) = parse_metadata(bytes, "fuzz", &Limits::METADATA) {
        let _ = reformulations(&metadata, "fuzz");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn mutated_mcore_metadata_never_panics(edits in prop::collection::vec(edit(), 1..6)) {
        read(&mutate(metadata(), &edits, 0..usize::MAX));
    }

    #[test]
    fn mutated_mcore_data_never_panics(edits in prop::collection::vec(edit(), 1..6)) {
        read(&mutate(metadata(), &edits, mcore_start()..usize::MAX));
    }

    #[test]
    fn mutated_metadata_json_never_panics(edits in prop::collection::vec(edit(), 1..4)) {
        let base = std::fs::read(fixture().join("metadata.json")).unwrap();
        let _ = parse_config(&mutate(&base, &edits, 0..usize::MAX), "fuzz");
    }

    #[test]
    fn the_reformulation_rule_accepts_only_boxes_inside_the_original_shape(
        stored in prop::collection::vec(0u64..8, 0..5),
        orig in prop::collection::vec(0u64..24, 0..4),
        offsets in prop::collection::vec(0u64..10, 0..5),
        sizes in prop::collection::vec(0u64..10, 0..5),
    ) {
        if let Ok(r) = Reformulation::new(&stored, &orig) {
            prop_assert_eq!(&r.shape, &orig);
            if let Ok((parent, start, end)) = r.chunk(&offsets, &sizes) {
                prop_assert!(start <= end && end <= parent.numel());
                for (d, &g) in orig.iter().enumerate() {
                    prop_assert!(parent.end(d) <= g);
                }
            }
        }
    }
}

#[test]
fn the_sample_reads_unmutated() {
    let metadata = parse_metadata(metadata(), "sample", &Limits::METADATA).unwrap();
    let r = reformulations(&metadata, "sample").unwrap();
    assert_eq!(r.iter().filter(|r| r.is_some()).count(), 30);
}
