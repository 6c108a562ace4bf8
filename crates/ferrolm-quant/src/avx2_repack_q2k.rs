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

/// Two ways to the exact sums of a block's halves: [`Narrow`] (AVX2) and [`Wide`] (AVX512BW).
trait HalfSums {
    /// What one block decodes to, once for all the columns it meets.
    type Block;
    /// Decodes the Q2_K block at `x`.
    unsafe fn decode(x: *const u8) -> Self::Block;
    /// `[S_0, S_1, M_0, M_1]` of the block against the Q8_K block at `y`, per half.
    unsafe fn sums(x: &Self::Block, y: *const u8) -> __m128i;
    /// The block's `d` and `dmin`.
    fn scales(x: &Self::Block) -> (f32, f32);
}

/// `[S_0, S_1, M_0, M_1]` from the halves' partial sums `s0`, `s1` and the minimums' products
/// `m` (lanes 0..4 half 0's sub-blocks, 4..8 half 1's).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn reduce(s0: __m256i, s1: __m256i, m: __m256i) -> __m128i {
    let t = _mm256_hadd_epi32(s0, s1);
    let t = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
    let m = _mm_hadd_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256::<1>(m));
    _mm_hadd_epi32(t, m)
}

/// AVX2: the block's two 32-byte runs of quants, the scales as i16 pairs (`pair_scales`:
/// sub-blocks 2k, 2k + 1 in the halves of vector k), the minimums as i16, `d` and `dmin`.
struct Narrow;

struct Q2 {
    q: [__m256i; 2],
    scv: [__m256i; 8],
    mins: __m256i,
    d: f32,
    dmin: f32,
}

impl HalfSums for Narrow {
    type Block = Q2;

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

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sums(x: &Q2, y: *const u8) -> __m128i {
        let mut s = [_mm256_setzero_si256(); 2];
        for (h, s) in s.iter_mut().enumerate() {
            for j in 0..4 {
                let yv = load(y.add(Y_QS + 128 * h + 32 * j));
                // quants 0..=3 against i8: maddubs' pairs cannot saturate
                let p = _mm256_maddubs_epi16(low2(x.q[h], 2 * j as i32), yv);
                *s = _mm256_add_epi32(*s, _mm256_madd_epi16(p, x.scv[4 * h + j]));
            }
        }
        reduce(s[0], s[1], _mm256_madd_epi16(x.mins, bsums(y)))
    }

    fn scales(x: &Q2) -> (f32, f32) {
        (x.d, x.dmin)
    }
}

/// AVX512BW: 64 quants a vector, in the activation's order (vector p: elements 64p.., the
/// sub-blocks 4p..4p + 4, whose scales `vpermw` spreads over its i16 lanes).
struct Wide;

struct Q2Wide {
    q: [__m512i; 4],
    scv: [__m512i; 4],
    mins: __m256i,
    d: f32,
    dmin: f32,
}

impl HalfSums for Wide {
    type Block = Q2Wide;

    #[inline]
    #[target_feature(enable = "avx2,f16c,avx512f,avx512bw")]
    unsafe fn decode(x: *const u8) -> Q2Wide {
        let sc = _mm_loadu_si128(x as *const __m128i);
        let nibble = _mm_set1_epi8(0x0f);
        let (d, dmin) = f16_pair(x.add(80));
        let sc16 = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_and_si128(sc, nibble)));
        // vector p: half p / 2's 32 bytes in both 256-bit halves, shifted by 4(p % 2) and
        // 4(p % 2) + 2 (elements 64p..64p + 32 and 64p + 32..64p + 64)
        let q = std::array::from_fn(|p| {
            let raw = _mm512_broadcast_i64x4(load(x.add(16 + 32 * (p / 2))));
            let (a, b) = ((4 * (p % 2)) as i16, (4 * (p % 2) + 2) as i16);
            let shift = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi16(a)),
                _mm256_set1_epi16(b),
            );
            _mm512_and_si512(_mm512_srlv_epi16(raw, shift), _mm512_set1_epi8(3))
        });
        let scv = std::array::from_fn(|p| {
            let idx: [i16; 32] = std::array::from_fn(|l| (4 * p + l / 8) as i16);
            _mm512_permutexvar_epi16(_mm512_loadu_si512(idx.as_ptr() as *const _), sc16)
        });
        Q2Wide {
            q,
            scv,
            mins: _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), nibble)),
            d,
            dmin,
        }
    }

    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw")]
    unsafe fn sums(x: &Q2Wide, y: *const u8) -> __m128i {
        let part = |p: usize| {
            let yv = _mm512_loadu_si512(y.add(Y_QS + 64 * p) as *const _);
            // quants 0..=3 against i8: maddubs' pairs cannot saturate
            _mm512_madd_epi16(_mm512_maddubs_epi16(x.q[p], yv), x.scv[p])
        };
        let half = |p: usize| {
            let v = _mm512_add_epi32(part(p), part(p + 1));
            _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
        };
        reduce(half(0), half(2), _mm256_madd_epi16(x.mins, bsums(y)))
    }

    fn scales(x: &Q2Wide) -> (f32, f32) {
        (x.d, x.dmin)
    }
}

