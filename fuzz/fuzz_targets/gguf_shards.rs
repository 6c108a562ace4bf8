//! Any bytes cut into shards: joining them as a split model returns a model or an error, and
//! never panics, hangs or over-allocates; what a joined model hands out is in bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte says how many shards (1 to 4); the rest is cut into that many equal parts.
    let Some((&n, rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 4) + 1;
    let part = rest.len().div_ceil(n).max(1);
    let shards: Vec<&[u8]> = rest.chunks(part).collect();
    if let Ok(f) = ferrolm_gguf::GgufFile::from_shards(&shards) {
        for t in f.tensors() {
            assert_eq!(f.tensor_data(t).len() as u64, t.size);
        }
    }
});
