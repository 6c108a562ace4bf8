//! Batched products (`dot_rows_multi`) in the shapes of a small model's prompt: Gemma 3
//! 270M's Q5_0 (640 -> 2048), Q4_K (1024 -> 640) and Q6_K (2048 -> 640) matrices, and an F16
//! attention score product (512 keys of a 256-wide head), against 64 tokens, one thread.
//! Prints the best of several timings as GMAC/s, for A/B runs of the batched tiles.
//!
//! `cargo run --release -p ferrolm-quant --example tile_bench`

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::Instant;

use common::{random_act, random_row, Rng};
use ferrolm_quant::{dot_kernel, row_bytes, TensorType};

fn main() {
    let mut rng = Rng::new(3);
    let tokens = 64;
    for (ty, n, rows) in [
        (TensorType::Q5_0, 640, 2048),
        (TensorType::Q4_K, 1024, 640),
        (TensorType::Q6_K, 2048, 640),
        // attention's scores: 512 cached keys of one 256-wide head against 64 queries
        (TensorType::F16, 256, 512),
    ] {
        let k = dot_kernel(ty).unwrap();
        let rb = row_bytes(ty, n).unwrap();
        let distinct: Vec<Vec<u8>> = (0..64).map(|_| random_row(ty, n, &mut rng)).collect();
        let w: Vec<u8> = (0..rows)
            .flat_map(|r| distinct[(r * 7919) % 64].clone())
            .collect();
        let mut acts = Vec::new();
        for _ in 0..tokens {
            acts.extend(random_act(k.activation_type(), n, &mut rng).1);
        }
        let ab = acts.len() / tokens;
        let mut out = vec![0f32; rows * tokens];
        let mut best = f64::MAX;
        for _ in 0..30 {
            let t = Instant::now();
            k.dot_rows_multi(n, &w, rb, rows, &acts, ab, tokens, &mut out);
            best = best.min(t.elapsed().as_secs_f64());
        }
        let gmac = (rows * n * tokens) as f64 / best / 1e9;
        println!("{ty}: {gmac:.2} GMAC/s ({:.3} ms)", best * 1e3);
    }
}
