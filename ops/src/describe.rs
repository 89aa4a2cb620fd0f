//! What a checkpoint holds, as one JSON document: format, step, every tensor with its saved boxes
//! (file and byte range), every plain (non-tensor) value with its decoded value, and the format's
//! own details. `tessera inspect --json` prints it and the Python package's `tessera.inspect`
//! returns it.

use std::sync::Arc;

use object_store::{ObjectStore, ObjectStoreExt};
use serde_json::{Value, json};
use tessera_loader::read::decoded::{DECODED_CACHE_BYTES, DecodedStore};
use tessera_metadata::formats::SafetensorsLayout;
use tessera_metadata::formats::dcp::{decode_object, decode_pickle};
use tessera_metadata::formats::native::DataPresence;
use tessera_metadata::{FormatDetails, OpenedCheckpoint};
use tessera_storage::StorageOptions;

use crate::OpsError;
use crate::open::open_at_with;

/// What `inspect --json` prints, as a JSON value: format, step, every tensor with its saved boxes
/// (file and byte range), `objects` (every plain value: key, file, byte range and `value`, or
/// `value_error` saying why it has none; the same shape for every format, empty for
/// safetensors), and the format's own details. Also what the Python package's `tessera.inspect`
/// returns.
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
        FormatDetails::Native { manifest } => {
            doc["manifest"] = json!(manifest);
            // A native checkpoint's plain values are listed as DCP's are (the manifest only
            // counts them): tessera.save stores each as a plain-value pickle or raw bytes, and
            // a converted DCP checkpoint keeps its torch.save blobs. A metadata-only checkpoint
            // has no bytes to decode: its values are listed without one.
            doc["objects"] = match manifest.data {
                DataPresence::Present => objects_json(&store, &checkpoint).await?,
                DataPresence::Absent => json!(
                    meta.objects()
                        .iter()
                        .map(|object| json!({
                            "key": object.key,
                            "file": meta.files()[object.file as usize].path,
                            "byte_offset": object.offset,
                            "byte_length": object.length,
                            "value_error": "a metadata-only checkpoint holds no data",
                        }))
                        .collect::<Vec<_>>()
                ),
            };
        }
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
            // safetensors holds tensors only; the key is there so that every format's document
            // has the same shape.
            doc["objects"] = json!([]);
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
/// Python value ([`decode_stored`]).
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
        match decode_stored(&bytes) {
            Ok(value) => entry["value"] = value,
            Err(e) => entry["value_error"] = json!(e),
        }
        objects.push(entry);
    }
    Ok(Value::Array(objects))
}

/// Raw bytes longer than this are not shown as a value (a JSON document is no place for a
/// serialized blob); their length is.
const MAX_RAW_BYTES_SHOWN: usize = 4096;

/// The stored bytes of a plain value as JSON (the mapping of [`decode_object`]), told apart by
/// how they start, as the Python package's `_objects.decode` tells them: a `torch.save` zip (DCP
/// and ByteCheckpoint store every plain value so; a conversion keeps them), a bare pickle
/// (`tessera.save`, protocol 2 or more), else the raw bytes `tessera.save` stores for a `bytes`
/// or `io.BytesIO` value (`{"__bytes__": "<hex>"}`). The error says why there is no value.
pub fn decode_stored(bytes: &[u8]) -> Result<Value, String> {
    if bytes.starts_with(b"PK\x03\x04") {
        return decode_object(bytes).map_err(|e| e.to_string());
    }
    if bytes.first() == Some(&0x80) {
        return decode_pickle(bytes).map_err(|e| e.to_string());
    }
    if bytes.len() > MAX_RAW_BYTES_SHOWN {
        return Err(format!(
            "raw bytes ({} B), longer than the {MAX_RAW_BYTES_SHOWN} B shown",
            bytes.len()
        ));
    }
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    Ok(json!({ "__bytes__": hex }))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn stored_values_decode_by_how_they_start() {
        // pickle.dumps(5, protocol=4) and pickle.dumps("run1", protocol=4), as tessera.save
        // stores them.
        assert_eq!(decode_stored(b"\x80\x04K\x05.").unwrap(), json!(5));
        assert_eq!(
            decode_stored(b"\x80\x04\x95\x08\x00\x00\x00\x00\x00\x00\x00\x8c\x04run1\x94.")
                .unwrap(),
            json!("run1")
        );
        assert_eq!(
            decode_stored(b"\x00\x01raw").unwrap(),
            json!({"__bytes__": "0001726177"})
        );
        let long = decode_stored(&[7u8; MAX_RAW_BYTES_SHOWN + 1]).unwrap_err();
        assert_eq!(long, "raw bytes (4097 B), longer than the 4096 B shown");
        let zip = decode_stored(b"PK\x03\x04 not a zip").unwrap_err();
        assert!(zip.contains("not a readable torch.save zip"), "{zip}");
    }
}
