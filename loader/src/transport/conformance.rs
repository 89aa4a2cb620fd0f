//! The conformance suite every [`Transport`] passes (in the spirit of object_store's
//! `integration` module). Each check takes the transports of one freshly built mesh, element `i`
//! being rank `i` (at least 2 ranks; 3 or more exercise more), drives all ranks from the calling
//! task, and panics with a message naming the check and the ranks when the transport misbehaves.
//! Checks that take `&[T]` leave the mesh clean (nothing buffered), so they may share one mesh;
//! the ones that kill a rank take the mesh by value.
//!
//! Every check is bounded in time: a transport that deadlocks fails the check instead of hanging
//! the test run.

use std::future::Future;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::future::join_all;

use super::Transport;
use crate::LoaderError;

/// How long any one check may take, whatever the transport (a deadlock becomes a failure).
pub const CHECK_LIMIT: Duration = Duration::from_secs(60);

async fn bounded<F: Future>(check: &str, future: F) -> F::Output {
    match tokio::time::timeout(CHECK_LIMIT, future).await {
        Ok(out) => out,
        Err(_) => panic!("{check}: did not finish within {CHECK_LIMIT:?} (deadlock?)"),
    }
}

fn world_of<T: Transport>(check: &str, mesh: &[T]) -> u32 {
    assert!(
        mesh.len() >= 2,
        "{check}: needs a mesh of at least 2 ranks, got {}",
        mesh.len()
    );
    for (i, t) in mesh.iter().enumerate() {
        assert_eq!(
            t.rank(),
            i as u32,
            "{check}: mesh element {i} says it is rank {}",
            t.rank()
        );
        assert_eq!(
            t.world(),
            mesh.len() as u32,
            "{check}: rank {i} says the world has {} ranks, the mesh has {}",
            t.world(),
            mesh.len()
        );
    }
    mesh.len() as u32
}

/// Deterministic bytes of the message `from` sends `to` under `tag`.
fn payload(from: u32, to: u32, tag: u64, len: usize) -> Bytes {
    let seed = (u64::from(from) << 48) ^ (u64::from(to) << 32) ^ tag;
    let mut out = vec![0u8; len];
    for (i, chunk) in out.chunks_mut(8).enumerate() {
        let mut z = seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 31)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        let n = chunk.len();
        chunk.copy_from_slice(&z.to_le_bytes()[..n]);
    }
    Bytes::from(out)
}

fn expect_ok<V>(check: &str, what: &str, result: Result<V, LoaderError>) -> V {
    match result {
        Ok(v) => v,
        Err(e) => panic!("{check}: {what} failed: {e}"),
    }
}

fn expect_payload(check: &str, from: u32, to: u32, tag: u64, got: &Bytes, want: &Bytes) {
    assert_eq!(
        got.len(),
        want.len(),
        "{check}: rank {to} got {} bytes from rank {from} under tag {tag:#x}, expected {}",
        got.len(),
        want.len()
    );
    if got != want {
        let at = got
            .iter()
            .zip(want.iter())
            .position(|(a, b)| a != b)
            .unwrap_or(0);
        panic!(
            "{check}: rank {to}'s message from rank {from} under tag {tag:#x} differs at byte {at}"
        );
    }
}

/// Rank 0 sends to rank 1 and rank 1 answers; both see the right bytes.
pub async fn point_to_point<T: Transport>(mesh: &[T]) {
    const CHECK: &str = "point_to_point";
    world_of(CHECK, mesh);
    bounded(CHECK, async {
        let (a, b) = (&mesh[0], &mesh[1]);
        let ping = payload(0, 1, 7, 1000);
        expect_ok(CHECK, "rank 0 send", a.send(1, 7, ping.clone()).await);
        let got = expect_ok(CHECK, "rank 1 recv", b.recv(0, 7).await);
        expect_payload(CHECK, 0, 1, 7, &got, &ping);
        let pong = payload(1, 0, 7, 333);
        expect_ok(CHECK, "rank 1 send", b.send(0, 7, pong.clone()).await);
        let got = expect_ok(CHECK, "rank 0 recv", a.recv(1, 7).await);
        expect_payload(CHECK, 1, 0, 7, &got, &pong);
    })
    .await;
}

