//! End-to-end tests of the `tessera` binary, run as a real process in temporary directories:
//! layout presets, synthetic checkpoints checked byte for byte against the value formula,
//! inspect, plan (summaries, rank plans in JSON and Arrow, executed against the real data files),
//! verify with corrupted and truncated files, and the demo.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;

use serde_json::Value;
use support::{
    MEGATRON_TP2_PP2_DP2, assert_same_bytes, crc32c, execute_and_check, fails, layout_file, ok,
    open, run_in, s, swap_two_boxes, synth_tiny,
};
use tessera_metadata::{TensorBox, TensorMeta};
use tessera_planner::{Layout, MeshDim, PlanSummary, RankPlan, Rule, Target, assign_writers};
use tessera_synth::{self as synth, Model};

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// The checkpoint directory as the object-store prefix the product prints in messages.
/// How storage errors name a checkpoint: the store is rooted at its run directory, so by its
/// directory name (the command's context line gives the full path).
fn prefix_of(ckpt: &Path) -> String {
    ckpt.file_name().unwrap().to_str().unwrap().to_string()
}

fn rule(pattern: &str, placements: &[&str]) -> Rule {
    Rule {
        pattern: pattern.to_string(),
        placements: placements.iter().map(|p| (*p).to_string()).collect(),
    }
}

/// The box rank `rank` holds of `fqn` under `layout`, `None` when it holds none.
fn held_box(layout: &Layout, tensors: &[TensorMeta], rank: usize, fqn: &str) -> Option<TensorBox> {
    let t = tensors.iter().position(|t| t.fqn == fqn).unwrap() as u32;
    let holdings = layout.resolve(tensors).unwrap();
    let request = holdings.ranks[rank].iter().find(|q| q.tensor == t)?;
    match &request.target {
        Target::Box(region) => Some(region.clone()),
        Target::Flat { .. } => panic!("a layout resolves to boxes"),
    }
}

fn bx(offsets: &[u64], lengths: &[u64]) -> Option<TensorBox> {
    Some(TensorBox::new(offsets.to_vec(), lengths.to_vec()))
}

fn tiny_tensors() -> Vec<TensorMeta> {
    synth::tensors(&Model::GptTiny.config(), true)
}

// ---------------------------------------------------------------------------------------------
// tessera layout

#[test]
fn layout_fsdp_prints_preset_json_that_parses_back() {
    let run = ok(["layout", "fsdp", "--dp", "4"]);
    assert!(run.stderr.is_empty(), "stderr: {}", run.stderr);
    let text = run.text();
    assert!(text.ends_with("}\n"), "one JSON document and a newline");
    let layout = Layout::from_json(&text).unwrap();
    assert_eq!(
        layout.mesh,
        vec![MeshDim {
            name: "dp".to_string(),
            size: 4
        }]
    );
    assert_eq!(layout.rules, vec![rule("*", &["shard(0)"])]);
    assert_eq!(layout.stages, None);
    assert_eq!(layout.world_size(), 4);

    // shard(0) like torch.chunk: 1000 rows over 4 ranks, 250 each; 0-dim replicated everywhere.
    let tensors = tiny_tensors();
    for rank in 0..4u64 {
        assert_eq!(
            held_box(
                &layout,
                &tensors,
                rank as usize,
                "model.embed_tokens.weight"
            ),
            bx(&[250 * rank, 0], &[250, 64])
        );
        assert_eq!(
            held_box(&layout, &tensors, rank as usize, "train.step"),
            bx(&[], &[])
        );
    }
    // ffn 98: fc2.weight [64, 98] is split on dim 0 (64 rows, 16 each).
    assert_eq!(
        held_box(&layout, &tensors, 3, "model.layers.2.mlp.fc2.weight"),
        bx(&[48, 0], &[16, 98])
    );
}

#[test]
fn layout_megatron_gpt_zero1_has_the_mesh_rules_and_stages() {
    let mut args = vec!["layout"];
    args.extend_from_slice(MEGATRON_TP2_PP2_DP2);
    let run = ok(args);
    let layout = Layout::from_json(&run.text()).unwrap();
    let dims: Vec<(&str, u32)> = layout
        .mesh
        .iter()
        .map(|d| (d.name.as_str(), d.size))
        .collect();
    assert_eq!(dims, [("pp", 2), ("dp", 2), ("tp", 2)]);
    let stage = "stage(layer)";
    let col_optim = [stage, "shard(0)", "shard(0)"];
    let row_optim = [stage, "shard(0)", "shard(1)"];
    let col = [stage, "replicate", "shard(0)"];
    let row = [stage, "replicate", "shard(1)"];
    assert_eq!(
        layout.rules,
        vec![
            rule("optim.state.*attn.qkv.weight.*", &col_optim),
            rule("optim.state.*mlp.fc1.weight.*", &col_optim),
            rule("optim.state.*embed_tokens.weight.*", &col_optim),
            rule("optim.state.*lm_head.weight.*", &col_optim),
            rule("optim.state.*attn.proj.weight.*", &row_optim),
            rule("optim.state.*mlp.fc2.weight.*", &row_optim),
            rule("optim.state.*", &[stage, "shard(0)", "replicate"]),
            rule("*attn.qkv.weight*", &col),
            rule("*mlp.fc1.weight*", &col),
            rule("*embed_tokens.weight*", &col),
            rule("*lm_head.weight*", &col),
            rule("*attn.proj.weight*", &row),
            rule("*mlp.fc2.weight*", &row),
            rule("*", &[stage, "replicate", "replicate"]),
        ]
    );
    let stages = layout.stages.clone().unwrap();
    assert_eq!(stages.layer_pattern, r"layers\.(\d+)\.");
    assert_eq!(stages.num_layers, Some(4));
    assert_eq!(stages.first, ["*embed*"]);
    assert_eq!(stages.last, ["*lm_head*", "*final_norm*"]);

    // Rank = pp*4 + dp*2 + tp (row-major, last dim fastest).
    let tensors = tiny_tensors();
    let qkv0 = "model.layers.0.attn.qkv.weight"; // [128, 64], stage 0
    assert_eq!(held_box(&layout, &tensors, 0, qkv0), bx(&[0, 0], &[64, 64]));
    assert_eq!(
        held_box(&layout, &tensors, 3, qkv0),
        bx(&[64, 0], &[64, 64])
    );
    assert_eq!(held_box(&layout, &tensors, 4, qkv0), None);
    // Row-parallel: layer 3 is on stage 1; shard(1) over tp.
    assert_eq!(
        held_box(&layout, &tensors, 5, "model.layers.3.attn.proj.weight"),
        bx(&[0, 32], &[64, 32])
    );
    assert_eq!(
        held_box(&layout, &tensors, 1, "model.layers.3.attn.proj.weight"),
        None
    );
    // ZeRO-1: dp splits fc1's 196 rows first (98 each), tp splits that again (49 each).
    assert_eq!(
        held_box(
            &layout,
            &tensors,
            3,
            "optim.state.model.layers.0.mlp.fc1.weight.exp_avg"
        ),
        bx(&[147, 0], &[49, 64])
    );
    assert_eq!(
        held_box(
            &layout,
            &tensors,
            3,
            "optim.state.model.embed_tokens.weight.master"
        ),
        bx(&[750, 0], &[250, 64])
    );
    // Norm states: shard(0) over dp, replicated over tp, on layer 2's stage (1).
    let norm = "optim.state.model.layers.2.input_norm.weight.master";
    assert_eq!(held_box(&layout, &tensors, 6, norm), bx(&[32], &[32]));
    assert_eq!(held_box(&layout, &tensors, 7, norm), bx(&[32], &[32]));
    assert_eq!(held_box(&layout, &tensors, 2, norm), None);
    // The final norm lives on the last stage, whole.
    let final_norm = "model.final_norm.weight";
    assert_eq!(held_box(&layout, &tensors, 4, final_norm), bx(&[0], &[64]));
    assert_eq!(held_box(&layout, &tensors, 3, final_norm), None);
}

