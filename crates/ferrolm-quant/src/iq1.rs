//! The 1.5/1.75-bit lattice i-quants IQ1_S and IQ1_M: 8-element groups indexing a grid of
//! ternary vectors (-1, 0, 1), shifted by `±IQ1_DELTA` per group or per 32 elements, with odd
//! 3-bit sub-block multipliers `2s + 1`.
//!
//! Dot products against Q8_K follow llama.cpp's AVX2 kernels: the grid part in integer lanes
//! (see `k_quants::k_lanes`), the delta part as a second integer sum.

use bytemuck::{Pod, Zeroable};

use crate::common::{f16_to_f32, fma8, reduce8, u16_at};
use crate::iq_grids::IQ1S_GRID;
use crate::k_quants::{k_lanes, BlockQ8K, QK_K};
use crate::tiled::TiledBlock;

/// ggml's `IQ1S_DELTA` (and `IQ1M_DELTA`, the same value).
const IQ1_DELTA: f32 = 0.125;

/// IQ1_S: per 32 elements a u16 of four 3-bit index extensions, the 3-bit scale and the
/// delta's sign; 8-bit index bytes.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockIq1S {
    pub d: [u8; 2],
    pub qs: [u8; QK_K / 8],
    pub qh: [u8; QK_K / 16],
}
const _: () = assert!(std::mem::size_of::<BlockIq1S>() == 2 + QK_K / 8 + QK_K / 16);

/// IQ1_M: index bytes; per 8 elements a nibble of three index bits and the delta's sign;
/// 3-bit scales per 16 elements; the f16 super-block scale in the top nibbles of the four
/// u16 scale words.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockIq1M {
    pub qs: [u8; QK_K / 8],
    pub qh: [u8; QK_K / 16],
    pub scales: [u8; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIq1M>() == QK_K / 8 + QK_K / 16 + QK_K / 32);

/// Grid values in element order, the odd multiplier of each 16 elements and the delta sign
/// (+1 or -1) of each 8 elements.
struct Unpacked {
    v: [i8; QK_K],
    m: [i32; QK_K / 16],
    sign: [i32; QK_K / 8],
}

fn grid8(idx: usize) -> [i8; 8] {
    IQ1S_GRID[idx].to_le_bytes().map(|b| b as i8)
}

fn unpack_s(b: &BlockIq1S) -> Unpacked {
    let mut u = Unpacked {
        v: [0; QK_K],
        m: [0; QK_K / 16],
        sign: [0; QK_K / 8],
    };
    for ib in 0..QK_K / 32 {
        let qh = u16_at(&b.qh, 2 * ib) as usize;
        for l in 0..4 {
            let idx = b.qs[4 * ib + l] as usize | ((qh >> (3 * l) & 7) << 8);
            u.v[32 * ib + 8 * l..][..8].copy_from_slice(&grid8(idx));
            u.sign[4 * ib + l] = if qh & 0x8000 != 0 { -1 } else { 1 };
        }
        let m = 2 * (qh >> 12 & 7) as i32 + 1;
        u.m[2 * ib] = m;
        u.m[2 * ib + 1] = m;
    }
    u
}

/// IQ1_M's f16 super-block scale, gathered from the top nibbles of the scale words.
fn iq1m_d(b: &BlockIq1M) -> f32 {
    let sc: [u16; 4] = std::array::from_fn(|k| u16_at(&b.scales, 2 * k));
    let bits = (sc[0] >> 12) | (sc[1] >> 8 & 0x00f0) | (sc[2] >> 4 & 0x0f00) | (sc[3] & 0xf000);
    f16_to_f32(bits.to_le_bytes())
}

fn unpack_m(b: &BlockIq1M) -> Unpacked {
    let mut u = Unpacked {
        v: [0; QK_K],
        m: [0; QK_K / 16],
        sign: [0; QK_K / 8],
    };
    for g in 0..QK_K / 8 {
        // Each qh byte serves two groups: low nibble the first, high nibble the second.
        let nib = b.qh[g / 2] >> (4 * (g % 2)) & 0xf;
        let idx = b.qs[g] as usize | ((nib as usize & 7) << 8);
        u.v[8 * g..][..8].copy_from_slice(&grid8(idx));
        u.sign[g] = if nib & 8 != 0 { -1 } else { 1 };
    }
    for (j, m) in u.m.iter_mut().enumerate() {
        let word = u16_at(&b.scales, 2 * (j / 4));
        *m = 2 * (word >> (3 * (j % 4)) & 7) as i32 + 1;
    }
    u
}

