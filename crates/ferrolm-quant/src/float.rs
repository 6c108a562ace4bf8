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
