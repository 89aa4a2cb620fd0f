//! A small HTTP/1.1 server of in-memory files, read the way object_store's `http://` store reads
//! (HEAD, GET with and without one `Range`): how a publishing process serves the data files of
//! its live publications (`tessera.publish`) to consuming jobs, which open them through
//! [`crate::LiveStore`] as they would any `http://` checkpoint.
//!
//! Plain threads, no async runtime: the server runs inside a training process whose own runtime
//! (if any) must not be stalled by it, a publication has a handful of consumers that each keep a
//! few pooled connections, and a thread per connection blocking on its socket is the simplest
//! thing that serves them. Every connection has a read timeout ([`IDLE_TIMEOUT`]) so the thread
//! of a consumer that died or went away ends.
//!
//! Requests are untrusted bytes: the head is capped at [`MAX_HEAD`], only `GET` and `HEAD`
//! are answered, a path is looked up as an exact key (no file system behind it), and anything
//! else is a 4xx.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use bytes::Bytes;

use crate::StorageError;

/// Largest request head read; object_store's requests are a few hundred bytes.
pub const MAX_HEAD: usize = 64 * 1024;
/// How long a connection may stay silent before its thread closes it: longer than a pooled
/// client connection usually idles (reqwest's default pool idle is 90 s), short enough that a
/// vanished consumer's thread ends.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

type Files = Arc<RwLock<HashMap<String, Bytes>>>;

/// Test support (`testing`): paths whose requests are held unanswered, and how many are held.
#[derive(Debug, Default)]
struct Held {
    paths: Mutex<HashSet<String>>,
    waiting: AtomicU64,
}

/// A running server: its address and the files it serves (by path, no leading `/`).
#[derive(Debug)]
pub struct RangeServer {
    addr: SocketAddr,
    files: Files,
    stop: Arc<AtomicBool>,
    // Shared with the connection threads, which read it in every build; this handle sets it
    // only in test builds (`hold`, `release`).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    held: Arc<Held>,
}

impl RangeServer {
    /// Binds `host` on an ephemeral port and starts accepting on a thread of its own.
    pub fn start(host: &str) -> Result<RangeServer, StorageError> {
        let failed = |detail: String| StorageError::Location {
            location: format!("http://{host}"),
            detail,
        };
        let listener = TcpListener::bind((host, 0))
            .map_err(|e| failed(format!("binding a port to serve publications: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| failed(format!("reading the bound address: {e}")))?;
        let files: Files = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let held = Arc::new(Held::default());
        let (accept_files, accept_stop, accept_held) = (files.clone(), stop.clone(), held.clone());
        std::thread::Builder::new()
            .name("tessera-range-server".to_string())
            .spawn(move || accept(listener, accept_files, accept_stop, accept_held))
            .map_err(|e| failed(format!("starting the server thread: {e}")))?;
        Ok(RangeServer {
            addr,
            files,
            stop,
            held,
        })
    }

    /// `http://host:port`, the origin every served path is under.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Serves `bytes` at `path` (replacing what was there).
    pub fn serve(&self, path: &str, bytes: Bytes) {
        self.files
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(path.trim_start_matches('/').to_string(), bytes);
    }

    /// Stops serving `path`; true when it was served. Requests already answering keep their bytes.
    pub fn remove(&self, path: &str) -> bool {
        self.files
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(path.trim_start_matches('/'))
            .is_some()
    }

    /// The bytes served at `path`.
    pub fn get(&self, path: &str) -> Option<Bytes> {
        self.files
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(path.trim_start_matches('/'))
            .cloned()
    }
}

#[cfg(feature = "testing")]
impl RangeServer {
    /// Test support: from now on, requests for `path` are read and held unanswered (a reader
    /// is mid-load when the test then kills the process) until [`Self::release`].
    pub fn hold(&self, path: &str) {
        self.held
            .paths
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(path.trim_start_matches('/').to_string());
    }

    /// Test support: answers `path`'s requests again, the held ones included.
    pub fn release(&self, path: &str) {
        self.held
            .paths
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(path.trim_start_matches('/'));
    }

    /// Test support: requests held right now.
    pub fn held_requests(&self) -> u64 {
        self.held.waiting.load(Ordering::Relaxed)
    }
}

impl Drop for RangeServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        // Wakes the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
    }
}

fn accept(listener: TcpListener, files: Files, stop: Arc<AtomicBool>, held: Arc<Held>) {
    for stream in listener.incoming() {
        if stop.load(Ordering::Relaxed) {
            return;
        }
        let Ok(stream) = stream else { continue };
        let (files, held) = (files.clone(), held.clone());
        // A connection that cannot get a thread is dropped: its client sees a reset and says so.
        let _ = std::thread::Builder::new()
            .name("tessera-range-conn".to_string())
            .spawn(move || {
                let _ = connection(stream, &files, &held);
            });
    }
}

/// Answers requests on one connection until the client closes it, goes silent for
/// [`IDLE_TIMEOUT`], or sends something that is not a request this server reads.
fn connection(stream: TcpStream, files: &Files, held: &Held) -> std::io::Result<()> {
    stream.set_read_timeout(Some(IDLE_TIMEOUT))?;
    stream.set_nodelay(true)?;
    let mut writer = stream.try_clone()?;
    let mut reader = BufReader::new(stream);
    loop {
        let Some(head) = read_head(&mut reader)? else {
            return Ok(());
        };
        hold_while_held(&head, held);
        let keep = respond(&head, files, &mut writer)?;
        writer.flush()?;
        if !keep {
            return Ok(());
        }
    }
}

/// The request head's lines (without the blank line), or `None` at a clean end of stream.
fn read_head(reader: &mut impl BufRead) -> std::io::Result<Option<Vec<String>>> {
    let mut lines = Vec::new();
    let mut total = 0usize;
    loop {
        let mut line = String::new();
        let n = std::io::Read::take(&mut *reader, (MAX_HEAD - total + 1) as u64)
            .read_line(&mut line)?;
        if n == 0 {
            return if lines.is_empty() {
                Ok(None)
            } else {
                Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "request head cut short",
                ))
            };
        }
        total += n;
        if total > MAX_HEAD {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                "request head over the cap",
            ));
        }
        let line = line.trim_end_matches(['\r', '\n']).to_string();
        if line.is_empty() {
            if lines.is_empty() {
                // Blank lines before a request are allowed (RFC 9112, 2.2).
                continue;
            }
            return Ok(Some(lines));
        }
        lines.push(line);
    }
}