#[test]
fn layout_rejects_invalid_preset_arguments() {
    assert_eq!(
        fails(["layout", "fsdp", "--dp", "0"]),
        "error: preset fsdp: --dp must be at least 1\n"
    );
    assert_eq!(
        fails([
            "layout",
            "megatron-gpt",
            "--tp",
            "2",
            "--pp",
            "4",
            "--dp",
            "1",
            "--num-layers",
            "2"
        ]),
        "error: preset megatron-gpt: --num-layers 2 is smaller than --pp 4: some stage would hold no layer\n"
    );
    assert_eq!(
        fails([
            "layout",
            "megatron-gpt",
            "--tp",
            "0",
            "--pp",
            "1",
            "--dp",
            "1",
            "--num-layers",
            "2"
        ]),
        "error: preset megatron-gpt: --tp must be at least 1\n"
    );
    // A missing argument is clap's usage error: exit code 2.
    let run = run_in(None, ["layout", "fsdp"]);
    assert_eq!(run.code, Some(2));
    assert!(run.stdout.is_empty());
    assert!(run.stderr.contains("--dp <DP>"), "stderr: {}", run.stderr);
}

// ---------------------------------------------------------------------------------------------
// tessera synth

#[test]
fn synth_writes_a_committed_checkpoint_whose_bytes_follow_the_formula() {
    let dir = tempdir();
    let layout_path = layout_file(dir.path(), "save.json", MEGATRON_TP2_PP2_DP2);
    let ckpt = dir.path().join("run").join("step-000005");
    let run = ok([
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        s(&layout_path),
        "--out",
        s(&ckpt),
    ]);

    assert!(ckpt.join("manifest.json").is_file());
    assert_eq!(
        std::fs::read_to_string(dir.path().join("run").join("latest")).unwrap(),
        "step-000005"
    );
    let checkpoint = open(&ckpt);
    let manifest = &checkpoint.manifest;
    let meta = &checkpoint.meta;
    assert_eq!(manifest.step, Some(5), "step from the directory name");
    assert_eq!(manifest.files.len(), 8, "one data file per saving rank");
    assert_eq!(
        run.text(),
        format!(
            "wrote {} (gpt-tiny, with data): {} tensors, {} saved boxes, 8 files, {} of tensors, metadata {}\n",
            s(&ckpt),
            manifest.tensors,
            manifest.chunks,
            tessera::human::bytes(manifest.tensor_bytes),
            tessera::human::bytes(manifest.metadata.size)
        )
    );
    for rank in 0..8 {
        let name = format!("data/rank-{rank:05}.bin");
        assert_eq!(
            run.stderr.matches(&format!(" {name} in ")).count(),
            1,
            "progress line of rank {rank}: {}",
            run.stderr
        );
    }

    // The manifest's source layout is the save layout.
    let layout = Layout::from_json(&std::fs::read_to_string(&layout_path).unwrap()).unwrap();
    let source: Layout = serde_json::from_value(manifest.source_layout.clone().unwrap()).unwrap();
    assert_eq!(source, layout);

    // The tensors are the model's; every box saved once, by the writer assign_writers picks.
    let tensors = tiny_tensors();
    assert_eq!(meta.tensors(), tensors.as_slice());
    let writes = assign_writers(&tensors, &layout.resolve(&tensors).unwrap()).unwrap();
    let mut expected_chunks: BTreeSet<(String, u32, TensorBox)> = BTreeSet::new();
    for (rank, items) in writes.iter().enumerate() {
        for item in items {
            expected_chunks.insert((
                format!("data/rank-{rank:05}.bin"),
                item.tensor,
                item.region.clone(),
            ));
        }
    }
    let actual_chunks: BTreeSet<(String, u32, TensorBox)> = meta
        .chunks()
        .iter()
        .map(|c| {
            (
                meta.files()[c.bytes.file as usize].path.clone(),
                c.tensor,
                c.region.clone(),
            )
        })
        .collect();
    assert_eq!(actual_chunks.len(), meta.chunks().len(), "no box twice");
    assert_eq!(actual_chunks, expected_chunks);

    // Every saved chunk's bytes are the formula's bytes of its box, 4 KiB aligned, crc32c right.
    let mut files: HashMap<String, Vec<u8>> = HashMap::new();
    for f in &manifest.files {
        let data = std::fs::read(ckpt.join(&f.path)).unwrap();
        assert_eq!(data.len() as u64, f.size, "{} size", f.path);
        files.insert(f.path.clone(), data);
    }
    let mut covered = vec![0u64; tensors.len()];
    for chunk in meta.chunks() {
        let tensor = &meta.tensors()[chunk.tensor as usize];
        let file = &meta.files()[chunk.bytes.file as usize].path;
        let what = format!("{} {} in {file}", tensor.fqn, chunk.region);
        let expected = synth::box_bytes(tensor, &chunk.region).unwrap();
        assert_eq!(chunk.bytes.length, expected.len() as u64, "{what}: length");
        assert_eq!(chunk.bytes.strides, None, "{what}: row-major");
        covered[chunk.tensor as usize] += chunk.region.numel();
        if expected.is_empty() {
            continue;
        }
        assert_eq!(chunk.bytes.offset % 4096, 0, "{what}: aligned");
        let start = chunk.bytes.offset as usize;
        let stored = &files[file][start..start + expected.len()];
        assert_same_bytes(stored, &expected, &what);
        if let Some(crc) = chunk.crc32c {
            assert_eq!(crc, crc32c(stored), "{what}: crc32c");
        }
    }
    for (t, tensor) in tensors.iter().enumerate() {
        assert_eq!(covered[t], tensor.numel(), "{} is covered once", tensor.fqn);
    }
}

