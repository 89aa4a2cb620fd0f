//! The ring exchange on real plans, over the in-process and TCP transports and the sequenced
//! transport (NCCL's protocol over an emulated data plane): every rank places the pieces it reads
//! (the synthetic formula's bytes), runs its exchanges concurrently with the others, and must end
//! with every destination byte-exact. The grouped device-to-device ring runs on emulated planes
//! too. A rank that dies mid-exchange makes the others fail quickly, naming it.
// LoaderError is 128 bytes (object_store::Error is 72 of them), just at clippy's
// `result_large_err` threshold; the closures here return it on the cold path.
#![allow(clippy::unwrap_used, missing_docs, clippy::result_large_err)]

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_loader::LoaderError;
use tessera_loader::exchange::place::{allocate, place_piece};
use tessera_loader::exchange::{
    ExchangeMessages, ExchangeStats, run_exchange_messages, run_exchanges,
};
use tessera_loader::testing::{EmulatedPlane, HostMemory};
use tessera_loader::transport::plane::PlaneThread;
use tessera_loader::transport::plane::ring::ring_exchange;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{
    InProcTransport, SequencedTransport, TcpTransport, Transport, TransportOptions,
};
use tessera_metadata::{ByteMeta, CheckpointMeta, DataFile, SavedChunk, TensorMeta};
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_planner::{
    ExplicitRequests, Layout, MeshDim, PlanOptions, RankPlan, RequestSet, Rule, Target,
    assign_writers, plan,
};
use tessera_synth::{self as synth, Model};
use tokio::sync::Notify;

const TIMEOUT: Duration = Duration::from_secs(5);

fn options() -> TransportOptions {
    TransportOptions::with_timeout(TIMEOUT)
}

fn megatron(tp: u32, pp: u32, dp: u32, zero1: bool) -> Layout {
    megatron_gpt(MegatronGpt {
        tp,
        pp,
        dp,
        num_layers: 4,
        zero1,
    })
    .unwrap()
}

/// Everything replicated over `n` ranks: every piece goes to every rank.
fn replicated(n: u32) -> Layout {
    Layout {
        mesh: vec![MeshDim {
            name: "dp".to_string(),
            size: n,
        }],
        rules: vec![Rule {
            pattern: "*".to_string(),
            placements: vec!["replicate".to_string()],
        }],
        stages: None,
    }
}

/// Metadata of `tensors` saved as `saved_as` would save them (each distinct box once, one file per
/// writing rank, boxes back to back). No bytes: the exchange only needs the plan, and the pieces'
/// bytes come from the synthetic formula.
fn checkpoint(tensors: &[TensorMeta], saved_as: &Layout) -> Arc<CheckpointMeta> {
    let holdings = saved_as.resolve(tensors).unwrap();
    let writes = assign_writers(tensors, &holdings).unwrap();
    let mut chunks = Vec::new();
    let mut files = Vec::new();
    for (f, items) in writes.into_iter().enumerate() {
        let mut offset = 0;
        for item in items {
            let length = item.region.numel() * tensors[item.tensor as usize].dtype.size();
            chunks.push(SavedChunk {
                tensor: item.tensor,
                region: item.region,
                bytes: ByteMeta {
                    file: f as u32,
                    offset,
                    length,
                    strides: None,
                },
                crc32c: None,
                crc32: None,
            });
            offset += length;
        }
        files.push(DataFile {
            path: format!("data/rank-{f:05}.bin"),
            size: Some(offset),
            encoded: None,
        });
    }
    Arc::new(CheckpointMeta::new(tensors.to_vec(), chunks, Vec::new(), files).unwrap())
}

fn rank_plans(meta: &Arc<CheckpointMeta>, requests: &RequestSet) -> Vec<RankPlan> {
    let plan = plan(meta, requests, &PlanOptions::default()).unwrap();
    let plans: Vec<RankPlan> = (0..plan.world_size())
        .map(|r| plan.rank_plan(r).unwrap())
        .collect();
    assert!(
        plans.iter().any(|p| p.summary.bytes_sent > 0),
        "the scenario has no exchange"
    );
    plans
}

