//! Every SIMD kernel against the scalar reference, bit for bit: single dots over odd and even
//! block counts, row batches of odd row counts and column batches below the tiled kernels'
//! width. On aarch64 (run under qemu in CI) every quantized type has a NEON kernel.

mod common;

use common::{random_act, random_row, Rng};
use ferrolm_quant::{dot_kernel_scalar, dot_kernel_with, row_bytes, KernelOptions, TensorType};

/// Every quantized weight type (those with a dot kernel, floats aside).
fn quantized_types() -> Vec<TensorType> {
    let float = [TensorType::F32, TensorType::F16, TensorType::BF16];
    TensorType::ALL
        .iter()
        .copied()
        .filter(|ty| !float.contains(ty) && dot_kernel_scalar(*ty).is_ok())
        .collect()
}

#[test]
fn simd_dots_equal_the_scalar_bits() {
    let mut rng = Rng::new(2024);
    let types = quantized_types();
    for ty in [
        TensorType::Q4_0,
        TensorType::Q6_K,
        TensorType::IQ1_M,
        TensorType::NVFP4,
    ] {
        assert!(types.contains(&ty), "{ty} missing from {types:?}");
    }
    for ty in types {
        // vec_dot everywhere: the tiled batches have their own tests
        let fast = dot_kernel_with(ty, &KernelOptions::PLAIN).unwrap();
        let slow = dot_kernel_scalar(ty).unwrap();
        #[cfg(target_arch = "aarch64")]
        assert_eq!(fast.isa(), "neon", "{ty} has no NEON kernel");
        let act_ty = fast.activation_type();
        for blocks in [1, 2, 3, 7, 8] {
            let n = blocks * ty.block_size().max(32);
            let (rb, ab) = (row_bytes(ty, n).unwrap(), row_bytes(act_ty, n).unwrap());
            for n_rows in [1, 3, 5] {
                let rows: Vec<u8> = (0..n_rows)
                    .flat_map(|_| random_row(ty, n, &mut rng))
                    .collect();
                let n_cols = 3;
                let acts: Vec<u8> = (0..n_cols)
                    .flat_map(|_| random_act(act_ty, n, &mut rng).1)
                    .collect();
                let mut got = vec![0f32; n_rows * n_cols];
                let mut want = vec![0f32; n_rows * n_cols];
                fast.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut got);
                slow.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut want);
                for i in 0..n_rows {
                    let (row, act) = (&rows[i * rb..(i + 1) * rb], &acts[..ab]);
                    let (a, b) = (fast.dot(n, row, act), slow.dot(n, row, act));
                    assert_eq!(a.to_bits(), b.to_bits(), "{ty} n={n} row {i}: {a} vs {b}");
                }
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{ty} n={n} rows={n_rows} batch");
            }
        }
    }
}
