//! `tessera load --transport tcp|nccl` without `--rank`: every rank as its own process on this
//! machine (`tessera load-rank`, the job's arguments whole from a file), supervised so that a
//! rank that fails, dies or stops ends the whole load within about twice the peer timeout, each
//! rank named with what became of it.

use std::time::Duration;

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
    world: u32,
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
        let report = reports_dir.path().join(format!("rank-{rank}.json"));
        let mut cmd = tokio::process::Command::new(&exe);
        cmd.arg("load-rank")
            .arg(&args_file)
            .args(["--rank", &rank.to_string()])
            .args(["--master-port", &port.to_string()])
            .arg("--report-json")
            .arg(&report);
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
        children.push((rank, report, child));
    }
    let outcomes = supervise(children, args.peer_timeout).await;
    let mut failures = Vec::new();
    let mut classes = Vec::new();
    let mut reports = Vec::new();
    let mut planned = None;
    for (rank, report, outcome) in outcomes {
        match outcome {
            RankOutcome::Succeeded => {
                let text = std::fs::read(&report)
                    .with_context(|| format!("reading rank {rank}'s report"))?;
                let parse = || -> Result<(RankReport, PlanSummary, f64)> {
                    let json: serde_json::Value = serde_json::from_slice(&text)?;
                    let plan_seconds = json["plan_seconds"].as_f64().unwrap_or(0.0);
                    let summary = serde_json::from_value(json["plan"].clone())?;
                    Ok((serde_json::from_value(json)?, summary, plan_seconds))
                };
                let (report, summary, plan_seconds) =
                    parse().with_context(|| format!("parsing rank {rank}'s report"))?;
                reports.push(report);
                planned.get_or_insert((summary, plan_seconds));
            }
            RankOutcome::Failed(message) => {
                // Killed or vanished: to its peers, a peer that failed.
                classes.push(crate::exit::ErrorClass::PeerFailed);
                failures.push(format!("rank {rank}: {message}"));
            }
            RankOutcome::Exited(message, code) => {
                classes.push(crate::exit::ErrorClass::from_code(code));
                failures.push(format!("rank {rank}: {message}"));
            }
        }
    }
    if !failures.is_empty() {
        // Its own type: the exit code is that of the rank whose trouble made the others fail
        // (each rank process exits with its own class's code).
        return Err(crate::exit::RanksFailed {
            failures,
            class: crate::exit::root_class(classes),
        }
        .into());
    }
    let (summary, plan_seconds) = planned.context("a job of no ranks")?;
    Ok(Loaded {
        reports,
        summary,
        plan_seconds,
    })
}

/// How one rank process ended.
enum RankOutcome {
    Succeeded,
    /// Its error, or what became of it when it left none.
    Failed(String),
    /// Its error, and the exit code it chose (which says the class of its failure).
    Exited(String, i32),
}

