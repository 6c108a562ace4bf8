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

/// One 32-value chunk of a lattice block: magnitudes `q`, sign bytes `s` (+1, -1; 0 where the
/// value is 0) and the odd multipliers of its two 16s.
struct Chunk {
    q: __m256i,
    s: __m256i,
    lo: i32,
    hi: i32,
    /// The `madd` multipliers where a format builds them as a vector (`halves(lo, hi)`
    /// otherwise).
    m: Option<__m256i>,
}

/// A lattice kernel from its chunk decoder `|x, ib| -> Chunk`: the vec_dot (`Block`) and the
/// tiled batch kernel's unpacking (`$tiled`), which share it. `$factor` is the format's constant
/// (the vec_dot's final multiplier, folded into the tiled kernel's row scale).
macro_rules! lattice_block {
    ($name:ident, $tiled:ident, $wb:expr, $factor:expr, |$x:ident, $ib:ident| $chunk:block
     $(, one_row $one_row:literal)?) => {
        #[inline]
        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn chunk_of($x: *const u8, $ib: usize) -> Chunk $chunk

        bytes_block!(
            $name,
            256,
            $wb,
            292,
            |x, y, acc| {
                let mut sum = _mm256_setzero_si256();
                for ib in 0..8 {
                    let c = chunk_of(x, ib);
                    let m = c.m.unwrap_or_else(|| halves(c.lo, c.hi));
                    sum = _mm256_add_epi32(sum, signed_lanes(c.q, c.s, y.add(Y_QS + 32 * ib), m));
                }
                fma_i32(acc, d_xy(x, y), sum);
            },
            finish | acc | { scaled_hsum(acc, $factor) }
            $(, one_row $one_row)?
        );

        /// The tiled batch kernel's view of one block (`tiled::TiledBlock`) into `t`, with
        /// AVX2. Handed out only after run-time detection; `b` holds one block.
        pub(crate) fn $tiled(b: &[u8], t: &mut crate::tiled::TiledBlock) {
            assert!(b.len() >= $wb);
            // SAFETY: avx2, fma and f16c were detected before this function was handed out
            // (kernel::tiled_fn); the decoder reads within the block's $wb bytes.
            unsafe { unpack(b.as_ptr(), t) }
        }

        #[target_feature(enable = "avx2,fma,f16c")]
        unsafe fn unpack(x: *const u8, t: &mut crate::tiled::TiledBlock) {
            t.d = f16_at(x) * $factor;
            t.mins = None;
            for ib in 0..8 {
                let c = chunk_of(x, ib);
                let w = _mm256_sign_epi8(c.q, c.s);
                _mm256_storeu_si256(t.w.as_mut_ptr().add(32 * ib) as *mut __m256i, w);
                t.scale16[2 * ib] = c.lo;
                t.scale16[2 * ib + 1] = c.hi;
            }
        }
    };
}

/// A chunk's stored sign bits (bit `j`: value `j` negative) as sign bytes, spread in a vector
/// (four table lookups and the shuffles that put them together took longer).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn stored_signs(bits: u32) -> __m256i {
    _mm256_or_si256(bits_to_bytes(bits), _mm256_set1_epi8(1))
}

/// The four sign bytes' patterns of a word of 7-bit sign indices, as four 8-byte lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn even_signs4(aux: u32) -> __m256i {
    _mm256_set_epi64x(
        even_signs(aux >> 21),
        even_signs(aux >> 14),
        even_signs(aux >> 7),
        even_signs(aux),
    )
}

mod iq2_xxs {
    use super::*;
    lattice_block!(Iq2Xxs, tiled, 66, 0.125, |x, ib| {
        let (grid, aux) = (u32_at(x.add(2 + 8 * ib)), u32_at(x.add(6 + 8 * ib)));
        let g = |l: u32| IQ2XXS_GRID[(grid >> (8 * l) & 255) as usize] as i64;
        let m = 2 * (aux >> 28) as i32 + 1;
        Chunk {
            q: _mm256_set_epi64x(g(3), g(2), g(1), g(0)),
            s: even_signs4(aux),
            lo: m,
            hi: m,
            m: None,
        }
    });
}

mod iq2_xs {
    use super::*;
    lattice_block!(Iq2Xs, tiled, 74, 0.125, |x, ib| {
        let words = (x.add(2 + 8 * ib) as *const u64).read_unaligned();
        let q16 = |l: usize| (words >> (16 * l)) as u32 & 0xffff;
        let g = |l: usize| IQ2XS_GRID[(q16(l) & 511) as usize] as i64;
        let sg = |l: usize| even_signs(q16(l) >> 9);
        let sc = *x.add(66 + ib) as i32;
        Chunk {
            q: _mm256_set_epi64x(g(3), g(2), g(1), g(0)),
            s: _mm256_set_epi64x(sg(3), sg(2), sg(1), sg(0)),
            lo: 2 * (sc & 15) + 1,
            hi: 2 * (sc >> 4) + 1,
            m: None,
        }
    });
}

