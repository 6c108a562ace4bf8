//! Matrix-vector throughput of every weight type's dot kernel.
//!
//! `cargo run --release -p ferrolm-quant --example dot_bench [rows cols] [TYPE ...] [--plain]
//! [--quick]`
//!
//! The kernels are those of a weight tensor of `rows` rows (`matrix_kernel`): with llama.cpp's
//! default paths mirrored (Q4_K, Q4_0, IQ4_NL, MXFP4 repacked on x86-64 with AVX2, Q2_K with AVX512, the tiled
//! batches), or with `--plain` without them (`KernelOptions::PLAIN`).
//!
//! For each weight type: a random `rows x cols` matrix (default 4096 x 4096) in that type, a
//! random activation vector quantized to its `vec_dot_type`, and timed matrix-vector products
//! on one thread (scalar reference and the picked kernel) and on all threads (rows split
//! evenly with `std::thread::scope`). Prints a markdown table of weight GB/s, and the
//! multiply-accumulates per second of one column (`dot_rows`) against eight columns at once
//! (`dot_rows_multi`, as in prompt processing).

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::{random_act, random_row, Rng};
use ferrolm_quant::{matrix_kernel, row_bytes, DotKernel, KernelOptions, TensorType};

/// Activation columns in the prompt-processing measurement.
const COLS: usize = 8;

const TYPES: &[TensorType] = &[
    TensorType::Q4_0,
    TensorType::Q4_1,
    TensorType::Q5_0,
    TensorType::Q5_1,
    TensorType::Q8_0,
    TensorType::Q2_K,
    TensorType::Q3_K,
    TensorType::Q4_K,
    TensorType::Q5_K,
    TensorType::Q6_K,
    TensorType::IQ4_NL,
    TensorType::MXFP4,
    TensorType::IQ1_S,
    TensorType::IQ1_M,
    TensorType::IQ2_XXS,
    TensorType::IQ2_XS,
    TensorType::IQ2_S,
    TensorType::IQ3_XXS,
    TensorType::IQ3_S,
    TensorType::IQ4_XS,
    TensorType::TQ1_0,
    TensorType::TQ2_0,
    TensorType::Q1_0,
    TensorType::Q2_0,
    TensorType::NVFP4,
    TensorType::F16,
    TensorType::BF16,
    TensorType::F32,
];

fn matvec(
    k: &DotKernel,
    n: usize,
    w: &[u8],
    rb: usize,
    act: &[u8],
    out: &mut [f32],
    threads: usize,
) {
    if threads <= 1 {
        k.dot_rows(n, w, rb, act, out);
        return;
    }
    let per = out.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (t, o) in out.chunks_mut(per).enumerate() {
            let rows = &w[t * per * rb..];
            s.spawn(move || k.dot_rows(n, rows, rb, act, o));
        }
    });
}

/// Best time of repeated runs over at least `budget`.
fn time(mut f: impl FnMut(), budget: Duration) -> Duration {
    f(); // warm up caches and threads
    let start = Instant::now();
    let mut best = Duration::MAX;
    while start.elapsed() < budget {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed());
    }
    best
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let (rows, cols) = (
        args.first().copied().unwrap_or(4096),
        args.get(1).copied().unwrap_or(4096),
    );
    // Type names among the arguments keep only those types.
    let only: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| a.parse::<usize>().is_err() && !a.starts_with("--"))
        .collect();
    let options = if std::env::args().any(|a| a == "--plain") {
        KernelOptions::PLAIN
    } else {
        KernelOptions::default()
    };
    let scalar = KernelOptions {
        scalar: true,
        ..options
    };
    let quick = std::env::args().any(|a| a == "--quick");
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut rng = Rng::new(2024);
    println!("matrix {rows} x {cols}, {threads} threads, best of repeated runs\n");
    println!(
        "| type | act | ISA | MB | scalar 1T GB/s | SIMD 1T GB/s | SIMD {threads}T GB/s | speed-up 1T \
         | 1 col 1T GMAC/s | {COLS} cols 1T GMAC/s |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for &ty in TYPES {
        if !only.is_empty() && !only.iter().any(|o| o.eq_ignore_ascii_case(ty.name())) {
            continue;
        }
        let fast = matrix_kernel(ty, rows, &options).unwrap();
        let slow = matrix_kernel(ty, rows, &scalar).unwrap();
        let rb = row_bytes(ty, cols).unwrap();
        let mut w = Vec::with_capacity(rows * rb);
        let row_rng = &mut rng;
        // A few distinct random rows repeated: generation stays quick, bytes stay realistic.
        let distinct: Vec<Vec<u8>> = (0..64).map(|_| random_row(ty, cols, row_rng)).collect();
        for r in 0..rows {
            w.extend_from_slice(&distinct[(r * 7919) % distinct.len()]);
        }
        let (_, act) = random_act(fast.activation_type(), cols, &mut rng);
        let mut out = vec![0f32; rows];
        let bytes = (rows * rb) as f64;
        let gbs = |d: Duration| bytes / d.as_secs_f64() / 1e9;
        let budget = Duration::from_millis(400);
        let skipped = |f: &mut dyn FnMut()| {
            if quick {
                Duration::MAX
            } else {
                time(f, budget)
            }
        };
        let t_scalar = skipped(&mut || matvec(&slow, cols, &w, rb, &act, &mut out, 1));
        let t1 = time(|| matvec(&fast, cols, &w, rb, &act, &mut out, 1), budget);
        let tn = skipped(&mut || matvec(&fast, cols, &w, rb, &act, &mut out, threads));
        // Prompt processing: COLS activation columns against the same rows (at most 512
        // rows, so this stays quick).
        let ab = act.len();
        let mut acts = Vec::with_capacity(COLS * ab);
        for _ in 0..COLS {
            acts.extend(random_act(fast.activation_type(), cols, &mut rng).1);
        }
        let prows = rows.min(512);
        let mut pout = vec![0f32; prows * COLS];
        let tm = time(
            || fast.dot_rows_multi(cols, &w, rb, prows, &acts, ab, COLS, &mut pout),
            budget,
        );
        let gmac1 = (rows * cols) as f64 / t1.as_secs_f64() / 1e9;
        let gmacm = (prows * cols * COLS) as f64 / tm.as_secs_f64() / 1e9;
        println!(
            "| {} | {} | {} | {:.1} | {:.2} | {:.2} | {:.2} | {:.1}x | {:.1} | {:.1} |",
            ty,
            fast.activation_type(),
            if fast.repacked() {
                format!("{} repacked", fast.isa())
            } else {
                fast.isa().to_string()
            },
            bytes / 1e6,
            gbs(t_scalar),
            gbs(t1),
            gbs(tn),
            t_scalar.as_secs_f64() / t1.as_secs_f64(),
            gmac1,
            gmacm
        );
    }
}
