//! Non-linear 4-bit formats: IQ4_NL (a fixed 16-entry codebook times an f16 scale), its
//! super-block form IQ4_XS (6-bit scales per 32, dots against Q8_K), MXFP4 (OCP microscaling
//! FP4: e2m1 values times a power-of-two e8m0 scale) and NVFP4 (e2m1 values with an unsigned
//! E4M3 scale per 16). IQ4_NL, MXFP4 and NVFP4 pack like Q4_0 and dot against Q8_0.

use bytemuck::{Pod, Zeroable};

use crate::common::{e8m0_to_f32_half, f16_to_f32, fma8, lanes8, reduce8};
use crate::k_quants::{k_lanes, BlockQ8K, QK_K};
use crate::legacy::BlockQ8_0;
use crate::tiled::TiledBlock;

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

/// llama.cpp's AVX2 `ggml_vec_dot_iq4_nl_q8_0` / `ggml_vec_dot_mxfp4_q8_0`: blocks in pairs into
/// two 8-lane accumulators (fused multiply-add by the block scale), `hsum_float_8` of their
/// sum, then an odd last block in scalar code, `sumf += d * sumi` (not contracted by gcc here).
fn dot_lookup<X: Copy>(
    xs: &[X],
    ys: &[BlockQ8_0],
    table: &[i8; 16],
    qs: impl Fn(&X) -> &[u8; QK / 2],
    scale: impl Fn(&X, &BlockQ8_0) -> f32,
) -> f32 {
    let nb = xs.len().min(ys.len());
    let block = |ib: usize| {
        let q = lookup(qs(&xs[ib]), table);
        let mut w = [0i32; QK];
        for (w, &q) in w.iter_mut().zip(&q) {
            *w = q as i32;
        }
        (w, scale(&xs[ib], &ys[ib]))
    };
    let (mut acc1, mut acc2) = ([0f32; 8], [0f32; 8]);
    let mut ib = 0;
    while ib + 1 < nb {
        let (w, d) = block(ib);
        fma8(&mut acc1, d, &lanes8(&w, bytemuck::cast_ref(&ys[ib].qs)));
        let (w, d) = block(ib + 1);
        fma8(
            &mut acc2,
            d,
            &lanes8(&w, bytemuck::cast_ref(&ys[ib + 1].qs)),
        );
        ib += 2;
    }
    let mut sum = [0f32; 8];
    for l in 0..8 {
        sum[l] = acc1[l] + acc2[l];
    }
    let mut sumf = reduce8(&sum);
    if ib < nb {
        let (w, d) = block(ib);
        let y: &[i8; QK] = bytemuck::cast_ref(&ys[ib].qs);
        let sumi: i32 = w.iter().zip(y).map(|(&w, &y)| w * y as i32).sum();
        sumf += d * sumi as f32;
    }
    sumf
}

pub(crate) fn dot_iq4_nl_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockIq4Nl] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    dot_lookup(
        xs,
        ys,
        &KVALUES_IQ4NL,
        |x| &x.qs,
        |x, y| f16_to_f32(y.d) * f16_to_f32(x.d),
    )
}

pub(crate) fn dot_mxfp4_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockMxfp4] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    dot_lookup(
        xs,
        ys,
        &KVALUES_MXFP4,
        |x| &x.qs,
        |x, y| f16_to_f32(y.d) * e8m0_to_f32_half(x.e),
    )
}

/// The scalar last block of the AVX2 kernels when the block count is odd: `d * sumi`.
pub(crate) fn odd_block_iq4_nl(x: &[u8], y: &[u8]) -> f32 {
    let (x, y): (&BlockIq4Nl, &BlockQ8_0) = (bytemuck::from_bytes(x), bytemuck::from_bytes(y));
    let q = lookup(&x.qs, &KVALUES_IQ4NL);
    let yq: &[i8; QK] = bytemuck::cast_ref(&y.qs);
    let sumi: i32 = q.iter().zip(yq).map(|(&w, &y)| w as i32 * y as i32).sum();
    (f16_to_f32(y.d) * f16_to_f32(x.d)) * sumi as f32
}