/// Rank 0 sends many tags (and several messages under one tag); rank 1 receives the tags in
/// reverse order, and the messages of one tag in the order they were sent.
pub async fn many_tags_out_of_order<T: Transport>(mesh: &[T]) {
    const CHECK: &str = "many_tags_out_of_order";
    world_of(CHECK, mesh);
    bounded(CHECK, async {
        let (a, b) = (&mesh[0], &mesh[1]);
        let tags: Vec<u64> = (0..64u64).map(|i| (i << 32) | (i * 7 % 5)).collect();
        for &tag in &tags {
            expect_ok(
                CHECK,
                "send",
                a.send(1, tag, payload(0, 1, tag, 10 + tag as usize % 100))
                    .await,
            );
        }
        for seq in 0..3u8 {
            expect_ok(
                CHECK,
                "send",
                a.send(1, u64::MAX, Bytes::from(vec![seq; 5])).await,
            );
        }
        for &tag in tags.iter().rev() {
            let got = expect_ok(CHECK, "recv", b.recv(0, tag).await);
            expect_payload(
                CHECK,
                0,
                1,
                tag,
                &got,
                &payload(0, 1, tag, 10 + tag as usize % 100),
            );
        }
        for seq in 0..3u8 {
            let got = expect_ok(CHECK, "recv", b.recv(0, u64::MAX).await);
            assert_eq!(
                got.as_ref(),
                &[seq; 5],
                "{CHECK}: messages under one tag arrived out of order (wanted message {seq})"
            );
        }
    })
    .await;
}

/// Every rank sends to every other rank before any rank receives anything: sends must not wait
/// for the receiver.
pub async fn sends_do_not_wait_for_recv<T: Transport>(mesh: &[T]) {
    const CHECK: &str = "sends_do_not_wait_for_recv";
    let world = world_of(CHECK, mesh);
    bounded(CHECK, async {
        for (from, t) in mesh.iter().enumerate() {
            for to in (0..world).filter(|&to| to != from as u32) {
                let data = payload(from as u32, to, 3, 4096);
                expect_ok(
                    CHECK,
                    &format!("rank {from} send to {to}"),
                    t.send(to, 3, data).await,
                );
            }
        }
        for (to, t) in mesh.iter().enumerate() {
            for from in (0..world).filter(|&from| from != to as u32) {
                let got = expect_ok(
                    CHECK,
                    &format!("rank {to} recv from {from}"),
                    t.recv(from, 3).await,
                );
                expect_payload(
                    CHECK,
                    from,
                    to as u32,
                    3,
                    &got,
                    &payload(from, to as u32, 3, 4096),
                );
            }
        }
    })
    .await;
}

/// The ring schedule of the loader: in round k every rank i sends to (i + k) mod n and receives
/// from (i − k) mod n, all ranks at once, receives posted before sends.
pub async fn all_pairs_ring<T: Transport>(mesh: &[T]) {
    const CHECK: &str = "all_pairs_ring";
    let world = world_of(CHECK, mesh);
    bounded(CHECK, async {
        for k in 1..world {
            let tag = super::exchange_tag(5, k);
            join_all(mesh.iter().map(|t| async move {
                let i = t.rank();
                let (to, from) = ((i + k) % world, (i + world - k) % world);
                let len = 100 + (i as usize * 37 + k as usize) % 300;
                let recv = t.recv(from, tag);
                let send = t.send(to, tag, payload(i, to, tag, len));
                let (got, sent) = futures::join!(recv, send);
                expect_ok(CHECK, &format!("round {k} rank {i} send to {to}"), sent);
                let got = expect_ok(CHECK, &format!("round {k} rank {i} recv from {from}"), got);
                let want_len = 100 + (from as usize * 37 + k as usize) % 300;
                expect_payload(CHECK, from, i, tag, &got, &payload(from, i, tag, want_len));
            }))
            .await;
        }
    })
    .await;
}

