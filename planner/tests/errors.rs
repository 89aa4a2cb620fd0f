//! Every layout, request and preset error, with the message a user sees.
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;

use tessera_metadata::{CheckpointMeta, DType, TensorMeta};
use tessera_planner::presets::{MegatronGpt, fsdp, megatron_gpt};
use tessera_planner::{ExplicitRequests, Layout, PlanError, PlanOptions, RequestSet, plan};

fn tensors() -> Vec<TensorMeta> {
    vec![
        TensorMeta::new("model.layers.0.mlp.fc1.weight", DType::Bf16, vec![8, 4]),
        TensorMeta::new("model.embed_tokens.weight", DType::Bf16, vec![10, 4]),
        TensorMeta::new("misc.scale", DType::F32, vec![4]),
    ]
}

fn resolve_err(json: &str) -> String {
    Layout::from_json(json)
        .and_then(|l| l.resolve(&tensors()))
        .unwrap_err()
        .to_string()
}

#[test]
fn unknown_placement() {
    assert_eq!(
        resolve_err(
            r#"{"mesh": [{"name": "dp", "size": 2}], "rules": [{"match": "*", "placements": ["shard0"]}]}"#
        ),
        "rule 0 (match \"*\"): unknown placement \"shard0\"; expected shard(<dim>), replicate or stage(layer)"
    );
}

#[test]
fn shard_dim_at_or_past_ndim() {
    assert_eq!(
        resolve_err(
            r#"{"mesh": [{"name": "tp", "size": 2}], "rules": [{"match": "misc.*", "placements": ["shard(1)"]}, {"match": "*", "placements": ["shard(0)"]}]}"#
        ),
        "tensor misc.scale (1 dims) cannot take placement shard(1) from rule 0 (match \"misc.*\"): dim 1 >= ndim 1"
    );
}

#[test]
fn tensor_without_rule() {
    assert_eq!(
        resolve_err(
            r#"{"mesh": [{"name": "dp", "size": 2}], "rules": [{"match": "model.*", "placements": ["shard(0)"]}]}"#
        ),
        "tensor misc.scale matches no rule of the layout (add a rule, e.g. {\"match\": \"*\", ...})"
    );
}

#[test]
fn mesh_size_zero() {
    assert_eq!(
        resolve_err(
            r#"{"mesh": [{"name": "dp", "size": 0}], "rules": [{"match": "*", "placements": ["shard(0)"]}]}"#
        ),
        "mesh dimension \"dp\" has size 0; every mesh dimension needs at least one rank"
    );
}

#[test]
fn stage_without_layer_or_first_last() {
    assert_eq!(
        resolve_err(
            r#"{"mesh": [{"name": "pp", "size": 2}], "rules": [{"match": "*", "placements": ["stage(layer)"]}],
                "stages": {"num_layers": 2, "first": ["*embed*"], "last": []}}"#
        ),
        "tensor misc.scale: cannot derive its pipeline stage: no layer number matches \"layers\\\\.(\\\\d+)\\\\.\" and it matches neither first [\"*embed*\"] nor last [] (see the layout's \"stages\": layer_pattern, first, last)"
    );
}

#[test]
fn stage_without_stages_section() {
    assert_eq!(
        resolve_err(
            r#"{"mesh": [{"name": "pp", "size": 2}], "rules": [{"match": "*", "placements": ["stage(layer)"]}]}"#
        ),
        "tensor model.layers.0.mlp.fc1.weight: cannot derive its pipeline stage: the layout has a stage(layer) placement but no \"stages\" section (see the layout's \"stages\": layer_pattern, first, last)"
    );
}

#[test]
fn wrong_placement_count() {
    assert_eq!(
        resolve_err(
            r#"{"mesh": [{"name": "dp", "size": 2}, {"name": "tp", "size": 2}], "rules": [{"match": "*", "placements": ["shard(0)"]}]}"#
        ),
        "rule 0 (match \"*\") has 1 placements but the mesh has 2 dimensions"
    );
}

