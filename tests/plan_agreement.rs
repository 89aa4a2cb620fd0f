//! A plan server that lies across ranks: each rank gets an honest plan of the right checkpoint
//! (every piece passes the checks against the opened metadata), but rank 1's comes from another
//! plan of the same requests (rank 0's two boxes listed the other way round), so piece id 0 is
//! rows 0..h on rank 0 and rows h..n on rank 1. `tessera load --server` used to exit 0 with the
//! rows mixed up on both ranks, in-process and over TCP; now the ranks compare what they pass
//! each other before the exchange and both fail naming the other. A rank plan whose
//! destinations are the rank's requests in another order is refused too.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::Arc;

use serde_json::json;
use support::{ok, run_in, s, synth_tiny};
use tessera_loader::checkpoint::Checkpoint;
use tessera_planner::{ExplicitRequest, ExplicitRequests, Plan, PlanOptions};

const ID: &str = "run/step-000005";

/// A plan server on 127.0.0.1 that answers every `POST /v1/plans` with `created` and rank r's
/// plan with `ranks[r]` (Arrow IPC), whatever was asked. Runs until the test process ends.
fn lying_server(created: serde_json::Value, ranks: Vec<Vec<u8>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let created = Arc::new(created.to_string().into_bytes());
    let ranks = Arc::new(ranks);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let (created, ranks) = (Arc::clone(&created), Arc::clone(&ranks));
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let path = line.split(' ').nth(1).unwrap_or("").to_string();
                let mut length = 0usize;
                loop {
                    let mut header = String::new();
                    reader.read_line(&mut header).unwrap();
                    if header.trim().is_empty() {
                        break;
                    }
                    let lower = header.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                }
                let mut body = vec![0u8; length];
                reader.read_exact(&mut body).unwrap();
                let (kind, answer): (&str, Vec<u8>) = if path == "/v1/plans" {
                    ("application/json", created.to_vec())
                } else {
                    let rank: usize = path.rsplit('/').next().unwrap().parse().unwrap();
                    ("application/vnd.apache.arrow.stream", ranks[rank].clone())
                };
                let head = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    answer.len()
                );
                stream.write_all(head.as_bytes()).unwrap();
                stream.write_all(&answer).unwrap();
            });
        }
    });
    url
}

/// The requests of the job: both ranks want a tensor's two halves by rows, top first (rank 0's
/// the other way round when `rank0_reversed`).
fn requests(ckpt: &Checkpoint, rank0_reversed: bool) -> ExplicitRequests {
    let tensor = ckpt
        .meta
        .tensors()
        .iter()
        .find(|t| t.shape.len() == 2 && t.shape[0] >= 4 && t.shape[0] % 2 == 0)
        .unwrap();
    let (n, c) = (tensor.shape[0], tensor.shape[1]);
    let half = |first: bool| ExplicitRequest::Box {
        fqn: tensor.fqn.clone(),
        offsets: vec![if first { 0 } else { n / 2 }, 0],
        lengths: vec![n / 2, c],
    };
    let mut rank0 = vec![half(true), half(false)];
    if rank0_reversed {
        rank0.reverse();
    }
    ExplicitRequests {
        ranks: vec![rank0, vec![half(true), half(false)]],
    }
}

fn plan(ckpt: &Checkpoint, requests: &ExplicitRequests) -> Plan {
    let set = requests.resolve(ckpt.meta.tensors()).unwrap();
    ckpt.plan(&set, &PlanOptions::default()).unwrap()
}

fn arrow(plan: &Plan, rank: u32) -> Vec<u8> {
    plan.rank_plan(rank).unwrap().to_arrow_ipc().unwrap()
}

/// A server answering rank r from `plans[r]`, and the created answer of `plans[0]`.
fn serve(ckpt: &Checkpoint, plans: [&Plan; 2]) -> String {
    let created = json!({
        "plan": "lying",
        "checkpoint": ID,
        "world": 2,
        "summary": plans[0].summary(),
        "checkpoint_identity": ckpt.meta.identity(),
    });
    lying_server(created, vec![arrow(plans[0], 0), arrow(plans[1], 1)])
}

