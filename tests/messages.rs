//! The CLI's messages to a new user (issue 17): a rank without a rendezvous address says what is
//! missing, storage errors print each cause once, paths that are not checkpoints say what they
//! are, output into a closed pipe ends quietly, and text output is for people.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;
use std::process::{Command, Stdio};

use support::{BIN, layout_file, s, synth_tiny};

fn tempdir() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Runs `tessera <args>` without torchrun's variables in its environment; returns (exit code,
/// stdout, stderr).
fn run_clean(args: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(BIN)
        .args(args)
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        output.status.code(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// Fails with a non-zero exit code and nothing on stdout; returns stderr. (The exit code itself
/// is another part of issue 17: distinct codes per kind of failure.)
#[track_caller]
fn failing(args: &[&str]) -> String {
    let (code, stdout, stderr) = run_clean(args);
    assert!(
        code.is_some_and(|c| c != 0),
        "tessera {args:?} should fail: {code:?}\n{stderr}"
    );
    assert!(stdout.is_empty(), "{stdout}");
    stderr
}

// ---------------------------------------------------------------------------------------------
// Rendezvous

/// `load --rank 1 --world 3` without a master address said "environment variable RANK is not
/// set" although RANK was given by flag. Now it names what is missing and how to give it.
#[test]
fn rank_without_master_address_names_the_flags_and_variables() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let layout = layout_file(dir.path(), "dp3.json", &["fsdp", "--dp", "3"]);
    let err = failing(&[
        "load",
        s(&ckpt),
        "--layout",
        s(&layout),
        "--rank",
        "1",
        "--world",
        "3",
    ]);
    assert_eq!(
        err,
        "error: --rank 1 joins a job of 3 ranks through rank 0, but the master address \
         (--master-addr HOST or MASTER_ADDR) and the master port (--master-port PORT, \
         TESSERA_PORT or MASTER_PORT) are not given: every rank needs rank 0's address \
         (torchrun sets MASTER_ADDR and MASTER_PORT)\n"
    );
}

// ---------------------------------------------------------------------------------------------
// Paths

/// A path that does not exist said "not a checkpoint tessera can read: no manifest.json ...";
/// a run directory (holding steps) was refused the same way; an empty directory too.
#[test]
fn paths_that_are_not_checkpoints_say_what_they_are() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let run = ckpt.parent().unwrap();
    let missing = dir.path().join("run").join("step-typo");
    let err = failing(&["inspect", s(&missing)]);
    assert_eq!(
        err,
        format!(
            "error: opening checkpoint {0}: {0}: does not exist (nothing is stored there)\n",
            s(&missing)
        )
    );
    let url = format!("file://{}", s(&missing));
    let err = failing(&["plan", &url, "--layout", s(&missing)]);
    assert!(err.contains("does not exist"), "{err}");
    assert!(!err.contains("manifest.json"), "{err}");

    // A second step, older by number but later by name, to show the latest is by number.
    let layout = layout_file(dir.path(), "dp2.json", &["fsdp", "--dp", "2"]);
    let older = run.join("step-000001");
    let (code, _, stderr) = run_clean(&[
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        s(&layout),
        "--out",
        s(&older),
        "--metadata-only",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    let err = failing(&["load", s(&missing), "--layout", s(&missing)]);
    assert_eq!(
        err,
        format!(
            "error: opening checkpoint {0}: {0}: does not exist (nothing is stored there)\n",
            s(&missing)
        )
    );
    let err = failing(&["verify", s(&missing)]);
    assert!(
        err.ends_with(&format!(
            "{}: does not exist (nothing is stored there)\n",
            s(&missing)
        )),
        "{err}"
    );
    for command in ["inspect", "verify"] {
        let err = failing(&[command, s(run)]);
        assert_eq!(
            err,
            format!(
                "error: opening checkpoint {}: run: a run directory, not a checkpoint: it holds 2 \
                 steps (step-000001, step-000005); the latest is step-000005 (give a step's \
                 directory, e.g. run/step-000005)\n",
                s(run)
            ),
            "{command}"
        );
    }

    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    assert_eq!(
        failing(&["inspect", s(&empty)]),
        format!(
            "error: opening checkpoint {0}: {0}: an empty directory, not a checkpoint\n",
            s(&empty)
        )
    );
}

/// Runs `tessera <args>` for at most 30 s (a server that should have refused to start is
/// killed, and the test fails); returns (exit code, stdout, stderr).
fn run_bounded(args: &[&str]) -> (Option<i32>, String, String) {
    let mut child = Command::new(BIN)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            let output = child.wait_with_output().unwrap();
            panic!(
                "tessera {args:?} still running after 30 s: {}",
                String::from_utf8_lossy(&output.stdout)
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    (
        output.status.code(),
        String::from_utf8(output.stdout).unwrap(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// `serve --root /nonexistent` started and showed an empty catalog; a taken port said only
/// "Address already in use".
#[test]
fn serve_refuses_a_missing_root_and_a_taken_port_suggests_addr() {
    let dir = tempdir();
    let missing = dir.path().join("no-such-catalog");
    let (code, stdout, stderr) =
        run_bounded(&["serve", "--root", s(&missing), "--addr", "127.0.0.1:0"]);
    assert!(code.is_some_and(|c| c != 0), "{stdout}{stderr}");
    assert!(stdout.is_empty(), "{stdout}");
    assert!(
        stderr.ends_with(&format!(
            "error: the catalog root {} does not exist: --root takes a directory (or URL) \
             holding <run>/<step> checkpoint directories\n",
            s(&missing)
        )),
        "{stderr}"
    );

    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, stdout, stderr) = run_bounded(&["serve", "--root", s(dir.path()), "--addr", &addr]);
    assert!(code.is_some_and(|c| c != 0), "{stdout}{stderr}");
    assert!(
        stderr.ends_with(&format!(
            "error: listening on {addr}: the address is taken (another server on that port?); \
             pick another with --addr, e.g. --addr 127.0.0.1:0 for any free port\n"
        )),
        "{stderr}"
    );
    // The empty root was only warned about (it got as far as binding).
    assert!(
        stderr.contains(&format!(
            "warning: the catalog root {} is empty: checkpoints show up as <run>/<step> \
             directories are saved under it\n",
            s(dir.path())
        )),
        "{stderr}"
    );
    drop(taken);
}

// ---------------------------------------------------------------------------------------------
// Output

/// `inspect --json | head` printed "error: Broken pipe (os error 32)" once head had its lines.
#[test]
fn output_into_a_closed_pipe_ends_quietly() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    for args in [
        vec!["inspect", "--json", s(&ckpt)],
        vec!["inspect", s(&ckpt)],
    ] {
        let mut child = Command::new(BIN)
            .args(&args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader closes before the first write (opening the checkpoint comes first).
        drop(child.stdout.take());
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8(output.stderr).unwrap();
        assert_eq!(stderr, "", "{args:?}");
        assert_eq!(output.status.code(), Some(0), "{args:?}");
    }
}

/// `synth --metadata-only` printed a "written" line per data file (8,192 for a large layout)
/// for files it never writes; a save with data still reports each file it writes.
#[test]
fn synth_reports_only_files_it_writes() {
    let dir = tempdir();
    let layout = layout_file(dir.path(), "dp4.json", &["fsdp", "--dp", "4"]);
    let synth = |out: &Path, extra: &[&str]| {
        let mut args = vec![
            "synth",
            "--model",
            "gpt-tiny",
            "--layout",
            s(&layout),
            "--out",
            s(out),
        ];
        args.extend_from_slice(extra);
        let (code, stdout, stderr) = run_clean(&args);
        assert_eq!(code, Some(0), "{stderr}");
        (stdout, stderr)
    };
    let metadata_only = dir.path().join("meta");
    let (stdout, stderr) = synth(&metadata_only, &["--metadata-only"]);
    assert_eq!(stderr, "");
    assert!(stdout.contains("(gpt-tiny, metadata only)"), "{stdout}");
    assert!(!metadata_only.join("data").exists());

    let with_data = dir.path().join("data");
    let (_, stderr) = synth(&with_data, &[]);
    let lines: Vec<&str> = stderr.lines().collect();
    assert_eq!(lines.len(), 4, "{stderr}");
    for rank in 0..4 {
        let file = format!("data/rank-{rank:05}.bin");
        assert!(with_data.join(&file).is_file(), "{file}");
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(&format!("  rank {rank:>5}: {file} in "))),
            "{stderr}"
        );
    }
}

/// `synth` over a committed step said "invalid checkpoint metadata" although nothing is wrong
/// with that checkpoint; it is the output location that is taken.
#[test]
fn synth_over_a_committed_step_says_it_is_taken() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let layout = layout_file(dir.path(), "dp2.json", &["fsdp", "--dp", "2"]);
    let err = failing(&[
        "synth",
        "--model",
        "gpt-tiny",
        "--layout",
        s(&layout),
        "--out",
        s(&ckpt),
    ]);
    assert_eq!(
        err,
        format!(
            "error: starting checkpoint {}: step-000005 already holds a committed checkpoint \
             (step-000005/manifest.json exists): save to another step directory, or remove this \
             one first\n",
            s(&ckpt)
        )
    );
    assert!(!err.contains("invalid checkpoint metadata"), "{err}");
}

/// `plan --rank R` in the default text format printed the JSON rank plan. Text is now for
/// people, and agrees with the JSON plan it describes.
#[test]
fn plan_rank_text_is_human_readable_and_matches_the_json() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let layout = layout_file(dir.path(), "dp3.json", &["fsdp", "--dp", "3"]);
    let base = ["plan", s(&ckpt), "--layout", s(&layout), "--rank", "1"];
    let (code, text, stderr) = run_clean(&base);
    assert_eq!(code, Some(0), "{stderr}");
    let mut json_args = base.to_vec();
    json_args.extend_from_slice(&["--format", "json"]);
    let (_, json, _) = run_clean(&json_args);
    let plan = tessera_planner::RankPlan::from_json(&json).unwrap();
    assert!(serde_json::from_str::<serde_json::Value>(&text).is_err());

    let read_here = plan.pieces.iter().filter(|p| p.read.is_some()).count();
    let human = |b: u64| tessera::human::bytes(b);
    let head = format!(
        "rank 1 of 3\n\
         destinations         {} ({})\n\
         pieces               {} ({read_here} read here, {} received)\n\
         bytes read           {} from {} files\n\
         bytes sent           {}\n\
         bytes received       {}\n",
        plan.destinations.len(),
        human(plan.summary.bytes_needed),
        plan.pieces.len(),
        plan.pieces.len() - read_here,
        human(plan.summary.bytes_read),
        plan.files.len(),
        human(plan.summary.bytes_sent),
        human(plan.summary.bytes_received),
    );
    assert!(text.starts_with(&head), "{text}");
    // Every file it reads, and every destination buffer by tensor name and part.
    let section = |name: &str| {
        let start = text.find(&format!("\n{name}\n")).expect(name) + name.len() + 2;
        text[start..].split("\n\n").next().unwrap().to_string()
    };
    let reads = section("reads");
    for file in &plan.files {
        assert!(reads.contains(&format!("  {file}  ")), "{file}: {reads}");
    }
    let destinations = section("destinations");
    assert_eq!(destinations.lines().count(), plan.destinations.len());
    assert!(
        destinations
            .lines()
            .any(|l| l.starts_with("  model.embed_tokens.weight")
                && l.contains("  [334..668, 0..64]  ")),
        "{destinations}"
    );
    // gpt-tiny saved tp2 pp2 dp2, loaded dp3: rank 1 gets some bytes from peers.
    assert!(plan.summary.bytes_received > 0);
    let peers = section("peers");
    assert!(peers.lines().all(|l| l.starts_with("  rank ")), "{peers}");
    assert!(!peers.contains("rank 1 "), "{peers}");
}

/// `inspect`/`plan`/`verify` help said "directory or file:// URL" although every store works.
#[test]
fn help_names_every_location_form() {
    for command in ["inspect", "plan", "verify", "load", "convert"] {
        let (code, help, _) = run_clean(&[command, "--help"]);
        assert_eq!(code, Some(0));
        let help = help.split_whitespace().collect::<Vec<_>>().join(" ");
        assert!(
            help.contains("a local directory, or a file://, s3://, gs://, az:// or http(s):// URL"),
            "{command}: {help}"
        );
    }
}

/// A DCP checkpoint's `inspect` listed tensors in the pickled dict's order and left out the
/// non-tensor objects (optimizer param groups, a train state): now both, sorted by name.
#[test]
fn dcp_inspect_lists_tensors_sorted_and_the_objects() {
    let fixtures = std::env::var_os("TESSERA_DCP_FIXTURES")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/dcp"));
    let ckpt = fixtures.join("e_w2_fsdp2_adamw");
    let expected: serde_json::Value =
        serde_json::from_slice(&std::fs::read(ckpt.join("expected.json")).unwrap()).unwrap();
    // Dot-separated parts, numbers by value: `blocks.2` before `blocks.10`.
    let key = |name: &str| -> Vec<(Option<u64>, String)> {
        name.split('.')
            .map(|p| (p.parse().ok(), p.to_string()))
            .map(|(n, p): (Option<u64>, String)| (n, if n.is_some() { String::new() } else { p }))
            .collect()
    };
    let mut tensors = Vec::new();
    let mut objects = Vec::new();
    for (name, entry) in expected["entries"].as_object().unwrap() {
        match entry["kind"].as_str().unwrap() {
            "tensor" => tensors.push(name.clone()),
            "bytes" => objects.push(name.clone()),
            other => panic!("{other}"),
        }
    }
    tensors.sort_by_key(|n| key(n));
    objects.sort_by_key(|n| key(n));
    assert_eq!((tensors.len(), objects.len()), (112, 14));

    let (code, text, stderr) = run_clean(&["inspect", s(&ckpt)]);
    assert_eq!(code, Some(0), "{stderr}");
    let sections: Vec<&str> = text.split("\n\n").collect();
    assert_eq!(sections.len(), 3, "{text}");
    let first_column = |section: &str, header: &str| -> Vec<String> {
        let mut lines = section.lines();
        assert!(lines.next().unwrap().starts_with(header), "{section}");
        lines
            .map(|l| l.split_whitespace().next().unwrap().to_string())
            .collect()
    };
    assert_eq!(first_column(sections[1], "FQN "), tensors);
    assert_eq!(first_column(sections[2], "OBJECT "), objects);
    // Each object row names its file and size.
    let step = sections[2]
        .lines()
        .find(|l| l.starts_with("train_state.step "))
        .unwrap();
    assert!(step.contains(".distcp"), "{step}");
    assert!(step.trim_end().ends_with('B'), "{step}");
}

// ---------------------------------------------------------------------------------------------
// Storage errors

/// Runs `tessera <args>` with the S3 test server's variables; returns (exit code, stderr).
fn run_s3(server: &tessera_storage::testing::S3TestServer, args: &[&str]) -> (Option<i32>, String) {
    let mut command = Command::new(BIN);
    command.args(args).stdin(Stdio::null());
    for (k, v) in server.env() {
        command.env(k, v);
    }
    let output = command.output().unwrap();
    assert!(
        output.stdout.is_empty(),
        "{}",
        String::from_utf8_lossy(&output.stdout)
    );
    (
        output.status.code(),
        String::from_utf8(output.stderr).unwrap(),
    )
}

/// An S3 error repeated "Generic S3 error ... NoSuchBucket" four or five times and "after 10
/// retries" three times in one line. Each cause is said once, the most specific first.
#[test]
fn a_missing_bucket_is_said_once() {
    let dir = tempdir();
    let server = tessera_storage::testing::S3TestServer::start(dir.path());
    let layout = layout_file(dir.path(), "dp2.json", &["fsdp", "--dp", "2"]);
    let location = "s3://no-such-bucket/run/step-1";
    for args in [
        vec!["inspect", location],
        vec!["verify", location],
        vec!["load", location, "--layout", s(&layout)],
    ] {
        let (code, err) = run_s3(&server, &args);
        assert!(code.is_some_and(|c| c != 0), "{args:?}: {err}");
        assert!(
            err.starts_with(
                "error: bucket no-such-bucket does not exist (404 NoSuchBucket)\n  while "
            ),
            "{args:?}: {err}"
        );
        // Before: NoSuchBucket five times, "Generic S3 error" four.
        for said_once in ["NoSuchBucket", "Generic S3 error", "404 Not Found"] {
            assert_eq!(
                err.matches(said_once).count(),
                1,
                "{said_once}: {args:?}: {err}"
            );
        }
        assert!(!err.contains("<?xml"), "{err}");
        assert_eq!(err.lines().count(), 2, "{err}");
    }
}

// ---------------------------------------------------------------------------------------------
// Layout warnings

/// A megatron layout made with `--num-layers 12` loaded a 4-layer checkpoint silently (every
/// layer on pipeline stage 0). `plan` and `load` now warn, naming the numbers; a fitting layout
/// gets no warning.
#[test]
fn a_megatron_layout_for_other_layers_is_warned_about() {
    let dir = tempdir();
    let ckpt = synth_tiny(dir.path());
    let preset = |layers: &str| {
        layout_file(
            dir.path(),
            &format!("pp2-{layers}.json"),
            &[
                "megatron-gpt",
                "--tp",
                "1",
                "--pp",
                "2",
                "--dp",
                "1",
                "--num-layers",
                layers,
            ],
        )
    };
    let wrong = preset("12");
    let warning = format!(
        "warning: layout {}: the layout's stages.num_layers is 12 but the checkpoint has 4 \
         layers (0..3): they all go to pipeline stage 0 of 2, the others hold no layer; make the \
         layout for 4 layers (e.g. `tessera layout megatron-gpt --num-layers 4`)\n",
        s(&wrong)
    );
    for command in ["plan", "load"] {
        let (code, stdout, stderr) = run_clean(&[command, s(&ckpt), "--layout", s(&wrong)]);
        assert_eq!(code, Some(0), "{stderr}");
        assert!(!stdout.is_empty());
        assert_eq!(
            stderr.matches("warning: ").count(),
            1,
            "{command}: {stderr}"
        );
        assert!(stderr.contains(&warning), "{command}: {stderr}");
    }
    let right = preset("4");
    let (code, _, stderr) = run_clean(&["plan", s(&ckpt), "--layout", s(&right)]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
}