fn gpt_tiny(with_optimizer: bool) -> Vec<TensorMeta> {
    synth::tensors(&Model::GptTiny.config(), with_optimizer)
}

/// tp2 checkpoint loaded as tp2 × dp2: the dp replicas split the reads and swap halves.
fn tp2_to_tp2_dp2() -> Vec<RankPlan> {
    let tensors = gpt_tiny(false);
    let meta = checkpoint(&tensors, &megatron(2, 1, 1, false));
    rank_plans(&meta, &megatron(2, 1, 2, false).resolve(&tensors).unwrap())
}

/// tp2 checkpoint with optimizer loaded as pp2 × dp2 × tp2 with a distributed optimizer (8 ranks,
/// groups of different sizes).
fn tp2_to_pp2_dp2_tp2_zero1() -> Vec<RankPlan> {
    let tensors = gpt_tiny(true);
    let meta = checkpoint(&tensors, &megatron(2, 1, 1, false));
    rank_plans(&meta, &megatron(2, 2, 2, true).resolve(&tensors).unwrap())
}

/// tp2 checkpoint replicated over 4 ranks: one group of 4, three rounds.
fn tp2_to_replicated_4() -> Vec<RankPlan> {
    let tensors = gpt_tiny(false);
    let meta = checkpoint(&tensors, &megatron(2, 1, 1, false));
    rank_plans(&meta, &replicated(4).resolve(&tensors).unwrap())
}

/// Overlapping flat ranges (distributed-optimizer buffers) and boxes across chunk borders: groups
/// of 2, 3 and 4 members.
fn overlapping_flat_ranges() -> Vec<RankPlan> {
    let tensors = gpt_tiny(false);
    let meta = checkpoint(&tensors, &megatron(2, 1, 1, false));
    let embed = "model.embed_tokens.weight"; // [1000, 64], saved as two [500, 64] chunks
    let fc2 = "model.layers.1.mlp.fc2.weight"; // [64, 98], saved as two [64, 49] chunks
    let text = format!(
        r#"{{"ranks": [
            [{{"fqn": "{embed}", "flat": [0, 40000]}}, {{"fqn": "{fc2}", "flat": [100, 3000]}}],
            [{{"fqn": "{embed}", "flat": [30000, 64000]}}, {{"fqn": "{fc2}", "offsets": [3, 40], "lengths": [20, 30]}}],
            [{{"fqn": "{embed}", "flat": [0, 40000]}}, {{"fqn": "{fc2}", "flat": [100, 3000]}}, {{"fqn": "model.final_norm.weight", "flat": [0, 64]}}],
            [{{"fqn": "{embed}", "flat": [25000, 35000]}}, {{"fqn": "model.final_norm.weight", "flat": [10, 20]}}]
        ]}}"#
    );
    let requests = ExplicitRequests::from_json(&text)
        .unwrap()
        .resolve(&tensors)
        .unwrap();
    rank_plans(&meta, &requests)
}

/// Destination buffers with this rank's own reads placed (the exchange's precondition).
fn prepared(plan: &RankPlan) -> Vec<Vec<u8>> {
    let mut buffers = allocate(plan);
    for (i, piece) in plan.pieces.iter().enumerate() {
        if piece.read.is_some() {
            let tensor = &plan.tensors[piece.tensor as usize];
            let wire = synth::box_bytes(tensor, &piece.region).unwrap();
            place_piece(plan, i, &wire, &mut buffers).unwrap();
        }
    }
    buffers
}

fn check_destinations(plan: &RankPlan, buffers: &[Vec<u8>]) {
    for (d, (dest, buffer)) in plan.destinations.iter().zip(buffers).enumerate() {
        let tensor = &plan.tensors[dest.tensor as usize];
        let expected = match &dest.target {
            Target::Box(region) => synth::box_bytes(tensor, region).unwrap(),
            Target::Flat { start, end } => synth::flat_bytes(tensor, *start, *end).unwrap(),
        };
        if buffer != &expected {
            let at = buffer
                .iter()
                .zip(&expected)
                .position(|(a, b)| a != b)
                .unwrap_or(0);
            panic!(
                "rank {} destination {d} ({} {:?}): wrong bytes from byte {at}",
                plan.rank, tensor.fqn, dest.target
            );
        }
    }
}

