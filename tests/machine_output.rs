//! Machine output of the `tessera` binary, run as a real process: `--json` on every command that
//! reports (one JSON document on stdout, errors included), the exit code of each class of
//! failure, `--include/--exclude` on convert and load, shell completions and the man page.

#![allow(clippy::unwrap_used)]

mod support;

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;
use support::{layout_file, ok, open, run_in, s, synth_tiny};

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Stdout of a run as the one JSON document it must be.
#[track_caller]
fn json_doc(run: &support::Run) -> Value {
    serde_json::from_slice(&run.stdout).unwrap_or_else(|e| {
        panic!(
            "{}: stdout is not one JSON document ({e}):\n{}\nstderr:\n{}",
            run.command,
            String::from_utf8_lossy(&run.stdout),
            run.stderr
        )
    })
}

/// Runs `tessera <args>` and checks that it exits with `code`; returns the run.
#[track_caller]
fn exits_with(code: i32, args: &[&str]) -> support::Run {
    let run = run_in(None, args);
    assert_eq!(
        run.code,
        Some(code),
        "{} should exit {code}; stdout:\n{}\nstderr:\n{}",
        run.command,
        String::from_utf8_lossy(&run.stdout),
        run.stderr
    );
    run
}

/// The `--json` error document of a failed run: its kind and code, and the message.
#[track_caller]
fn json_error(run: &support::Run, kind: &str, code: i64) -> String {
    let doc = json_doc(run);
    assert_eq!(doc["error"]["kind"], kind, "{doc}");
    assert_eq!(doc["error"]["code"], code, "{doc}");
    // The person watching still gets the message on stderr.
    let message = doc["error"]["message"].as_str().unwrap().to_string();
    assert!(run.stderr.contains(&message), "stderr: {}", run.stderr);
    message
}

/// A TCP port on 127.0.0.1 where nothing listens (bound, then released).
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

/// Flips one byte in the middle of the checkpoint's largest data file; returns its path.
fn flip_a_byte(ckpt: &Path) -> String {
    let manifest = open(ckpt).manifest;
    let file = manifest.files.iter().max_by_key(|f| f.size).unwrap();
    let path = ckpt.join(&file.path);
    let mut data = std::fs::read(&path).unwrap();
    let middle = data.len() / 2;
    data[middle] ^= 0x10;
    std::fs::write(&path, &data).unwrap();
    file.path.clone()
}

