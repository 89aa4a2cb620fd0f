//! A server that stops sending mid-body (HTTP here; S3 goes through the same object_store HTTP
//! client and the same client keys): every request must end after the policy's read timeout of
//! silence, as a transient error, instead of hanging the load. The server is the shared
//! `testing::StallingHttpServer` (a real directory over HTTP; only the files its rule matches
//! stall), which the loader and CLI tests use to stall a whole load.
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use object_store::ObjectStoreExt;
use object_store::path::Path;
use tessera_storage::testing::{Stall, StallingHttpServer};
use tessera_storage::{Location, RetryPolicy, StorageOptions, is_timeout, is_transient, open_with};

const SIZE: usize = 1 << 20;

fn bytes() -> Vec<u8> {
    (0..SIZE).map(|i| (i * 31 % 251) as u8).collect()
}

/// A server for a directory holding `run/step/data.bin` (1 MiB) and `run/step/meta.json`, and
/// the location `run/step` on it opened with the short policy.
fn serve() -> (tempfile::TempDir, StallingHttpServer, Location) {
    let dir = tempfile::tempdir().unwrap();
    let step = dir.path().join("run/step");
    std::fs::create_dir_all(&step).unwrap();
    std::fs::write(step.join("data.bin"), bytes()).unwrap();
    std::fs::write(step.join("meta.json"), b"{\"step\": 1}").unwrap();
    let server = StallingHttpServer::start(dir.path());
    let options = StorageOptions {
        retry: short_policy(),
        ..StorageOptions::default()
    };
    let location = open_with(&format!("{}/run/step", server.url()), &options).unwrap();
    (dir, server, location)
}

fn data_files(path: &str) -> bool {
    path.ends_with(".bin")
}

fn short_policy() -> RetryPolicy {
    RetryPolicy {
        connect_timeout: Duration::from_millis(500),
        read_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_secs(3),
        ..RetryPolicy::default()
    }
}

/// The server answers the way object_store's HTTP store expects: a listing (PROPFIND), HEAD,
/// whole and ranged GETs with the file's bytes, 404 for a missing file; nothing stalls unless
/// told to.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_serves_listings_heads_and_ranges() {
    let (_dir, server, location) = serve();
    let store = &location.store;
    let listed = store
        .list_with_delimiter(Some(&location.prefix))
        .await
        .unwrap();
    let mut names: Vec<_> = listed
        .objects
        .iter()
        .map(|o| (o.location.to_string(), o.size))
        .collect();
    names.sort();
    assert_eq!(
        names,
        vec![
            ("run/step/data.bin".to_string(), SIZE as u64),
            ("run/step/meta.json".to_string(), 11),
        ]
    );
    let path = Path::from("run/step/data.bin");
    assert_eq!(store.head(&path).await.unwrap().size, SIZE as u64);
    let all = store.get(&path).await.unwrap().bytes().await.unwrap();
    assert!(all.as_ref() == bytes().as_slice());
    let range = store.get_range(&path, 1000..5000).await.unwrap();
    assert!(range.as_ref() == &bytes()[1000..5000]);
    let missing = store
        .get(&Path::from("run/step/absent.bin"))
        .await
        .unwrap_err();
    assert!(
        matches!(missing, object_store::Error::NotFound { .. }),
        "{missing}"
    );
    assert_eq!(server.stalled(), 0);
    assert!(
        server
            .requests()
            .contains(&"GET /run/step/data.bin bytes=1000-4999".to_string()),
        "{:?}",
        server.requests()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_midway_fails_after_the_read_timeout() {
    let (_dir, server, location) = serve();
    server.stall(Stall::AfterBytes(1000), data_files);
    // Files the rule does not match are served normally.
    let meta = location
        .store
        .get(&Path::from("run/step/meta.json"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(meta.as_ref(), b"{\"step\": 1}");
    let path = Path::from("run/step/data.bin");
    let started = Instant::now();
    let result = tokio::time::timeout(Duration::from_secs(30), location.store.get(&path)).await;
    let get = result.expect("the GET itself hung past 30 s");
    let err = match get {
        Ok(response) => {
            // The headers came: the stall is in the body, which reading must cut.
            tokio::time::timeout(Duration::from_secs(30), response.bytes())
                .await
                .expect("reading the stalled body hung past 30 s")
                .unwrap_err()
        }
        Err(e) => e,
    };
    let took = started.elapsed();
    assert!(is_transient(&err), "{err}");
    assert!(is_timeout(&err), "{err:?}");
    assert!(took < Duration::from_secs(10), "took {took:?}: {err}");
    assert_eq!(server.stalled(), 1);
    eprintln!("stalled body cut after {took:?}: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_read_of_a_stalled_body_fails_after_the_read_timeout() {
    let (_dir, server, location) = serve();
    server.stall(Stall::AfterBytes(100), data_files);
    let path = Path::from("run/step/data.bin");
    let started = Instant::now();
    let result = tokio::time::timeout(
        Duration::from_secs(30),
        location.store.get_range(&path, 0..4096),
    )
    .await
    .expect("get_range hung past 30 s");
    let took = started.elapsed();
    let err = result.unwrap_err();
    assert!(is_transient(&err), "{err}");
    assert!(is_timeout(&err), "{err:?}");
    assert!(took < Duration::from_secs(10), "took {took:?}: {err}");
    assert_eq!(server.stalled(), 1);
    eprintln!("stalled range cut after {took:?}: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_fails_after_the_read_timeout() {
    let (_dir, server, location) = serve();
    server.stall(Stall::BeforeHeaders, data_files);
    let path = Path::from("run/step/data.bin");
    let started = Instant::now();
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        location.store.get_range(&path, 0..4096),
    )
    .await
    .expect("get_range hung past 30 s")
    .unwrap_err();
    let took = started.elapsed();
    assert!(is_transient(&err), "{err}");
    assert!(is_timeout(&err), "{err:?}");
    assert!(took < Duration::from_secs(10), "took {took:?}: {err}");
    assert_eq!(server.stalled(), 1);
    eprintln!("silent server cut after {took:?}: {err}");
}

/// A TCP proxy on 127.0.0.1 in front of `upstream` that, for a connection whose first request
/// line contains `stall_on`, passes on the answer's headers and `after` bytes of its body and
/// then nothing more; other connections are passed through untouched. S3's own test server
/// cannot stall; this puts the stall between it and the S3 client.
async fn stalling_proxy(
    upstream: std::net::SocketAddr,
    stall_on: &'static str,
    after: usize,
) -> u16 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            tokio::spawn(async move {
                let Ok(mut server) = tokio::net::TcpStream::connect(upstream).await else {
                    return;
                };
                let mut head = Vec::new();
                let mut buf = [0u8; 8192];
                while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                    match client.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => head.extend_from_slice(&buf[..n]),
                    }
                }
                let first_line = head.split(|b| *b == b'\n').next().unwrap_or_default();
                let stall = String::from_utf8_lossy(first_line).contains(stall_on);
                if server.write_all(&head).await.is_err() {
                    return;
                }
                if !stall {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                    return;
                }
                // Headers plus `after` bytes of the body, then silence until the client gives up.
                let mut answer = Vec::new();
                loop {
                    if let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n")
                        && answer.len() >= end + 4 + after
                    {
                        let _ = client.write_all(&answer[..end + 4 + after]).await;
                        break;
                    }
                    match server.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => answer.extend_from_slice(&buf[..n]),
                    }
                }
                while let Ok(n) = client.read(&mut buf).await {
                    if n == 0 {
                        return;
                    }
                }
            });
        }
    });
    port
}

