//! Which model a benchmark runs: `TESSERA_BENCH_MODEL`, or the benchmark's default.

use tessera_synth::Model;

/// The model named by `TESSERA_BENCH_MODEL`, else `default`.
pub fn bench_model(default: &str) -> Model {
    std::env::var("TESSERA_BENCH_MODEL")
        .unwrap_or_else(|_| default.to_string())
        .parse()
        .unwrap()
}
