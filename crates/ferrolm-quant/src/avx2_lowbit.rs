//! AVX2 kernels of IQ1_S, TQ1_0, TQ2_0, Q1_0, Q2_0 and NVFP4, the same integer lanes and float
//! order as their scalar references (`iq1`, `ternary`, `low_bit`, `iq`), which follow
//! llama.cpp's AVX2 kernels (its generic C loop for Q2_0).

use super::*;
use crate::iq::{ue4m3_to_f32_half, KVALUES_MXFP4};
use crate::iq_grids::IQ1S_GRID;

/// `maddubs` of unsigned codes with the activations, then pairs: 8 i32 lanes of 32 elements.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn code_lanes(codes: __m256i, y: *const u8) -> __m256i {
    dot_u8_i8(codes, load(y))
}

/// The Q8_K block sums of groups `2l, 2l + 1` in lane `l`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bsum_pairs(y: *const u8) -> __m256i {
    _mm256_madd_epi16(bsums(y), _mm256_set1_epi16(1))
}

// TQ2_0: codes 0..=3 in bit pairs, minus the block sums (`t - 1`); d at byte 64.
bytes_block!(Tq2_0, 256, 66, 292, |x, y, acc| {
    let mut sum = _mm256_sub_epi32(_mm256_setzero_si256(), bsum_pairs(y));
    for half in 0..2 {
        let q = load(x.add(32 * half));
        for l in 0..4 {
            let codes = low2(q, 2 * l as i32);
            let ys = y.add(Y_QS + 128 * half + 32 * l);
            sum = _mm256_add_epi32(sum, code_lanes(codes, ys));
        }
    }
    fma_i32(acc, y_d(y) * f16_at(x.add(64)), sum);
});

// TQ1_0: each byte times 3^n (wrapping, as ggml's `q * pow3[n]`), the top of `3 q` as the trit
// (`subs`/`avg`, llama.cpp's way), then as TQ2_0; d at byte 52.
bytes_block!(Tq1_0, 256, 54, 292, |x, y, acc| {
    let mut sum = _mm256_sub_epi32(_mm256_setzero_si256(), bsum_pairs(y));
    // elements 32n + m: trit n of byte m of the first 32
    let q = load(x);
    let mut p = q;
    for n in 0..5 {
        sum = _mm256_add_epi32(sum, code_lanes(top_trit(p), y.add(Y_QS + 32 * n)));
        p = times3(p);
    }
    // elements 160 + 16n + m: trit n of byte 32 + m; 240 + 4n + j: trit n of byte 48 + j
    let q16 = _mm_loadu_si128(x.add(32) as *const __m128i);
    let p16: [__m128i; 5] = {
        let mut t = [q16; 5];
        for n in 1..5 {
            t[n] = _mm_add_epi8(t[n - 1], _mm_add_epi8(t[n - 1], t[n - 1]));
        }
        t
    };
    const POW3: [u8; 4] = [1, 3, 9, 27];
    let qh: [u8; 16] = std::array::from_fn(|k| (*x.add(48 + k % 4)).wrapping_mul(POW3[k / 4]));
    let qh = _mm_loadu_si128(qh.as_ptr() as *const __m128i);
    let pairs = [(p16[0], p16[1]), (p16[2], p16[3]), (p16[4], qh)];
    for (k, (lo, hi)) in pairs.into_iter().enumerate() {
        let codes = top_trit(_mm256_set_m128i(hi, lo));
        sum = _mm256_add_epi32(sum, code_lanes(codes, y.add(Y_QS + 160 + 32 * k)));
    }
    fma_i32(acc, y_d(y) * f16_at(x.add(52)), sum);
});

/// Each byte times 3, wrapping.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn times3(q: __m256i) -> __m256i {
    _mm256_add_epi8(q, _mm256_add_epi8(q, q))
}

/// `(3 q) >> 8` of each byte: `avg(x, avg(x, 0))` with `x = q - 1` (saturating) keeps the top
/// two bits of `1.5 x`, the same for all 256 values (tests/dot.rs checks TQ1_0 against the scalar).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn top_trit(q: __m256i) -> __m256i {
    let x = _mm256_subs_epu8(q, _mm256_set1_epi8(1));
    let t = _mm256_avg_epu8(x, _mm256_avg_epu8(x, _mm256_setzero_si256()));
    _mm256_and_si256(_mm256_srli_epi16(t, 6), _mm256_set1_epi8(3))
}

