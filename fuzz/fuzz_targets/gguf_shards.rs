//! Any bytes cut into shards: joining them as a split model returns a model or an error, and
//! never panics, hangs or over-allocates; what a joined model hands out is in bounds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first byte says how many shards (1 to 4), the next 4-byte little-endian lengths say
    // where each but the last ends; the last takes the rest.
    let Some((&n, mut rest)) = data.split_first() else {
        return;
    };
    let n = usize::from(n % 4) + 1;
    let mut shards = Vec::with_capacity(n);
    for _ in 1..n {
        let Some((len, tail)) = rest.split_first_chunk::<4>() else {
            return;
        };
        let len = (u32::from_le_bytes(*len) as usize).min(tail.len());
        let (shard, tail) = tail.split_at(len);
        shards.push(shard);
        rest = tail;
    }
    shards.push(rest);
    if let Ok(f) = ferrolm_gguf::GgufFile::from_shards(&shards) {
        for t in f.tensors() {
            assert_eq!(f.tensor_data(t).len() as u64, t.size);
        }
    }
});
