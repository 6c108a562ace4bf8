//! The 32-element "legacy" formats: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the Q8_1 activation format.
//!
//! Every block holds an f16 scale `d` (plus an f16 minimum `m` for the `_1` kinds); quants are
//! packed so that byte `j` carries element `j` in its low nibble and element `j + 16` in its high
//! nibble. Q5 keeps the fifth bit of element `j` in bit `j` of the little-endian u32 `qh`.

use bytemuck::{Pod, Zeroable};

use crate::common::{f16_to_f32, f32_to_f16, roundf};

/// Elements per block of every legacy format.
pub(crate) const QK: usize = 32;

/// Q4_0: `x = d * (q - 8)`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ4_0 {
    pub d: [u8; 2],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 2 + QK / 2);

/// Q4_1: `x = d * q + m`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ4_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 4 + QK / 2);

/// Q5_0: `x = d * (q - 16)` with q five bits.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ5_0 {
    pub d: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_0>() == 2 + 4 + QK / 2);

/// Q5_1: `x = d * q + m` with q five bits.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ5_1 {
    pub d: [u8; 2],
    pub m: [u8; 2],
    pub qh: [u8; 4],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5_1>() == 4 + 4 + QK / 2);

/// Q8_0: `x = d * q` with q a signed byte.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ8_0 {
    pub d: [u8; 2],
    pub qs: [u8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 2 + QK);

/// Q8_1 (activations only): Q8_0 plus `s = d * sum(q)` as f16.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ8_1 {
    pub d: [u8; 2],
    pub s: [u8; 2],
    pub qs: [u8; QK],
}
const _: () = assert!(std::mem::size_of::<BlockQ8_1>() == 4 + QK);

#[inline(always)]
fn as_i8(b: &[u8; QK]) -> &[i8; QK] {
    bytemuck::cast_ref(b)
}

// ---------------------------------------------------------------------------------------------
// Dequantize

pub(crate) fn dequantize_q4_0(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ4_0] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        for j in 0..QK / 2 {
            y[j] = ((b.qs[j] & 0x0f) as i32 - 8) as f32 * d;
            y[j + QK / 2] = ((b.qs[j] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

pub(crate) fn dequantize_q4_1(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ4_1] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        let m = f16_to_f32(b.m);
        for j in 0..QK / 2 {
            y[j] = (b.qs[j] & 0x0f) as f32 * d + m;
            y[j + QK / 2] = (b.qs[j] >> 4) as f32 * d + m;
        }
    }
}

#[inline(always)]
fn q5_values(qh: [u8; 4], qs: &[u8; QK / 2]) -> [u8; QK] {
    let qh = u32::from_le_bytes(qh);
    let mut q = [0u8; QK];
    for j in 0..QK / 2 {
        let h0 = (((qh >> j) << 4) & 0x10) as u8;
        let h1 = ((qh >> (j + 12)) & 0x10) as u8;
        q[j] = (qs[j] & 0x0f) | h0;
        q[j + QK / 2] = (qs[j] >> 4) | h1;
    }
    q
}

pub(crate) fn dequantize_q5_0(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ5_0] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        let q = q5_values(b.qh, &b.qs);
        for j in 0..QK {
            y[j] = (q[j] as i32 - 16) as f32 * d;
        }
    }
}

pub(crate) fn dequantize_q5_1(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ5_1] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        let m = f16_to_f32(b.m);
        let q = q5_values(b.qh, &b.qs);
        for j in 0..QK {
            y[j] = q[j] as f32 * d + m;
        }
    }
}

pub(crate) fn dequantize_q8_0(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ8_0] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        for (y, &q) in y.iter_mut().zip(as_i8(&b.qs)) {
            *y = q as f32 * d;
        }
    }
}

