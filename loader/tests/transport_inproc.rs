//! The in-process transport across OS threads, each with its own runtime (how ranks that own
//! thread-bound resources, like an NCCL communicator, would use it).
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Duration;

use bytes::Bytes;
use tessera_loader::LoaderError;
use tessera_loader::transport::{InProcTransport, Transport, TransportOptions};

fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(future)
}

#[test]
fn ranks_on_threads_exchange_in_a_ring() {
    let world = 3u32;
    let mesh = InProcTransport::mesh(
        world,
        TransportOptions::with_timeout(Duration::from_secs(2)),
    );
    let threads: Vec<_> = mesh
        .into_iter()
        .map(|t| {
            std::thread::spawn(move || {
                block_on(async {
                    let r = t.rank();
                    for k in 1..world {
                        let to = (r + k) % world;
                        t.send(
                            to,
                            u64::from(k),
                            Bytes::from(vec![r as u8; 10 * k as usize]),
                        )
                        .await
                        .unwrap();
                    }
                    for k in 1..world {
                        let from = (r + world - k) % world;
                        let got = t.recv(from, u64::from(k)).await.unwrap();
                        assert_eq!(got.as_ref(), vec![from as u8; 10 * k as usize].as_slice());
                    }
                    // Stay alive until every rank is done receiving.
                    t
                })
            })
        })
        .collect();
    let done: Vec<_> = threads.into_iter().map(|h| h.join().unwrap()).collect();
    assert_eq!(done.len(), 3);
}

#[test]
fn a_rank_dropped_on_another_thread_wakes_the_waiter() {
    let mut mesh =
        InProcTransport::mesh(2, TransportOptions::with_timeout(Duration::from_secs(10)));
    let doomed = mesh.pop().unwrap();
    let waiter = mesh.pop().unwrap();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(100));
        drop(doomed);
    });
    let start = std::time::Instant::now();
    let result = block_on(waiter.recv(1, 5));
    killer.join().unwrap();
    assert!(
        matches!(result, Err(LoaderError::Transport { peer: 1, .. })),
        "{result:?}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "took {:?}",
        start.elapsed()
    );
    let err = block_on(waiter.send(1, 5, Bytes::new())).unwrap_err();
    assert!(err.to_string().contains("rank 1 has exited"), "{err}");
}
