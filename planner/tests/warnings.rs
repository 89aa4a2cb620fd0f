//! Layouts that resolve but do not fit the checkpoint: `Layout::warnings` says so, naming the
//! field and the numbers (a megatron-gpt layout made for 12 layers against a 4-layer model put
//! every layer on the first pipeline stage, silently).
#![allow(clippy::unwrap_used, missing_docs)]

use tessera_metadata::{DType, TensorMeta};
use tessera_planner::presets::{MegatronGpt, megatron_gpt};

fn model(layers: u64) -> Vec<TensorMeta> {
    let mut tensors = vec![TensorMeta::new(
        "model.embed_tokens.weight",
        DType::F32,
        vec![64, 16],
    )];
    for layer in 0..layers {
        tensors.push(TensorMeta::new(
            format!("model.layers.{layer}.mlp.fc1.weight"),
            DType::F32,
            vec![32, 16],
        ));
    }
    tensors.push(TensorMeta::new("lm_head.weight", DType::F32, vec![64, 16]));
    tensors
}

fn megatron(pp: u32, num_layers: u64) -> tessera_planner::Layout {
    megatron_gpt(MegatronGpt {
        tp: 1,
        pp,
        dp: 1,
        num_layers,
        zero1: false,
    })
    .unwrap()
}

#[test]
fn stages_for_more_layers_than_the_checkpoint_has_are_warned_about() {
    let tensors = model(4);
    let layout = megatron(2, 12);
    // It resolves: the warning is all that tells the user.
    layout.resolve(&tensors).unwrap();
    assert_eq!(
        layout.warnings(&tensors),
        [
            "the layout's stages.num_layers is 12 but the checkpoint has 4 layers (0..3): they all \
          go to pipeline stage 0 of 2, the others hold no layer; make the layout for 4 layers \
          (e.g. `tessera layout megatron-gpt --num-layers 4`)"
        ]
    );
    assert_eq!(
        megatron(4, 12).warnings(&model(6)),
        [
            "the layout's stages.num_layers is 12 but the checkpoint has 6 layers (0..5): they all \
          go to the first 2 of 4 pipeline stages, the others hold no layer; make the layout for \
          6 layers (e.g. `tessera layout megatron-gpt --num-layers 6`)"
        ]
    );
}

#[test]
fn fitting_layouts_have_no_warnings() {
    assert!(megatron(2, 4).warnings(&model(4)).is_empty());
    assert!(megatron(1, 4).warnings(&model(4)).is_empty());
}

#[test]
fn a_layer_pattern_no_tensor_matches_is_warned_about() {
    let mut layout = megatron(2, 4);
    layout.stages.as_mut().unwrap().layer_pattern = r"blocks\.(\d+)\.".to_string();
    layout.stages.as_mut().unwrap().num_layers = None;
    let tensors = vec![
        TensorMeta::new("model.embed_tokens.weight", DType::F32, vec![64, 16]),
        TensorMeta::new("lm_head.weight", DType::F32, vec![64, 16]),
    ];
    layout.resolve(&tensors).unwrap();
    assert_eq!(
        layout.warnings(&tensors),
        [
            "no tensor of the checkpoint matches the layout's stages.layer_pattern \
          \"blocks\\\\.(\\\\d+)\\\\.\": every tensor goes by stages.first/last, so the pipeline \
          stages between hold nothing"
        ]
    );
}
