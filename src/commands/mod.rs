//! The subcommands of the `tessera` binary, one module each.

pub mod convert;
pub mod demo;
pub mod error_text;
pub mod gc;
pub mod inspect;
pub mod layout;
pub mod live;
pub mod load;
pub mod plan;
pub mod select;
pub mod serve;
pub mod synth;
pub mod target;
pub mod verify;

use std::time::Duration;

use anyhow::{Context, Result, bail};
use tessera_loader::checkpoint::Checkpoint;
use tessera_metadata::OpenedCheckpoint;
use tessera_planner::Layout;
use tessera_storage::{RetryPolicy, StorageOptions};

pub use tessera_ops::open::{CACHE_DIR_ENV, open_options};

/// Environment variable of `--storage-read-timeout`.
pub const READ_TIMEOUT_ENV: &str = "TESSERA_STORAGE_READ_TIMEOUT";
/// Environment variable of `--storage-attempts`.
pub const ATTEMPTS_ENV: &str = "TESSERA_STORAGE_ATTEMPTS";

/// The one retry policy of a command's stores and reads: the defaults, with the read timeout
/// (seconds of silence before a request is cut) and the attempts per request the operator gave
/// (`--storage-read-timeout`, `--storage-attempts`, or [`READ_TIMEOUT_ENV`], [`ATTEMPTS_ENV`]).
/// They set how soon a load from a store that stalls fails (docs/retry.md). The whole-request
/// timeout is raised to the read timeout when that is longer, so that a long read timeout is not
/// cut short by it.
pub fn storage_policy(read_timeout_secs: f64, attempts: u32) -> Result<RetryPolicy> {
    if !(read_timeout_secs > 0.0 && read_timeout_secs.is_finite()) {
        bail!(
            "--storage-read-timeout ({READ_TIMEOUT_ENV}) must be a positive number of seconds, not {read_timeout_secs}"
        );
    }
    if attempts == 0 {
        bail!("--storage-attempts ({ATTEMPTS_ENV}) must be at least 1");
    }
    let defaults = RetryPolicy::default();
    let read_timeout = Duration::try_from_secs_f64(read_timeout_secs)
        .with_context(|| format!("--storage-read-timeout {read_timeout_secs}"))?;
    Ok(RetryPolicy {
        max_attempts: attempts,
        read_timeout,
        request_timeout: defaults.request_timeout.max(read_timeout),
        ..defaults
    })
}

/// How patient the checkpoint's storage requests are (load, inspect, verify, convert, plan): the
/// two numbers the operator sets, as flags (or variables), and in `tessera load`'s arguments as
/// JSON (those it hands the rank processes it spawns); [`StorageArgs::policy`] refuses them as
/// the flags are.
#[derive(clap::Args, Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct StorageArgs {
    /// Seconds a storage request may go without receiving data (mid-body or before the answer)
    /// before it is cut and retried. With --storage-attempts it bounds how soon a load from a
    /// store that stalls fails: about attempts x this (see docs/retry.md).
    #[arg(
        long,
        env = READ_TIMEOUT_ENV,
        value_name = "SECS",
        default_value_t = RetryPolicy::default().read_timeout.as_secs_f64()
    )]
    pub storage_read_timeout: f64,
    /// Attempts per storage request before a transient failure (a timeout, a reset
    /// connection, a 5xx answer) fails the command.
    #[arg(
        long,
        env = ATTEMPTS_ENV,
        value_name = "N",
        default_value_t = RetryPolicy::default().max_attempts
    )]
    pub storage_attempts: u32,
}

impl StorageArgs {
    /// The retry policy of the two flags ([`storage_policy`]).
    pub fn policy(&self) -> Result<RetryPolicy> {
        storage_policy(self.storage_read_timeout, self.storage_attempts)
    }
}

/// Storage options that give every store `retry`'s timeouts.
pub fn storage_options(retry: &RetryPolicy) -> StorageOptions {
    StorageOptions {
        retry: retry.clone(),
        ..StorageOptions::default()
    }
}

/// Opens the checkpoint at `location` in whatever format it is (see `tessera_ops::open`), its
/// store with `retry`'s timeouts.
pub async fn open(location: &str, retry: &RetryPolicy) -> Result<OpenedCheckpoint> {
    Ok(
        tessera_ops::open::open_at_with(location, &storage_options(retry))
            .await?
            .1,
    )
}

/// Opens the checkpoint at `location` for loading (block checksums included for native ones),
/// its store with `retry`'s timeouts, its DCP blob index cached in `cache_dir` when given;
/// refuses a metadata-only checkpoint (`tessera_ops::open::open_for_load`).
pub async fn open_for_load(
    location: &str,
    retry: &RetryPolicy,
    cache_dir: Option<&std::path::Path>,
) -> Result<Checkpoint> {
    Ok(tessera_ops::open::open_for_load(location, &storage_options(retry), cache_dir).await?)
}

/// Whether `err` comes from writing to a pipe whose reader has closed it (`tessera inspect
/// --json | head`). Rust ignores SIGPIPE, so such a write fails with EPIPE instead of ending the
/// process as it would a C tool; the front end ends quietly as those do.
pub fn is_broken_pipe(err: &anyhow::Error) -> bool {
    err.chain().any(|cause| {
        cause
            .downcast_ref::<std::io::Error>()
            .is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

/// Reads a layout JSON file (`-` for standard input).
pub fn read_layout(path: &str) -> Result<Layout> {
    let text = read_text(path)?;
    Layout::from_json(&text).with_context(|| format!("reading layout {path}"))
}

/// Prints to stderr what in the layout at `path` does not fit `tensors` though it resolves
/// ([`Layout::warnings`]: stages made for another number of layers).
pub fn warn_layout(path: &str, layout: &Layout, tensors: &[tessera_metadata::TensorMeta]) {
    for warning in layout.warnings(tensors) {
        eprintln!("warning: layout {path}: {warning}");
    }
}

/// Reads a text file, or standard input for `-`.
pub fn read_text(path: &str) -> Result<String> {
    if path == "-" {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)
            .context("reading standard input")?;
        return Ok(text);
    }
    std::fs::read_to_string(path).with_context(|| format!("reading {path}"))
}
