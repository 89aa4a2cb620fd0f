//! The storage crate's in-process S3 test server as a process, for tests in other languages (the Python
//! package's pytest suite): `s3_test_server ROOT [--bytes-per-second N] [BUCKET...]` serves ROOT
//! on 127.0.0.1 (every answer's body through one link of N bytes/s when given), creates the
//! buckets, prints the client environment as one JSON object on stdout, and serves until its
//! standard input closes (so it never outlives the test that started it).
//!
//! Lines on standard input ask for the server's own account of what it served to GETs, so a test
//! can hold a client's report against the wire: `served PREFIX` answers one JSON line
//! `{"get_requests": N, "get_body_bytes": B}` for URI paths starting with PREFIX (`/bucket/key`;
//! empty: all), `reset` starts counting from zero and answers `{}`, and `index` gives objects
//! copied into ROOT by hand the ETag an upload would have (`S3TestServer::index_objects`).

use std::io::{BufRead, Write};

use tessera_storage::testing::S3TestServer;

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(root) = args.next() else {
        eprintln!("usage: s3_test_server ROOT [--bytes-per-second N] [BUCKET...]");
        std::process::exit(2);
    };
    let mut link = None;
    let mut buckets = Vec::new();
    while let Some(arg) = args.next() {
        if arg == "--bytes-per-second" {
            match args.next().and_then(|v| v.parse::<u64>().ok()) {
                Some(rate) if rate > 0 => link = Some(rate),
                _ => {
                    eprintln!("--bytes-per-second takes a positive number of bytes");
                    std::process::exit(2);
                }
            }
        } else {
            buckets.push(arg);
        }
    }
    let server = S3TestServer::start_with_link(&root, link);
    for bucket in buckets {
        server.create_bucket(&bucket);
    }
    let env: serde_json::Map<String, serde_json::Value> = server
        .env()
        .into_iter()
        .map(|(k, v)| (k, serde_json::Value::String(v)))
        .collect();
    let mut stdout = std::io::stdout();
    if writeln!(stdout, "{}", serde_json::Value::Object(env))
        .and_then(|()| stdout.flush())
        .is_err()
    {
        std::process::exit(1);
    }
    // Serve until the parent closes our stdin (or dies), answering its questions meanwhile.
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let answer = match line.trim().split_once(' ').unwrap_or((line.trim(), "")) {
            ("served", prefix) => {
                let served = server.served_where(|path| path.starts_with(prefix));
                serde_json::json!({
                    "get_requests": served.get_requests,
                    "get_body_bytes": served.get_body_bytes,
                })
            }
            ("index", _) => {
                server.index_objects();
                serde_json::json!({})
            }
            ("reset", _) => {
                server.reset_served();
                serde_json::json!({})
            }
            (other, _) => serde_json::json!({"error": format!("unknown command {other:?}")}),
        };
        if writeln!(stdout, "{answer}")
            .and_then(|()| stdout.flush())
            .is_err()
        {
            break;
        }
    }
    drop(server);
}
