//! TCP rendezvous: ranks starting in any order, a world of one, and the failures that must be
//! quick and clear (no master, a missing rank, disagreeing world sizes, a stray connection).
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use bytes::Bytes;
use tessera_loader::LoaderError;
use tessera_loader::transport::rendezvous::RendezvousConfig;
use tessera_loader::transport::{TcpTransport, Transport, TransportOptions, conformance};
use tokio::io::AsyncWriteExt;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn options(connect: Duration) -> TransportOptions {
    TransportOptions {
        timeout: Duration::from_secs(2),
        connect_timeout: connect,
        progress_every: None,
    }
}

fn spawn_rank(
    rank: u32,
    world: u32,
    port: u16,
    connect: Duration,
) -> tokio::task::JoinHandle<Result<TcpTransport, LoaderError>> {
    tokio::spawn(async move {
        let config = RendezvousConfig::new(rank, world, "127.0.0.1", port).unwrap();
        TcpTransport::connect(&config, options(connect)).await
    })
}

fn rendezvous_detail(result: Result<TcpTransport, LoaderError>) -> String {
    match result {
        Err(LoaderError::Rendezvous { detail }) => detail,
        Err(other) => panic!("expected a rendezvous error, got {other}"),
        Ok(_) => panic!("expected a rendezvous error, the mesh came up"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_start_in_any_order() {
    let port = free_port();
    let connect = Duration::from_secs(10);
    let mut tasks = vec![None, None, None, None];
    // Highest rank first, the master last, with gaps: the others retry until it listens.
    for rank in [3u32, 1, 2, 0] {
        tasks[rank as usize] = Some(spawn_rank(rank, 4, port, connect));
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let mut mesh = Vec::new();
    for task in tasks.into_iter().flatten() {
        mesh.push(task.await.unwrap().unwrap());
    }
    conformance::all_pairs_ring(&mesh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn world_of_one_needs_no_network() {
    let config = RendezvousConfig::new(0, 1, "127.0.0.1", free_port()).unwrap();
    let solo = TcpTransport::connect(&config, options(Duration::from_secs(1)))
        .await
        .unwrap();
    assert_eq!((solo.rank(), solo.world()), (0, 1));
    assert!(solo.send(0, 1, Bytes::new()).await.is_err());
    assert!(solo.recv(0, 1).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_master_fails_within_the_connect_timeout() {
    let port = free_port();
    let start = Instant::now();
    let detail = rendezvous_detail(
        spawn_rank(1, 2, port, Duration::from_millis(500))
            .await
            .unwrap(),
    );
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
    assert!(
        detail.contains("could not reach the master") && detail.contains(&port.to_string()),
        "{detail}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_rank_is_named() {
    let port = free_port();
    let connect = Duration::from_millis(800);
    let master = spawn_rank(0, 3, port, connect);
    let one = spawn_rank(1, 3, port, connect);
    let start = Instant::now();
    let detail = rendezvous_detail(master.await.unwrap());
    assert!(detail.contains("missing ranks [2]"), "{detail}");
    // Rank 1 learns the rendezvous is off when the master goes away, or times out itself.
    let detail = rendezvous_detail(one.await.unwrap());
    assert!(detail.contains("rank 1"), "{detail}");
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "took {:?}",
        start.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disagreeing_world_sizes_are_an_error() {
    let port = free_port();
    let connect = Duration::from_secs(2);
    let master = spawn_rank(0, 2, port, connect);
    let other = spawn_rank(1, 3, port, connect);
    let detail = rendezvous_detail(master.await.unwrap());
    assert!(
        detail.contains("WORLD_SIZE=2") && detail.contains("3 ranks"),
        "{detail}"
    );
    assert!(other.await.unwrap().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_rank_is_an_error() {
    let port = free_port();
    let connect = Duration::from_secs(2);
    let master = spawn_rank(0, 3, port, connect);
    let a = spawn_rank(1, 3, port, connect);
    let b = spawn_rank(1, 3, port, connect);
    let detail = rendezvous_detail(master.await.unwrap());
    assert!(detail.contains("rank 1 checked in twice"), "{detail}");
    assert!(a.await.unwrap().is_err());
    assert!(b.await.unwrap().is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stray_connections_are_turned_away() {
    let port = free_port();
    let connect = Duration::from_secs(5);
    let master = spawn_rank(0, 2, port, connect);
    // A stranger talks garbage to the master, another connects and says nothing.
    let mut garbage = loop {
        if let Ok(s) = tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    garbage.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let _silent = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let one = spawn_rank(1, 2, port, connect);
    let mesh = vec![master.await.unwrap().unwrap(), one.await.unwrap().unwrap()];
    conformance::point_to_point(&mesh).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn master_port_in_use_is_an_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port();
    let detail = rendezvous_detail(
        spawn_rank(0, 2, port, Duration::from_secs(1))
            .await
            .unwrap(),
    );
    assert!(
        detail.contains("could not listen") && detail.contains("MASTER_PORT"),
        "{detail}"
    );
}

/// A rank of another job (another plan fingerprint) on the master's port is refused by name,
/// with both fingerprints, instead of joining a mesh it does not belong to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_of_another_job_is_refused_naming_both() {
    let port = free_port();
    let connect = Duration::from_secs(5);
    let join = |rank: u32, job: u64| {
        tokio::spawn(async move {
            let config = RendezvousConfig::new(rank, 2, "127.0.0.1", port)
                .unwrap()
                .with_job(job);
            TcpTransport::connect(&config, options(connect)).await
        })
    };
    let master = join(0, 0xaaaa);
    let impostor = join(1, 0xbbbb);
    let start = Instant::now();
    let detail = rendezvous_detail(master.await.unwrap());
    assert!(
        detail.starts_with("rank 0 refused rank 1 from 127.0.0.1:")
            && detail
                .contains("it loads job 000000000000bbbb but rank 0 loads job 000000000000aaaa"),
        "{detail}"
    );
    assert!(impostor.await.unwrap().is_err());
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
}

/// Two processes claiming one rank: the error names both connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_rank_names_both_connections() {
    let port = free_port();
    let connect = Duration::from_secs(2);
    let master = spawn_rank(0, 3, port, connect);
    let a = spawn_rank(1, 3, port, connect);
    let b = spawn_rank(1, 3, port, connect);
    let detail = rendezvous_detail(master.await.unwrap());
    let (_, rest) = detail
        .split_once("rank 1 checked in twice, from 127.0.0.1:")
        .unwrap_or_else(|| panic!("{detail}"));
    assert!(rest.contains(" and from 127.0.0.1:"), "{detail}");
    let _ = (a.await, b.await);
}
