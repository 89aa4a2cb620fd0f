//! `tessera verify`: check every checksum of a checkpoint.

use std::fmt::Write;

use anyhow::{Result, bail};
use tessera_metadata::native::verify_checkpoint;

use crate::human;
use crate::storage;

/// Runs the command; an error (non-zero exit) when anything is wrong, listing every bad block.
pub async fn run(location: &str) -> Result<String> {
    let loc = storage::open(location)?;
    let report = verify_checkpoint(loc.store.as_ref(), &loc.prefix).await?;
    let mut out = String::new();
    if report.data_absent {
        writeln!(
            out,
            "{location}: metadata-only checkpoint; metadata and manifest checksums are fine, no data to check"
        )?;
        return Ok(out);
    }
    for missing in &report.missing_files {
        writeln!(out, "missing file {missing}")?;
    }
    for m in &report.size_mismatches {
        writeln!(
            out,
            "{}: size {} but the manifest says {}",
            m.file, m.actual, m.expected
        )?;
    }
    for b in &report.bad_blocks {
        writeln!(
            out,
            "bad block in {} bytes {}..{}: expected crc32c {:08x}, found {:08x}",
            b.file, b.start, b.end, b.expected, b.actual
        )?;
    }
    if !report.is_ok() {
        bail!("{out}{location}: verification failed");
    }
    writeln!(
        out,
        "{location}: ok, {} files, {} checked",
        report.files,
        human::bytes(report.bytes_checked)
    )?;
    Ok(out)
}
