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

/// A rank that never checks in: rank 0 gives up at its deadline, and the rank that did check
/// in learns then which rank is missing, instead of waiting out its own longer deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_that_checked_in_learn_which_rank_never_came_when_rank_0_gives_up() {
    let port = free_port();
    let master = spawn_rank(0, 3, port, Duration::from_millis(1500));
    let start = Instant::now();
    let waiting = rendezvous_detail(
        spawn_rank(1, 3, port, Duration::from_secs(20))
            .await
            .unwrap(),
    );
    assert_eq!(
        waiting,
        "rank 1: the master gave up the rendezvous: rank 0: only 2 of 3 ranks checked in within \
         1.5s; missing ranks [2]"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(
        rendezvous_detail(master.await.unwrap()),
        "rank 0: only 2 of 3 ranks checked in within 1.5s; missing ranks [2]"
    );
}

/// A rank started with another world size is refused on its own connection, told why at once;
/// rank 0 goes on waiting for its rank 1 and, when the deadline passes without it, names the
/// refused hello beside the missing rank (the likely explanation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_of_another_world_size_is_refused_and_named_at_the_deadline() {
    let port = free_port();
    let master = spawn_rank(0, 2, port, Duration::from_millis(1500));
    let start = Instant::now();
    let other = rendezvous_detail(
        spawn_rank(1, 3, port, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    assert_eq!(
        other,
        format!(
            "rank 1: the master at 127.0.0.1:{port} turned this rank away: it says the world \
             has 3 ranks but rank 0 has WORLD_SIZE=2"
        )
    );
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    let detail = rendezvous_detail(master.await.unwrap());
    let (head, refusals) = detail
        .split_once("; it refused 1 connection that was not this job's (a rank of another job, or one started with other settings, on port ")
        .unwrap_or_else(|| panic!("{detail}"));
    assert_eq!(
        head,
        "rank 0: only 1 of 2 ranks checked in within 1.5s; missing ranks [1]"
    );
    assert!(
        refusals.contains("refused a hello from 127.0.0.1:")
            && refusals
                .ends_with(" as rank 1: it says the world has 3 ranks but rank 0 has WORLD_SIZE=2"),
        "{detail}"
    );
}

/// Two processes claiming one rank: the second is refused, naming where the first checked in
/// from, and the job meets with the first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_claim_of_a_rank_is_refused_naming_the_first() {
    let port = free_port();
    let connect = Duration::from_secs(5);
    let master = spawn_rank(0, 3, port, connect);
    let mut a = spawn_rank(1, 3, port, connect);
    let mut b = spawn_rank(1, 3, port, connect);
    // Whichever of the two checked in first is rank 1 and waits for rank 2; the other is turned
    // away at once.
    let (turned_away, kept) = tokio::select! {
        done = &mut a => (done, b),
        done = &mut b => (done, a),
    };
    let detail = rendezvous_detail(turned_away.unwrap());
    assert!(
        detail.starts_with(&format!(
            "rank 1: the master at 127.0.0.1:{port} turned this rank away: rank 1 already checked in from 127.0.0.1:"
        )) && detail.ends_with("(two processes with the same RANK?)"),
        "{detail}"
    );
    let two = spawn_rank(2, 3, port, connect);
    let mesh = vec![
        master.await.unwrap().unwrap(),
        kept.await.unwrap().unwrap(),
        two.await.unwrap().unwrap(),
    ];
    conformance::all_pairs_ring(&mesh).await;
}

/// The rendezvous's hello as its wire format has it (`loader/src/transport/tcp.rs`), for strays
/// that `TcpTransport` cannot play: a second rank 0, a rank that leaves right after its hello.
fn raw_hello(rank: u32, world: u32, job: u64) -> Vec<u8> {
    let addr = b"127.0.0.1:9";
    let mut hello = b"TSRH".to_vec();
    hello.extend_from_slice(&3u32.to_le_bytes());
    hello.extend_from_slice(&rank.to_le_bytes());
    hello.extend_from_slice(&world.to_le_bytes());
    hello.extend_from_slice(&job.to_le_bytes());
    hello.extend_from_slice(&(addr.len() as u16).to_le_bytes());
    hello.extend_from_slice(addr);
    // No plan options.
    hello.extend_from_slice(&0u16.to_le_bytes());
    hello
}

