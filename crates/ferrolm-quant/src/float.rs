//! Unquantized element types: F32, F16 and BF16, stored little-endian.

use half::f16;

#[inline(always)]
pub(crate) fn bf16_to_f32(b: [u8; 2]) -> f32 {
    f32::from_bits((u16::from_le_bytes(b) as u32) << 16)
}

/// ggml's `ggml_compute_fp32_to_bf16`: NaN made quiet, otherwise round to nearest even.
#[inline(always)]
pub(crate) fn f32_to_bf16(x: f32) -> [u8; 2] {
    let u = x.to_bits();
    let h = if (u & 0x7fff_ffff) > 0x7f80_0000 {
        (u >> 16) | 64
    } else {
        (u + (0x7fff + ((u >> 16) & 1))) >> 16
    };
    (h as u16).to_le_bytes()
}

pub(crate) fn dequantize_f32(src: &[u8], dst: &mut [f32]) {
    for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
        *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    }
}

pub(crate) fn dequantize_f16(src: &[u8], dst: &mut [f32]) {
    for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *y = f16::from_le_bytes([b[0], b[1]]).to_f32();
    }
}

pub(crate) fn dequantize_bf16(src: &[u8], dst: &mut [f32]) {
    for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
        *y = bf16_to_f32([b[0], b[1]]);
    }
}

pub(crate) fn quantize_f32(src: &[f32], dst: &mut [u8]) {
    for (&x, b) in src.iter().zip(dst.chunks_exact_mut(4)) {
        b.copy_from_slice(&x.to_le_bytes());
    }
}

pub(crate) fn quantize_f16(src: &[f32], dst: &mut [u8]) {
    for (&x, b) in src.iter().zip(dst.chunks_exact_mut(2)) {
        b.copy_from_slice(&f16::from_f32(x).to_le_bytes());
    }
}

pub(crate) fn quantize_bf16(src: &[f32], dst: &mut [u8]) {
    for (&x, b) in src.iter().zip(dst.chunks_exact_mut(2)) {
        b.copy_from_slice(&f32_to_bf16(x));
    }
}

// Scalar dots with the float arithmetic of llama.cpp's AVX512 `ggml_vec_dot_f32/f16/bf16`
// (see `ggml_vec`).

pub(crate) fn dot_f32(n: usize, row: &[u8], act: &[u8]) -> f32 {
    crate::ggml_vec::dot_f32_bytes(n, row, act)
}

pub(crate) fn dot_f16(n: usize, row: &[u8], act: &[u8]) -> f32 {
    crate::ggml_vec::dot_f16_bytes(n, row, act)
}

pub(crate) fn dot_bf16(n: usize, row: &[u8], act: &[u8]) -> f32 {
    crate::ggml_vec::dot_bf16_bytes(n, row, act)
}

// ---------------------------------------------------------------------------------------------
// Batches: llamafile_sgemm's tinyBLAS (what llama.cpp's mul_mat runs for F32/F16/BF16 weights
// when the batch has >= 2 columns, k % KN == 0 and the row count % 4 == 0)

/// Which element type a float batch kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FloatKind {
    F32,
    F16,
    Bf16,
}

impl FloatKind {
    fn elem(self) -> usize {
        if self == FloatKind::F32 {
            4
        } else {
            2
        }
    }
    /// tinyBLAS's KN: the elements one accumulator step consumes (16 f32 lanes; 32 bf16 for
    /// `vdpbf16ps`).
    fn kn(self) -> usize {
        if self == FloatKind::Bf16 {
            32
        } else {
            16
        }
    }
    fn widen(self, b: &[u8], out: &mut [f32]) {
        match self {
            FloatKind::F32 => dequantize_f32(b, out),
            FloatKind::F16 => dequantize_f16(b, out),
            FloatKind::Bf16 => dequantize_bf16(b, out),
        }
    }
}

/// The float kind of a weight type, if it is a float type.
pub(crate) fn float_kind(ty: crate::TensorType) -> Option<FloatKind> {
    match ty {
        crate::TensorType::F32 => Some(FloatKind::F32),
        crate::TensorType::F16 => Some(FloatKind::F16),
        crate::TensorType::BF16 => Some(FloatKind::Bf16),
        _ => None,
    }
}

