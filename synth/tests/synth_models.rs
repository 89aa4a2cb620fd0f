//! Synthetic model definitions: names, sizes, parameter counts and the exact tensor list.

#![allow(clippy::unwrap_used)]

use sha2::{Digest, Sha256};
use tessera_metadata::{DType, TensorMeta};
use tessera_synth::{Model, ModelConfig, SynthError, box_bytes, check_box, tensors, total_bytes};

#[test]
fn model_names_round_trip_and_unknown_names_list_the_valid_ones() {
    let names: Vec<String> = Model::ALL.iter().map(ToString::to_string).collect();
    assert_eq!(
        names,
        [
            "gpt-tiny",
            "gpt-small",
            "llama3-8b",
            "llama3-70b",
            "llama3-405b"
        ]
    );
    for model in Model::ALL {
        assert_eq!(model.to_string().parse::<Model>().unwrap(), model);
    }
    let err = "llama3-7b".parse::<Model>().unwrap_err();
    assert!(matches!(err, SynthError::UnknownModel { .. }));
    assert_eq!(
        err.to_string(),
        "unknown synthetic model \"llama3-7b\"; valid names: gpt-tiny, gpt-small, llama3-8b, \
         llama3-70b, llama3-405b"
    );
}

#[test]
fn llama3_configs_are_the_published_sizes() {
    let cfg = |hidden, num_heads, num_layers, ffn| ModelConfig {
        hidden,
        num_heads,
        num_kv_heads: 8,
        head_dim: 128,
        ffn,
        vocab: 128_256,
        num_layers,
    };
    assert_eq!(Model::Llama3_8b.config(), cfg(4096, 32, 32, 14336));
    assert_eq!(Model::Llama3_70b.config(), cfg(8192, 64, 80, 28672));
    assert_eq!(Model::Llama3_405b.config(), cfg(16384, 128, 126, 53248));
}

#[test]
fn param_counts_are_exact_and_match_the_published_totals() {
    // (model, exact count from the shapes, published total with untied embeddings)
    let cases = [
        (Model::Llama3_8b, 8_030_261_248u64, 8.03e9),
        (Model::Llama3_70b, 70_553_706_496, 70.6e9),
        (Model::Llama3_405b, 405_853_388_800, 405.9e9),
    ];
    for (model, exact, published) in cases {
        let cfg = model.config();
        assert_eq!(cfg.param_count(), exact, "{model}");
        let rel = (exact as f64 - published).abs() / published;
        assert!(rel < 0.01, "{model}: {exact} vs {published}");
        // The count equals the sum over the tensor list.
        let listed: u64 = tensors(&cfg, false)
            .iter()
            .filter(|t| t.dtype == DType::Bf16)
            .map(TensorMeta::numel)
            .sum();
        assert_eq!(listed, exact, "{model}");
        assert_eq!(cfg.param_bytes(), 2 * exact);
        assert_eq!(cfg.checkpoint_bytes(false), 2 * exact + 8);
        assert_eq!(cfg.checkpoint_bytes(true), 14 * exact + 8);
    }
    assert_eq!(Model::GptSmall.config().param_count(), 162_417_408);
    assert_eq!(Model::GptTiny.config().param_count(), 252_992);
}

#[test]
fn llama3_8b_tensor_list_has_the_documented_shapes() {
    let list = tensors(&Model::Llama3_8b.config(), true);
    assert_eq!(list.len(), (3 + 32 * 6) * 4 + 1);
    let find = |fqn: &str| list.iter().find(|t| t.fqn == fqn).unwrap().clone();
    assert_eq!(
        find("model.layers.31.attn.qkv.weight"),
        TensorMeta::new(
            "model.layers.31.attn.qkv.weight",
            DType::Bf16,
            vec![6144, 4096]
        )
    );
    assert_eq!(
        find("model.layers.0.mlp.fc1.weight").shape,
        vec![28672, 4096]
    );
    assert_eq!(
        find("model.layers.0.mlp.fc2.weight").shape,
        vec![4096, 14336]
    );
    assert_eq!(
        find("optim.state.model.lm_head.weight.exp_avg_sq"),
        TensorMeta::new(
            "optim.state.model.lm_head.weight.exp_avg_sq",
            DType::F32,
            vec![128_256, 4096]
        )
    );
    assert_eq!(
        total_bytes(&list),
        Model::Llama3_8b.config().checkpoint_bytes(true)
    );
}