/// 64 MiB each way between ranks 0 and 1 at the same time (neither side reads first).
pub async fn large_message<T: Transport>(mesh: &[T]) {
    const CHECK: &str = "large_message";
    world_of(CHECK, mesh);
    const LEN: usize = 64 << 20;
    bounded(CHECK, async {
        let (a, b) = (&mesh[0], &mesh[1]);
        let (to_b, to_a) = (payload(0, 1, 1, LEN), payload(1, 0, 1, LEN));
        let (sa, sb) = futures::join!(a.send(1, 1, to_b.clone()), b.send(0, 1, to_a.clone()));
        expect_ok(CHECK, "rank 0 send", sa);
        expect_ok(CHECK, "rank 1 send", sb);
        let (ra, rb) = futures::join!(a.recv(1, 1), b.recv(0, 1));
        expect_payload(CHECK, 1, 0, 1, &expect_ok(CHECK, "rank 0 recv", ra), &to_a);
        expect_payload(CHECK, 0, 1, 1, &expect_ok(CHECK, "rank 1 recv", rb), &to_b);
    })
    .await;
}

/// An empty message is a message: it arrives, empty, and the next one under the tag follows.
pub async fn empty_message<T: Transport>(mesh: &[T]) {
    const CHECK: &str = "empty_message";
    world_of(CHECK, mesh);
    bounded(CHECK, async {
        let (a, b) = (&mesh[0], &mesh[1]);
        expect_ok(CHECK, "send empty", a.send(1, 9, Bytes::new()).await);
        expect_ok(
            CHECK,
            "send after empty",
            a.send(1, 9, Bytes::from_static(b"x")).await,
        );
        let got = expect_ok(CHECK, "recv empty", b.recv(0, 9).await);
        assert!(
            got.is_empty(),
            "{CHECK}: the empty message arrived with {} bytes",
            got.len()
        );
        let got = expect_ok(CHECK, "recv after empty", b.recv(0, 9).await);
        assert_eq!(
            got.as_ref(),
            b"x",
            "{CHECK}: the message after the empty one is wrong"
        );
    })
    .await;
}

/// Sending to or receiving from yourself or a rank outside the world fails at once (not by
/// timing out).
pub async fn send_to_self_is_an_error<T: Transport>(mesh: &[T]) {
    const CHECK: &str = "send_to_self_is_an_error";
    let world = world_of(CHECK, mesh);
    let quick = Duration::from_secs(1);
    for t in mesh {
        let r = t.rank();
        for (what, result) in [
            (
                "send to itself",
                bounded(CHECK, t.send(r, 1, Bytes::from_static(b"me")))
                    .await
                    .err(),
            ),
            (
                "send outside the world",
                bounded(CHECK, t.send(world, 1, Bytes::new())).await.err(),
            ),
            (
                "send to u32::MAX",
                bounded(CHECK, t.send(u32::MAX, 1, Bytes::new()))
                    .await
                    .err(),
            ),
        ] {
            match result {
                Some(LoaderError::Transport { .. }) => {}
                Some(other) => panic!("{CHECK}: rank {r} {what}: wrong error: {other}"),
                None => panic!("{CHECK}: rank {r} {what} succeeded"),
            }
        }
        for (what, peer) in [
            ("recv from itself", r),
            ("recv from outside the world", world),
        ] {
            let start = Instant::now();
            match tokio::time::timeout(quick, t.recv(peer, 1)).await {
                Ok(Err(LoaderError::Transport { .. })) => {}
                Ok(Err(other)) => panic!("{CHECK}: rank {r} {what}: wrong error: {other}"),
                Ok(Ok(_)) => panic!("{CHECK}: rank {r} {what} returned a message"),
                Err(_) => panic!("{CHECK}: rank {r} {what} did not fail within {quick:?}"),
            }
            assert!(start.elapsed() < quick, "{CHECK}: rank {r} {what} was slow");
        }
    }
}

