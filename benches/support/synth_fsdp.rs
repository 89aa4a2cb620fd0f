//! The loading benchmarks' checkpoint: a synthetic model with optimizer states, saved FSDP over
//! 4 ranks in a temporary directory (native format), then opened for loading.

use std::time::Instant;

use tessera_loader::checkpoint::Checkpoint;
use tessera_metadata::formats::native::Manifest;
use tessera_planner::presets::fsdp;
use tessera_synth::Model;
use tessera_synth::{SynthOptions, synthesize};

/// A written and opened benchmark checkpoint; the directory goes when it drops.
// Each bench binary compiles this module and reads only what it needs of it.
#[allow(dead_code)]
pub struct BenchCheckpoint {
    /// Keeps the files.
    pub dir: tempfile::TempDir,
    /// Its location.
    pub location: String,
    /// Bytes of its data files.
    pub bytes: u64,
    /// Its manifest (the data files).
    pub manifest: Manifest,
    /// Seconds the synthesis took.
    pub synth_seconds: f64,
    /// Opened for loading.
    pub checkpoint: Checkpoint,
}

/// Writes `model` with optimizer states saved `fsdp --dp 4` and opens it.
pub fn synth_fsdp4(runtime: &tokio::runtime::Runtime, model: Model) -> BenchCheckpoint {
    let dir = tempfile::tempdir().unwrap();
    let location = dir.path().join("run/step-000001").display().to_string();
    let store = tessera_storage::create(&location).unwrap();
    let started = Instant::now();
    let manifest = runtime
        .block_on(synthesize(
            store.store.clone(),
            &store.prefix,
            &store.display,
            &fsdp(4).unwrap(),
            &SynthOptions {
                model,
                optimizer: true,
                metadata_only: false,
                dist_optimizer: None,
                step: Some(1),
                progress: None,
            },
        ))
        .unwrap();
    let synth_seconds = started.elapsed().as_secs_f64();
    let checkpoint = runtime
        .block_on(Checkpoint::open(tessera_storage::open(&location).unwrap()))
        .unwrap();
    BenchCheckpoint {
        dir,
        bytes: manifest.files.iter().map(|f| f.size).sum(),
        manifest,
        location,
        synth_seconds,
        checkpoint,
    }
}
