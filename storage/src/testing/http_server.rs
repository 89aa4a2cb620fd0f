//! A plain HTTP file server on 127.0.0.1 that serves a local directory the way object_store's
//! `http://` store reads one (HEAD, GET with and without `Range`, WebDAV `PROPFIND` listings),
//! and that can be told to stall: answer a GET with its headers and the first bytes of the body,
//! then send nothing more with the connection left open, or never answer at all. That is what an
//! overloaded or wedged storage server looks like to a loader, and what a load must survive by
//! failing within a known time instead of hanging (docs/retry.md).
//!
//! Only the files a stall rule matches stall, so a test can serve a checkpoint's metadata
//! normally (open and plan succeed) and stall its data files (the load's reads).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::loopback::LoopbackServer;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// What the server does with a request for a file a stall rule matches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stall {
    /// Answer in full.
    Never,
    /// Answer a GET with its headers and the first `n` bytes of the body, then send nothing
    /// more (the connection stays open until the client gives up). HEAD is answered in full:
    /// it has no body to stall in.
    AfterBytes(u64),
    /// Read the request (GET or HEAD) and never answer, not even the status line.
    BeforeHeaders,
}

/// The rule [`StallingHttpServer::stall`] sets: which stall, for which files.
type Matcher = Arc<dyn Fn(&str) -> bool + Send + Sync>;

struct State {
    rule: Mutex<(Stall, Matcher)>,
    /// Responses the server stalled.
    stalled: AtomicU64,
    /// Every request, as `METHOD /path [range]`.
    requests: Mutex<Vec<String>>,
}

impl State {
    fn stall_for(&self, path: &str) -> Stall {
        let rule = self.rule.lock().unwrap_or_else(PoisonError::into_inner);
        if (rule.1)(path) { rule.0 } else { Stall::Never }
    }
}

/// Largest request head the server reads; object_store's requests are a few hundred bytes.
const MAX_HEAD: usize = 64 * 1024;
/// How long dropping the server waits for connection tasks (they only wait on sockets).
const SHUTDOWN_GRACE: Duration = Duration::from_millis(500);
/// The `Last-Modified` of every file: object_store's HTTP store parses but does not need it, and
/// the ETag (size and modification time) is what tells versions of a file apart.
const LAST_MODIFIED: &str = "Tue, 15 Nov 1994 08:12:31 GMT";

/// An HTTP server for the files under a directory, on its own thread and Tokio runtime (so it
/// serves synchronous tests, any test runtime, and child processes alike). `GET /a/b` reads
/// `root/a/b`. Dropping it stops it and cuts every connection, stalled ones included.
pub struct StallingHttpServer {
    server: LoopbackServer,
    root: PathBuf,
    state: Arc<State>,
}

impl std::fmt::Debug for StallingHttpServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StallingHttpServer")
            .field("addr", &self.server.addr())
            .field("root", &self.root)
            .finish_non_exhaustive()
    }
}

impl StallingHttpServer {
    /// Starts serving `root` (an existing directory), stalling nothing.
    ///
    /// # Panics
    /// When no port on 127.0.0.1 can be bound or no runtime started: test setup that cannot go
    /// on.
    pub fn start(root: impl AsRef<Path>) -> Self {
        let root = root.as_ref().to_path_buf();
        let state = Arc::new(State {
            rule: Mutex::new((Stall::Never, Arc::new(|_: &str| false))),
            stalled: AtomicU64::new(0),
            requests: Mutex::new(Vec::new()),
        });
        let served = root.clone();
        let shared = Arc::clone(&state);
        let server = LoopbackServer::start("HTTP test server", SHUTDOWN_GRACE, move |socket| {
            let root = served.clone();
            let state = Arc::clone(&shared);
            async move { serve(socket, &root, &state).await }
        });
        Self {
            server,
            root,
            state,
        }
    }

    /// `http://127.0.0.1:<port>`: the origin; a checkpoint at `root/run/step` is the location
    /// `{url}/run/step`.
    pub fn url(&self) -> String {
        format!("http://{}", self.server.addr())
    }

    /// The directory served.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// From now on, requests for the files `which` accepts (given the path under the root,
    /// `run/step/data/rank0.bin`) stall as `stall` says; other files are served normally.
    /// Requests already answered are not affected.
    pub fn stall(&self, stall: Stall, which: impl Fn(&str) -> bool + Send + Sync + 'static) {
        *self
            .state
            .rule
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = (stall, Arc::new(which));
    }

    /// Serves every file normally again.
    pub fn stop_stalling(&self) {
        self.stall(Stall::Never, |_| false);
    }

    /// How many responses were stalled so far.
    pub fn stalled(&self) -> u64 {
        self.state.stalled.load(Ordering::Relaxed)
    }