mod iq2_s {
    use super::*;
    lattice_block!(Iq2S, tiled, 82, 0.125, |x, ib| {
        let signs = u32_at(x.add(34 + 4 * ib));
        let idx = iq2s_indices(x);
        let i = if ib.is_multiple_of(2) {
            _mm_cvtsi128_si64(idx[ib / 2])
        } else {
            _mm_extract_epi64::<1>(idx[ib / 2])
        } as u64;
        // 10-bit indices, inside the table
        let g = |l: u64| *IQ2S_GRID.get_unchecked((i >> (16 * l) & 0xffff) as usize) as i64;
        let sc = *x.add(74 + ib) as i32;
        // the block's sixteen multipliers (the same for every chunk: built once), each twice
        // in a dword: chunk ib's first 16s' in dword ib % 4 of the low half of vector ib / 4,
        // its second 16s' in the high half, so that one `pshufd` spreads them
        let n = _mm_loadl_epi64(x.add(74) as *const __m128i);
        let m4 = _mm_set1_epi8(15);
        let n = _mm_unpacklo_epi64(
            _mm_and_si128(n, m4),
            _mm_and_si128(_mm_srli_epi16::<4>(n), m4),
        );
        let mult = _mm256_cvtepu8_epi16(_mm_add_epi8(_mm_add_epi8(n, n), _mm_set1_epi8(1)));
        let mult = [
            _mm256_unpacklo_epi16(mult, mult),
            _mm256_unpackhi_epi16(mult, mult),
        ];
        Chunk {
            q: _mm256_set_epi64x(g(3), g(2), g(1), g(0)),
            s: stored_signs(signs),
            lo: 2 * (sc & 15) + 1,
            hi: 2 * (sc >> 4) + 1,
            m: Some(dword_spread(mult[ib / 4], ib % 4)),
        }
    }, one_row true);
}

/// IQ2_S's 32 10-bit grid indices of the block at `x` as u16, built together (one at a time
/// in scalar code took longer): entries 8k..8k + 8 (chunks 2k and 2k + 1) in vector k. Entry
/// `j` is low byte `j` with bits `2 (j % 4)..` of `qh` byte `j / 4` on top.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq2s_indices(x: *const u8) -> [__m128i; 4] {
    let qh = _mm_cvtepu8_epi16(_mm_loadl_epi64(x.add(66) as *const __m128i));
    // each qh byte four times, shifted so that its bits 2l, 2l + 1 land on bits 8, 9
    let shifts = _mm_set_epi16(4, 16, 64, 256, 4, 16, 64, 256);
    grid_indices(x.add(2), qh, |r| {
        _mm_and_si128(_mm_mullo_epi16(r, shifts), _mm_set1_epi16(0x300))
    })
}

mod iq3_xxs {
    use super::*;
    lattice_block!(Iq3Xxs, tiled, 98, 0.25, |x, ib| {
        let idx = (x.add(2 + 8 * ib) as *const u64).read_unaligned();
        let g = |k: usize| IQ3XXS_GRID[(idx >> (8 * k) & 255) as usize] as i32;
        let aux = u32_at(x.add(66 + 4 * ib));
        let m = 2 * (aux >> 28) as i32 + 1;
        Chunk {
            q: _mm256_set_epi32(g(7), g(6), g(5), g(4), g(3), g(2), g(1), g(0)),
            s: even_signs4(aux),
            lo: m,
            hi: m,
            m: None,
        }
    });
}

mod iq3_s {
    use super::*;
    lattice_block!(Iq3S, tiled, 110, 1.0, |x, ib| {
        let qh = *x.add(66 + ib) as usize;
        // entry k of the 32 values: qs byte k, its ninth bit bit k of qh
        let g = |k: usize| {
            let idx = *x.add(2 + 8 * ib + k) as usize | (qh << (8 - k) & 256);
            IQ3S_GRID[idx] as i32
        };
        let m = 2 * (*x.add(106 + ib / 2) >> (4 * (ib % 2)) & 15) as i32 + 1;
        Chunk {
            q: _mm256_set_epi32(g(7), g(6), g(5), g(4), g(3), g(2), g(1), g(0)),
            s: stored_signs(u32_at(x.add(74 + 4 * ib))),
            lo: m,
            hi: m,
            m: None,
        }
    });
}

mod iq4_xs {
    use super::*;
    // IQ4_XS as a lattice: magnitudes |v|, signs from v itself, the signed 6-bit scale.
    lattice_block!(Iq4Xs, tiled, 136, 1.0, |x, ib| {
        let sh = u16::from_le_bytes([*x.add(2), *x.add(3)]) as i32;
        let v = lookup_16(x.add(8 + 16 * ib), &crate::iq::KVALUES_IQ4NL);
        let lo = (*x.add(4 + ib / 2) >> (4 * (ib % 2)) & 15) as i32;
        let ls = (lo | (sh >> (2 * ib) & 3) << 4) - 32;
        Chunk {
            q: _mm256_sign_epi8(v, v),
            s: v,
            lo: ls,
            hi: ls,
            m: None,
        }
    });
}

pub(crate) use iq2_s::{tiled as tiled_iq2_s, Iq2S};
pub(crate) use iq2_xs::{tiled as tiled_iq2_xs, Iq2Xs};
pub(crate) use iq2_xxs::{tiled as tiled_iq2_xxs, Iq2Xxs};
pub(crate) use iq3_s::{tiled as tiled_iq3_s, Iq3S};
pub(crate) use iq3_xxs::{tiled as tiled_iq3_xxs, Iq3Xxs};
pub(crate) use iq4_xs::{tiled as tiled_iq4_xs, Iq4Xs};
