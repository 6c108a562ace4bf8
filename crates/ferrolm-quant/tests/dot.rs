//! Dot kernels: the scalar reference against a float dot of dequantized values, and every
//! SIMD kernel against the scalar reference.

mod common;

use common::{random_act, random_row, Rng, LATER_TYPES};
use ferrolm_quant::{
    dequantize, dot_kernel, dot_kernel_scalar, dot_kernel_with, vec_dot_type, KernelOptions,
    TensorType,
};

const SIMD_TYPES: &[TensorType] = &[
    TensorType::F32,
    TensorType::F16,
    TensorType::BF16,
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
];

/// Every weight type: the first set, then `common::LATER_TYPES`.
fn weight_types() -> Vec<TensorType> {
    [SIMD_TYPES, LATER_TYPES].concat()
}

/// Dequantized float dot in f64, and the sum of |terms| for tolerances.
fn float_dot(ty: TensorType, n: usize, row: &[u8], act: &[u8]) -> (f64, f64) {
    let act_ty = vec_dot_type(ty).unwrap();
    let mut w = vec![0f32; n];
    let mut a = vec![0f32; n];
    dequantize(ty, row, &mut w).unwrap();
    dequantize(act_ty, act, &mut a).unwrap();
    let dot = w.iter().zip(&a).map(|(&x, &y)| x as f64 * y as f64).sum();
    let mag = w
        .iter()
        .zip(&a)
        .map(|(&x, &y)| (x as f64 * y as f64).abs())
        .sum();
    (dot, mag)
}

#[test]
fn scalar_kernels_equal_the_dequantized_dot() {
    let mut rng = Rng::new(42);
    for ty in weight_types() {
        let k = dot_kernel_scalar(ty).unwrap();
        assert_eq!(k.isa(), "scalar");
        for blocks in [1, 3, 8] {
            let n = blocks * ty.block_size().max(32);
            let row = random_row(ty, n, &mut rng);
            let (_, act) = random_act(k.activation_type(), n, &mut rng);
            let got = k.dot(n, &row, &act) as f64;
            let (want, mag) = float_dot(ty, n, &row, &act);
            // f16-rounded products of scales (Q8_1's s) cost a little more than f32 rounding.
            let tol = 2e-3 * mag + 1e-30;
            assert!(
                (got - want).abs() <= tol,
                "{ty} n={n}: scalar {got} vs dequantized {want} (|terms| {mag})"
            );
            assert!(mag > 0.0, "{ty}: degenerate test data");
        }
    }
}

#[test]
fn simd_kernels_equal_the_scalar_reference() {
    let mut rng = Rng::new(1234);
    let mut simd = 0;
    for ty in weight_types() {
        let fast = dot_kernel(ty).unwrap();
        let slow = dot_kernel_scalar(ty).unwrap();
        if fast.isa() != "scalar" {
            simd += 1;
        }
        for blocks in [1, 2, 5, 16, 33] {
            let n = blocks * ty.block_size().max(32);
            for _ in 0..4 {
                let row = random_row(ty, n, &mut rng);
                let (_, act) = random_act(fast.activation_type(), n, &mut rng);
                let a = fast.dot(n, &row, &act) as f64;
                let b = slow.dot(n, &row, &act) as f64;
                let (_, mag) = float_dot(ty, n, &row, &act);
                let tol = 1e-5 * mag + 1e-30;
                assert!(
                    (a - b).abs() <= tol,
                    "{ty} n={n} ({}): {a} vs scalar {b}, |terms| {mag}",
                    fast.isa()
                );
            }
        }
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert_eq!(
            simd,
            weight_types().len(),
            "every weight type has an AVX2 kernel"
        );
    }
    // aarch64: tests/neon.rs checks which types have a NEON kernel, bit for bit.
    let _ = simd;
}