#[test]
fn synth_metadata_only_llama3_8b_writes_no_data() {
    let dir = tempdir();
    let layout_path = layout_file(
        dir.path(),
        "save.json",
        &[
            "megatron-gpt",
            "--tp",
            "8",
            "--pp",
            "4",
            "--dp",
            "2",
            "--num-layers",
            "32",
        ],
    );
    let ckpt = dir.path().join("llama").join("step-000010");
    let run = ok([
        "synth",
        "--model",
        "llama3-8b",
        "--layout",
        s(&layout_path),
        "--out",
        s(&ckpt),
        "--metadata-only",
    ]);
    assert!(
        run.text().contains("(llama3-8b, metadata only)"),
        "{}",
        run.text()
    );
    assert!(ckpt.join("manifest.json").is_file());
    assert!(ckpt.join("metadata.arrow").is_file());
    assert!(!ckpt.join("data").exists(), "no data directory");
    assert!(!ckpt.join("checksums.arrow").exists());

    let manifest: Value =
        serde_json::from_slice(&std::fs::read(ckpt.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["data"], "absent");
    assert_eq!(manifest["step"], 10);
    assert_eq!(manifest["checksums"], Value::Null);

    let layout = Layout::from_json(&std::fs::read_to_string(&layout_path).unwrap()).unwrap();
    let tensors = synth::tensors(&Model::Llama3_8b.config(), true);
    let writes = assign_writers(&tensors, &layout.resolve(&tensors).unwrap()).unwrap();
    let expected_chunks: usize = writes.iter().map(Vec::len).sum();
    assert_eq!(manifest["chunks"], expected_chunks as u64);
    assert_eq!(manifest["tensors"], tensors.len() as u64);
    assert_eq!(
        manifest["tensor_bytes"],
        Model::Llama3_8b.config().checkpoint_bytes(true)
    );

    let checkpoint = open(&ckpt);
    assert_eq!(checkpoint.meta.chunks().len(), expected_chunks);
    assert_eq!(checkpoint.meta.tensors(), tensors.as_slice());

    // Metadata only still plans, and verify says there is nothing to check.
    let fsdp = layout_file(dir.path(), "fsdp8.json", &["fsdp", "--dp", "8"]);
    let run = ok(["plan", s(&ckpt), "--layout", s(&fsdp), "--format", "json"]);
    let summary: PlanSummary = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(summary.ranks, 8);
    assert_eq!(summary.bytes_read, summary.unique_bytes_needed);
    assert_eq!(
        summary.unique_bytes_needed,
        Model::Llama3_8b.config().checkpoint_bytes(true)
    );
    assert_eq!(
        ok(["verify", s(&ckpt)]).text(),
        format!(
            "{}: metadata-only checkpoint; metadata and manifest checksums are fine, no data to check\n",
            s(&ckpt)
        )
    );
}

#[test]
fn synth_refuses_an_unknown_model_and_a_committed_directory() {
    let dir = tempdir();
    let layout = layout_file(dir.path(), "fsdp2.json", &["fsdp", "--dp", "2"]);
    let out = dir.path().join("step-000001");
    assert_eq!(
        fails([
            "synth",
            "--model",
            "gpt-huge",
            "--layout",
            s(&layout),
            "--out",
            s(&out)
        ]),
        "error: unknown synthetic model \"gpt-huge\"; valid names: gpt-tiny, gpt-small, llama3-8b, llama3-70b, llama3-405b\n"
    );
    assert!(!out.exists());

    let args = [
        "synth",
        "--model",
        "gpt-tiny",
        "--no-optimizer",
        "--step",
        "7",
        "--layout",
        s(&layout),
        "--out",
        s(&out),
    ];
    ok(args);
    let manifest_before = std::fs::read(out.join("manifest.json")).unwrap();
    let prefix = prefix_of(&out);
    assert_eq!(
        fails(args),
        format!(
            "error: starting checkpoint {}: {prefix} already holds a committed checkpoint ({prefix}/manifest.json exists): save to another step directory, or remove this one first\n",
            s(&out)
        )
    );
    assert_eq!(
        std::fs::read(out.join("manifest.json")).unwrap(),
        manifest_before
    );
    let checkpoint = open(&out);
    assert_eq!(checkpoint.manifest.step, Some(7));
    assert_eq!(
        checkpoint.meta.tensors(),
        synth::tensors(&Model::GptTiny.config(), false).as_slice()
    );
}

// ---------------------------------------------------------------------------------------------
// tessera inspect

#[test]
fn inspect_prints_the_summary_and_tensor_table() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let checkpoint = open(&ckpt);
    let manifest = &checkpoint.manifest;
    let text = ok(["inspect", s(&ckpt)]).text();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        format!(
            "checkpoint {}: tessera format v1, step 5, committed, data present",
            s(&ckpt)
        )
    );
    assert_eq!(
        lines[1],
        format!(
            "{} tensors, {} saved boxes, 0 objects, 8 data files, {} of tensors, metadata {}",
            manifest.tensors,
            manifest.chunks,
            tessera::human::bytes(manifest.tensor_bytes),
            tessera::human::bytes(manifest.metadata.size)
        )
    );
    assert_eq!(lines[2], "saved with mesh pp=2 dp=2 tp=2");
    assert_eq!(lines[3], "");
    let tensors = tiny_tensors();
    let width = tensors.iter().map(|t| t.fqn.len()).max().unwrap();
    assert_eq!(
        lines[4],
        format!(
            "{:width$}  {:6}  {:18}  {:>6}  {:>12}",
            "FQN", "DTYPE", "SHAPE", "BOXES", "BYTES"
        )
    );
    // Embedding: column-parallel over tp (2 boxes, the dp replicas written once), 125 KiB.
    let embed = format!(
        "{:width$}  {:6}  {:18}  {:>6}  {:>12}",
        "model.embed_tokens.weight", "bf16", "[1000, 64]", 2, "125.00 KiB"
    );
    assert_eq!(lines[5], embed);
    let step = format!(
        "{:width$}  {:6}  {:18}  {:>6}  {:>12}",
        "train.step", "i64", "[]", 1, "8 B"
    );
    assert_eq!(*lines.last().unwrap(), step);
    let rows = &lines[5..];
    assert_eq!(rows.len(), tensors.len());
    for (row, tensor) in rows.iter().zip(&tensors) {
        assert!(
            row.starts_with(&format!("{}  ", tensor.fqn)),
            "{row:?} is the row of {}",
            tensor.fqn
        );
    }
}

