//! `tessera load --transport tcp|nccl` without `--rank`: every rank as its own process on this
//! machine (`tessera load-rank`, the job's arguments whole from a file), supervised
//! (`crate::ranks`) so that a rank that fails, dies or stops ends the whole load within about
//! twice the peer timeout, each rank named with what became of it.

use anyhow::{Context, Result};
use tessera_loader::load::RankReport;
use tessera_planner::PlanSummary;

use super::{LoadArgs, Loaded};

/// The environment variable of the plan server's bearer token (`--token`).
pub const TOKEN_ENV: &str = "TESSERA_TOKEN";

/// The arguments of one spawned rank (`tessera load-rank ARGS --rank R --master-port P
/// --report-json PATH`): the job's, as its parent wrote them to `args_file`, with this rank's
/// own and the token from [`TOKEN_ENV`].
pub fn rank_args(
    args_file: &std::path::Path,
    rank: u32,
    master_port: u16,
    report_json: String,
) -> Result<LoadArgs> {
    let text = std::fs::read(args_file)
        .with_context(|| format!("reading the load's arguments {}", args_file.display()))?;
    let args: LoadArgs = serde_json::from_slice(&text).with_context(|| {
        format!(
            "{}: not the arguments of a load as `tessera load` writes them for its ranks",
            args_file.display()
        )
    })?;
    Ok(LoadArgs {
        rank: Some(rank),
        master_port: Some(master_port),
        report_json: Some(report_json),
        token: std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty()),
        ..args
    })
}

/// A rank's `--report-json`: its report, with the job's plan in numbers and how long planning
/// took, which the parent of spawned ranks reports the job with.
pub(super) fn write_rank_json(
    path: &str,
    report: &RankReport,
    summary: &PlanSummary,
    plan_seconds: f64,
) -> Result<()> {
    let mut json = serde_json::to_value(report)?;
    json["plan"] = serde_json::to_value(summary)?;
    json["plan_seconds"] = serde_json::json!(plan_seconds);
    std::fs::write(path, serde_json::to_vec(&json)?).with_context(|| format!("writing {path}"))
}

/// The file a spawned rank's arguments are in, beside the ranks' reports.
const ARGS_FILE: &str = "args.json";

/// Runs every rank as its own process (`tessera load-rank`), rendezvousing on a free loopback
/// port. The ranks take this job's arguments whole (written once as JSON), so that a rank
/// process loads as a rank of this process would, flag for flag; only its rank, the port and
/// where its report goes are its own.
pub(super) async fn load_all_spawned(
    args: &LoadArgs,
    (world, peer_timeout): (u32, std::time::Duration),
    shared_cache: Option<&std::path::Path>,
) -> Result<Loaded> {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("finding a free port")?;
        listener.local_addr()?.port()
    };
    let reports_dir = tempfile::tempdir().context("creating a report directory")?;
    // Every rank is one of `world` meeting on loopback; it says nothing itself (the parent
    // reports the job) and writes no metrics file (the parent writes the job's).
    let rank_args = LoadArgs {
        rank: None,
        world: Some(world),
        master_addr: Some("127.0.0.1".to_string()),
        master_port: None,
        quiet: true,
        json: false,
        report_json: None,
        metrics_file: None,
        ..args.clone()
    };
    let args_file = reports_dir.path().join(ARGS_FILE);
    std::fs::write(&args_file, serde_json::to_vec_pretty(&rank_args)?)
        .with_context(|| format!("writing the ranks' arguments {}", args_file.display()))?;
    let exe = std::env::current_exe().context("locating the tessera binary")?;
    let mut children = Vec::with_capacity(world as usize);
    for rank in 0..world {
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.arg("load-rank")
            .arg(&args_file)
            .args(["--rank", &rank.to_string()])
            .args(["--master-port", &port.to_string()])
            .arg("--report-json")
            .arg(reports_dir.path().join(format!("rank-{rank}.json")));
        // Not in the file: a token is a secret.
        if let Some(token) = &args.token {
            cmd.env(TOKEN_ENV, token);
        }
        if let Some(dir) = shared_cache {
            cmd.env(crate::commands::CACHE_DIR_ENV, dir);
        }
        cmd.stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let child = cmd
            .spawn()
            .with_context(|| format!("starting rank {rank}"))?;
        children.push((rank, child));
    }
    let reports = crate::ranks::supervise(children, peer_timeout, pass_on, |rank| {
        read_rank_json(&reports_dir.path().join(format!("rank-{rank}.json")), rank)
    })
    .await?;
    let (summary, plan_seconds) = reports
        .first()
        .map(|(_, summary, seconds)| (summary.clone(), *seconds))
        .context("a job of no ranks")?;
    Ok(Loaded {
        reports: reports.into_iter().map(|(report, ..)| report).collect(),
        summary,
        plan_seconds,
    })
}

/// Whether a line a rank process wrote to stderr is passed on as it comes: progress ("rank 0:
/// waiting for ranks 2,3 to join") and the rendezvous's refusals of connections that are not the
/// job's, so that a waiting load is not silent; and rank 0's word on the memory tier's copies it
/// did not take (every rank here shares this host's tier and its verdicts). The rest is the
/// rank's message should it fail.
fn pass_on(rank: u32, line: &str) -> bool {
    (line.starts_with("rank ")
        && (line.contains(": waiting for ")
            || line.ends_with("; still waiting for this job's ranks")))
        || (rank == 0 && line.starts_with("warning: memory tier"))
}

/// What rank `rank` wrote to its `--report-json` ([`write_rank_json`]): its report, the job's
/// plan in numbers and how long planning took.
fn read_rank_json(path: &std::path::Path, rank: u32) -> Result<(RankReport, PlanSummary, f64)> {
    let text = std::fs::read(path).with_context(|| format!("reading rank {rank}'s report"))?;
    let parse = || -> Result<(RankReport, PlanSummary, f64)> {
        let json: serde_json::Value = serde_json::from_slice(&text)?;
        let plan_seconds = json["plan_seconds"].as_f64().unwrap_or(0.0);
        let summary = serde_json::from_value(json["plan"].clone())?;
        Ok((serde_json::from_value(json)?, summary, plan_seconds))
    };
    parse().with_context(|| format!("parsing rank {rank}'s report"))
}
