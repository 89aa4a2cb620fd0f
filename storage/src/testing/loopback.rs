//! A TCP server on 127.0.0.1 on its own thread and Tokio runtime: what the test servers here
//! share. Its own thread and runtime let it serve synchronous tests, any test runtime, and child
//! processes alike; dropping it stops accepting, cuts the connections still open after a grace
//! period, and joins the thread.

use std::future::Future;
use std::net::SocketAddr;
use std::thread::JoinHandle;
use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::oneshot;

/// A running accept loop; see the module docs.
#[derive(Debug)]
pub(crate) struct LoopbackServer {
    addr: SocketAddr,
    shutdown: Option<oneshot::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl LoopbackServer {
    /// Binds a free port on 127.0.0.1 and hands every accepted connection to `serve`, each in
    /// its own task. `name` ("S3 test server") names the thread and the panics; `grace` bounds
    /// how long dropping waits for connections in flight.
    ///
    /// # Panics
    /// When no port can be bound, no runtime started or no thread spawned: test setup that
    /// cannot go on.
    pub(crate) fn start<F, Fut>(name: &'static str, grace: Duration, serve: F) -> Self
    where
        F: Fn(TcpStream) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        // Bound here, not on the server thread, so that the port is known and taken on return.
        let listener = std::net::TcpListener::bind(("127.0.0.1", 0))
            .and_then(|l| l.set_nonblocking(true).map(|()| l))
            .unwrap_or_else(|e| panic!("{name}: cannot bind 127.0.0.1: {e}"));
        let addr = listener
            .local_addr()
            .unwrap_or_else(|e| panic!("{name}: no local address: {e}"));
        let thread_name = name.to_lowercase().replace(' ', "-");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(thread_name.clone())
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("{name}: cannot start a runtime: {e}"));
        let (shutdown, mut stop) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(thread_name)
            .spawn(move || {
                runtime.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                        return;
                    };
                    loop {
                        let socket = tokio::select! {
                            // A send or a dropped sender: either way, stop.
                            _ = &mut stop => break,
                            accepted = listener.accept() => match accepted {
                                Ok((socket, _)) => socket,
                                Err(_) => continue,
                            },
                        };
                        tokio::spawn(serve(socket));
                    }
                });
                // Cuts the connection tasks still running; bounded so that drop is too.
                runtime.shutdown_timeout(grace);
            })
            .unwrap_or_else(|e| panic!("{name}: cannot spawn its thread: {e}"));
        Self {
            addr,
            shutdown: Some(shutdown),
            thread: Some(thread),
        }
    }

    /// The bound address.
    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for LoopbackServer {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            // The server may have stopped already; then there is no one to tell.
            let _ = shutdown.send(());
        }
        if let Some(thread) = self.thread.take() {
            // A panic on the server thread has been reported there already.
            let _ = thread.join();
        }
    }
}