#[test]
fn inspect_json_lists_every_tensor_with_its_boxes() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let checkpoint = open(&ckpt);
    let meta = &checkpoint.meta;
    let run = ok(["inspect", s(&ckpt), "--json"]);
    let doc: Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(doc["location"], s(&ckpt));
    assert_eq!(
        doc["manifest"],
        serde_json::to_value(&checkpoint.manifest).unwrap()
    );
    let tensors = doc["tensors"].as_array().unwrap();
    assert_eq!(tensors.len(), meta.tensors().len());
    for (t, (json, tensor)) in tensors.iter().zip(meta.tensors()).enumerate() {
        assert_eq!(json["fqn"], tensor.fqn.as_str());
        assert_eq!(json["dtype"], serde_json::to_value(tensor.dtype).unwrap());
        assert_eq!(json["shape"], serde_json::to_value(&tensor.shape).unwrap());
        assert_eq!(json["bytes"], tensor.nbytes());
        let boxes = json["boxes"].as_array().unwrap();
        let chunks = meta.chunks_of(t as u32);
        assert!(!boxes.is_empty(), "{} has boxes", tensor.fqn);
        assert_eq!(boxes.len(), chunks.len(), "{}", tensor.fqn);
        let mut numel = 0;
        for (b, c) in boxes.iter().zip(chunks) {
            let offsets: Vec<u64> = serde_json::from_value(b["offsets"].clone()).unwrap();
            let lengths: Vec<u64> = serde_json::from_value(b["lengths"].clone()).unwrap();
            assert_eq!(offsets.as_slice(), &c.region.offsets[..]);
            assert_eq!(lengths.as_slice(), &c.region.lengths[..]);
            assert_eq!(b["file"], meta.files()[c.bytes.file as usize].path.as_str());
            assert_eq!(b["byte_offset"], c.bytes.offset);
            assert_eq!(b["byte_length"], c.bytes.length);
            assert_eq!(b["crc32c"], serde_json::to_value(c.crc32c).unwrap());
            numel += lengths.iter().product::<u64>();
        }
        assert_eq!(numel, tensor.numel(), "{}: boxes cover it", tensor.fqn);
    }
    let embed = &tensors[0];
    assert_eq!(embed["fqn"], "model.embed_tokens.weight");
    assert_eq!(embed["dtype"], "bf16");
    assert_eq!(embed["shape"], serde_json::json!([1000, 64]));
}

// ---------------------------------------------------------------------------------------------
// tessera plan

#[test]
fn plan_summary_for_fsdp_dp3_reads_each_byte_once() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let tensor_bytes = open(&ckpt).manifest.tensor_bytes;
    let layout = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);

    let text = ok(["plan", s(&ckpt), "--layout", s(&layout)]).text();
    assert!(text.starts_with("ranks                3\n"), "{text}");
    assert!(text.contains("\nread amplification   1.00\n"), "{text}");
    assert!(
        text.contains("\nexchange groups      1 (at most 2 ring rounds)\n"),
        "{text}"
    );
    assert!(text.contains("\nbytes exchanged      16 B\n"), "{text}");

    let run = ok(["plan", s(&ckpt), "--layout", s(&layout), "--format", "json"]);
    let summary: PlanSummary = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(summary.ranks, 3);
    assert_eq!(summary.bytes_read, summary.unique_bytes_needed);
    assert_eq!(summary.unique_bytes_needed, tensor_bytes);
    // Everything shard(0) once, except train.step (8 bytes) that all three ranks hold.
    assert_eq!(summary.bytes_needed, tensor_bytes + 2 * 8);
    assert_eq!(summary.bytes_exchanged, 2 * 8);
    assert_eq!(summary.exchange_groups, 1);
    assert_eq!(summary.max_rounds, 2);
    assert_eq!(summary.read_amplification, 1.0);
}

#[test]
fn plan_rank_plan_json_and_arrow_agree() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let layout = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);
    let base = ["plan", s(&ckpt), "--layout", s(&layout), "--rank", "1"];

    let json = ok(base.iter().copied().chain(["--format", "json"]));
    assert!(json.stderr.is_empty(), "{}", json.stderr);
    let plan = RankPlan::from_json(&json.text()).unwrap();
    assert_eq!(plan.rank, 1);
    assert_eq!(plan.world, 3);
    assert!(!plan.pieces.is_empty());
    // Text is for people (tests/messages.rs checks it); JSON is the plan to execute.
    assert!(ok(base).text().starts_with("rank 1 of 3\n"));

    let arrow = ok(base
        .iter()
        .copied()
        .chain(["--format", "arrow", "--summary"]));
    assert_eq!(RankPlan::from_arrow_ipc(&arrow.stdout).unwrap(), plan);
    assert!(
        arrow.stderr.starts_with("ranks                3\n")
            && arrow.stderr.contains("\nread amplification   1.00\n"),
        "summary on stderr: {}",
        arrow.stderr
    );

    // Rank 1 of 3 needs rows 334..668 of the embedding: one destination, row-major.
    let embed = plan
        .destinations
        .iter()
        .find(|d| plan.tensors[d.tensor as usize].fqn == "model.embed_tokens.weight")
        .unwrap();
    assert_eq!(
        embed.target,
        Target::Box(TensorBox::new(vec![334, 0], vec![334, 64]))
    );
    assert_eq!(embed.bytes, 334 * 64 * 2);
}

fn rank_plans(ckpt: &Path, source: &[&str], world: u32) -> Vec<RankPlan> {
    (0..world)
        .map(|rank| {
            let rank = rank.to_string();
            let mut args = vec!["plan", s(ckpt)];
            args.extend_from_slice(source);
            args.extend_from_slice(&["--rank", &rank, "--format", "json"]);
            RankPlan::from_json(&ok(args).text()).unwrap()
        })
        .collect()
}

fn summary(ckpt: &Path, source: &[&str]) -> PlanSummary {
    let mut args = vec!["plan", s(ckpt)];
    args.extend_from_slice(source);
    args.extend_from_slice(&["--format", "json"]);
    serde_json::from_slice(&ok(args).stdout).unwrap()
}

#[test]
fn plan_fsdp_dp3_rank_plans_rebuild_every_shard_from_the_files() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let layout = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);
    let source = ["--layout", s(&layout)];
    let plans = rank_plans(&ckpt, &source, 3);
    let read = execute_and_check(&ckpt, &plans);
    let summary = summary(&ckpt, &source);
    assert_eq!(read.iter().sum::<u64>(), summary.bytes_read);
    assert_eq!(*read.iter().max().unwrap(), summary.max_read_per_rank);
    // Every rank has a destination for every tensor (possibly empty for the uneven tail).
    for plan in &plans {
        assert_eq!(plan.destinations.len(), tiny_tensors().len());
    }
}

