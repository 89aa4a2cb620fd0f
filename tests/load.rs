//! End-to-end loads through the real binary: synthesize at one layout, `tessera load` at another,
//! and check every rank's dump byte for byte against the value formula; faults with clear errors.
#![allow(clippy::unwrap_used, missing_docs)]

mod support;

use std::path::{Path, PathBuf};

use support::{fails, layout_file, ok, s};
use tessera_metadata::formats::safetensors;
use tessera_planner::{Layout, Target};
use tessera_synth::{self as synth, Model};

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

fn megatron(tp: &str, pp: &str, dp: &str) -> Vec<&'static str> {
    let leak = |v: &str| -> &'static str { Box::leak(v.to_string().into_boxed_str()) };
    vec![
        "megatron-gpt",
        "--tp",
        leak(tp),
        "--pp",
        leak(pp),
        "--dp",
        leak(dp),
        "--num-layers",
        "4",
    ]
}

/// Synthesizes gpt-tiny saved with `preset` and returns the checkpoint directory.
fn synth(dir: &Path, preset: &[&str]) -> PathBuf {
    support::synth_saved_as(dir, preset)
}

/// Checks that `dump` holds, for every rank of `layout_path`, exactly the boxes the layout gives
/// it, with the formula's bytes.
fn check_dumps(dump: &Path, layout_path: &Path) {
    let layout = Layout::from_json(&std::fs::read_to_string(layout_path).unwrap()).unwrap();
    let tensors = synth::tensors(&Model::GptTiny.config(), true);
    let requests = layout.resolve(&tensors).unwrap();
    for (rank, rank_requests) in requests.ranks.iter().enumerate() {
        let path = dump.join(format!("rank-{rank}.safetensors"));
        let file = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let header = safetensors::parse(&file, s(&path)).unwrap();
        assert_eq!(
            header.tensors.len(),
            rank_requests.len(),
            "rank {rank}: tensor count"
        );
        for request in rank_requests {
            let tensor = &tensors[request.tensor as usize];
            let Target::Box(region) = &request.target else {
                unreachable!()
            };
            let entry = header
                .tensors
                .iter()
                .find(|e| e.name == tensor.fqn)
                .unwrap();
            assert_eq!(
                entry.shape,
                region.lengths.to_vec(),
                "rank {rank} {}",
                tensor.fqn
            );
            assert_eq!(entry.dtype, tensor.dtype);
            let (a, b) = entry.data_offsets;
            let got = &file[(header.data_start + a) as usize..(header.data_start + b) as usize];
            assert!(
                got == synth::box_bytes(tensor, region).unwrap().as_slice(),
                "rank {rank} {} {region}: bytes differ",
                tensor.fqn
            );
        }
    }
}

fn load_and_check(saved: &[&str], target: &[&str], transport: &str) {
    let dir = tempdir();
    let ckpt = synth(dir.path(), saved);
    let layout = layout_file(dir.path(), "target.json", target);
    let dump = dir.path().join("dump");
    let run = ok([
        "load",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--transport",
        transport,
        "--check",
        "--dump",
        s(&dump),
    ]);
    let text = run.text();
    assert!(text.contains("read amplification 1.00"), "{text}");
    assert!(
        text.contains("check                every byte matches the synthetic formula"),
        "{text}"
    );
    check_dumps(&dump, &layout);
}

#[test]
fn tp2_to_tp4_inproc() {
    load_and_check(&megatron("2", "1", "1"), &megatron("4", "1", "1"), "inproc");
}

#[test]
fn tp4_to_tp1_inproc() {
    load_and_check(&megatron("4", "1", "1"), &megatron("1", "1", "1"), "inproc");
}

#[test]
fn pp2_to_pp1_inproc() {
    load_and_check(&megatron("1", "2", "1"), &megatron("1", "1", "2"), "inproc");
}

#[test]
fn fsdp_dp4_to_tp2_dp2_inproc() {
    load_and_check(&["fsdp", "--dp", "4"], &megatron("2", "1", "2"), "inproc");
}

#[test]
fn uneven_fsdp_dp4_to_dp3_tcp() {
    // fc2's 98 columns and the 1000-row embedding split unevenly both ways.
    load_and_check(&["fsdp", "--dp", "4"], &["fsdp", "--dp", "3"], "tcp");
}

#[test]
fn fsdp_dp4_to_tp2_dp2_tcp() {
    load_and_check(&["fsdp", "--dp", "4"], &megatron("2", "1", "2"), "tcp");
}