/// `x = (d * m) * (v + delta)`, in ggml's order of operations.
fn dequantize_unpacked(d: f32, u: &Unpacked, y: &mut [f32]) {
    for (k, y) in y.iter_mut().enumerate() {
        let dl = d * u.m[k / 16] as f32;
        let delta = IQ1_DELTA * u.sign[k / 8] as f32;
        *y = dl * (u.v[k] as f32 + delta);
    }
}

pub(crate) fn dequantize_iq1_s(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockIq1S] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        dequantize_unpacked(f16_to_f32(b.d), &unpack_s(b), y);
    }
}

pub(crate) fn dequantize_iq1_m(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockIq1M] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        dequantize_unpacked(iq1m_d(b), &unpack_m(b), y);
    }
}

/// The delta part's lanes for IQ1_M (llama.cpp: `maddubs(1, sign(q8, delta))` then `madd` by
/// the scales): lane `l` sums `m * sign * q8` over elements `32g + 4l .. 32g + 4l + 4`.
fn delta_lanes(u: &Unpacked, y: &[i8; QK_K]) -> [f32; 8] {
    let mut s = [0i8; QK_K];
    for (k, s) in s.iter_mut().enumerate() {
        *s = u.sign[k / 8] as i8;
    }
    k_lanes(&s, y, |g, l| u.m[2 * g + l / 4])
}

/// The tiled matmul's view: values `8 v + sign` (the delta scaled by 8), `d / 8`.
fn tiled_view(t: &mut TiledBlock, d: f32, u: Unpacked) {
    *t = TiledBlock {
        d: d * 0.125,
        w: std::array::from_fn(|k| 8 * u.v[k] + u.sign[k / 8] as i8),
        scale16: u.m,
        mins: None,
    }
}

pub(crate) fn tiled_iq1_s(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockIq1S = bytemuck::from_bytes(b);
    tiled_view(t, f16_to_f32(b.d), unpack_s(b))
}

pub(crate) fn tiled_iq1_m(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockIq1M = bytemuck::from_bytes(b);
    tiled_view(t, iq1m_d(b), unpack_m(b))
}

/// llama.cpp's AVX2 `ggml_vec_dot_iq1_s_q8_K`: the grid part in lanes (`fma` by `d`), the
/// delta part as one integer per super-block from the Q8_K block sums, accumulated in a
/// scalar float (`accum1 += d * sumi1`, contracted to an fma by gcc), and
/// `hsum + 0.125 * accum1`.
pub(crate) fn dot_iq1_s_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockIq1S] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8K] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    let mut acc1 = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let u = unpack_s(x);
        let lanes = k_lanes(&u.v, y.q(), |g, _| u.m[2 * g]);
        let mut sumi1 = 0i32;
        for ib in 0..QK_K / 32 {
            let bsum = y.bsum(2 * ib) + y.bsum(2 * ib + 1);
            sumi1 += bsum * u.sign[4 * ib] * u.m[2 * ib];
        }
        let d = y.d() * f16_to_f32(x.d);
        fma8(&mut acc, d, &lanes);
        acc1 = d.mul_add(sumi1 as f32, acc1);
    }
    reduce8(&acc) + IQ1_DELTA * acc1
}

/// llama.cpp's AVX2 `ggml_vec_dot_iq1_m_q8_K`: grid and delta parts in two lane
/// accumulators, `hsum(grid) + 0.125 * hsum(delta)`.
pub(crate) fn dot_iq1_m_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockIq1M] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8K] = bytemuck::cast_slice(act);
    let (mut acc1, mut acc2) = ([0f32; 8], [0f32; 8]);
    for (x, y) in xs.iter().zip(ys) {
        let u = unpack_m(x);
        let lanes = k_lanes(&u.v, y.q(), |g, l| u.m[2 * g + l / 4]);
        let d = y.d() * iq1m_d(x);
        fma8(&mut acc1, d, &lanes);
        fma8(&mut acc2, d, &delta_lanes(&u, y.q()));
    }
    reduce8(&acc1) + IQ1_DELTA * reduce8(&acc2)
}
