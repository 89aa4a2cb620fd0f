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

use std::sync::Arc;

use anyhow::{Context, Result};
use object_store::ObjectStore;
use tessera_loader::load::Checkpoint;
use tessera_metadata::{OpenOptions, OpenedCheckpoint, open_any};
use tessera_planner::Layout;

use tessera_storage as storage;

/// Environment variable naming a local directory where DCP blob indexes are cached between runs
/// (every rank process of `load --transport tcp` shares it). Never the checkpoint's directory.
pub const CACHE_DIR_ENV: &str = "TESSERA_CACHE_DIR";

/// Open options of the commands: the DCP index cache directory from [`CACHE_DIR_ENV`].
pub fn open_options() -> OpenOptions {
    let mut options = OpenOptions::default();
    options.dcp.cache_dir = std::env::var_os(CACHE_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map(std::path::PathBuf::from);
    options
}

/// Opens the checkpoint at `location` in whatever format it is (native, PyTorch DCP,
/// safetensors), without reading native block checksums (describing and planning do not need
/// them).
pub async fn open(location: &str) -> Result<OpenedCheckpoint> {
    Ok(open_at(location).await?.1)
}

/// [`open`], also returning the store the checkpoint is in.
pub async fn open_at(location: &str) -> Result<(Arc<dyn ObjectStore>, OpenedCheckpoint)> {
    open_at_with(location, &storage::StorageOptions::default()).await
}

/// [`open_at`] with storage options (credentials and endpoints on top of the environment).
pub async fn open_at_with(
    location: &str,
    storage_options: &storage::StorageOptions,
) -> Result<(Arc<dyn ObjectStore>, OpenedCheckpoint)> {
    let loc = storage::open_with(location, storage_options)?;
    let mut options = open_options();
    options.block_checksums = false;
    let opened = open_any(loc.store.as_ref(), &loc.prefix, &options)
        .await
        .with_context(|| format!("opening checkpoint {location}"))?;
    Ok((loc.store, opened))
}

/// Opens the checkpoint at `location` for loading (block checksums included for native ones).
pub async fn open_for_load(location: &str) -> Result<Checkpoint> {
    let loc = storage::open(location)?;
    Checkpoint::open_with(loc, &open_options())
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
