//! llama.cpp's repacked Q2_K products (`repack::half_sums_q2_k` with `repack::gemv` and
//! `repack::gemm`) with AVX2: each block's exact sums of its two 128-element halves, then the
//! reference's fmas. Integers are exact however they are added up, so only the float steps
//! follow the reference's order.

use std::arch::x86_64::*;

use super::{bsums, f16_pair, load, low2, pair_scales, y_d, Y_QS};
use crate::k_quants::QK_K;

/// Bytes of a Q2_K block and of a Q8_K one.
const WB: usize = 84;
const AB: usize = 292;

/// The pieces of one Q2_K block that every column meets: its two 32-byte runs of quants, the
/// scales as i16 pairs (`pair_scales`: sub-blocks 2k, 2k + 1 in the halves of vector k), the
/// minimums as i16, `d` and `dmin`.
struct Q2 {
    q: [__m256i; 2],
    scv: [__m256i; 8],
    mins: __m256i,
    d: f32,
    dmin: f32,
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn decode(x: *const u8) -> Q2 {
    let sc = _mm_loadu_si128(x as *const __m128i);
    let nibble = _mm_set1_epi8(0x0f);
    let (d, dmin) = f16_pair(x.add(80));
    Q2 {
        q: [load(x.add(16)), load(x.add(48))],
        scv: pair_scales(_mm_and_si128(sc, nibble)),
        mins: _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), nibble)),
        d,
        dmin,
    }
}

/// `[S_0, S_1, M_0, M_1]` of the block against the Q8_K block at `y`, per half.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn half_sums(x: &Q2, y: *const u8) -> __m128i {
    let mut s = [_mm256_setzero_si256(); 2];
    for (h, s) in s.iter_mut().enumerate() {
        for j in 0..4 {
            let yv = load(y.add(Y_QS + 128 * h + 32 * j));
            // quants 0..=3 against i8: maddubs' pairs cannot saturate
            let p = _mm256_maddubs_epi16(low2(x.q[h], 2 * j as i32), yv);
            *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, x.scv[4 * h + j]));
        }
    }
    // the minimums' lanes 0..4 are half 0's sub-blocks, lanes 4..8 half 1's
    let m = _mm256_madd_epi16(x.mins, bsums(y));
    let t = _mm256_hadd_epi32(s[0], s[1]);
    let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
    let m = _mm_hadd_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
    _mm_hadd_epi32(t, m)
}

/// The four sums of [`half_sums`] as integers.
#[inline(always)]
unsafe fn lanes(v: __m128i) -> [i32; 4] {
    std::mem::transmute::<__m128i, [i32; 4]>(v)
}

