//! The capped safetensors header parser; whatever it accepts must be sound (entries back to back
//! from 0, `numel × dtype size` bytes each, inside the file). Corpus: fixture files' headers.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera_metadata::formats::safetensors::parse;

fuzz_target!(|data: &[u8]| {
    if let Ok(header) = parse(data, "fuzz") {
        let mut expected = 0u64;
        for t in &header.tensors {
            let (begin, end) = t.data_offsets;
            assert_eq!(begin, expected);
            assert_eq!(
                end - begin,
                t.shape.iter().product::<u64>() * t.dtype.size()
            );
            assert!(header.data_start + end <= data.len() as u64);
            expected = end;
        }
    }
});
