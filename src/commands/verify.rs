//! `tessera verify`: check what a checkpoint's format lets us check. Native: every block checksum,
//! every box's and object's own crc32c, and no stray file under the checkpoint (on local disk
//! also the staging files `<name>#<n>` a killed upload leaves, which the object store hides).
//! PyTorch DCP: the structure (metadata, every blob's zip directory and `data.pkl`, byte ranges)
//! and the zip CRC-32 of every tensor storage and object blob (a blob saved compressed, DCP's
//! ZStandard extension, over its decoded bytes, the whole stream decoded). safetensors: headers, byte ranges
//! (no overlap, no hole, inside the file); the format records no checksums of the data.
//! DeepSpeed: the torch.save files' structure and layout, and the zip CRC-32 of every record.
//! ByteCheckpoint: the structure (metadata, every chunk's rebuild descriptor against its byte
//! range) and the zip CRC-32 of its torch.save objects; raw storage bytes carry no checksum.

use std::fmt::Write;

use anyhow::{Context, Result};
use tessera_metadata::formats::bytecheckpoint::verify_bytecheckpoint;
use tessera_metadata::formats::dcp::{BadBlob, verify_dcp};
use tessera_metadata::formats::deepspeed::verify_deepspeed;
use tessera_metadata::formats::list_dir;
use tessera_metadata::formats::native::{self, verify_checkpoint};
use tessera_metadata::{FormatDetails, open_any};

use crate::human;
use tessera_storage as storage;

/// Reads in flight while checking DCP blobs.
const CONCURRENCY: usize = 16;

/// Runs the command; an error (non-zero exit) when anything is wrong, listing every bad block,
/// box, blob or stray file.
pub async fn run(location: &str, retry: &storage::RetryPolicy) -> Result<String> {
    check(location, Strays::Fail, retry).await
}

/// The error of a verification that found problems: `out`'s lines are the problems. Its own type
/// (exit code 4, `problems` in the `--json` error) so that it is told from an unreadable
/// checkpoint.
/// Lists what a zip CRC-32 check found bad (`what`: blob, record), one line each, and fails the
/// verification when there is anything.
fn refuse_bad(out: &mut String, what: &str, bad: &[BadBlob], location: &str) -> Result<()> {
    for bad in bad {
        writeln!(
            out,
            "bad {what} in {} bytes {}..{} ({}): {}",
            bad.file, bad.start, bad.end, bad.entry, bad.detail
        )?;
    }
    if bad.is_empty() {
        Ok(())
    } else {
        Err(failed(out, location))
    }
}

fn failed(out: &str, location: &str) -> anyhow::Error {
    anyhow::Error::new(crate::exit::VerificationFailed {
        location: location.to_string(),
        problems: out.lines().map(str::to_string).collect(),
    })
}

/// What stray files under a native checkpoint mean.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strays {
    /// They fail verification (`tessera verify`: the directory is not what the manifest says).
    Fail,
    /// They are not looked for (a source about to be read: they cannot change what is read).
    Ignore,
}

