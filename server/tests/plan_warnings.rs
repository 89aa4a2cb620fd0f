//! `POST /v1/plans` carries the layout's warnings: a megatron layout made for 12 layers against
//! the 4-layer fixture plans (200) and says that its stages do not fit; a fitting one says
//! nothing.
#![allow(clippy::unwrap_used)]

mod support;

use axum::http::StatusCode;
use tempfile::TempDir;
use tessera_planner::presets::{MegatronGpt, megatron_gpt};
use tessera_server::{AppState, ServerConfig, app};

use support::*;

#[tokio::test]
async fn a_plan_for_stages_that_do_not_fit_carries_a_warning() {
    let dir = TempDir::new().unwrap();
    let root = dir.path().join("catalog");
    std::fs::create_dir_all(&root).unwrap();
    write_catalog(&root).await;
    let app = app(AppState::new(ServerConfig::new(root.to_str().unwrap())).unwrap());
    let layout = |num_layers| {
        megatron_gpt(MegatronGpt {
            tp: 1,
            pp: 2,
            dp: 1,
            num_layers,
            zero1: false,
        })
        .unwrap()
    };

    let answer = post_json(&app, "/v1/plans", plan_body("gpt/step-000100", &layout(12))).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.text());
    assert_eq!(
        answer.json()["warnings"],
        serde_json::json!([
            "the layout's stages.num_layers is 12 but the checkpoint has 4 layers (0..3): they \
             all go to pipeline stage 0 of 2, the others hold no layer; make the layout for 4 \
             layers (e.g. `tessera layout megatron-gpt --num-layers 4`)"
        ])
    );
    // The plan's own page says it too.
    let id = answer.json()["plan"].as_str().unwrap().to_string();
    let again = get(&app, &format!("/v1/plans/{id}")).await;
    assert_eq!(again.json()["warnings"], answer.json()["warnings"]);

    let fits = post_json(&app, "/v1/plans", plan_body("gpt/step-000100", &layout(4))).await;
    assert_eq!(fits.status, StatusCode::OK, "{}", fits.text());
    assert!(fits.json().get("warnings").is_none(), "{}", fits.text());
}