impl Wide {
    /// `[a, b, c, e]` with `a + b` the block's `S` and `c + e` its `M`, fewer steps than
    /// [`HalfSums::sums`] where the halves need not be apart (the gemv).
    #[inline]
    #[target_feature(enable = "avx2,avx512f,avx512bw")]
    unsafe fn totals(x: &Q2Wide, y: *const u8) -> __m128i {
        let part = |p: usize| {
            let yv = _mm512_loadu_si512(y.add(Y_QS + 64 * p) as *const _);
            _mm512_madd_epi16(_mm512_maddubs_epi16(x.q[p], yv), x.scv[p])
        };
        let v = _mm512_add_epi32(
            _mm512_add_epi32(part(0), part(1)),
            _mm512_add_epi32(part(2), part(3)),
        );
        let v = _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v));
        let t = _mm256_hadd_epi32(v, _mm256_madd_epi16(x.mins, bsums(y)));
        _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t))
    }
}

/// The four sums of [`HalfSums::sums`] as integers.
#[inline(always)]
unsafe fn lanes(v: __m128i) -> [i32; 4] {
    std::mem::transmute::<__m128i, [i32; 4]>(v)
}

/// Whether the CPU has what [`Wide`] needs.
fn wide() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw")
}

/// `DotKernel::dot` of a repacked Q2_K row: the gemv. Handed out only after run-time
/// detection of AVX2, FMA and F16C (`kernel::build_repacked`); `row` and `act` are exactly
/// the blocks of `n` elements.
pub(crate) fn dot(n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_with(wide(), n, row, act)
}

/// [`dot`], by AVX512BW when `wide` (which the CPU must have).
fn dot_with(wide: bool, n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = n / QK_K;
    assert!(row.len() >= nb * WB && act.len() >= nb * AB);
    assert!(!wide || self::wide());
    // SAFETY: the features were detected (AVX512BW just above); the loads read within the
    // `nb` blocks of both (checked above).
    unsafe {
        if wide {
            gemv_512(nb, row.as_ptr(), act.as_ptr())
        } else {
            gemv_avx2(nb, row.as_ptr(), act.as_ptr())
        }
    }
}

/// `DotKernel::dot_rows` of repacked Q2_K rows: the gemv, four rows at a time by AVX512BW
/// where the CPU has it (their sums reduced together, their two fmas each in the lanes of one
/// vector), under the same conditions as [`dot`].
pub(crate) fn rows(n: usize, rows: &[u8], row_stride: usize, act: &[u8], out: &mut [f32]) {
    rows_with(wide(), n, rows, row_stride, act, out)
}

/// [`rows`], by AVX512BW when `wide` (which the CPU must have).
fn rows_with(wide: bool, n: usize, rows: &[u8], row_stride: usize, act: &[u8], out: &mut [f32]) {
    let nb = n / QK_K;
    assert!(act.len() >= nb * AB);
    assert!(out.is_empty() || rows.len() >= (out.len() - 1) * row_stride + nb * WB);
    assert!(!wide || self::wide());
    let quads = if wide { out.len() / 4 } else { 0 };
    for g in 0..quads {
        // SAFETY: AVX512BW was detected (asserted above), the rest before this function was
        // handed out; rows 4g..4g + 4 and the column lie within the checked lengths.
        let four = unsafe {
            gemv4_512(
                nb,
                rows.as_ptr().add(4 * g * row_stride),
                row_stride,
                act.as_ptr(),
            )
        };
        out[4 * g..4 * g + 4].copy_from_slice(&four);
    }
    for (i, o) in out.iter_mut().enumerate().skip(4 * quads) {
        *o = dot_with(
            wide,
            n,
            &rows[i * row_stride..i * row_stride + nb * WB],
            act,
        );
    }
}