type RankOutcome<T> = (
    T,
    Result<ExchangeStats, LoaderError>,
    Vec<Vec<u8>>,
    Duration,
);

/// Runs every rank's exchange in its own task. Transports come back with the outcomes, so no
/// rank's end closes before every rank is done.
async fn exchange_all<T: Transport + 'static>(
    mesh: Vec<T>,
    plans: &[RankPlan],
) -> Vec<RankOutcome<T>> {
    exchange_all_in_parts(mesh, plans, None).await
}

/// [`exchange_all`] with shares cut into parts of `part_bytes` (`None`: `run_exchanges`, the
/// default cut).
async fn exchange_all_in_parts<T: Transport + 'static>(
    mesh: Vec<T>,
    plans: &[RankPlan],
    part_bytes: Option<u64>,
) -> Vec<RankOutcome<T>> {
    assert_eq!(mesh.len(), plans.len());
    let tasks: Vec<_> = mesh
        .into_iter()
        .zip(plans.iter().cloned())
        .map(|(transport, plan)| {
            tokio::spawn(async move {
                let mut buffers = prepared(&plan);
                let start = Instant::now();
                let result = match part_bytes {
                    None => run_exchanges(&transport, &plan, &mut buffers).await,
                    Some(bytes) => {
                        let messages = ExchangeMessages::of_plan_in_parts(&plan, bytes).unwrap();
                        run_exchange_messages(&transport, &plan, &messages, &mut buffers).await
                    }
                };
                (transport, result, buffers, start.elapsed())
            })
        })
        .collect();
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.unwrap());
    }
    out
}

async fn exchange_and_check<T: Transport + 'static>(mesh: Vec<T>, plans: &[RankPlan]) {
    exchange_in_parts_and_check(mesh, plans, None).await;
}