    /// Every request so far, in arrival order, as `METHOD /path` plus ` bytes=a-b` for a range.
    pub fn requests(&self) -> Vec<String> {
        self.state
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// A parsed request head.
struct Request {
    method: String,
    /// Percent-decoded path without the leading `/`.
    path: String,
    range: Option<String>,
    depth: Option<String>,
}

fn parse_request(head: &[u8]) -> Option<Request> {
    let text = std::str::from_utf8(head).ok()?;
    let mut lines = text.split("\r\n");
    let mut first = lines.next()?.split_whitespace();
    let method = first.next()?.to_string();
    let target = first.next()?;
    let raw = target.split(['?', '#']).next().unwrap_or_default();
    let path = percent_decode(raw.trim_start_matches('/'))?;
    let mut range = None;
    let mut depth = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        match name.trim().to_ascii_lowercase().as_str() {
            "range" => range = Some(value.trim().to_string()),
            "depth" => depth = Some(value.trim().to_string()),
            _ => {}
        }
    }
    Some(Request {
        method,
        path,
        range,
        depth,
    })
}

fn percent_decode(raw: &str) -> Option<String> {
    let bytes = raw.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

fn percent_encode(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for b in path.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'/' | b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

/// The file or directory `path` names under `root`; `None` for a path that would leave it.
fn resolve(root: &Path, path: &str) -> Option<PathBuf> {
    let mut out = root.to_path_buf();
    for part in path.split('/').filter(|p| !p.is_empty()) {
        if part == "." || part == ".." || part.contains('\\') {
            return None;
        }
        out.push(part);
    }
    Some(out)
}

/// `bytes=a-b`, `bytes=a-` or `bytes=-n` against a file of `size` bytes: the half-open range,
/// or `Err(())` when it cannot be satisfied (or is not one range).
fn parse_range(spec: &str, size: u64) -> Result<(u64, u64), ()> {
    let spec = spec.strip_prefix("bytes=").ok_or(())?;
    if spec.contains(',') {
        return Err(());
    }
    let (a, b) = spec.split_once('-').ok_or(())?;
    let (start, end) = match (a.trim(), b.trim()) {
        ("", n) => {
            let n: u64 = n.parse().map_err(|_| ())?;
            (size.saturating_sub(n), size)
        }
        (a, "") => (a.parse().map_err(|_| ())?, size),
        (a, b) => {
            let a: u64 = a.parse().map_err(|_| ())?;
            let b: u64 = b.parse().map_err(|_| ())?;
            if b < a {
                return Err(());
            }
            (a, b.saturating_add(1).min(size))
        }
    };
    if start >= size || start >= end {
        return Err(());
    }
    Ok((start, end))
}

fn etag(meta: &std::fs::Metadata) -> String {
    let modified = meta
        .modified()
        .ok()
        .and_then(|m| m.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    format!("\"{:x}-{modified:x}\"", meta.len())
}

fn simple(status: &str) -> String {
    format!("HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
}

/// One `<response>` of a PROPFIND answer.
fn prop_entry(out: &mut String, href: &str, meta: &std::fs::Metadata) {
    let href = percent_encode(href);
    if meta.is_dir() {
        let _ = write!(
            out,
            "<response><href>{href}/</href><propstat><prop><getlastmodified>{LAST_MODIFIED}</getlastmodified>\
             <resourcetype><collection/></resourcetype></prop><status>HTTP/1.1 200 OK</status></propstat></response>"
        );
    } else {
        let _ = write!(
            out,
            "<response><href>{href}</href><propstat><prop><getlastmodified>{LAST_MODIFIED}</getlastmodified>\
             <getcontentlength>{}</getcontentlength><resourcetype/><getetag>{}</getetag></prop>\
             <status>HTTP/1.1 200 OK</status></propstat></response>",
            meta.len(),
            etag(meta).replace('"', "&quot;")
        );
    }
}

/// A PROPFIND answer for `path` (depth 0: itself; otherwise itself and its children).
fn propfind(file: &Path, path: &str, depth: Option<&str>) -> std::io::Result<String> {
    let meta = std::fs::metadata(file)?;
    let href = format!("/{}", path.trim_end_matches('/'));
    let mut body =
        String::from("<?xml version=\"1.0\" encoding=\"utf-8\"?><multistatus xmlns=\"DAV:\">");
    prop_entry(&mut body, &href, &meta);
    if meta.is_dir() && depth != Some("0") {
        let mut children: Vec<_> = std::fs::read_dir(file)?.flatten().collect();
        children.sort_by_key(|e| e.file_name());
        for child in children {
            let (Ok(meta), Some(name)) = (
                child.metadata(),
                child.file_name().to_str().map(String::from),
            ) else {
                continue;
            };
            let child_href = format!("{}/{name}", href.trim_end_matches('/'));
            prop_entry(&mut body, &child_href, &meta);
        }
    }
    body.push_str("</multistatus>");
    Ok(body)
}

/// Serves one request on `socket` (answers carry `Connection: close`).
async fn serve(mut socket: TcpStream, root: &Path, state: &State) {
    let mut head = Vec::new();
    let mut buf = [0u8; 4096];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
        if head.len() > MAX_HEAD {
            let _ = socket
                .write_all(simple("431 Request Header Fields Too Large").as_bytes())
                .await;
            return;
        }
        match socket.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
    }
    let Some(request) = parse_request(&head) else {
        let _ = socket.write_all(simple("400 Bad Request").as_bytes()).await;
        return;
    };
    {
        let mut line = format!("{} /{}", request.method, request.path);
        if let Some(range) = &request.range {
            let _ = write!(line, " {range}");
        }
        state
            .requests
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(line);
    }
    let Some(file) = resolve(root, &request.path) else {
        let _ = socket.write_all(simple("404 Not Found").as_bytes()).await;
        return;
    };
    if request.method == "PROPFIND" {
        let answer = match propfind(&file, &request.path, request.depth.as_deref()) {
            Ok(body) => format!(
                "HTTP/1.1 207 Multi-Status\r\nContent-Type: application/xml; charset=utf-8\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            ),
            Err(_) => simple("404 Not Found"),
        };
        let _ = socket.write_all(answer.as_bytes()).await;
        return;
    }
    let head_only = match request.method.as_str() {
        "GET" => false,
        "HEAD" => true,
        _ => {
            let _ = socket
                .write_all(simple("405 Method Not Allowed").as_bytes())
                .await;
            return;
        }
    };
    let meta = match std::fs::metadata(&file) {
        Ok(meta) if meta.is_file() => meta,
        _ => {
            let _ = socket.write_all(simple("404 Not Found").as_bytes()).await;
            return;
        }
    };
    let stall = state.stall_for(&request.path);
    if stall == Stall::BeforeHeaders {
        state.stalled.fetch_add(1, Ordering::Relaxed);
        wait_for_close(&mut socket).await;
        return;
    }
    let size = meta.len();
    let common = format!(
        "Last-Modified: {LAST_MODIFIED}\r\nETag: {}\r\nAccept-Ranges: bytes\r\nConnection: close",
        etag(&meta)
    );
    let (status, start, end, extra) = match request.range.as_deref() {
        None => ("200 OK", 0, size, String::new()),
        Some(spec) => match parse_range(spec, size) {
            Ok((start, end)) => (
                "206 Partial Content",
                start,
                end,
                format!("Content-Range: bytes {start}-{}/{size}\r\n", end - 1),
            ),
            Err(()) => {
                let answer = format!(
                    "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{size}\r\n\
                     Content-Length: 0\r\n{common}\r\n\r\n"
                );
                let _ = socket.write_all(answer.as_bytes()).await;
                return;
            }
        },
    };
    let header = format!(
        "HTTP/1.1 {status}\r\nContent-Length: {}\r\n{extra}{common}\r\n\r\n",
        end - start
    );
    if socket.write_all(header.as_bytes()).await.is_err() || head_only {
        return;
    }
    let Ok(body) = read_range(&file, start, end).await else {
        // The headers promised a body; closing short tells the client the answer is broken.
        return;
    };
    match stall {
        Stall::AfterBytes(n) if n < body.len() as u64 => {
            let sent = usize::try_from(n).unwrap_or(usize::MAX).min(body.len());
            let _ = socket.write_all(&body[..sent]).await;
            let _ = socket.flush().await;
            state.stalled.fetch_add(1, Ordering::Relaxed);
            wait_for_close(&mut socket).await;
        }
        _ => {
            let _ = socket.write_all(&body).await;
            let _ = socket.flush().await;
        }
    }
}

/// Sends nothing more; returns once the client closes the connection (it gave up).
async fn wait_for_close(socket: &mut TcpStream) {
    let mut buf = [0u8; 1024];
    while let Ok(n) = socket.read(&mut buf).await {
        if n == 0 {
            return;
        }
    }
}

async fn read_range(file: &Path, start: u64, end: u64) -> std::io::Result<Vec<u8>> {
    use tokio::io::AsyncSeekExt;
    let mut f = tokio::fs::File::open(file).await?;
    f.seek(std::io::SeekFrom::Start(start)).await?;
    let len = usize::try_from(end - start).map_err(std::io::Error::other)?;
    let mut body = vec![0u8; len];
    f.read_exact(&mut body).await?;
    Ok(body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges() {
        assert_eq!(parse_range("bytes=0-9", 100), Ok((0, 10)));
        assert_eq!(parse_range("bytes=90-200", 100), Ok((90, 100)));
        assert_eq!(parse_range("bytes=10-", 100), Ok((10, 100)));
        assert_eq!(parse_range("bytes=-10", 100), Ok((90, 100)));
        assert_eq!(parse_range("bytes=100-200", 100), Err(()));
        assert_eq!(parse_range("bytes=5-1", 100), Err(()));
        assert_eq!(parse_range("bytes=0-1,4-5", 100), Err(()));
    }

    #[test]
    fn paths_stay_under_the_root() {
        let root = Path::new("/srv");
        assert_eq!(resolve(root, "a/b"), Some(PathBuf::from("/srv/a/b")));
        assert_eq!(resolve(root, "a/../../etc"), None);
        assert_eq!(percent_decode("a%20b"), Some("a b".to_string()));
        assert_eq!(percent_encode("a b/c"), "a%20b/c");
    }
}