/// Every rank sends to every other rank at once, several messages each, and nobody receives until
/// all sends are done: buffered transports take this in stride; a transport over a rendezvous data
/// plane (NCCL, where a send waits for its receive) deadlocks unless it orders transfers.
pub async fn crossing_sends<T: Transport>(mesh: &[T]) {
    const CHECK: &str = "crossing_sends";
    let world = world_of(CHECK, mesh);
    let message = |from: u32, to: u32, k: u64| {
        payload(
            from,
            to,
            77 + k,
            1000 + (from * 7 + to) as usize + k as usize,
        )
    };
    let sends = mesh.iter().map(|t| async move {
        let from = t.rank();
        let all = (0..world)
            .filter(|&to| to != from)
            .flat_map(|to| (0..3u64).map(move |k| (to, k)))
            .map(|(to, k)| async move { (to, k, t.send(to, 77 + k, message(from, to, k)).await) });
        for (to, k, sent) in join_all(all).await {
            expect_ok(CHECK, &format!("rank {from} send {k} to {to}"), sent);
        }
    });
    bounded(CHECK, join_all(sends)).await;
    for t in mesh {
        let to = t.rank();
        for from in (0..world).filter(|&f| f != to) {
            for k in 0..3u64 {
                let got = expect_ok(
                    CHECK,
                    &format!("rank {to} recv {k} from {from}"),
                    bounded(CHECK, t.recv(from, 77 + k)).await,
                );
                expect_payload(CHECK, from, to, 77 + k, &got, &message(from, to, k));
            }
        }
    }
}

/// A world of one rank (the only NCCL configuration a single GPU allows): it is rank 0 of 1,
/// and sending to or receiving from itself or anyone else fails at once, naming the peer.
pub async fn lone_rank<T: Transport>(t: &T) {
    const CHECK: &str = "lone_rank";
    assert_eq!(
        (t.rank(), t.world()),
        (0, 1),
        "{CHECK}: expected rank 0 of a world of 1"
    );
    let quick = Duration::from_secs(1);
    for peer in [0, 1, u32::MAX] {
        match bounded(CHECK, t.send(peer, 1, Bytes::from_static(b"me"))).await {
            Err(LoaderError::Transport { peer: p, .. }) if p == peer => {}
            other => panic!("{CHECK}: send to {peer}: expected a transport error, got {other:?}"),
        }
        match tokio::time::timeout(quick, t.recv(peer, 1)).await {
            Ok(Err(LoaderError::Transport { peer: p, .. })) if p == peer => {}
            Ok(other) => {
                panic!("{CHECK}: recv from {peer}: expected a transport error, got {other:?}")
            }
            Err(_) => panic!("{CHECK}: recv from {peer} did not fail within {quick:?}"),
        }
    }
}

/// A receive nobody answers fails with [`LoaderError::PeerTimeout`] after about `timeout` (the
/// mesh's [`super::TransportOptions::timeout`]).
pub async fn recv_times_out<T: Transport>(mesh: &[T], timeout: Duration) {
    const CHECK: &str = "recv_times_out";
    world_of(CHECK, mesh);
    let start = Instant::now();
    let result = bounded(CHECK, mesh[0].recv(1, 0xdead)).await;
    let waited = start.elapsed();
    match result {
        Err(LoaderError::PeerTimeout { peer: 1, .. }) => {}
        Err(other) => panic!("{CHECK}: wrong error: {other}"),
        Ok(_) => panic!("{CHECK}: a message nobody sent arrived"),
    }
    assert!(
        waited + Duration::from_millis(50) >= timeout && waited <= timeout + Duration::from_secs(2),
        "{CHECK}: timed out after {waited:?}, configured {timeout:?}"
    );
}

/// What a rank sent before it exited is still delivered; after that, receiving from it fails
/// at once.
pub async fn messages_sent_before_exit_are_delivered<T: Transport>(mut mesh: Vec<T>) {
    const CHECK: &str = "messages_sent_before_exit_are_delivered";
    let world = world_of(CHECK, &mesh);
    let Some(leaver) = mesh.pop() else { return };
    let gone = world - 1;
    for to in 0..gone {
        let data = payload(gone, to, 11, 50_000);
        expect_ok(
            CHECK,
            &format!("rank {gone} send to {to}"),
            bounded(CHECK, leaver.send(to, 11, data)).await,
        );
    }
    drop(leaver);
    for t in &mesh {
        let to = t.rank();
        let got = expect_ok(
            CHECK,
            &format!("rank {to} recv of what rank {gone} sent before exiting"),
            bounded(CHECK, t.recv(gone, 11)).await,
        );
        expect_payload(CHECK, gone, to, 11, &got, &payload(gone, to, 11, 50_000));
    }
    let quick = Duration::from_secs(5);
    for t in &mesh {
        match tokio::time::timeout(quick, t.recv(gone, 11)).await {
            Ok(Err(LoaderError::Transport { peer, .. })) if peer == gone => {}
            Ok(Err(other)) => panic!(
                "{CHECK}: rank {}: wrong error after rank {gone} left: {other}",
                t.rank()
            ),
            Ok(Ok(_)) => panic!(
                "{CHECK}: rank {} got a message rank {gone} never sent",
                t.rank()
            ),
            Err(_) => panic!(
                "{CHECK}: rank {} waited {quick:?} for rank {gone}, which had exited",
                t.rank()
            ),
        }
    }
}

