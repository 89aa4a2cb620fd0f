//! What a checkpoint holds, as one JSON document: format, step, every tensor with its saved boxes
//! (file and byte range), and the format's own details. `tessera inspect --json` prints it and the
//! Python package's `tessera.inspect` returns it.

use std::sync::Arc;

use object_store::{ObjectStore, ObjectStoreExt};
use serde_json::{Value, json};
use tessera_loader::read::decoded::{DECODED_CACHE_BYTES, DecodedStore};
use tessera_metadata::formats::SafetensorsLayout;
use tessera_metadata::formats::dcp::decode_object;
use tessera_metadata::{FormatDetails, OpenedCheckpoint};
use tessera_storage::StorageOptions;

use crate::OpsError;
use crate::open::open_at_with;

/// What `inspect --json` prints, as a JSON value: format, step, every tensor with its saved boxes
/// (file and byte range), and the format's own details. Also what the Python package's
/// `tessera.inspect` returns.
pub async fn describe(location: &str, storage_options: &StorageOptions) -> Result<Value, OpsError> {
    let (store, checkpoint) = open_at_with(location, storage_options).await?;
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
        "writer": checkpoint.writer.as_ref().map(ToString::to_string),
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
            if let Some(megatron) = &dcp.megatron {
                doc["megatron"] = json!(megatron);
            }
            doc["objects"] = objects_json(&store, &checkpoint).await?;
        }
        FormatDetails::DeepSpeed(ds) => {
            doc["deepspeed"] = json!({
                "tag": ds.tag,
                "zero_stage": ds.zero_stage,
                "dp_world_size": ds.dp_world_size,
                "ds_version": ds.ds_version,
                "requests": ds.requests,
                "bytes_read": ds.bytes_read,
            });
            // Entries of a pickle have no byte range of their own: each object points at the
            // pickle holding it, and its value is the one the reader decoded.
            doc["objects"] = json!(
                checkpoint
                    .meta
                    .objects()
                    .iter()
                    .zip(&ds.objects)
                    .map(|(object, (_, value))| {
                        let mut entry = json!({
                            "key": object.key,
                            "file": checkpoint.meta.files()[object.file as usize].path,
                            "byte_offset": object.offset,
                            "byte_length": object.length,
                        });
                        match value {
                            Some(value) => entry["value"] = value.clone(),
                            None => entry["value_error"] = json!("not a simple Python value"),
                        }
                        entry
                    })
                    .collect::<Vec<_>>()
            );
        }
        FormatDetails::ByteCheckpoint(bc) => {
            doc["bytecheckpoint"] = json!({
                "version": bc.version,
                "followed": bc.followed,
                "components": bc.components.iter().map(|c| json!({
                    "name": c.name,
                    "dir": c.dir,
                    "metadata_file": c.metadata_file,
                    "metadata_bytes": c.metadata_bytes,
                    "bytecheckpoint_version": c.version,
                    "tensors": c.metadata.tensors.len(),
                    "objects": c.metadata.objects.len(),
                    "user_defined_keys": c.user_defined_keys,
                })).collect::<Vec<_>>(),
            });
            doc["objects"] = objects_json(&store, &checkpoint).await?;
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

/// How a safetensors checkpoint's files were found, in words.
pub fn layout_name(layout: SafetensorsLayout) -> &'static str {
    match layout {
        SafetensorsLayout::SingleFile => "single file",
        SafetensorsLayout::Directory => "directory",
        SafetensorsLayout::Index => "HF index model.safetensors.index.json",
        SafetensorsLayout::DcpSharded => "DCP HF writer, sharded/",
    }
}

/// The non-tensor entries of a checkpoint, each with its decoded value when it is a simple
/// Python value.
pub async fn objects_json(
    store: &Arc<dyn ObjectStore>,
    checkpoint: &OpenedCheckpoint,
) -> Result<Value, OpsError> {
    let meta = &checkpoint.meta;
    let location = checkpoint.root.clone();
    // Data file paths are `/`-separated (ByteCheckpoint's `optimizer/__0_0.distcp`): one path
    // part per segment, or the `/` would be escaped into the name.
    let resolve = |file: &str| {
        file.split('/')
            .fold(location.clone(), |path, part| path.join(part))
    };
    // Objects saved compressed (DCP's ZStandard extension) are files of the model that exist
    // only as decoded bytes: read through the loader's decoding view, as a load reads them.
    let decoded = DecodedStore::for_files(
        Arc::clone(store),
        meta.files(),
        |name| Ok(resolve(name)),
        DECODED_CACHE_BYTES,
    )?;
    let store: &dyn ObjectStore = match &decoded {
        Some(decoded) => decoded,
        None => store.as_ref(),
    };
    let mut objects = Vec::with_capacity(meta.objects().len());
    for object in meta.objects() {
        let file = &meta.files()[object.file as usize].path;
        let path = resolve(file);
        let bytes = store
            .get_range(&path, object.offset..object.offset + object.length)
            .await
            .map_err(|source| tessera_storage::StorageError::Store {
                action: format!("reading object {} from", object.key),
                path: path.to_string(),
                source,
            })?;
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