// IQ1_S: grid lanes by the odd multipliers (fma by d into `v`), the delta's integer sum from the
// block sums (fma by d into `s`); the end is `hsum(v) + 0.125 * s`. The grid indices and the
// multipliers are built for the block at once in vectors, the delta's sum by one `madd` of
// the block sums (each index and each chunk's delta in scalar code took longer).
bytes_block!(
    Iq1S,
    256,
    50,
    292,
    |x, y, acc| {
        let qh = _mm_loadu_si128(x.add(34) as *const __m128i);
        let idx = iq1s_indices(x, qh);
        // chunk ib's multiplier twice in dword ib, negated where its delta is negative
        let m = _mm_add_epi16(
            _mm_and_si128(_mm_srli_epi16::<11>(qh), _mm_set1_epi16(14)),
            _mm_set1_epi16(1),
        );
        let neg = _mm_srai_epi16::<15>(qh);
        let signed = _mm_sub_epi16(_mm_xor_si128(m, neg), neg);
        let dm = |v: __m128i| _mm256_set_m128i(v, v);
        let mult = [dm(_mm_unpacklo_epi16(m, m)), dm(_mm_unpackhi_epi16(m, m))];
        let delta = _mm256_madd_epi16(
            bsums(y),
            _mm256_set_m128i(
                _mm_unpackhi_epi16(signed, signed),
                _mm_unpacklo_epi16(signed, signed),
            ),
        );
        let mut sum = _mm256_setzero_si256();
        for ib in 0..8 {
            let i = if ib % 2 == 0 {
                _mm_cvtsi128_si64(idx[ib / 2])
            } else {
                _mm_extract_epi64::<1>(idx[ib / 2])
            } as u64;
            // 11-bit indices, inside the table
            let g = |l: u64| *IQ1S_GRID.get_unchecked((i >> (16 * l) & 0xffff) as usize) as i64;
            let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
            let p16 = _mm256_maddubs_epi16(
                _mm256_sign_epi8(q, q),
                _mm256_sign_epi8(load(y.add(Y_QS + 32 * ib)), q),
            );
            let m = dword_spread(mult[ib / 4], ib % 4);
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, m));
        }
        let sumi1 = hsum_i32(delta);
        let d = y_d(y) * f16_at(x);
        fma_i32(acc, d, sum);
        acc.s = d.mul_add(sumi1 as f32, acc.s);
    },
    finish | acc | { hsum_f32(acc.v) + 0.125 * acc.s }
);

/// IQ1_S's 32 11-bit grid indices of the block at `x` (`qh` its eight words at byte 34) as
/// u16: entries 8k..8k + 8 (chunks 2k and 2k + 1) in vector k. Entry `j` is low byte `j` with
/// bits `3 (j % 4)..` of word `j / 4` on top.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq1s_indices(x: *const u8, qh: __m128i) -> [__m128i; 4] {
    // each word four times, shifted so that its bits 3l..3l + 3 land on bits 13..16, then 8..11
    let shifts = _mm_set_epi16(16, 128, 1024, 8192, 16, 128, 1024, 8192);
    grid_indices(x.add(2), qh, |r| {
        let t = _mm_srli_epi16::<5>(_mm_mullo_epi16(r, shifts));
        _mm_and_si128(t, _mm_set1_epi16(0x700))
    })
}

// IQ1_M: grid lanes and delta-sign lanes, both by the multipliers of each 16 elements, into
// two accumulators; the end is `hsum(v) + 0.125 * hsum(v2)`. The block's grid indices, delta
// signs and multipliers are built for all chunks at once in vectors (one index at a time in
// scalar code was most of the block's instructions).
bytes_block!(
    Iq1M,
    256,
    56,
    292,
    |x, y, acc| {
        let sc = (x.add(48) as *const u64).read_unaligned();
        let bits = (sc >> 12 & 0xf) | (sc >> 24 & 0xf0) | (sc >> 36 & 0xf00) | (sc >> 48 & 0xf000);
        let d = y_d(y) * _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)));
        let idx = iq1m_indices(x);
        let signs = iq1m_delta_signs(x);
        let mult = iq1m_multipliers(sc);
        let (mut grid, mut delta) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for ib in 0..8 {
            let i = if ib % 2 == 0 {
                _mm_cvtsi128_si64(idx[ib / 2])
            } else {
                _mm_extract_epi64::<1>(idx[ib / 2])
            } as u64;
            // 11-bit indices, inside the table
            let g =
                |l: u64| *IQ1S_GRID_PLUS1.get_unchecked((i >> (16 * l) & 0xffff) as usize) as i64;
            let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
            // qword l: the sign of group 4 (ib % 4) + l of the chunk's half of the block
            let b = |l: usize| 0x0101_0101_0101_0101 * (4 * (ib % 4) + l) as i64;
            let pick = _mm256_set_epi64x(b(3), b(2), b(1), b(0));
            let s = _mm256_shuffle_epi8(signs[ib / 4], pick);
            let m = dword_spread(mult[ib % 2], ib / 2);
            // pair sums of q y as those of (q + 1) y less those of y, which the delta takes
            let yv = load(y.add(Y_QS + 32 * ib));
            let ys = _mm256_maddubs_epi16(_mm256_set1_epi8(1), yv);
            let p16 = _mm256_sub_epi16(_mm256_maddubs_epi16(q, yv), ys);
            grid = _mm256_add_epi32(grid, _mm256_madd_epi16(p16, m));
            let d16 = _mm256_sign_epi16(ys, s);
            delta = _mm256_add_epi32(delta, _mm256_madd_epi16(d16, m));
        }
        fma_i32(acc, d, grid);
        acc.v2 = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(delta), acc.v2);
    },
    finish | acc | { hsum_f32(acc.v) + 0.125 * hsum_f32(acc.v2) }
);

