//! The device load pipeline on CPU: a real checkpoint on disk (synthetic formula bytes, verified
//! reads) loaded into emulated device memory through the pinned staging pool, with the exchange
//! on host buffers (in-process transport) or device to device on emulated NCCL planes (the
//! sequenced transport's grouped ring). Every destination is copied back and compared with the
//! formula, byte for byte.
// LoaderError is 128 bytes (object_store::Error is 72 of them), just at clippy's
// `result_large_err` threshold; the closures here return it on the cold path.
#![allow(clippy::unwrap_used, missing_docs, clippy::result_large_err)]

mod support_read;

use std::sync::Arc;
use std::time::Duration;

use support_read::{COLUMNS_TP3, DP2_TP2, WHOLE, expected_destination, rank_plans};
use tessera_loader::LoaderError;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::device::load::{DeviceExchange, DeviceLoadedRank, OnHost, load_rank_to_device};
use tessera_loader::device::staging::{StagingOptions, StagingPool};
use tessera_loader::load::LoadOptions;
use tessera_loader::read::ReadOptions;
use tessera_loader::testing::{EmulatedPlane, HostCopyEngine, HostMemory};
use tessera_loader::transport::plane::PlaneThread;
use tessera_loader::transport::{InProcTransport, SequencedTransport, TransportOptions};
use tessera_planner::RankPlan;

const TIMEOUT: Duration = Duration::from_secs(5);

fn transport_options() -> TransportOptions {
    TransportOptions::with_timeout(TIMEOUT)
}

/// The fixture checkpoint on a local disk, opened as a loader would open it.
async fn checkpoint() -> (tempfile::TempDir, Checkpoint) {
    support_read::local_checkpoint().await
}

/// Small chunks and two lanes, so even this small checkpoint takes many staged copies.
fn staging() -> StagingPool<HostCopyEngine> {
    StagingPool::new(
        HostCopyEngine::new(Duration::ZERO),
        StagingOptions {
            chunk_bytes: 4096,
            buffers: 2,
            lanes: 2,
        },
    )
    .unwrap()
}

fn options() -> LoadOptions {
    LoadOptions {
        read: ReadOptions {
            verify: true,
            ..ReadOptions::default()
        },
        progress: None,
        ..LoadOptions::default()
    }
}

fn destinations(plan: &RankPlan) -> Vec<HostMemory> {
    plan.destinations
        .iter()
        .map(|d| HostMemory::zeroed(d.bytes as usize))
        .collect()
}

/// Loads every rank of `plans` at once into emulated device memory, rank `r` exchanging through
/// `exchanges[r]`; returns each rank's outcome in rank order. Every exchange lives until all ranks
/// are done (a transport dropped early is a peer that died).
async fn load_ranks<X>(
    checkpoint: &Checkpoint,
    plans: &[RankPlan],
    exchanges: Vec<X>,
) -> Vec<Result<DeviceLoadedRank<HostMemory>, LoaderError>>
where
    X: DeviceExchange<HostMemory> + Send + 'static,
{
    let tasks: Vec<_> = plans
        .iter()
        .cloned()
        .zip(exchanges)
        .map(|(plan, exchange)| {
            let checkpoint = checkpoint.clone();
            tokio::spawn(async move {
                let mut pool = staging();
                let dests = destinations(&plan);
                let loaded =
                    load_rank_to_device(&checkpoint, plan, &exchange, &mut pool, dests, &options())
                        .await;
                (loaded, exchange)
            })
        })
        .collect();
    let mut outcomes = Vec::new();
    for task in tasks {
        outcomes.push(task.await.unwrap());
    }
    outcomes.into_iter().map(|(loaded, _)| loaded).collect()
}

/// Every device buffer of `loaded` holds the formula's bytes of its destination.
fn check_device_buffers(loaded: &DeviceLoadedRank<HostMemory>, plan: &RankPlan) {
    for (d, buffer) in loaded.buffers.iter().enumerate() {
        assert!(
            buffer.to_vec() == expected_destination(plan, d),
            "rank {} destination {d}: wrong bytes on the device",
            plan.rank
        );
    }
}