#[test]
fn executing_rank_plans_against_a_corrupted_file_is_caught() {
    // The harness itself must notice wrong bytes: flip one byte inside a saved box.
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let layout = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);
    let plans = rank_plans(&ckpt, &["--layout", s(&layout)], 3);
    let meta = open(&ckpt).meta;
    let chunk = meta.chunks().iter().find(|c| c.bytes.length > 100).unwrap();
    let path = ckpt.join(&meta.files()[chunk.bytes.file as usize].path);
    let mut data = std::fs::read(&path).unwrap();
    data[(chunk.bytes.offset + 99) as usize] ^= 1;
    std::fs::write(&path, &data).unwrap();
    let outcome = std::panic::catch_unwind(|| execute_and_check(&ckpt, &plans));
    let message = outcome.unwrap_err();
    let message = message.downcast_ref::<String>().unwrap();
    assert!(message.contains("first difference at byte"), "{message}");
}

#[test]
fn plan_megatron_tp4_dp2_zero1_rank_plans_rebuild_every_shard_from_the_files() {
    // Resharding tp2 pp2 → tp4 pp1: dp replicas share pieces, so the ring exchange carries them.
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let layout = layout_file(
        dir.path(),
        "tp4.json",
        &[
            "megatron-gpt",
            "--tp",
            "4",
            "--pp",
            "1",
            "--dp",
            "2",
            "--num-layers",
            "4",
            "--zero1",
        ],
    );
    let source = ["--layout", s(&layout)];
    let summary = summary(&ckpt, &source);
    assert_eq!(summary.ranks, 8);
    assert_eq!(summary.bytes_read, summary.unique_bytes_needed);
    assert!(summary.bytes_exchanged > 0);
    let plans = rank_plans(&ckpt, &source, 8);
    let read = execute_and_check(&ckpt, &plans);
    assert_eq!(read.iter().sum::<u64>(), summary.bytes_read);
}

#[test]
fn plan_explicit_requests_with_flat_ranges_rebuild_from_the_files() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let requests = dir.path().join("requests.json");
    // Flat ranges crossing the saved tp boxes of the embedding (rows 0..500 | 500..1000 are
    // elements 0..32000 | 32000..64000), overlapping between ranks 0 and 1, plus overlapping
    // boxes of a row-parallel weight between ranks 1 and 2.
    std::fs::write(
        &requests,
        r#"{"ranks": [
            [{"fqn": "model.embed_tokens.weight", "flat": [100, 40000]},
             {"fqn": "train.step", "offsets": [], "lengths": []}],
            [{"fqn": "model.embed_tokens.weight", "flat": [30000, 64000]},
             {"fqn": "model.layers.1.mlp.fc2.weight", "offsets": [3, 5], "lengths": [50, 90]}],
            [{"fqn": "optim.state.model.layers.2.attn.qkv.weight.exp_avg", "flat": [1000, 7001]},
             {"fqn": "model.layers.1.mlp.fc2.weight", "offsets": [0, 0], "lengths": [64, 98]},
             {"fqn": "model.final_norm.weight", "offsets": [64], "lengths": [0]},
             {"fqn": "model.embed_tokens.weight", "flat": [5, 5]}]
        ]}"#,
    )
    .unwrap();
    let source = ["--requests", s(&requests)];
    let summary = summary(&ckpt, &source);
    assert_eq!(summary.ranks, 3);
    assert_eq!(summary.destinations, 8);
    let unique = 63_900 * 2 + 8 + 64 * 98 * 2 + 6001 * 4;
    assert_eq!(summary.unique_bytes_needed, unique);
    assert_eq!(summary.bytes_read, unique);
    assert_eq!(
        summary.bytes_needed,
        (39_900 + 34_000) * 2 + 8 + 50 * 90 * 2 + 6001 * 4 + 64 * 98 * 2
    );
    assert_eq!(summary.bytes_exchanged, 10_000 * 2 + 50 * 90 * 2);
    let plans = rank_plans(&ckpt, &source, 3);
    assert!(matches!(
        plans[0].destinations[0].target,
        Target::Flat {
            start: 100,
            end: 40000
        }
    ));
    // Empty requests get empty destination buffers.
    let empty: Vec<u64> = plans[2].destinations[2..].iter().map(|d| d.bytes).collect();
    assert_eq!(empty, [0, 0]);
    execute_and_check(&ckpt, &plans);

    // Without dedup every rank reads all it needs itself, and the result is the same.
    let no_dedup = ["--requests", s(&requests), "--no-dedup"];
    let summary = self::summary(&ckpt, &no_dedup);
    assert_eq!(summary.bytes_read, summary.bytes_needed);
    assert_eq!(summary.bytes_exchanged, 0);
    let plans = rank_plans(&ckpt, &no_dedup, 3);
    let read = execute_and_check(&ckpt, &plans);
    for (plan, read) in plans.iter().zip(read) {
        assert!(plan.exchanges.iter().all(|e| e.rounds.is_empty()));
        assert_eq!(read, plan.summary.bytes_needed, "rank {}", plan.rank);
    }
}

#[test]
fn plan_reports_bad_arguments_and_inputs() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let c = s(&ckpt);
    let fsdp3 = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);
    let l = s(&fsdp3);

    assert_eq!(
        fails(["plan", c, "--layout", l, "--rank", "99"]),
        "error: rank 99 is out of range for a world of 3 ranks\n"
    );
    assert_eq!(
        fails(["plan", c, "--layout", l, "--format", "arrow"]),
        "error: --format arrow needs --rank (Arrow IPC holds one rank's plan)\n"
    );

    let malformed = dir.path().join("malformed.json");
    std::fs::write(
        &malformed,
        r#"{"mesh": [{"name": "dp", "size": 3}], "rules": ["#,
    )
    .unwrap();
    let err = fails(["plan", c, "--layout", s(&malformed)]);
    assert!(
        err.starts_with(&format!(
            "error: reading layout {}: invalid layout JSON: ",
            s(&malformed)
        )),
        "{err}"
    );

    let partial = dir.path().join("partial.json");
    std::fs::write(
        &partial,
        r#"{"mesh": [{"name": "dp", "size": 3}],
            "rules": [{"match": "model.*", "placements": ["shard(0)"]}]}"#,
    )
    .unwrap();
    assert_eq!(
        fails(["plan", c, "--layout", s(&partial)]),
        format!(
            "error: resolving layout {} against {c}: tensor optim.state.model.embed_tokens.weight.master matches no rule of the layout (add a rule, e.g. {{\"match\": \"*\", ...}})\n",
            s(&partial)
        )
    );

    let requests = dir.path().join("requests.json");
    std::fs::write(
        &requests,
        r#"{"ranks": [[{"fqn": "model.embed_tokens.weight", "flat": [0, 64001]}]]}"#,
    )
    .unwrap();
    assert_eq!(
        fails(["plan", c, "--requests", s(&requests)]),
        format!(
            "error: reading requests {}: rank 0: flat range [0, 64001) of tensor model.embed_tokens.weight is outside [0, 64000]\n",
            s(&requests)
        )
    );
    // clap's argument group: one of the two, never both, never neither.
    let usage_error = |args: &[&str]| {
        let run = run_in(None, args);
        assert_eq!(run.code, Some(2), "usage errors exit 2: {}", run.stderr);
        run.stderr
    };
    let both = usage_error(&["plan", c, "--layout", l, "--requests", s(&requests)]);
    assert!(
        both.starts_with(
            "error: the argument '--layout <LAYOUT>' cannot be used with '--requests <REQUESTS>'"
        ),
        "{both}"
    );
    let neither = usage_error(&["plan", c]);
    assert!(
        neither.starts_with("error: the following required arguments were not provided:\n  <--layout <LAYOUT>|--requests <REQUESTS>>"),
        "{neither}"
    );
}

