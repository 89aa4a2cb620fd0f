//! The subcommands of the `tessera` binary, one module each.

pub mod convert;
pub mod demo;
pub mod inspect;
pub mod layout;
pub mod load;
pub mod plan;
pub mod serve;
pub mod synth;
pub mod verify;

use anyhow::{Context, Result};
use tessera_loader::load::Checkpoint;
use tessera_metadata::OpenedCheckpoint;
use tessera_planner::Layout;
use tessera_storage::StorageOptions;

pub use tessera_ops::open::{CACHE_DIR_ENV, open_options};

/// Opens the checkpoint at `location` in whatever format it is (see `tessera_ops::open`).
pub async fn open(location: &str) -> Result<OpenedCheckpoint> {
    Ok(tessera_ops::open::open(location).await?)
}

/// Opens the checkpoint at `location` for loading (block checksums included for native ones).
pub async fn open_for_load(location: &str) -> Result<Checkpoint> {
    Ok(tessera_ops::open::open_for_load(location, &StorageOptions::default()).await?)
}

/// Reads a layout JSON file (`-` for standard input).
pub fn read_layout(path: &str) -> Result<Layout> {
    let text = read_text(path)?;
    Layout::from_json(&text).with_context(|| format!("reading layout {path}"))
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