#[test]
fn explicit_requests_with_flat_ranges_and_an_empty_box() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &megatron("2", "2", "1"));
    let requests = dir.path().join("requests.json");
    std::fs::write(
        &requests,
        r#"{"ranks": [
            [{"fqn": "optim.state.model.layers.1.mlp.fc1.weight.exp_avg", "flat": [100, 9000]},
             {"fqn": "model.lm_head.weight", "offsets": [10, 0], "lengths": [0, 64]}],
            [{"fqn": "optim.state.model.layers.1.mlp.fc1.weight.exp_avg", "flat": [5000, 12544]},
             {"fqn": "train.step", "offsets": [], "lengths": []}]
        ]}"#,
    )
    .unwrap();
    let dump = dir.path().join("dump");
    ok([
        "load",
        s(&ckpt),
        "--requests",
        s(&requests),
        "--check",
        "--dump",
        s(&dump),
    ]);
    let tensors = synth::tensors(&Model::GptTiny.config(), true);
    let exp_avg = tensors
        .iter()
        .find(|t| t.fqn == "optim.state.model.layers.1.mlp.fc1.weight.exp_avg")
        .unwrap();
    let file = std::fs::read(dump.join("rank-1.safetensors")).unwrap();
    let header = safetensors::parse(&file, "rank-1").unwrap();
    let entry = header
        .tensors
        .iter()
        .find(|e| e.name == exp_avg.fqn)
        .unwrap();
    assert_eq!(entry.shape, vec![12544 - 5000]);
    let (a, b) = entry.data_offsets;
    assert_eq!(
        &file[(header.data_start + a) as usize..(header.data_start + b) as usize],
        synth::flat_bytes(exp_avg, 5000, 12544).unwrap().as_slice()
    );
    let rank0 = safetensors::parse(
        &std::fs::read(dump.join("rank-0.safetensors")).unwrap(),
        "rank-0",
    )
    .unwrap();
    let empty = rank0
        .tensors
        .iter()
        .find(|e| e.name == "model.lm_head.weight")
        .unwrap();
    assert_eq!(
        (
            empty.shape.clone(),
            empty.data_offsets.1 - empty.data_offsets.0
        ),
        (vec![0, 64], 0)
    );
}

#[test]
fn corrupted_data_is_a_checksum_error_naming_file_and_block() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let layout = layout_file(dir.path(), "target.json", &["fsdp", "--dp", "1"]);
    let data = ckpt.join("data/rank-00001.bin");
    let mut bytes = std::fs::read(&data).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x40;
    std::fs::write(&data, &bytes).unwrap();
    let err = support::fails_verifying(["load", s(&ckpt), "--layout", s(&layout)]);
    assert!(err.contains("checksum mismatch in "), "{err}");
    // Whole saved boxes are checked by their own crc32c (no checksum blocks fetched for them):
    // the error names the file, the box's bytes (which hold the flipped one) and its tensor.
    let (_, rest) = err
        .split_once("data/rank-00001.bin bytes ")
        .unwrap_or_else(|| panic!("{err}"));
    let (range, rest) = rest.split_once(' ').unwrap();
    let (start, end) = range.split_once("..").unwrap();
    let (start, end): (usize, usize) = (start.parse().unwrap(), end.parse().unwrap());
    assert!(start <= at && at < end, "{at} outside {range}: {err}");
    assert!(rest.starts_with("(tensor "), "{err}");
    // Without verification the same load goes through (the bytes are simply wrong), and
    // `--check` finds them: a verification failure (4), as the README's table says (it was 1).
    let err = support::fails_verifying([
        "load",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--no-verify",
        "--check",
    ]);
    assert!(err.contains("expected bytes"), "{err}");
}

#[test]
fn a_missing_data_file_is_named() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let layout = layout_file(dir.path(), "target.json", &["fsdp", "--dp", "1"]);
    std::fs::remove_file(ckpt.join("data/rank-00000.bin")).unwrap();
    let err = support::fails_not_found(["load", s(&ckpt), "--layout", s(&layout)]);
    assert!(err.contains("data/rank-00000.bin is missing"), "{err}");
}

#[test]
fn a_directory_without_manifest_is_refused() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let layout = layout_file(dir.path(), "target.json", &["fsdp", "--dp", "1"]);
    std::fs::remove_file(ckpt.join("manifest.json")).unwrap();
    let err = fails(["load", s(&ckpt), "--layout", s(&layout)]);
    assert_eq!(
        err,
        format!(
            "error: opening checkpoint {}: step-000001: no manifest.json, so this is not a committed checkpoint (an incomplete save?)\n",
            s(&ckpt)
        )
    );
}

