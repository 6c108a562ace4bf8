//! Non-linear 4-bit formats: IQ4_NL (a fixed 16-entry codebook times an f16 scale) and MXFP4
//! (OCP microscaling FP4: e2m1 values times a power-of-two e8m0 scale). Both pack like Q4_0
//! and dot against Q8_0 activations.

use bytemuck::{Pod, Zeroable};

use crate::common::{dot_i8, e8m0_to_f32_half, f16_to_f32};
use crate::legacy::BlockQ8_0;

/// Elements per block of both formats.
pub(crate) const QK: usize = 32;

/// IQ4_NL's codebook.
pub(crate) const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

/// The e2m1 values, doubled so that they are integers (the e8m0 scale is halved to match).
pub(crate) const KVALUES_MXFP4: [i8; 16] =
    [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// IQ4_NL: `x = d * KVALUES_IQ4NL[q]`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockIq4Nl {
    pub d: [u8; 2],
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIq4Nl>() == 2 + QK / 2);

/// MXFP4: `x = 2^(e - 128) * KVALUES_MXFP4[q]`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockMxfp4 {
    pub e: u8,
    pub qs: [u8; QK / 2],
}
const _: () = assert!(std::mem::size_of::<BlockMxfp4>() == 1 + QK / 2);

#[inline(always)]
fn lookup(qs: &[u8; QK / 2], table: &[i8; 16]) -> [i8; QK] {
    let mut q = [0i8; QK];
    for j in 0..QK / 2 {
        q[j] = table[(qs[j] & 0x0f) as usize];
        q[j + QK / 2] = table[(qs[j] >> 4) as usize];
    }
    q
}

pub(crate) fn dequantize_iq4_nl(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockIq4Nl] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = f16_to_f32(b.d);
        for (y, q) in y.iter_mut().zip(lookup(&b.qs, &KVALUES_IQ4NL)) {
            *y = d * q as f32;
        }
    }
}

pub(crate) fn dequantize_mxfp4(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockMxfp4] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK)) {
        let d = e8m0_to_f32_half(b.e);
        for (y, q) in y.iter_mut().zip(lookup(&b.qs, &KVALUES_MXFP4)) {
            *y = d * q as f32;
        }
    }
}

fn best_index_mxfp4(x: f32, e: f32) -> u8 {
    let mut best = 0u8;
    let mut best_err = (KVALUES_MXFP4[0] as f32 * e - x).abs();
    for (i, &k) in KVALUES_MXFP4.iter().enumerate().skip(1) {
        let err = (k as f32 * e - x).abs();
        if err < best_err {
            best = i as u8;
            best_err = err;
        }
    }
    best
}

/// ggml's `quantize_row_mxfp4_ref`.
pub(crate) fn quantize_mxfp4(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockMxfp4] = bytemuck::cast_slice_mut(dst);
    for (x, b) in src.chunks_exact(QK).zip(blocks) {
        let amax = x
            .iter()
            .fold(0.0f32, |a, &v| if a < v.abs() { v.abs() } else { a });
        let e = if amax > 0.0 {
            (amax.log2().floor() - 2.0 + 127.0) as u8
        } else {
            0
        };
        let d = e8m0_to_f32_half(e);
        b.e = e;
        for j in 0..QK / 2 {
            b.qs[j] = best_index_mxfp4(x[j], d) | (best_index_mxfp4(x[j + QK / 2], d) << 4);
        }
    }
}

pub(crate) fn dot_iq4_nl_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockIq4Nl] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let sumi = dot_i8(
            &lookup(&x.qs, &KVALUES_IQ4NL),
            bytemuck::cast_ref::<_, [i8; QK]>(&y.qs),
        );
        sumf += (f16_to_f32(x.d) * f16_to_f32(y.d)) * sumi as f32;
    }
    sumf
}

pub(crate) fn dot_mxfp4_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockMxfp4] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    let mut sumf = 0.0f32;
    for (x, y) in xs.iter().zip(ys) {
        let sumi = dot_i8(
            &lookup(&x.qs, &KVALUES_MXFP4),
            bytemuck::cast_ref::<_, [i8; QK]>(&y.qs),
        );
        sumf += (e8m0_to_f32_half(x.e) * f16_to_f32(y.d)) * sumi as f32;
    }
    sumf
}
