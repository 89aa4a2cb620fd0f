//! `tessera load --rank`: one process per rank, started the way a launcher starts them (each with
//! its own arguments and working directory), meeting at rank 0's rendezvous on 127.0.0.1. What
//! the ranks must agree on, and who is blamed when one of them goes away.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use support::{layout_file, s};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// How a test starts one rank.
struct RankArgs<'a> {
    /// The checkpoint as this rank is given it.
    checkpoint: &'a str,
    /// The rank's working directory (the test's when `None`).
    cwd: Option<&'a Path>,
    /// Flags after the common ones.
    extra: &'a [&'a str],
}

impl<'a> RankArgs<'a> {
    fn at(checkpoint: &'a str) -> Self {
        RankArgs {
            checkpoint,
            cwd: None,
            extra: &[],
        }
    }
}

/// Starts `tessera load <checkpoint> --layout <layout> --rank <rank> --world <world>` meeting at
/// 127.0.0.1:`port`, every wait on a peer bounded by `peer_timeout` seconds. `layout` may be
/// `--requests <file>` instead ([`requests`]).
fn start_rank(
    args: &RankArgs<'_>,
    layout: &Path,
    (rank, world): (u32, u32),
    port: u16,
    peer_timeout: &str,
) -> Child {
    let target = if layout.extension().is_some_and(|e| e == "requests") {
        "--requests"
    } else {
        "--layout"
    };
    let mut command = Command::new(support::BIN);
    command
        .args(["load", args.checkpoint, target, s(layout)])
        .args(["--transport", "tcp", "--check", "--quiet"])
        .args(["--rank", &rank.to_string(), "--world", &world.to_string()])
        .args([
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port.to_string(),
        ])
        .args(["--peer-timeout", peer_timeout])
        .args(args.extra)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(cwd) = args.cwd {
        command.current_dir(cwd);
    }
    command.spawn().unwrap()
}

/// What became of one rank process.
#[derive(Debug)]
struct Ended {
    code: Option<i32>,
    stderr: String,
    /// When it ended, from the test's start.
    after: Duration,
}

/// Waits for every process in `ranks` (killing what is still running `bound` after `started`,
/// and failing the test then); returns what became of each, in order.
fn wait_all(ranks: Vec<Child>, started: Instant, bound: Duration) -> Vec<Ended> {
    let mut ranks: Vec<(Child, Option<Ended>)> = ranks.into_iter().map(|c| (c, None)).collect();
    while ranks.iter().any(|(_, ended)| ended.is_none()) {
        if started.elapsed() > bound {
            for (child, _) in &mut ranks {
                let _ = child.kill();
            }
            panic!("rank processes still running after {bound:?}");
        }
        for (child, ended) in &mut ranks {
            if ended.is_none()
                && let Some(status) = child.try_wait().unwrap()
            {
                let mut stderr = String::new();
                child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut stderr)
                    .unwrap();
                *ended = Some(Ended {
                    code: status.code(),
                    stderr,
                    after: started.elapsed(),
                });
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ranks.into_iter().map(|(_, ended)| ended.unwrap()).collect()
}

/// The error line of a rank's stderr (`error: ...`).
fn error_of(ended: &Ended) -> &str {
    ended
        .stderr
        .lines()
        .find(|l| l.starts_with("error: "))
        .unwrap_or_else(|| panic!("no error line: {ended:?}"))
}

/// gpt-tiny saved as FSDP dp 2 at `<dir>/run/step-000001`, and a dp 2 layout to load it into.
fn checkpoint_and_layout(dir: &Path) -> (PathBuf, PathBuf) {
    let ckpt = support::synth_saved_as(dir, &["fsdp", "--dp", "2"]);
    let layout = layout_file(dir, "dp2.json", &["fsdp", "--dp", "2"]);
    (ckpt, layout)
}

/// A relative checkpoint path on one rank (started in the run's directory) and an absolute one
/// on the other were two jobs to rank 0 (the path as typed went into the job's fingerprint),
/// and the load failed. They name one checkpoint, so they are one job, and the load succeeds.
#[test]
fn a_relative_and_an_absolute_path_to_one_checkpoint_are_one_job() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, layout) = checkpoint_and_layout(dir.path());
    let run_dir = ckpt.parent().unwrap();
    let port = free_port();
    let started = Instant::now();
    let relative = RankArgs {
        cwd: Some(run_dir),
        ..RankArgs::at("step-000001")
    };
    let ranks = vec![
        start_rank(&relative, &layout, (0, 2), port, "20"),
        start_rank(&RankArgs::at(s(&ckpt)), &layout, (1, 2), port, "20"),
    ];
    for (rank, ended) in wait_all(ranks, started, Duration::from_secs(60))
        .iter()
        .enumerate()
    {
        assert_eq!(ended.code, Some(0), "rank {rank}: {}", ended.stderr);
    }
}

