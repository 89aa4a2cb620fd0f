//! The ByteCheckpoint reader never panics on foreign bytes: its `.metadata` field reader and the
//! chunk descriptor reader fed random bytes and mutations (byte flips, opcode insertions,
//! deletions, truncations) of the real fixture's files, and whole opens of a save whose
//! `.metadata` or data file was mutated. The same entry points as the cargo-fuzz target
//! `bytecheckpoint` in `fuzz/`, on stable Rust.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;
mod mutation_support;

use dcp_support::copy_dir_writable;
use mutation_support::{edit, mutate};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use proptest::prelude::*;
use tessera_metadata::formats::bytecheckpoint::{is_bytecheckpoint_metadata, parse_bc_fields};
use tessera_metadata::formats::dcp::parse_metadata;
use tessera_metadata::formats::torch::blob::parse_tensor_descriptor;
use tessera_metadata::formats::torch::pickle::Limits;

fn fixture() -> PathBuf {
    std::env::var_os("TESSERA_INTEROP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/interop")
        })
        .join("bytecheckpoint_0.0.2_torch2.5.0_fsdp_w2/ckpt")
}

struct Samples {
    metadata: Vec<Vec<u8>>,
    descriptors: Vec<Vec<u8>>,
}

/// Both `.metadata` files, and every chunk descriptor of the model's (each a `SHORT_BINBYTES`
/// `C <len>` holding a protocol-2 pickle).
fn samples() -> &'static Samples {
    static SAMPLES: OnceLock<Samples> = OnceLock::new();
    SAMPLES.get_or_init(|| {
        let model = std::fs::read(fixture().join("model/.metadata")).unwrap();
        let optimizer = std::fs::read(fixture().join("optimizer/.metadata")).unwrap();
        let mut descriptors = Vec::new();
        for (at, w) in model.windows(4).enumerate() {
            if w[0] == b'C' && w[2..] == [0x80, 0x02] {
                descriptors.push(model[at + 2..at + 2 + w[1] as usize].to_vec());
            }
        }
        assert_eq!(descriptors.len(), 16);
        for d in &descriptors {
            assert!(parse_tensor_descriptor(d, &Limits::BLOB).is_ok());
        }
        Samples {
            metadata: vec![model, optimizer],
            descriptors,
        }
    })
}

fn read_metadata_every_way(data: &[u8]) {
    let _ = is_bytecheckpoint_metadata(data);
    let _ = parse_bc_fields(data, "fuzz", &Limits::METADATA);
    let _ = parse_metadata(data, "fuzz", &Limits::METADATA);
}

/// A writable copy of the fixture's model component under `dir`, with `.metadata` or a data
/// file replaced.
fn model_copy(dir: &Path, metadata: Option<&[u8]>, data: Option<&[u8]>) -> PathBuf {
    let to = dir.join("model");
    copy_dir_writable(&fixture().join("model"), &to);
    if let Some(bytes) = metadata {
        std::fs::write(to.join(".metadata"), bytes).unwrap();
    }
    if let Some(bytes) = data {
        std::fs::write(to.join("__1_0.distcp"), bytes).unwrap();
    }
    to
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic_the_readers(data in prop::collection::vec(any::<u8>(), 0..512)) {
        read_metadata_every_way(&data);
        let _ = parse_tensor_descriptor(&data, &Limits::BLOB);
    }

    #[test]
    fn mutated_metadata_never_panics(which in 0usize..2, edits in prop::collection::vec(edit(), 1..6)) {
        read_metadata_every_way(&mutate(&samples().metadata[which], &edits, 0..usize::MAX));
    }

    #[test]
    fn mutated_descriptors_never_panic(which in 0usize..16, edits in prop::collection::vec(edit(), 1..6)) {
        let _ = parse_tensor_descriptor(&mutate(&samples().descriptors[which], &edits, 0..usize::MAX), &Limits::BLOB);
    }
}

proptest! {
    // Whole opens touch the disk: fewer cases.
    #![proptest_config(ProptestConfig { cases: 48, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn opening_a_save_with_a_mutated_metadata_or_data_file_never_panics(
        edits in prop::collection::vec(edit(), 1..4),
        data_too in any::<bool>(),
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let metadata = mutate(&samples().metadata[0], &edits, 0..usize::MAX);
        let data = data_too.then(|| {
            let bytes = std::fs::read(fixture().join("model/__1_0.distcp")).unwrap();
            mutate(&bytes, &edits, 0..usize::MAX)
        });
        let dir = model_copy(tmp.path(), Some(&metadata), data.as_deref());
        if let Ok(opened) = dcp_support::open(&dir) {
            // What opens must be consistent: every chunk's bytes inside its file.
            for chunk in opened.meta.chunks() {
                let file = &opened.meta.files()[chunk.bytes.file as usize];
                prop_assert!(chunk.bytes.offset + chunk.bytes.length <= file.size.unwrap());
            }
        }
        let _ = dcp_support::open(tmp.path());
    }
}