struct Job {
    _dir: tempfile::TempDir,
    ckpt_dir: std::path::PathBuf,
    requests_file: std::path::PathBuf,
    checkpoint: Checkpoint,
    a: Plan,
    b: Plan,
}

async fn job() -> Job {
    let dir = tempfile::tempdir().unwrap();
    let ckpt_dir = synth_tiny(dir.path());
    let checkpoint = Checkpoint::open(tessera_storage::open(s(&ckpt_dir)).unwrap())
        .await
        .unwrap();
    let asked = requests(&checkpoint, false);
    let requests_file = dir.path().join("requests.json");
    std::fs::write(&requests_file, serde_json::to_vec(&asked).unwrap()).unwrap();
    let a = plan(&checkpoint, &asked);
    let b = plan(&checkpoint, &requests(&checkpoint, true));
    // The lie is real: the two plans name different rows by the same piece id.
    let (a0, b1) = (a.rank_plan(0).unwrap(), b.rank_plan(1).unwrap());
    let region = |p: &tessera_planner::RankPlan, id: u32| {
        p.pieces
            .iter()
            .find(|x| x.id == id)
            .map(|x| x.region.clone())
    };
    assert!(
        a0.pieces
            .iter()
            .any(|p| region(&b1, p.id).is_some_and(|r| r != p.region)),
        "the plans agree on every shared piece id: {:?} vs {:?}",
        a0.pieces
            .iter()
            .map(|p| (p.id, p.region.clone(), p.reader))
            .collect::<Vec<_>>(),
        b1.pieces
            .iter()
            .map(|p| (p.id, p.region.clone(), p.reader))
            .collect::<Vec<_>>()
    );
    Job {
        _dir: dir,
        ckpt_dir,
        requests_file,
        checkpoint,
        a,
        b,
    }
}

fn load(job: &Job, server: &str, extra: &[&str]) -> support::Run {
    let mut args = vec![
        "load",
        s(&job.ckpt_dir),
        "--requests",
        s(&job.requests_file),
        "--server",
        server,
        "--checkpoint-id",
        ID,
        "--quiet",
        "--peer-timeout",
        "20",
    ];
    args.extend_from_slice(extra);
    run_in(None::<&Path>, args)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_given_rank_plans_of_different_plans_are_refused_in_process_and_over_tcp() {
    let job = job().await;
    // Honest: every rank from one plan, every byte checked against the formula.
    let honest = serve(&job.checkpoint, [&job.a, &job.a]);
    ok([
        "load",
        s(&job.ckpt_dir),
        "--requests",
        s(&job.requests_file),
        "--server",
        &honest,
        "--checkpoint-id",
        ID,
        "--quiet",
        "--check",
    ]);

    let lying = serve(&job.checkpoint, [&job.a, &job.b]);
    for transport in ["inproc", "tcp"] {
        let run = load(&job, &lying, &["--transport", transport]);
        assert_ne!(run.code, Some(0), "{transport}: the load succeeded");
        for needle in [
            "rank 0: this rank's plan and the plan of rank 1 disagree on what they pass each other",
            "rank 1: this rank's plan and the plan of rank 0 disagree",
            "nothing was exchanged",
        ] {
            assert!(
                run.stderr.contains(needle),
                "{transport}: {needle:?} not in {}",
                run.stderr
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_plan_whose_destinations_are_the_requests_in_another_order_is_refused() {
    let job = job().await;
    // Both ranks from plan B, which lists rank 0's boxes the other way round: the ranks agree
    // with each other, but rank 0's buffers would get each other's rows.
    let swapped = serve(&job.checkpoint, [&job.b, &job.b]);
    let run = load(&job, &swapped, &[]);
    assert_ne!(run.code, Some(0), "the load succeeded");
    for needle in [
        "rank 0: the plan's destinations are not this rank's requests: destination 0 is box at [",
        "but request 0 is box at [0, 0]",
        "nothing was read",
    ] {
        assert!(
            run.stderr.contains(needle),
            "{needle:?} not in {}",
            run.stderr
        );
    }
}
