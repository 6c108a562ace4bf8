//! AVX2 kernels of the lattice i-quants and IQ4_XS against Q8_K, the same integer lanes as
//! llama.cpp's AVX2 `ggml_vec_dot_iq*_q8_K` (and the scalar references in `iq2`, `iq3`, `iq`):
//! grid entries gathered into a register with `set_epi64x`/`set_epi32`, signs applied to the
//! activations with `sign_epi8`, `maddubs` then `madd` by the sub-block multipliers, one fma
//! by `d_x * d_y` per super-block, and the format's constant times `hsum` at the end.

use super::*;
use crate::iq2::KSIGNS;
use crate::iq_grids::{IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};

/// `SIGN_BYTES[b]`: byte `j` is -1 where bit `j` of `b` is set, +1 where clear (what
/// `sign_epi8` multiplies the activations by).
static SIGN_BYTES: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut b = 0;
    while b < 256 {
        let mut j = 0;
        while j < 8 {
            let byte: u64 = if b >> j & 1 != 0 { 0xff } else { 0x01 };
            t[b] |= byte << (8 * j);
            j += 1;
        }
        b += 1;
    }
    t
};

/// The signs of a 7-bit sign index (llama.cpp's `keven_signs_q2xs`).
#[inline(always)]
fn even_signs(i: u32) -> i64 {
    SIGN_BYTES[KSIGNS[(i & 127) as usize] as usize] as i64
}

/// The u32 at `p`.
#[inline(always)]
unsafe fn u32_at(p: *const u8) -> u32 {
    (p as *const u32).read_unaligned()
}

/// `maddubs(q, sign(y, s))` then `madd` by `m`: the 8 i32 lanes of 32 elements.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn signed_lanes(q: __m256i, signs: __m256i, y: *const u8, m: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_sign_epi8(load(y), signs)), m)
}

/// The super-block's scale `d_x * d_y`, with an f16 `d` at byte 0.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn d_xy(x: *const u8, y: *const u8) -> f32 {
    f16_at(x) * y_d(y)
}

/// `factor * hsum(v)`: the end of every kernel here (`s` and `m` stay unused).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn scaled_hsum(acc: &Acc, factor: f32) -> f32 {
    factor * hsum_f32(acc.v)
}

/// A lattice kernel: `$lanes` are the super-block's i32 lanes, `$factor` the format's constant.
macro_rules! lattice_block {
    ($name:ident, $wb:expr, $factor:expr, |$x:ident, $y:ident| $lanes:expr) => {
        bytes_block!(
            $name,
            256,
            $wb,
            292,
            |$x, $y, acc| {
                let sum: __m256i = $lanes;
                fma_i32(acc, d_xy($x, $y), sum);
            },
            finish | acc | { scaled_hsum(acc, $factor) }
        );
    };
}

lattice_block!(Iq2Xxs, 66, 0.125, |x, y| {
    let mut sum = _mm256_setzero_si256();
    for ib in 0..8 {
        let (grid, aux) = (u32_at(x.add(2 + 8 * ib)), u32_at(x.add(6 + 8 * ib)));
        let g = |l: u32| IQ2XXS_GRID[(grid >> (8 * l) & 255) as usize] as i64;
        let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
        let s = _mm256_set_epi64x(
            even_signs(aux >> 21),
            even_signs(aux >> 14),
            even_signs(aux >> 7),
            even_signs(aux),
        );
        let m = _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16);
        sum = _mm256_add_epi32(sum, signed_lanes(q, s, y.add(Y_QS + 32 * ib), m));
    }
    sum
});

lattice_block!(Iq2Xs, 74, 0.125, |x, y| {
    let mut sum = _mm256_setzero_si256();
    for ib in 0..8 {
        let q16 =
            |l: usize| u16::from_le_bytes([*x.add(2 + 8 * ib + 2 * l), *x.add(3 + 8 * ib + 2 * l)]);
        let g = |l: usize| IQ2XS_GRID[(q16(l) & 511) as usize] as i64;
        let sg = |l: usize| even_signs((q16(l) >> 9) as u32);
        let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
        let s = _mm256_set_epi64x(sg(3), sg(2), sg(1), sg(0));
        let sc = *x.add(66 + ib) as i32;
        let m = halves(2 * (sc & 15) + 1, 2 * (sc >> 4) + 1);
        sum = _mm256_add_epi32(sum, signed_lanes(q, s, y.add(Y_QS + 32 * ib), m));
    }
    sum
});