/// Every rank's exchange (shares cut into parts of `part_bytes`, see [`exchange_all_in_parts`]),
/// checked: each rank's bytes sent and received are its plan's, every destination is the
/// formula's, every byte sent is received once.
async fn exchange_in_parts_and_check<T: Transport + 'static>(
    mesh: Vec<T>,
    plans: &[RankPlan],
    part_bytes: Option<u64>,
) {
    let outcomes = exchange_all_in_parts(mesh, plans, part_bytes).await;
    let (mut sent, mut received, mut messages) = (0, 0, 0);
    for ((_, result, buffers, _), plan) in outcomes.iter().zip(plans) {
        let stats = match result {
            Ok(stats) => stats,
            Err(e) => panic!("rank {}: {e}", plan.rank),
        };
        assert_eq!(
            stats.bytes_sent, plan.summary.bytes_sent,
            "rank {}",
            plan.rank
        );
        assert_eq!(
            stats.bytes_received, plan.summary.bytes_received,
            "rank {}",
            plan.rank
        );
        check_destinations(plan, buffers);
        sent += stats.bytes_sent;
        received += stats.bytes_received;
        messages += stats.messages;
    }
    assert_eq!(sent, received, "every byte sent is received once");
    assert!(
        messages > 0 && messages % 2 == 0,
        "{messages} messages: each is sent and received"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn tcp_mesh(world: u32) -> Vec<TcpTransport> {
    let port = free_port();
    let tasks: Vec<_> = (0..world)
        .map(|rank| {
            let config = RendezvousConfig::new(rank, world, "127.0.0.1", port).unwrap();
            tokio::spawn(async move { TcpTransport::connect(&config, options()).await })
        })
        .collect();
    let mut mesh = Vec::new();
    for task in tasks {
        mesh.push(task.await.unwrap().unwrap());
    }
    mesh
}

/// Sequenced transports (NCCL's protocol) over an in-process control mesh and emulated planes.
fn sequenced_mesh(world: u32) -> Vec<SequencedTransport<InProcTransport, EmulatedPlane>> {
    InProcTransport::mesh(world, options())
        .into_iter()
        .zip(EmulatedPlane::mesh(world, TIMEOUT))
        .map(|(control, plane)| {
            let name = format!("plane-{}", plane.rank());
            let plane = PlaneThread::spawn(&name, move || Ok(plane)).unwrap();
            SequencedTransport::new(control, plane, options())
        })
        .collect()
}

/// Every rank's grouped ring on its own emulated plane (each on its plane thread, as with
/// NCCL), from destinations holding the rank's own reads; checks the outcome like
/// [`exchange_and_check`].
async fn grouped_and_check(plans: &[RankPlan]) -> u64 {
    let planes = EmulatedPlane::mesh(plans.len() as u32, TIMEOUT);
    let threads: Vec<PlaneThread<EmulatedPlane>> = planes
        .into_iter()
        .map(|plane| {
            let name = format!("plane-{}", plane.rank());
            PlaneThread::spawn(&name, move || Ok(plane)).unwrap()
        })
        .collect();
    let runs = threads.iter().zip(plans).map(|(thread, plan)| {
        let plan = plan.clone();
        let destinations: Vec<HostMemory> = prepared(&plan)
            .into_iter()
            .map(HostMemory::from_vec)
            .collect();
        thread.run(move |plane| {
            let stats = ring_exchange(plane, &plan, &destinations);
            (plan, stats, destinations)
        })
    });
    let mut groups = 0;
    for outcome in futures::future::join_all(runs).await {
        let (plan, stats, destinations) = outcome.unwrap();
        let stats = stats.unwrap_or_else(|e| panic!("rank {}: {e}", plan.rank));
        assert_eq!(
            stats.bytes_sent, plan.summary.bytes_sent,
            "rank {}",
            plan.rank
        );
        assert_eq!(
            stats.bytes_received, plan.summary.bytes_received,
            "rank {}",
            plan.rank
        );
        let buffers: Vec<Vec<u8>> = destinations.iter().map(HostMemory::to_vec).collect();
        check_destinations(&plan, &buffers);
        groups += stats.messages;
    }
    groups
}

macro_rules! scenarios {
    ($($name:ident),* $(,)?) => {
        mod inproc {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let plans = super::$name();
                    let mesh = InProcTransport::mesh(plans.len() as u32, options());
                    exchange_and_check(mesh, &plans).await;
                }
            )*
        }
        mod tcp {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let plans = super::$name();
                    let mesh = tcp_mesh(plans.len() as u32).await;
                    exchange_and_check(mesh, &plans).await;
                }
            )*
        }
        /// The plan's messages through the sequenced transport: arbitrary concurrent sends and
        /// receives on a plane where a send blocks until its receive is posted.
        mod sequenced {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let plans = super::$name();
                    exchange_and_check(sequenced_mesh(plans.len() as u32), &plans).await;
                }
            )*
        }
        /// The grouped fast path: one group of operations per ring round, device to device.
        mod grouped {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let plans = super::$name();
                    let messages = grouped_and_check(&plans).await;
                    assert!(messages > 0 && messages % 2 == 0, "{messages} messages");
                }
            )*
        }
    };
}

scenarios!(
    tp2_to_tp2_dp2,
    tp2_to_pp2_dp2_tp2_zero1,
    tp2_to_replicated_4,
    overlapping_flat_ranges,
);

/// A transport that lets `sends` sends through, then signals and never completes another
/// send (the rank hangs until its task is aborted, which drops the inner transport: it dies).
struct DiesAfterSends<T> {
    inner: T,
    sends: AtomicUsize,
    limit: usize,
    died: Arc<Notify>,
}

impl<T: Transport> Transport for DiesAfterSends<T> {
    fn rank(&self) -> u32 {
        self.inner.rank()
    }

