//! `tessera inspect`: what a checkpoint holds.

use std::fmt::Write;

use anyhow::Result;
use serde_json::json;
use tessera_metadata::native::DataPresence;

use crate::human;

/// Runs the command; returns what goes to stdout.
pub async fn run(location: &str, as_json: bool) -> Result<String> {
    let checkpoint = super::open(location).await?;
    let manifest = &checkpoint.manifest;
    let meta = &checkpoint.meta;
    if as_json {
        let tensors: Vec<_> = meta
            .tensors()
            .iter()
            .enumerate()
            .map(|(t, tensor)| {
                let boxes: Vec<_> = meta
                    .chunks_of(t as u32)
                    .iter()
                    .map(|c| {
                        json!({
                            "offsets": c.region.offsets,
                            "lengths": c.region.lengths,
                            "file": meta.files()[c.bytes.file as usize].path,
                            "byte_offset": c.bytes.offset,
                            "byte_length": c.bytes.length,
                            "crc32c": c.crc32c,
                        })
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
        let doc = json!({ "location": location, "manifest": manifest, "tensors": tensors });
        return Ok(serde_json::to_string_pretty(&doc)? + "\n");
    }
    let mut out = String::new();
    let data = match manifest.data {
        DataPresence::Present => "data present",
        DataPresence::Absent => "metadata only",
    };
    writeln!(
        out,
        "checkpoint {location}: {} format v{}, step {}, committed, {data}",
        manifest.format,
        manifest.format_version,
        manifest.step.map_or("-".to_string(), |s| s.to_string())
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
