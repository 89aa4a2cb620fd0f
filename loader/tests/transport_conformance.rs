//! The transport conformance suite against every CPU transport: in-process and TCP loopback.
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Duration;

use tessera_loader::rendezvous::RendezvousConfig;
use tessera_loader::transport::{InProcTransport, TcpTransport, TransportOptions, conformance};

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

macro_rules! suite {
    ($module:ident, $make:expr) => {
        mod $module {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn point_to_point() {
                conformance::point_to_point(&$make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn many_tags_out_of_order() {
                conformance::many_tags_out_of_order(&$make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sends_do_not_wait_for_recv() {
                conformance::sends_do_not_wait_for_recv(&$make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn all_pairs_ring() {
                conformance::all_pairs_ring(&$make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn large_message() {
                conformance::large_message(&$make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn empty_message() {
                conformance::empty_message(&$make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn send_to_self_is_an_error() {
                conformance::send_to_self_is_an_error(&$make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn recv_times_out() {
                conformance::recv_times_out(&$make, TIMEOUT).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn messages_sent_before_exit_are_delivered() {
                conformance::messages_sent_before_exit_are_delivered($make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn peer_death_fails_fast() {
                // Well under the transport timeout: death is noticed, not timed out.
                conformance::peer_death_fails_fast($make, Duration::from_secs(1)).await;
            }

            /// The checks that leave the mesh clean also pass one after another on one mesh.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn whole_suite_on_one_mesh() {
                let mesh = $make;
                conformance::point_to_point(&mesh).await;
                conformance::many_tags_out_of_order(&mesh).await;
                conformance::sends_do_not_wait_for_recv(&mesh).await;
                conformance::all_pairs_ring(&mesh).await;
                conformance::empty_message(&mesh).await;
                conformance::send_to_self_is_an_error(&mesh).await;
                conformance::messages_sent_before_exit_are_delivered(mesh).await;
            }
        }
    };
}

suite!(inproc, inproc_mesh());
suite!(tcp, tcp_mesh().await);

/// A world of one rank, in-process and over TCP (no rendezvous needed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lone_rank() {
    conformance::lone_rank(&InProcTransport::mesh(1, options())[0]).await;
    let config = RendezvousConfig::new(0, 1, "127.0.0.1", free_port()).unwrap();
    let tcp = TcpTransport::connect(&config, options()).await.unwrap();
    conformance::lone_rank(&tcp).await;
}
