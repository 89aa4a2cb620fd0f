//! The parsers of foreign bytes never panic: the pickle VM (and what reads its result: the
//! `.metadata` interpreter, the JSON decoder of objects), the torch.save zip reader and the tensor
//! blob parser, fed random bytes and mutations (byte flips, opcode insertions, deletions,
//! truncations) of real fixture files. The same entry points as the cargo-fuzz targets in
//! `fuzz/`, run in the normal test suite on stable Rust.
#![allow(clippy::unwrap_used, missing_docs)]

mod dcp_support;
mod mutation_support;

use mutation_support::{INTERESTING, edit, mutate};
use std::sync::OnceLock;

use bytes::Bytes;
use dcp_support::fixtures;
use proptest::prelude::*;
use proptest::sample::Index;
use tessera_metadata::formats::dcp::{decode_object, decode_pickle, parse_metadata};
use tessera_metadata::formats::torch::blob::parse_tensor_blob;
use tessera_metadata::formats::torch::pickle::{Limits, unpickle};
use tessera_metadata::formats::torch::zip::{Segments, ZipError, read_archive};

struct Samples {
    metadata: Vec<Vec<u8>>,
    blobs: Vec<Vec<u8>>,
}

/// `.metadata` of fixtures a and e; blobs of fixture a (an object, a 1-d tensor, the transposed
/// weight, a 0-dim tensor) and b's empty chunk.
fn samples() -> &'static Samples {
    static SAMPLES: OnceLock<Samples> = OnceLock::new();
    SAMPLES.get_or_init(|| {
        let dir = fixtures();
        let a = std::fs::read(dir.join("a_w1_plain/__0_0.distcp")).unwrap();
        let b3 = std::fs::read(dir.join("b_w4_fsdp_shard0/__3_0.distcp")).unwrap();
        let blob = |file: &[u8], at: usize, len: usize| file[at..at + len].to_vec();
        // b's rank 3 writes the empty chunk of model.tiny.weight; find it by its data.pkl.
        let opened = dcp_support::open(&dir.join("b_w4_fsdp_shard0")).unwrap();
        let t = opened.meta.tensor_index("model.tiny.weight").unwrap();
        let empty = opened
            .dcp()
            .unwrap()
            .blobs
            .iter()
            .find(|c| c.entry == "tensor model.tiny.weight chunk [3..3, 0..5]")
            .unwrap();
        assert_eq!(opened.meta.chunks_of(t).len(), 4);
        Samples {
            metadata: vec![
                std::fs::read(dir.join("a_w1_plain/.metadata")).unwrap(),
                std::fs::read(dir.join("e_w2_fsdp2_adamw/.metadata")).unwrap(),
            ],
            blobs: vec![
                blob(&a, 0, 1261),
                blob(&a, 307522, 1833),
                blob(&a, 309355, 26153),
                blob(&a, 731889, 1577),
                blob(&b3, empty.offset as usize, empty.length as usize),
            ],
        }
    })
}

/// Everything that reads a blob: the whole-archive reader, the object decoder, and the tensor
/// blob parser both on the whole blob and driven through `Need` from its head and tail only.
fn read_blob_every_way(blob: &[u8]) {
    let _ = read_archive(blob);
    let _ = decode_object(blob);
    let _ = parse_tensor_blob(&Segments::whole(Bytes::copy_from_slice(blob)));
    let len = blob.len() as u64;
    let mut seg = Segments::new(len);
    let head = len.min(1024);
    seg.add(0, Bytes::copy_from_slice(&blob[..head as usize]));
    let tail = len.saturating_sub(1024);
    seg.add(tail, Bytes::copy_from_slice(&blob[tail as usize..]));
    for _ in 0..8 {
        match parse_tensor_blob(&seg) {
            Err(ZipError::Need(range)) => {
                assert!(
                    range.start < range.end && range.end <= len,
                    "{range:?} of {len}"
                );
                seg.add(
                    range.start,
                    Bytes::copy_from_slice(&blob[range.start as usize..range.end as usize]),
                );
            }
            _ => break,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic_the_pickle_readers(data in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = unpickle(&data, &Limits::BLOB);
        let _ = parse_metadata(&data, "fuzz", &Limits::METADATA);
        let _ = decode_pickle(&data);
    }

    #[test]
    fn random_opcode_soup_never_panics_the_pickle_readers(
        ops in prop::collection::vec((any::<Index>(), any::<u8>()), 0..256)
    ) {
        let mut data = vec![0x80, 0x04];
        for (op, arg) in ops {
            data.push(INTERESTING[op.index(INTERESTING.len())]);
            if arg < 64 {
                data.push(arg);
            }
        }
        let _ = unpickle(&data, &Limits::BLOB);
        let _ = parse_metadata(&data, "fuzz", &Limits::METADATA);
        let _ = decode_pickle(&data);
    }

    #[test]
    fn mutated_metadata_never_panics(which in 0usize..2, edits in prop::collection::vec(edit(), 1..6)) {
        let base = &samples().metadata[which];
        let data = mutate(base, &edits, 0..base.len());
        let _ = parse_metadata(&data, "fuzz", &Limits::METADATA);
    }

    #[test]
    fn random_bytes_never_panic_the_zip_readers(data in prop::collection::vec(any::<u8>(), 0..2048)) {
        read_blob_every_way(&data);
    }

    #[test]
    fn mutated_blobs_never_panic(which in 0usize..5, edits in prop::collection::vec(edit(), 1..6)) {
        let base = &samples().blobs[which];
        read_blob_every_way(&mutate(base, &edits, 0..base.len()));
    }

    #[test]
    fn mutated_zip_tails_never_panic(which in 0usize..5, edits in prop::collection::vec(edit(), 1..4)) {
        // The directory and end records: where offsets and sizes live.
        let base = &samples().blobs[which];
        let from = base.len().saturating_sub(700);
        read_blob_every_way(&mutate(base, &edits, from..base.len()));
    }

    #[test]
    fn mutated_data_pkl_in_an_intact_zip_never_panics(which in 1usize..5, edits in prop::collection::vec(edit(), 1..4)) {
        // data.pkl's bytes start after its 30-byte local header and name; the zip stays intact
        // except for the pickle (its CRC is not checked when indexing), so the tensor rebuild
        // interpretation sees the damage.
        let base = &samples().blobs[which];
        let start = 30 + "archive/data.pkl".len();
        let data = mutate(base, &[edits.as_slice()].concat(), start..start + 150);
        if data.len() == base.len() {
            read_blob_every_way(&data);
        }
    }
}

#[test]
fn the_samples_parse_unmutated() {
    for metadata in &samples().metadata {
        parse_metadata(metadata, "sample", &Limits::METADATA).unwrap();
    }
    for blob in &samples().blobs[1..] {
        parse_tensor_blob(&Segments::whole(Bytes::copy_from_slice(blob))).unwrap();
        read_archive(blob).unwrap();
    }
    decode_object(&samples().blobs[0]).unwrap();
}
