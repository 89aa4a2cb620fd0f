//! The DeepSpeed reader's parsing of a whole `*_model_states.pt` / `*_optim_states.pt` file (zip
//! directory, data.pkl, the states' structure, storage records). Corpus: the ZeRO-2 fixture's files.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_metadata::formats::deepspeed::states::parse_states_file;

fuzz_target!(|data: &[u8]| {
    let _ = parse_states_file(data);
});
