//! `tessera synth --dist-optimizer-flat`: optimizer states saved the way Megatron-Core's
//! distributed optimizer saves them (flat ranges of each TP-local box, split contiguously over
//! the data-parallel ranks), then verified and loaded through the real binary into other
//! layouts and flat requests, every byte checked against the value formula.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use support::{assert_same_bytes, fails, layout_file, ok, open, s};
use tessera_metadata::TensorBox;
use tessera_planner::{Layout, Target};
use tessera_synth::{self as synth, Model};

/// Megatron GPT, tp2 × dp3 (so the DP split of every buffer is uneven), 2 pipeline stages.
const SAVED: &[&str] = &[
    "megatron-gpt",
    "--tp",
    "2",
    "--pp",
    "2",
    "--dp",
    "3",
    "--num-layers",
    "4",
];

fn synth_flat(dir: &Path) -> (PathBuf, PathBuf) {
    let layout = layout_file(dir, "saved.json", SAVED);
    let ckpt = dir.join("run").join("step-000002");
    ok([
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        s(&layout),
        "--dist-optimizer-flat",
        "--out",
        s(&ckpt),
    ]);
    (ckpt, layout)
}

#[test]
fn flat_optimizer_states_are_flat_ranges_of_tp_local_boxes_written_by_their_dp_ranks() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, layout_path) = synth_flat(dir.path());
    let checkpoint = open(&ckpt);
    let meta = &checkpoint.meta;
    let tensors = synth::tensors(&Model::GptTiny.config(), true);
    assert_eq!(meta.tensors(), tensors.as_slice());
    let layout = Layout::from_json(&std::fs::read_to_string(&layout_path).unwrap()).unwrap();
    let holdings = layout.resolve(&tensors).unwrap();
    // Who holds each (tensor, box) in the save layout.
    let mut holders: HashMap<(u32, TensorBox), Vec<usize>> = HashMap::new();
    for (rank, requests) in holdings.ranks.iter().enumerate() {
        for r in requests {
            let Target::Box(region) = &r.target else {
                unreachable!()
            };
            holders
                .entry((r.tensor, region.clone()))
                .or_default()
                .push(rank);
        }
    }

    let files: Vec<Vec<u8>> = meta
        .files()
        .iter()
        .map(|f| std::fs::read(ckpt.join(&f.path)).unwrap())
        .collect();
    let mut mid_row = 0;
    let mut unaligned = 0;
    for chunk in meta.chunks() {
        let tensor = &tensors[chunk.tensor as usize];
        let file = &meta.files()[chunk.bytes.file as usize].path;
        let what = format!("{} {} in {file}", tensor.fqn, chunk.region);
        // Every saved box holds the formula's bytes and its own crc32c.
        let expected = synth::box_bytes(tensor, &chunk.region).unwrap();
        let at = chunk.bytes.offset as usize;
        assert_same_bytes(
            &files[chunk.bytes.file as usize][at..at + expected.len()],
            &expected,
            &what,
        );
        let rank: usize = file["data/rank-".len()..file.len() - ".bin".len()]
            .parse()
            .unwrap();
        if !tensor.fqn.starts_with("optim.state.") {
            // Parameters are saved as the layout's boxes.
            assert!(
                holders.contains_key(&(chunk.tensor, chunk.region.clone())),
                "{what}"
            );
            continue;
        }
        // An optimizer-state chunk lies inside a TP-local box its writer holds, and is written
        // by a rank of that box's data-parallel group.
        let parent = holders
            .iter()
            .find(|((t, region), _)| *t == chunk.tensor && region.contains(&chunk.region))
            .unwrap_or_else(|| panic!("{what}: inside no box of the save layout"));
        assert!(
            parent.1.contains(&rank),
            "{what}: rank {rank} does not hold {}",
            parent.0.1
        );
        if tensor.shape.len() == 2 && chunk.region.lengths[1] < parent.0.1.lengths[1] {
            mid_row += 1;
        }
        if chunk.bytes.offset % 4096 != 0 {
            unaligned += 1;
        }
    }
    // The DP split cuts rows: some tiles are parts of a row, lying right after the previous
    // tile of their range (not at an aligned offset).
    assert!(
        mid_row > 0 && unaligned > 0,
        "{mid_row} mid-row, {unaligned} unaligned tiles"
    );

    let total: u64 = checkpoint.manifest.files.iter().map(|f| f.size).sum();
    assert_eq!(
        ok(["verify", s(&ckpt)]).text(),
        format!(
            "{}: ok, {} files, {} checked\n",
            s(&ckpt),
            meta.files().len(),
            tessera::human::bytes(total)
        )
    );
}