    fn world(&self) -> u32 {
        self.inner.world()
    }

    async fn send(&self, to: u32, tag: u64, data: Bytes) -> Result<(), LoaderError> {
        if self.sends.fetch_add(1, Ordering::SeqCst) >= self.limit {
            std::future::pending::<()>().await;
        }
        let result = self.inner.send(to, tag, data).await;
        self.died.notify_one();
        std::future::pending::<()>().await;
        result
    }

    fn recv(&self, from: u32, tag: u64) -> impl Future<Output = Result<Bytes, LoaderError>> + Send {
        self.inner.recv(from, tag)
    }
}

/// Rank 2 of a group of 4 sends its round-1 message (to rank 3) and dies. Ranks 0 and 1 never get
/// its share: they must fail, naming rank 2, long before the transport timeout. Rank 3 may finish.
async fn death_mid_exchange<T: Transport + 'static>(mut mesh: Vec<T>, bound: DeathBound) {
    let plans = tp2_to_replicated_4();
    let victim = 2usize;
    assert!(
        plans[victim].summary.bytes_sent > 0,
        "the victim must have something to send"
    );
    let died = Arc::new(Notify::new());
    let dying = DiesAfterSends {
        inner: mesh.remove(victim),
        sends: AtomicUsize::new(0),
        limit: 1,
        died: Arc::clone(&died),
    };
    let victim_plan = plans[victim].clone();
    let victim_task = tokio::spawn(async move {
        let mut buffers = prepared(&victim_plan);
        run_exchanges(&dying, &victim_plan, &mut buffers).await
    });
    let survivors: Vec<RankPlan> = plans
        .iter()
        .filter(|p| p.rank as usize != victim)
        .cloned()
        .collect();
    let killer = async {
        tokio::time::timeout(TIMEOUT, died.notified())
            .await
            .unwrap();
        victim_task.abort();
    };
    let (outcomes, ()) = tokio::join!(exchange_all(mesh, &survivors), killer);
    for ((_, result, _, elapsed), plan) in outcomes.iter().zip(&survivors) {
        let rank = plan.rank;
        assert!(
            *elapsed < bound.within,
            "rank {rank} took {elapsed:?}, the bound is {:?}: death was not noticed ({:?})",
            bound.within,
            result.as_ref().map(|_| ()).map_err(ToString::to_string)
        );
        match result {
            Err(LoaderError::Transport { .. } | LoaderError::PeerTimeout { .. })
                if !bound.names_the_dead_rank => {}
            Err(LoaderError::Transport { peer, .. } | LoaderError::PeerTimeout { peer, .. })
                if *peer == 2 =>
            {
                let text = result.as_ref().unwrap_err().to_string();
                assert!(
                    text.contains("rank 2") && text.contains("group"),
                    "rank {rank}: {text}"
                );
            }
            Err(e) => panic!("rank {rank}: the error does not name rank 2: {e}"),
            Ok(_) if rank == 3 => {}
            Ok(_) => panic!("rank {rank} finished without rank 2's share"),
        }
    }
}

/// How a death must show: within what time, and whether every survivor's error names the dead
/// rank.
struct DeathBound {
    within: Duration,
    names_the_dead_rank: bool,
}

