//! `tessera demo`: a small synthetic catalog in a local directory, resharded on the spot.

use std::fmt::Write;
use std::sync::Arc;

use anyhow::{Context, Result};
use tessera_metadata::formats::native::read_manifest;
use tessera_planner::presets::{MegatronGpt, fsdp, megatron_gpt};
use tessera_planner::{Layout, PlanOptions, plan};
use tessera_synth::Model;

use tessera_storage as storage;
use tessera_synth::{SynthOptions, synthesize};

/// One checkpoint of the demo catalog.
struct DemoCheckpoint {
    run: &'static str,
    step: u64,
    model: Model,
    optimizer: bool,
    layout: Layout,
    /// How the report names the saved layout.
    layout_name: &'static str,
}

/// The demo catalog: gpt-tiny saved as Megatron tp2 pp2 and as FSDP dp2, two steps each (the
/// `latest` pointers follow the writes), and gpt-small without optimizer states (~310 MiB)
/// saved FSDP dp4, a size where reads and exchanges are worth looking at.
fn catalog() -> Result<Vec<DemoCheckpoint>> {
    let tiny = Model::GptTiny.config();
    let megatron = |tp, pp| {
        megatron_gpt(MegatronGpt {
            tp,
            pp,
            dp: 1,
            num_layers: tiny.num_layers,
            zero1: false,
        })
    };
    let mut out = Vec::new();
    for step in [100, 200] {
        out.push(DemoCheckpoint {
            run: "gpt-tiny",
            step,
            model: Model::GptTiny,
            optimizer: true,
            layout: megatron(2, 2)?,
            layout_name: "megatron tp2 pp2",
        });
    }
    for step in [100, 200] {
        out.push(DemoCheckpoint {
            run: "gpt-tiny-fsdp",
            step,
            model: Model::GptTiny,
            optimizer: true,
            layout: fsdp(2)?,
            layout_name: "fsdp dp2",
        });
    }
    out.push(DemoCheckpoint {
        run: "gpt-small",
        step: 1000,
        model: Model::GptSmall,
        optimizer: false,
        layout: fsdp(4)?,
        layout_name: "fsdp dp4",
    });
    Ok(out)
}

/// Creates the demo catalog in `dir` (each checkpoint only when absent, so a second run is
/// quick), then plans `<dir>/gpt-tiny/step-000100` for other layouts and reports what each
/// would read and exchange.
pub async fn run(dir: &str) -> Result<String> {
    let mut out = String::new();
    let root = dir.trim_end_matches('/');
    for c in catalog()? {
        let path = format!("{root}/{}/step-{:06}", c.run, c.step);
        let location = storage::create(&path)?;
        if read_manifest(location.store.as_ref(), &location.prefix)
            .await
            .is_ok()
        {
            writeln!(out, "using {path}")?;
            continue;
        }
        synthesize(
            location.store.clone(),
            &location.prefix,
            &location.display,
            &c.layout,
            &SynthOptions {
                model: c.model,
                optimizer: c.optimizer,
                metadata_only: false,
                dist_optimizer: None,
                step: Some(c.step),
                progress: None,
            },
        )
        .await
        .with_context(|| format!("creating {path}"))?;
        writeln!(
            out,
            "created {path} ({} {}, saved {})",
            c.model.name(),
            if c.optimizer {
                "with optimizer states"
            } else {
                "without optimizer states"
            },
            c.layout_name
        )?;
    }
    let ckpt = format!("{root}/gpt-tiny/step-000100");
    let config = Model::GptTiny.config();
    let checkpoint = super::open(&ckpt, &tessera_storage::RetryPolicy::default()).await?;
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