#[test]
fn dot_rows_and_multi_match_single_dots() {
    let mut rng = Rng::new(99);
    for ty in weight_types() {
        let k = dot_kernel(ty).unwrap();
        let n = 2 * ty.block_size().max(64);
        let rb = ferrolm_quant::row_bytes(ty, n).unwrap();
        let ab = ferrolm_quant::row_bytes(k.activation_type(), n).unwrap();
        for n_rows in [1, 3, 4, 7] {
            let stride = rb + 5; // rows need not be packed
            let mut rows = vec![0u8; n_rows * stride];
            for i in 0..n_rows {
                rows[i * stride..i * stride + rb].copy_from_slice(&random_row(ty, n, &mut rng));
            }
            let n_cols = 6; // one group of four columns and a remainder
            let mut acts = Vec::new();
            for _ in 0..n_cols {
                acts.extend(random_act(k.activation_type(), n, &mut rng).1);
            }
            let mut out = vec![0f32; n_rows];
            k.dot_rows(n, &rows, stride, &acts[..ab], &mut out);
            let mut multi = vec![0f32; n_rows * n_cols];
            k.dot_rows_multi(n, &rows, stride, n_rows, &acts, ab, n_cols, &mut multi);
            // Batches of these types follow llamafile_sgemm, not vec_dot: compare with the
            // scalar kernel's batch instead (tests/ggml_oracle.rs checks both against llama.cpp).
            let sgemm = matches!(
                ty,
                TensorType::IQ4_NL | TensorType::F32 | TensorType::F16 | TensorType::BF16
            );
            let mut scalar_multi = vec![0f32; n_rows * n_cols];
            dot_kernel_scalar(ty).unwrap().dot_rows_multi(
                n,
                &rows,
                stride,
                n_rows,
                &acts,
                ab,
                n_cols,
                &mut scalar_multi,
            );
            for i in 0..n_rows {
                let row = &rows[i * stride..i * stride + rb];
                let single = k.dot(n, row, &acts[..ab]);
                assert_eq!(
                    out[i].to_bits(),
                    single.to_bits(),
                    "{ty} rows={n_rows} row {i}"
                );
                for c in 0..n_cols {
                    let s = if sgemm {
                        scalar_multi[c * n_rows + i]
                    } else {
                        k.dot(n, row, &acts[c * ab..(c + 1) * ab])
                    };
                    assert_eq!(
                        multi[c * n_rows + i].to_bits(),
                        s.to_bits(),
                        "{ty} multi r{i} c{c}"
                    );
                }
            }
        }
    }
}

/// Batches wide enough for the whole register tiles (8 and more columns, row pairs and an odd
/// row, several groups of rows and of columns): every output equals the single dot of its row
/// and column, bit for bit.
#[test]
fn multi_full_tiles_match_single_dots() {
    let mut rng = Rng::new(7);
    for ty in weight_types() {
        if matches!(
            ty,
            TensorType::IQ4_NL | TensorType::F32 | TensorType::F16 | TensorType::BF16
        ) || TILED.contains(&ty)
        {
            // llamafile_sgemm order, checked against llama.cpp in ggml_oracle.rs; the tiled
            // types in tiled_batches_switch_to_the_tiled_sum
            continue;
        }
        let k = dot_kernel(ty).unwrap();
        let n = 3 * ty.block_size().max(64);
        let rb = ferrolm_quant::row_bytes(ty, n).unwrap();
        let ab = ferrolm_quant::row_bytes(k.activation_type(), n).unwrap();
        for (n_rows, n_cols) in [(2, 8), (5, 19), (4, 16), (9, 24)] {
            let stride = rb + 3;
            let mut rows = vec![0u8; n_rows * stride];
            for i in 0..n_rows {
                rows[i * stride..i * stride + rb].copy_from_slice(&random_row(ty, n, &mut rng));
            }
            let mut acts = Vec::new();
            for _ in 0..n_cols {
                acts.extend(random_act(k.activation_type(), n, &mut rng).1);
            }
            let mut multi = vec![0f32; n_rows * n_cols];
            k.dot_rows_multi(n, &rows, stride, n_rows, &acts, ab, n_cols, &mut multi);
            for i in 0..n_rows {
                let row = &rows[i * stride..i * stride + rb];
                for c in 0..n_cols {
                    let s = k.dot(n, row, &acts[c * ab..(c + 1) * ab]);
                    assert_eq!(
                        multi[c * n_rows + i].to_bits(),
                        s.to_bits(),
                        "{ty} {n_rows}x{n_cols} r{i} c{c}"
                    );
                }
            }
        }
    }
}

/// The types llama.cpp's tiled matmul takes from 8 activation columns.
const TILED: &[TensorType] = &[
    TensorType::Q2_K,
    TensorType::Q3_K,
    TensorType::Q4_K,
    TensorType::Q5_K,
    TensorType::Q6_K,
    TensorType::IQ1_S,
    TensorType::IQ1_M,
    TensorType::IQ2_XXS,
    TensorType::IQ2_XS,
    TensorType::IQ2_S,
    TensorType::IQ3_XXS,
    TensorType::IQ3_S,
    TensorType::IQ4_XS,
];