/// Another checkpoint is still another job: the rank given it is turned away at once, and rank
/// 0 names the refusal when its own rank 1 does not come.
#[test]
fn a_rank_given_another_checkpoint_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, layout) = checkpoint_and_layout(dir.path());
    let other_dir = dir.path().join("other");
    std::fs::create_dir(&other_dir).unwrap();
    let other = support::synth_saved_as(&other_dir, &["fsdp", "--dp", "1"]);
    let port = free_port();
    let started = Instant::now();
    let ranks = vec![
        start_rank(&RankArgs::at(s(&ckpt)), &layout, (0, 2), port, "4"),
        start_rank(&RankArgs::at(s(&other)), &layout, (1, 2), port, "4"),
    ];
    let ended = wait_all(ranks, started, Duration::from_secs(60));
    let (zero, one) = (&ended[0], &ended[1]);
    assert_eq!(one.code, Some(support::PEER_FAILED), "{}", one.stderr);
    assert!(
        error_of(one).starts_with(&format!(
            "error: rendezvous failed: rank 1: the master at 127.0.0.1:{port} turned this rank away: it loads job "
        )),
        "{}",
        one.stderr
    );
    // Turned away as it checked in, not at rank 0's deadline.
    assert!(one.after + Duration::from_secs(2) < zero.after, "{ended:?}");
    assert_eq!(zero.code, Some(support::PEER_FAILED), "{}", zero.stderr);
    assert!(
        error_of(zero).starts_with(
            "error: rendezvous failed: rank 0: only 1 of 2 ranks checked in within 4s; missing ranks [1]; it refused 1 connection"
        ),
        "{}",
        zero.stderr
    );
    assert!(
        zero.stderr
            .contains("rank 0: refused a hello from 127.0.0.1:"),
        "{}",
        zero.stderr
    );
}

/// A rank started with another `--read-order` plans differently from its peers: the load
/// failed late, each rank blaming a peer that "may have died". The plan options are agreed at
/// the rendezvous now: every rank fails at once, naming the option, both values and the rank.
#[test]
fn ranks_given_different_read_orders_fail_at_once_naming_the_option() {
    let dir = tempfile::tempdir().unwrap();
    // Row shards loaded as column slices: the two orders read them differently.
    let ckpt = support::synth_saved_as(dir.path(), &["fsdp", "--dp", "2"]);
    let layout = layout_file(
        dir.path(),
        "tp3.json",
        &[
            "megatron-gpt",
            "--tp",
            "3",
            "--pp",
            "1",
            "--dp",
            "1",
            "--num-layers",
            "4",
        ],
    );
    let port = free_port();
    let started = Instant::now();
    let request = RankArgs {
        extra: &["--read-order", "request"],
        ..RankArgs::at(s(&ckpt))
    };
    let storage = RankArgs {
        extra: &["--read-order", "storage"],
        ..RankArgs::at(s(&ckpt))
    };
    let ranks = vec![
        start_rank(&request, &layout, (0, 3), port, "30"),
        start_rank(&storage, &layout, (1, 3), port, "30"),
        start_rank(&request, &layout, (2, 3), port, "30"),
    ];
    let ended = wait_all(ranks, started, Duration::from_secs(60));
    for (rank, ended) in ended.iter().enumerate() {
        // Invalid input (exit 1), not a peer that failed, and long before the peer timeout.
        assert_eq!(ended.code, Some(1), "rank {rank}: {}", ended.stderr);
        assert_eq!(
            error_of(ended),
            format!(
                "error: rank {rank}: the ranks of this job plan with different options, so their \
                 plans would not fit together: rank 1 plans with --read-order storage but rank 0 \
                 with --read-order request; give every rank the same options"
            ),
            "{}",
            ended.stderr
        );
        assert!(ended.after < Duration::from_secs(20), "{ended:?}");
    }
}