/// The same stall between the S3 test server and the `s3://` store (a proxy that passes on the
/// headers and 100 bytes of a data object's body): the range read is cut after the read timeout
/// as a transient timeout, as over plain HTTP.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_s3_range_read_of_a_stalled_body_fails_after_the_read_timeout() {
    use tessera_storage::testing::S3TestServer;
    let dir = tempfile::tempdir().unwrap();
    let server = S3TestServer::start(dir.path());
    server.create_bucket("ckpt");
    let path = Path::from("run/step/data/rank0.bin");
    server
        .store("ckpt")
        .put(&path, bytes().into())
        .await
        .unwrap();
    let upstream: std::net::SocketAddr = server
        .endpoint()
        .trim_start_matches("http://")
        .parse()
        .unwrap();
    let port = stalling_proxy(upstream, "/data/", 100).await;
    let mut options = server.options();
    options.retry = short_policy();
    options.env.push((
        "AWS_ENDPOINT_URL".to_string(),
        format!("http://127.0.0.1:{port}"),
    ));
    let location = open_with("s3://ckpt/run/step", &options).unwrap();
    let started = Instant::now();
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        location.store.get_range(&path, 0..65536),
    )
    .await
    .expect("get_range through the stalling proxy hung past 30 s")
    .unwrap_err();
    let took = started.elapsed();
    assert!(is_transient(&err), "{err}");
    assert!(is_timeout(&err), "{err:?}");
    assert!(took < Duration::from_secs(10), "took {took:?}: {err}");
    eprintln!("stalled S3 range cut after {took:?}: {err}");
    // The proxy passes everything else on: the object is there and readable without it.
    let direct = server.store("ckpt").get_range(&path, 0..100).await.unwrap();
    assert!(direct.as_ref() == &bytes()[..100]);
    // Drop the server (joins its thread) off the runtime's workers.
    tokio::task::spawn_blocking(move || drop(server))
        .await
        .unwrap();
}