#[test]
fn convert_to_another_layout_and_back_loads_the_same_bytes() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &megatron("2", "2", "1"));
    let layout = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);
    let out = dir.path().join("converted/step-000001");
    let run = ok([
        "convert",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--out",
        s(&out),
    ]);
    assert!(
        run.text()
            .starts_with(&format!("converted {} to {}", s(&ckpt), s(&out))),
        "{}",
        run.text()
    );
    ok(["verify", s(&out)]);
    // The converted checkpoint is saved as fsdp dp3: 3 data files, boxes of the new layout.
    let converted = support::open(&out);
    assert_eq!(converted.manifest.files.len(), 3);
    let target = layout_file(dir.path(), "tp2.json", &megatron("2", "1", "1"));
    let dump = dir.path().join("dump");
    ok([
        "load",
        s(&out),
        "--layout",
        s(&target),
        "--check",
        "--dump",
        s(&dump),
    ]);
    check_dumps(&dump, &target);
}

#[test]
fn convert_to_consolidated_safetensors() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let out = dir.path().join("hf");
    ok([
        "convert",
        s(&ckpt),
        "--format",
        "safetensors",
        "--out",
        s(&out),
        "--max-shard-bytes",
        "1000000",
    ]);
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    let weight_map = index["weight_map"].as_object().unwrap();
    let tensors = synth::tensors(&Model::GptTiny.config(), true);
    assert_eq!(weight_map.len(), tensors.len());
    assert_eq!(
        index["metadata"]["total_size"].as_u64(),
        Some(tensors.iter().map(|t| t.nbytes()).sum())
    );
    for tensor in &tensors {
        let file_name = weight_map[&tensor.fqn].as_str().unwrap();
        let file = std::fs::read(out.join(file_name)).unwrap();
        assert!(
            file.len() <= 1_000_000 + 64 * 1024,
            "{file_name} is {} bytes",
            file.len()
        );
        let header = safetensors::parse(&file, file_name).unwrap();
        let entry = header
            .tensors
            .iter()
            .find(|e| e.name == tensor.fqn)
            .unwrap();
        let (a, b) = entry.data_offsets;
        assert!(
            file[(header.data_start + a) as usize..(header.data_start + b) as usize]
                == synth::box_bytes(tensor, &tensor.full_box()).unwrap(),
            "{}",
            tensor.fqn
        );
    }
}

#[test]
fn a_convert_killed_midway_leaves_no_checkpoint() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let layout = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);
    let out = dir.path().join("converted/step-000001");
    // The fault hook aborts the process (as a kill would) after the first data file is written.
    let status = std::process::Command::new(support::BIN)
        .args([
            "convert",
            s(&ckpt),
            "--layout",
            s(&layout),
            "--out",
            s(&out),
        ])
        .env("TESSERA_FAULT_ABORT_AFTER_FILES", "1")
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success());
    assert!(
        out.join("data/rank-00000.bin").exists(),
        "the first data file was written"
    );
    assert!(!out.join("manifest.json").exists());
    let err = fails(["inspect", s(&out)]);
    assert!(
        err.contains("no manifest.json, so this is not a committed checkpoint"),
        "{err}"
    );
    assert!(!dir.path().join("converted/latest").exists());

    // The killed writer's claim is still there: a new convert is refused, naming it.
    let claim = out.join(".tessera-claim.json");
    let body: serde_json::Value = serde_json::from_slice(&std::fs::read(&claim).unwrap()).unwrap();
    let pid = body["pid"].as_u64().unwrap();
    let args = [
        "convert",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--out",
        s(&out),
    ];
    let err = fails(args);
    assert!(
        err.starts_with(&format!(
            "error: claiming {out} for writing: {out} is being written by another writer: step-000001/.tessera-claim.json is held by tessera convert pid {pid} on host ",
            out = s(&out)
        )),
        "{err}"
    );
    assert!(err.contains("rerun with --break-claim"), "{err}");
    // A writer killed mid-upload also leaves object_store's staging file, which its listings hide.
    std::fs::write(out.join("data/rank-00001.bin#1"), b"half an upload").unwrap();

    let mut resumed = args.to_vec();
    resumed.push("--break-claim");
    let text = ok(resumed).text();
    assert!(
        text.starts_with(&format!(
            "broke the write claim of tessera convert pid {pid} on host "
        )),
        "{text}"
    );
    assert!(
        text.contains(
            "removed data/rank-00001.bin#1: an unfinished upload of an interrupted writer\n"
        ),
        "{text}"
    );
    assert!(!out.join("data/rank-00001.bin#1").exists());
    assert!(!claim.exists(), "the claim is removed after the commit");
    assert!(ok(["verify", s(&out)]).text().contains(": ok, 3 files"));
}

