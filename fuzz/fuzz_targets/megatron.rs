//! Megatron-Core's additions to DCP: the `.metadata` interpreter with `mcore_data` and save plans,
//! the reformulation rule checked for every tensor, `metadata.json`. Corpus: the 0.15 fixture's
//! `.metadata` and `metadata.json`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_metadata::formats::dcp::megatron::{parse_config, reformulations};
use tessera_metadata::formats::dcp::parse_metadata;
use tessera_metadata::formats::torch::pickle::Limits;

fuzz_target!(|data: &[u8]| {
    if let Ok(metadata) = parse_metadata(data, "fuzz", &Limits::METADATA) {
        let _ = reformulations(&metadata, "fuzz");
    }
    let _ = parse_config(data, "fuzz");
});