/// The IQ1 grid's entries plus 1 in each byte: 0..=2, unsigned for `maddubs`.
pub(super) static IQ1S_GRID_PLUS1: [u64; 2048] = {
    let mut t = [0u64; 2048];
    let mut i = 0;
    while i < 2048 {
        let mut b = 0;
        while b < 8 {
            let v = (IQ1S_GRID[i] >> (8 * b)) as u8 as i8 + 1;
            t[i] |= (v as u8 as u64) << (8 * b);
            b += 1;
        }
        i += 1;
    }
    t
};

/// IQ1_M's 32 11-bit grid indices of the block at `x` as u16: entries 8k..8k + 8 (chunks 2k
/// and 2k + 1) in vector k. Entry j is low byte j with nibble j of the `qh` bytes (its 3 low
/// bits) on top.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq1m_indices(x: *const u8) -> [__m128i; 4] {
    let qh = _mm_loadu_si128(x.add(32) as *const __m128i);
    let m7 = _mm_set1_epi8(7);
    let (even, odd) = (
        _mm_and_si128(qh, m7),
        _mm_and_si128(_mm_srli_epi16::<4>(qh), m7),
    );
    let high = [_mm_unpacklo_epi8(even, odd), _mm_unpackhi_epi8(even, odd)];
    let low = [
        _mm_loadu_si128(x as *const __m128i),
        _mm_loadu_si128(x.add(16) as *const __m128i),
    ];
    [
        _mm_unpacklo_epi8(low[0], high[0]),
        _mm_unpackhi_epi8(low[0], high[0]),
        _mm_unpacklo_epi8(low[1], high[1]),
        _mm_unpackhi_epi8(low[1], high[1]),
    ]
}

/// IQ1_M's delta signs (bit 3 of each `qh` nibble, one per group of 8) as bytes 0x81
/// (negative) or 0x01, which spread over a group's bytes make `sign_epi16` operands: groups
/// 0..16 (byte g) in both halves of the first vector, 16..32 in the second.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq1m_delta_signs(x: *const u8) -> [__m256i; 2] {
    let qh = _mm_loadu_si128(x.add(32) as *const __m128i);
    // bit 7 of byte 2k: the low nibble's bit 3; of byte 2k + 1: the high nibble's
    let low = _mm_slli_epi16::<4>(qh);
    let s = |v: __m128i| {
        let v = _mm_or_si128(
            _mm_and_si128(v, _mm_set1_epi8(0x80u8 as i8)),
            _mm_set1_epi8(1),
        );
        _mm256_broadcastsi128_si256(v)
    };
    [s(_mm_unpacklo_epi8(low, qh)), s(_mm_unpackhi_epi8(low, qh))]
}

/// IQ1_M's sixteen multipliers `2 s + 1` from its scale words `sc`, each twice in a dword:
/// chunk ib's first 16 elements' in dword ib / 2 of the low half of vector ib % 2, its second
/// 16's in the high half, so that one `pshufd` spreads them.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq1m_multipliers(sc: u64) -> [__m256i; 2] {
    // u16 p of qword q: the 3-bit scale at bit (0, 6, 3, 9)[q] of word p
    let s = _mm256_srlv_epi64(_mm256_set1_epi64x(sc as i64), _mm256_set_epi64x(9, 3, 6, 0));
    let s = _mm256_and_si256(s, _mm256_set1_epi16(7));
    let m = _mm256_add_epi16(_mm256_add_epi16(s, s), _mm256_set1_epi16(1));
    [_mm256_unpacklo_epi16(m, m), _mm256_unpackhi_epi16(m, m)]
}

