//! The subcommands of the `tessera` binary, one module each.

pub mod convert;
pub mod demo;
pub mod inspect;
pub mod layout;
pub mod load;
pub mod plan;
pub mod synth;
pub mod verify;

use anyhow::{Context, Result};
use tessera_metadata::native::{NativeCheckpoint, open_checkpoint};
use tessera_planner::Layout;

use crate::storage;

/// Opens a committed native checkpoint at `location`.
pub async fn open(location: &str) -> Result<NativeCheckpoint> {
    let loc = storage::open(location)?;
    open_checkpoint(loc.store.as_ref(), &loc.prefix)
        .await
        .with_context(|| format!("opening checkpoint {location}"))
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
