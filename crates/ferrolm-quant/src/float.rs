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
#[derive(Clone, Copy, PartialEq, Eq)]
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
    n_cols >= 2 && n % kind.kn() == 0 && n_rows % 4 == 0
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
fn tinyblas_body(
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

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code, clippy::too_many_arguments)]
#[target_feature(enable = "avx2,fma")]
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
    tinyblas_body(
        kind, n, rows, row_stride, n_rows, acts, act_stride, n_cols, out,
    )
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
    if crate::kernel::simd_enabled()
        && std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
    {
        // SAFETY: avx2 and fma were detected just above.
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