/// A 2^20-rank mesh over gpt-tiny would take about 27 GiB to plan: `tessera plan` refuses it
/// from the planner's estimate, with the server's check and bound (its 422 `plan_too_large`),
/// at once and with the exit code of bad input, naming the estimate, the bound and the flag that
/// raises it. Before, it aborted on allocation (SIGABRT) after seconds of swapping.
#[cfg(unix)]
#[test]
fn plan_refuses_a_mesh_whose_plan_would_not_fit_from_its_estimate() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let huge = layout_file(dir.path(), "huge.json", &["fsdp", "--dp", "1048576"]);
    // Under a 4 GiB address-space limit, so that a regression aborts on allocation instead of
    // taking the machine's memory.
    let started = std::time::Instant::now();
    let output = std::process::Command::new("sh")
        .args(["-c", "ulimit -v 4194304 && exec \"$0\" \"$@\""])
        .args([support::BIN, "plan", s(&ckpt), "--layout", s(&huge)])
        .output()
        .unwrap();
    let elapsed = started.elapsed();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.starts_with(&format!(
            "error: refusing to plan {} for layout {} (raise the bound with --plan-memory-mib if this machine has the memory): planning this would take about ",
            s(&ckpt),
            s(&huge)
        )),
        "{stderr}"
    );
    assert!(stderr.contains(" GiB) for 1048576 ranks, "), "{stderr}");
    assert!(
        stderr.ends_with(&format!(
            ", over the bound of {} bytes for one plan computation\n",
            tessera_server::DEFAULT_PLAN_MEMORY_BYTES
        )),
        "{stderr}"
    );
    assert!(
        elapsed < std::time::Duration::from_secs(5),
        "refused after {elapsed:?}"
    );
    // The flag sets the bound: a small plan passes the default and is refused under 1 MiB, also
    // for explicit requests.
    let fsdp2 = layout_file(dir.path(), "fsdp2.json", &["fsdp", "--dp", "2"]);
    ok(["plan", s(&ckpt), "--layout", s(&fsdp2)]);
    let err = fails([
        "plan",
        s(&ckpt),
        "--layout",
        s(&fsdp2),
        "--plan-memory-mib",
        "1",
    ]);
    assert!(
        err.contains("for 2 ranks, ") && err.contains("over the bound of 1048576 bytes"),
        "{err}"
    );
    let requests = dir.path().join("requests.json");
    std::fs::write(
        &requests,
        r#"{"ranks": [[{"fqn": "model.final_norm.weight", "flat": [0, 40]}]]}"#,
    )
    .unwrap();
    let err = fails([
        "plan",
        s(&ckpt),
        "--requests",
        s(&requests),
        "--plan-memory-mib",
        "1",
    ]);
    assert!(
        err.starts_with(&format!(
            "error: refusing to plan {} for requests {}",
            s(&ckpt),
            s(&requests)
        )),
        "{err}"
    );
}

#[test]
fn a_directory_without_manifest_is_not_a_checkpoint() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let layout = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);
    std::fs::remove_file(ckpt.join("manifest.json")).unwrap();
    let missing = format!(
        "{}: no manifest.json, so this is not a committed checkpoint (an incomplete save?)",
        prefix_of(&ckpt)
    );
    assert_eq!(
        fails(["plan", s(&ckpt), "--layout", s(&layout)]),
        format!("error: opening checkpoint {}: {missing}\n", s(&ckpt))
    );
    assert_eq!(
        fails(["inspect", s(&ckpt)]),
        format!("error: opening checkpoint {}: {missing}\n", s(&ckpt))
    );
    let err = fails(["verify", s(&ckpt)]);
    assert!(err.contains(&missing), "{err}");
}

// ---------------------------------------------------------------------------------------------
// tessera verify

#[test]
fn verify_passes_a_fresh_checkpoint() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let manifest = open(&ckpt).manifest;
    let total: u64 = manifest.files.iter().map(|f| f.size).sum();
    // file:// URLs work too.
    for location in [s(&ckpt).to_string(), format!("file://{}", s(&ckpt))] {
        assert_eq!(
            ok(["verify", &location]).text(),
            format!(
                "{location}: ok, 8 files, {} checked\n",
                tessera::human::bytes(total)
            )
        );
    }
}

#[test]
fn verify_names_the_block_holding_a_flipped_byte() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let manifest = open(&ckpt).manifest;
    let block = manifest.block_size;
    assert_eq!(block, 64 * 1024);
    let file = manifest.files.iter().max_by_key(|f| f.size).unwrap();
    assert!(file.size > 2 * block, "{} is several blocks", file.path);
    let path = ckpt.join(&file.path);
    let mut data = std::fs::read(&path).unwrap();
    let pos = data.len() / 2 + 123;
    let a = pos as u64 / block * block;
    let b = (a + block).min(file.size);
    let expected = crc32c(&data[a as usize..b as usize]);
    data[pos] ^= 0x10;
    let found = crc32c(&data[a as usize..b as usize]);
    std::fs::write(&path, &data).unwrap();
    // The box holding the byte no longer matches its own crc either.
    let opened = open(&ckpt);
    let meta = &opened.meta;
    let file_index = meta
        .files()
        .iter()
        .position(|f| f.path == file.path)
        .unwrap() as u32;
    let chunk = meta
        .chunks()
        .iter()
        .find(|c| {
            c.bytes.file == file_index
                && (c.bytes.offset..c.bytes.offset + c.bytes.length).contains(&(pos as u64))
        })
        .expect("the flipped byte lies in a box");
    let (start, end) = (chunk.bytes.offset, chunk.bytes.offset + chunk.bytes.length);

    assert_eq!(
        support::fails_verifying(["verify", s(&ckpt)]),
        format!(
            "error: bad block in {} bytes {a}..{b}: expected crc32c {expected:08x}, found {found:08x}\n\
             bad box: checksum mismatch in {} bytes {start}..{end} (tensor {} box {}): its metadata records crc32c {:08x}, the bytes have {:08x}\n\
             {}: verification failed\n",
            file.path,
            file.path,
            meta.tensors()[chunk.tensor as usize].fqn,
            chunk.region,
            chunk.crc32c.unwrap(),
            crc32c(&data[start as usize..end as usize]),
            s(&ckpt)
        )
    );
}