#[test]
fn malformed_layout_json_names_line_and_column() {
    let err = Layout::from_json("{\"mesh\": [}").unwrap_err();
    assert!(matches!(err, PlanError::Json { what: "layout", .. }));
    assert!(
        err.to_string().starts_with("invalid layout JSON: "),
        "{err}"
    );
    assert!(err.to_string().contains("line 1 column 11"), "{err}");
}

#[test]
fn invalid_layer_pattern() {
    assert_eq!(
        resolve_err(
            r#"{"mesh": [{"name": "pp", "size": 2}], "rules": [{"match": "*", "placements": ["stage(layer)"]}], "stages": {"layer_pattern": "layers"}}"#
        ),
        "stages.layer_pattern \"layers\" is invalid: it needs a capture group for the layer number"
    );
}

fn requests_err(json: &str) -> String {
    ExplicitRequests::from_json(json)
        .and_then(|r| r.resolve(&tensors()))
        .unwrap_err()
        .to_string()
}

#[test]
fn request_errors_name_rank_and_tensor() {
    assert_eq!(
        requests_err(r#"{"ranks": [[], [{"fqn": "nope", "flat": [0, 1]}]]}"#),
        "rank 1: requested tensor nope is not in the checkpoint"
    );
    assert_eq!(
        requests_err(r#"{"ranks": [[{"fqn": "misc.scale", "offsets": [2], "lengths": [3]}]]}"#),
        "rank 0: request [2..5] for tensor misc.scale does not fit its shape [4]"
    );
    assert_eq!(
        requests_err(
            r#"{"ranks": [[{"fqn": "misc.scale", "offsets": [0, 0], "lengths": [1, 1]}]]}"#
        ),
        "rank 0: request [0..1, 0..1] for tensor misc.scale does not fit its shape [4]"
    );
    assert_eq!(
        requests_err(r#"{"ranks": [[{"fqn": "misc.scale", "flat": [3, 9]}]]}"#),
        "rank 0: flat range [3, 9) of tensor misc.scale is outside [0, 4]"
    );
}

#[test]
fn uncovered_request_and_rank_out_of_range() {
    // No saved chunks at all: planning refuses rather than returning zeros.
    let meta =
        Arc::new(CheckpointMeta::new(tensors(), Vec::new(), Vec::new(), Vec::new()).unwrap());
    let requests = fsdp(1).unwrap().resolve(meta.tensors()).unwrap();
    let err = plan(&meta, &requests, &PlanOptions::default()).unwrap_err();
    assert_eq!(
        err.to_string(),
        "rank 0: tensor model.layers.0.mlp.fc1.weight elements [0..8, 0..4] are not in any saved chunk"
    );
    let empty = plan(
        &meta,
        &RequestSet {
            ranks: vec![Vec::new()],
            disjoint: false,
        },
        &PlanOptions::default(),
    )
    .unwrap();
    assert_eq!(
        empty.rank_plan(1).unwrap_err().to_string(),
        "rank 1 is out of range for a world of 1 ranks"
    );
}

#[test]
fn preset_errors() {
    assert_eq!(
        fsdp(0).unwrap_err().to_string(),
        "preset fsdp: --dp must be at least 1"
    );
    let err = megatron_gpt(MegatronGpt {
        tp: 2,
        pp: 4,
        dp: 1,
        num_layers: 2,
        zero1: false,
    })
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "preset megatron-gpt: --num-layers 2 is smaller than --pp 4: some stage would hold no layer"
    );
}

/// 65536 × 65536 wrapped to 0 ranks (an empty plan that "loaded" fine); it is 2^32 ranks.
#[test]
fn mesh_product_that_wraps_u32_to_zero() {
    let json = r#"{"mesh": [{"name": "pp", "size": 65536}, {"name": "dp", "size": 65536}],
                   "rules": [{"match": "*", "placements": ["replicate", "shard(0)"]}]}"#;
    let layout = Layout::from_json(json).unwrap();
    let err = layout.resolve(&tensors()).unwrap_err();
    assert!(matches!(err, PlanError::WorldTooLarge { ranks, .. } if ranks == 1 << 32));
    assert_eq!(
        err.to_string(),
        "layout mesh [pp=65536, dp=65536] gives 4294967296 ranks, more than the 1048576 a plan may have"
    );
    assert_eq!(layout.world_size(), u32::MAX, "saturates, never wraps");
}

/// 4294967295² wrapped to 1 rank (which then loaded a fraction of the model).
#[test]
fn mesh_product_that_wraps_u32_to_one() {
    let json = r#"{"mesh": [{"name": "a", "size": 4294967295}, {"name": "b", "size": 4294967295}],
                   "rules": [{"match": "*", "placements": ["shard(0)", "replicate"]}]}"#;
    assert_eq!(
        resolve_err(json),
        "layout mesh [a=4294967295, b=4294967295] gives 18446744065119617025 ranks, more than the 1048576 a plan may have"
    );
}