/// As [`odd_block_iq4_nl`] for MXFP4.
pub(crate) fn odd_block_mxfp4(x: &[u8], y: &[u8]) -> f32 {
    let (x, y): (&BlockMxfp4, &BlockQ8_0) = (bytemuck::from_bytes(x), bytemuck::from_bytes(y));
    let q = lookup(&x.qs, &KVALUES_MXFP4);
    let yq: &[i8; QK] = bytemuck::cast_ref(&y.qs);
    let sumi: i32 = q.iter().zip(yq).map(|(&w, &y)| w as i32 * y as i32).sum();
    (f16_to_f32(y.d) * e8m0_to_f32_half(x.e)) * sumi as f32
}

/// IQ4_NL against several Q8_0 columns as llamafile_sgemm's `tinyBLAS_Q0_AVX` computes each
/// element: one 8-lane accumulator, a fused multiply-add by `d_x * d_y` per block, `hsum`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn multi_iq4_nl_q8_0(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    let nb = n / QK;
    let (rb, ab) = (
        nb * std::mem::size_of::<BlockIq4Nl>(),
        nb * std::mem::size_of::<BlockQ8_0>(),
    );
    for i in 0..n_rows {
        let xs: &[BlockIq4Nl] = bytemuck::cast_slice(&rows[i * row_stride..i * row_stride + rb]);
        for c in 0..n_cols {
            let ys: &[BlockQ8_0] = bytemuck::cast_slice(&acts[c * act_stride..c * act_stride + ab]);
            let mut acc = [0f32; 8];
            for (x, y) in xs.iter().zip(ys) {
                let q = lookup(&x.qs, &KVALUES_IQ4NL);
                let mut w = [0i32; QK];
                for (w, &q) in w.iter_mut().zip(&q) {
                    *w = q as i32;
                }
                let s = lanes8(&w, bytemuck::cast_ref(&y.qs));
                fma8(&mut acc, f16_to_f32(x.d) * f16_to_f32(y.d), &s);
            }
            out[c * n_rows + i] = reduce8(&acc);
        }
    }
}

/// IQ4_XS: IQ4_NL's codebook in 256-element super-blocks, with a 6-bit scale per 32 elements
/// (`x = d * (s - 32) * KVALUES_IQ4NL[q]`; low nibbles in `scales_l`, high bits in `scales_h`).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockIq4Xs {
    pub d: [u8; 2],
    pub scales_h: [u8; 2],
    pub scales_l: [u8; QK_K / 64],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockIq4Xs>() == 4 + QK_K / 64 + QK_K / 2);

/// IQ4_XS's signed scale `s - 32` of the 32 elements `ib`.
#[inline(always)]
fn iq4_xs_scale(b: &BlockIq4Xs, ib: usize) -> i32 {
    let h = u16::from_le_bytes(b.scales_h);
    let ls = (b.scales_l[ib / 2] >> (4 * (ib % 2)) & 0xf) as u16 | ((h >> (2 * ib) & 3) << 4);
    ls as i32 - 32
}

/// IQ4_XS's codebook values in element order (each 32 elements packed as IQ4_NL's).
fn iq4_xs_values(b: &BlockIq4Xs) -> [i8; QK_K] {
    let mut v = [0i8; QK_K];
    for ib in 0..QK_K / 32 {
        let qs: &[u8; QK / 2] = b.qs[16 * ib..16 * ib + 16].try_into().unwrap();
        v[32 * ib..32 * ib + 32].copy_from_slice(&lookup(qs, &KVALUES_IQ4NL));
    }
    v
}

pub(crate) fn dequantize_iq4_xs(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockIq4Xs] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, v) = (f16_to_f32(b.d), iq4_xs_values(b));
        for (k, y) in y.iter_mut().enumerate() {
            let dl = d * iq4_xs_scale(b, k / 32) as f32;
            *y = dl * v[k] as f32;
        }
    }
}

/// The tiled matmul's view of an IQ4_XS block: codebook values, signed scales, `d`.
pub(crate) fn tiled_iq4_xs(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockIq4Xs = bytemuck::from_bytes(b);
    *t = TiledBlock {
        d: f16_to_f32(b.d),
        w: iq4_xs_values(b),
        scale16: std::array::from_fn(|j| iq4_xs_scale(b, j / 2)),
        mins: None,
    }
}

