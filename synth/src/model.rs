//! Synthetic model definitions: a decoder-only transformer's tensors (Llama-style names and
//! shapes) for a few sizes, from a toy that makes resharding hit uneven boxes up to Llama 3 405B.

use std::fmt;
use std::str::FromStr;

use crate::error::SynthError;
use tessera_metadata::{DType, TensorMeta};

/// Element type of the model parameters.
pub const PARAM_DTYPE: DType = DType::Bf16;

/// Element type of the optimizer states (master weights and Adam moments).
pub const OPTIM_DTYPE: DType = DType::F32;

/// Optimizer states kept per parameter, in the order they are listed.
pub const OPTIM_STATES: [&str; 3] = ["master", "exp_avg", "exp_avg_sq"];

/// FQN of the training step counter (i64, 0-dim).
pub const TRAIN_STEP_FQN: &str = "train.step";

/// A synthetic model size.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Model {
    /// A toy with uneven sizes (ffn 98, vocab 1000) so that resharding meets uneven and empty
    /// boxes; the whole checkpoint with optimizer state is about 3.5 MB.
    GptTiny,
    /// About 125M parameters (GPT-2 small sizes, vocab 32000).
    GptSmall,
    /// Llama 3 8B sizes.
    Llama3_8b,
    /// Llama 3 70B sizes.
    Llama3_70b,
    /// Llama 3 405B sizes.
    Llama3_405b,
}

impl Model {
    /// Every model, smallest first.
    pub const ALL: [Model; 5] = [
        Model::GptTiny,
        Model::GptSmall,
        Model::Llama3_8b,
        Model::Llama3_70b,
        Model::Llama3_405b,
    ];

    /// The name used on the command line and in files: `gpt-tiny`, `llama3-8b`, ...
    pub fn name(self) -> &'static str {
        match self {
            Model::GptTiny => "gpt-tiny",
            Model::GptSmall => "gpt-small",
            Model::Llama3_8b => "llama3-8b",
            Model::Llama3_70b => "llama3-70b",
            Model::Llama3_405b => "llama3-405b",
        }
    }

    /// The model's sizes. Llama 3 sizes are those of the published configs.
    pub fn config(self) -> ModelConfig {
        match self {
            Model::GptTiny => ModelConfig {
                hidden: 64,
                num_heads: 4,
                num_kv_heads: 2,
                head_dim: 16,
                ffn: 98,
                vocab: 1000,
                num_layers: 4,
            },
            Model::GptSmall => ModelConfig {
                hidden: 768,
                num_heads: 12,
                num_kv_heads: 12,
                head_dim: 64,
                ffn: 3072,
                vocab: 32000,
                num_layers: 12,
            },
            Model::Llama3_8b => ModelConfig {
                hidden: 4096,
                num_heads: 32,
                num_kv_heads: 8,
                head_dim: 128,
                ffn: 14336,
                vocab: 128_256,
                num_layers: 32,
            },
            Model::Llama3_70b => ModelConfig {
                hidden: 8192,
                num_heads: 64,
                num_kv_heads: 8,
                head_dim: 128,
                ffn: 28672,
                vocab: 128_256,
                num_layers: 80,
            },
            Model::Llama3_405b => ModelConfig {
                hidden: 16384,
                num_heads: 128,
                num_kv_heads: 8,
                head_dim: 128,
                ffn: 53248,
                vocab: 128_256,
                num_layers: 126,
            },
        }
    }

    fn valid_names() -> String {
        Model::ALL.map(Model::name).join(", ")
    }
}

impl fmt::Display for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Model {
    type Err = SynthError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Model::ALL
            .into_iter()
            .find(|m| m.name() == s.trim())
            .ok_or_else(|| SynthError::UnknownModel {
                name: s.to_string(),
                valid: Model::valid_names(),
            })
    }
}

/// Sizes of a decoder-only transformer with grouped-query attention, a gated MLP (fused
/// gate+up projection `fc1` of `2 * ffn` rows) and untied input/output embeddings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ModelConfig {
    /// Model (residual stream) width.
    pub hidden: u64,
    /// Query heads.
    pub num_heads: u64,
    /// Key/value heads.
    pub num_kv_heads: u64,
    /// Width of one head.
    pub head_dim: u64,
    /// MLP intermediate width.
    pub ffn: u64,
    /// Vocabulary size.
    pub vocab: u64,
    /// Transformer layers.
    pub num_layers: u64,
}