/// Q8_0 activation blocks: f16 d, then 32 quants.
const Q8_0_BYTES: usize = 34;

// Q1_0 (128 elements over four Q8_0 blocks): the activations with the weights' signs, summed
// in lanes; a multiply by the first block's d, fmas for the others, one fma by the weight's d.
bytes_block!(Q1_0, 128, 18, 4 * Q8_0_BYTES, |x, y, acc| {
    let mut block = _mm256_setzero_ps();
    for k in 0..4 {
        let yk = y.add(Q8_0_BYTES * k);
        let bits = u32::from_le_bytes([
            *x.add(2 + 4 * k),
            *x.add(3 + 4 * k),
            *x.add(4 + 4 * k),
            *x.add(5 + 4 * k),
        ]);
        // +1 where a bit is set, -1 where clear
        let s = _mm256_or_si256(
            _mm256_andnot_si256(bits_to_bytes(bits), _mm256_set1_epi8(-1)),
            _mm256_set1_epi8(1),
        );
        let ones = _mm256_set1_epi8(1);
        let lanes = _mm256_cvtepi32_ps(dot_u8_i8(ones, _mm256_sign_epi8(load(yk.add(2)), s)));
        let dy = _mm256_set1_ps(f16_at(yk));
        block = if k == 0 {
            _mm256_mul_ps(dy, lanes)
        } else {
            _mm256_fmadd_ps(dy, lanes, block)
        };
    }
    acc.v = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(x)), block, acc.v);
});

// Q2_0 (64 elements over two Q8_0 blocks): llama.cpp's generic loop, in `s`: per activation
// block `sumi += d_y * (sum of (q - 1) * y)`, then `sumf += d_x * sumi`, unfused.
bytes_block!(Q2_0, 64, 18, 2 * Q8_0_BYTES, |x, y, acc| {
    let mut sumi = 0f32;
    for k in 0..2 {
        let yk = y.add(Q8_0_BYTES * k);
        // element j of this half: bits 2 (j % 4) of byte 8k + j / 4
        let mut codes = [0u8; 32];
        for (j, c) in codes.iter_mut().enumerate() {
            *c = *x.add(2 + 8 * k + j / 4) >> (2 * (j % 4)) & 3;
        }
        let yv = load(yk.add(2));
        let qy = dot_u8_i8(load(codes.as_ptr()), yv);
        let ysum = dot_u8_i8(_mm256_set1_epi8(1), yv);
        let s = hsum_i32(_mm256_sub_epi32(qy, ysum));
        sumi += f16_at(yk) * s as f32;
    }
    acc.s += f16_at(x) * sumi;
});

/// The eight i32 lanes summed.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn hsum_i32(v: __m256i) -> i32 {
    let mut a = [0i32; 8];
    _mm256_storeu_si256(a.as_mut_ptr() as *mut __m256i, v);
    a.iter().sum()
}

// NVFP4 (64 elements over two Q8_0 blocks): per Q8_0 block the two sub-blocks' e2m1 values in
// element order, lanes 0-3 scaled by the first sub-block's `scale * d_y`, 4-7 by the second's.
bytes_block!(Nvfp4, 64, 36, 2 * Q8_0_BYTES, |x, y, acc| {
    let t = _mm_loadu_si128(KVALUES_MXFP4.as_ptr() as *const __m128i);
    let m4 = _mm_set1_epi8(0x0f);
    for h in 0..2 {
        let yh = y.add(Q8_0_BYTES * h);
        let bits = _mm_loadu_si128(x.add(4 + 16 * h) as *const __m128i);
        let lo = _mm_shuffle_epi8(t, _mm_and_si128(bits, m4));
        let hi = _mm_shuffle_epi8(t, _mm_and_si128(_mm_srli_epi16(bits, 4), m4));
        let v = _mm256_set_m128i(_mm_unpackhi_epi64(lo, hi), _mm_unpacklo_epi64(lo, hi));
        let lanes = _mm256_cvtepi32_ps(dot_i8(v, load(yh.add(2))));
        let dy = f16_at(yh);
        let s0 = ue4m3_to_f32_half(*x.add(2 * h)) * dy;
        let s1 = ue4m3_to_f32_half(*x.add(2 * h + 1)) * dy;
        acc.v = _mm256_fmadd_ps(
            _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0)),
            lanes,
            acc.v,
        );
    }
});

