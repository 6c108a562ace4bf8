//! The 2-bit lattice i-quants IQ2_XXS, IQ2_XS and IQ2_S: 256-element super-blocks of
//! 8-element groups, each group an index into a grid of magnitude vectors (bytes 8, 25, 43)
//! plus eight sign bits, with 4-bit sub-block scales `d * (0.5 + s) / 4`.
//!
//! Dot products run against Q8_K activations in llama.cpp's AVX2 lane order (see
//! `k_quants::k_lanes`): integer lanes per super-block, `fma` by `d_x * d_y`, `hsum`.

use bytemuck::{Pod, Zeroable};

use crate::common::{f16_to_f32, fma8, reduce8, u16_at, u32_at};
use crate::iq_grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID};
use crate::k_quants::{k_lanes, BlockQ8K, QK_K};
use crate::tiled::TiledBlock;

/// `KSIGNS[i]`: seven stored sign bits `i` completed with an eighth that makes the count of
/// negative signs even (the i-quants only store sign patterns of even parity).
pub(crate) const KSIGNS: [u8; 128] = {
    let mut t = [0u8; 128];
    let mut i = 0;
    while i < 128 {
        t[i] = i as u8 | (((i as u32).count_ones() as u8 & 1) << 7);
        i += 1;
    }
    t
};

/// The eight magnitudes of grid entry `word` with the signs of `signs` (bit j negates j).
#[inline(always)]
pub(crate) fn signed8(word: u64, signs: u8) -> [i8; 8] {
    let b = word.to_le_bytes();
    std::array::from_fn(|j| {
        let v = b[j] as i8;
        if signs >> j & 1 != 0 {
            -v
        } else {
            v
        }
    })
}

/// IQ2_XXS: per 32 elements, four grid bytes and a u32 of four 7-bit sign indices and a
/// 4-bit scale.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockIq2Xxs {
    pub d: [u8; 2],
    pub qs: [u8; QK_K / 4],
}
const _: () = assert!(std::mem::size_of::<BlockIq2Xxs>() == 2 + QK_K / 4);

/// IQ2_XS: per 8 elements a u16 of a 9-bit grid index and a 7-bit sign index; 4-bit scales
/// per 16 elements.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockIq2Xs {
    pub d: [u8; 2],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIq2Xs>() == 2 + QK_K / 4 + QK_K / 32);

/// IQ2_S: 10-bit grid indices (low bytes, then two high bits each in `qh`), explicit sign
/// bytes after the indices, 4-bit scales per 16 elements.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockIq2S {
    pub d: [u8; 2],
    pub qs: [u8; QK_K / 4],
    pub qh: [u8; QK_K / 32],
    pub scales: [u8; QK_K / 32],
}
const _: () = assert!(std::mem::size_of::<BlockIq2S>() == 2 + QK_K / 4 + QK_K / 16);

/// Signed grid values of a super-block in element order, and its per-16-element scales `s`
/// (the sub-block multiplier is `0.5 + s`).
struct Unpacked {
    v: [i8; QK_K],
    s: [u8; QK_K / 16],
}

fn unpack_xxs(b: &BlockIq2Xxs) -> Unpacked {
    let mut u = Unpacked {
        v: [0; QK_K],
        s: [0; QK_K / 16],
    };
    for ib in 0..QK_K / 32 {
        let (grid, aux) = (u32_at(&b.qs, 8 * ib), u32_at(&b.qs, 8 * ib + 4));
        for l in 0..4 {
            let g = IQ2XXS_GRID[(grid >> (8 * l) & 0xff) as usize];
            let signs = KSIGNS[(aux >> (7 * l) & 127) as usize];
            u.v[32 * ib + 8 * l..][..8].copy_from_slice(&signed8(g, signs));
        }
        u.s[2 * ib] = (aux >> 28) as u8;
        u.s[2 * ib + 1] = (aux >> 28) as u8;
    }
    u
}

fn unpack_xs(b: &BlockIq2Xs) -> Unpacked {
    let mut u = Unpacked {
        v: [0; QK_K],
        s: [0; QK_K / 16],
    };
    for g8 in 0..QK_K / 8 {
        let q = u16_at(&b.qs, 2 * g8);
        let signed = signed8(IQ2XS_GRID[(q & 511) as usize], KSIGNS[(q >> 9) as usize]);
        u.v[8 * g8..][..8].copy_from_slice(&signed);
    }
    for ib in 0..QK_K / 32 {
        u.s[2 * ib] = b.scales[ib] & 0xf;
        u.s[2 * ib + 1] = b.scales[ib] >> 4;
    }
    u
}