/// Four rows (`stride` bytes apart) against one column, the gemv: lanes `2r`, `2r + 1` of one
/// vector hold row r's `acc` and `acc_min`, each its own chain in block order.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn gemv4_512(nb: usize, x: *const u8, stride: usize, y: *const u8) -> [f32; 4] {
    let mut acc = _mm256_setzero_ps();
    for b in 0..nb {
        let yb = y.add(b * AB);
        // plain loops: closures would not inherit the target features, nor be inlined
        let mut t = [_mm_setzero_si128(); 4];
        let mut dm = [0i32; 4];
        for r in 0..4 {
            let xb = x.add(r * stride + b * WB);
            t[r] = Wide::totals(&Wide::decode(xb), yb);
            // the row's d and dmin, side by side as in its block
            dm[r] = (xb.add(80) as *const i32).read_unaligned();
        }
        // [S_0, M_0, S_1, M_1 | S_2, M_2, S_3, M_3]
        let sm = _mm256_set_m128i(_mm_hadd_epi32(t[2], t[3]), _mm_hadd_epi32(t[0], t[1]));
        let dm = _mm256_cvtph_ps(_mm_loadu_si128(dm.as_ptr() as *const __m128i));
        let scale = _mm256_mul_ps(dm, _mm256_set1_ps(y_d(yb)));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sm), scale, acc);
    }
    let a = std::mem::transmute::<__m256, [f32; 8]>(acc);
    std::array::from_fn(|r| a[2 * r] - a[2 * r + 1])
}

