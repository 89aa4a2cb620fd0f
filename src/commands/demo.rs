//! `tessera demo`: a small synthetic catalog in a local directory, resharded on the spot.

use std::fmt::Write;
use std::sync::Arc;

use anyhow::Result;
use tessera_metadata::native::read_manifest;
use tessera_metadata::synth::Model;
use tessera_planner::presets::{MegatronGpt, fsdp, megatron_gpt};
use tessera_planner::{PlanOptions, plan};

use crate::storage;
use crate::synth::{SynthOptions, synthesize};

/// Creates `<dir>/gpt-tiny/step-000100` (saved Megatron tp2 pp2) if absent, then plans it for
/// other layouts and reports what each would read and exchange.
pub async fn run(dir: &str) -> Result<String> {
    let mut out = String::new();
    let ckpt = format!("{}/gpt-tiny/step-000100", dir.trim_end_matches('/'));
    let location = storage::create(&ckpt)?;
    let config = Model::GptTiny.config();
    let saved_layout = megatron_gpt(MegatronGpt {
        tp: 2,
        pp: 2,
        dp: 1,
        num_layers: config.num_layers,
        zero1: false,
    })?;
    if read_manifest(location.store.as_ref(), &location.prefix)
        .await
        .is_err()
    {
        synthesize(
            &location,
            &saved_layout,
            &SynthOptions {
                model: Model::GptTiny,
                optimizer: true,
                metadata_only: false,
                step: Some(100),
                progress: false,
            },
        )
        .await?;
        writeln!(
            out,
            "created {ckpt} (gpt-tiny with optimizer states, saved megatron tp2 pp2)"
        )?;
    } else {
        writeln!(out, "using {ckpt}")?;
    }
    let checkpoint = super::open(&ckpt).await?;
    let meta = Arc::new(checkpoint.meta);
    let targets = [
        ("fsdp dp4", fsdp(4)?),
        (
            "megatron tp1 pp1 dp2",
            megatron_gpt(MegatronGpt {
                tp: 1,
                pp: 1,
                dp: 2,
                num_layers: config.num_layers,
                zero1: false,
            })?,
        ),
        (
            "megatron tp4 pp1 dp2 zero1",
            megatron_gpt(MegatronGpt {
                tp: 4,
                pp: 1,
                dp: 2,
                num_layers: config.num_layers,
                zero1: true,
            })?,
        ),
    ];
    for (name, layout) in targets {
        let requests = layout.resolve(meta.tensors())?;
        let started = std::time::Instant::now();
        let p = plan(&meta, &requests, &PlanOptions::default())?;
        writeln!(out, "\nreshard to {name}:")?;
        out.push_str(&super::plan::summary_text(
            p.summary(),
            started.elapsed().as_secs_f64(),
        ));
    }
    writeln!(out, "\nnext: tessera inspect {ckpt}")?;
    writeln!(
        out,
        "      tessera layout fsdp --dp 3 > l.json && tessera plan {ckpt} --layout l.json --rank 0"
    )?;
    Ok(out)
}