/// Whether llama.cpp's mul_mat hands this product to llamafile_sgemm's tinyBLAS (AVX512
/// build): at least 2 columns, `n` a multiple of KN and a row count that is a multiple of 4.
pub(crate) fn tinyblas_applies(kind: FloatKind, n: usize, n_rows: usize, n_cols: usize) -> bool {
    n_cols >= 2 && n.is_multiple_of(kind.kn()) && n_rows.is_multiple_of(4)
}

/// One output element of tinyBLAS<16, __m512>: a 16-lane accumulator fed by fused
/// multiply-adds (F32/F16: 16 elements a step; BF16: `vdpbf16ps`, 32 elements a step, lane `l`
/// taking element `2l + 1` then `2l`), then `_mm512_reduce_add_ps`.
#[inline(always)]
fn tinyblas_elem(kind: FloatKind, a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 16];
    if kind == FloatKind::Bf16 {
        for (a, b) in a.chunks_exact(32).zip(b.chunks_exact(32)) {
            for (l, acc) in acc.iter_mut().enumerate() {
                *acc = a[2 * l + 1].mul_add(b[2 * l + 1], *acc);
                *acc = a[2 * l].mul_add(b[2 * l], *acc);
            }
        }
    } else {
        for (a, b) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
            for l in 0..16 {
                acc[l] = a[l].mul_add(b[l], acc[l]);
            }
        }
    }
    crate::common::reduce16(&acc)
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn tinyblas_body(
    kind: FloatKind,
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    let rb = n * kind.elem();
    let mut cols = vec![0f32; n * n_cols];
    for (c, col) in cols.chunks_exact_mut(n).enumerate() {
        kind.widen(&acts[c * act_stride..c * act_stride + rb], col);
    }
    let mut row = vec![0f32; n];
    for i in 0..n_rows {
        kind.widen(&rows[i * row_stride..i * row_stride + rb], &mut row);
        for (c, col) in cols.chunks_exact(n).enumerate() {
            out[c * n_rows + i] = tinyblas_elem(kind, &row, col);
        }
    }
}

/// One row of `kind` widened to f32, F16 with F16C (exact, as `_mm512_cvtph_ps`);
/// `dst.len()` is a multiple of 8.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_f16c(kind: FloatKind, src: &[u8], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    if kind == FloatKind::F16 {
        for (k, d) in dst.chunks_exact_mut(8).enumerate() {
            let h = _mm_loadu_si128(src.as_ptr().add(16 * k) as *const __m128i);
            _mm256_storeu_ps(d.as_mut_ptr(), _mm256_cvtph_ps(h));
        }
    } else {
        kind.widen(src, dst);
    }
}

/// The `n_cols` activation columns of a batch widened once, `n` values each.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_columns(
    kind: FloatKind,
    n: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
) -> Vec<f32> {
    let rb = n * kind.elem();
    let mut cols = vec![0f32; n * n_cols];
    for (c, col) in cols.chunks_exact_mut(n).enumerate() {
        widen_f16c(kind, &acts[c * act_stride..c * act_stride + rb], col);
    }
    cols
}

