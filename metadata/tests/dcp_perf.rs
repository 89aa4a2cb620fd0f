//! How fast a big `.metadata` parses: 200 000 chunks (2 000 tensors × 100 ranks), the size of a
//! large model's DCP checkpoint. Ignored by default; run with
//! `cargo test --release -p tessera-metadata --test dcp_perf -- --ignored --nocapture`.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::time::Instant;

use dcp_support::{ChunkSpec, MetadataStyle, TensorSpec, dcp_metadata};
use tessera_metadata::formats::dcp::parse_metadata;
use tessera_metadata::formats::torch::pickle::Limits;

#[test]
#[ignore = "timing; run in release"]
fn parse_200k_chunks() {
    let names: Vec<&'static str> = (0..2000)
        .map(|t| {
            &*Box::leak(format!("model.layers.{}.mlp.fc{}.weight", t / 4, t % 4).into_boxed_str())
        })
        .collect();
    let tensors: Vec<TensorSpec> = names
        .iter()
        .map(|&fqn| TensorSpec {
            fqn,
            dtype: "bfloat16",
            shape: vec![100 * 64, 4096],
            chunks: (0..100u64)
                .map(|r| -> ChunkSpec {
                    (
                        vec![r * 64, 0],
                        vec![64, 4096],
                        "__0_0.distcp",
                        r * 600_000,
                        525_000,
                        vec![],
                    )
                })
                .collect(),
        })
        .collect();
    let bytes = dcp_metadata(MetadataStyle::TORCH_2_15, &tensors, &[]);
    let started = Instant::now();
    let parsed = parse_metadata(&bytes, "big", &Limits::METADATA).unwrap();
    let seconds = started.elapsed().as_secs_f64();
    let chunks: usize = parsed.tensors.iter().map(|t| t.chunks.len()).sum();
    assert_eq!(chunks, 200_000);
    println!(
        "parsed {} MiB of .metadata ({chunks} chunks, {} pickle objects) in {seconds:.3} s",
        bytes.len() >> 20,
        parsed.pickle_objects
    );
}
