//! A plan server on an ephemeral loopback port, started in this process over a catalog root,
//! for end-to-end tests that run the real binary against it.
#![allow(clippy::unwrap_used)]

use std::path::Path;

use serde_json::Value;

use super::s;

/// Serves a catalog root from this process on an ephemeral loopback port; stops on drop.
pub struct Served {
    pub addr: std::net::SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Served {
    pub fn start(root: &Path) -> Served {
        let state =
            tessera_server::AppState::new(tessera_server::ServerConfig::new(s(root))).unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        listener.set_nonblocking(true).unwrap();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            runtime.block_on(async move {
                let listener = tokio::net::TcpListener::from_std(listener).unwrap();
                tessera_server::serve(listener, state, async move {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
            });
        });
        Served {
            addr,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    pub fn get(&self, path: &str) -> Value {
        use std::io::{Read, Write};
        let mut stream = std::net::TcpStream::connect(self.addr).unwrap();
        write!(
            stream,
            "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
        )
        .unwrap();
        let mut response = String::new();
        stream.read_to_string(&mut response).unwrap();
        let (head, body) = response.split_once("\r\n\r\n").unwrap();
        assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}");
        // Bodies may be chunked: take the JSON between the first '{' and the last '}'.
        let json = &body[body.find('{').unwrap()..=body.rfind('}').unwrap()];
        serde_json::from_str(json).unwrap()
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}