/// Transports that buffer (in-process, TCP): every survivor fails within one timeout, naming it.
const BUFFERED: DeathBound = DeathBound {
    within: TIMEOUT,
    names_the_dead_rank: true,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inproc_rank_dies_mid_exchange() {
    death_mid_exchange(InProcTransport::mesh(4, options()), BUFFERED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_rank_dies_mid_exchange() {
    death_mid_exchange(tcp_mesh(4).await, BUFFERED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequenced_rank_dies_mid_exchange() {
    // A sequenced (NCCL-like) transfer cannot be cancelled once posted: a survivor whose plane is
    // in a transfer with another survivor, itself blocked on the dead rank, fails when that
    // plane's timeout fires, possibly naming the survivor it waited for. So: every survivor fails
    // (none hangs, none succeeds without the dead rank's share) within one plane timeout per
    // other rank in the chain.
    death_mid_exchange(
        sequenced_mesh(4),
        DeathBound {
            within: TIMEOUT * 3,
            names_the_dead_rank: false,
        },
    )
    .await;
}

/// A rank whose plane dies in the grouped ring makes the peers waiting on it fail fast, naming
/// it and the group and round, not hang until the timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grouped_rank_dies_mid_ring() {
    let plans = tp2_to_replicated_4();
    let mut planes = EmulatedPlane::mesh(4, TIMEOUT);
    let victim = planes.remove(2);
    let threads: Vec<_> = planes
        .into_iter()
        .map(|plane| {
            let name = format!("plane-{}", plane.rank());
            PlaneThread::spawn(&name, move || Ok(plane)).unwrap()
        })
        .collect();
    let survivors: Vec<RankPlan> = plans.iter().filter(|p| p.rank != 2).cloned().collect();
    let start = Instant::now();
    let runs = threads.iter().zip(&survivors).map(|(thread, plan)| {
        let plan = plan.clone();
        let destinations: Vec<HostMemory> = prepared(&plan)
            .into_iter()
            .map(HostMemory::from_vec)
            .collect();
        thread.run(move |plane| (plan.rank, ring_exchange(plane, &plan, &destinations)))
    });
    let killer = async {
        tokio::time::sleep(Duration::from_millis(100)).await;
        drop(victim);
    };
    let (outcomes, ()) = tokio::join!(futures::future::join_all(runs), killer);
    for outcome in outcomes {
        let (rank, result) = outcome.unwrap();
        match result {
            Err(LoaderError::Transport {
                peer: 2, detail, ..
            }) => {
                assert!(
                    detail.contains("group") && detail.contains("round"),
                    "rank {rank}: {detail}"
                );
            }
            Err(e) => panic!("rank {rank}: the error does not name rank 2: {e}"),
            Ok(_) => panic!("rank {rank} finished without rank 2"),
        }
    }
    assert!(
        start.elapsed() < TIMEOUT,
        "took {:?}: the death was not noticed",
        start.elapsed()
    );
}

/// A peer whose message has the wrong length is reported with the group, round and sizes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_message_length_is_named() {
    let plans = tp2_to_tp2_dp2();
    let mesh = InProcTransport::mesh(plans.len() as u32, options());
    // Rank 0's peer in its first round with something to receive sends one byte too few.
    let (exchange, round) = plans[0]
        .exchanges
        .iter()
        .find_map(|e| {
            e.rounds
                .iter()
                .find(|r| !r.recv.is_empty())
                .map(|r| (e.group, r.clone()))
        })
        .unwrap();
    let liar = &mesh[round.recv_from as usize];
    let tag = tessera_loader::transport::exchange_tag(exchange, round.round);
    liar.send(
        0,
        tag,
        Bytes::from(vec![0u8; round.recv_bytes as usize - 1]),
    )
    .await
    .unwrap();
    let mut buffers = prepared(&plans[0]);
    let err = run_exchanges(&mesh[0], &plans[0], &mut buffers)
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, LoaderError::Transport { peer, .. } if peer == round.recv_from)
            && text.contains(&format!("group {exchange} round {}", round.round))
            && text.contains(&format!("expected {} bytes", round.recv_bytes))
            && text.contains(&format!("got {}", round.recv_bytes - 1)),
        "{text}"
    );
}

/// A plan for another rank is refused before anything is sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plan_for_another_rank_is_refused() {
    let plans = tp2_to_tp2_dp2();
    let mesh = InProcTransport::mesh(plans.len() as u32, options());
    let mut buffers = prepared(&plans[1]);
    let err = run_exchanges(&mesh[0], &plans[1], &mut buffers)
        .await
        .unwrap_err();
    assert!(matches!(err, LoaderError::InvalidPlan { .. }), "{err}");
}

/// Shares cut into parts of at most this many bytes in the tests below: every gpt-tiny share of
/// more than a few pieces goes in several parts.
const SMALL_PARTS: u64 = 16 * 1024;