#[test]
fn each_class_of_failure_has_its_exit_code_and_json_kind() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let dp2 = layout_file(dir.path(), "dp2.json", &["fsdp", "--dp", "2"]);

    // 2: a bad command line (clap's code and message); with --json also the error document.
    let run = exits_with(2, &["load", s(&ckpt)]);
    assert!(run.stderr.contains("--layout"), "{}", run.stderr);
    assert!(run.stdout.is_empty());
    let run = exits_with(2, &["load", s(&ckpt), "--json"]);
    let doc = json_doc(&run);
    assert_eq!(doc["error"]["kind"], "usage", "{doc}");
    assert_eq!(doc["error"]["code"], 2, "{doc}");
    let message = doc["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("the following required arguments were not provided"),
        "{message}"
    );
    assert!(run.stderr.contains(message), "{}", run.stderr);

    // 3: not found.
    let missing = dir.path().join("no-such-run").join("step-1");
    let run = exits_with(3, &["inspect", s(&missing), "--json"]);
    let message = json_error(&run, "not_found", 3);
    assert!(message.contains("does not exist"), "{message}");
    exits_with(3, &["verify", s(&missing)]);
    let run = exits_with(
        3,
        &[
            "plan",
            s(&ckpt),
            "--layout",
            "/no/such/layout.json",
            "--json",
        ],
    );
    assert!(json_error(&run, "not_found", 3).contains("/no/such/layout.json"));

    // 5: storage that does not answer (after the retries).
    let url = format!("http://127.0.0.1:{}/run/step-1", closed_port());
    let run = exits_with(5, &["inspect", &url, "--storage-attempts", "1", "--json"]);
    let message = json_error(&run, "unreachable", 5);
    assert!(message.contains("manifest.json"), "{message}");

    // 6: the ranks cannot meet (a rendezvous master nobody runs).
    let port = closed_port().to_string();
    let run = exits_with(
        6,
        &[
            "load",
            s(&ckpt),
            "--layout",
            s(&dp2),
            "--rank",
            "1",
            "--world",
            "2",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            &port,
            "--peer-timeout",
            "1",
            "--json",
        ],
    );
    let message = json_error(&run, "peer_failed", 6);
    assert!(message.contains("rendezvous"), "{message}");

    // 1: anything else (a model nobody knows).
    let run = exits_with(
        1,
        &[
            "synth",
            "--model",
            "gpt-huge",
            "--layout",
            s(&dp2),
            "--out",
            s(&dir.path().join("x")),
            "--json",
        ],
    );
    assert!(json_error(&run, "other", 1).contains("gpt-huge"));

    // 4: verification failed: verify lists the bad block in `problems`; load and convert that
    // read it fail with the same code.
    let bad_file = flip_a_byte(&ckpt);
    let run = exits_with(4, &["verify", s(&ckpt), "--json"]);
    let message = json_error(&run, "verification_failed", 4);
    assert!(message.ends_with("verification failed"), "{message}");
    let doc = json_doc(&run);
    let problems: Vec<&str> = doc["error"]["problems"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p.as_str().unwrap())
        .collect();
    assert!(
        problems
            .iter()
            .any(|p| p.starts_with(&format!("bad block in {bad_file} bytes "))),
        "{problems:?}"
    );
    // Without --json: the code, the message on stderr, nothing on stdout.
    let run = exits_with(4, &["verify", s(&ckpt)]);
    assert!(run.stdout.is_empty());
    assert!(run.stderr.contains(&format!("bad block in {bad_file}")));
    let run = exits_with(4, &["load", s(&ckpt), "--layout", s(&dp2)]);
    assert!(run.stderr.contains("checksum mismatch"), "{}", run.stderr);
    // Rank processes: the rank that read the bad block exits 4, and so does the load.
    let run = exits_with(
        4,
        &[
            "load",
            s(&ckpt),
            "--layout",
            s(&dp2),
            "--transport",
            "tcp",
            "--peer-timeout",
            "5",
        ],
    );
    assert!(run.stderr.contains("checksum mismatch"), "{}", run.stderr);
    let out = dir.path().join("converted");
    exits_with(
        4,
        &["convert", s(&ckpt), "--layout", s(&dp2), "--out", s(&out)],
    );
}

#[test]
fn help_lists_the_exit_codes_and_json_flags() {
    let help = ok(["--help"]).text();
    for line in [
        "Exit codes:",
        "  3  not found",
        "  4  verification failed",
        "  5  unreachable",
        "  6  peer failed",
        "{\"error\": {\"kind\", \"code\", \"message\"}}",
    ] {
        assert!(help.contains(line), "{line:?} missing from:\n{help}");
    }
    for command in ["inspect", "plan", "load", "verify", "convert", "synth"] {
        let help = ok([command, "--help"]).text();
        assert!(help.contains("--json"), "{command} --help:\n{help}");
    }
    for command in ["load", "convert"] {
        let help = ok([command, "--help"]).text();
        assert!(
            help.contains("--include <GLOB>") && help.contains("--exclude <GLOB>"),
            "{command} --help:\n{help}"
        );
    }
}

