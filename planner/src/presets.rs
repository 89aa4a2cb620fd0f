//! Layout presets for common parallelisms, printed by `tessera layout <preset>`.

use crate::PlanError;
use crate::layout::{Layout, MeshDim, Rule, Stages};

/// FSDP / ZeRO-3 style: every tensor `shard(0)` over `dp` ranks (0-dim tensors replicated).
pub fn fsdp(dp: u32) -> Result<Layout, PlanError> {
    if dp == 0 {
        return Err(PlanError::Preset {
            preset: "fsdp",
            detail: "--dp must be at least 1".to_string(),
        });
    }
    let layout = Layout {
        mesh: vec![MeshDim {
            name: "dp".to_string(),
            size: dp,
        }],
        rules: vec![rule("*", &["shard(0)"])],
        stages: None,
    };
    // A preset nobody can plan is refused here, where the flag was given.
    layout.checked_world_size()?;
    Ok(layout)
}

/// Arguments of the Megatron GPT preset.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MegatronGpt {
    /// Tensor-parallel size.
    pub tp: u32,
    /// Pipeline-parallel size.
    pub pp: u32,
    /// Data-parallel size.
    pub dp: u32,
    /// Transformer layers (for balancing pipeline stages).
    pub num_layers: u64,
    /// Distributed optimizer: optimizer states additionally `shard(0)` over dp.
    pub zero1: bool,
}

/// Megatron-style GPT: mesh (pp, dp, tp); column-parallel qkv/fc1/embedding/lm_head `shard(0)`
/// over tp, row-parallel proj/fc2 `shard(1)`, norms and biases replicated; pipeline stages by
/// layer with the embedding first and the final norm and lm_head last. With `zero1` the optimizer
/// states are also `shard(0)` over dp (nested inside nothing: dp splits first, mesh order).
pub fn megatron_gpt(args: MegatronGpt) -> Result<Layout, PlanError> {
    for (name, value) in [("--tp", args.tp), ("--pp", args.pp), ("--dp", args.dp)] {
        if value == 0 {
            return Err(PlanError::Preset {
                preset: "megatron-gpt",
                detail: format!("{name} must be at least 1"),
            });
        }
    }
    if args.num_layers < u64::from(args.pp) {
        return Err(PlanError::Preset {
            preset: "megatron-gpt",
            detail: format!(
                "--num-layers {} is smaller than --pp {}: some stage would hold no layer",
                args.num_layers, args.pp
            ),
        });
    }
    let column = [
        "*attn.qkv.weight",
        "*mlp.fc1.weight",
        "*embed_tokens.weight",
        "*lm_head.weight",
    ];
    let row = ["*attn.proj.weight", "*mlp.fc2.weight"];
    let stage = "stage(layer)";
    let mut rules = Vec::new();
    if args.zero1 {
        for p in column {
            rules.push(rule(
                &format!("optim.state.{p}.*"),
                &[stage, "shard(0)", "shard(0)"],
            ));
        }
        for p in row {
            rules.push(rule(
                &format!("optim.state.{p}.*"),
                &[stage, "shard(0)", "shard(1)"],
            ));
        }
        rules.push(rule("optim.state.*", &[stage, "shard(0)", "replicate"]));
    }
    for p in column {
        rules.push(rule(&format!("{p}*"), &[stage, "replicate", "shard(0)"]));
    }
    for p in row {
        rules.push(rule(&format!("{p}*"), &[stage, "replicate", "shard(1)"]));
    }
    rules.push(rule("*", &[stage, "replicate", "replicate"]));
    let layout = Layout {
        mesh: vec![
            MeshDim {
                name: "pp".to_string(),
                size: args.pp,
            },
            MeshDim {
                name: "dp".to_string(),
                size: args.dp,
            },
            MeshDim {
                name: "tp".to_string(),
                size: args.tp,
            },
        ],
        rules,
        stages: Some(Stages {
            layer_pattern: r"layers\.(\d+)\.".to_string(),
            num_layers: Some(args.num_layers),
            first: vec!["*embed*".to_string()],
            last: vec!["*lm_head*".to_string(), "*final_norm*".to_string()],
        }),
    };
    layout.checked_world_size()?;
    Ok(layout)
}

fn rule(pattern: &str, placements: &[&str]) -> Rule {
    Rule {
        pattern: pattern.to_string(),
        placements: placements.iter().map(|p| (*p).to_string()).collect(),
    }
}
