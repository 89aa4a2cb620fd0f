//! `tessera plan`: plan a checkpoint for a layout or explicit requests; print the summary or
//! one rank's plan (JSON or Arrow IPC).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use tessera_planner::{ExplicitRequests, PlanOptions, PlanSummary, RequestSet, plan};

use crate::human;

/// Output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Human-readable text (summary) or JSON (rank plan).
    Text,
    /// JSON.
    Json,
    /// Arrow IPC stream (rank plans only).
    Arrow,
}

/// Arguments of `tessera plan`.
#[derive(Clone, Debug)]
pub struct PlanArgs {
    /// Checkpoint location.
    pub checkpoint: String,
    /// Target layout JSON file.
    pub layout: Option<String>,
    /// Explicit requests JSON file.
    pub requests: Option<String>,
    /// One rank's plan instead of the summary.
    pub rank: Option<u32>,
    /// Output format.
    pub format: Format,
    /// Print the summary (also with `--rank`, to stderr).
    pub summary: bool,
    /// Disable read dedup.
    pub no_dedup: bool,
    /// Timeouts and attempts of the checkpoint's store.
    pub retry: tessera_storage::RetryPolicy,
}

/// Runs the command; returns what goes to stdout.
pub async fn run(args: &PlanArgs) -> Result<Vec<u8>> {
    let checkpoint = super::open(&args.checkpoint, &args.retry).await?;
    let meta = Arc::new(checkpoint.meta);
    let requests: RequestSet = match (&args.layout, &args.requests) {
        (Some(layout), None) => super::read_layout(layout)?
            .resolve(meta.tensors())
            .with_context(|| format!("resolving layout {layout} against {}", args.checkpoint))?,
        (None, Some(path)) => ExplicitRequests::from_json(&super::read_text(path)?)
            .and_then(|r| r.resolve(meta.tensors()))
            .with_context(|| format!("reading requests {path}"))?,
        _ => bail!("give exactly one of --layout or --requests"),
    };
    let started = Instant::now();
    let plan = plan(
        &meta,
        &requests,
        &PlanOptions {
            dedup: !args.no_dedup,
        },
    )?;
    let elapsed = started.elapsed().as_secs_f64();
    let Some(rank) = args.rank else {
        return Ok(match args.format {
            Format::Json => serde_json::to_vec_pretty(plan.summary())?,
            Format::Text => summary_text(plan.summary(), elapsed).into_bytes(),
            Format::Arrow => bail!("--format arrow needs --rank (Arrow IPC holds one rank's plan)"),
        });
    };
    if args.summary {
        eprint!("{}", summary_text(plan.summary(), elapsed));
    }
    let rank_plan = plan.rank_plan(rank)?;
    Ok(match args.format {
        Format::Text | Format::Json => {
            let mut out = rank_plan.to_json().into_bytes();
            out.push(b'\n');
            out
        }
        Format::Arrow => rank_plan.to_arrow_ipc()?,
    })
}

/// The summary as aligned text.
pub fn summary_text(s: &PlanSummary, seconds: f64) -> String {
    format!(
        "ranks                {}\n\
         destinations         {}\n\
         pieces               {}\n\
         exchange groups      {} (at most {} ring rounds)\n\
         bytes needed         {} (every rank's buffers)\n\
         unique bytes needed  {}\n\
         bytes read           {}\n\
         read amplification   {:.2}\n\
         bytes exchanged      {}\n\
         read per rank        max {}, mean {}\n\
         planned in           {:.3} s\n",
        s.ranks,
        s.destinations,
        s.pieces,
        s.exchange_groups,
        s.max_rounds,
        human::bytes(s.bytes_needed),
        human::bytes(s.unique_bytes_needed),
        human::bytes(s.bytes_read),
        s.read_amplification,
        human::bytes(s.bytes_exchanged),
        human::bytes(s.max_read_per_rank),
        human::bytes(s.mean_read_per_rank as u64),
        seconds,
    )
}
