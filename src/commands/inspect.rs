//! `tessera inspect`: what a checkpoint holds.

use std::fmt::Write;

use anyhow::Result;
use tessera_metadata::formats::dcp::{IndexSource, IndexStats, MegatronDetails};
use tessera_metadata::formats::native::DataPresence;
use tessera_metadata::{CheckpointMeta, FormatDetails};
use tessera_ops::describe::{describe, layout_name};
use tessera_storage::RetryPolicy;

use crate::human;

/// Runs the command; returns what goes to stdout. Native, PyTorch DCP and safetensors
/// checkpoints are described alike (tensors, boxes, byte ranges); the header says what the
/// format records (native: manifest; DCP: metadata version and the blob index; safetensors: how
/// its files were found).
pub async fn run(location: &str, as_json: bool, retry: &RetryPolicy) -> Result<String> {
    if as_json {
        let doc = describe(location, &super::storage_options(retry)).await?;
        return Ok(serde_json::to_string_pretty(&doc)? + "\n");
    }
    let checkpoint = super::open(location, retry).await?;
    let meta = &checkpoint.meta;
    let mut out = String::new();
    let step = checkpoint.step.map_or("-".to_string(), |s| s.to_string());
    match &checkpoint.details {
        FormatDetails::Native { manifest } => {
            let data = match manifest.data {
                DataPresence::Present => "data present",
                DataPresence::Absent => "metadata only",
            };
            writeln!(
                out,
                "checkpoint {location}: {} format v{}, step {step}, committed, {data}",
                manifest.format, manifest.format_version,
            )?;
            writeln!(
                out,
                "{} tensors, {} saved boxes, {} objects, {} data files, {} of tensors, metadata {}",
                manifest.tensors,
                manifest.chunks,
                manifest.objects,
                manifest.files.len(),
                human::bytes(manifest.tensor_bytes),
                human::bytes(manifest.metadata.size)
            )?;
            if let Some(layout) = &manifest.source_layout
                && let Some(mesh) = layout.get("mesh").and_then(|m| m.as_array())
            {
                let dims: Vec<String> = mesh
                    .iter()
                    .map(|d| format!("{}={}", d["name"].as_str().unwrap_or("?"), d["size"]))
                    .collect();
                writeln!(out, "saved with mesh {}", dims.join(" "))?;
            }
        }
        FormatDetails::Dcp(dcp) => {
            writeln!(
                out,
                "checkpoint {location}: PyTorch DCP{}, step {step}, committed ({} present), read in place",
                dcp.metadata
                    .version
                    .as_ref()
                    .map_or(String::new(), |v| format!(" metadata v{v}")),
                dcp.metadata_files.join(", ")
            )?;
            writeln!(
                out,
                "{} tensors, {} saved boxes, {} objects, {} data files, {} of tensors, metadata {}",
                meta.tensors().len(),
                meta.chunks().len(),
                meta.objects().len(),
                meta.files().len(),
                human::bytes(meta.tensor_bytes()),
                human::bytes(dcp.stats.metadata_bytes)
            )?;
            writeln!(out, "{}", index_line(&dcp.stats))?;
            if let Some(megatron) = &dcp.megatron {
                writeln!(out, "{}", megatron_line(megatron))?;
            }
        }
        FormatDetails::DeepSpeed(ds) => {
            writeln!(
                out,
                "checkpoint {location}: {}, step {step}, {}{} data-parallel ranks, read in place",
                checkpoint
                    .writer
                    .as_ref()
                    .map_or("DeepSpeed".to_string(), ToString::to_string),
                ds.tag
                    .as_ref()
                    .map_or(String::new(), |t| format!("tag {t} (from latest), ")),
                ds.dp_world_size
            )?;
            writeln!(
                out,
                "{} tensors, {} saved boxes, {} objects, {} data files, {} of tensors, {} read in {} requests at open",
                meta.tensors().len(),
                meta.chunks().len(),
                meta.objects().len(),
                meta.files().len(),
                human::bytes(meta.tensor_bytes()),
                human::bytes(ds.bytes_read),
                ds.requests
            )?;
        }
        FormatDetails::ByteCheckpoint(bc) => {
            writeln!(
                out,
                "checkpoint {location}: {}, step {step}, committed ({}{}), read in place",
                checkpoint
                    .writer
                    .as_ref()
                    .map_or("ByteCheckpoint".to_string(), ToString::to_string),
                tessera_metadata::formats::bytecheckpoint::component_names(bc),
                bc.followed
                    .as_ref()
                    .map_or(String::new(), |d| format!(" in {d}, from the tracker"))
            )?;
            writeln!(
                out,
                "{} tensors, {} saved boxes, {} objects, {} data files, {} of tensors, metadata {}",
                meta.tensors().len(),
                meta.chunks().len(),
                meta.objects().len(),
                meta.files().len(),
                human::bytes(meta.tensor_bytes()),
                human::bytes(bc.components.iter().map(|c| c.metadata_bytes).sum())
            )?;
        }
        FormatDetails::Safetensors(st) => {
            writeln!(
                out,
                "checkpoint {location}: safetensors ({}), step {step}, read in place",
                layout_name(st.layout)
            )?;
            writeln!(
                out,
                "{} tensors, {} saved boxes, {} data files, {} of tensors, headers {}",
                meta.tensors().len(),
                meta.chunks().len(),
                meta.files().len(),
                human::bytes(meta.tensor_bytes()),
                human::bytes(st.files.iter().map(|f| f.header.data_start).sum())
            )?;
        }
    }
    out.push('\n');
    out.push_str(&tensor_table(meta));
    Ok(out)
}