pub(crate) fn dequantize_q8_1(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ8_1] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        for (y, &q) in y.iter_mut().zip(as_i8(&b.qs)) {
            *y = q as f32 * d;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Quantize (ggml's `quantize_row_*_ref`)

/// Signed absolute maximum: the value with the largest magnitude, first one on ties.
#[inline(always)]
fn signed_absmax(x: &[f32]) -> f32 {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

#[inline(always)]
fn min_max(x: &[f32]) -> (f32, f32) {
    let mut min = f32::MAX;
    let mut max = -f32::MAX;
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

/// C's `(int8_t)(float)` for values the callers keep inside [0, 128): truncation toward zero.
#[inline(always)]
fn trunc_u8(x: f32) -> u8 {
    x as i32 as u8
}

pub(crate) fn quantize_q4_0(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ4_0] = bytemuck::cast_slice_mut(dst);
    for (x, b) in src.chunks_exact(QK).zip(blocks) {
        let d = signed_absmax(x) / -8.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f32_to_f16(d);
        for j in 0..QK / 2 {
            let q0 = trunc_u8(x[j] * id + 8.5).min(15);
            let q1 = trunc_u8(x[j + QK / 2] * id + 8.5).min(15);
            b.qs[j] = q0 | (q1 << 4);
        }
    }
}

pub(crate) fn quantize_q4_1(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ4_1] = bytemuck::cast_slice_mut(dst);
    for (x, b) in src.chunks_exact(QK).zip(blocks) {
        let (min, max) = min_max(x);
        let d = (max - min) / 15.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f32_to_f16(d);
        b.m = f32_to_f16(min);
        for j in 0..QK / 2 {
            let q0 = trunc_u8((x[j] - min) * id + 0.5).min(15);
            let q1 = trunc_u8((x[j + QK / 2] - min) * id + 0.5).min(15);
            b.qs[j] = q0 | (q1 << 4);
        }
    }
}

#[inline(always)]
fn pack_q5(q: &[u8; QK], qs: &mut [u8; QK / 2]) -> [u8; 4] {
    let mut qh = 0u32;
    for j in 0..QK / 2 {
        qs[j] = (q[j] & 0x0f) | ((q[j + QK / 2] & 0x0f) << 4);
        qh |= ((q[j] as u32 & 0x10) >> 4) << j;
        qh |= ((q[j + QK / 2] as u32 & 0x10) >> 4) << (j + QK / 2);
    }
    qh.to_le_bytes()
}

pub(crate) fn quantize_q5_0(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ5_0] = bytemuck::cast_slice_mut(dst);
    for (x, b) in src.chunks_exact(QK).zip(blocks) {
        let d = signed_absmax(x) / -16.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f32_to_f16(d);
        let mut q = [0u8; QK];
        for (q, &v) in q.iter_mut().zip(x) {
            *q = trunc_u8(v * id + 16.5).min(31);
        }
        b.qh = pack_q5(&q, &mut b.qs);
    }
}

pub(crate) fn quantize_q5_1(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ5_1] = bytemuck::cast_slice_mut(dst);
    for (x, b) in src.chunks_exact(QK).zip(blocks) {
        let (min, max) = min_max(x);
        let d = (max - min) / 31.0;
        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
        b.d = f32_to_f16(d);
        b.m = f32_to_f16(min);
        let mut q = [0u8; QK];
        for (q, &v) in q.iter_mut().zip(x) {
            *q = trunc_u8((v - min) * id + 0.5).min(31);
        }
        b.qh = pack_q5(&q, &mut b.qs);
    }
}

/// How an activation quantizer turns `x * id` into an integer and computes `id`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Rounding {
    /// `quantize_row_q8_*_ref`: `id = 1 / d`, `roundf` (half away from zero).
    Reference,
    /// llama.cpp's AVX path: `id = 127 / amax`, round half to even.
    X86,
    /// llama.cpp's NEON path: `id = 1 / d`, round half to even.
    Arm,
}

#[inline(always)]
fn q8_block(x: &[f32], qs: &mut [u8; QK], rounding: Rounding) -> (f32, i32) {
    // The largest magnitude (NaNs never win) in eight independent lanes, which vectorizes,
    // then across them: the same value as one pass in order.
    let mut lanes = [0.0f32; 8];
    for chunk in x.chunks_exact(8) {
        for (m, &v) in lanes.iter_mut().zip(chunk) {
            if v.abs() > *m {
                *m = v.abs();
            }
        }
    }
    let amax = lanes.iter().fold(0.0f32, |a, &m| if m > a { m } else { a });
    let d = amax / 127.0;
    let id = match rounding {
        Rounding::X86 => {
            if amax != 0.0 {
                127.0 / amax
            } else {
                0.0
            }
        }
        Rounding::Reference | Rounding::Arm => {
            if d != 0.0 {
                1.0 / d
            } else {
                0.0
            }
        }
    };
    let mut sum = 0i32;
    for (q, &v) in qs.iter_mut().zip(x) {
        let r = match rounding {
            Rounding::Reference => roundf(v * id),
            Rounding::X86 | Rounding::Arm => round_half_even(v * id),
        };
        let r = r as i32;
        sum += r;
        *q = r as i8 as u8;
    }
    (d, sum)
}

/// Rounds to the nearest integer, ties to even, for |x| <= 2^22 (a quantized value is at most
/// 127.5): adding and removing 1.5 * 2^23 leaves the rounding to the FPU's default mode. The
/// same result as `round_ties_even`, which without SSE4.1 in the target is a libm call per
/// element (8% of a prompt's time).
#[inline]
fn round_half_even(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    (x + MAGIC) - MAGIC
}

