//! One batched product (`dot_rows_multi`), repeated: for A/B runs of a batch kernel under
//! `perf stat -e cycles:u` (multiply-accumulates per cycle hold up better than timings on a
//! shared machine).
//!
//! `cargo run --release -p ferrolm-quant --example batch_bench TYPE [cols] [rows] [n] [--plain]`
//! (defaults: 8 columns, 512 rows of 4096 elements); prints the best GMAC/s and the MACs done.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{random_act, random_row, Rng};
use ferrolm_quant::{matrix_kernel, row_bytes, KernelOptions, TensorType};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let ty = args
        .first()
        .expect("usage: batch_bench TYPE [cols] [rows] [n] [--plain]");
    let ty = *TensorType::ALL
        .iter()
        .find(|t| t.name().eq_ignore_ascii_case(ty))
        .expect("a tensor type name");
    let nums: Vec<usize> = args.iter().filter_map(|a| a.parse().ok()).collect();
    let at = |i: usize, d: usize| nums.get(i).copied().unwrap_or(d);
    let (cols, rows, n) = (at(0, 8), at(1, 512), at(2, 4096));
    let options = if args.iter().any(|a| a == "--plain") {
        KernelOptions::PLAIN
    } else {
        KernelOptions::default()
    };
    let k = matrix_kernel(ty, 4096, &options).unwrap();
    let mut rng = Rng::new(2024);
    let rb = row_bytes(ty, n).unwrap();
    let distinct: Vec<Vec<u8>> = (0..64).map(|_| random_row(ty, n, &mut rng)).collect();
    let w: Vec<u8> = (0..rows)
        .flat_map(|r| distinct[(r * 7919) % 64].clone())
        .collect();
    let acts: Vec<u8> = (0..cols)
        .flat_map(|_| random_act(k.activation_type(), n, &mut rng).1)
        .collect();
    let ab = acts.len() / cols;
    let mut out = vec![0f32; rows * cols];
    let (mut best, mut runs) = (Duration::MAX, 0usize);
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(1) {
        let t = Instant::now();
        k.dot_rows_multi(n, &w, rb, rows, &acts, ab, cols, &mut out);
        best = best.min(t.elapsed());
        runs += 1;
    }
    let macs = (rows * cols * n) as f64;
    println!(
        "{ty} {rows} x {n} x {cols} cols: best {:.1} GMAC/s, {:.3e} MACs in {runs} runs",
        macs / best.as_secs_f64() / 1e9,
        macs * runs as f64
    );
}