/// [`tinyblas_body`] with AVX2+FMA: the 16-lane accumulator as two 8-lane halves, four
/// columns at a time for independent dependency chains.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tinyblas_fma(
    kind: FloatKind,
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    use std::arch::x86_64::*;
    let rb = n * kind.elem();
    let hsum8 = |v: __m256| {
        let s = _mm_add_ps(_mm256_extractf128_ps::<1>(v), _mm256_castps256_ps128(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    };
    if kind == FloatKind::Bf16 {
        // raw bf16: per 32-bit lane, the odd element is the high half, the even the low
        let hi = _mm256_set1_epi32(0xffff_0000u32 as i32);
        let odd = |v: __m256i| _mm256_castsi256_ps(_mm256_and_si256(v, hi));
        let even = |v: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<16>(v));
        for i in 0..n_rows {
            let a = rows[i * row_stride..i * row_stride + rb].as_ptr();
            for c in 0..n_cols {
                let b = acts[c * act_stride..c * act_stride + rb].as_ptr();
                let (mut lo, mut up) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                for k in (0..n).step_by(32) {
                    let ld = |p: *const u8, o: usize| {
                        _mm256_loadu_si256(p.add(2 * (k + o)) as *const __m256i)
                    };
                    let (a0, b0, a1, b1) = (ld(a, 0), ld(b, 0), ld(a, 16), ld(b, 16));
                    lo = _mm256_fmadd_ps(odd(a0), odd(b0), lo);
                    lo = _mm256_fmadd_ps(even(a0), even(b0), lo);
                    up = _mm256_fmadd_ps(odd(a1), odd(b1), up);
                    up = _mm256_fmadd_ps(even(a1), even(b1), up);
                }
                out[c * n_rows + i] = hsum8(_mm256_add_ps(up, lo));
            }
        }
        return;
    }
    let widen = |src: &[u8], dst: &mut [f32]| widen_f16c(kind, src, dst);
    let cols = widen_columns(kind, n, acts, act_stride, n_cols);
    let mut row = vec![0f32; n];
    for i in 0..n_rows {
        widen(&rows[i * row_stride..i * row_stride + rb], &mut row);
        let a = row.as_ptr();
        let mut c = 0;
        while c < n_cols {
            let g = (n_cols - c).min(4);
            let mut lo = [_mm256_setzero_ps(); 4];
            let mut up = [_mm256_setzero_ps(); 4];
            let bp: [*const f32; 4] =
                std::array::from_fn(|j| cols[(c + j.min(g - 1)) * n..].as_ptr());
            for k in (0..n).step_by(16) {
                let (a0, a1) = (_mm256_loadu_ps(a.add(k)), _mm256_loadu_ps(a.add(k + 8)));
                for j in 0..4 {
                    lo[j] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(bp[j].add(k)), lo[j]);
                    up[j] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(bp[j].add(k + 8)), up[j]);
                }
            }
            for j in 0..g {
                out[(c + j) * n_rows + i] = hsum8(_mm256_add_ps(up[j], lo[j]));
            }
            c += g;
        }
    }
}

/// [`tinyblas_fma`] for F32/F16 with AVX-512F: each output's 16-lane accumulator is one
/// 512-bit register, 4 rows x 4 columns at a time (each row and column load feeds four
/// products); the same fused multiply-adds per lane in the same order, and the same final
/// sum of the two 8-lane halves, so every output keeps its bits.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f")]
unsafe fn tinyblas_512(
    kind: FloatKind,
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    // rows and columns per tile
    const T: usize = 4;
    let rb = n * kind.elem();
    let widen = |src: &[u8], dst: &mut [f32]| widen_f16c(kind, src, dst);
    let cols = widen_columns(kind, n, acts, act_stride, n_cols);
    let mut tile_rows = vec![0f32; T * n];
    let mut i = 0;
    while i < n_rows {
        let h = (n_rows - i).min(T);
        for (r, row) in tile_rows.chunks_exact_mut(n).take(h).enumerate() {
            let at = (i + r) * row_stride;
            widen(&rows[at..at + rb], row);
        }
        // a short last tile repeats its last row or column and keeps only the real outputs
        let ap: [*const f32; T] = std::array::from_fn(|r| tile_rows[r.min(h - 1) * n..].as_ptr());
        let mut c = 0;
        while c < n_cols {
            let g = (n_cols - c).min(T);
            let bp: [*const f32; T] =
                std::array::from_fn(|j| cols[(c + j.min(g - 1)) * n..].as_ptr());
            let sums = tile_4x4(ap, bp, n);
            for r in 0..h {
                for j in 0..g {
                    out[(c + j) * n_rows + i + r] = sums[r][j];
                }
            }
            c += g;
        }
        i += h;
    }
}

