//! How the CLI runs a job's ranks: tasks of this process, or processes it spawned and
//! supervises. Either way they end together, and the job's error names each failed rank with
//! what became of it; its class (and so the exit code) is that of the rank whose trouble made
//! the others fail ([`crate::exit::root_class`]).

use std::time::Duration;

use anyhow::Result;

use crate::exit::{ErrorClass, RanksFailed, classify, root_class};

/// Waits for every rank's task (each in rank order) and returns what each returned; their
/// failures as one error naming each rank ([`RanksFailed`]).
pub async fn join_tasks<T>(tasks: Vec<tokio::task::JoinHandle<Result<T>>>) -> Result<Vec<T>> {
    let mut done = Vec::with_capacity(tasks.len());
    let mut failures = Vec::new();
    for (rank, task) in tasks.into_iter().enumerate() {
        match task.await {
            Ok(Ok(value)) => done.push(value),
            Ok(Err(e)) => failures.push((classify(&e), format!("rank {rank}: {e}"))),
            Err(e) => failures.push((ErrorClass::Other, format!("rank {rank}: task failed: {e}"))),
        }
    }
    ranks_failed(failures)?;
    Ok(done)
}

/// Waits for every rank process (`(rank, process)`, its stderr piped) until all have ended,
/// then takes what each left with `collect(rank)` (in the order given); their failures as one
/// error naming each rank ([`RanksFailed`]).
///
/// A rank that stops making progress (SIGSTOPped, hung in a syscall) never exits and its peers
/// only time out on it; waiting for it would hang the job forever. So once any rank has failed,
/// the others get `grace` (the peer timeout: every live rank that waits on a failed one fails by
/// itself within it) and are then killed, each reported with what became of it. The job
/// therefore ends within about twice the peer timeout of the first failure.
///
/// A rank's stderr is read as it goes (a full pipe would block it); the lines `pass_on(rank,
/// line)` takes (progress, warnings said once) are printed as they come, the others kept as the
/// rank's message should it fail.
pub async fn supervise<T>(
    children: Vec<(u32, tokio::process::Child)>,
    grace: Duration,
    pass_on: fn(u32, &str) -> bool,
    mut collect: impl FnMut(u32) -> Result<T>,
) -> Result<Vec<T>> {
    let ranks: Vec<u32> = children.iter().map(|(rank, _)| *rank).collect();
    let outcomes = wait_all(children, grace, pass_on).await;
    let mut failures = Vec::new();
    for (rank, outcome) in ranks.iter().zip(&outcomes) {
        if let Some((class, why)) = outcome.failure() {
            failures.push((class, format!("rank {rank}: {why}")));
        }
    }
    ranks_failed(failures)?;
    ranks.into_iter().map(&mut collect).collect()
}

/// `failures` (each rank's class and `rank R: why`) as one error, or nothing when there are none.
fn ranks_failed(failures: Vec<(ErrorClass, String)>) -> Result<()> {
    if failures.is_empty() {
        return Ok(());
    }
    let (classes, failures): (Vec<_>, Vec<_>) = failures.into_iter().unzip();
    Err(RanksFailed {
        failures,
        class: root_class(classes),
    }
    .into())
}

/// How one rank process ended.
#[derive(Debug, PartialEq)]
enum RankOutcome {
    Succeeded,
    /// Its error, or what became of it when it left none.
    Failed(String),
    /// Its error, and the exit code it chose (which says the class of its failure).
    Exited(String, i32),
}

impl RankOutcome {
    /// The class and message of a failure; `None` for a rank that succeeded.
    fn failure(&self) -> Option<(ErrorClass, &str)> {
        match self {
            RankOutcome::Succeeded => None,
            // Killed or vanished: to its peers, a peer that failed.
            RankOutcome::Failed(why) => Some((ErrorClass::PeerFailed, why)),
            // Each rank process exits with its own class's code.
            RankOutcome::Exited(why, code) => Some((ErrorClass::from_code(*code), why)),
        }
    }
}

