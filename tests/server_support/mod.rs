//! What the server end-to-end tests (`server.rs`, `server_identity.rs`) share: the test
//! checkpoint, a server on a loopback port, and a load that checks every byte.

// Each test binary uses a subset of these helpers.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use serde_json::Value;
use tessera_loader::checkpoint::Checkpoint;
use tessera_loader::load::{LoadOptions, load_rank};
use tessera_loader::transport::{InProcTransport, TransportOptions};
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_planner::{Layout, RankPlan, Target};
use tessera_server::{AppState, ServerConfig};
use tessera_storage::{self as storage, StorageOptions};
use tessera_synth::{self as synth, Model, SynthOptions, synthesize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;

/// A Megatron GPT layout of gpt-tiny's 4 layers.
pub fn megatron(tp: u32, pp: u32, dp: u32, zero1: bool) -> Layout {
    megatron_gpt(MegatronGpt {
        tp,
        pp,
        dp,
        num_layers: 4,
        zero1,
    })
    .unwrap()
}

/// Writes gpt-tiny with optimizer states saved with `layout` at `location`.
pub async fn write_tiny(location: &str, layout: &Layout, options: &StorageOptions) {
    let out = storage::create_with(location, options).unwrap();
    synthesize(
        out.store.clone(),
        &out.prefix,
        &out.display,
        layout,
        &SynthOptions {
            model: Model::GptTiny,
            optimizer: true,
            metadata_only: false,
            dist_optimizer: None,
            step: None,
            progress: None,
        },
    )
    .await
    .unwrap();
}

/// A server on an ephemeral port of 127.0.0.1, stopped (gracefully) when dropped.
pub struct RunningServer {
    pub addr: SocketAddr,
    pub state: AppState,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl RunningServer {
    pub async fn start(config: ServerConfig) -> Self {
        let state = AppState::new(config).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(tessera_server::serve(listener, state.clone(), async move {
            let _ = stopped.await;
        }));
        Self {
            addr,
            state,
            stop: Some(stop),
            task: Some(tokio::spawn(async move {
                task.await.unwrap().unwrap();
            })),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn stop(mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(Duration::from_secs(10), task)
                .await
                .expect("the server stops within its grace period")
                .unwrap();
        }
    }

    /// One HTTP/1.1 request: status and body (JSON, or a string when it is not JSON).
    pub async fn request(&self, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        let mut stream = tokio::net::TcpStream::connect(self.addr).await.unwrap();
        let body = body.unwrap_or("");
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            self.addr,
            body.len()
        );
        stream.write_all(head.as_bytes()).await.unwrap();
        stream.write_all(body.as_bytes()).await.unwrap();
        let mut response = Vec::new();
        tokio::time::timeout(Duration::from_secs(60), stream.read_to_end(&mut response))
            .await
            .unwrap()
            .unwrap();
        let response = String::from_utf8_lossy(&response);
        let status = response
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0);
        let body = response.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        let json = serde_json::from_str(body).unwrap_or_else(|_| Value::String(body.to_string()));
        (status, json)
    }

    pub async fn get(&self, path: &str) -> (u16, Value) {
        self.request("GET", path, None).await
    }

    pub async fn post_plan(&self, body: &Value) -> (u16, Value) {
        self.request("POST", "/v1/plans", Some(&body.to_string()))
            .await
    }
}

/// Loads every rank of `plans` in this process and checks every byte against the formula.
pub async fn load_and_check(checkpoint: &Checkpoint, plans: Vec<RankPlan>) -> u64 {
    let world = plans.len() as u32;
    let transports = InProcTransport::mesh(world, TransportOptions::default());
    let mut tasks = Vec::new();
    for (plan, transport) in plans.into_iter().zip(transports) {
        let checkpoint = checkpoint.clone();
        tasks.push(tokio::spawn(async move {
            load_rank(&checkpoint, plan, &transport, &LoadOptions::default()).await
        }));
    }
    let mut bytes_read = 0;
    for task in tasks {
        let loaded = task.await.unwrap().unwrap();
        let plan = &loaded.plan;
        for (dest, buffer) in plan.destinations.iter().zip(&loaded.buffers) {
            let tensor = &plan.tensors[dest.tensor as usize];
            match &dest.target {
                Target::Box(region) => synth::check_box(tensor, region, buffer).unwrap(),
                Target::Flat { start, end } => {
                    synth::check_flat(tensor, *start, *end, buffer).unwrap()
                }
            }
        }
        bytes_read += loaded.report.bytes_read;
    }
    bytes_read
}