/// Below 8 columns a tiled type's batch is its `vec_dot`, bit for bit; from 8 it is the tiled
/// kernel's sum (bit-exact with llama.cpp through tests/synthetic_parity.rs in ferrolm-model),
/// which differs from `vec_dot` in rounding only.
#[test]
fn tiled_batches_switch_to_the_tiled_sum() {
    let mut rng = Rng::new(17);
    for &ty in TILED {
        let k = dot_kernel(ty).unwrap();
        let n = 3 * ty.block_size();
        let rb = ferrolm_quant::row_bytes(ty, n).unwrap();
        let ab = ferrolm_quant::row_bytes(k.activation_type(), n).unwrap();
        let n_rows = 3;
        let rows: Vec<u8> = (0..n_rows)
            .flat_map(|_| random_row(ty, n, &mut rng))
            .collect();
        let mut differ = 0;
        for n_cols in [7, 8, 20] {
            let acts: Vec<u8> = (0..n_cols)
                .flat_map(|_| random_act(k.activation_type(), n, &mut rng).1)
                .collect();
            let mut multi = vec![0f32; n_rows * n_cols];
            k.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut multi);
            let mut scalar = vec![0f32; n_rows * n_cols];
            let s = dot_kernel_scalar(ty).unwrap();
            s.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut scalar);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&multi),
                bits(&scalar),
                "{ty} {n_cols} cols: SIMD vs scalar"
            );
            for i in 0..n_rows {
                let row = &rows[i * rb..(i + 1) * rb];
                for c in 0..n_cols {
                    let act = &acts[c * ab..(c + 1) * ab];
                    let (got, single) = (multi[c * n_rows + i], k.dot(n, row, act));
                    if n_cols < 8 {
                        assert_eq!(got.to_bits(), single.to_bits(), "{ty} {n_cols} cols");
                    } else {
                        let (want, mag) = float_dot(ty, n, row, act);
                        let tol = 1e-5 * mag + 1e-30;
                        assert!((got as f64 - want).abs() <= tol, "{ty}: {got} vs {want}");
                        differ += (got != single) as usize;
                    }
                }
            }
        }
        assert!(differ > 0, "{ty}: the tiled sum never differs from vec_dot");
    }
}

#[test]
#[should_panic(expected = "multiple of the block size")]
fn dot_panics_on_partial_blocks() {
    let k = dot_kernel(TensorType::Q4_0).unwrap();
    k.dot(48, &[0u8; 36], &[0u8; 68]);
}

#[test]
#[should_panic(expected = "row has")]
fn dot_panics_on_short_rows() {
    let k = dot_kernel(TensorType::Q8_0).unwrap();
    k.dot(64, &[0u8; 67], &[0u8; 68]);
}

/// The batched Q4_K and Q6_K products without the tiled matmul (the AVX-512 VNNI tile where
/// the CPU has one: 4 rows x 8 columns) against single dots, with random and extreme blocks: every quant at its
/// largest, activations at -128 and 127, all 6-bit scales, and shapes with whole tiles and
/// remainders of rows and columns.
#[test]
fn k_quant_batches_with_extreme_blocks_match_single_dots() {
    let mut rng = Rng::new(11);
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    for ty in [TensorType::Q4_K, TensorType::Q6_K] {
        let k = dot_kernel_with(ty, &KernelOptions::PLAIN).unwrap();
        let n = 2 * 256;
        let rb = ferrolm_quant::row_bytes(ty, n).unwrap();
        let ab = ferrolm_quant::row_bytes(k.activation_type(), n).unwrap();
        let (wb, d_at) = if ty == TensorType::Q4_K {
            (144, 0)
        } else {
            (210, 208)
        };
        let weight_row = |rng: &mut Rng, i: usize| {
            let mut row = match i % 3 {
                0 => rng.bytes(rb),
                1 => vec![0xff; rb],
                _ => random_row(ty, n, rng),
            };
            for b in 0..n / 256 {
                let o = b * wb + d_at;
                row[o..o + 2].copy_from_slice(&f16(0.01 + rng.uniform()));
                if ty == TensorType::Q4_K {
                    row[o + 2..o + 4].copy_from_slice(&f16(rng.uniform()));
                }
            }
            row
        };
        let act = |rng: &mut Rng, c: usize| {
            let mut a = vec![0u8; ab];
            for b in 0..n / 256 {
                let blk = &mut a[b * 292..(b + 1) * 292];
                blk[..4].copy_from_slice(&(0.001 + rng.uniform()).to_le_bytes());
                let qs: Vec<i8> = (0..256)
                    .map(|e| match c % 3 {
                        0 => (rng.next_u64() % 256) as u8 as i8,
                        1 => -128,
                        _ if e % 2 == 0 => 127,
                        _ => -128,
                    })
                    .collect();
                for (e, q) in qs.iter().enumerate() {
                    blk[4 + e] = *q as u8;
                }
                for g in 0..16 {
                    let s: i16 = qs[16 * g..16 * (g + 1)].iter().map(|&q| q as i16).sum();
                    blk[260 + 2 * g..262 + 2 * g].copy_from_slice(&s.to_le_bytes());
                }
            }
            a
        };
        for (n_rows, n_cols) in [(4, 8), (8, 24), (6, 13), (3, 9)] {
            let rows: Vec<u8> = (0..n_rows).flat_map(|i| weight_row(&mut rng, i)).collect();
            let acts: Vec<u8> = (0..n_cols).flat_map(|c| act(&mut rng, c)).collect();
            let mut multi = vec![0f32; n_rows * n_cols];
            k.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut multi);
            for i in 0..n_rows {
                for c in 0..n_cols {
                    let s = k.dot(n, &rows[i * rb..(i + 1) * rb], &acts[c * ab..(c + 1) * ab]);
                    assert!(s.is_finite(), "{ty} r{i} c{c}");
                    assert_eq!(
                        multi[c * n_rows + i].to_bits(),
                        s.to_bits(),
                        "{ty} {n_rows}x{n_cols} r{i} c{c}"
                    );
                }
            }
        }
    }
}