/// Loads every rank of `plans` concurrently, rank `r` exchanging through `exchanges[r]`, and
/// checks every rank's device buffers against the formula and its report against its plan.
async fn load_all<X>(checkpoint: &Checkpoint, plans: &[RankPlan], exchanges: Vec<X>)
where
    X: DeviceExchange<HostMemory> + Send + 'static,
{
    let outcomes = load_ranks(checkpoint, plans, exchanges).await;
    for (loaded, plan) in outcomes.into_iter().zip(plans) {
        let loaded = loaded.unwrap_or_else(|e| panic!("rank {}: {e}", plan.rank));
        assert_eq!(&loaded.plan, plan);
        check_device_buffers(&loaded, plan);
        let report = &loaded.report;
        assert_eq!(report.rank, plan.rank);
        assert_eq!(report.bytes_needed, plan.summary.bytes_needed);
        assert_eq!(report.h2d_bytes, plan.summary.bytes_needed);
        assert_eq!(report.bytes_read, plan.summary.bytes_read);
        assert_eq!(report.bytes_sent, plan.summary.bytes_sent);
        assert_eq!(report.bytes_received, plan.summary.bytes_received);
        assert!(report.h2d_seconds > 0.0 && report.h2d_seconds <= report.total_seconds);
    }
}

async fn on_host(layout: &str) {
    let (_dir, checkpoint) = checkpoint().await;
    let plans = rank_plans(&checkpoint.meta, layout, true);
    let mesh = InProcTransport::mesh(plans.len() as u32, transport_options());
    load_all(&checkpoint, &plans, mesh.into_iter().map(OnHost).collect()).await;
}