/// The last rank dies while the others wait for it: every pending receive from it, and every
/// later one, fails with an error naming it ([`LoaderError::Transport`], or
/// [`LoaderError::PeerTimeout`] for a transport that cannot tell) within `within`; sending to it
/// fails too once its death is known.
pub async fn peer_death_fails_fast<T: Transport>(mut mesh: Vec<T>, within: Duration) {
    const CHECK: &str = "peer_death_fails_fast";
    let world = world_of(CHECK, &mesh);
    let Some(victim) = mesh.pop() else { return };
    let dead = world - 1;
    let killer = async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(victim);
    };
    let start = Instant::now();
    let waits = join_all(mesh.iter().map(|t| async move {
        let result = t.recv(dead, 42).await;
        (t.rank(), result, start.elapsed())
    }));
    let ((), outcomes) = bounded(CHECK, async { futures::join!(killer, waits) }).await;
    let check = |rank: u32, result: Result<Bytes, LoaderError>, waited: Duration| {
        match result {
            Err(LoaderError::Transport { peer, .. } | LoaderError::PeerTimeout { peer, .. })
                if peer == dead => {}
            Err(other) => {
                panic!("{CHECK}: rank {rank}: the error does not name dead rank {dead}: {other}")
            }
            Ok(_) => panic!("{CHECK}: rank {rank} got a message dead rank {dead} never sent"),
        }
        assert!(
            waited <= within,
            "{CHECK}: rank {rank} took {waited:?} to notice rank {dead} died (limit {within:?})"
        );
    };
    for (rank, result, waited) in outcomes {
        check(rank, result, waited);
    }
    for t in &mesh {
        let start = Instant::now();
        let result = bounded(CHECK, t.recv(dead, 43)).await;
        let known_dead = matches!(result, Err(LoaderError::Transport { .. }));
        check(t.rank(), result, start.elapsed());
        if known_dead
            && bounded(CHECK, t.send(dead, 44, Bytes::from_static(b"anyone?")))
                .await
                .is_ok()
        {
            panic!(
                "{CHECK}: rank {}: sending to dead rank {dead} succeeded",
                t.rank()
            );
        }
    }
}

/// Declares `mod $module` with one tokio test per check of this suite, each on a fresh mesh from
/// `$make` (an expression, `.await` allowed, evaluated in each test), plus the checks that leave
/// the mesh clean run one after another on one mesh. `$timeout` is the mesh's
/// [`super::TransportOptions::timeout`]. Used by every transport's test file, so that each runs
/// the same suite.
#[macro_export]
macro_rules! transport_conformance_tests {
    ($module:ident, $make:expr, $timeout:expr) => {
        mod $module {
            use super::*;
            use $crate::transport::conformance;

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
            async fn crossing_sends() {
                conformance::crossing_sends(&$make).await;
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
                conformance::recv_times_out(&$make, $timeout).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn messages_sent_before_exit_are_delivered() {
                conformance::messages_sent_before_exit_are_delivered($make).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn peer_death_fails_fast() {
                // Well under the transport timeout: death is noticed, not timed out.
                conformance::peer_death_fails_fast($make, std::time::Duration::from_secs(1)).await;
            }

            /// The checks that leave the mesh clean also pass one after another on one mesh.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn whole_suite_on_one_mesh() {
                let mesh = $make;
                conformance::point_to_point(&mesh).await;
                conformance::many_tags_out_of_order(&mesh).await;
                conformance::sends_do_not_wait_for_recv(&mesh).await;
                conformance::crossing_sends(&mesh).await;
                conformance::all_pairs_ring(&mesh).await;
                conformance::empty_message(&mesh).await;
                conformance::send_to_self_is_an_error(&mesh).await;
                conformance::messages_sent_before_exit_are_delivered(mesh).await;
            }
        }
    };
}
