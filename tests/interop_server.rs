//! Checkpoints other training stacks wrote, served by the plan server like tessera's own: the
//! catalog lists them with their format and writer, and `tessera load --server` (plan from the
//! server, bytes read in place) gives every rank the writer's own resharded result.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::path::{Path, PathBuf};

use serde_json::Value;
use support::reference::{
    check_reference, check_reference_listed, interop_fixtures, json, write_layout,
    write_layout_with_catch_all,
};
use support::served::Served;
use support::{ok, s};

/// A catalog root with the interop fixtures as runs: `megatron/{mcore-0.15,mcore-0.19}`,
/// DeepSpeed's save directory as run `deepspeed` (its `latest` names `global_step1`), and a
/// ByteCheckpoint save whole (`bytecheckpoint/fsdp-w2`) and its `model/` component on its own
/// (`bytecheckpoint/model-only`).
fn catalog_root(root: &Path) -> PathBuf {
    let fixtures = interop_fixtures();
    support::copy_dir_writable(
        &fixtures.join("megatron_core_0.15.3_tp2dp2_flat/ckpt"),
        &root.join("megatron/mcore-0.15"),
    );
    support::copy_dir_writable(
        &fixtures.join("megatron_core_0.19.2_tp2dp2/ckpt"),
        &root.join("megatron/mcore-0.19"),
    );
    support::copy_dir_writable(
        &fixtures.join("deepspeed_0.19.8_zero2_w2/ckpt"),
        &root.join("deepspeed"),
    );
    let bytecheckpoint = fixtures.join("bytecheckpoint_0.0.2_torch2.5.0_fsdp_w2/ckpt");
    support::copy_dir_writable(&bytecheckpoint, &root.join("bytecheckpoint/fsdp-w2"));
    support::copy_dir_writable(
        &bytecheckpoint.join("model"),
        &root.join("bytecheckpoint/model-only"),
    );
    root.to_path_buf()
}

fn entry<'a>(catalog: &'a Value, id: &str) -> &'a Value {
    catalog["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["id"] == id)
        .unwrap_or_else(|| panic!("{id} not listed: {catalog}"))
}

#[test]
fn the_catalog_lists_other_stacks_checkpoints_with_their_writer() {
    let tmp = tempfile::tempdir().unwrap();
    let root = catalog_root(&tmp.path().join("root"));
    let served = Served::start(&root);
    let catalog = served.get("/v1/checkpoints");
    for (id, format) in [
        ("megatron/mcore-0.15", "dcp"),
        ("megatron/mcore-0.19", "dcp"),
        ("deepspeed/global_step1", "deepspeed"),
        ("bytecheckpoint/fsdp-w2", "bytecheckpoint"),
        ("bytecheckpoint/model-only", "bytecheckpoint"),
    ] {
        let listed = entry(&catalog, id);
        assert_eq!(listed["format"], format, "{id}");
        assert_eq!(listed["committed"], true, "{id}");
    }
    assert_eq!(entry(&catalog, "deepspeed/global_step1")["latest"], true);
    assert_eq!(entry(&catalog, "deepspeed/global_step1")["step"], 1);
    let writer = |id: &str| {
        served.get(&format!("/v1/checkpoints/{id}"))["writer"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(
        writer("megatron/mcore-0.15")
            .starts_with("Megatron-Core torch_dist (version backend v1, MCoreMetadata"),
        "{}",
        writer("megatron/mcore-0.15")
    );
    assert!(
        writer("megatron/mcore-0.19").starts_with("Megatron-Core torch_dist (version backend v1"),
        "{}",
        writer("megatron/mcore-0.19")
    );
    assert_eq!(
        writer("deepspeed/global_step1"),
        "DeepSpeed ZeRO-2 (version 0.19.8)"
    );
    // The reformulated optimizer states are listed in Megatron's original shapes.
    let tensors = served.get("/v1/checkpoints/megatron/mcore-0.15/tensors?limit=1000");
    let fc1 = tensors["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["fqn"] == "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc1.weight")
        .unwrap();
    assert_eq!(fc1["shape"], serde_json::json!([2, 128, 64]));
}

#[test]
fn loads_planned_by_the_server_give_every_rank_the_writers_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let root = catalog_root(&tmp.path().join("root"));
    let served = Served::start(&root);
    let server = format!("http://{}", served.addr);
    let fixtures = interop_fixtures();
    let cases = [
        (
            "megatron/mcore-0.15",
            fixtures.join("megatron_core_0.15.3_tp2dp2_flat/reference_w2x2_s0s1.json"),
            true,
        ),
        (
            "megatron/mcore-0.19",
            fixtures.join("megatron_core_0.19.2_tp2dp2/reference_w3_shard0.json"),
            true,
        ),
        (
            "deepspeed/global_step1",
            fixtures.join("deepspeed_0.19.8_zero2_w2/reference_zero_to_fp32_out_w2x2_s0s1.json"),
            false,
        ),
        (
            "bytecheckpoint/model-only",
            fixtures.join("bytecheckpoint_0.0.2_torch2.5.0_fsdp_w2/reference_model_w3_shard0.json"),
            true,
        ),
    ];
    for (id, reference_path, exactly) in cases {
        let reference = json(&reference_path);
        let name = id.replace('/', "-");
        let layout_path = tmp.path().join(format!("{name}.layout.json"));
        let layout = if exactly {
            write_layout(&reference, &layout_path)
        } else {
            write_layout_with_catch_all(&reference, &layout_path)
        };
        let dump = tmp.path().join(format!("{name}.dump"));
        let report = ok([
            "load",
            s(&root.join(id)),
            "--layout",
            &layout,
            "--server",
            &server,
            "--dump",
            s(&dump),
        ])
        .text();
        assert!(report.contains("read amplification 1.00"), "{id}: {report}");
        if exactly {
            check_reference(&dump, &reference);
        } else {
            check_reference_listed(&dump, &reference);
        }
    }
}