impl ModelConfig {
    /// The parameters (FQN and shape) in model (state-dict) order, without dtype.
    pub fn param_shapes(&self) -> Vec<(String, Vec<u64>)> {
        let h = self.hidden;
        let qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim;
        let layer_count = usize::try_from(self.num_layers).unwrap_or(0);
        let mut out = Vec::with_capacity(3 + 6 * layer_count);
        out.push(("model.embed_tokens.weight".to_string(), vec![self.vocab, h]));
        for i in 0..self.num_layers {
            let p = format!("model.layers.{i}");
            out.push((format!("{p}.attn.qkv.weight"), vec![qkv_rows, h]));
            out.push((
                format!("{p}.attn.proj.weight"),
                vec![h, self.num_heads * self.head_dim],
            ));
            out.push((format!("{p}.mlp.fc1.weight"), vec![2 * self.ffn, h]));
            out.push((format!("{p}.mlp.fc2.weight"), vec![h, self.ffn]));
            out.push((format!("{p}.input_norm.weight"), vec![h]));
            out.push((format!("{p}.post_attn_norm.weight"), vec![h]));
        }
        out.push(("model.final_norm.weight".to_string(), vec![h]));
        out.push(("model.lm_head.weight".to_string(), vec![self.vocab, h]));
        out
    }

    /// Parameters of one transformer layer.
    pub fn layer_param_count(&self) -> u64 {
        let h = self.hidden;
        let qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim * h;
        let proj = h * self.num_heads * self.head_dim;
        let mlp = 3 * self.ffn * h;
        qkv + proj + mlp + 2 * h
    }

    /// Parameters of the whole model (embeddings and lm_head counted separately: untied).
    pub fn param_count(&self) -> u64 {
        2 * self.vocab * self.hidden + self.num_layers * self.layer_param_count() + self.hidden
    }

    /// Bytes of the parameters ([`PARAM_DTYPE`]).
    pub fn param_bytes(&self) -> u64 {
        self.param_count() * PARAM_DTYPE.size()
    }

    /// Bytes of the whole checkpoint [`tensors`] describes: parameters, the optimizer states when
    /// asked, and the step counter.
    pub fn checkpoint_bytes(&self, with_optimizer: bool) -> u64 {
        let optim = if with_optimizer {
            self.param_count() * OPTIM_DTYPE.size() * OPTIM_STATES.len() as u64
        } else {
            0
        };
        self.param_bytes() + optim + DType::I64.size()
    }
}

/// The tensors of a synthetic checkpoint of `config`: the parameters (bf16) in model order, then
/// when `with_optimizer`, for every parameter in the same order its f32
/// `optim.state.<fqn>.master`, `.exp_avg` and `.exp_avg_sq` of the same shape, and last
/// `train.step` (i64, 0-dim).
pub fn tensors(config: &ModelConfig, with_optimizer: bool) -> Vec<TensorMeta> {
    let params = config.param_shapes();
    let states = if with_optimizer {
        OPTIM_STATES.len()
    } else {
        0
    };
    let mut out = Vec::with_capacity(params.len() * (1 + states) + 1);
    for (fqn, shape) in &params {
        out.push(TensorMeta::new(fqn.clone(), PARAM_DTYPE, shape.clone()));
    }
    if with_optimizer {
        for (fqn, shape) in &params {
            for state in OPTIM_STATES {
                out.push(TensorMeta::new(
                    format!("optim.state.{fqn}.{state}"),
                    OPTIM_DTYPE,
                    shape.clone(),
                ));
            }
        }
    }
    out.push(TensorMeta::new(TRAIN_STEP_FQN, DType::I64, Vec::new()));
    out
}

/// Total bytes of `tensors`.
pub fn total_bytes(tensors: &[TensorMeta]) -> u64 {
    tensors.iter().map(TensorMeta::nbytes).sum()
}