#[inline(always)] // into `avx2::quantize_activation`, to be compiled for AVX2 there
pub(crate) fn quantize_q8_0_with(src: &[f32], dst: &mut [u8], rounding: Rounding) {
    let blocks: &mut [BlockQ8_0] = bytemuck::cast_slice_mut(dst);
    for (x, b) in src.chunks_exact(QK).zip(blocks) {
        let (d, _) = q8_block(x, &mut b.qs, rounding);
        b.d = f32_to_f16(d);
    }
}

pub(crate) fn quantize_q8_1_with(src: &[f32], dst: &mut [u8], rounding: Rounding) {
    let blocks: &mut [BlockQ8_1] = bytemuck::cast_slice_mut(dst);
    for (x, b) in src.chunks_exact(QK).zip(blocks) {
        let (d, sum) = q8_block(x, &mut b.qs, rounding);
        b.d = f32_to_f16(d);
        b.s = f32_to_f16(sum as f32 * d);
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar dot products, with the float arithmetic of llama.cpp's AVX2 kernels
// (arch/x86/quants.c): per block, eight f32 lanes of 4-product integer sums are accumulated
// with a fused multiply-add by the block scale; at the end `hsum_float_8` (plus, for the `_1`
// kinds, the scalar sum of `m * s` accumulated without fusion).

use crate::common::{fma8, lanes8, reduce8};

#[inline(always)]
fn widen<const OFF: i32>(q: &[u8; QK]) -> [i32; QK] {
    let mut w = [0i32; QK];
    for (w, &q) in w.iter_mut().zip(q) {
        *w = q as i32 - OFF;
    }
    w
}

#[inline(always)]
fn nibbles(qs: &[u8; QK / 2]) -> [u8; QK] {
    let mut q = [0u8; QK];
    for j in 0..QK / 2 {
        q[j] = qs[j] & 0x0f;
        q[j + QK / 2] = qs[j] >> 4;
    }
    q
}

pub(crate) fn dot_q4_0_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ4_0] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let s = lanes8(&widen::<8>(&nibbles(&x.qs)), as_i8(&y.qs));
        fma8(&mut acc, f16_to_f32(x.d) * f16_to_f32(y.d), &s);
    }
    reduce8(&acc)
}

pub(crate) fn dot_q4_1_q8_1(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ4_1] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_1] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        summs += f16_to_f32(x.m) * f16_to_f32(y.s);
        let s = lanes8(&widen::<0>(&nibbles(&x.qs)), as_i8(&y.qs));
        fma8(&mut acc, f16_to_f32(x.d) * f16_to_f32(y.d), &s);
    }
    reduce8(&acc) + summs
}

pub(crate) fn dot_q5_0_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ5_0] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let s = lanes8(&widen::<16>(&q5_values(x.qh, &x.qs)), as_i8(&y.qs));
        fma8(&mut acc, f16_to_f32(x.d) * f16_to_f32(y.d), &s);
    }
    reduce8(&acc)
}

pub(crate) fn dot_q5_1_q8_1(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ5_1] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_1] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        summs += f16_to_f32(x.m) * f16_to_f32(y.s);
        let s = lanes8(&widen::<0>(&q5_values(x.qh, &x.qs)), as_i8(&y.qs));
        fma8(&mut acc, f16_to_f32(x.d) * f16_to_f32(y.d), &s);
    }
    reduce8(&acc) + summs
}

pub(crate) fn dot_q8_0_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ8_0] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let mut w = [0i32; QK];
        for (w, &q) in w.iter_mut().zip(as_i8(&x.qs)) {
            *w = q as i32;
        }
        let s = lanes8(&w, as_i8(&y.qs));
        fma8(&mut acc, f16_to_f32(x.d) * f16_to_f32(y.d), &s);
    }
    reduce8(&acc)
}

#[cfg(test)]
mod rounding_tests {
    use super::round_half_even;

    #[test]
    fn the_magic_rounding_equals_round_ties_even() {
        let mut x = -130.0f32;
        while x <= 130.0 {
            for v in [
                x,
                x + 0.5,
                x - 0.5,
                f32::from_bits((x + 0.5).to_bits() + 1),
                x + 1e-3,
            ] {
                // Compared as the integers the quantizers keep (-0.0 and 0.0 are both 0).
                assert_eq!(round_half_even(v) as i32, v.round_ties_even() as i32, "{v}");
            }
            x += 0.25;
        }
    }
}
