//! The 3-bit lattice i-quants IQ3_XXS and IQ3_S: 4-element groups indexing a grid of
//! magnitude vectors, eight sign bits per 8 elements, sub-block scales per 32 elements.
//! Dot products against Q8_K in llama.cpp's AVX2 lane order, as in `iq2`.

use bytemuck::{Pod, Zeroable};

use crate::common::{f16_to_f32, fma8, reduce8, u32_at};
use crate::iq2::KSIGNS;
use crate::iq_grids::{IQ3S_GRID, IQ3XXS_GRID};
use crate::k_quants::{k_lanes, BlockQ8K, QK_K};
use crate::tiled::TiledBlock;

/// IQ3_XXS: 8-bit grid indices, then per 32 elements a u32 of four 7-bit sign indices and a
/// 4-bit scale (`d * (0.5 + s) / 2`).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockIq3Xxs {
    pub d: [u8; 2],
    pub qs: [u8; 3 * QK_K / 8],
}
const _: () = assert!(std::mem::size_of::<BlockIq3Xxs>() == 2 + 3 * QK_K / 8);

/// IQ3_S: 9-bit grid indices (low bytes, ninth bits in `qh`), explicit sign bytes, 4-bit
/// scales per 32 elements (`d * (1 + 2s)`).
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockIq3S {
    pub d: [u8; 2],
    pub qs: [u8; QK_K / 4],
    pub qh: [u8; QK_K / 32],
    pub signs: [u8; QK_K / 8],
    pub scales: [u8; QK_K / 64],
}
const _: () = assert!(std::mem::size_of::<BlockIq3S>() == 2 + 13 * (QK_K / 32) + QK_K / 64);

/// Eight signed values from two 4-byte grid entries and a sign byte.
#[inline(always)]
fn signed_pair(g1: u32, g2: u32, signs: u8) -> [i8; 8] {
    let (a, b) = (g1.to_le_bytes(), g2.to_le_bytes());
    std::array::from_fn(|j| {
        let v = if j < 4 { a[j] } else { b[j - 4] } as i8;
        if signs >> j & 1 != 0 {
            -v
        } else {
            v
        }
    })
}

/// Signed values in element order and the 4-bit scale of each 32 elements.
struct Unpacked {
    v: [i8; QK_K],
    s: [u8; QK_K / 32],
}

fn unpack_xxs(b: &BlockIq3Xxs) -> Unpacked {
    let mut u = Unpacked {
        v: [0; QK_K],
        s: [0; QK_K / 32],
    };
    for ib in 0..QK_K / 32 {
        let aux = u32_at(&b.qs, QK_K / 4 + 4 * ib);
        for l in 0..4 {
            let q = &b.qs[8 * ib + 2 * l..];
            let signs = KSIGNS[(aux >> (7 * l) & 127) as usize];
            let v = signed_pair(
                IQ3XXS_GRID[q[0] as usize],
                IQ3XXS_GRID[q[1] as usize],
                signs,
            );
            u.v[32 * ib + 8 * l..][..8].copy_from_slice(&v);
        }
        u.s[ib] = (aux >> 28) as u8;
    }
    u
}

fn unpack_s(b: &BlockIq3S) -> Unpacked {
    let mut u = Unpacked {
        v: [0; QK_K],
        s: [0; QK_K / 32],
    };
    for ib in 0..QK_K / 32 {
        let qh = b.qh[ib] as usize;
        for l in 0..4 {
            let q = &b.qs[8 * ib + 2 * l..];
            let i1 = q[0] as usize | (qh << (8 - 2 * l) & 256);
            let i2 = q[1] as usize | (qh << (7 - 2 * l) & 256);
            let v = signed_pair(IQ3S_GRID[i1], IQ3S_GRID[i2], b.signs[4 * ib + l]);
            u.v[32 * ib + 8 * l..][..8].copy_from_slice(&v);
        }
        u.s[ib] = b.scales[ib / 2] >> (4 * (ib % 2)) & 0xf;
    }
    u
}

pub(crate) fn dequantize_iq3_xxs(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockIq3Xxs] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, u) = (f16_to_f32(b.d), unpack_xxs(b));
        for (k, y) in y.iter_mut().enumerate() {
            let db = d * (0.5 + u.s[k / 32] as f32) * 0.5;
            *y = db * u.v[k] as f32;
        }
    }
}

pub(crate) fn dequantize_iq3_s(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockIq3S] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let (d, u) = (f16_to_f32(b.d), unpack_s(b));
        for (k, y) in y.iter_mut().enumerate() {
            let db = d * (1 + 2 * u.s[k / 32] as i32) as f32;
            *y = db * u.v[k] as f32;
        }
    }
}

/// llama.cpp's AVX2 kernels: integer lanes times `2s + 1`, `fma` by `d_x * d_y`, then
/// `scale * hsum` (IQ3_XXS's scale is 0.25, IQ3_S's 1).
fn dot_unpacked<X>(
    xs: &[X],
    ys: &[BlockQ8K],
    d: impl Fn(&X) -> f32,
    unpack: impl Fn(&X) -> Unpacked,
) -> [f32; 8] {
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let u = unpack(x);
        let lanes = k_lanes(&u.v, y.q(), |g, _| 2 * u.s[g] as i32 + 1);
        fma8(&mut acc, d(x) * y.d(), &lanes);
    }
    acc
}

/// The tiled matmul's view: `d * row_factor`, multipliers `2s + 1` for each 32 elements.
fn tiled_view(t: &mut TiledBlock, d: f32, u: Unpacked) {
    *t = TiledBlock {
        d,
        w: u.v,
        scale16: std::array::from_fn(|j| 2 * u.s[j / 2] as i32 + 1),
        mins: None,
    }
}

pub(crate) fn tiled_iq3_xxs(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockIq3Xxs = bytemuck::from_bytes(b);
    tiled_view(t, f16_to_f32(b.d) * 0.25, unpack_xxs(b))
}

pub(crate) fn tiled_iq3_s(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockIq3S = bytemuck::from_bytes(b);
    tiled_view(t, f16_to_f32(b.d), unpack_s(b))
}

pub(crate) fn dot_iq3_xxs_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let acc = dot_unpacked::<BlockIq3Xxs>(
        bytemuck::cast_slice(row),
        bytemuck::cast_slice(act),
        |x| f16_to_f32(x.d),
        unpack_xxs,
    );
    0.25 * reduce8(&acc)
}

pub(crate) fn dot_iq3_s_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let acc = dot_unpacked::<BlockIq3S>(
        bytemuck::cast_slice(row),
        bytemuck::cast_slice(act),
        |x| f16_to_f32(x.d),
        unpack_s,
    );
    reduce8(&acc)
}