#[inline(always)]
unsafe fn gemv<H: HalfSums>(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for b in 0..nb {
        let (xb, yb) = (x.add(b * WB), y.add(b * AB));
        let blk = H::decode(xb);
        let [s0, s1, m0, m1] = lanes(H::sums(&blk, yb));
        let ((d, dmin), yd) = (H::scales(&blk), y_d(yb));
        acc = ((s0 + s1) as f32).mul_add(d * yd, acc);
        acc_min = ((m0 + m1) as f32).mul_add(dmin * yd, acc_min);
    }
    acc - acc_min
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn gemv_avx2(nb: usize, x: *const u8, y: *const u8) -> f32 {
    gemv::<Narrow>(nb, x, y)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn gemv_512(nb: usize, x: *const u8, y: *const u8) -> f32 {
    gemv::<Wide>(nb, x, y)
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
    multi_with(
        wide(),
        n,
        rows,
        row_stride,
        n_rows,
        acts,
        act_stride,
        n_cols,
        out,
    )
}

/// [`multi`], by AVX512BW when `wide` (which the CPU must have).
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
fn multi_with(
    wide: bool,
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
    assert!(!wide || self::wide());
    let gemm_cols = n_cols - n_cols % 4;
    let (mut acc, mut acc_min) = (vec![0f32; n_cols], vec![0f32; n_cols]);
    for i in 0..n_rows {
        acc.fill(0.0);
        acc_min.fill(0.0);
        let x = rows.as_ptr().wrapping_add(i * row_stride);
        let y = acts.as_ptr();
        // SAFETY: as in `dot_with`; row i and every column lie within the checked lengths.
        unsafe {
            if wide {
                row_512(nb, x, y, act_stride, gemm_cols, &mut acc, &mut acc_min)
            } else {
                row_avx2(nb, x, y, act_stride, gemm_cols, &mut acc, &mut acc_min)
            }
        };
        for c in 0..n_cols {
            out[c * n_rows + i] = acc[c] - acc_min[c];
        }
    }
}

/// One row's accumulators against every column (`acc.len()` of them, `stride` bytes apart):
/// the gemm's two fmas per half for the first `gemm_cols`, the gemv's one per block after.
#[inline(always)]
unsafe fn row_into<H: HalfSums>(
    nb: usize,
    x: *const u8,
    y: *const u8,
    stride: usize,
    gemm_cols: usize,
    acc: &mut [f32],
    acc_min: &mut [f32],
) {
    let wide = gemm_cols - gemm_cols % 8;
    for b in 0..nb {
        let blk = H::decode(x.add(b * WB));
        let (bd, bdmin) = H::scales(&blk);
        // gemm columns eight at a time: their sums transposed so that lane j is column
        // c0 + j, then the same fmas in the lanes, each column's chain in order
        for c0 in (0..wide).step_by(8) {
            let mut t = [_mm_setzero_si128(); 8];
            let mut yd = [0f32; 8];
            for j in 0..8 {
                let yb = y.add((c0 + j) * stride + b * AB);
                t[j] = H::sums(&blk, yb);
                yd[j] = y_d(yb);
            }
            let [s0, s1, m0, m1] = transpose8(&t);
            let yd = _mm256_loadu_ps(yd.as_ptr());
            let (d, dmin) = (
                _mm256_mul_ps(_mm256_set1_ps(bd), yd),
                _mm256_mul_ps(_mm256_set1_ps(bdmin), yd),
            );
            let (pa, pm) = (acc.as_mut_ptr().add(c0), acc_min.as_mut_ptr().add(c0));
            let (mut a, mut m) = (_mm256_loadu_ps(pa), _mm256_loadu_ps(pm));
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), d, a);
            m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m0), dmin, m);
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), d, a);
            m = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m1), dmin, m);
            _mm256_storeu_ps(pa, a);
            _mm256_storeu_ps(pm, m);
        }
        for (c, (acc, acc_min)) in acc
            .iter_mut()
            .zip(acc_min.iter_mut())
            .enumerate()
            .skip(wide)
        {
            let yb = y.add(c * stride + b * AB);
            let [s0, s1, m0, m1] = lanes(H::sums(&blk, yb));
            let yd = y_d(yb);
            let (d, dmin) = (bd * yd, bdmin * yd);
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

/// Eight columns' `[S_0, S_1, M_0, M_1]` to four vectors whose lane j is column j's.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(t: &[__m128i; 8]) -> [__m256i; 4] {
    let four = |t: &[__m128i]| {
        let (u0, u1) = (
            _mm_unpacklo_epi32(t[0], t[1]),
            _mm_unpacklo_epi32(t[2], t[3]),
        );
        let (u2, u3) = (
            _mm_unpackhi_epi32(t[0], t[1]),
            _mm_unpackhi_epi32(t[2], t[3]),
        );
        [
            _mm_unpacklo_epi64(u0, u1),
            _mm_unpackhi_epi64(u0, u1),
            _mm_unpacklo_epi64(u2, u3),
            _mm_unpackhi_epi64(u2, u3),
        ]
    };
    let (lo, hi) = (four(&t[..4]), four(&t[4..]));
    [0, 1, 2, 3].map(|k| _mm256_set_m128i(hi[k], lo[k]))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_avx2(
    nb: usize,
    x: *const u8,
    y: *const u8,
    stride: usize,
    gemm_cols: usize,
    acc: &mut [f32],
    acc_min: &mut [f32],
) {
    row_into::<Narrow>(nb, x, y, stride, gemm_cols, acc, acc_min)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw")]
unsafe fn row_512(
    nb: usize,
    x: *const u8,
    y: *const u8,
    stride: usize,
    gemm_cols: usize,
    acc: &mut [f32],
    acc_min: &mut [f32],
) {
    row_into::<Wide>(nb, x, y, stride, gemm_cols, acc, acc_min)
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
        let cases = [
            (256, 1, 1),
            (768, 3, 5),
            (512, 13, 7),
            (4096, 9, 12),
            (512, 5, 21),
        ];
        for (n, n_rows, n_cols) in cases {
            let rows = q2_k_rows(n_rows, n, &mut next);
            let acts = q8_k_cols(n_cols, n, &mut next);
            let (rb, ab) = (rows.len() / n_rows, acts.len() / n_cols);
            let what = format!("Q2_K {n_rows} x {n} x {n_cols}");
            let mut got = vec![0f32; n_rows * n_cols];
            fast.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut got);
            let mut want = vec![0f32; n_rows * n_cols];
            reference.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut want);
            assert_eq!(bits(&got), bits(&want), "{what}");
            // both widths, batches and single dots (the gemv) alike
            for wide in [false, super::wide()] {
                got.fill(0.0);
                super::multi_with(wide, n, &rows, rb, n_rows, &acts, ab, n_cols, &mut got);
                assert_eq!(bits(&got), bits(&want), "{what}: wide {wide}");
                for (c, i) in (0..n_cols).flat_map(|c| (0..n_rows).map(move |i| (c, i))) {
                    let (row, col) = (&rows[i * rb..(i + 1) * rb], &acts[c * ab..(c + 1) * ab]);
                    let one = super::dot_with(wide, n, row, col).to_bits();
                    let want = reference.dot(n, row, col).to_bits();
                    assert_eq!(one, want, "{what}: wide {wide}, row {i}, column {c}");
                }
                let mut got_rows = vec![0f32; n_rows];
                super::rows_with(wide, n, &rows, rb, &acts[..ab], &mut got_rows);
                for (i, g) in got_rows.iter().enumerate() {
                    let want = reference.dot(n, &rows[i * rb..(i + 1) * rb], &acts[..ab]);
                    assert_eq!(
                        g.to_bits(),
                        want.to_bits(),
                        "{what}: wide {wide}, rows, row {i}"
                    );
                }
            }
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