#[test]
fn verify_and_load_refuse_boxes_pointing_at_each_others_bytes() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let moved = swap_two_boxes(&ckpt);
    // The metadata is self-consistent: inspect opens it.
    ok(["inspect", s(&ckpt)]);
    let err = support::fails_verifying(["verify", s(&ckpt)]);
    for (fqn, region, file, start, end) in &moved {
        let data = std::fs::read(ckpt.join(file)).unwrap();
        let actual = crc32c(&data[*start as usize..*end as usize]);
        let line = format!(
            "bad box: checksum mismatch in {file} bytes {start}..{end} (tensor {fqn} box {region}): its metadata records crc32c "
        );
        let found = err.lines().find(|l| l.contains(&line[..line.len() - 1]));
        let found = found.unwrap_or_else(|| panic!("no line {line:?} in {err}"));
        assert!(
            found.ends_with(&format!(", the bytes have {actual:08x}")),
            "{found}"
        );
    }
    assert!(
        err.ends_with(&format!("{}: verification failed\n", s(&ckpt))),
        "{err}"
    );
    assert!(!err.contains("bad block"), "{err}");

    // Loading the whole model reads every box whole: the load fails naming a box.
    let layout = layout_file(dir.path(), "one.json", &["fsdp", "--dp", "1"]);
    let err = support::fails_verifying(["load", s(&ckpt), "--layout", s(&layout)]);
    assert!(
        moved.iter().any(|(fqn, region, file, start, end)| err.contains(&format!(
            "checksum mismatch in {}/{file} bytes {start}..{end} (tensor {fqn} box {region}): its metadata records crc32c",
            prefix_of(&ckpt)
        ))),
        "{err}"
    );
}

#[test]
fn verify_reports_truncated_and_missing_files() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let manifest = open(&ckpt).manifest;
    let block = manifest.block_size;
    let mut by_size = manifest.files.clone();
    by_size.sort_by_key(|f| std::cmp::Reverse(f.size));
    let (truncated, missing) = (&by_size[0], &by_size[1]);

    // Cut the file in the middle of a block: that block's checksum no longer matches.
    let path = ckpt.join(&truncated.path);
    let data = std::fs::read(&path).unwrap();
    let a = truncated.size / 2 / block * block;
    let new_len = a + 1000;
    let expected = crc32c(&data[a as usize..(a + block).min(truncated.size) as usize]);
    let found = crc32c(&data[a as usize..new_len as usize]);
    std::fs::write(&path, &data[..new_len as usize]).unwrap();
    std::fs::remove_file(ckpt.join(&missing.path)).unwrap();

    let err = support::fails_verifying(["verify", s(&ckpt)]);
    assert_eq!(
        err,
        format!(
            "error: missing file {m}\n\
             {t}: size {new_len} but the manifest says {size}\n\
             bad block in {t} bytes {a}..{new_len}: expected crc32c {expected:08x}, found {found:08x}\n\
             {c}: verification failed\n",
            m = missing.path,
            t = truncated.path,
            size = truncated.size,
            c = s(&ckpt)
        )
    );
}

#[test]
fn verify_reports_appended_bytes_as_a_size_mismatch_only() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let file = open(&ckpt).manifest.files[0].clone();
    let path = ckpt.join(&file.path);
    let mut data = std::fs::read(&path).unwrap();
    data.extend_from_slice(b"xyz");
    std::fs::write(&path, &data).unwrap();
    // The recorded bytes are intact: only the size is wrong, no block is reported corrupt.
    assert_eq!(
        support::fails_verifying(["verify", s(&ckpt)]),
        format!(
            "error: {t}: size {actual} but the manifest says {size}\n{c}: verification failed\n",
            t = file.path,
            actual = file.size + 3,
            size = file.size,
            c = s(&ckpt)
        )
    );
}

// ---------------------------------------------------------------------------------------------
// tessera demo

#[test]
fn demo_creates_a_catalog_reshards_it_and_reuses_it() {
    let dir = tempdir();
    let run = run_in(Some(dir.path()), ["demo", "--dir", "catalog", "--no-serve"]);
    assert_eq!(run.code, Some(0), "stderr: {}", run.stderr);
    let text = run.text();
    let ckpt = "catalog/gpt-tiny/step-000100";
    assert!(
        text.starts_with(&format!(
            "created {ckpt} (gpt-tiny with optimizer states, saved megatron tp2 pp2)\n\
             created catalog/gpt-tiny/step-000200 (gpt-tiny with optimizer states, saved megatron tp2 pp2)\n\
             created catalog/gpt-tiny-fsdp/step-000100 (gpt-tiny with optimizer states, saved fsdp dp2)\n\
             created catalog/gpt-tiny-fsdp/step-000200 (gpt-tiny with optimizer states, saved fsdp dp2)\n\
             created catalog/gpt-small/step-001000 (gpt-small without optimizer states, saved fsdp dp4)\n"
        )),
        "{text}"
    );
    let sections: Vec<&str> = text.split("\nreshard to ").skip(1).collect();
    let names: Vec<&str> = sections
        .iter()
        .map(|s| s.split_once(":\n").unwrap().0)
        .collect();
    assert_eq!(
        names,
        [
            "fsdp dp4",
            "megatron tp1 pp1 dp2",
            "megatron tp4 pp1 dp2 zero1"
        ]
    );
    for section in &sections {
        assert!(
            section.contains("\nread amplification   1.00\n"),
            "{section}"
        );
    }
    assert!(text.contains(&format!("\nnext: tessera inspect {ckpt}\n")));

    let abs = dir.path().join(ckpt);
    assert!(abs.join("manifest.json").is_file());
    // The latest pointers follow the last step written.
    for (run, latest) in [
        ("gpt-tiny", "step-000200"),
        ("gpt-tiny-fsdp", "step-000200"),
        ("gpt-small", "step-001000"),
    ] {
        assert_eq!(
            std::fs::read_to_string(dir.path().join("catalog").join(run).join("latest")).unwrap(),
            latest
        );
    }
    for other in [
        "gpt-tiny/step-000200",
        "gpt-tiny-fsdp/step-000100",
        "gpt-small/step-001000",
    ] {
        ok(["verify", s(&dir.path().join("catalog").join(other))]);
    }
    let small = open(&dir.path().join("catalog/gpt-small/step-001000"));
    assert_eq!(small.manifest.step, Some(1000));
    assert!(
        small
            .meta
            .tensors()
            .iter()
            .all(|t| !t.fqn.starts_with("optim.")),
        "gpt-small is saved without optimizer states"
    );
    let small_bytes: u64 = small.meta.tensors().iter().map(|t| t.nbytes()).sum();
    assert!(
        (250 << 20..400 << 20).contains(&small_bytes),
        "{small_bytes}"
    );
    let checkpoint = open(&abs);
    assert_eq!(checkpoint.manifest.step, Some(100));
    assert_eq!(checkpoint.meta.tensors(), tiny_tensors().as_slice());
    ok(["verify", s(&abs)]);

    let again = run_in(
        Some(dir.path()),
        ["demo", "--dir", "catalog/", "--no-serve"],
    );
    assert_eq!(again.code, Some(0), "stderr: {}", again.stderr);
    let again = again.text();
    assert!(again.starts_with(&format!("using {ckpt}\n")), "{again}");
    assert_eq!(again.matches("\nusing ").count(), 4, "{again}");
    assert!(!again.contains("created "), "{again}");
    assert_eq!(again.matches("read amplification   1.00\n").count(), 3);
}

