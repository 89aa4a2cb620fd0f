//! The pickle VM and everything that reads its result: the DCP `.metadata` interpreter, the JSON
//! decoder of non-tensor objects. Corpus: fixture `.metadata` files and `data.pkl`s.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_metadata::formats::torch::pickle::{Limits, unpickle};
use tessera_metadata::formats::dcp::{decode_pickle, parse_metadata};

fuzz_target!(|data: &[u8]| {
    let _ = unpickle(data, &Limits::BLOB);
    let _ = parse_metadata(data, "fuzz", &Limits::METADATA);
    let _ = decode_pickle(data);
});