/// Verifies the checkpoint at `location` as far as its format allows (see the module docs); an
/// error listing everything that is wrong, or a one-line summary.
pub async fn check(location: &str, strays: Strays, retry: &storage::RetryPolicy) -> Result<String> {
    let loc = storage::open_with(location, &super::storage_options(retry))?;
    tessera_ops::open::check_local(location)
        .with_context(|| format!("opening checkpoint {location}"))?;
    let listing = list_dir(loc.store.as_ref(), &loc.prefix)
        .await
        .with_context(|| format!("opening checkpoint {location}"))?;
    let native = listing.files.contains_key(native::MANIFEST_FILE)
        || listing.files.contains_key(native::METADATA_FILE)
        || listing.dirs.contains(native::DATA_DIR);
    if native {
        return verify_native(location, &loc, strays).await;
    }
    let mut options = super::open_options();
    options.block_checksums = false;
    let opened = open_any(loc.store.as_ref(), &loc.prefix, &options)
        .await
        .with_context(|| format!("opening checkpoint {location}"))?;
    let mut out = String::new();
    match &opened.details {
        FormatDetails::Dcp(dcp) => {
            let report = verify_dcp(
                loc.store.as_ref(),
                &opened.root,
                &opened.meta,
                dcp,
                CONCURRENCY,
            )
            .await?;
            refuse_bad(&mut out, "blob", &report.bad, location)?;
            writeln!(
                out,
                "{location}: ok, PyTorch DCP: metadata, {} blob headers and byte ranges are consistent; \
                 {} tensor storages and {} objects match their zip CRC-32, {} checked{}",
                dcp.blobs.len() + opened.meta.objects().len(),
                report.tensors_checked,
                report.objects_checked,
                human::bytes(report.bytes_checked),
                if report.unchecked > 0 {
                    format!(
                        "; {} safetensors-format blobs have no checksum",
                        report.unchecked
                    )
                } else {
                    String::new()
                }
            )?;
        }
        FormatDetails::ByteCheckpoint(bc) => {
            let report = verify_bytecheckpoint(
                loc.store.as_ref(),
                &opened.root,
                &opened.meta,
                bc,
                CONCURRENCY,
            )
            .await?;
            refuse_bad(&mut out, "blob", &report.bad, location)?;
            writeln!(
                out,
                "{location}: ok, ByteCheckpoint: metadata, {} rebuild descriptors and byte ranges are \
                 consistent (raw storage bytes: no checksum recorded); {} torch.save objects match \
                 their zip CRC-32, {} checked",
                report.chunks_unchecked,
                report.objects_checked,
                human::bytes(report.bytes_checked),
            )?;
        }
        FormatDetails::Safetensors(st) => {
            for file in &st.files {
                let data_end = file.header.data_start
                    + file.header.tensors.last().map_or(0, |t| t.data_offsets.1);
                if file.size > data_end {
                    writeln!(
                        out,
                        "note: {} has {} bytes after its last tensor",
                        file.path,
                        file.size - data_end
                    )?;
                }
            }
            writeln!(
                out,
                "{location}: ok, safetensors: {} files, {} tensors; headers parse and every tensor's \
                 byte range lies inside its file with no overlap or hole (safetensors records no \
                 checksums: data bytes not verified)",
                st.files.len(),
                opened.meta.tensors().len()
            )?;
        }
        FormatDetails::DeepSpeed(ds) => {
            let report = verify_deepspeed(
                loc.store.as_ref(),
                &opened.root,
                &opened.meta,
                ds,
                CONCURRENCY,
            )
            .await?;
            refuse_bad(&mut out, "record", &report.bad, location)?;
            writeln!(
                out,
                "{location}: ok, DeepSpeed ZeRO: {} torch.save files parse and their layout is consistent; \
                 {} records (storages and pickles) match their zip CRC-32, {} checked",
                opened.meta.files().len(),
                report.records_checked,
                human::bytes(report.bytes_checked)
            )?;
        }
        FormatDetails::Native { .. } => return verify_native(location, &loc, strays).await,
    }
    Ok(out)
}

async fn verify_native(location: &str, loc: &storage::Location, strays: Strays) -> Result<String> {
    let mut report = verify_checkpoint(loc.store.as_ref(), &loc.prefix).await?;
    match strays {
        Strays::Ignore => report.stray_files.clear(),
        Strays::Fail => {
            if let Some(dir) = storage::local_directory(location) {
                report.stray_files.extend(storage::staged_uploads(&dir)?);
                report.stray_files.sort();
            }
        }
    }
    let mut out = String::new();
    for stray in &report.stray_files {
        writeln!(
            out,
            "stray file {stray}: not part of the checkpoint (left by an interrupted writer? remove it)"
        )?;
    }
    if report.data_absent && !report.is_ok() {
        return Err(failed(&out, location));
    }
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
    for b in &report.bad_boxes {
        writeln!(out, "bad box: {}", b.to_error())?;
    }
    if !report.is_ok() {
        return Err(failed(&out, location));
    }
    writeln!(
        out,
        "{location}: ok, {} files, {} checked",
        report.files,
        human::bytes(report.bytes_checked)
    )?;
    Ok(out)
}

/// `verify --json`: the checkpoint, `ok: true` (a failure is the error document, with its
/// `problems`), the notes (strays, trailing bytes) and the summary line.
pub fn json_report(location: &str, text: &str) -> String {
    let mut lines: Vec<&str> = text.lines().collect();
    let summary = lines.pop().unwrap_or_default();
    let doc = serde_json::json!({
        "checkpoint": location,
        "ok": true,
        "notes": lines,
        "summary": summary,
    });
    format!("{doc:#}\n")
}