/// llama.cpp's AVX2 `ggml_vec_dot_iq4_xs_q8_K`: integer lanes times the signed scales, `fma`
/// by `d_x * d_y`, `hsum`.
pub(crate) fn dot_iq4_xs_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockIq4Xs] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8K] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let lanes = k_lanes(&iq4_xs_values(x), y.q(), |g, _| iq4_xs_scale(x, g));
        fma8(&mut acc, f16_to_f32(x.d) * y.d(), &lanes);
    }
    reduce8(&acc)
}

/// Elements per NVFP4 block, and per scale.
const QK_NVFP4: usize = 64;
const QK_NVFP4_SUB: usize = 16;

/// NVFP4: four 16-element sub-blocks, each with an unsigned E4M3 scale; e2m1 codes packed as
/// MXFP4's within each sub-block (low nibbles first).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockNvfp4 {
    pub d: [u8; QK_NVFP4 / QK_NVFP4_SUB],
    pub qs: [u8; QK_NVFP4 / 2],
}
const _: () = assert!(std::mem::size_of::<BlockNvfp4>() == QK_NVFP4 / QK_NVFP4_SUB + QK_NVFP4 / 2);

/// ggml's `ggml_ue4m3_to_fp32`: unsigned E4M3 (bias 7, the sign bit ignored), halved to match
/// the doubled e2m1 values; 0 and 0x7F read as zero. Every value is exact in f32.
const fn ue4m3_half(x: u8) -> f32 {
    if x == 0 || x == 0x7f {
        return 0.0;
    }
    let (exp, man) = ((x >> 3 & 0xf) as i32, (x & 7) as f32);
    let raw = if exp == 0 {
        man * f32::from_bits(((127 - 9) as u32) << 23)
    } else {
        (1.0 + man / 8.0) * f32::from_bits(((127 + exp - 7) as u32) << 23)
    };
    raw * 0.5
}

/// [`ue4m3_half`] of every byte (the table ggml's CPU backend reads too).
static UE4M3_HALF: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = ue4m3_half(i as u8);
        i += 1;
    }
    t
};

/// An NVFP4 sub-block scale as f32 (halved), by table.
#[inline(always)]
pub(crate) fn ue4m3_to_f32_half(x: u8) -> f32 {
    UE4M3_HALF[x as usize]
}

/// NVFP4's doubled e2m1 values in element order.
fn nvfp4_values(b: &BlockNvfp4) -> [i8; QK_NVFP4] {
    let mut v = [0i8; QK_NVFP4];
    for s in 0..QK_NVFP4 / QK_NVFP4_SUB {
        for j in 0..QK_NVFP4_SUB / 2 {
            let q = b.qs[8 * s + j];
            v[16 * s + j] = KVALUES_MXFP4[(q & 0xf) as usize];
            v[16 * s + j + 8] = KVALUES_MXFP4[(q >> 4) as usize];
        }
    }
    v
}

pub(crate) fn dequantize_nvfp4(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockNvfp4] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_NVFP4)) {
        let v = nvfp4_values(b);
        for (k, y) in y.iter_mut().enumerate() {
            *y = v[k] as f32 * ue4m3_to_f32_half(b.d[k / QK_NVFP4_SUB]);
        }
    }
}

/// llama.cpp's AVX2 `ggml_vec_dot_nvfp4_q8_0`: per 32 elements (one Q8_0 block, two NVFP4
/// sub-blocks) integer lanes, `fma` by the sub-block's `scale * d_y` (lanes 0-3 the first
/// sub-block, 4-7 the second), `hsum`.
pub(crate) fn dot_nvfp4_q8_0(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockNvfp4] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8_0] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    for (x, ys) in xs.iter().zip(ys.chunks_exact(QK_NVFP4 / QK)) {
        let v = nvfp4_values(x);
        for (h, y) in ys.iter().enumerate() {
            let w: [i32; QK] = std::array::from_fn(|j| v[QK * h + j] as i32);
            let lanes = lanes8(&w, bytemuck::cast_ref(&y.qs));
            let dy = f16_to_f32(y.d);
            let (s0, s1) = (
                ue4m3_to_f32_half(x.d[2 * h]) * dy,
                ue4m3_to_f32_half(x.d[2 * h + 1]) * dy,
            );
            for (l, a) in acc.iter_mut().enumerate() {
                let s = if l < 4 { s0 } else { s1 };
                *a = s.mul_add(lanes[l], *a);
            }
        }
    }
    reduce8(&acc)
}