/// `written by Megatron-Core torch_dist (version …); N tensors stored reformulated
/// (flattened_range), shown in their original shapes; common state in …`.
fn megatron_line(megatron: &MegatronDetails) -> String {
    let mut line = format!("written by {}", megatron.writer());
    if !megatron.reformulated.is_empty() {
        line.push_str(&format!(
            "; {} tensors stored reformulated (flattened_range), shown in their original shapes",
            megatron.reformulated.len()
        ));
    }
    if let Some(common) = &megatron.common_state {
        line.push_str(&format!("; common state in {common}"));
    }
    line
}

/// Widest the FQN column gets: longer names are printed whole and push their own row's other
/// columns right, instead of widening every row of the table.
const MAX_FQN_COLUMN: usize = 96;

/// The tensor table: one row per tensor with its dtype, shape, saved boxes and bytes. Padding is
/// done by hand: `format!("{:width$}")` panics ("Formatting argument out of range") for a width
/// over u16::MAX, which a 65,536-character tensor name gave.
pub fn tensor_table(meta: &CheckpointMeta) -> String {
    let width = meta
        .tensors()
        .iter()
        .map(|t| t.fqn.chars().count())
        .max()
        .unwrap_or(3)
        .clamp(3, MAX_FQN_COLUMN);
    let mut out = String::new();
    let mut row = |fqn: &str, dtype: &str, shape: &str, boxes: &str, bytes: &str| {
        out.push_str(&human::pad_right(fqn, width));
        out.push_str("  ");
        out.push_str(&human::pad_right(dtype, 6));
        out.push_str("  ");
        out.push_str(&human::pad_right(shape, 18));
        out.push_str("  ");
        out.push_str(&human::pad_left(boxes, 6));
        out.push_str("  ");
        out.push_str(&human::pad_left(bytes, 12));
        out.push('\n');
    };
    row("FQN", "DTYPE", "SHAPE", "BOXES", "BYTES");
    for (t, tensor) in meta.tensors().iter().enumerate() {
        // Checked: metadata validation bounds numel × dtype size, but rendering must not rely on
        // it (it runs on whatever the reader accepted).
        let bytes = tensor
            .shape
            .iter()
            .try_fold(tensor.dtype.size(), |acc, &d| acc.checked_mul(d))
            .map_or_else(|| "over 2^64 B".to_string(), human::bytes);
        row(
            &tensor.fqn,
            tensor.dtype.name(),
            &human::shape(&tensor.shape),
            &meta.chunks_of(t as u32).len().to_string(),
            &bytes,
        );
    }
    out
}

/// The line that says what indexing a DCP checkpoint's blobs cost.
pub fn index_line(stats: &IndexStats) -> String {
    match stats.source {
        IndexSource::Built => format!(
            "blob index: {} torch.save blobs, {} of zip headers read in {} requests",
            stats.blobs,
            human::bytes(stats.bytes_read),
            stats.requests
        ),
        IndexSource::Memory => format!(
            "blob index: {} torch.save blobs, from the in-memory cache",
            stats.blobs
        ),
        IndexSource::Disk => format!(
            "blob index: {} torch.save blobs, from the cache directory (no header reads)",
            stats.blobs
        ),
    }
}