#[test]
fn a_share_cut_into_parts_is_cut_the_same_way_by_sender_and_receiver() {
    for plans in [
        tp2_to_tp2_dp2(),
        tp2_to_pp2_dp2_tp2_zero1(),
        tp2_to_replicated_4(),
    ] {
        let messages: Vec<ExchangeMessages> = plans
            .iter()
            .map(|p| ExchangeMessages::of_plan_in_parts(p, SMALL_PARTS).unwrap())
            .collect();
        let whole: Vec<ExchangeMessages> = plans
            .iter()
            .map(|p| ExchangeMessages::of_plan(p).unwrap())
            .collect();
        let mut cut = 0;
        for (from, plan) in plans.iter().enumerate() {
            // The parts of a share hold its pieces once each, in order, and say their bytes.
            for out in &messages[from].outgoing {
                assert!(out.bytes > 0);
                let bytes: u64 = out.pieces.iter().map(|&i| plan.pieces[i].bytes).sum();
                assert_eq!(
                    bytes, out.bytes,
                    "rank {from} group {} part {}",
                    out.group, out.part
                );
            }
            for share in &whole[from].outgoing {
                let parts: Vec<_> = messages[from]
                    .outgoing
                    .iter()
                    .filter(|m| (m.group, m.round, m.to) == (share.group, share.round, share.to))
                    .collect();
                let joined: Vec<usize> = parts.iter().flat_map(|m| m.pieces.clone()).collect();
                assert_eq!(joined, share.pieces, "rank {from}: parts in share order");
                let numbers: Vec<u32> = parts.iter().map(|m| m.part).collect();
                assert_eq!(numbers, (0..parts.len() as u32).collect::<Vec<_>>());
                cut += parts.len() - 1;
            }
            // What one rank sends a peer is exactly what the peer expects from it: piece ids,
            // bytes and tags part by part.
            for out in &messages[from].outgoing {
                let to = out.to as usize;
                let expect = messages[to]
                    .incoming
                    .iter()
                    .find(|m| m.from as usize == from && m.tag == out.tag)
                    .unwrap_or_else(|| panic!("rank {to} expects no message {:#x}", out.tag));
                let ids = |plan: &RankPlan, pieces: &[usize]| -> Vec<u32> {
                    pieces.iter().map(|&i| plan.pieces[i].id).collect()
                };
                assert_eq!(
                    (expect.group, expect.round, expect.part, expect.bytes),
                    (out.group, out.round, out.part, out.bytes)
                );
                assert_eq!(ids(&plans[to], &expect.pieces), ids(plan, &out.pieces));
            }
            let mut tags: Vec<(u32, u64)> = messages[from]
                .outgoing
                .iter()
                .map(|m| (m.to, m.tag))
                .collect();
            let count = tags.len();
            tags.sort_unstable();
            tags.dedup();
            assert_eq!(tags.len(), count, "rank {from}: two messages share a tag");
        }
        assert!(cut > 0, "no share was large enough to be cut");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_in_parts_land_every_byte_in_process() {
    for plans in [
        tp2_to_tp2_dp2(),
        tp2_to_replicated_4(),
        overlapping_flat_ranges(),
    ] {
        let mesh = InProcTransport::mesh(plans.len() as u32, options());
        exchange_in_parts_and_check(mesh, &plans, Some(SMALL_PARTS)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_in_parts_land_every_byte_over_tcp() {
    let plans = tp2_to_pp2_dp2_tp2_zero1();
    let mesh = tcp_mesh(plans.len() as u32).await;
    exchange_in_parts_and_check(mesh, &plans, Some(SMALL_PARTS)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_in_parts_land_every_byte_when_a_send_waits_for_its_receive() {
    let plans = tp2_to_replicated_4();
    exchange_in_parts_and_check(
        sequenced_mesh(plans.len() as u32),
        &plans,
        Some(SMALL_PARTS),
    )
    .await;
}
