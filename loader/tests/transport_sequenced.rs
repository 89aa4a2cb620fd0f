//! The sequenced transport (the NCCL transport's protocol) on CPU: the full transport conformance
//! suite at worlds 2, 3 and 4 over an emulated data plane with NCCL's blocking rendezvous
//! semantics, with the control plane in-process or over TCP; and the emulated plane's own
//! semantics, which is what makes these tests mean something for NCCL.
// LoaderError is 128 bytes (object_store::Error is 72 of them), just at clippy's
// `result_large_err` threshold; the closures here return it on the cold path.
#![allow(clippy::unwrap_used, missing_docs, clippy::result_large_err)]

use std::time::{Duration, Instant};

use tessera_loader::LoaderError;
use tessera_loader::device::DeviceMemory;
use tessera_loader::testing::{EmulatedPlane, HostMemory};
use tessera_loader::transport::plane::{DataPlane, PlaneOp, PlaneThread};
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{
    InProcTransport, SequencedTransport, TcpTransport, TransportOptions, conformance,
};
use tessera_loader::transport_conformance_tests;

const TIMEOUT: Duration = Duration::from_secs(2);

fn options() -> TransportOptions {
    TransportOptions::with_timeout(TIMEOUT)
}

fn planes(world: u32) -> Vec<PlaneThread<EmulatedPlane>> {
    EmulatedPlane::mesh(world, TIMEOUT)
        .into_iter()
        .map(|plane| {
            let name = format!("plane-{}", plane.rank());
            PlaneThread::spawn(&name, move || Ok(plane)).unwrap()
        })
        .collect()
}

fn inproc_mesh(world: u32) -> Vec<SequencedTransport<InProcTransport, EmulatedPlane>> {
    InProcTransport::mesh(world, options())
        .into_iter()
        .zip(planes(world))
        .map(|(control, plane)| SequencedTransport::new(control, plane, options()))
        .collect()
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn tcp_mesh(world: u32) -> Vec<SequencedTransport<TcpTransport, EmulatedPlane>> {
    let port = free_port();
    let tasks: Vec<_> = (0..world)
        .map(|rank| {
            let config = RendezvousConfig::new(rank, world, "127.0.0.1", port).unwrap();
            tokio::spawn(async move { TcpTransport::connect(&config, options()).await })
        })
        .collect();
    let mut controls = Vec::new();
    for task in tasks {
        controls.push(task.await.unwrap().unwrap());
    }
    controls
        .into_iter()
        .zip(planes(world))
        .map(|(control, plane)| SequencedTransport::new(control, plane, options()))
        .collect()
}

transport_conformance_tests!(inproc_world2, inproc_mesh(2), TIMEOUT);
transport_conformance_tests!(inproc_world3, inproc_mesh(3), TIMEOUT);
transport_conformance_tests!(inproc_world4, inproc_mesh(4), TIMEOUT);
transport_conformance_tests!(tcp_world3, tcp_mesh(3).await, TIMEOUT);

/// A lone rank (NCCL's only configuration on one GPU): no peer to talk to, and it says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_of_one() {
    let mesh = inproc_mesh(1);
    conformance::lone_rank(&mesh[0]).await;
}

// The emulated plane itself: NCCL's semantics, or the tests above prove nothing about NCCL.

fn buffer(bytes: &[u8]) -> HostMemory {
    HostMemory::from_vec(bytes.to_vec())
}

