//! Damaged DCP checkpoints (copies of fixture a) fail with errors that name the file, the byte
//! range and the tensor: a truncated `.distcp`, a missing one, a truncated, empty or corrupt
//! `.metadata`, blobs whose zip is damaged. Data corruption that opening cannot see (a flipped
//! storage byte) is what `verify_dcp` finds.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::path::Path;

use dcp_support::{copy_fixture, open, runtime, store_for};
use tessera_metadata::MetadataError;
use tessera_metadata::formats::dcp::verify_dcp;

/// fixture a's blob of `model.lm_head.weight` and `model.final_ln.bias` in `__0_0.distcp`.
const LM_HEAD: (usize, usize) = (309355, 26153);
const FINAL_LN_BIAS: (usize, usize) = (307522, 1833);

fn damage(dir: &Path, file: &str, edit: impl FnOnce(&mut Vec<u8>)) {
    let path = dir.join(file);
    let mut bytes = std::fs::read(&path).unwrap();
    edit(&mut bytes);
    std::fs::write(&path, bytes).unwrap();
}

fn error(dir: &Path) -> String {
    open(dir).unwrap_err().to_string()
}

/// Position of `needle` in `hay` at or after `from`.
fn find(hay: &[u8], needle: &[u8], from: usize) -> usize {
    from + hay[from..]
        .windows(needle.len())
        .position(|w| w == needle)
        .unwrap()
}

#[test]
fn a_truncated_distcp_names_the_chunk_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    damage(&dir, "__0_0.distcp", |b| b.truncate(b.len() - 100));
    assert_eq!(
        error(&dir),
        "tensor train_step: chunk [] reads bytes 731889..733466 of a_w1_plain/__0_0.distcp, past its end (733366 bytes)"
    );
}

#[test]
fn a_missing_distcp_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    std::fs::remove_file(dir.join("__0_0.distcp")).unwrap();
    assert_eq!(
        error(&dir),
        "invalid checkpoint metadata: data file a_w1_plain/__0_0.distcp (named in .metadata) does not exist"
    );
}

#[test]
fn a_save_without_metadata_is_incomplete() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    std::fs::rename(dir.join(".metadata"), dir.join(".metadata.tmp")).unwrap();
    assert_eq!(
        error(&dir),
        "a_w1_plain: .distcp files but no .metadata: an incomplete PyTorch DCP save (torch writes it last)"
    );
}

#[test]
fn a_truncated_or_corrupt_metadata_names_the_byte() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    damage(&dir, ".metadata", |b| b.truncate(8000));
    assert_eq!(
        error(&dir),
        "a_w1_plain/.metadata: cannot decode DCP metadata: pickle byte 2: frame of 15971 bytes runs past the end"
    );
    // Without the frame header the truncation is found where the opcodes stop.
    damage(&dir, ".metadata", |b| {
        b.drain(2..11);
    });
    assert_eq!(
        error(&dir),
        "a_w1_plain/.metadata: cannot decode DCP metadata: pickle byte 7991: truncated: no STOP opcode"
    );

    let dir = copy_fixture("a_w1_plain", &tmp.path().join("2"));
    // Byte 65 is the NEWOBJ of the Metadata object.
    damage(&dir, ".metadata", |b| b[65] = 0xff);
    assert_eq!(
        error(&dir),
        "a_w1_plain/.metadata: cannot decode DCP metadata: pickle byte 65: unknown opcode 0xff"
    );
    std::fs::write(dir.join(".metadata"), b"\x80\x04}\x94.").unwrap();
    assert_eq!(
        error(&dir),
        "a_w1_plain/.metadata: cannot decode DCP metadata: the pickled object is a dict of 0, not a Metadata"
    );
}

/// An empty `.metadata` (a save or copy cut short) is named as such, and is no storage trouble:
/// before, detection asked the store for the byte range 0..0, which it refused as invalid, and
/// that read as a transient storage error (retried, then "unreachable").
#[test]
fn an_empty_metadata_is_named_as_an_empty_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    std::fs::write(dir.join(".metadata"), b"").unwrap();
    let err = open(&dir).unwrap_err();
    assert!(matches!(err, MetadataError::EmptyFile { .. }), "{err:?}");
    assert!(err.is_permanent());
    assert_eq!(
        err.to_string(),
        "a_w1_plain/.metadata: the DCP metadata file is empty (0 bytes); the save or copy that wrote it was cut short"
    );
}

