//! `tessera demo` serving its catalog with the built-in web UI, over a real socket on 127.0.0.1:
//! the page, its script and style sheet, and the API the script calls. The browser-driven suite
//! is tests/webui (`make webui`, headless Chromium).
#![allow(clippy::unwrap_used, missing_docs)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// The demo process, killed when dropped so a failing assertion leaves nothing running.
struct Demo(Child);

impl Drop for Demo {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A plain HTTP/1.1 GET: status, headers (lowercased) and body.
fn get(addr: &str, path: &str) -> (u16, String, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    stream.read_to_string(&mut answer).unwrap();
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let status = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, head.to_ascii_lowercase(), body.to_string())
}

#[test]
fn demo_serves_the_catalog_and_the_web_ui() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .current_dir(dir.path())
        .args(["demo", "--dir", "catalog", "--addr", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let _demo = Demo(child);
    let mut report = String::new();
    let mut addr = None;
    for line in BufReader::new(stdout).lines() {
        let line = line.unwrap();
        if let Some(rest) = line.strip_prefix("listening on http://") {
            addr = Some(rest.split(' ').next().unwrap().to_string());
            break;
        }
        report.push_str(&line);
        report.push('\n');
    }
    let addr = addr.unwrap_or_else(|| panic!("the demo never served: {report}"));
    // The reshard report comes first, then the server.
    assert_eq!(
        report.matches("read amplification   1.00").count(),
        3,
        "{report}"
    );
    assert!(report.ends_with("serving the catalog and its web UI (Ctrl-C stops):\n"));

    let (status, head, page) = get(&addr, "/");
    assert_eq!(status, 200);
    assert!(head.contains("content-type: text/html"), "{head}");
    assert!(
        page.contains(r#"<script src="/app.js"></script>"#),
        "{page}"
    );
    assert!(page.contains(r#"href="/style.css""#));
    let (status, head, script) = get(&addr, "/app.js");
    assert_eq!(status, 200);
    assert!(head.contains("content-type: text/javascript"), "{head}");
    for route in ["#/ckpt/", "/v1/checkpoints", "/v1/plans"] {
        assert!(script.contains(route), "{route}");
    }
    let (status, head, _) = get(&addr, "/style.css");
    assert_eq!(status, 200);
    assert!(head.contains("content-type: text/css"), "{head}");

    // The page's icon (and the /favicon.ico browsers ask for unprompted).
    assert!(
        page.contains(r#"<link rel="icon" href="/favicon.svg""#),
        "{page}"
    );
    for icon in ["/favicon.svg", "/favicon.ico"] {
        let (status, head, body) = get(&addr, icon);
        assert_eq!(status, 200, "{icon}");
        assert!(head.contains("content-type: image/svg+xml"), "{head}");
        assert!(body.starts_with("<svg"), "{icon}: {body}");
    }
    // The plan preview draws from the per-rank totals and the rank overview, not rank plans.
    for route in ["/ranks`", "/overview`"] {
        assert!(script.contains(route), "{route}");
    }

    let (status, _, catalog) = get(&addr, "/v1/checkpoints");
    assert_eq!(status, 200);
    let catalog: serde_json::Value = serde_json::from_str(&catalog).unwrap();
    let mut ids: Vec<&str> = catalog["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        [
            "gpt-small/step-001000",
            "gpt-tiny-fsdp/step-000100",
            "gpt-tiny-fsdp/step-000200",
            "gpt-tiny/step-000100",
            "gpt-tiny/step-000200",
        ]
    );
    let (status, _, _) = get(&addr, "/no-such-page.js");
    assert_eq!(status, 404);
}