/// Two ranks that both send first, each in its own group, block each other: a send waits for
/// its receive. This is the deadlock the sequencer exists to prevent.
#[test]
fn emulated_sends_block_until_received() {
    let mut planes = EmulatedPlane::mesh(2, Duration::from_millis(300));
    let mut b = planes.pop().unwrap();
    let mut a = planes.pop().unwrap();
    let other = std::thread::spawn(move || {
        let data = buffer(b"from b");
        let result = b.group(&[PlaneOp::Send {
            peer: 0,
            buffer: &data,
            len: 6,
        }]);
        (b, result)
    });
    let data = buffer(b"from a");
    let start = Instant::now();
    let mine = a.group(&[PlaneOp::Send {
        peer: 1,
        buffer: &data,
        len: 6,
    }]);
    let (_b, theirs) = other.join().unwrap();
    assert!(
        matches!(mine, Err(LoaderError::PeerTimeout { peer: 1, .. })),
        "{mine:?}"
    );
    assert!(
        matches!(theirs, Err(LoaderError::PeerTimeout { peer: 0, .. })),
        "{theirs:?}"
    );
    assert!(start.elapsed() >= Duration::from_millis(300));
}

/// In one group, a send and a receive crossing each other complete (what the grouped ring
/// relies on), and transfers between a pair match in posting order.
#[test]
fn emulated_groups_cross_and_match_in_order() {
    let mut planes = EmulatedPlane::mesh(2, TIMEOUT);
    let mut b = planes.pop().unwrap();
    let mut a = planes.pop().unwrap();
    let other = std::thread::spawn(move || {
        let out = buffer(b"BBBB");
        let (first, second) = (HostMemory::zeroed(3), HostMemory::zeroed(5));
        b.group(&[
            PlaneOp::Send {
                peer: 0,
                buffer: &out,
                len: 4,
            },
            PlaneOp::Recv {
                peer: 0,
                buffer: &first,
                len: 3,
            },
            PlaneOp::Recv {
                peer: 0,
                buffer: &second,
                len: 5,
            },
        ])
        .unwrap();
        (first.to_vec(), second.to_vec())
    });
    let (one, two) = (buffer(b"abc"), buffer(b"defgh"));
    let inbox = HostMemory::zeroed(8);
    a.group(&[
        PlaneOp::Recv {
            peer: 1,
            buffer: &inbox,
            len: 4,
        },
        PlaneOp::Send {
            peer: 1,
            buffer: &one,
            len: 3,
        },
        PlaneOp::Send {
            peer: 1,
            buffer: &two,
            len: 5,
        },
    ])
    .unwrap();
    let (first, second) = other.join().unwrap();
    assert_eq!(first, b"abc");
    assert_eq!(second, b"defgh");
    assert_eq!(&inbox.to_vec()[..4], b"BBBB");
    assert_eq!(inbox.len(), 8);
}

/// A length mismatch fails both sides, naming the sizes; a send to a rank whose plane is gone
/// fails at once.
#[test]
fn emulated_mismatch_and_death_fail() {
    let mut planes = EmulatedPlane::mesh(3, TIMEOUT);
    let dead = planes.pop().unwrap();
    let mut b = planes.pop().unwrap();
    let mut a = planes.pop().unwrap();
    let other = std::thread::spawn(move || {
        let inbox = HostMemory::zeroed(10);
        b.group(&[PlaneOp::Recv {
            peer: 0,
            buffer: &inbox,
            len: 10,
        }])
    });
    let data = buffer(&[7; 9]);
    let mine = a.group(&[PlaneOp::Send {
        peer: 1,
        buffer: &data,
        len: 9,
    }]);
    let theirs = other.join().unwrap();
    for result in [&mine, &theirs] {
        let text = result.as_ref().unwrap_err().to_string();
        assert!(
            text.contains("sent 9 bytes") && text.contains("receive of 10"),
            "{text}"
        );
    }
    // `a` is aborted now, like an NCCL communicator after an error.
    let again = a.group(&[]);
    assert!(again.is_err());

    let mut planes = EmulatedPlane::mesh(3, TIMEOUT);
    drop(dead);
    let gone = planes.pop().unwrap();
    drop(gone);
    let mut c = planes.remove(0);
    let start = Instant::now();
    let result = c.group(&[PlaneOp::Send {
        peer: 2,
        buffer: &data,
        len: 9,
    }]);
    assert!(
        matches!(result, Err(LoaderError::Transport { peer: 2, .. })),
        "{result:?}"
    );
    assert!(start.elapsed() < TIMEOUT);
}