/// Blocks while the request's path is held (only ever set by tests through `hold`).
fn hold_while_held(head: &[String], held: &Held) {
    let path = head
        .first()
        .and_then(|l| l.split_whitespace().nth(1))
        .unwrap_or_default()
        .trim_start_matches('/');
    let is_held = || {
        held.paths
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(path)
    };
    if !is_held() {
        return;
    }
    held.waiting.fetch_add(1, Ordering::Relaxed);
    while is_held() {
        std::thread::sleep(Duration::from_millis(10));
    }
    held.waiting.fetch_sub(1, Ordering::Relaxed);
}

/// Writes the response to one request; returns whether the connection stays open.
fn respond(head: &[String], files: &Files, out: &mut impl Write) -> std::io::Result<bool> {
    let mut first = head
        .first()
        .map(|l| l.split_whitespace())
        .into_iter()
        .flatten();
    let (Some(method), Some(target)) = (first.next(), first.next()) else {
        status(out, "400 Bad Request", "not an HTTP request")?;
        return Ok(false);
    };
    let mut range = None;
    let mut close = false;
    for line in &head[1..] {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        match name.trim().to_ascii_lowercase().as_str() {
            "range" => range = Some(value.trim().to_string()),
            "connection" => close = value.trim().eq_ignore_ascii_case("close"),
            _ => {}
        }
    }
    let head_only = match method {
        "GET" => false,
        "HEAD" => true,
        _ => {
            status(out, "405 Method Not Allowed", "only GET and HEAD")?;
            return Ok(!close);
        }
    };
    let path = target
        .split(['?', '#'])
        .next()
        .unwrap_or_default()
        .trim_start_matches('/');
    let Some(bytes) = files
        .read()
        .unwrap_or_else(PoisonError::into_inner)
        .get(path)
        .cloned()
    else {
        status(
            out,
            "404 Not Found",
            "not served (retired or never published)",
        )?;
        return Ok(!close);
    };
    let size = bytes.len() as u64;
    let (code, start, end) = match range.as_deref() {
        None => ("200 OK", 0, size),
        Some(spec) => match parse_range(spec, size) {
            Some((start, end)) => ("206 Partial Content", start, end),
            None => {
                write!(
                    out,
                    "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{size}\r\nContent-Length: 0\r\n\r\n"
                )?;
                return Ok(!close);
            }
        },
    };
    write!(
        out,
        "HTTP/1.1 {code}\r\nContent-Length: {}\r\n",
        end - start
    )?;
    if range.is_some() {
        write!(
            out,
            "Content-Range: bytes {start}-{}/{size}\r\n",
            end.saturating_sub(1)
        )?;
    }
    write!(out, "Accept-Ranges: bytes\r\n\r\n")?;
    if !head_only {
        // In range: parse_range keeps start < end <= size.
        if let Some(body) = bytes.get(start as usize..end as usize) {
            out.write_all(body)?;
        }
    }
    Ok(!close)
}

