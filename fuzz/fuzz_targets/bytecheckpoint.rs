//! The ByteCheckpoint reader's parsers of foreign bytes: its `.metadata` field reader (with the
//! DCP interpreter it shares the file with) and the per-chunk `_rebuild_tensor_v2` descriptor
//! reader. Corpus: the interop fixture's `.metadata` files and chunk descriptors.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_metadata::formats::bytecheckpoint::{is_bytecheckpoint_metadata, parse_bc_fields};
use tessera_metadata::formats::torch::blob::parse_tensor_descriptor;
use tessera_metadata::formats::dcp::parse_metadata;
use tessera_metadata::formats::torch::pickle::Limits;

fuzz_target!(|data: &[u8]| {
    let _ = is_bytecheckpoint_metadata(data);
    let _ = parse_bc_fields(data, "fuzz", &Limits::METADATA);
    let _ = parse_metadata(data, "fuzz", &Limits::METADATA);
    let _ = parse_tensor_descriptor(data, &Limits::BLOB);
});