#[test]
fn verify_reports_a_staging_file_left_inside_a_checkpoint() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    std::fs::write(ckpt.join("data/rank-00000.bin#1"), b"x").unwrap();
    assert_eq!(
        support::fails_verifying(["verify", s(&ckpt)]),
        format!(
            "error: stray file data/rank-00000.bin#1: not part of the checkpoint (left by an interrupted writer? remove it)\n{}: verification failed\n",
            s(&ckpt)
        )
    );
}

#[test]
fn a_live_claim_refuses_a_second_writer_at_once() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let layout = layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]);
    let out = dir.path().join("converted/step-000001");
    std::fs::create_dir_all(&out).unwrap();
    std::fs::write(
        out.join(".tessera-claim.json"),
        r#"{"pid": 4242, "host": "trainer-7", "created": "2026-01-02T03:04:05Z", "command": "tessera convert"}"#,
    )
    .unwrap();
    for format in [
        &["--layout", s(&layout)][..],
        &["--format", "safetensors"][..],
    ] {
        let mut args = vec!["convert", s(&ckpt), "--out", s(&out)];
        args.extend_from_slice(format);
        assert_eq!(
            fails(args),
            format!(
                "error: claiming {o} for writing: {o} is being written by another writer: step-000001/.tessera-claim.json is held by tessera convert pid 4242 on host trainer-7 since 2026-01-02T03:04:05Z. If that writer is dead (killed, its host gone), rerun with --break-claim to remove its claim and write anyway\n",
                o = s(&out)
            )
        );
    }
    // Nothing was written next to the claim.
    let entries: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    assert_eq!(entries, vec![".tessera-claim.json".to_string()]);
}

/// Two converts into one `--out` at once: exactly one commits, the other fails (on the claim, or
/// on the committed checkpoint when it started after the first finished), and what is committed
/// verifies. Repeated, since the interleaving differs from run to run.
#[test]
fn two_concurrent_converts_into_one_out_commit_one_intact_checkpoint() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let layouts = [
        layout_file(dir.path(), "fsdp3.json", &["fsdp", "--dp", "3"]),
        layout_file(dir.path(), "fsdp4.json", &["fsdp", "--dp", "4"]),
    ];
    for attempt in 0..5 {
        let out = dir.path().join(format!("race{attempt}/step-000001"));
        let children: Vec<std::process::Child> = layouts
            .iter()
            .map(|layout| {
                std::process::Command::new(support::BIN)
                    .args(["convert", s(&ckpt), "--layout", s(layout), "--out", s(&out)])
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outputs: Vec<std::process::Output> = children
            .into_iter()
            .map(|c| c.wait_with_output().unwrap())
            .collect();
        let winners = outputs.iter().filter(|o| o.status.success()).count();
        assert_eq!(winners, 1, "attempt {attempt}: {outputs:?}");
        let loser = outputs.iter().find(|o| !o.status.success()).unwrap();
        let err = String::from_utf8_lossy(&loser.stderr);
        assert!(
            err.contains("is being written by another writer")
                || err.contains("holds a committed checkpoint"),
            "attempt {attempt}: {err}"
        );
        assert!(ok(["verify", s(&out)]).text().contains(": ok, "));
        assert!(!out.join(".tessera-claim.json").exists());
    }
}

/// An export killed after its first shard shows no shard (they are staged as `.partial`); one
/// killed while renaming shows an incomplete set, refused naming the missing shard; a retry
/// with --break-claim cleans up and commits the whole export.
#[test]
fn an_interrupted_safetensors_export_is_never_read_as_a_checkpoint() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let out = dir.path().join("hf");
    let args = [
        "convert",
        s(&ckpt),
        "--format",
        "safetensors",
        "--out",
        s(&out),
        "--max-shard-bytes",
        "1000000",
    ];
    let status = std::process::Command::new(support::BIN)
        .args(args)
        .env("TESSERA_FAULT_ABORT_AFTER_FILES", "2")
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap();
    assert!(!status.success());
    let mut names: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "{names:?}");
    assert_eq!(names[0], ".tessera-claim.json");
    assert!(names[1].ends_with(".safetensors.partial"), "{names:?}");
    let total: usize = names[1]
        .trim_end_matches(".safetensors.partial")
        .rsplit("-of-")
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(total >= 3, "{names:?}");
    let err = fails(["inspect", s(&out)]);
    assert!(!err.contains("ok"), "{err}");

    // As if killed after renaming the first shard into place: the set is incomplete.
    let first = names[1].trim_end_matches(".partial").to_string();
    std::fs::rename(out.join(&names[1]), out.join(&first)).unwrap();
    let second = first.replacen("-00001-of-", "-00002-of-", 1);
    for command in ["inspect", "verify"] {
        let err = fails([command, s(&out)]);
        assert!(
            err.contains(&format!("incomplete safetensors shard set: {second}, "))
                && err.contains(&format!(" missing (1 of {total} shards of model-*-of-")),
            "{command}: {err}"
        );
    }

    let mut resumed = args.to_vec();
    resumed.push("--break-claim");
    let text = ok(resumed).text();
    assert!(text.contains("model.safetensors.index.json"), "{text}");
    let leftovers: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.ends_with(".partial") || n.starts_with(".tessera"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    assert!(
        ok(["verify", s(&out)])
            .text()
            .contains(&format!("ok, safetensors: {total} files"))
    );
}