/// Waits for every process, all at once, as [`supervise`] says; each one's outcome, in order.
async fn wait_all(
    mut children: Vec<(u32, tokio::process::Child)>,
    grace: Duration,
    pass_on: fn(u32, &str) -> bool,
) -> Vec<RankOutcome> {
    use futures::StreamExt;
    let (kill_tx, kill_rx) = tokio::sync::watch::channel(false);
    let mut waits = futures::stream::FuturesUnordered::new();
    for (index, (rank, child)) in children.iter_mut().enumerate() {
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
                        if pass_on(rank, &line) {
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
            (index, rank_outcome(status, killed, &text, grace))
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
        let Some((index, outcome)) = next else {
            break;
        };
        if outcome.failure().is_some() && kill_at.is_none() && !*kill_tx.borrow() {
            kill_at = Some(tokio::time::Instant::now() + grace);
        }
        outcomes[index] = Some(outcome);
    }
    outcomes
        .into_iter()
        .map(|outcome| {
            outcome.unwrap_or_else(|| {
                RankOutcome::Failed("its process could not be waited for".to_string())
            })
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

#[cfg(all(test, unix))]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    use super::*;

    const GRACE: Duration = Duration::from_secs(2);

    /// A process that exited with `code` (the raw wait status).
    fn exited(code: i32) -> std::io::Result<ExitStatus> {
        Ok(ExitStatus::from_raw(code << 8))
    }

    /// A process killed by `signal`.
    fn signalled(signal: i32) -> std::io::Result<ExitStatus> {
        Ok(ExitStatus::from_raw(signal))
    }

    #[test]
    fn an_exit_code_keeps_its_class_and_the_rank_its_message() {
        let outcome = rank_outcome(exited(4), None, "error: block 3 of x: checksum\n", GRACE);
        assert_eq!(
            outcome,
            RankOutcome::Exited("block 3 of x: checksum".to_string(), 4)
        );
        assert_eq!(
            outcome.failure(),
            Some((ErrorClass::VerificationFailed, "block 3 of x: checksum"))
        );
        // Silent: the code is said, with its class still.
        let silent = rank_outcome(exited(3), None, "", GRACE);
        assert_eq!(
            silent.failure(),
            Some((ErrorClass::NotFound, "exited with code 3, no report"))
        );
        assert_eq!(
            rank_outcome(exited(0), None, "", GRACE).failure(),
            None,
            "success"
        );
    }

    #[test]
    fn a_signal_is_named_and_counts_as_a_failed_peer() {
        let outcome = rank_outcome(signalled(11), None, "", GRACE);
        assert_eq!(
            outcome.failure(),
            Some((ErrorClass::PeerFailed, "killed by signal 11, no report"))
        );
    }

    #[test]
    fn a_rank_killed_after_the_grace_says_whether_it_was_stopped_and_what_it_printed() {
        let stopped = rank_outcome(signalled(9), Some(Some('T')), "loading\n", GRACE);
        assert_eq!(
            stopped,
            RankOutcome::Failed(
                "stopped (SIGSTOP or a debugger) 2 s after another rank failed: killed by signal \
                 9, no report (it had printed: loading)"
                    .to_string()
            )
        );
        let running = rank_outcome(signalled(9), Some(Some('S')), "", GRACE);
        assert_eq!(
            running,
            RankOutcome::Failed(
                "still running 2 s after another rank failed: killed by signal 9, no report"
                    .to_string()
            )
        );
    }

    #[test]
    fn the_state_of_a_live_process_is_read_and_a_gone_one_has_none() {
        // This test's own process runs (or sleeps between polls), never stopped.
        let state = process_state(std::process::id()).unwrap();
        assert!(matches!(state, 'R' | 'S'), "{state}");
        assert_eq!(process_state(u32::MAX), None);
    }

    #[test]
    fn failures_become_one_error_naming_each_rank_with_the_root_class() {
        let err = ranks_failed(vec![
            (ErrorClass::PeerFailed, "rank 0: rank 1 failed".to_string()),
            (
                ErrorClass::VerificationFailed,
                "rank 1: checksum".to_string(),
            ),
        ])
        .unwrap_err();
        let failed = err.downcast_ref::<RanksFailed>().unwrap();
        assert_eq!(failed.class, ErrorClass::VerificationFailed);
        assert_eq!(
            err.to_string(),
            "the load failed:\n  rank 0: rank 1 failed\n  rank 1: checksum"
        );
        assert!(ranks_failed(Vec::new()).is_ok());
    }
}
