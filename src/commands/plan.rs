//! `tessera plan`: plan a checkpoint for a layout or explicit requests; print the summary or
//! one rank's plan (text, JSON or Arrow IPC).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Result, bail};
use tessera_planner::{PlanOptions, PlanSummary, RankPlan, Target, plan};

use crate::human;

/// Output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// Human-readable text (the summary, or a rank plan's reads, buffers and exchanges).
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
    /// Most bytes planning may take by the planner's estimate (`--plan-memory-mib`).
    pub plan_memory_bytes: u64,
    /// Timeouts and attempts of the checkpoint's store.
    pub retry: tessera_storage::RetryPolicy,
}

/// Runs the command; returns what goes to stdout.
pub async fn run(args: &PlanArgs) -> Result<Vec<u8>> {
    let checkpoint = super::open(&args.checkpoint, &args.retry).await?;
    let meta = Arc::new(checkpoint.meta);
    let options = PlanOptions {
        dedup: !args.no_dedup,
        ..PlanOptions::default()
    };
    let bound = super::target::PlanBound {
        options: &options,
        bytes: args.plan_memory_bytes,
    };
    let requests = super::target::resolve(
        &args.checkpoint,
        (args.layout.as_deref(), args.requests.as_deref()),
        &meta,
        Some(bound),
        true,
    )?;
    let started = Instant::now();
    let plan = plan(&meta, &requests, &options)?;
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
        Format::Text => rank_plan_text(&rank_plan).into_bytes(),
        Format::Json => {
            let mut out = rank_plan.to_json().into_bytes();
            out.push(b'\n');
            out
        }
        Format::Arrow => rank_plan.to_arrow_ipc()?,
    })
}

/// One rank's plan for people: its totals, what it reads from each file, every destination
/// buffer (tensor, part, size, and whether it reads the bytes itself or receives them), and
/// its exchange partners. The whole plan, to execute or diff, is `--format json` or `arrow`.
pub fn rank_plan_text(plan: &RankPlan) -> String {
    use std::collections::BTreeMap;
    use std::fmt::Write as _;

    let s = &plan.summary;
    let read_here = plan.pieces.iter().filter(|p| p.read.is_some()).count();
    let rounds: usize = plan.exchanges.iter().map(|e| e.rounds.len()).sum();
    let mut out = String::new();
    let _ = write!(
        out,
        "rank {} of {}\n\
         destinations         {} ({})\n\
         pieces               {} ({} read here, {} received)\n\
         bytes read           {} from {}\n\
         bytes sent           {}\n\
         bytes received       {}\n\
         exchanges            {}, {}\n",
        plan.rank,
        plan.world,
        plan.destinations.len(),
        human::bytes(s.bytes_needed),
        plan.pieces.len(),
        read_here,
        plan.pieces.len() - read_here,
        human::bytes(s.bytes_read),
        count(plan.files.len(), "file"),
        human::bytes(s.bytes_sent),
        human::bytes(s.bytes_received),
        count(plan.exchanges.len(), "group"),
        count(rounds, "round"),
    );

    // Reads by file: pieces and bytes this rank fetches from each.
    let mut by_file: BTreeMap<u32, (usize, u64)> = BTreeMap::new();
    for piece in &plan.pieces {
        if let Some(read) = &piece.read {
            let entry = by_file.entry(read.file).or_default();
            entry.0 += 1;
            entry.1 += piece.bytes;
        }
    }
    if !by_file.is_empty() {
        out.push_str("\nreads\n");
        for (file, (pieces, bytes)) in &by_file {
            let name = plan.files.get(*file as usize).map_or("?", String::as_str);
            let _ = writeln!(out, "  {name}  {pieces} pieces, {}", human::bytes(*bytes));
        }
    }

    // Destinations: where each buffer's bytes come from (this rank's reads or peers).
    let mut sources: Vec<(usize, Vec<u32>)> = vec![(0, Vec::new()); plan.destinations.len()];
    for piece in &plan.pieces {
        for place in &piece.places {
            if let Some((own, peers)) = sources.get_mut(place.destination as usize) {
                if piece.reader == plan.rank {
                    *own += 1;
                } else if !peers.contains(&piece.reader) {
                    peers.push(piece.reader);
                }
            }
        }
    }
    if !plan.destinations.is_empty() {
        out.push_str("\ndestinations\n");
        let fqn = |t: u32| plan.tensors.get(t as usize).map_or("?", |t| t.fqn.as_str());
        let width = plan
            .destinations
            .iter()
            .map(|d| fqn(d.tensor).len())
            .max()
            .unwrap_or(0)
            .min(60);
        for (destination, (own, peers)) in plan.destinations.iter().zip(&mut sources) {
            let part = match &destination.target {
                Target::Box(region) => region.to_string(),
                Target::Flat { start, end } => format!("flat {start}..{end}"),
            };
            peers.sort_unstable();
            let from = match (*own > 0, peers.is_empty()) {
                (_, true) => "read here".to_string(),
                (own, false) => format!(
                    "{}from {} {}",
                    if own { "read here and " } else { "" },
                    if peers.len() == 1 { "rank" } else { "ranks" },
                    peers
                        .iter()
                        .map(u32::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            };
            let _ = writeln!(
                out,
                "  {:<width$}  {part}  {}  {from}",
                fqn(destination.tensor),
                human::bytes(destination.bytes),
            );
        }
    }

    // Ring partners: bytes sent to and received from each peer over all groups.
    let mut partners: BTreeMap<u32, (u64, u64)> = BTreeMap::new();
    for round in plan.exchanges.iter().flat_map(|e| &e.rounds) {
        if round.send_bytes > 0 {
            partners.entry(round.send_to).or_default().0 += round.send_bytes;
        }
        if round.recv_bytes > 0 {
            partners.entry(round.recv_from).or_default().1 += round.recv_bytes;
        }
    }
    if !partners.is_empty() {
        out.push_str("\npeers\n");
        for (peer, (sent, received)) in &partners {
            let _ = writeln!(
                out,
                "  rank {peer}  sends {}, receives {}",
                human::bytes(*sent),
                human::bytes(*received)
            );
        }
    }
    out
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

/// `1 file`, `3 files`.
fn count(n: usize, what: &str) -> String {
    if n == 1 {
        format!("1 {what}")
    } else {
        format!("{n} {what}s")
    }
}
