//! The ternary formats of BitNet b1.58-style models, `x = (t - 1) * d` with t in 0..=2:
//! TQ1_0 packs five trits per byte (base 3, read back by multiplying with powers of 3 and
//! taking the top of `3 q` as ggml does) and four in each of its last bytes; TQ2_0 packs
//! four two-bit codes per byte. Both dot against Q8_K activations.

use bytemuck::{Pod, Zeroable};

use crate::common::{f16_to_f32, reduce8};
use crate::k_quants::{BlockQ8K, QK_K};

/// Bytes of TQ1_0's five-trit part.
const TQ1_QS: usize = (QK_K - 4 * QK_K / 64) / 5;

/// TQ1_0: 48 bytes of five trits, 4 bytes of four trits, the f16 scale last.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockTq1_0 {
    pub qs: [u8; TQ1_QS],
    pub qh: [u8; QK_K / 64],
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockTq1_0>() == 2 + QK_K / 64 + TQ1_QS);

/// TQ2_0: element `32 l + m` of each 128 in bits `2 l` of byte `m` of its 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockTq2_0 {
    pub qs: [u8; QK_K / 4],
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockTq2_0>() == 2 + QK_K / 4);

const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// The `n`-th trit of a base-3 byte as ggml stores them (`q * 3^n` wrapping, top of `3 q`).
#[inline(always)]
fn trit(byte: u8, n: usize) -> u8 {
    ((byte.wrapping_mul(POW3[n]) as u16 * 3) >> 8) as u8
}

/// TQ1_0's codes (0..=2) in element order.
fn tq1_codes(b: &BlockTq1_0) -> [u8; QK_K] {
    let mut t = [0u8; QK_K];
    for (e, t) in t.iter_mut().enumerate() {
        *t = match e {
            0..160 => trit(b.qs[e % 32], e / 32),
            160..240 => trit(b.qs[32 + (e - 160) % 16], (e - 160) / 16),
            _ => trit(b.qh[(e - 240) % 4], (e - 240) / 4),
        };
    }
    t
}

/// TQ2_0's codes (0..=3; the quantizer never writes 3, which reads as `2 d`) in element order.
fn tq2_codes(b: &BlockTq2_0) -> [u8; QK_K] {
    std::array::from_fn(|e| {
        let (half, l, m) = (e / 128, e % 128 / 32, e % 32);
        b.qs[32 * half + m] >> (2 * l) & 3
    })
}

fn dequantize_codes(d: f32, t: &[u8; QK_K], y: &mut [f32]) {
    for (y, &t) in y.iter_mut().zip(t) {
        *y = (t as i32 - 1) as f32 * d;
    }
}

pub(crate) fn dequantize_tq1_0(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockTq1_0] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        dequantize_codes(f16_to_f32(b.d), &tq1_codes(b), y);
    }
}

pub(crate) fn dequantize_tq2_0(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockTq2_0] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        dequantize_codes(f16_to_f32(b.d), &tq2_codes(b), y);
    }
}

/// llama.cpp's AVX2 `ggml_vec_dot_tq{1,2}_0_q8_K`: the unsigned codes times the activations in
/// 16-bit lanes, minus the activation's block sums (which turns `t` into `t - 1`), lane `l`
/// holding elements `32g + 4l .. 32g + 4l + 4` and the sums of groups `2l`, `2l + 1`; then
/// `lanes * (d_y * d_x) + acc` (contracted to an fma by gcc) and `hsum`.
fn dot_codes<X>(
    xs: &[X],
    ys: &[BlockQ8K],
    d: impl Fn(&X) -> f32,
    codes: impl Fn(&X) -> [u8; QK_K],
) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let t = codes(x);
        let q = y.q();
        let dxy = y.d() * d(x);
        for (l, a) in acc.iter_mut().enumerate() {
            let mut s = -(y.bsum(2 * l) + y.bsum(2 * l + 1));
            for g in 0..QK_K / 32 {
                for k in 32 * g + 4 * l..32 * g + 4 * l + 4 {
                    s += t[k] as i32 * q[k] as i32;
                }
            }
            *a = (s as f32).mul_add(dxy, *a);
        }
    }
    reduce8(&acc)
}

pub(crate) fn dot_tq1_0_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_codes::<BlockTq1_0>(
        bytemuck::cast_slice(row),
        bytemuck::cast_slice(act),
        |x| f16_to_f32(x.d),
        tq1_codes,
    )
}

pub(crate) fn dot_tq2_0_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_codes::<BlockTq2_0>(
        bytemuck::cast_slice(row),
        bytemuck::cast_slice(act),
        |x| f16_to_f32(x.d),
        tq2_codes,
    )
}