#[test]
fn a_blob_without_end_record_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    let (start, len) = LM_HEAD;
    damage(&dir, "__0_0.distcp", |b| b[start + len - 22] = b'X');
    assert_eq!(
        error(&dir),
        "a_w1_plain/__0_0.distcp bytes 309355..335508 (tensor model.lm_head.weight chunk [0..96, 0..64]): no end of central directory record (not a zip archive, or truncated)"
    );
}

#[test]
fn a_blob_with_a_corrupt_data_pkl_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    let (start, len) = FINAL_LN_BIAS;
    damage(&dir, "__0_0.distcp", |b| {
        // data.pkl starts with PROTO 2 then GLOBAL 'torch._utils ...'.
        let at = find(&b[..start + len], b"\x80\x02ctorch._utils", start);
        b[at + 2] = 0xfe;
    });
    assert_eq!(
        error(&dir),
        "a_w1_plain/__0_0.distcp bytes 307522..309355 (tensor model.final_ln.bias chunk [0..64]): archive/data.pkl: pickle byte 2: unknown opcode 0xfe"
    );
}

#[test]
fn a_compressed_storage_member_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    let (start, len) = FINAL_LN_BIAS;
    damage(&dir, "__0_0.distcp", |b| {
        // The central directory entry of archive/data/0: method (offset 10) = 8 (deflate).
        let at = find(&b[..start + len], b"PK\x01\x02", start);
        let at = find(&b[..start + len], b"archive/data/0", at) - 46;
        b[at + 10] = 8;
    });
    assert_eq!(
        error(&dir),
        "a_w1_plain/__0_0.distcp bytes 307522..309355 (tensor model.final_ln.bias chunk [0..64]): member archive/data/0 is compressed (method 8); torch.save stores members uncompressed"
    );
}

#[test]
fn verify_finds_a_flipped_storage_byte_that_opening_cannot_see() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = copy_fixture("a_w1_plain", tmp.path());
    let opened = open(&dir).unwrap();
    let (store, prefix) = store_for(&dir);
    let report = runtime()
        .block_on(verify_dcp(
            store.as_ref(),
            &prefix,
            &opened.meta,
            opened.dcp().unwrap(),
            8,
        ))
        .unwrap();
    assert!(report.is_ok(), "{report:?}");
    assert_eq!(report.tensors_checked, 51);
    assert_eq!(report.objects_checked, 11);

    let t = opened.meta.tensor_index("model.final_ln.bias").unwrap();
    let chunk = &opened.meta.chunks_of(t)[0];
    let at = chunk.bytes.offset as usize + 5;
    let mut original = 0u8;
    damage(&dir, "__0_0.distcp", |b| {
        original = b[at];
        b[at] ^= 0x01;
    });
    let file = std::fs::read(dir.join("__0_0.distcp")).unwrap();
    let storage = &file[chunk.bytes.offset as usize..(chunk.bytes.offset + 256) as usize];
    let actual = crc32fast::hash(storage);
    let mut fixed = storage.to_vec();
    fixed[5] = original;
    let expected = crc32fast::hash(&fixed);
    let reopened = open(&dir).unwrap();
    let report = runtime()
        .block_on(verify_dcp(
            store.as_ref(),
            &prefix,
            &reopened.meta,
            reopened.dcp().unwrap(),
            8,
        ))
        .unwrap();
    assert_eq!(report.bad.len(), 1);
    let bad = &report.bad[0];
    assert_eq!(
        (
            bad.file.as_str(),
            bad.entry.as_str(),
            bad.start,
            bad.end,
            bad.detail.clone()
        ),
        (
            "__0_0.distcp",
            "tensor model.final_ln.bias chunk [0..64]",
            chunk.bytes.offset,
            chunk.bytes.offset + 256,
            format!("storage crc32 {actual:08x} but the zip records {expected:08x}")
        )
    );
}
