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
                "{}",
                counts_line(
                    meta,
                    &format!("metadata {}", human::bytes(dcp.stats.metadata_bytes))
                )
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
                "{}",
                counts_line(
                    meta,
                    &format!(
                        "{} read in {} requests at open",
                        human::bytes(ds.bytes_read),
                        ds.requests
                    )
                )
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
                "{}",
                counts_line(
                    meta,
                    &format!(
                        "metadata {}",
                        human::bytes(bc.components.iter().map(|c| c.metadata_bytes).sum())
                    )
                )
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
    // DCP metadata keeps tensors in the order of a dict torch pickled (state-dict insertion
    // order, per rank, merged), which reads as random: sort it. Formats written in model order
    // (native, DeepSpeed) or sorted already (safetensors) keep theirs.
    let sorted = matches!(
        checkpoint.details,
        FormatDetails::Dcp(_) | FormatDetails::ByteCheckpoint(_)
    );
    out.push('\n');
    out.push_str(&table_of_tensors(meta, sorted));
    if !meta.objects().is_empty() {
        out.push('\n');
        out.push_str(&object_table(meta));
    }
    Ok(out)
}

/// Compares names with their digit runs as numbers: `layers.2` before `layers.10`.
fn natural_cmp(a: &str, b: &str) -> std::cmp::Ordering {
    fn runs(s: &str) -> impl Iterator<Item = (bool, &str)> {
        let mut rest = s;
        std::iter::from_fn(move || {
            let first = rest.chars().next()?;
            let digit = first.is_ascii_digit();
            let end = rest
                .find(|c: char| c.is_ascii_digit() != digit)
                .unwrap_or(rest.len());
            let (run, tail) = rest.split_at(end);
            rest = tail;
            Some((digit, run))
        })
    }
    let mut left = runs(a);
    let mut right = runs(b);
    loop {
        let order = match (left.next(), right.next()) {
            (None, None) => return a.cmp(b),
            (None, Some(_)) => return std::cmp::Ordering::Less,
            (Some(_), None) => return std::cmp::Ordering::Greater,
            (Some((true, x)), Some((true, y))) => {
                // By value without parsing (runs may exceed u64): fewer significant digits
                // first, then digit by digit.
                let (x, y) = (x.trim_start_matches('0'), y.trim_start_matches('0'));
                x.len().cmp(&y.len()).then_with(|| x.cmp(y))
            }
            (Some((_, x)), Some((_, y))) => x.cmp(y),
        };
        if order.is_ne() {
            return order;
        }
    }
}

/// The non-tensor objects (a step counter, a config, an RNG state): key, file and size, sorted
/// by key.
pub fn object_table(meta: &CheckpointMeta) -> String {
    let mut objects: Vec<_> = meta.objects().iter().collect();
    objects.sort_by(|a, b| natural_cmp(&a.key, &b.key));
    let width = objects
        .iter()
        .map(|o| o.key.chars().count())
        .max()
        .unwrap_or(6)
        .clamp(6, MAX_FQN_COLUMN);
    let file_width = objects
        .iter()
        .filter_map(|o| meta.files().get(o.file as usize))
        .map(|f| f.path.chars().count())
        .max()
        .unwrap_or(4)
        .clamp(4, MAX_FQN_COLUMN);
    let mut out = String::new();
    let mut row = |key: &str, file: &str, bytes: &str| {
        out.push_str(&human::pad_right(key, width));
        out.push_str("  ");
        out.push_str(&human::pad_right(file, file_width));
        out.push_str("  ");
        out.push_str(&human::pad_left(bytes, 12));
        out.push('\n');
    };
    row("OBJECT", "FILE", "BYTES");
    for object in objects {
        let file = meta
            .files()
            .get(object.file as usize)
            .map_or("?", |f| f.path.as_str());
        row(&object.key, file, &human::bytes(object.length));
    }
    out
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

/// The line of counts every format's header has: tensors, saved boxes, objects, data files and
/// tensor bytes, then what the format adds (`tail`).
fn counts_line(meta: &CheckpointMeta, tail: &str) -> String {
    format!(
        "{} tensors, {} saved boxes, {} objects, {} data files, {} of tensors, {tail}",
        meta.tensors().len(),
        meta.chunks().len(),
        meta.objects().len(),
        meta.files().len(),
        human::bytes(meta.tensor_bytes()),
    )
}

/// Widest the FQN column gets: longer names are printed whole and push their own row's other
/// columns right, instead of widening every row of the table.
const MAX_FQN_COLUMN: usize = 96;

/// The tensor table: one row per tensor with its dtype, shape, saved boxes and bytes. Padding is
/// done by hand: `format!("{:width$}")` panics ("Formatting argument out of range") for a width
/// over u16::MAX, which a 65,536-character tensor name gave.
pub fn tensor_table(meta: &CheckpointMeta) -> String {
    table_of_tensors(meta, false)
}

/// [`tensor_table`], its rows in the metadata's order or sorted by name ([`natural_cmp`]).
fn table_of_tensors(meta: &CheckpointMeta, sorted: bool) -> String {
    let mut order: Vec<usize> = (0..meta.tensors().len()).collect();
    if sorted {
        let tensors = meta.tensors();
        order.sort_by(|&a, &b| natural_cmp(&tensors[a].fqn, &tensors[b].fqn));
    }
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
    for t in order {
        let tensor = &meta.tensors()[t];
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
        IndexSource::Built if stats.compressed_blobs > 0 => format!(
            "blob index: {} torch.save blobs ({} compressed, decoded whole to be indexed), {} read in {} requests",
            stats.blobs,
            stats.compressed_blobs,
            human::bytes(stats.bytes_read),
            stats.requests
        ),
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

#[cfg(test)]
mod tests {
    use super::natural_cmp;

    #[test]
    fn names_sort_with_numbers_by_value() {
        let mut names = vec![
            "optim.state.layers.10.w",
            "layers.10.w",
            "layers.2.w",
            "layers.2.b",
            "layers.02.c",
            "layers.1.w",
            "a99999999999999999999999.x",
            "a100000000000000000000000.x",
        ];
        names.sort_by(|a, b| natural_cmp(a, b));
        assert_eq!(
            names,
            [
                "a99999999999999999999999.x",
                "a100000000000000000000000.x",
                "layers.1.w",
                "layers.2.b",
                "layers.02.c",
                "layers.2.w",
                "layers.10.w",
                "optim.state.layers.10.w",
            ]
        );
    }
}
