//! Helpers of the server tests: a catalog written with the real native writer (synthetic values,
//! so loaded bytes can be checked), and requests sent through the router with `oneshot`.

// Each test binary uses a subset of these helpers.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::Path as FsPath;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, to_bytes};
use axum::http::{Request, StatusCode, header};
use object_store::ObjectStore;
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use serde_json::Value;
use tessera_metadata::formats::native::{NativeWriter, WriteOptions};
use tessera_planner::presets::{MegatronGpt, fsdp, megatron_gpt};
use tessera_planner::{Layout, assign_writers};
use tessera_synth::{self as synth, Model};
use tower::ServiceExt;

/// gpt-tiny's saved layout in the fixture: Megatron tp2 pp2 dp2 with a distributed optimizer.
pub fn saved_layout() -> Layout {
    megatron_gpt(MegatronGpt {
        tp: 2,
        pp: 2,
        dp: 2,
        num_layers: Model::GptTiny.config().num_layers,
        zero1: true,
    })
    .unwrap()
}

/// A target layout: Megatron tp1 pp2 dp2 (4 ranks, DP replicas share reads).
pub fn target_layout() -> Layout {
    megatron_gpt(MegatronGpt {
        tp: 1,
        pp: 2,
        dp: 2,
        num_layers: Model::GptTiny.config().num_layers,
        zero1: false,
    })
    .unwrap()
}

/// Writes a synthetic checkpoint of `model` saved with `layout` at `<root>/<run>/<name>`;
/// without `commit` the data files are written but no manifest (an interrupted save).
pub async fn write_checkpoint(
    root: &FsPath,
    run: &str,
    name: &str,
    model: Model,
    optimizer: bool,
    layout: &Layout,
    commit: bool,
) {
    let store: Arc<dyn ObjectStore> = Arc::new(LocalFileSystem::new_with_prefix(root).unwrap());
    let tensors = synth::tensors(&model.config(), optimizer);
    let holdings = layout.resolve(&tensors).unwrap();
    let writes = assign_writers(&tensors, &holdings).unwrap();
    let writer = NativeWriter::create(
        store,
        Path::from(format!("{run}/{name}")),
        tensors.clone(),
        WriteOptions {
            source_layout: Some(serde_json::to_value(layout).unwrap()),
            ..WriteOptions::default()
        },
    )
    .await
    .unwrap();
    let mut files = Vec::new();
    for (rank, items) in writes.into_iter().enumerate() {
        let mut file = writer.data_file(&format!("rank-{rank:05}")).unwrap();
        for item in items {
            let bytes = synth::box_bytes(&tensors[item.tensor as usize], &item.region).unwrap();
            file.write_box(item.tensor, item.region, &bytes)
                .await
                .unwrap();
        }
        files.push(file.finish().await.unwrap());
    }
    if commit {
        writer.commit(files).await.unwrap();
    }
}

/// The test catalog under `root`:
///
/// - `gpt/step-000100`: gpt-tiny with optimizer states, saved Megatron tp2 pp2 dp2 zero1
/// - `gpt/step-000200`: gpt-tiny without optimizer states, saved FSDP dp2; `gpt/latest` names it
/// - `gpt/step-000300`: data written, no manifest (incomplete)
/// - `gpt/notes/readme.txt`: not a checkpoint (ignored)
/// - `eval/step-000005`: gpt-tiny without optimizer states, saved FSDP dp1
/// - `.trash/step-000001/x`: a hidden directory (ignored)
pub async fn write_catalog(root: &FsPath) {
    let tiny = Model::GptTiny;
    write_checkpoint(
        root,
        "gpt",
        "step-000100",
        tiny,
        true,
        &saved_layout(),
        true,
    )
    .await;
    let fsdp2 = fsdp(2).unwrap();
    write_checkpoint(root, "gpt", "step-000200", tiny, false, &fsdp2, true).await;
    write_checkpoint(root, "gpt", "step-000300", tiny, false, &fsdp2, false).await;
    let fsdp1 = fsdp(1).unwrap();
    write_checkpoint(root, "eval", "step-000005", tiny, false, &fsdp1, true).await;
    std::fs::create_dir_all(root.join("gpt/notes")).unwrap();
    std::fs::write(root.join("gpt/notes/readme.txt"), "not a checkpoint").unwrap();
    std::fs::create_dir_all(root.join(".trash/step-000001")).unwrap();
    std::fs::write(root.join(".trash/step-000001/x"), "x").unwrap();
}

/// An answer: status, headers and body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: axum::http::HeaderMap,
    pub body: Vec<u8>,
}

impl Answer {
    /// The body as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "body is not JSON ({e}): {}",
                String::from_utf8_lossy(&self.body)
            )
        })
    }

    /// The body as text.
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts an error answer: status, JSON kind, and that the detail mentions `needle`.
    pub fn assert_error(&self, status: StatusCode, kind: &str, needle: &str) {
        assert_eq!(self.status, status, "body: {}", self.text());
        let json = self.json();
        assert_eq!(json["error"], kind, "body: {json}");
        let detail = json["detail"].as_str().unwrap();
        assert!(
            detail.contains(needle),
            "detail {detail:?} does not mention {needle:?}"
        );
        assert_eq!(
            self.headers[header::CONTENT_TYPE],
            "application/json",
            "errors are JSON"
        );
    }
}

/// Sends `request` through `app` with `oneshot`.
pub async fn send(app: &Router, request: Request<Body>) -> Answer {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response.headers().clone();
    let body = to_bytes(response.into_body(), usize::MAX)
        .await
        .unwrap()
        .to_vec();
    Answer {
        status,
        headers,
        body,
    }
}

/// `GET uri`.
pub async fn get(app: &Router, uri: &str) -> Answer {
    send(app, Request::get(uri).body(Body::empty()).unwrap()).await
}

/// `POST uri` with a JSON body.
pub async fn post_json(app: &Router, uri: &str, body: impl Into<Body>) -> Answer {
    send(
        app,
        Request::post(uri)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.into())
            .unwrap(),
    )
    .await
}

/// A plan request body for `checkpoint` and `layout`.
pub fn plan_body(checkpoint: &str, layout: &Layout) -> String {
    serde_json::json!({"checkpoint": checkpoint, "layout": layout}).to_string()
}

/// The value of a metric line `name` (exact series text) in a Prometheus exposition.
pub fn metric(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}