/// Waits for every rank process, all at once, reading their stderr as they go (a full pipe
/// would block a rank). A rank that stops making progress (SIGSTOPped, hung in a syscall) never
/// exits and its peers only time out on it; waiting for it would hang `load` forever. So once
/// any rank has failed, the others get `grace` (the peer timeout: every live rank that waits on a
/// failed one fails by itself within it) and are then killed, each reported with what became of
/// it. The parent therefore ends within about twice the peer timeout of the first failure.
async fn supervise(
    mut children: Vec<(u32, std::path::PathBuf, tokio::process::Child)>,
    grace: Duration,
) -> Vec<(u32, std::path::PathBuf, RankOutcome)> {
    use futures::StreamExt;
    let (kill_tx, kill_rx) = tokio::sync::watch::channel(false);
    let mut waits = futures::stream::FuturesUnordered::new();
    for (index, (rank, _, child)) in children.iter_mut().enumerate() {
        let rank = *rank;
        let stderr = child.stderr.take();
        let mut kill_rx = kill_rx.clone();
        let pid = child.id();
        waits.push(async move {
            let read_stderr = async {
                let mut text = String::new();
                if let Some(pipe) = stderr {
                    use tokio::io::AsyncBufReadExt;
                    let mut lines = tokio::io::BufReader::new(pipe).lines();
                    // A killed rank's pipe closes with it; a read error only loses its message.
                    while let Ok(Some(line)) = lines.next_line().await {
                        // Progress ("rank 0: waiting for ranks 2,3 to join") and the
                        // rendezvous's refusals of connections that are not the job's are
                        // passed on as they come, so that a waiting load is not silent.
                        // So are rank 0's word on the memory tier's copies it did not take
                        // (every rank here shares this host's tier and its verdicts).
                        if (line.starts_with("rank ")
                            && (line.contains(": waiting for ")
                                || line.ends_with("; still waiting for this job's ranks")))
                            || (rank == 0 && line.starts_with("warning: memory tier"))
                        {
                            eprintln!("{line}");
                        } else {
                            text.push_str(&line);
                            text.push('\n');
                        }
                    }
                }
                text
            };
            let wait = async {
                tokio::select! {
                    status = child.wait() => (status, None),
                    _ = kill_rx.wait_for(|kill| *kill) => {
                        // Seen before the kill: a SIGSTOPped rank shows state T.
                        let state = pid.and_then(process_state);
                        let _ = child.start_kill();
                        (child.wait().await, Some(state))
                    }
                }
            };
            let (text, (status, killed)) = tokio::join!(read_stderr, wait);
            (index, rank, rank_outcome(status, killed, &text, grace))
        });
    }
    let mut outcomes: Vec<Option<RankOutcome>> = (0..waits.len()).map(|_| None).collect();
    let mut kill_at: Option<tokio::time::Instant> = None;
    loop {
        let next = match kill_at {
            Some(at) => match tokio::time::timeout_at(at, waits.next()).await {
                Ok(next) => next,
                Err(_) => {
                    let _ = kill_tx.send(true);
                    kill_at = None;
                    continue;
                }
            },
            None => waits.next().await,
        };
        let Some((index, _rank, outcome)) = next else {
            break;
        };
        if matches!(outcome, RankOutcome::Failed(_) | RankOutcome::Exited(..))
            && kill_at.is_none()
            && !*kill_tx.borrow()
        {
            kill_at = Some(tokio::time::Instant::now() + grace);
        }
        outcomes[index] = Some(outcome);
    }
    drop(waits);
    children
        .into_iter()
        .zip(outcomes)
        .map(|((rank, report, _), outcome)| {
            let outcome = outcome.unwrap_or_else(|| {
                RankOutcome::Failed("its process could not be waited for".to_string())
            });
            (rank, report, outcome)
        })
        .collect()
}

/// What became of a rank process: success, its own error message, or (when it left none) how it
/// ended: killed by us after the grace period (and whether it was stopped then), killed by a
/// signal from elsewhere, or an exit code.
fn rank_outcome(
    status: std::io::Result<std::process::ExitStatus>,
    killed: Option<Option<char>>,
    stderr: &str,
    grace: Duration,
) -> RankOutcome {
    let status = match status {
        Ok(status) if status.success() => return RankOutcome::Succeeded,
        Ok(status) => status,
        Err(e) => return RankOutcome::Failed(format!("waiting for its process failed: {e}")),
    };
    let message = stderr.trim().trim_start_matches("error: ");
    if let Some(state) = killed {
        let how = match state {
            Some('T') | Some('t') => "stopped (SIGSTOP or a debugger)",
            _ => "still running",
        };
        let mut line = format!(
            "{how} {:.0} s after another rank failed: killed by signal 9, no report",
            grace.as_secs_f64()
        );
        if !message.is_empty() {
            line.push_str(&format!(" (it had printed: {message})"));
        }
        return RankOutcome::Failed(line);
    }
    if !message.is_empty() {
        return match status.code() {
            Some(code) => RankOutcome::Exited(message.to_string(), code),
            None => RankOutcome::Failed(message.to_string()),
        };
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            return RankOutcome::Failed(format!("killed by signal {signal}, no report"));
        }
    }
    match status.code() {
        Some(code) => RankOutcome::Exited(format!("exited with code {code}, no report"), code),
        None => RankOutcome::Failed("ended without an exit code, no report".to_string()),
    }
}

/// The state letter of process `pid` (`R`, `S`, `T` for stopped, ...) from `/proc`, where there
/// is one.
fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": comm may hold spaces and parentheses, so look after the last ')'.
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}
