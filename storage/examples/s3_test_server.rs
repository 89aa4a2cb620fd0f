//! The storage crate's in-process S3 test server as a process, for tests in other languages (the Python
//! package's pytest suite): `s3_test_server ROOT [BUCKET...]` serves ROOT on 127.0.0.1, creates
//! the buckets, prints the client environment as one JSON object on stdout, and serves until its
//! standard input closes (so it never outlives the test that started it).

use std::io::{Read, Write};

use tessera_storage::testing::S3TestServer;

fn main() {
    let mut args = std::env::args().skip(1);
    let Some(root) = args.next() else {
        eprintln!("usage: s3_test_server ROOT [BUCKET...]");
        std::process::exit(2);
    };
    let server = S3TestServer::start(&root);
    for bucket in args {
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
    // Serve until the parent closes our stdin (or dies).
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
    drop(server);
}