/// `8 g + delta` of 32 IQ1 grid bytes (four entries, -1..1) with their deltas (+1 / -1 bytes):
/// the tiled kernel's values (the delta scaled by 8 along with the grid).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn iq1_tiled_values(g: __m256i, delta: __m256i) -> __m256i {
    let g2 = _mm256_add_epi8(g, g);
    let g4 = _mm256_add_epi8(g2, g2);
    _mm256_add_epi8(_mm256_add_epi8(g4, g4), delta)
}

/// IQ1_S's view for the tiled batch kernel (`tiled::TiledBlock`) into `t`, with AVX2. Handed
/// out only after run-time detection; `b` holds one block.
pub(crate) fn tiled_iq1_s(b: &[u8], t: &mut crate::tiled::TiledBlock) {
    assert!(b.len() >= 50);
    // SAFETY: avx2, fma and f16c were detected before this function was handed out
    // (kernel::tiled_fn); the reads stay within the block's 50 bytes.
    unsafe { unpack_iq1_s(b.as_ptr(), t) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_iq1_s(x: *const u8, t: &mut crate::tiled::TiledBlock) {
    t.d = f16_at(x) * 0.125;
    t.mins = None;
    for ib in 0..8 {
        let qh = u16::from_le_bytes([*x.add(34 + 2 * ib), *x.add(35 + 2 * ib)]) as usize;
        let low = u32::from_le_bytes([
            *x.add(2 + 4 * ib),
            *x.add(3 + 4 * ib),
            *x.add(4 + 4 * ib),
            *x.add(5 + 4 * ib),
        ]);
        let g = |l: usize| {
            let idx = (low >> (8 * l) & 255) as usize | ((qh >> (3 * l) & 7) << 8);
            IQ1S_GRID[idx] as i64
        };
        let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
        let delta = _mm256_set1_epi8(if qh & 0x8000 != 0 { -1 } else { 1 });
        let w = iq1_tiled_values(q, delta);
        _mm256_storeu_si256(t.w.as_mut_ptr().add(32 * ib) as *mut __m256i, w);
        let m = 2 * (qh >> 12 & 7) as i32 + 1;
        t.scale16[2 * ib] = m;
        t.scale16[2 * ib + 1] = m;
    }
}

/// IQ1_M's view for the tiled batch kernel, with AVX2 (as [`tiled_iq1_s`]).
pub(crate) fn tiled_iq1_m(b: &[u8], t: &mut crate::tiled::TiledBlock) {
    assert!(b.len() >= 56);
    // SAFETY: as in `tiled_iq1_s`, within the block's 56 bytes.
    unsafe { unpack_iq1_m(b.as_ptr(), t) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_iq1_m(x: *const u8, t: &mut crate::tiled::TiledBlock) {
    let sc: [u16; 4] =
        std::array::from_fn(|k| u16::from_le_bytes([*x.add(48 + 2 * k), *x.add(49 + 2 * k)]));
    let bits = (sc[0] >> 12) | (sc[1] >> 8 & 0x00f0) | (sc[2] >> 4 & 0x0f00) | (sc[3] & 0xf000);
    t.d = half::f16::from_bits(bits).to_f32() * 0.125;
    t.mins = None;
    for ib in 0..8 {
        let low = u32::from_le_bytes([
            *x.add(4 * ib),
            *x.add(1 + 4 * ib),
            *x.add(2 + 4 * ib),
            *x.add(3 + 4 * ib),
        ]);
        let hi = u16::from_le_bytes([*x.add(32 + 2 * ib), *x.add(33 + 2 * ib)]);
        let nib = |g: usize| (hi >> (4 * g) & 0xf) as u8;
        let g = |l: usize| {
            let idx = (low >> (8 * l) & 255) as usize | ((nib(l) as usize & 7) << 8);
            IQ1S_GRID[idx] as i64
        };
        let sg = |l: usize| {
            if nib(l) & 8 != 0 {
                -1i64
            } else {
                0x0101_0101_0101_0101
            }
        };
        let q = _mm256_set_epi64x(g(3), g(2), g(1), g(0));
        let delta = _mm256_set_epi64x(sg(3), sg(2), sg(1), sg(0));
        let w = iq1_tiled_values(q, delta);
        _mm256_storeu_si256(t.w.as_mut_ptr().add(32 * ib) as *mut __m256i, w);
        let word = sc[ib / 2] as i32 >> (6 * (ib % 2));
        t.scale16[2 * ib] = 2 * (word & 7) + 1;
        t.scale16[2 * ib + 1] = 2 * (word >> 3 & 7) + 1;
    }
}