/// The exact gpt-tiny list: parameters in model order, optimizer states per parameter, the step.
#[test]
fn gpt_tiny_tensor_list_is_exact() {
    let cfg = Model::GptTiny.config();
    let params = tensors(&cfg, false);
    let got: Vec<(String, DType, Vec<u64>)> = params
        .iter()
        .map(|t| (t.fqn.clone(), t.dtype, t.shape.clone()))
        .collect();
    let mut want = vec![(
        "model.embed_tokens.weight".to_string(),
        DType::Bf16,
        vec![1000, 64],
    )];
    for i in 0..4 {
        want.extend([
            (
                format!("model.layers.{i}.attn.qkv.weight"),
                DType::Bf16,
                vec![128, 64],
            ),
            (
                format!("model.layers.{i}.attn.proj.weight"),
                DType::Bf16,
                vec![64, 64],
            ),
            (
                format!("model.layers.{i}.mlp.fc1.weight"),
                DType::Bf16,
                vec![196, 64],
            ),
            (
                format!("model.layers.{i}.mlp.fc2.weight"),
                DType::Bf16,
                vec![64, 98],
            ),
            (
                format!("model.layers.{i}.input_norm.weight"),
                DType::Bf16,
                vec![64],
            ),
            (
                format!("model.layers.{i}.post_attn_norm.weight"),
                DType::Bf16,
                vec![64],
            ),
        ]);
    }
    want.push(("model.final_norm.weight".to_string(), DType::Bf16, vec![64]));
    want.push((
        "model.lm_head.weight".to_string(),
        DType::Bf16,
        vec![1000, 64],
    ));
    want.push(("train.step".to_string(), DType::I64, vec![]));
    assert_eq!(got, want);
    // Spot-check the literal names too (not only the generator above).
    assert_eq!(params[1].fqn, "model.layers.0.attn.qkv.weight");
    assert_eq!(params[6].fqn, "model.layers.0.post_attn_norm.weight");
    assert_eq!(params[24].fqn, "model.layers.3.post_attn_norm.weight");
    assert_eq!(params[26].fqn, "model.lm_head.weight");

    let full = tensors(&cfg, true);
    assert_eq!(full.len(), 27 * 4 + 1);
    assert_eq!(full[..27], params[..27]);
    let optim: Vec<&str> = full[27..33].iter().map(|t| t.fqn.as_str()).collect();
    assert_eq!(
        optim,
        [
            "optim.state.model.embed_tokens.weight.master",
            "optim.state.model.embed_tokens.weight.exp_avg",
            "optim.state.model.embed_tokens.weight.exp_avg_sq",
            "optim.state.model.layers.0.attn.qkv.weight.master",
            "optim.state.model.layers.0.attn.qkv.weight.exp_avg",
            "optim.state.model.layers.0.attn.qkv.weight.exp_avg_sq",
        ]
    );
    for (k, p) in params[..27].iter().enumerate() {
        for (s, state) in ["master", "exp_avg", "exp_avg_sq"].iter().enumerate() {
            let t = &full[27 + 3 * k + s];
            assert_eq!(t.fqn, format!("optim.state.{}.{state}", p.fqn));
            assert_eq!((t.dtype, &t.shape), (DType::F32, &p.shape));
        }
    }
    assert_eq!(
        full.last().unwrap(),
        &TensorMeta::new("train.step", DType::I64, vec![])
    );
    // Small enough for every test: 14 bytes per parameter plus the step.
    assert_eq!(total_bytes(&full), 3_541_896);
    assert_eq!(cfg.checkpoint_bytes(true), 3_541_896);
}

/// The whole gpt-tiny checkpoint's bytes (fqn then bytes of every tensor, in list order), pinned:
/// generating them is deterministic across runs and machines. Recorded from this implementation
/// (whose formula the fixture tests prove); it guards the list and the values against drift.
#[test]
fn gpt_tiny_checkpoint_bytes_are_pinned() {
    let mut hasher = Sha256::new();
    for t in tensors(&Model::GptTiny.config(), true) {
        let bytes = box_bytes(&t, &t.full_box()).unwrap();
        check_box(&t, &t.full_box(), &bytes).unwrap();
        hasher.update(t.fqn.as_bytes());
        hasher.update(&bytes);
    }
    let digest: String = hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        digest,
        "eb8346ff8cd469591f8f076ddccffc218036f30d19de8b47a0b87cb94d6b4e03"
    );
}
