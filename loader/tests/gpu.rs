//! The GPU path on a GPU (feature `cuda`). Each test first checks for a CUDA device and, where
//! there is none, prints `skipped: <reason>` and returns. Where there is one: staged uploads and
//! device copies checked byte for byte, a synthetic checkpoint loaded into device memory (loader
//! buffers and caller-provided pointers) copied back and compared with the formula, and the NCCL
//! transport at world size 1 (and 2 or 4 where there are that many GPUs). `make gpu-test` runs
//! these with every other GPU test.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, missing_docs)]

mod support_read;

use std::sync::Arc;
use std::time::Duration;

use support_read::{DP2_TP2, WHOLE, expected_destination, rank_plans};
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::device::DeviceMemory;
use tessera_loader::device::cuda::{CudaDevice, DeviceBuffer, NcclTransport, connect_nccl, probe};
use tessera_loader::device::load::{DeviceExchange, OnHost, load_rank_to_device};
use tessera_loader::device::staging::{StagingOptions, Upload};
use tessera_loader::exchange::place::copy_runs;
use tessera_loader::load::LoadOptions;
use tessera_loader::transport::plane::{DataPlane, PlaneOp};
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{InProcTransport, TransportOptions, conformance};
use tessera_planner::{RankPlan, StridedRuns};