/// A world under the rank limit whose per-rank requests (one per rank and tensor) would still
/// take tens of GiB is refused before anything is allocated.
#[test]
fn world_times_tensors_over_the_request_limit() {
    let many: Vec<TensorMeta> = (0..200)
        .map(|i| TensorMeta::new(format!("t{i}"), DType::F32, vec![4]))
        .collect();
    let json = r#"{"mesh": [{"name": "dp", "size": 1048576}], "rules": [{"match": "*", "placements": ["shard(0)"]}]}"#;
    let err = Layout::from_json(json)
        .unwrap()
        .resolve(&many)
        .unwrap_err()
        .to_string();
    assert!(
        err.starts_with(
            "layout mesh [dp=1048576]: 1048576 ranks x 200 tensors is 209715200 per-rank requests, more than the 134217728 a plan may hold"
        ),
        "{err}"
    );
}

#[test]
fn presets_refuse_a_world_over_the_limit() {
    assert_eq!(
        fsdp(1_000_000_000).unwrap_err().to_string(),
        "layout mesh [dp=1000000000] gives 1000000000 ranks, more than the 1048576 a plan may have"
    );
    let err = megatron_gpt(MegatronGpt {
        tp: 65536,
        pp: 65536,
        dp: 1,
        num_layers: 65536,
        zero1: false,
    })
    .unwrap_err();
    assert!(
        matches!(err, PlanError::WorldTooLarge { ranks, .. } if ranks == 1 << 32),
        "{err}"
    );
}

#[test]
fn explicit_requests_with_more_ranks_than_the_limit() {
    let requests = ExplicitRequests {
        ranks: vec![Vec::new(); tessera_planner::MAX_WORLD as usize + 1],
    };
    assert_eq!(
        requests.resolve(&tensors()).unwrap_err().to_string(),
        "requests \"ranks\" gives 1048577 ranks, more than the 1048576 a plan may have"
    );
}

/// Layer numbers near u64::MAX: (layer + 1) · stages overflowed u64 in the stage formula.
#[test]
fn huge_layer_numbers_get_a_stage_without_overflow() {
    let layer = u64::MAX - 1;
    let tensors = vec![TensorMeta::new(
        format!("model.layers.{layer}.w"),
        DType::F32,
        vec![4],
    )];
    let json = format!(
        r#"{{"mesh": [{{"name": "pp", "size": 4}}], "rules": [{{"match": "*", "placements": ["stage(layer)"]}}],
            "stages": {{"num_layers": {}}}}}"#,
        u64::MAX
    );
    let requests = Layout::from_json(&json).unwrap().resolve(&tensors).unwrap();
    // The last layer lives on the last stage only.
    let holders: Vec<usize> = (0..4).filter(|&r| !requests.ranks[r].is_empty()).collect();
    assert_eq!(holders, vec![3]);
}

/// A dimension near u64::MAX split over a few ranks: (c + 1) · chunk overflowed u64.
#[test]
fn shard_of_a_dimension_near_u64_max() {
    let n = u64::MAX - 2;
    let tensors = vec![TensorMeta::new("w", DType::U8, vec![n])];
    let json = r#"{"mesh": [{"name": "dp", "size": 3}], "rules": [{"match": "*", "placements": ["shard(0)"]}]}"#;
    let requests = Layout::from_json(json).unwrap().resolve(&tensors).unwrap();
    let total: u64 = requests.ranks.iter().map(|r| r[0].target.numel()).sum();
    assert_eq!(total, n);
}