/// Connects to the master at `port` (it may not listen yet) and sends `bytes`.
async fn stray(port: u16, bytes: &[u8]) -> tokio::net::TcpStream {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut stream = loop {
        match tokio::net::TcpStream::connect(("127.0.0.1", port)).await {
            Ok(stream) => break stream,
            Err(e) if Instant::now() > deadline => panic!("the master never listened: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    };
    stream.write_all(bytes).await.unwrap();
    stream
}

/// Everything the master sends `stream` until it closes it (bounded: a master that keeps a
/// refused connection open fails the test); a reset (closed with unread bytes) is an error.
async fn answer(mut stream: tokio::net::TcpStream) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(3), stream.read_to_end(&mut answer))
        .await
        .expect("the master closes a refused connection")?;
    Ok(answer)
}

/// One stray hello (garbage, another job, another world size, a rank number already taken)
/// aborted a healthy job. Now each is refused on its own connection (told why when it speaks
/// the rendezvous), and the job's real ranks meet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stray_hellos_are_refused_and_the_job_still_meets() {
    let port = free_port();
    let job = 0xaaaa;
    let config = |rank: u32, world: u32, job: u64| {
        RendezvousConfig::new(rank, world, "127.0.0.1", port)
            .unwrap()
            .with_job(job)
    };
    let start = Instant::now();
    let master = {
        let config = config(0, 2, job);
        tokio::spawn(async move {
            TcpTransport::connect(&config, options(Duration::from_secs(10))).await
        })
    };
    let turned_away =
        |why: &str| format!("rank 1: the master at 127.0.0.1:{port} turned this rank away: {why}");

    // (a) Garbage: closed without an answer (it does not speak the rendezvous).
    let garbage = stray(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
    match answer(garbage).await {
        Ok(bytes) => assert_eq!(bytes, b""),
        // Closed with the rest of the garbage unread: a reset.
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }

    // (b) A rank of another job, and one of another world size.
    let other_job =
        TcpTransport::connect(&config(1, 2, 0xbbbb), options(Duration::from_secs(5))).await;
    assert_eq!(
        rendezvous_detail(other_job),
        turned_away(&format!(
            "it loads job 000000000000bbbb but rank 0 loads job 000000000000aaaa (another \
             checkpoint, layout or option, or another job on port {port})"
        ))
    );
    let other_world =
        TcpTransport::connect(&config(1, 4, job), options(Duration::from_secs(5))).await;
    assert_eq!(
        rendezvous_detail(other_world),
        turned_away("it says the world has 4 ranks but rank 0 has WORLD_SIZE=2")
    );

    // (c) A rank number already taken: rank 0 is the master's own.
    let second_zero = answer(stray(port, &raw_hello(0, 2, job)).await)
        .await
        .unwrap();
    let (magic, rest) = second_zero.split_at(4);
    assert_eq!(magic, b"TSRN");
    // Version, kind 0 (this connection turned away), length, reason.
    assert_eq!(rest[4], 0);
    assert_eq!(
        String::from_utf8_lossy(&rest[7..]),
        "it checked in as rank 0, which is the master's own rank (two ranks 0?)"
    );

    // The real rank 1: the job meets.
    let one = TcpTransport::connect(&config(1, 2, job), options(Duration::from_secs(5)))
        .await
        .unwrap();
    let mesh = vec![master.await.unwrap().unwrap(), one];
    conformance::point_to_point(&mesh).await;
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

/// A rank that checks in and then goes away (a process restarted by its launcher, a stray that
/// said hello and left) leaves its place to the next hello for its rank instead of making that
/// one a duplicate, and is not counted in when the others are all in (it would be sent a table
/// it cannot use, and the mesh would fail on it): the wait goes on for the job's own rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_gone_after_its_hello_is_replaced_by_the_next() {
    let port = free_port();
    let connect = Duration::from_secs(5);
    let master = spawn_rank(0, 4, port, connect);
    // Time for the master to read a hello and see its connection close.
    let settle = || tokio::time::sleep(Duration::from_millis(200));
    drop(stray(port, &raw_hello(1, 4, 0)).await);
    settle().await;
    // Takes the place of the one that left.
    let one = spawn_rank(1, 4, port, connect);
    settle().await;
    drop(stray(port, &raw_hello(2, 4, 0)).await);
    settle().await;
    // All four look in now, but rank 2 has left: the wait goes on for the real one.
    let three = spawn_rank(3, 4, port, connect);
    settle().await;
    let two = spawn_rank(2, 4, port, connect);
    let mesh = vec![
        master.await.unwrap().unwrap(),
        one.await.unwrap().unwrap(),
        two.await.unwrap().unwrap(),
        three.await.unwrap().unwrap(),
    ];
    conformance::all_pairs_ring(&mesh).await;
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
/// with both fingerprints, instead of joining a mesh it does not belong to; the master, whose
/// own rank 1 never comes, names the refusal with the missing rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_of_another_job_is_refused_naming_both() {
    let port = free_port();
    let join = |rank: u32, job: u64, connect: Duration| {
        tokio::spawn(async move {
            let config = RendezvousConfig::new(rank, 2, "127.0.0.1", port)
                .unwrap()
                .with_job(job);
            TcpTransport::connect(&config, options(connect)).await
        })
    };
    let master = join(0, 0xaaaa, Duration::from_secs(2));
    let start = Instant::now();
    let impostor = rendezvous_detail(join(1, 0xbbbb, Duration::from_secs(5)).await.unwrap());
    assert!(
        impostor.starts_with(&format!(
            "rank 1: the master at 127.0.0.1:{port} turned this rank away: "
        )) && impostor
            .contains("it loads job 000000000000bbbb but rank 0 loads job 000000000000aaaa"),
        "{impostor}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
    let detail = rendezvous_detail(master.await.unwrap());
    assert!(
        detail.starts_with("rank 0: only 1 of 2 ranks checked in within 2s; missing ranks [1]; it refused 1 connection")
            && detail.contains(" as rank 1: it loads job 000000000000bbbb but rank 0 loads job 000000000000aaaa"),
        "{detail}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "{:?}",
        start.elapsed()
    );
}

/// A rank of this job given another option that changes the plan (`--read-order`) is not a
/// stray: once every rank is in, rank 0 calls the whole job off, and every rank fails at once
/// with the same words, naming the option, both values and the rank.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ranks_planning_with_other_options_are_called_off_on_every_rank() {
    let port = free_port();
    let start = Instant::now();
    let ranks: Vec<_> = [("auto", "on"), ("auto", "on"), ("storage", "off")]
        .into_iter()
        .enumerate()
        .map(|(rank, (order, dedup))| {
            let plan = vec![
                ("--read-order".to_string(), order.to_string()),
                ("dedup".to_string(), dedup.to_string()),
            ];
            let config = RendezvousConfig::new(rank as u32, 3, "127.0.0.1", port)
                .unwrap()
                .with_job(7)
                .with_plan(plan);
            tokio::spawn(async move {
                TcpTransport::connect(&config, options(Duration::from_secs(10))).await
            })
        })
        .collect();
    for (rank, task) in ranks.into_iter().enumerate() {
        match task.await.unwrap() {
            Err(LoaderError::RanksDisagree { rank: r, detail }) => {
                assert_eq!(r, rank as u32);
                assert_eq!(
                    detail,
                    "rank 2 plans with --read-order storage but rank 0 with --read-order auto; \
                     rank 2 plans with dedup off but rank 0 with dedup on"
                );
            }
            Err(other) => panic!("rank {rank}: expected the job called off, got {other}"),
            Ok(_) => panic!("rank {rank}: the mesh came up with ranks planning differently"),
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
    let message = LoaderError::RanksDisagree {
        rank: 1,
        detail: "rank 2 plans with --read-order storage but rank 0 with --read-order auto"
            .to_string(),
    }
    .to_string();
    assert_eq!(
        message,
        "rank 1: the ranks of this job plan with different options, so their plans would not fit \
         together: rank 2 plans with --read-order storage but rank 0 with --read-order auto; give \
         every rank the same options"
    );
}

/// A mesh of `world` ranks on a free port.
async fn mesh(world: u32) -> Vec<TcpTransport> {
    let port = free_port();
    let tasks: Vec<_> = (0..world)
        .map(|rank| spawn_rank(rank, world, port, Duration::from_secs(5)))
        .collect();
    let mut mesh = Vec::new();
    for task in tasks {
        mesh.push(task.await.unwrap().unwrap());
    }
    mesh
}

/// The rank and peer of a transport error, and its text.
fn blamed(error: LoaderError) -> (u32, u32, String) {
    let text = error.to_string();
    match error {
        LoaderError::Transport { rank, peer, .. } => (rank, peer, text),
        other => panic!("expected a transport error, got {other}"),
    }
}

/// Rank 1 is killed; rank 2, which waited on it, fails and leaves; rank 0 only waited on rank 2.
/// Rank 0 named rank 2 (whose connection it saw close) as the rank that failed. A rank that
/// leaves says goodbye now, a killed one cannot: rank 0 names rank 1, the one that died, and
/// says what then happened with rank 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_after_a_peer_died_blames_the_peer_that_died() {
    let mut ranks = mesh(3).await;
    let two = ranks.pop().unwrap();
    let one = ranks.pop().unwrap();
    let zero = ranks.pop().unwrap();
    let waits_on_two = tokio::spawn(async move { (zero.recv(2, 5).await, zero) });
    let waits_on_one = tokio::spawn(async move { (two.recv(1, 5).await, two) });
    one.crash();

    let (got, two) = waits_on_one.await.unwrap();
    let (rank, peer, text) = blamed(got.unwrap_err());
    assert_eq!((rank, peer), (2, 1), "{text}");
    assert_eq!(
        text,
        "rank 2: transport to rank 1 failed: waiting for tag 0x5: rank 1 closed its connection \
         without a goodbye (its process was killed or crashed)"
    );
    drop(two);

    let (got, _zero) = waits_on_two.await.unwrap();
    let (rank, peer, text) = blamed(got.unwrap_err());
    assert_eq!((rank, peer), (0, 1), "{text}");
    assert_eq!(
        text,
        "rank 0: transport to rank 1 failed: rank 1 closed its connection without a goodbye (its \
         process was killed or crashed); then, with rank 2: waiting for tag 0x5: rank 2 left (its \
         load ended, done or failed: its own error says why) (likely because of rank 1, which \
         died first)"
    );
}

/// A rank that ended its load and left is no one's culprit: when another rank dies later, the
/// error names that one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_left_is_not_blamed_for_a_later_death() {
    let mut ranks = mesh(3).await;
    let two = ranks.pop().unwrap();
    let one = ranks.pop().unwrap();
    let zero = ranks.pop().unwrap();
    drop(one);
    // Rank 0 sees rank 1 leave before rank 2 dies.
    let left = zero.recv(1, 9).await.unwrap_err().to_string();
    assert!(
        left.ends_with("rank 1 left (its load ended, done or failed: its own error says why)"),
        "{left}"
    );
    two.crash();
    let (rank, peer, text) = blamed(zero.recv(2, 9).await.unwrap_err());
    assert_eq!((rank, peer), (0, 2), "{text}");
    assert!(
        text.ends_with(
            "rank 2 closed its connection without a goodbye (its process was killed or crashed)"
        ),
        "{text}"
    );
    // Nor for its own leaving, which came before the death.
    let (_, peer, text) = blamed(zero.send(1, 9, Bytes::from_static(b"x")).await.unwrap_err());
    assert_eq!(peer, 1, "{text}");
    assert!(
        text.ends_with(
            "sending tag 0x9: rank 1 left (its load ended, done or failed: its own error says why)"
        ),
        "{text}"
    );
}

/// Sends are blamed like receives: rank 0's send to rank 2, which left after rank 1 died, names
/// rank 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_send_after_a_peer_died_blames_the_peer_that_died() {
    let mut ranks = mesh(3).await;
    let two = ranks.pop().unwrap();
    let one = ranks.pop().unwrap();
    let zero = ranks.pop().unwrap();
    one.crash();
    assert!(two.recv(1, 3).await.is_err());
    drop(two);
    // Rank 0 learns of both (in that order) before it sends.
    assert!(zero.recv(1, 3).await.is_err());
    let left = zero.recv(2, 3).await.unwrap_err().to_string();
    assert!(left.contains("then, with rank 2"), "{left}");
    let (_, peer, text) = blamed(zero.send(2, 4, Bytes::from_static(b"x")).await.unwrap_err());
    assert_eq!(peer, 1, "{text}");
    assert!(
        text.contains("; then, with rank 2: sending tag 0x4: rank 2 left"),
        "{text}"
    );
}