/// Runs the binary with extra environment variables and expects success.
fn ok_with_env(env: &[(String, String)], args: &[&str]) -> String {
    let output = std::process::Command::new(support::BIN)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "tessera {} failed:\n{}",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn synth_verify_and_load_through_a_real_s3_server() {
    let dir = tempdir();
    std::fs::create_dir_all(dir.path().join("s3")).unwrap();
    let server = tessera_storage::testing::S3TestServer::start(dir.path().join("s3"));
    server.create_bucket("ckpts");
    let env = server.env();
    let saved = layout_file(dir.path(), "saved.json", &["fsdp", "--dp", "4"]);
    let target = layout_file(dir.path(), "target.json", &megatron("2", "1", "2"));
    let url = "s3://ckpts/run/step-000001";
    ok_with_env(
        &env,
        &[
            "synth",
            "--model",
            "gpt-tiny",
            "--layout",
            s(&saved),
            "--out",
            url,
        ],
    );
    assert!(ok_with_env(&env, &["verify", url]).contains(": ok, 4 files"));
    for transport in ["inproc", "tcp"] {
        let dump = dir.path().join(format!("dump-{transport}"));
        let report = ok_with_env(
            &env,
            &[
                "load",
                url,
                "--layout",
                s(&target),
                "--transport",
                transport,
                "--check",
                "--dump",
                s(&dump),
            ],
        );
        assert!(report.contains("read amplification 1.00"), "{report}");
        check_dumps(&dump, &target);
    }
    // The latest pointer of the run lives in the bucket too.
    let latest = std::fs::read_to_string(dir.path().join("s3/ckpts/run/latest")).unwrap();
    assert_eq!(latest.trim(), "step-000001");
}

/// `load --dump` named each destination by scanning the names so far: quadratic, about a minute
/// for 100k tensors. 100k one-element tensors (plus a rank holding several boxes of one tensor,
/// which must get `#k` names) load and dump with every name and byte right.
#[test]
fn dump_of_100k_tensors_names_every_tensor() {
    use tessera_metadata::DType;
    use tessera_metadata::formats::safetensors::{TensorView, serialize};
    const N: usize = 100_000;
    let dir = tempdir();
    let names: Vec<String> = (0..N).map(|i| format!("t.{i}")).collect();
    let values: Vec<[u8; 4]> = (0..N).map(|i| (i as f32).to_le_bytes()).collect();
    let shape = [1u64];
    let views: Vec<TensorView<'_>> = names
        .iter()
        .zip(&values)
        .map(|(name, v)| TensorView {
            name,
            dtype: DType::F32,
            shape: &shape,
            data: v,
        })
        .collect();
    let ckpt = dir.path().join("many");
    std::fs::create_dir_all(&ckpt).unwrap();
    std::fs::write(
        ckpt.join("model.safetensors"),
        serialize(&views, None).unwrap(),
    )
    .unwrap();
    let layout = layout_file(dir.path(), "dp1.json", &["fsdp", "--dp", "1"]);
    let dump = dir.path().join("dump");
    let started = std::time::Instant::now();
    ok([
        "load",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--dump",
        s(&dump),
        "--quiet",
    ]);
    eprintln!(
        "load --dump of {N} tensors: {:.2} s",
        started.elapsed().as_secs_f64()
    );
    let file = std::fs::read(dump.join("rank-0.safetensors")).unwrap();
    let header = safetensors::parse(&file, "rank-0").unwrap();
    assert_eq!(header.tensors.len(), N);
    let start = header.data_start as usize;
    for entry in &header.tensors {
        let i: usize = entry.name.strip_prefix("t.").unwrap().parse().unwrap();
        let (b, e) = entry.data_offsets;
        assert_eq!(
            &file[start + b as usize..start + e as usize],
            &values[i],
            "{}",
            entry.name
        );
    }

    // Many boxes of one tensor on one rank: FQN, FQN#1, FQN#2, ...
    let requests = dir.path().join("requests.json");
    let boxes: Vec<String> = (0..2_000)
        .map(|_| r#"{"fqn": "t.7", "offsets": [0], "lengths": [1]}"#.to_string())
        .collect();
    std::fs::write(
        &requests,
        format!(r#"{{"ranks": [[{}]]}}"#, boxes.join(",")),
    )
    .unwrap();
    let dump2 = dir.path().join("dump2");
    ok([
        "load",
        s(&ckpt),
        "--requests",
        s(&requests),
        "--dump",
        s(&dump2),
        "--quiet",
    ]);
    let file = std::fs::read(dump2.join("rank-0.safetensors")).unwrap();
    let header = safetensors::parse(&file, "rank-0").unwrap();
    let mut got: Vec<String> = header.tensors.iter().map(|t| t.name.clone()).collect();
    got.sort();
    let mut expected: Vec<String> = std::iter::once("t.7".to_string())
        .chain((1..2_000).map(|k| format!("t.7#{k}")))
        .collect();
    expected.sort();
    assert_eq!(got, expected);
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The rendezvous waited 300 s for a missing rank whatever --peer-timeout said, silently. Now it
/// ends within the peer timeout and says every second or so whom it waits for.
#[test]
fn rendezvous_honours_peer_timeout_and_says_whom_it_waits_for() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let layout = layout_file(dir.path(), "dp3.json", &["fsdp", "--dp", "3"]);
    let port = free_port().to_string();
    let started = std::time::Instant::now();
    let err = support::fails_peer([
        "load",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--transport",
        "tcp",
        "--rank",
        "0",
        "--world",
        "3",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        &port,
        "--peer-timeout",
        "3",
    ]);
    let took = started.elapsed();
    assert!(took < std::time::Duration::from_secs(30), "took {took:?}");
    assert!(
        err.contains(&format!(
            "rank 0: waiting for ranks 1,2 to join at 127.0.0.1:{port} (1 of 3 in, 1 s of 3 s)\n"
        )),
        "{err}"
    );
    assert!(
        err.contains("rank 0: only 1 of 3 ranks checked in within 3s; missing ranks [1, 2]"),
        "{err}"
    );
}

/// The child processes of `tessera load --transport tcp` (their pids from /proc).
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return out;
    };
    for task in tasks.flatten() {
        if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<u32>().ok()),
            );
        }
    }
    out
}