lattice_block!(Iq2S, 82, 0.125, |x, y| {
    let mut sum = _mm256_setzero_si256();
    for ib in 0..8 {
        let qh = *x.add(66 + ib) as usize;
        let g = |l: usize| {
            let idx = *x.add(2 + 4 * ib + l) as usize | (qh << (8 - 2 * l) & 0x300);
            IQ2S_GRID[idx] as i64
        };
        let sg = |l: usize| SIGN_BYTES[*x.add(34 + 4 * ib + l) as usize] as i64;
        let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
        let s = _mm256_set_epi64x(sg(3), sg(2), sg(1), sg(0));
        let sc = *x.add(74 + ib) as i32;
        let m = halves(2 * (sc & 15) + 1, 2 * (sc >> 4) + 1);
        sum = _mm256_add_epi32(sum, signed_lanes(q, s, y.add(Y_QS + 32 * ib), m));
    }
    sum
});

lattice_block!(Iq3Xxs, 98, 0.25, |x, y| {
    let mut sum = _mm256_setzero_si256();
    for ib in 0..8 {
        let g = |k: usize| IQ3XXS_GRID[*x.add(2 + 8 * ib + k) as usize] as i32;
        let q = _mm256_set_epi32(g(7), g(6), g(5), g(4), g(3), g(2), g(1), g(0));
        let aux = u32_at(x.add(66 + 4 * ib));
        let s = _mm256_set_epi64x(
            even_signs(aux >> 21),
            even_signs(aux >> 14),
            even_signs(aux >> 7),
            even_signs(aux),
        );
        let m = _mm256_set1_epi16((2 * (aux >> 28) + 1) as i16);
        sum = _mm256_add_epi32(sum, signed_lanes(q, s, y.add(Y_QS + 32 * ib), m));
    }
    sum
});

lattice_block!(Iq3S, 110, 1.0, |x, y| {
    let mut sum = _mm256_setzero_si256();
    for ib in 0..8 {
        let qh = *x.add(66 + ib) as usize;
        // entry k of the 32 elements: qs byte k, its ninth bit bit k of qh
        let g = |k: usize| {
            let idx = *x.add(2 + 8 * ib + k) as usize | (qh << (8 - k) & 256);
            IQ3S_GRID[idx] as i32
        };
        let q = _mm256_set_epi32(g(7), g(6), g(5), g(4), g(3), g(2), g(1), g(0));
        let sg = |l: usize| SIGN_BYTES[*x.add(74 + 4 * ib + l) as usize] as i64;
        let s = _mm256_set_epi64x(sg(3), sg(2), sg(1), sg(0));
        let sc = (*x.add(106 + ib / 2) >> (4 * (ib % 2)) & 15) as i16;
        let m = _mm256_set1_epi16(2 * sc + 1);
        sum = _mm256_add_epi32(sum, signed_lanes(q, s, y.add(Y_QS + 32 * ib), m));
    }
    sum
});

lattice_block!(Iq4Xs, 136, 1.0, |x, y| {
    let mut sum = _mm256_setzero_si256();
    let sh = u16::from_le_bytes([*x.add(2), *x.add(3)]) as i32;
    for ib in 0..8 {
        let v = lookup_16(x.add(8 + 16 * ib), &crate::iq::KVALUES_IQ4NL);
        let lo = (*x.add(4 + ib / 2) >> (4 * (ib % 2)) & 15) as i32;
        let ls = (lo | (sh >> (2 * ib) & 3) << 4) - 32;
        let p16 = _mm256_maddubs_epi16(
            _mm256_sign_epi8(v, v),
            _mm256_sign_epi8(load(y.add(Y_QS + 32 * ib)), v),
        );
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, _mm256_set1_epi16(ls as i16)));
    }
    sum
});
