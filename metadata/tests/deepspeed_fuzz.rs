//! The DeepSpeed reader never panics: the states parser (the cargo-fuzz target's entry point) on
//! random bytes and on mutations (byte flips, deletions, insertions, truncations) of the ZeRO-2
//! fixture's files, and the whole reader (`open_any` over an in-memory store) with one file of the
//! checkpoint mutated. Unmutated files parse: the mutations start from something valid.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use object_store::memory::InMemory;
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStoreExt, PutPayload};
use proptest::prelude::*;
use proptest::sample::Index;
use tessera_metadata::formats::deepspeed::states::parse_states_file;
use tessera_metadata::{OpenOptions, open_any};

const FILES: [&str; 3] = [
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    "zero_pp_rank_1_mp_rank_00_optim_states.pt",
];

fn dir() -> PathBuf {
    std::env::var_os("TESSERA_INTEROP_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures/interop")
        })
        .join("deepspeed_0.19.8_zero2_w2/ckpt/global_step1")
}

fn files() -> &'static Vec<Vec<u8>> {
    static FILES_: OnceLock<Vec<Vec<u8>>> = OnceLock::new();
    FILES_.get_or_init(|| {
        FILES
            .iter()
            .map(|f| std::fs::read(dir().join(f)).unwrap())
            .collect()
    })
}

#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    Delete(Index, usize),
    Insert(Index, Vec<u8>),
    Truncate(Index),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<Index>(), 1u8..=255).prop_map(|(i, b)| Mutation::Flip(i, b)),
        (any::<Index>(), 1usize..64).prop_map(|(i, n)| Mutation::Delete(i, n)),
        (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<Index>().prop_map(Mutation::Truncate),
    ]
}

/// Mutations land in the structures (data.pkl and the zip records at the start and the end) more
/// often than in the tensor bytes, which the parser never reads.
fn apply(bytes: &mut Vec<u8>, mutations: &[Mutation]) {
    for m in mutations {
        if bytes.is_empty() {
            return;
        }
        let at = |i: &Index, len: usize| {
            let k = i.index(len);
            // Half of the positions in the first 2 KiB or the last 2 KiB.
            match k % 4 {
                0 => k % len.min(2048),
                1 => len - 1 - (k % len.min(2048)),
                _ => k,
            }
        };
        match m {
            Mutation::Flip(i, b) => {
                let k = at(i, bytes.len());
                bytes[k] ^= b;
            }
            Mutation::Delete(i, n) => {
                let k = at(i, bytes.len());
                let end = (k + n).min(bytes.len());
                bytes.drain(k..end);
            }
            Mutation::Insert(i, b) => {
                let k = at(i, bytes.len());
                bytes.splice(k..k, b.iter().copied());
            }
            Mutation::Truncate(i) => {
                let k = at(i, bytes.len());
                bytes.truncate(k);
            }
        }
    }
}

#[test]
fn the_fixture_files_parse() {
    for (name, bytes) in FILES.iter().zip(files()) {
        parse_states_file(bytes).unwrap_or_else(|e| panic!("{name}: {e}"));
    }
}

fn open_mutated(which: usize, bytes: Vec<u8>) -> Result<(), String> {
    let store = InMemory::new();
    let rt = dcp_support::runtime();
    rt.block_on(async {
        store
            .put(
                &ObjectPath::from("ckpt/latest"),
                PutPayload::from("global_step1\n"),
            )
            .await
            .unwrap();
        for (k, (name, original)) in FILES.iter().zip(files()).enumerate() {
            let data = if k == which {
                bytes.clone()
            } else {
                original.clone()
            };
            store
                .put(
                    &ObjectPath::from(format!("ckpt/global_step1/{name}")),
                    PutPayload::from(data),
                )
                .await
                .unwrap();
        }
        open_any(&store, &ObjectPath::from("ckpt"), &OpenOptions::default())
            .await
            .map(|_| ())
            .map_err(|e| e.to_string())
    })
}

#[test]
fn the_unmutated_checkpoint_opens_from_memory() {
    open_mutated(0, files()[0].clone()).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic_the_states_parser(data in prop::collection::vec(any::<u8>(), 0..1024)) {
        let _ = parse_states_file(&data);
    }

    #[test]
    fn mutated_files_never_panic_the_states_parser(
        which in 0usize..3,
        mutations in prop::collection::vec(mutation(), 1..4),
    ) {
        let mut bytes = files()[which].clone();
        apply(&mut bytes, &mutations);
        let _ = parse_states_file(&bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn a_mutated_file_never_panics_the_reader(
        which in 0usize..3,
        mutations in prop::collection::vec(mutation(), 1..3),
    ) {
        let mut bytes = files()[which].clone();
        apply(&mut bytes, &mutations);
        // Errors are fine (and name the file); a panic fails the test.
        if let Err(e) = open_mutated(which, bytes) {
            prop_assert!(!e.is_empty());
        }
    }
}