/// A SIGSTOPped rank never exits: its peers fail after --peer-timeout naming it, and the parent
/// waited for it forever. Now the parent kills it after the grace period, reports every rank
/// (the stopped one as stopped and killed) and exits non-zero.
#[test]
fn a_stopped_rank_is_killed_and_reported_and_load_ends() {
    let dir = tempdir();
    let ckpt = synth(dir.path(), &["fsdp", "--dp", "2"]);
    let layout = layout_file(dir.path(), "dp3.json", &["fsdp", "--dp", "3"]);
    // The scenario needs rank 2 stopped while it is alive. Under a loaded test run it can be gone
    // before the signal lands (it failed at once, e.g. another test's process took the free port
    // the parent picked); then the precondition did not happen and the scenario is run again.
    let mut attempt = 0;
    let (started, mut parent, stopped) = loop {
        attempt += 1;
        assert!(
            attempt <= 3,
            "rank 2 could not be stopped alive in 3 attempts"
        );
        let started = std::time::Instant::now();
        let mut parent = std::process::Command::new(support::BIN)
            .args([
                "load",
                s(&ckpt),
                "--layout",
                s(&layout),
                "--transport",
                "tcp",
                "--peer-timeout",
                "2",
            ])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Stop rank 2 as soon as its process exists, before it can check in or load.
        let mut stopped = None;
        let mut gone = false;
        while stopped.is_none() && !gone && started.elapsed() < std::time::Duration::from_secs(20) {
            for child in children_of(parent.id()) {
                let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
                let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
                if args.windows(2).any(|w| w[0] == b"--rank" && w[1] == b"2") {
                    let status = std::process::Command::new("kill")
                        .args(["-STOP", &child.to_string()])
                        .status()
                        .unwrap();
                    if status.success() {
                        stopped = Some(child);
                    } else {
                        gone = true;
                    }
                    break;
                }
            }
        }
        match stopped {
            Some(child) => break (started, parent, child),
            None => {
                let _ = parent.kill();
                let output = parent.wait_with_output().unwrap();
                eprintln!(
                    "attempt {attempt}: rank 2 was gone before it could be stopped; again. Its load said:\n{}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
        }
    };
    // Generous: the bound is about twice the 2 s peer timeout after start-up.
    let deadline = started + std::time::Duration::from_secs(60);
    let status = loop {
        if let Some(status) = parent.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = parent.kill();
            let _ = std::process::Command::new("kill")
                .args(["-KILL", &stopped.to_string()])
                .status();
            panic!("tessera load still running after 60 s with rank 2 stopped");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let took = started.elapsed();
    let output = parent.wait_with_output().unwrap();
    let stderr = String::from_utf8(output.stderr).unwrap();
    eprintln!("load with rank 2 stopped ended after {took:?}:\n{stderr}");
    assert_eq!(status.code(), Some(support::PEER_FAILED), "{stderr}");
    let report = &stderr[stderr.find("error: the load failed:\n").expect(&stderr)..];
    let line = |rank: u32| {
        report
            .lines()
            .find(|l| l.starts_with(&format!("  rank {rank}: ")))
            .unwrap_or_else(|| panic!("no line for rank {rank}: {stderr}"))
            .trim()
            .to_string()
    };
    assert!(
        line(2).starts_with("rank 2: stopped (SIGSTOP or a debugger) 2 s after another rank failed: killed by signal 9, no report"),
        "{stderr}"
    );
    // Rank 0 names rank 2 (missing from the rendezvous, or late with its pieces); rank 1 has its
    // own error (the master gave up, or rank 2 timed out on it).
    // Stopped before it checked in (the usual case), the others' progress lines said whom they
    // waited for; stopped a moment later (a busy machine), rank 0 waited for its pieces instead.
    let zero = line(0);
    let waited_at_rendezvous = stderr.contains("rank 0: waiting for rank 2 to join at 127.0.0.1:");
    let waited_for_pieces = zero.contains("nothing from rank 2");
    assert!(waited_at_rendezvous || waited_for_pieces, "{stderr}");
    assert!(
        zero.contains("missing ranks [2]") || zero.contains("rank 2"),
        "{stderr}"
    );
    assert!(line(1).len() > "  rank 1: ".len(), "{stderr}");
}

/// Runs `tessera <args>` with extra environment variables and returns its exit code, stderr and
/// how long it took.
fn run_timed(env: &[(&str, &str)], args: &[&str]) -> (Option<i32>, String, std::time::Duration) {
    let started = std::time::Instant::now();
    let output = std::process::Command::new(support::BIN)
        .args(args)
        .envs(env.iter().copied())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8(output.stderr).unwrap(),
        started.elapsed(),
    )
}

/// A storage server that stalls mid-body on every data file (headers and 100 bytes, then
/// silence with the connection open) used to hang `tessera load` for minutes. With
/// `--storage-read-timeout 0.3 --storage-attempts 3` (or the same as TESSERA_STORAGE_* variables,
/// which the rank processes of `--transport tcp` get too) the load exits 1 after about 3 × 0.3 s
/// per rank, naming the stalled file and saying it gave up after 3 attempts that timed out. The
/// same command loads and checks every byte when nothing stalls.
#[test]
fn a_load_from_storage_that_stalls_mid_body_fails_within_the_bound() {
    use tessera_storage::testing::{Stall, StallingHttpServer};
    let dir = tempdir();
    synth(dir.path(), &["fsdp", "--dp", "2"]);
    let target = layout_file(dir.path(), "target.json", &megatron("2", "1", "1"));
    let server = StallingHttpServer::start(dir.path());
    let url = format!("{}/run/step-000001", server.url());
    let load = |transport: &'static str| {
        vec![
            "load".to_string(),
            url.clone(),
            "--layout".to_string(),
            s(&target).to_string(),
            "--transport".to_string(),
            transport.to_string(),
            "--check".to_string(),
        ]
    };
    let flags = ["--storage-read-timeout", "0.3", "--storage-attempts", "3"];
    let env = [
        ("TESSERA_STORAGE_READ_TIMEOUT", "0.3"),
        ("TESSERA_STORAGE_ATTEMPTS", "3"),
    ];

    let mut args = load("inproc");
    args.extend(flags.iter().map(|f| f.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (code, stderr, _) = run_timed(&[], &args);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(server.stalled(), 0);

    server.stall(Stall::AfterBytes(100), |path| path.contains("/data/"));
    // In-process ranks, timeouts as flags; rank processes over TCP, timeouts from the
    // environment (forwarded to every rank).
    let inproc = args.clone();
    let tcp_args = load("tcp");
    let tcp: Vec<&str> = tcp_args.iter().map(String::as_str).collect();
    for (args, env) in [(&inproc[..], &[][..]), (&tcp[..], &env[..])] {
        let before = server.stalled();
        let (code, stderr, took) = run_timed(env, args);
        eprintln!("{} ended after {took:?}:\n{stderr}", args.join(" "));
        assert_eq!(code, Some(support::UNREACHABLE), "{stderr}");
        assert!(stderr.contains("error: the load failed:"), "{stderr}");
        assert!(
            stderr.contains(
                "(gave up after 3 attempts, the last one timed out) of run/step-000001/data/"
            ),
            "{stderr}"
        );
        assert!(server.stalled() >= before + 3, "{}", server.stalled());
        // About 1 s per rank (3 × 0.3 s and backoff); the bound is generous for a loaded machine,
        // far below the default timeouts (5 × 10 s) and the 60 s peer timeout.
        assert!(took < std::time::Duration::from_secs(20), "took {took:?}");
    }
}

/// The storage flags refuse what cannot be a timeout or an attempt count, naming the flag.
#[test]
fn storage_flags_refuse_nonsense() {
    let err = fails(["inspect", "/nonexistent", "--storage-read-timeout", "0"]);
    assert!(err.contains("--storage-read-timeout (TESSERA_STORAGE_READ_TIMEOUT) must be a positive number of seconds"), "{err}");
    let err = fails(["verify", "/nonexistent", "--storage-attempts", "0"]);
    assert!(
        err.contains("--storage-attempts (TESSERA_STORAGE_ATTEMPTS) must be at least 1"),
        "{err}"
    );
}

/// The hidden entry of a spawned rank (`tessera load-rank ARGS ...`) refuses an arguments file
/// that is missing or is not a load's arguments, naming the file, before it meets any peer.
#[test]
fn load_rank_refuses_a_missing_or_garbled_args_file_naming_it() {
    let dir = tempdir();
    let missing = dir.path().join("missing.json");
    let garbled = dir.path().join("garbled.json");
    std::fs::write(&garbled, "{\"checkpoint\": 7}").unwrap();
    for (file, why) in [
        (&missing, "reading the load's arguments"),
        (&garbled, "not the arguments of a load"),
    ] {
        let run = support::run_in(
            None,
            [
                "load-rank",
                s(file),
                "--rank",
                "0",
                "--master-port",
                "1",
                "--report-json",
                s(&dir.path().join("report.json")),
            ],
        );
        assert_ne!(run.code, Some(0), "{run:?}");
        assert!(run.stderr.contains(s(file)), "{}", run.stderr);
        assert!(run.stderr.contains(why), "{}", run.stderr);
        assert!(!dir.path().join("report.json").exists());
    }
}

/// A metadata-only checkpoint (`synth --metadata-only`) is refused by load and convert alike,
/// named, before any rank starts or anything is written.
#[test]
fn load_and_convert_refuse_a_metadata_only_checkpoint_naming_it() {
    let dir = tempdir();
    let layout = layout_file(dir.path(), "dp2.json", &["fsdp", "--dp", "2"]);
    let ckpt = dir.path().join("ck");
    ok([
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        s(&layout),
        "--out",
        s(&ckpt),
        "--metadata-only",
    ]);
    let said = format!(
        "{}: a metadata-only checkpoint has no data to load",
        s(&ckpt)
    );
    for transport in ["inproc", "tcp"] {
        let err = fails([
            "load",
            s(&ckpt),
            "--layout",
            s(&layout),
            "--transport",
            transport,
        ]);
        assert!(err.contains(&said), "{err}");
    }
    let out = dir.path().join("out");
    let err = fails([
        "convert",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--out",
        s(&out),
    ]);
    assert!(err.contains(&said), "{err}");
    assert!(!out.exists());
}