fn status(out: &mut impl Write, code: &str, body: &str) -> std::io::Result<()> {
    write!(
        out,
        "HTTP/1.1 {code}\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

/// `bytes=a-b`, `bytes=a-` or `bytes=-n` against `size` bytes: the half-open range, or `None`
/// when it cannot be satisfied or is not one range.
fn parse_range(spec: &str, size: u64) -> Option<(u64, u64)> {
    let spec = spec.strip_prefix("bytes=")?;
    if spec.contains(',') {
        return None;
    }
    let (a, b) = spec.split_once('-')?;
    let (start, end) = match (a.trim(), b.trim()) {
        ("", n) => (size.saturating_sub(n.parse().ok()?), size),
        (a, "") => (a.parse().ok()?, size),
        (a, b) => {
            let a: u64 = a.parse().ok()?;
            let b: u64 = b.parse().ok()?;
            if b < a {
                return None;
            }
            (a, b.saturating_add(1).min(size))
        }
    };
    (start < end && end <= size).then_some((start, end))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use object_store::path::Path;
    use object_store::{GetOptions, GetRange, ObjectStore, ObjectStoreExt};

    fn store(server: &RangeServer) -> object_store::http::HttpStore {
        crate::install_tls_provider();
        object_store::http::HttpBuilder::new()
            .with_url(server.url())
            .with_client_options(
                crate::RetryPolicy::default()
                    .client_options()
                    .with_allow_http(true),
            )
            .build()
            .unwrap()
    }

    #[tokio::test]
    async fn http_store_reads_served_bytes_whole_in_ranges_and_by_head() {
        let server = RangeServer::start("127.0.0.1").unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7) as u8).collect();
        server.serve(
            "run/step-000001/data/publisher-rank-0.bin",
            Bytes::from(data.clone()),
        );
        let store = store(&server);
        let path = Path::from("run/step-000001/data/publisher-rank-0.bin");
        let whole = store.get(&path).await.unwrap().bytes().await.unwrap();
        assert_eq!(whole.as_ref(), data.as_slice());
        let part = store.get_range(&path, 4096..5000).await.unwrap();
        assert_eq!(part.as_ref(), &data[4096..5000]);
        let tail = store
            .get_opts(
                &path,
                GetOptions {
                    range: Some(GetRange::Suffix(100)),
                    ..GetOptions::default()
                },
            )
            .await
            .unwrap()
            .bytes()
            .await
            .unwrap();
        assert_eq!(tail.as_ref(), &data[9900..]);
        assert_eq!(store.head(&path).await.unwrap().size, 10_000);
    }

    #[tokio::test]
    async fn a_removed_file_is_not_found_and_bad_ranges_are_refused() {
        let server = RangeServer::start("127.0.0.1").unwrap();
        server.serve("a.bin", Bytes::from_static(b"0123456789"));
        let store = store(&server);
        let path = Path::from("a.bin");
        assert!(store.get_range(&path, 20..30).await.is_err());
        assert!(server.remove("a.bin"));
        let err = store.get(&path).await.unwrap_err();
        assert!(matches!(err, object_store::Error::NotFound { .. }), "{err}");
    }

    #[test]
    fn ranges_parse_with_bounds() {
        assert_eq!(parse_range("bytes=0-9", 10), Some((0, 10)));
        assert_eq!(parse_range("bytes=5-", 10), Some((5, 10)));
        assert_eq!(parse_range("bytes=-3", 10), Some((7, 10)));
        assert_eq!(parse_range("bytes=8-100", 10), Some((8, 10)));
        assert_eq!(parse_range("bytes=10-", 10), None);
        assert_eq!(parse_range("bytes=3-1", 10), None);
        assert_eq!(parse_range("bytes=0-1,3-4", 10), None);
        assert_eq!(parse_range("items=0-1", 10), None);
    }
}