/// The 4 x 4 dots of `tinyblas_512`: rows at `a`, columns at `b`, `n` floats each (a
/// multiple of 16): one 16-lane accumulator each, finished as `tinyblas_fma` finishes its two
/// 8-lane halves.
#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
#[target_feature(enable = "avx2,fma,avx512f")]
unsafe fn tile_4x4(a: [*const f32; 4], b: [*const f32; 4], n: usize) -> [[f32; 4]; 4] {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    let mut k = 0;
    while k < n {
        let bv = [
            _mm512_loadu_ps(b[0].add(k)),
            _mm512_loadu_ps(b[1].add(k)),
            _mm512_loadu_ps(b[2].add(k)),
            _mm512_loadu_ps(b[3].add(k)),
        ];
        for (row, acc) in a.iter().zip(acc.iter_mut()) {
            let av = _mm512_loadu_ps(row.add(k));
            for (acc, bv) in acc.iter_mut().zip(bv) {
                *acc = _mm512_fmadd_ps(av, bv, *acc);
            }
        }
        k += 16;
    }
    let mut sums = [[0f32; 4]; 4];
    for (sums, acc) in sums.iter_mut().zip(acc) {
        for (sum, v) in sums.iter_mut().zip(acc) {
            let lo = _mm512_castps512_ps256(v);
            let up = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            let h = _mm256_add_ps(up, lo);
            let s = _mm_add_ps(_mm256_extractf128_ps::<1>(h), _mm256_castps256_ps128(h));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            *sum = _mm_cvtss_f32(s);
        }
    }
    sums
}

/// The per-element arithmetic of llamafile_sgemm's tinyBLAS (lengths checked by the caller;
/// only when [`tinyblas_applies`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn tinyblas(
    kind: FloatKind,
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if kind != FloatKind::Bf16
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: avx512f, avx2, fma and f16c were detected just above.
        #[allow(unsafe_code)]
        unsafe {
            tinyblas_512(
                kind, n, rows, row_stride, n_rows, acts, act_stride, n_cols, out,
            )
        };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
    {
        // SAFETY: avx2, fma and f16c were detected just above.
        #[allow(unsafe_code)]
        unsafe {
            tinyblas_fma(
                kind, n, rows, row_stride, n_rows, acts, act_stride, n_cols, out,
            )
        };
        return;
    }
    tinyblas_body(
        kind, n, rows, row_stride, n_rows, acts, act_stride, n_cols, out,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batched float products this CPU runs (AVX-512 or AVX2 tiles) against the scalar
    /// definition of tinyBLAS's arithmetic, bit for bit: F32 and F16, several lengths, row
    /// counts of whole and repeated tiles, column counts with and without a remainder, strides
    /// longer than a row.
    #[test]
    fn tinyblas_tiles_match_the_scalar_definition() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 8.0
        };
        for kind in [FloatKind::F32, FloatKind::F16] {
            let bytes = |v: f32| -> Vec<u8> {
                if kind == FloatKind::F32 {
                    v.to_le_bytes().to_vec()
                } else {
                    half::f16::from_f32(v).to_le_bytes().to_vec()
                }
            };
            for (n, n_rows, n_cols) in [(16, 4, 2), (48, 8, 5), (256, 12, 9), (64, 4, 64)] {
                assert!(tinyblas_applies(kind, n, n_rows, n_cols));
                let (row_stride, act_stride) = ((n + 3) * kind.elem(), (n + 1) * kind.elem());
                let matrix = |count: usize, stride: usize, next: &mut dyn FnMut() -> f32| {
                    let mut m = vec![0u8; count * stride];
                    for r in 0..count {
                        for k in 0..n {
                            let at = r * stride + k * kind.elem();
                            m[at..at + kind.elem()].copy_from_slice(&bytes(next()));
                        }
                    }
                    m
                };
                let rows = matrix(n_rows, row_stride, &mut next);
                let acts = matrix(n_cols, act_stride, &mut next);
                let mut got = vec![0f32; n_rows * n_cols];
                let mut want = vec![0f32; n_rows * n_cols];
                tinyblas(
                    kind, n, &rows, row_stride, n_rows, &acts, act_stride, n_cols, &mut got,
                );
                tinyblas_body(
                    kind, n, &rows, row_stride, n_rows, &acts, act_stride, n_cols, &mut want,
                );
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(
                        g.to_bits(),
                        w.to_bits(),
                        "{kind:?} {n}x{n_rows}x{n_cols} at {i}"
                    );
                }
            }
        }
    }
}
