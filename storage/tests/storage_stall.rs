//! A server that stops sending mid-body (HTTP here; S3 goes through the same object_store HTTP
//! client and the same client keys): every request must end after the policy's read timeout of
//! silence, as a transient error, instead of hanging the load.
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::{Duration, Instant};

use object_store::ObjectStoreExt;
use object_store::path::Path;
use tessera_storage::{RetryPolicy, StorageOptions, is_transient, open_with};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Answers every HEAD and GET on loopback with headers for a 1 MiB body (or the range asked),
/// sends `sent` bytes of it, then stays silent with the connection open (until the test ends).
/// `None`: not even the headers.
async fn stalling_server(sent: Option<usize>) -> u16 {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut request = Vec::new();
                let mut buf = [0u8; 4096];
                while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                    match socket.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => request.extend_from_slice(&buf[..n]),
                    }
                }
                let head = request.starts_with(b"HEAD");
                let total: u64 = 1 << 20;
                let text = String::from_utf8_lossy(&request).to_ascii_lowercase();
                // "range: bytes=a-b" (inclusive) gets a 206 for that range.
                let range = text
                    .lines()
                    .find_map(|l| l.strip_prefix("range: bytes="))
                    .and_then(|r| r.trim().split_once('-'))
                    .and_then(|(a, b)| Some((a.parse::<u64>().ok()?, b.parse::<u64>().ok()?)));
                let common = "Last-Modified: Tue, 15 Nov 1994 08:12:31 GMT\r\nETag: \"x\"";
                let header = match range {
                    Some((a, b)) => format!(
                        "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {a}-{b}/{total}\r\n{common}\r\n\r\n",
                        b - a + 1
                    ),
                    None => {
                        format!("HTTP/1.1 200 OK\r\nContent-Length: {total}\r\n{common}\r\n\r\n")
                    }
                };
                if let Some(sent) = sent {
                    let _ = socket.write_all(header.as_bytes()).await;
                    if !head {
                        let _ = socket.write_all(&vec![7u8; sent]).await;
                    }
                }
                let _ = socket.flush().await;
                // Keep the connection open and silent.
                tokio::time::sleep(Duration::from_secs(3600)).await;
            });
        }
    });
    port
}

fn short_policy() -> RetryPolicy {
    RetryPolicy {
        connect_timeout: Duration::from_millis(500),
        read_timeout: Duration::from_millis(500),
        request_timeout: Duration::from_secs(3),
        ..RetryPolicy::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_stops_midway_fails_after_the_read_timeout() {
    let port = stalling_server(Some(1000)).await;
    let options = StorageOptions {
        retry: short_policy(),
        ..StorageOptions::default()
    };
    let location = open_with(&format!("http://127.0.0.1:{port}/run/step"), &options).unwrap();
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
    assert!(took < Duration::from_secs(10), "took {took:?}: {err}");
    eprintln!("stalled body cut after {took:?}: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_range_read_of_a_stalled_body_fails_after_the_read_timeout() {
    let port = stalling_server(Some(100)).await;
    let options = StorageOptions {
        retry: short_policy(),
        ..StorageOptions::default()
    };
    let location = open_with(&format!("http://127.0.0.1:{port}/run/step"), &options).unwrap();
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
    assert!(took < Duration::from_secs(10), "took {took:?}: {err}");
    eprintln!("stalled range cut after {took:?}: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_never_answers_fails_after_the_read_timeout() {
    let port = stalling_server(None).await;
    let options = StorageOptions {
        retry: short_policy(),
        ..StorageOptions::default()
    };
    let location = open_with(&format!("http://127.0.0.1:{port}/run/step"), &options).unwrap();
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
    assert!(took < Duration::from_secs(10), "took {took:?}: {err}");
    eprintln!("silent server cut after {took:?}: {err}");
}