fn unpack_s(b: &BlockIq2S) -> Unpacked {
    let mut u = Unpacked {
        v: [0; QK_K],
        s: [0; QK_K / 16],
    };
    for ib in 0..QK_K / 32 {
        for l in 0..4 {
            let idx = b.qs[4 * ib + l] as usize | ((b.qh[ib] as usize) << (8 - 2 * l) & 0x300);
            let signs = b.qs[QK_K / 8 + 4 * ib + l];
            u.v[32 * ib + 8 * l..][..8].copy_from_slice(&signed8(IQ2S_GRID[idx], signs));
        }
        u.s[2 * ib] = b.scales[ib] & 0xf;
        u.s[2 * ib + 1] = b.scales[ib] >> 4;
    }
    u
}

/// `x = d * (0.5 + s) * 0.25 * v`, in ggml's order of operations.
fn dequantize_unpacked(d: f32, u: &Unpacked, y: &mut [f32]) {
    for (k, y) in y.iter_mut().enumerate() {
        let db = d * (0.5 + u.s[k / 16] as f32) * 0.25;
        *y = db * u.v[k] as f32;
    }
}

pub(crate) fn dequantize_iq2_xxs(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockIq2Xxs] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        dequantize_unpacked(f16_to_f32(b.d), &unpack_xxs(b), y);
    }
}

pub(crate) fn dequantize_iq2_xs(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockIq2Xs] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        dequantize_unpacked(f16_to_f32(b.d), &unpack_xs(b), y);
    }
}

pub(crate) fn dequantize_iq2_s(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockIq2S] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        dequantize_unpacked(f16_to_f32(b.d), &unpack_s(b), y);
    }
}

/// llama.cpp's AVX2 `ggml_vec_dot_iq2_*_q8_K`: integer lanes with the odd multipliers
/// `2s + 1` (16-bit `madd`), `fma` by `d_x * d_y` per super-block, `0.125 * hsum`.
fn dot_unpacked<X>(
    xs: &[X],
    ys: &[BlockQ8K],
    d: impl Fn(&X) -> f32,
    unpack: impl Fn(&X) -> Unpacked,
) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let u = unpack(x);
        let lanes = k_lanes(&u.v, y.q(), |g, l| 2 * u.s[2 * g + l / 4] as i32 + 1);
        fma8(&mut acc, d(x) * y.d(), &lanes);
    }
    0.125 * reduce8(&acc)
}

/// The tiled matmul's view (`tiled_unpack_src0`): `d / 8`, multipliers `2s + 1`.
fn tiled_view(t: &mut TiledBlock, d: [u8; 2], u: Unpacked) {
    *t = TiledBlock {
        d: f16_to_f32(d) * 0.125,
        w: u.v,
        scale16: u.s.map(|s| 2 * s as i32 + 1),
        mins: None,
    }
}

pub(crate) fn tiled_iq2_xxs(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockIq2Xxs = bytemuck::from_bytes(b);
    tiled_view(t, b.d, unpack_xxs(b))
}

pub(crate) fn tiled_iq2_xs(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockIq2Xs = bytemuck::from_bytes(b);
    tiled_view(t, b.d, unpack_xs(b))
}

pub(crate) fn tiled_iq2_s(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockIq2S = bytemuck::from_bytes(b);
    tiled_view(t, b.d, unpack_s(b))
}

pub(crate) fn dot_iq2_xxs_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_unpacked::<BlockIq2Xxs>(
        bytemuck::cast_slice(row),
        bytemuck::cast_slice(act),
        |x| f16_to_f32(x.d),
        unpack_xxs,
    )
}

pub(crate) fn dot_iq2_xs_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_unpacked::<BlockIq2Xs>(
        bytemuck::cast_slice(row),
        bytemuck::cast_slice(act),
        |x| f16_to_f32(x.d),
        unpack_xs,
    )
}

pub(crate) fn dot_iq2_s_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    dot_unpacked::<BlockIq2S>(
        bytemuck::cast_slice(row),
        bytemuck::cast_slice(act),
        |x| f16_to_f32(x.d),
        unpack_s,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sign_table_is_llama_cpps() {
        // tests/golden/ksigns_iq2xs.bin: gguf.quants' copy of ggml's ksigns_iq2xs.
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/ksigns_iq2xs.bin");
        let want = std::fs::read(path).expect("run scripts/quant_golden.py");
        assert_eq!(&KSIGNS[..], &want[..]);
    }

    #[test]
    fn grids_hold_the_lattice_magnitudes() {
        // The generated tables keep ggml's layout: IQ2 bytes are 8, 25 or 43.
        for &w in IQ2XXS_GRID.iter().chain(&IQ2XS_GRID).chain(&IQ2S_GRID) {
            assert!(
                w.to_le_bytes().iter().all(|b| [8, 25, 43].contains(b)),
                "{w:#x}"
            );
        }
        assert_eq!(IQ2XXS_GRID[1], 0x080808080808082b);
    }
}
