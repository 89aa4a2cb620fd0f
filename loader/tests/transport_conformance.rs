//! The transport conformance suite against every CPU transport: in-process and TCP loopback.
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Duration;

use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{InProcTransport, TcpTransport, TransportOptions, conformance};
use tessera_loader::transport_conformance_tests;

const WORLD: u32 = 4;
const TIMEOUT: Duration = Duration::from_secs(2);

fn options() -> TransportOptions {
    TransportOptions::with_timeout(TIMEOUT)
}

fn inproc_mesh() -> Vec<InProcTransport> {
    InProcTransport::mesh(WORLD, options())
}

/// A port nobody listens on right now (the OS picks it; there is a small window for a race).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A TCP mesh on loopback: `WORLD` tasks each joining through rank 0.
async fn tcp_mesh() -> Vec<TcpTransport> {
    let port = free_port();
    let tasks: Vec<_> = (0..WORLD)
        .map(|rank| {
            let config = RendezvousConfig::new(rank, WORLD, "127.0.0.1", port).unwrap();
            tokio::spawn(async move { TcpTransport::connect(&config, options()).await })
        })
        .collect();
    let mut mesh = Vec::new();
    for task in tasks {
        mesh.push(task.await.unwrap().unwrap());
    }
    mesh
}

transport_conformance_tests!(inproc, inproc_mesh(), TIMEOUT);
transport_conformance_tests!(tcp, tcp_mesh().await, TIMEOUT);

/// A world of one rank, in-process and over TCP (no rendezvous needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_rank() {
    conformance::lone_rank(&InProcTransport::mesh(1, options())[0]).await;
    let config = RendezvousConfig::new(0, 1, "127.0.0.1", free_port()).unwrap();
    let tcp = TcpTransport::connect(&config, options()).await.unwrap();
    conformance::lone_rank(&tcp).await;
}
