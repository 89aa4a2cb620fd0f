//! The torch.save zip reader and the DCP tensor blob parser, on a whole blob and driven through
//! `Need` from its first and last KiB (as the indexer reads it). Corpus: fixture blobs.
#![no_main]

use bytes::Bytes;
use libfuzzer_sys::fuzz_target;
use tessera_metadata::formats::torch::blob::parse_tensor_blob;
use tessera_metadata::formats::dcp::decode_object;
use tessera_metadata::formats::torch::zip::{Segments, ZipError, read_archive};

fuzz_target!(|data: &[u8]| {
    let _ = read_archive(data);
    let _ = decode_object(data);
    let _ = parse_tensor_blob(&Segments::whole(Bytes::copy_from_slice(data)));
    let len = data.len() as u64;
    let mut seg = Segments::new(len);
    let head = len.min(1024) as usize;
    seg.add(0, Bytes::copy_from_slice(&data[..head]));
    let tail = data.len().saturating_sub(1024);
    seg.add(tail as u64, Bytes::copy_from_slice(&data[tail..]));
    for _ in 0..8 {
        match parse_tensor_blob(&seg) {
            Err(ZipError::Need(range)) => {
                assert!(range.start < range.end && range.end <= len);
                let bytes = &data[range.start as usize..range.end as usize];
                seg.add(range.start, Bytes::copy_from_slice(bytes));
            }
            _ => break,
        }
    }
});