fn load_checked(ckpt: &Path, target: &str, arg: &Path) {
    let run = ok(["load", s(ckpt), target, s(arg), "--check"]);
    let text = run.text();
    assert!(text.contains("read amplification 1.00"), "{text}");
    assert!(
        text.contains("check                every byte matches the synthetic formula"),
        "{text}"
    );
}

#[test]
fn a_flat_optimizer_checkpoint_loads_into_other_layouts_byte_exact() {
    let dir = tempfile::tempdir().unwrap();
    let (ckpt, _) = synth_flat(dir.path());
    for (name, preset) in [
        (
            "tp4.json",
            &[
                "megatron-gpt",
                "--tp",
                "4",
                "--pp",
                "1",
                "--dp",
                "1",
                "--num-layers",
                "4",
            ][..],
        ),
        (
            "zero1.json",
            &[
                "megatron-gpt",
                "--tp",
                "1",
                "--pp",
                "2",
                "--dp",
                "2",
                "--num-layers",
                "4",
                "--zero1",
            ][..],
        ),
        ("fsdp.json", &["fsdp", "--dp", "3"][..]),
    ] {
        let layout = layout_file(dir.path(), name, preset);
        load_checked(&ckpt, "--layout", &layout);
    }
    // ZeRO-style flat partitions of the states, across the DP cut points of the save.
    let requests = dir.path().join("requests.json");
    std::fs::write(
        &requests,
        r#"{"ranks": [
            [{"fqn": "optim.state.model.layers.1.mlp.fc1.weight.exp_avg", "flat": [0, 6000]},
             {"fqn": "optim.state.model.embed_tokens.weight.master", "flat": [31000, 64000]}],
            [{"fqn": "optim.state.model.layers.1.mlp.fc1.weight.exp_avg", "flat": [6000, 12544]},
             {"fqn": "optim.state.model.layers.3.input_norm.weight.exp_avg_sq", "flat": [1, 63]}]
        ]}"#,
    )
    .unwrap();
    load_checked(&ckpt, "--requests", &requests);
}

#[test]
fn dist_optimizer_flat_refuses_layouts_it_cannot_split() {
    let dir = tempfile::tempdir().unwrap();
    let zero1 = layout_file(
        dir.path(),
        "zero1.json",
        &[
            "megatron-gpt",
            "--tp",
            "2",
            "--pp",
            "1",
            "--dp",
            "2",
            "--num-layers",
            "4",
            "--zero1",
        ],
    );
    let out = dir.path().join("a");
    let err = fails([
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        s(&zero1),
        "--dist-optimizer-flat",
        "--out",
        s(&out),
    ]);
    assert!(
        err.contains(
            "saving optimizer states as flat ranges over mesh dim \"dp\": tensor optim.state."
        ) && err.contains("not by its data-parallel peers"),
        "{err}"
    );
    let fsdp = layout_file(dir.path(), "fsdp.json", &["fsdp", "--dp", "2"]);
    let err = fails([
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        s(&fsdp),
        "--dist-optimizer-flat=data",
        "--out",
        s(&out),
    ]);
    assert!(
        err.contains("mesh dim \"data\": the save layout's mesh has no such dim (it has dp)"),
        "{err}"
    );
    assert!(!out.join("manifest.json").exists());
    let help = ok(["synth", "--help"]).text();
    assert!(help.contains("--dist-optimizer-flat [<DP_DIM>]"), "{help}");
}