/// Writes a one-file safetensors checkpoint `<dir>/<name>/model.safetensors` holding `tensors`
/// (f32, each element its flat index within the file) and returns the checkpoint directory.
fn safetensors_checkpoint(
    dir: &Path,
    name: &str,
    tensors: &[(String, Vec<u64>)],
) -> std::path::PathBuf {
    use tessera_metadata::DType;
    use tessera_metadata::formats::safetensors::{TensorView, serialize};
    let data: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, shape)| {
            let n: u64 = shape.iter().product();
            (0..n).flat_map(|i| (i as f32).to_le_bytes()).collect()
        })
        .collect();
    let views: Vec<TensorView<'_>> = tensors
        .iter()
        .zip(&data)
        .map(|((fqn, shape), data)| TensorView {
            name: fqn,
            dtype: DType::F32,
            shape,
            data,
        })
        .collect();
    let ckpt = dir.join(name);
    std::fs::create_dir_all(&ckpt).unwrap();
    std::fs::write(
        ckpt.join("model.safetensors"),
        serialize(&views, None).unwrap(),
    )
    .unwrap();
    ckpt
}

/// A 65,536-character tensor name panicked inspect's table ("Formatting argument out of range").
#[test]
fn inspect_renders_a_65536_character_tensor_name() {
    let dir = tempdir();
    let long = "n".repeat(65_536);
    let ckpt = safetensors_checkpoint(
        dir.path(),
        "long",
        &[(long.clone(), vec![2, 3]), ("short".to_string(), vec![4])],
    );
    let text = ok(["inspect", s(&ckpt)]).text();
    let row = text
        .lines()
        .find(|l| l.starts_with(long.as_str()))
        .expect("a row for the long name");
    assert_eq!(
        row.strip_prefix(long.as_str()).unwrap(),
        format!("  {:6}  {:18}  {:>6}  {:>12}", "f32", "[2, 3]", 1, "24 B")
    );
    let short = text.lines().find(|l| l.starts_with("short ")).unwrap();
    assert!(
        short.len() < 200,
        "short rows keep a capped column: {short}"
    );
}

/// Meshes whose rank count wrapped u32: 65536² planned 0 ranks (and `load --check` "passed"),
/// 4294967295² planned 1 rank; `--dp 1000000000` aborted on allocation.
#[test]
fn plan_and_load_refuse_meshes_over_the_rank_limit() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let c = s(&ckpt);
    for (sizes, ranks) in [
        ([65_536u64, 65_536], "4294967296"),
        ([4_294_967_295, 4_294_967_295], "18446744065119617025"),
    ] {
        let layout = dir.path().join(format!("mesh-{}.json", sizes[0]));
        std::fs::write(
            &layout,
            format!(
                r#"{{"mesh": [{{"name": "pp", "size": {}}}, {{"name": "dp", "size": {}}}],
                    "rules": [{{"match": "*", "placements": ["replicate", "shard(0)"]}}]}}"#,
                sizes[0], sizes[1]
            ),
        )
        .unwrap();
        let l = s(&layout);
        let expected = format!(
            "layout mesh [pp={}, dp={}] gives {ranks} ranks, more than the 1048576 a plan may have\n",
            sizes[0], sizes[1]
        );
        for args in [
            vec!["plan", c, "--layout", l],
            vec!["load", c, "--layout", l, "--check"],
        ] {
            let err = fails(&args);
            assert!(err.starts_with("error: resolving layout "), "{err}");
            assert!(err.ends_with(&expected), "{args:?}: {err}");
        }
    }
    assert_eq!(
        fails(["layout", "fsdp", "--dp", "1000000000"]),
        "error: layout mesh [dp=1000000000] gives 1000000000 ranks, more than the 1048576 a plan may have\n"
    );
    let big = dir.path().join("big.json");
    std::fs::write(
        &big,
        r#"{"mesh": [{"name": "dp", "size": 1000000000}], "rules": [{"match": "*", "placements": ["shard(0)"]}]}"#,
    )
    .unwrap();
    let err = fails(["load", c, "--layout", s(&big)]);
    assert!(
        err.ends_with("layout mesh [dp=1000000000] gives 1000000000 ranks, more than the 1048576 a plan may have\n"),
        "{err}"
    );
}

/// A requested box whose end passes u64::MAX: the error shows its true end, not a wrapped one.
#[test]
fn plan_error_shows_the_true_end_of_an_overflowing_box() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let requests = dir.path().join("requests.json");
    std::fs::write(
        &requests,
        r#"{"ranks": [[{"fqn": "model.embed_tokens.weight", "offsets": [18446744073709551615, 0], "lengths": [2, 64]}]]}"#,
    )
    .unwrap();
    assert_eq!(
        fails(["plan", s(&ckpt), "--requests", s(&requests)]),
        format!(
            "error: reading requests {}: rank 0: request [18446744073709551615..18446744073709551617, 0..64] for tensor model.embed_tokens.weight does not fit its shape [1000, 64]\n",
            s(&requests)
        )
    );
}
