//! Q1_0 and Q2_0, the 1-bit and 2-bit formats of models trained for them: Q1_0 stores 128
//! signs per f16 scale (`x = ±d`), Q2_0 64 two-bit codes (`x = (q - 1) * d`, q in 0..=3).
//! Both dot against Q8_0 activations, so one weight block spans several activation blocks.

use bytemuck::{Pod, Zeroable};

use crate::common::{f16_to_f32, fma8, lanes8, reduce8};
use crate::legacy::BlockQ8_0;

/// Elements per Q1_0 block.
const QK1_0: usize = 128;
/// Elements per Q2_0 block.
const QK2_0: usize = 64;
/// Elements per Q8_0 activation block.
const QK8: usize = 32;

/// Q1_0: bit `j` of the 16 bytes set means `+d`, clear `-d`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ1_0 {
    pub d: [u8; 2],
    pub qs: [u8; QK1_0 / 8],
}
const _: () = assert!(std::mem::size_of::<BlockQ1_0>() == 2 + QK1_0 / 8);

/// Q2_0: element `j` in bits `2 (j % 4)` of byte `j / 4`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ2_0 {
    pub d: [u8; 2],
    pub qs: [u8; QK2_0 / 4],
}
const _: () = assert!(std::mem::size_of::<BlockQ2_0>() == 2 + QK2_0 / 4);

#[inline(always)]
fn q1_sign(b: &BlockQ1_0, j: usize) -> bool {
    b.qs[j / 8] >> (j % 8) & 1 != 0
}

#[inline(always)]
fn q2_code(b: &BlockQ2_0, j: usize) -> i32 {
    (b.qs[j / 4] >> (2 * (j % 4)) & 3) as i32
}

pub(crate) fn dequantize_q1_0(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ1_0] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK1_0)) {
        let d = f16_to_f32(b.d);
        for (j, y) in y.iter_mut().enumerate() {
            *y = if q1_sign(b, j) { d } else { -d };
        }
    }
}

pub(crate) fn dequantize_q2_0(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ2_0] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK2_0)) {
        let d = f16_to_f32(b.d);
        for (j, y) in y.iter_mut().enumerate() {
            *y = (q2_code(b, j) - 1) as f32 * d;
        }
    }
}

/// llama.cpp's AVX2 `ggml_vec_dot_q1_0_q8_0`: per weight block, the four activation blocks'
/// sign-flipped lanes weighted by their scales (a multiply, then three fmas), then one fma by
/// the weight scale into the accumulator; `hsum` at the end.
pub(crate) fn dot_q1_0_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ1_0] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    for (x, ys) in xs.iter().zip(ys.chunks_exact(QK1_0 / QK8)) {
        let mut block = [0f32; 8];
        for (k, y) in ys.iter().enumerate() {
            let w: [i32; QK8] =
                std::array::from_fn(|j| if q1_sign(x, QK8 * k + j) { 1 } else { -1 });
            let lanes = lanes8(&w, bytemuck::cast_ref(&y.qs));
            let dy = f16_to_f32(y.d);
            if k == 0 {
                block = lanes.map(|s| dy * s);
            } else {
                fma8(&mut block, dy, &lanes);
            }
        }
        let d0 = f16_to_f32(x.d);
        for (a, &b) in acc.iter_mut().zip(&block) {
            *a = d0.mul_add(b, *a);
        }
    }
    reduce8(&acc)
}

/// llama.cpp's generic `ggml_vec_dot_q2_0_q8_0_generic` (there is no x86 kernel): an integer
/// sum per activation block, `sumi += d_y * sumi_block`, `sumf += d_x * sumi`, each a multiply
/// then an add (gcc does not contract these; the oracle goldens tell fused sums apart).
pub(crate) fn dot_q2_0_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ2_0] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    let mut sumf = 0f32;
    for (x, ys) in xs.iter().zip(ys.chunks_exact(QK2_0 / QK8)) {
        let mut sumi = 0f32;
        for (k, y) in ys.iter().enumerate() {
            let q: &[i8; QK8] = bytemuck::cast_ref(&y.qs);
            let s: i32 = (0..QK8)
                .map(|j| (q2_code(x, QK8 * k + j) - 1) * q[j] as i32)
                .sum();
            sumi += f16_to_f32(y.d) * s as f32;
        }
        sumf += f16_to_f32(x.d) * sumi;
    }
    sumf
}