#[test]
fn every_reporting_command_prints_one_json_document() {
    let dir = tempdir();
    let save = layout_file(dir.path(), "dp2.json", &["fsdp", "--dp", "2"]);
    let dp1 = layout_file(dir.path(), "dp1.json", &["fsdp", "--dp", "1"]);
    let ckpt = dir.path().join("run").join("step-1");
    let synth = json_doc(&ok([
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        s(&save),
        "--out",
        s(&ckpt),
        "--json",
    ]));
    let manifest = open(&ckpt).manifest;
    assert_eq!(synth["out"], s(&ckpt));
    assert_eq!(synth["model"], "gpt-tiny");
    assert_eq!(synth["data"], true);
    assert_eq!(synth["tensors"], manifest.tensors);
    assert_eq!(synth["boxes"], manifest.chunks);
    assert_eq!(synth["files"], manifest.files.len());
    assert_eq!(synth["tensor_bytes"], manifest.tensor_bytes);

    let plan = json_doc(&ok(["plan", s(&ckpt), "--layout", s(&dp1), "--json"]));
    assert_eq!(plan["ranks"], 1);
    assert_eq!(plan["bytes_needed"], manifest.tensor_bytes);

    let verify = json_doc(&ok(["verify", s(&ckpt), "--json"]));
    assert_eq!(verify["checkpoint"], s(&ckpt));
    assert_eq!(verify["ok"], true);
    assert!(
        verify["summary"]
            .as_str()
            .unwrap()
            .starts_with(&format!("{}: ok, 2 files", s(&ckpt))),
        "{verify}"
    );

    let load = json_doc(&ok([
        "load",
        s(&ckpt),
        "--layout",
        s(&save),
        "--check",
        "--json",
    ]));
    assert_eq!(load["checkpoint"], s(&ckpt));
    assert_eq!(load["format"], "native");
    assert_eq!(load["world"], 2);
    assert_eq!(load["ranks_loaded"], 2);
    // The plan's totals are `plan --json`'s; every rank's buffers add up to them.
    let planned = json_doc(&ok(["plan", s(&ckpt), "--layout", s(&save), "--json"]));
    assert_eq!(load["plan"], planned);
    let ranks = load["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    let needed: u64 = ranks
        .iter()
        .map(|r| r["bytes_needed"].as_u64().unwrap())
        .sum();
    assert_eq!(planned["bytes_needed"], needed);

    let out = dir.path().join("export");
    let convert = json_doc(&ok([
        "convert",
        s(&ckpt),
        "--format",
        "safetensors",
        "--out",
        s(&out),
        "--json",
    ]));
    assert_eq!(convert["format"], "safetensors");
    assert_eq!(convert["tensors"], manifest.tensors);
    let index: Value =
        serde_json::from_slice(&std::fs::read(out.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(convert["tensor_bytes"], index["metadata"]["total_size"]);
    assert_eq!(convert["files"], 1);
    assert_eq!(convert["notes"], serde_json::json!([]));

    let inspect = json_doc(&ok(["inspect", s(&out), "--json"]));
    assert!(inspect.is_object(), "{inspect}");
}

/// The tensor names of a checkpoint, as `inspect --json` lists them.
fn tensor_names(ckpt: &Path) -> BTreeSet<String> {
    let doc = json_doc(&ok(["inspect", s(ckpt), "--json"]));
    doc["tensors"]
        .as_array()
        .unwrap_or_else(|| panic!("no tensors in {doc}"))
        .iter()
        .map(|t| t["fqn"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn include_and_exclude_pick_the_tensors_convert_and_load_take() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let all = tensor_names(&ckpt);
    assert!(all.iter().any(|n| n.starts_with("optim.")));
    let dp1 = layout_file(dir.path(), "dp1.json", &["fsdp", "--dp", "1"]);
    let dp2 = layout_file(dir.path(), "dp2.json", &["fsdp", "--dp", "2"]);

    // safetensors export of the model weights only: no optimizer state, every weight, and the
    // bytes are the synthetic formula's (load --check reads them back).
    let weights = dir.path().join("weights");
    ok([
        "convert",
        s(&ckpt),
        "--format",
        "safetensors",
        "--out",
        s(&weights),
        "--exclude",
        "optim.*",
    ]);
    let expected: BTreeSet<String> = all
        .iter()
        .filter(|n| !n.starts_with("optim."))
        .cloned()
        .collect();
    assert!(!expected.is_empty());
    assert_eq!(tensor_names(&weights), expected);
    ok(["load", s(&weights), "--layout", s(&dp1), "--check"]);

    // Native convert of the attention weights, resharded: only those, and they verify and load.
    let attn = dir.path().join("attn");
    let convert = json_doc(&ok([
        "convert",
        s(&ckpt),
        "--layout",
        s(&dp2),
        "--out",
        s(&attn),
        "--include",
        "model.layers.*.attn.*",
        "--exclude",
        "*proj*",
        "--json",
    ]));
    let expected: BTreeSet<String> = all
        .iter()
        .filter(|n| n.starts_with("model.layers.") && n.contains(".attn.") && !n.contains("proj"))
        .cloned()
        .collect();
    assert_eq!(expected.len(), 4, "{expected:?}");
    assert_eq!(convert["tensors"], 4);
    assert_eq!(tensor_names(&attn), expected);
    ok(["verify", s(&attn)]);
    ok(["load", s(&attn), "--layout", s(&dp1), "--check"]);

    // load --include: the dump holds exactly the matching tensors, with the formula's bytes.
    let dump = dir.path().join("dump");
    let load = json_doc(&ok([
        "load",
        s(&ckpt),
        "--layout",
        s(&dp1),
        "--include",
        "*embed*",
        "--check",
        "--dump",
        s(&dump),
        "--json",
    ]));
    let embed: BTreeSet<String> = all
        .iter()
        .filter(|n| n.contains("embed"))
        .cloned()
        .collect();
    assert_eq!(load["plan"]["destinations"], embed.len());
    assert_eq!(tensor_names(&dump.join("rank-0.safetensors")), embed);

    // Rank processes over TCP take the same filter: two ranks, each dump only the weights.
    let dump = dir.path().join("dump-tcp");
    ok([
        "load",
        s(&ckpt),
        "--layout",
        s(&dp2),
        "--transport",
        "tcp",
        "--exclude",
        "optim.*",
        "--check",
        "--dump",
        s(&dump),
    ]);
    let weights: BTreeSet<String> = all
        .iter()
        .filter(|n| !n.starts_with("optim."))
        .cloned()
        .collect();
    for rank in 0..2 {
        assert_eq!(
            tensor_names(&dump.join(format!("rank-{rank}.safetensors"))),
            weights
        );
    }

    // A pattern that matches nothing is an error naming it, and nothing is written.
    let out = dir.path().join("nothing");
    for (flag, args) in [
        (
            "--include",
            vec![
                "load",
                s(&ckpt),
                "--layout",
                s(&dp1),
                "--include",
                "model.layer.*",
            ],
        ),
        (
            "--exclude",
            vec![
                "convert",
                s(&ckpt),
                "--format",
                "safetensors",
                "--out",
                s(&out),
                "--exclude",
                "optimizer.*",
            ],
        ),
    ] {
        let run = exits_with(1, &args);
        let pattern = args.last().unwrap();
        assert!(
            run.stderr.contains(&format!(
                "{flag} \"{pattern}\" matches no tensor of {}",
                s(&ckpt)
            )),
            "{}",
            run.stderr
        );
    }
    assert!(!out.join("model.safetensors.index.json").exists());

    // A plan server plans every tensor: a filter with --server is refused, not ignored.
    let run = exits_with(
        1,
        &[
            "load",
            s(&ckpt),
            "--layout",
            s(&dp1),
            "--server",
            "http://127.0.0.1:1",
            "--include",
            "model.*",
        ],
    );
    assert!(
        run.stderr
            .contains("--include/--exclude filter a plan made here; a server plans every tensor"),
        "{}",
        run.stderr
    );
}

#[test]
fn completions_and_man_page_come_from_the_command_line_definition() {
    let bash = ok(["completions", "bash"]).text();
    assert!(bash.contains("_tessera()"), "{bash}");
    for word in ["inspect", "convert", "--include", "--storage-attempts"] {
        assert!(
            bash.contains(word),
            "{word} missing from the bash completions"
        );
    }
    let zsh = ok(["completions", "zsh"]).text();
    assert!(zsh.starts_with("#compdef tessera"), "{zsh}");
    exits_with(2, &["completions", "tcsh"]);

    let man = ok(["man"]).text();
    assert!(man.contains(".TH tessera 1"), "{man}");
    assert!(
        man.contains("Exit codes:"),
        "the man page lists the exit codes"
    );
    let dir = tempdir();
    ok(["man", "--dir", s(dir.path())]);
    let load = std::fs::read_to_string(dir.path().join("tessera-load.1")).unwrap();
    assert!(load.contains("\\-\\-include"), "{load}");
}

/// Runs `tessera <args>` with `env` added.
fn run_with_env(env: &[(String, String)], args: &[&str]) -> support::Run {
    let output = std::process::Command::new(support::BIN)
        .args(args)
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    support::Run {
        command: format!("tessera {}", args.join(" ")),
        code: output.status.code(),
        stdout: output.stdout,
        stderr: String::from_utf8(output.stderr).unwrap(),
    }
}

#[test]
fn a_bucket_missing_on_s3_is_not_found() {
    let dir = tempdir();
    std::fs::create_dir_all(dir.path().join("s3")).unwrap();
    let server = tessera_storage::testing::S3TestServer::start(dir.path().join("s3"));
    server.create_bucket("ckpts");
    let env = server.env();
    for url in ["s3://no-such-bucket/run/step-000001"] {
        for command in ["inspect", "verify"] {
            let run = run_with_env(&env, &[command, url, "--json"]);
            assert_eq!(
                run.code,
                Some(3),
                "{}: stdout {}\nstderr {}",
                run.command,
                String::from_utf8_lossy(&run.stdout),
                run.stderr
            );
            json_error(&run, "not_found", 3);
        }
    }
}