/// Explicit requests (`<dir>/three.requests`) where rank 0 needs only what rank 2 reads and
/// rank 2 also needs what rank 1 reads: rank 0 never waits on rank 1.
fn requests(dir: &Path) -> PathBuf {
    let path = dir.join("three.requests");
    let whole = |fqn: &str, rows: u32| {
        format!(r#"{{"fqn": "{fqn}", "offsets": [0, 0], "lengths": [{rows}, 64]}}"#)
    };
    let (embed, fc1) = (
        whole("model.embed_tokens.weight", 1000),
        whole("model.layers.0.mlp.fc1.weight", 196),
    );
    std::fs::write(
        &path,
        format!(r#"{{"ranks": [[{embed}], [{fc1}], [{embed}, {fc1}]]}}"#),
    )
    .unwrap();
    path
}

/// Rank 1 of three is killed while its peers wait: rank 2 in its read, rank 0 (which reads
/// nothing) for the others' reads. Rank 2 failed naming rank 1, but rank 0 named rank 2, whose
/// connection it saw close when rank 2 gave up. Every survivor names the rank that died: rank 0
/// holds the job's rounds and sees rank 1's connection end, and tells rank 2.
#[test]
fn the_survivors_of_a_killed_rank_name_it() {
    use tessera_storage::testing::{Stall, StallingHttpServer};
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, _) = checkpoint_and_layout(dir.path());
    let requests = requests(dir.path());
    // Ranks 1 and 2 read the same checkpoint through servers that never answer for its data:
    // they stay in their reads, the mesh up, until rank 1 is killed.
    let servers = [(); 2].map(|()| StallingHttpServer::start(dir.path()));
    for server in &servers {
        server.stall(Stall::BeforeHeaders, |path| path.contains("/data/"));
    }
    let urls = servers
        .each_ref()
        .map(|server| format!("{}/run/step-000001", server.url()));
    // An order given outright plans the same from a local and a remote store.
    let common = ["--read-order", "request"];
    let stalled = [
        "--read-order",
        "request",
        "--storage-read-timeout",
        "60",
        "--storage-attempts",
        "1",
    ];
    let port = free_port();
    let started = Instant::now();
    let mut ranks = vec![start_rank(
        &RankArgs {
            extra: &common,
            ..RankArgs::at(s(&ckpt))
        },
        &requests,
        (0, 3),
        port,
        "30",
    )];
    for (rank, url) in [1, 2].into_iter().zip(&urls) {
        let args = RankArgs {
            extra: &stalled,
            ..RankArgs::at(url)
        };
        ranks.push(start_rank(&args, &requests, (rank, 3), port, "30"));
    }
    while servers.iter().any(|server| server.stalled() == 0) {
        if started.elapsed() > Duration::from_secs(30)
            || ranks.iter_mut().any(|r| r.try_wait().unwrap().is_some())
        {
            for rank in &mut ranks {
                let _ = rank.kill();
            }
            let ended = wait_all(ranks, started, Duration::from_secs(60));
            panic!("ranks 1 and 2 did not both reach their reads: {ended:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    ranks[1].kill().unwrap();
    let ended = wait_all(ranks, started, Duration::from_secs(60));
    assert_eq!(ended[1].code, None, "rank 1 was killed");
    for rank in [0, 2] {
        let survivor = &ended[rank];
        assert_eq!(
            survivor.code,
            Some(support::PEER_FAILED),
            "{}",
            survivor.stderr
        );
        let error = error_of(survivor);
        assert!(
            error.starts_with(&format!("error: rank {rank}: transport to rank 1 failed: "))
                && error.contains(
                    "rank 1 closed its connection without a goodbye (its process was killed or crashed)"
                ),
            "rank {rank}: {}",
            survivor.stderr
        );
        // Within moments of the kill, not at the peer timeout.
        assert!(survivor.after < Duration::from_secs(25), "{ended:?}");
    }
    // Rank 0 serves the job's rounds to every rank, so it sees rank 1's connection end itself
    // (it used to learn of it only through rank 2 leaving: "then, with rank 2"), and rank 2,
    // still in its read, is told by rank 0 at once.
    assert!(
        !error_of(&ended[0]).contains("rank 2"),
        "{}",
        ended[0].stderr
    );
}