/// `DotKernel::dot` of a repacked Q2_K row: the gemv. Handed out only after run-time
/// detection of AVX2, FMA and F16C (`kernel::build_repacked`); `row` and `act` are exactly
/// the blocks of `n` elements.
pub(crate) fn dot(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = n / QK_K;
    assert!(row.len() >= nb * WB && act.len() >= nb * AB);
    // SAFETY: the features were detected before this function was handed out; the loads read
    // within the `nb` blocks of both (checked above).
    unsafe { gemv(nb, row.as_ptr(), act.as_ptr()) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for b in 0..nb {
        let (xb, yb) = (x.add(b * WB), y.add(b * AB));
        let blk = decode(xb);
        let [s0, s1, m0, m1] = lanes(half_sums(&blk, yb));
        let yd = y_d(yb);
        acc = ((s0 + s1) as f32).mul_add(blk.d * yd, acc);
        acc_min = ((m0 + m1) as f32).mul_add(blk.dmin * yd, acc_min);
    }
    acc - acc_min
}

/// `DotKernel::dot_rows_multi` of repacked Q2_K rows (`repack::multi_k`'s split: the gemm for
/// the first `n_cols - n_cols % 4` columns, the gemv for the rest), under the same conditions
/// as [`dot`]: each block of a row decoded once for all the columns.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
pub(crate) fn multi(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    let nb = n / QK_K;
    if n_rows == 0 || n_cols == 0 {
        return;
    }
    assert!(rows.len() >= (n_rows - 1) * row_stride + nb * WB);
    assert!(acts.len() >= (n_cols - 1) * act_stride + nb * AB);
    assert!(out.len() >= n_rows * n_cols);
    let gemm_cols = n_cols - n_cols % 4;
    let (mut acc, mut acc_min) = (vec![0f32; n_cols], vec![0f32; n_cols]);
    for i in 0..n_rows {
        acc.fill(0.0);
        acc_min.fill(0.0);
        // SAFETY: as in `dot`; row i and every column lie within the checked lengths.
        unsafe {
            row_into(
                nb,
                rows.as_ptr().add(i * row_stride),
                acts.as_ptr(),
                act_stride,
                gemm_cols,
                &mut acc,
                &mut acc_min,
            )
        };
        for c in 0..n_cols {
            out[c * n_rows + i] = acc[c] - acc_min[c];
        }
    }
}

/// One row's accumulators against every column (`acc.len()` of them, `stride` bytes apart):
/// the gemm's two fmas per half for the first `gemm_cols`, the gemv's one per block after.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_into(
    nb: usize,
    x: *const u8,
    y: *const u8,
    stride: usize,
    gemm_cols: usize,
    acc: &mut [f32],
    acc_min: &mut [f32],
) {
    for b in 0..nb {
        let blk = decode(x.add(b * WB));
        for (c, (acc, acc_min)) in acc.iter_mut().zip(acc_min.iter_mut()).enumerate() {
            let yb = y.add(c * stride + b * AB);
            let [s0, s1, m0, m1] = lanes(half_sums(&blk, yb));
            let yd = y_d(yb);
            let (d, dmin) = (blk.d * yd, blk.dmin * yd);
            if c < gemm_cols {
                *acc = (s0 as f32).mul_add(d, *acc);
                *acc_min = (m0 as f32).mul_add(dmin, *acc_min);
                *acc = (s1 as f32).mul_add(d, *acc);
                *acc_min = (m1 as f32).mul_add(dmin, *acc_min);
            } else {
                *acc = ((s0 + s1) as f32).mul_add(d, *acc);
                *acc_min = ((m0 + m1) as f32).mul_add(dmin, *acc_min);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::avx2::tiled512::tests::stream;
    use crate::{matrix_kernel, quantize_activation, KernelOptions, TensorType};

    /// `count` rows of `n` elements of random Q2_K blocks: every scale and quant byte random,
    /// `d` and `dmin` of moderate size.
    fn q2_k_rows(count: usize, n: usize, next: &mut impl FnMut() -> u64) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..count * n / 256 {
            out.extend((0..80).map(|_| next() as u8));
            for _ in 0..2 {
                out.extend((0x1800 + (next() % 0x1000) as u16).to_le_bytes());
            }
        }
        out
    }

    /// Q8_K activations of `count` columns: gaussian-ish values with outliers, at times a
    /// column of one value (its quants all at the extreme).
    fn q8_k_cols(count: usize, n: usize, next: &mut impl FnMut() -> u64) -> Vec<u8> {
        let mut out = vec![0u8; count * n / 256 * 292];
        for (c, col) in out.chunks_exact_mut(n / 256 * 292).enumerate() {
            let x: Vec<f32> = (0..n)
                .map(|i| match (c % 5, i % 97) {
                    (4, _) => -3.0,
                    (_, 0) => (next() % 2000) as f32 - 1000.0,
                    _ => ((next() % 20001) as f32 - 10000.0) / 3000.0,
                })
                .collect();
            quantize_activation(TensorType::Q8_K, &x, col).unwrap();
        }
        out
    }

    /// The AVX2 kernel gives the scalar reference's bits for single dots, rows and batches
    /// (column counts on both sides of the gemm's multiples of 4); the gemm and the gemv
    /// differ in their float steps, so a batch's last `n % 4` columns must be the gemv's.
    #[test]
    fn avx2_matches_the_scalar_reference() {
        if !(is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            return;
        }
        let mut next = stream(0x9e37_79b9_7f4a_7c15);
        let scalar = KernelOptions {
            scalar: true,
            ..Default::default()
        };
        let fast = matrix_kernel(TensorType::Q2_K, 64, &KernelOptions::default()).unwrap();
        let reference = matrix_kernel(TensorType::Q2_K, 64, &scalar).unwrap();
        assert!(fast.repacked() && reference.repacked() && fast.isa() == "avx2");
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let mut gemm_differs = false;
        for (n, n_rows, n_cols) in [(256, 1, 1), (768, 3, 5), (512, 13, 7), (4096, 9, 12)] {
            let rows = q2_k_rows(n_rows, n, &mut next);
            let acts = q8_k_cols(n_cols, n, &mut next);
            let (rb, ab) = (rows.len() / n_rows, acts.len() / n_cols);
            let what = format!("Q2_K {n_rows} x {n} x {n_cols}");
            let mut got = vec![0f32; n_rows * n_cols];
            fast.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut got);
            let mut want = vec![0f32; n_rows * n_cols];
            reference.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut want);
            assert_eq!(bits(&got), bits(&want), "{what}");
            for c in 0..n_cols {
                let act = &acts[c * ab..(c + 1) * ab];
                let mut got_rows = vec![0f32; n_rows];
                fast.dot_rows(n, &rows, rb, act, &mut got_rows);
                for i in 0..n_rows {
                    let one = fast.dot(n, &rows[i * rb..(i + 1) * rb], act);
                    assert_eq!(one.to_bits(), got_rows[i].to_bits(), "{what}: row {i}");
                    let batch = want[c * n_rows + i];
                    if c >= n_cols - n_cols % 4 {
                        assert_eq!(one.to_bits(), batch.to_bits(), "{what}: gemv column {c}");
                    } else {
                        gemm_differs |= one.to_bits() != batch.to_bits();
                    }
                }
            }
        }
        assert!(
            gemm_differs,
            "the gemm's steps never changed a bit: the test is too weak"
        );
    }
}
