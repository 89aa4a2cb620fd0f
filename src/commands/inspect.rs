//! `tessera inspect`: what a checkpoint holds.

use std::fmt::Write;

use anyhow::{Context, Result};
use object_store::{ObjectStore, ObjectStoreExt};
use serde_json::{Value, json};
use tessera_metadata::formats::SafetensorsLayout;
use tessera_metadata::formats::dcp::{IndexSource, IndexStats, decode_object};
use tessera_metadata::formats::native::DataPresence;
use tessera_metadata::{FormatDetails, OpenedCheckpoint};

use crate::human;
use tessera_storage::StorageOptions;

/// Runs the command; returns what goes to stdout. Native, PyTorch DCP and safetensors
/// checkpoints are described alike (tensors, boxes, byte ranges); the header says what the
/// format records (native: manifest; DCP: metadata version and the blob index; safetensors: how
/// its files were found).
pub async fn run(location: &str, as_json: bool) -> Result<String> {
    if as_json {
        let doc = describe(location, &StorageOptions::default()).await?;
        return Ok(serde_json::to_string_pretty(&doc)? + "\n");
    }
    let (_store, checkpoint) = super::open_at(location).await?;
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
    let width = meta
        .tensors()
        .iter()
        .map(|t| t.fqn.len())
        .max()
        .unwrap_or(3)
        .max(3);
    writeln!(
        out,
        "\n{:width$}  {:6}  {:18}  {:>6}  {:>12}",
        "FQN", "DTYPE", "SHAPE", "BOXES", "BYTES"
    )?;
    for (t, tensor) in meta.tensors().iter().enumerate() {
        writeln!(
            out,
            "{:width$}  {:6}  {:18}  {:>6}  {:>12}",
            tensor.fqn,
            tensor.dtype.name(),
            human::shape(&tensor.shape),
            meta.chunks_of(t as u32).len(),
            human::bytes(tensor.nbytes())
        )?;
    }
    Ok(out)
}

/// What `inspect --json` prints, as a JSON value: format, step, every tensor with its saved boxes
/// (file and byte range), and the format's own details. Also what the Python package's
/// `tessera.inspect` returns.
pub async fn describe(location: &str, storage_options: &StorageOptions) -> Result<Value> {
    let (store, checkpoint) = super::open_at_with(location, storage_options).await?;
    let meta = &checkpoint.meta;
    let tensors: Vec<_> = meta
        .tensors()
        .iter()
        .enumerate()
        .map(|(t, tensor)| {
            let boxes: Vec<_> = meta
                .chunks_of(t as u32)
                .iter()
                .map(|c| {
                    let mut b = json!({
                        "offsets": c.region.offsets,
                        "lengths": c.region.lengths,
                        "file": meta.files()[c.bytes.file as usize].path,
                        "byte_offset": c.bytes.offset,
                        "byte_length": c.bytes.length,
                        "crc32c": c.crc32c,
                    });
                    if let Some(strides) = &c.bytes.strides {
                        b["strides"] = json!(strides);
                    }
                    b
                })
                .collect();
            json!({
                "fqn": tensor.fqn,
                "dtype": tensor.dtype,
                "shape": tensor.shape,
                "bytes": tensor.nbytes(),
                "boxes": boxes,
            })
        })
        .collect();
    let mut doc = json!({
        "location": location,
        "format": checkpoint.format,
        "step": checkpoint.step,
        "committed": checkpoint.committed,
        "tensors": tensors,
    });
    match &checkpoint.details {
        FormatDetails::Native { manifest } => doc["manifest"] = json!(manifest),
        FormatDetails::Dcp(dcp) => {
            doc["dcp"] = json!({
                "metadata_files": dcp.metadata_files,
                "version": dcp.metadata.version,
                "checkpoint_id": dcp.metadata.checkpoint_id,
                "save_id": dcp.metadata.save_id,
                "index": dcp.stats,
            });
            doc["objects"] = objects_json(store.as_ref(), &checkpoint).await?;
        }
        FormatDetails::Safetensors(st) => {
            doc["safetensors"] = json!({
                "layout": layout_name(st.layout),
                "files": st.files.iter().map(|f| json!({
                    "path": f.path,
                    "size": f.size,
                    "metadata": f.header.metadata,
                })).collect::<Vec<_>>(),
            });
        }
    }
    Ok(doc)
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

fn layout_name(layout: SafetensorsLayout) -> &'static str {
    match layout {
        SafetensorsLayout::SingleFile => "single file",
        SafetensorsLayout::Directory => "directory",
        SafetensorsLayout::Index => "HF index model.safetensors.index.json",
        SafetensorsLayout::DcpSharded => "DCP HF writer, sharded/",
    }
}

/// The non-tensor entries of a DCP checkpoint, each with its decoded value when it is a simple
/// Python value.
async fn objects_json(store: &dyn ObjectStore, checkpoint: &OpenedCheckpoint) -> Result<Value> {
    let meta = &checkpoint.meta;
    let location = checkpoint.root.clone();
    let mut objects = Vec::with_capacity(meta.objects().len());
    for object in meta.objects() {
        let file = &meta.files()[object.file as usize].path;
        let path = location.clone().join(file.as_str());
        let bytes = store
            .get_range(&path, object.offset..object.offset + object.length)
            .await
            .with_context(|| format!("reading object {}", object.key))?;
        let mut entry = json!({
            "key": object.key,
            "file": file,
            "byte_offset": object.offset,
            "byte_length": object.length,
        });
        match decode_object(&bytes) {
            Ok(value) => entry["value"] = value,
            Err(e) => entry["value_error"] = json!(e.to_string()),
        }
        objects.push(entry);
    }
    Ok(Value::Array(objects))
}
