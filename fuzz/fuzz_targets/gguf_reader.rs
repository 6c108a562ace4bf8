//! Any bytes: the reader returns a file or an error, and never panics, hangs or over-allocates.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = ferrolm_gguf::GgufFile::from_bytes(data.to_vec()) {
        // Everything a validated file hands out must be in bounds.
        for t in f.tensors() {
            assert_eq!(f.tensor_data(t).len() as u64, t.size);
        }
        for (_, v) in f.metadata().iter() {
            let _ = v.to_string();
        }
    }
});