async fn on_device(layout: &str) {
    let (_dir, checkpoint) = checkpoint().await;
    let plans = rank_plans(&checkpoint.meta, layout, true);
    let world = plans.len() as u32;
    let mesh: Vec<_> = InProcTransport::mesh(world, transport_options())
        .into_iter()
        .zip(EmulatedPlane::mesh(world, TIMEOUT))
        .map(|(control, plane)| {
            let name = format!("plane-{}", plane.rank());
            let plane = PlaneThread::spawn(&name, move || Ok(plane)).unwrap();
            SequencedTransport::new(control, plane, transport_options())
        })
        .collect();
    load_all(&checkpoint, &plans, mesh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_checkpoint_one_rank() {
    on_host(WHOLE).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp2_tp2_exchange_on_host() {
    on_host(DP2_TP2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp2_tp2_exchange_on_device() {
    on_device(DP2_TP2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn columns_tp3_exchange_on_device() {
    on_device(COLUMNS_TP3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn whole_checkpoint_on_a_device_world_of_one() {
    on_device(WHOLE).await;
}

/// Caller-provided destinations must match the plan: a wrong count or size is refused before
/// anything is read, naming the destination and tensor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destinations_must_fit_the_plan() {
    let (_dir, checkpoint) = checkpoint().await;
    let plan = rank_plans(&checkpoint.meta, WHOLE, true).remove(0);
    let transport = Arc::new(InProcTransport::mesh(1, transport_options()).remove(0));
    let mut pool = staging();
    let mut dests = destinations(&plan);
    dests[1] = HostMemory::zeroed(dests[1].to_vec().len() + 1);
    let fqn = plan.tensors[plan.destinations[1].tensor as usize]
        .fqn
        .clone();
    let err = load_rank_to_device(
        &checkpoint,
        plan.clone(),
        &OnHost(Arc::clone(&transport)),
        &mut pool,
        dests,
        &options(),
    )
    .await
    .unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, LoaderError::Device { .. })
            && text.contains("destination 1")
            && text.contains(&fqn),
        "{text}"
    );
    let mut dests = destinations(&plan);
    dests.pop();
    let err = load_rank_to_device(
        &checkpoint,
        plan,
        &OnHost(Arc::clone(&transport)),
        &mut pool,
        dests,
        &options(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, LoaderError::Device { .. }), "{err}");
}

/// A load into (emulated) device memory over a host transport runs the pipeline every host load
/// runs before its upload: a column reshard of a checkpoint saved by rows has its saved boxes
/// verified jointly from the ranks' parts (no checksum block fetched: every rank fetches its own
/// columns and nothing more) and the replicas copy each other's shares straight out of memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_column_reshard_into_device_memory_uses_joint_checks_and_direct_copies() {
    let (_dir, checkpoint) = support_read::synth_saved_by_rows(4).await;
    let plans = rank_plans(&checkpoint.meta, DP2_TP2_MATRICES, true);
    assert!(
        plans.iter().any(|p| !p.joint_checks.is_empty()),
        "the plan has no joint checks"
    );
    let mut direct = 0;
    for (loaded, plan) in load_on_host(&checkpoint, &plans)
        .await
        .into_iter()
        .zip(&plans)
    {
        let loaded = loaded.unwrap_or_else(|e| panic!("rank {}: {e}", plan.rank));
        check_device_buffers(&loaded, plan);
        let report = &loaded.report;
        assert_eq!(report.verify_extra_bytes, 0, "rank {}", plan.rank);
        assert_eq!(
            report.bytes_fetched, report.bytes_read,
            "rank {}",
            plan.rank
        );
        assert_eq!(report.bytes_received, plan.summary.bytes_received);
        assert_eq!(report.h2d_bytes, plan.summary.bytes_needed);
        direct += report.bytes_received_direct;
    }
    let received: u64 = plans.iter().map(|p| p.summary.bytes_received).sum();
    assert!(
        received > 0 && direct == received,
        "{direct} of {received} copied directly"
    );
}

/// The same load with a flipped byte inside a jointly checked box: every rank holding a part of
/// the box fails naming it (the folds do not add up), none uploads wrong bytes as success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_byte_in_a_column_read_box_fails_the_device_load() {
    let (dir, checkpoint) = support_read::synth_saved_by_rows(4).await;
    let plans = rank_plans(&checkpoint.meta, DP2_TP2_MATRICES, true);
    let check = plans
        .iter()
        .flat_map(|p| &p.joint_checks)
        .next()
        .expect("a joint check")
        .clone();
    let fqn = &plans
        .iter()
        .find(|p| p.joint_checks.iter().any(|c| c.id == check.id))
        .unwrap()
        .tensors[check.tensor as usize]
        .fqn;
    let tensor = checkpoint.meta.tensor_index(fqn).unwrap();
    let chunk = checkpoint
        .meta
        .chunks_of(tensor)
        .iter()
        .find(|c| c.region == check.region)
        .unwrap()
        .clone();
    let file = &checkpoint.meta.files()[chunk.bytes.file as usize].path;
    let path = dir.path().join(support_read::PREFIX).join(file);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[(chunk.bytes.offset + chunk.bytes.length / 2) as usize] ^= 0xFF;
    std::fs::write(&path, bytes).unwrap();

    for (outcome, plan) in load_on_host(&checkpoint, &plans)
        .await
        .into_iter()
        .zip(&plans)
    {
        if !check.members.contains(&plan.rank) {
            continue;
        }
        let error = outcome.expect_err("a member of the corrupt box's check succeeded");
        assert!(
            matches!(error, LoaderError::JointChecksum(_)),
            "rank {}: {error}",
            plan.rank
        );
        assert!(error.to_string().contains(fqn.as_str()), "{error}");
    }
}

/// [`load_ranks`] with the exchange on the host over one in-process mesh.
async fn load_on_host(
    checkpoint: &Checkpoint,
    plans: &[RankPlan],
) -> Vec<Result<DeviceLoadedRank<HostMemory>, LoaderError>> {
    let mesh = InProcTransport::mesh(plans.len() as u32, transport_options());
    load_ranks(checkpoint, plans, mesh.into_iter().map(OnHost).collect()).await
}

/// Two data-parallel replicas of a tp=2 column split of every matrix; vectors and scalars whole.
const DP2_TP2_MATRICES: &str = r#"{"mesh": [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}],
    "rules": [{"match": "*norm*", "placements": ["replicate", "replicate"]},
              {"match": "*.weight", "placements": ["replicate", "shard(1)"]},
              {"match": "*", "placements": ["replicate", "replicate"]}]}"#;