/// Why GPU tests cannot run here, if they cannot.
fn no_gpu() -> Option<String> {
    match CudaDevice::count() {
        Ok(0) => Some("no CUDA device is visible".to_string()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}

/// Why NCCL tests cannot run here, if they cannot.
fn no_nccl(ranks: u32) -> Option<String> {
    if let Some(reason) = no_gpu() {
        return Some(reason);
    }
    if let Err(e) = probe::nccl() {
        return Some(e.to_string());
    }
    let gpus = CudaDevice::count().unwrap_or(0);
    (gpus < ranks).then(|| {
        format!("{ranks} ranks need {ranks} GPUs (NCCL refuses two ranks on one GPU); {gpus} here")
    })
}

macro_rules! skip_unless {
    ($reason:expr) => {
        if let Some(reason) = $reason {
            println!("skipped: {reason}");
            return;
        }
    };
}

fn bytes(seed: u64, len: usize) -> Vec<u8> {
    let mut z = seed;
    (0..len)
        .map(|_| {
            z = z
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (z >> 56) as u8
        })
        .collect()
}

fn options() -> TransportOptions {
    TransportOptions::with_timeout(Duration::from_secs(30))
}

/// Pinned staging into device memory: awkward sizes and offsets, several lanes, copied back.
#[test]
fn staged_upload_round_trips() {
    skip_unless!(no_gpu());
    let device = CudaDevice::open(0).unwrap();
    let mut pool = device
        .staging(StagingOptions {
            chunk_bytes: 1 << 20,
            buffers: 2,
            lanes: 3,
        })
        .unwrap();
    let sources: Vec<Vec<u8>> = [0usize, 1, (1 << 20) - 1, 1 << 20, (5 << 20) + 7]
        .iter()
        .enumerate()
        .map(|(i, &n)| bytes(i as u64 + 1, n))
        .collect();
    let total: usize = sources.iter().map(Vec::len).sum();
    let target = device.alloc(total + 64).unwrap();
    let mut expected = vec![0u8; total + 64];
    let mut at = 64u64;
    let mut uploads = Vec::new();
    for source in &sources {
        uploads.push(Upload {
            source,
            target: &target,
            offset: at,
        });
        expected[at as usize..at as usize + source.len()].copy_from_slice(source);
        at += source.len() as u64;
    }
    // The last upload ends exactly at the buffer's end... and one byte further is refused.
    let stats = pool.upload(&uploads[..]).unwrap();
    assert_eq!(stats.bytes, total as u64);
    assert!(device.to_host(&target).unwrap() == expected);
    let over = [Upload {
        source: &sources[1][..],
        target: &target,
        offset: (total + 64) as u64,
    }];
    assert!(pool.upload(&over).is_err());
    println!(
        "staged {} MB at {:.2} GB/s on {}",
        stats.bytes / 1_000_000,
        stats.gb_per_s(),
        device.name()
    );
}

async fn fixture() -> (tempfile::TempDir, Checkpoint) {
    support_read::local_checkpoint().await
}

fn check_on_device(device: &CudaDevice, plan: &RankPlan, buffers: &[DeviceBuffer]) {
    for (d, buffer) in buffers.iter().enumerate() {
        assert!(
            device.to_host(buffer).unwrap() == expected_destination(plan, d),
            "rank {} destination {d}: wrong bytes in device memory",
            plan.rank
        );
    }
}

async fn load_on<X: DeviceExchange<DeviceBuffer>>(
    checkpoint: &Checkpoint,
    plan: RankPlan,
    exchange: &X,
    device: &CudaDevice,
    destinations: Vec<DeviceBuffer>,
) -> Vec<DeviceBuffer> {
    let mut pool = device.staging(StagingOptions::default()).unwrap();
    let loaded = load_rank_to_device(
        checkpoint,
        plan.clone(),
        exchange,
        &mut pool,
        destinations,
        &LoadOptions::default(),
    )
    .await
    .unwrap();
    assert_eq!(loaded.report.h2d_bytes, plan.summary.bytes_needed);
    check_on_device(device, &plan, &loaded.buffers);
    loaded.buffers
}

/// The synthetic checkpoint into loader-allocated device buffers, one rank, and four ranks of
/// dp2 × tp2 on this GPU exchanging on the host.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_into_device_memory() {
    skip_unless!(no_gpu());
    let device = CudaDevice::open(0).unwrap();
    let (_dir, checkpoint) = fixture().await;
    let plan = rank_plans(&checkpoint.meta, WHOLE, true).remove(0);
    let transport = OnHost(InProcTransport::mesh(1, options()).remove(0));
    let destinations = device.alloc_destinations(&plan).unwrap();
    load_on(&checkpoint, plan, &transport, &device, destinations).await;

    let plans = rank_plans(&checkpoint.meta, DP2_TP2, true);
    let tasks: Vec<_> = InProcTransport::mesh(plans.len() as u32, options())
        .into_iter()
        .zip(plans)
        .map(|(transport, plan)| {
            let (device, checkpoint) = (device.clone(), checkpoint.clone());
            tokio::spawn(async move {
                let destinations = device.alloc_destinations(&plan).unwrap();
                load_on(&checkpoint, plan, &OnHost(transport), &device, destinations).await;
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}

/// Caller-provided device memory (what a torch integration passes as `tensor.data_ptr()`): the
/// loader writes into it, does not free it, and the owner sees the formula's bytes.
// Wrapping device memory by address is `unsafe` by contract: this test plays the caller.
#[allow(unsafe_code)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_into_caller_pointers() {
    skip_unless!(no_gpu());
    let device = CudaDevice::open(0).unwrap();
    let (_dir, checkpoint) = fixture().await;
    let plan = rank_plans(&checkpoint.meta, WHOLE, true).remove(0);
    // The "framework's" tensors: one allocation, destinations packed at 256-byte alignment.
    let sizes: Vec<usize> = plan.destinations.iter().map(|d| d.bytes as usize).collect();
    let offsets: Vec<usize> = sizes
        .iter()
        .scan(0usize, |at, &n| {
            let here = *at;
            *at += n.div_ceil(256) * 256;
            Some(here)
        })
        .collect();
    let arena = device
        .alloc(offsets.last().unwrap() + sizes.last().unwrap())
        .unwrap();
    let wrapped: Vec<DeviceBuffer> = offsets
        .iter()
        .zip(&sizes)
        // SAFETY: each range lies inside `arena`, which outlives the load, and nothing else
        // touches it meanwhile.
        .map(|(&at, &n)| unsafe { device.wrap(arena.device_ptr() + at as u64, n) })
        .collect();
    assert!(wrapped.iter().all(|b| !b.is_owned()));
    let transport = OnHost(InProcTransport::mesh(1, options()).remove(0));
    let returned = load_on(&checkpoint, plan.clone(), &transport, &device, wrapped).await;
    drop(returned);
    // Still the caller's memory, still holding the bytes after the wrappers are gone.
    let whole = device.to_host(&arena).unwrap();
    for (d, (&at, &n)) in offsets.iter().zip(&sizes).enumerate() {
        assert!(
            whole[at..at + n] == expected_destination(&plan, d)[..],
            "destination {d}"
        );
    }
}

async fn nccl_world_of_one() -> (CudaDevice, NcclTransport) {
    let device = CudaDevice::open(0).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = RendezvousConfig::new(0, 1, "127.0.0.1", port).unwrap();
    let transport = connect_nccl(&config, options(), &device).await.unwrap();
    (device, transport)
}

/// NCCL at world size 1: the transport's lone-rank checks, a real NCCL transfer (rank 0 to
/// itself in one group), the plane's strided device copies against the host's, and a device
/// load through it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nccl_transport_world_of_one() {
    skip_unless!(no_nccl(1));
    let (device, transport) = nccl_world_of_one().await;
    conformance::lone_rank(&transport).await;

    let data = bytes(42, (3 << 20) + 5);
    let sent = data.clone();
    let echoed = transport
        .plane()
        .run(move |plane| {
            let (out, back) = (plane.alloc(sent.len())?, plane.alloc(sent.len())?);
            plane.upload(&sent, &out, 0)?;
            plane.group(&[
                PlaneOp::Send {
                    peer: 0,
                    buffer: &out,
                    len: sent.len(),
                },
                PlaneOp::Recv {
                    peer: 0,
                    buffer: &back,
                    len: sent.len(),
                },
            ])?;
            let mut host = vec![0u8; sent.len()];
            plane.download(&back, 0, &mut host)?;
            Ok::<_, tessera_loader::LoaderError>(host)
        })
        .await
        .unwrap()
        .unwrap();
    assert!(echoed == data, "NCCL self-transfer changed the bytes");

    // Contiguous, 2-D (a column slice: 100 rows of 24 bytes at pitch 96 into pitch 40) and 3-D.
    let cases = [
        StridedRuns {
            run_bytes: 5000,
            counts: vec![],
            src_offset: 7,
            src_strides: vec![],
            dst_offset: 3,
            dst_strides: vec![],
        },
        StridedRuns {
            run_bytes: 24,
            counts: vec![100],
            src_offset: 48,
            src_strides: vec![96],
            dst_offset: 8,
            dst_strides: vec![40],
        },
        StridedRuns {
            run_bytes: 6,
            counts: vec![3, 4],
            src_offset: 1,
            src_strides: vec![400, 50],
            dst_offset: 0,
            dst_strides: vec![24, 6],
        },
    ];
    for runs in cases {
        let source = bytes(7, 10_000);
        let mut expected = vec![0u8; 5_100];
        copy_runs(&runs, &source, &mut expected);
        let job_runs = runs.clone();
        let got = transport
            .plane()
            .run(move |plane| {
                let (src, dst) = (plane.alloc(source.len())?, plane.alloc(5_100)?);
                plane.upload(&source, &src, 0)?;
                plane.upload(&vec![0u8; 5_100], &dst, 0)?;
                plane.copy_runs(&job_runs, &src, &dst)?;
                let mut host = vec![0u8; dst.len()];
                plane.download(&dst, 0, &mut host)?;
                Ok::<_, tessera_loader::LoaderError>(host)
            })
            .await
            .unwrap()
            .unwrap();
        assert!(got == expected, "device copy along {runs:?}");
    }

    let (_dir, checkpoint) = fixture().await;
    let plan = rank_plans(&checkpoint.meta, WHOLE, true).remove(0);
    let destinations = device.alloc_destinations(&plan).unwrap();
    load_on(&checkpoint, plan, &transport, &device, destinations).await;
}

/// Ranks on GPUs `0..world`, each with its own NCCL transport (one process, one task per rank).
async fn nccl_mesh(world: u32) -> Vec<(CudaDevice, NcclTransport)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let tasks: Vec<_> = (0..world)
        .map(|rank| {
            tokio::spawn(async move {
                let device = CudaDevice::open(rank).unwrap();
                let config = RendezvousConfig::new(rank, world, "127.0.0.1", port).unwrap();
                let transport = connect_nccl(&config, options(), &device).await.unwrap();
                (device, transport)
            })
        })
        .collect();
    let mut mesh = Vec::new();
    for task in tasks {
        mesh.push(task.await.unwrap());
    }
    mesh
}

/// Two GPUs: the transport conformance checks that keep the mesh, and a device load whose ring
/// runs GPU to GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nccl_transport_two_gpus() {
    skip_unless!(no_nccl(2));
    let (devices, mesh): (Vec<_>, Vec<_>) = nccl_mesh(2).await.into_iter().unzip();
    conformance::point_to_point(&mesh).await;
    conformance::many_tags_out_of_order(&mesh).await;
    conformance::sends_do_not_wait_for_recv(&mesh).await;
    conformance::all_pairs_ring(&mesh).await;
    conformance::large_message(&mesh).await;
    conformance::empty_message(&mesh).await;
    conformance::send_to_self_is_an_error(&mesh).await;

    let (_dir, checkpoint) = fixture().await;
    let dp2 = r#"{"mesh": [{"name": "dp", "size": 2}],
        "rules": [{"match": "*", "placements": ["replicate"]}]}"#;
    let plans = rank_plans(&checkpoint.meta, dp2, true);
    assert!(plans.iter().all(|p| p.summary.bytes_received > 0));
    let mesh: Vec<Arc<NcclTransport>> = mesh.into_iter().map(Arc::new).collect();
    let tasks: Vec<_> = plans
        .into_iter()
        .zip(devices)
        .zip(mesh.iter().cloned())
        .map(|((plan, device), transport)| {
            let checkpoint = checkpoint.clone();
            tokio::spawn(async move {
                let destinations = device.alloc_destinations(&plan).unwrap();
                load_on(&checkpoint, plan, &*transport, &device, destinations).await;
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
    conformance::messages_sent_before_exit_are_delivered(
        mesh.into_iter()
            .map(|t| Arc::try_unwrap(t).unwrap())
            .collect(),
    )
    .await;
}

/// Four GPUs: dp2 × tp2 with the ring GPU to GPU.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nccl_ring_four_gpus() {
    skip_unless!(no_nccl(4));
    let (_dir, checkpoint) = fixture().await;
    let plans = rank_plans(&checkpoint.meta, DP2_TP2, true);
    let mesh: Vec<Arc<(CudaDevice, NcclTransport)>> =
        nccl_mesh(4).await.into_iter().map(Arc::new).collect();
    let tasks: Vec<_> = plans
        .into_iter()
        .zip(mesh.iter().cloned())
        .map(|(plan, rank)| {
            let checkpoint = checkpoint.clone();
            tokio::spawn(async move {
                let (device, transport) = &*rank;
                let destinations = device.alloc_destinations(&plan).unwrap();
                load_on(&checkpoint, plan, transport, device, destinations).await;
            })
        })
        .collect();
    for task in tasks {
        task.await.unwrap();
    }
}
