//! The CLI's messages to a new user (issue 17): a rank without a rendezvous address says what is
//! missing, storage errors print each cause once, paths that are not checkpoints say what they
//! are, output into a closed pipe ends quietly, and text output is for people.

#![allow(clippy::unwrap_used)]

mod support;

use std::path::Path;
use std::process::{Command, Stdio};

use support::{BIN, layout_file, run_in, s, synth_tiny};

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
         (--master-addr HOST or MASTER_ADDR) and the master port (--master-port PORT or \
         MASTER_PORT) are not given: every rank needs rank 0's address (torchrun sets \
         MASTER_ADDR and MASTER_PORT)\n"
    );
}
