//! Decode kernels with AVX-512 (VBMI, VNNI): Q1_0's and TQ1_0's (at the end) and the lattice
//! i-quants' (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS; IQ3_S's AVX2 kernel is as fast):
//! the same integer lanes as the AVX2 kernels of `iquants` and `lowbit` (llama.cpp's AVX2
//! `vec_dot`), two 32-value chunks per register. The grid entries are loaded one by one (this
//! CPU's gathers are slower), the 7-bit sign indices of a block looked up together
//! (`vpmultishiftqb`, `vpermi2b`; the S formats store them) into one 64-bit mask per two chunks
//! that negates the activations, and the lanes of a chunk pair added at the end: each of the
//! eight i32 lanes is the same exact sum.

use super::*;
use crate::iq2::KSIGNS;
use crate::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3XXS_GRID};

/// Whether the CPU has what these kernels use ([`Block::AVX512`]).
pub(crate) fn available() -> bool {
    has_avx512_vnni()
        && std::arch::is_x86_feature_detected!("avx512vbmi")
        && std::arch::is_x86_feature_detected!("bmi2")
}

/// Byte `4 ib + j` (ib < 8, j < 4) from byte `8 ib + j`.
static PACK4: [u8; 64] = {
    let mut t = [0u8; 64];
    let mut i = 0;
    while i < 32 {
        t[i] = (8 * (i / 4) + i % 4) as u8;
        i += 1;
    }
    t
};

/// Which multiplier each lane of chunk pair 0 takes, per layout of the multipliers (dword
/// `2 ib` per chunk; `ib` per chunk; `2 ib + h` per 16): lanes 0-7 are chunk 0's, 8-15 chunk
/// 1's.
static PER_CHUNK_EVEN: [i32; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2];
static PER_CHUNK: [i32; 16] = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1];
static PER_16: [i32; 16] = [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3];

/// The `madd` multipliers of the four chunk pairs (i16 pairs) from the values `m` (dwords as
/// `first` says, chunk pair `k` at `first + step k`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn multipliers(m: __m512i, first: &[i32; 16], step: i32) -> [__m512i; 4] {
    let m = _mm512_or_si512(m, _mm512_slli_epi32::<16>(m));
    let step = _mm512_set1_epi32(step);
    let mut at = _mm512_loadu_si512(first.as_ptr() as *const _);
    let mut mult = [_mm512_setzero_si512(); 4];
    for v in mult.iter_mut() {
        *v = _mm512_permutexvar_epi32(at, m);
        at = _mm512_add_epi32(at, step);
    }
    mult
}

/// `2 v + 1` of each dword.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn odd(v: __m512i) -> __m512i {
    _mm512_add_epi32(_mm512_add_epi32(v, v), _mm512_set1_epi32(1))
}

/// The nibbles of the 8 bytes at `p`, low then high of each, as dwords.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn nibble_dwords(p: *const u8) -> __m512i {
    let v = _mm_cvtsi64_si128((p as *const i64).read_unaligned());
    let m4 = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(v, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), m4);
    _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi))
}

/// The sign masks of chunk pairs `(2k, 2k + 1)` (bit `j` of 64: value `j` negative) from the
/// 7-bit sign indices of the 32 groups of 8 in bytes 0-31 of `idx`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn ksign_masks(idx: __m512i) -> [u64; 4] {
    let table = KSIGNS.as_ptr();
    let signs = _mm512_permutex2var_epi8(
        _mm512_loadu_si512(table as *const _),
        idx,
        _mm512_loadu_si512(table.add(64) as *const _),
    );
    let (lo, hi) = (
        _mm512_castsi512_si128(signs),
        _mm512_extracti32x4_epi32::<1>(signs),
    );
    [
        _mm_cvtsi128_si64(lo) as u64,
        _mm_extract_epi64::<1>(lo) as u64,
        _mm_cvtsi128_si64(hi) as u64,
        _mm_extract_epi64::<1>(hi) as u64,
    ]
}

/// The XXS formats' sign masks and multipliers from the chunks' aux words (four 7-bit sign
/// indices, the scale on top) in the low dword of qword `ib` of `aux`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn xxs_signs(aux: __m512i) -> ([u64; 4], [__m512i; 4]) {
    // bytes 0-3 of each qword: the four indices at bits 0, 7, 14, 21
    let fields = _mm512_set1_epi64(0x150e_0700);
    let idx = _mm512_multishift_epi64_epi8(fields, aux);
    let idx = _mm512_and_si512(idx, _mm512_set1_epi8(127));
    let pack = _mm512_loadu_si512(PACK4.as_ptr() as *const _);
    let masks = ksign_masks(_mm512_permutexvar_epi8(pack, idx));
    let m = odd(_mm512_srli_epi32::<28>(aux));
    (masks, multipliers(m, &PER_CHUNK_EVEN, 4))
}

/// Sign masks stored as bytes (one per group of 8) at `p`.
#[inline]
unsafe fn stored_masks(p: *const u8) -> [u64; 4] {
    let m = |k: usize| (p.add(8 * k) as *const u64).read_unaligned();
    [m(0), m(1), m(2), m(3)]
}

/// The eight i32 lanes of a block: chunk pair `k` with magnitudes `q[k]`, `masks[k]` and
/// `mult[k]` against the Q8_K block at `y`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn lanes(q: [__m512i; 4], masks: [u64; 4], mult: [__m512i; 4], y: *const u8) -> __m256i {
    let mut sum = _mm512_setzero_si512();
    for k in 0..4 {
        let yv = _mm512_loadu_si512(y.add(Y_QS + 64 * k) as *const _);
        let ys = _mm512_mask_sub_epi8(yv, masks[k], _mm512_setzero_si512(), yv);
        sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(q[k], ys), mult[k]);
    }
    _mm256_add_epi32(
        _mm512_castsi512_si256(sum),
        _mm512_extracti64x4_epi64::<1>(sum),
    )
}

/// A lattice [`Block`] of this module: `$lanes(x, y)` gives a block's eight i32 lanes,
/// `$factor` is the format's constant.
macro_rules! xxs_block {
    ($name:ident, $wb:expr, $factor:expr, |$x:ident, $y:ident| $lanes:block
     $(, rows_inline $why:literal)?) => {
        bytes_block!(
            avx512 $name,
            256,
            $wb,
            292,
            |$x, $y, acc| {
                let sum = $lanes;
                fma_i32(acc, f16_at($x) * y_d($y), sum);
            },
            finish | acc | { $factor * hsum_f32(acc.v) }
            $(, rows_inline $why)?
        );
    };
}

// IQ2_XXS: per chunk four grid bytes then the aux word (four sign indices, the scale on top).
xxs_block!(Iq2Xxs, 66, 0.125, |x, y| {
    let raw = _mm512_loadu_si512(x.add(2) as *const _);
    let q = [
        iq2_pair(x, 0),
        iq2_pair(x, 1),
        iq2_pair(x, 2),
        iq2_pair(x, 3),
    ];
    let (masks, mult) = xxs_signs(_mm512_srli_epi64::<32>(raw));
    lanes(q, masks, mult, y)
});

// IQ3_XXS: eight grid bytes per chunk, then the eight aux words.
xxs_block!(Iq3Xxs, 98, 0.25, |x, y| {
    let q = [
        iq3_pair(x, 0),
        iq3_pair(x, 1),
        iq3_pair(x, 2),
        iq3_pair(x, 3),
    ];
    let aux = _mm512_cvtepu32_epi64(_mm256_loadu_si256(x.add(66) as *const __m256i));
    let (masks, mult) = xxs_signs(aux);
    lanes(q, masks, mult, y)
},
rows_inline "LLVM does not inline this `apply`, which costs a call per block and row.");

/// Grid entries of IQ3_XXS chunks `2k` and `2k + 1` of the block at `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn iq3_pair(x: *const u8, k: usize) -> __m512i {
    let idx = (x.add(2 + 16 * k) as *const [u64; 2]).read_unaligned();
    let g = |h: usize, e: usize| IQ3XXS_GRID[(idx[h] >> (8 * e) & 255) as usize] as i32;
    let lo = _mm256_set_epi32(
        g(0, 7),
        g(0, 6),
        g(0, 5),
        g(0, 4),
        g(0, 3),
        g(0, 2),
        g(0, 1),
        g(0, 0),
    );
    let hi = _mm256_set_epi32(
        g(1, 7),
        g(1, 6),
        g(1, 5),
        g(1, 4),
        g(1, 3),
        g(1, 2),
        g(1, 1),
        g(1, 0),
    );
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi)
}

/// The grid entries `g(h, l)` of entry `l` of chunk `2k + h`, in element order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn entries(g: impl Fn(usize, usize) -> i64) -> __m512i {
    _mm512_set_epi64(
        g(1, 3),
        g(1, 2),
        g(1, 1),
        g(1, 0),
        g(0, 3),
        g(0, 2),
        g(0, 1),
        g(0, 0),
    )
}

/// Grid entries of IQ2_XXS chunks `2k` and `2k + 1` of the block at `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn iq2_pair(x: *const u8, k: usize) -> __m512i {
    let idx = [0, 1].map(|h| (x.add(2 + 8 * (2 * k + h)) as *const u32).read_unaligned());
    let g = |h: usize, l: usize| IQ2XXS_GRID[(idx[h] >> (8 * l) & 255) as usize] as i64;
    entries(g)
}

// IQ2_XS: 32 words of a 9-bit grid index and a 7-bit sign index, a scale per 16.
xxs_block!(Iq2Xs, 74, 0.125, |x, y| {
    let q = [
        iq2_xs_pair(x, 0),
        iq2_xs_pair(x, 1),
        iq2_xs_pair(x, 2),
        iq2_xs_pair(x, 3),
    ];
    let words = _mm512_loadu_si512(x.add(2) as *const _);
    let idx = _mm512_cvtepi16_epi8(_mm512_srli_epi16::<9>(words));
    let masks = ksign_masks(_mm512_castsi256_si512(idx));
    let mult = multipliers(odd(nibble_dwords(x.add(66))), &PER_16, 4);
    lanes(q, masks, mult, y)
});

/// Grid entries of IQ2_XS chunks `2k` and `2k + 1` of the block at `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn iq2_xs_pair(x: *const u8, k: usize) -> __m512i {
    let w = [0, 1].map(|h| (x.add(2 + 8 * (2 * k + h)) as *const u64).read_unaligned());
    let g = |h: usize, l: usize| IQ2XS_GRID[(w[h] >> (16 * l) & 511) as usize] as i64;
    entries(g)
}

// IQ2_S: 32 low bytes of 10-bit grid indices, 32 sign bytes, the high bits, a scale per 16.
xxs_block!(Iq2S, 82, 0.125, |x, y| {
    let q = [
        iq2_s_pair(x, 0),
        iq2_s_pair(x, 1),
        iq2_s_pair(x, 2),
        iq2_s_pair(x, 3),
    ];
    let mult = multipliers(odd(nibble_dwords(x.add(74))), &PER_16, 4);
    lanes(q, stored_masks(x.add(34)), mult, y)
});

/// Grid entries of IQ2_S chunks `2k` and `2k + 1` of the block at `x`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn iq2_s_pair(x: *const u8, k: usize) -> __m512i {
    let qh = [*x.add(66 + 2 * k) as usize, *x.add(67 + 2 * k) as usize];
    let g = |h: usize, l: usize| {
        let idx = *x.add(2 + 8 * k + 4 * h + l) as usize | (qh[h] << (8 - 2 * l) & 0x300);
        IQ2S_GRID[idx] as i64
    };
    entries(g)
}

/// The magnitudes and the negative values' masks of the signed grid bytes `q` (IQ1's -1..1).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn magnitudes(q: [__m512i; 4]) -> ([__m512i; 4], [u64; 4]) {
    let mut out = ([_mm512_setzero_si512(); 4], [0u64; 4]);
    for (k, q) in q.iter().enumerate() {
        out.0[k] = _mm512_abs_epi8(*q);
        out.1[k] = _mm512_movepi8_mask(*q);
    }
    out
}

/// IQ1_M's grid entries plus one (`lowbit::IQ1S_GRID_PLUS1`) of chunks `2k` and `2k + 1`:
/// each chunk's four 11-bit indices put together in the u16 fields of one word by two `pdep`s
/// (its four low bytes, and its two `qh` bytes' nibbles without their delta-sign bits), fewer
/// instructions than shifting and masking each index (`vpgatherqq` was slower on Zen 4 and 5).
/// Without target features of its own, so that it is inlined.
#[inline(always)]
unsafe fn iq1m_pair(x: *const u8, k: usize) -> __m512i {
    let mut idx = [0u64; 2];
    for (h, idx) in idx.iter_mut().enumerate() {
        let c = 2 * k + h;
        let low = (x.add(4 * c) as *const u32).read_unaligned() as u64;
        let high = (x.add(32 + 2 * c) as *const u16).read_unaligned() as u64;
        *idx =
            _pdep_u64(low, 0x00ff_00ff_00ff_00ff) | _pdep_u64(high & 0x7777, 0x0f00_0f00_0f00_0f00);
    }
    let grid = &lowbit::IQ1S_GRID_PLUS1;
    let g = |i: u64, l: u64| *grid.get_unchecked((i >> (16 * l) & 0xffff) as usize) as i64;
    let [a, b] = idx;
    // closures handed to another function were not inlined here
    _mm512_set_epi64(
        g(b, 3),
        g(b, 2),
        g(b, 1),
        g(b, 0),
        g(a, 3),
        g(a, 2),
        g(a, 1),
        g(a, 0),
    )
}

/// IQ1 grid entries of chunks `2k` and `2k + 1`: `low` their four low index bytes each,
/// `high` their four 3-bit high parts at bits `shift * l` of each chunk's 16 bits.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn iq1_pair(low: *const u8, high: u32, shift: u32) -> __m512i {
    let g = |h: usize, l: usize| {
        let top = ((high >> (16 * h)) as usize) << 8 >> (shift as usize * l) & 0x700;
        IQ1S_GRID[*low.add(4 * h + l) as usize | top] as i64
    };
    entries(g)
}

// IQ1_S (as `lowbit::Iq1S`): the grid lanes by the odd multipliers, the delta's integer sum
// from the block sums; the end is `hsum(v) + 0.125 * s`.
bytes_block!(
    avx512 Iq1S,
    256,
    50,
    292,
    |x, y, acc| {
    let high = |k: usize| (x.add(34 + 4 * k) as *const u32).read_unaligned();
    let q = [
        iq1_pair(x.add(2), high(0), 3),
        iq1_pair(x.add(10), high(1), 3),
        iq1_pair(x.add(18), high(2), 3),
        iq1_pair(x.add(26), high(3), 3),
    ];
    let (mags, masks) = magnitudes(q);
    let qh = _mm_loadu_si128(x.add(34) as *const __m128i);
    let m = _mm_and_si128(_mm_srli_epi16::<12>(qh), _mm_set1_epi16(7));
    let m = odd(_mm512_cvtepu16_epi32(_mm256_zextsi128_si256(m)));
    let sum = lanes(mags, masks, multipliers(m, &PER_CHUNK, 2), y);
    let mut sumi1 = 0i32;
    for ib in 0..8 {
        let qh = u16::from_le_bytes([*x.add(34 + 2 * ib), *x.add(35 + 2 * ib)]) as i32;
        let bs = |j: usize| {
            i16::from_le_bytes([*y.add(Y_BSUMS + 2 * j), *y.add(Y_BSUMS + 2 * j + 1)]) as i32
        };
        let sign = if qh & 0x8000 != 0 { -1 } else { 1 };
        sumi1 += (bs(2 * ib) + bs(2 * ib + 1)) * sign * (2 * (qh >> 12 & 7) + 1);
    }
    let d = y_d(y) * f16_at(x);
    fma_i32(acc, d, sum);
    acc.s = d.mul_add(sumi1 as f32, acc.s);
},
    finish | acc | { hsum_f32(acc.v) + 0.125 * acc.s },
    rows_inline "LLVM does not inline this `apply`, which costs a call per block and row."
);

/// Byte `b` of vector `h`: the `qh` byte of group `16 h + b / 4` (4 bytes per group of 8,
/// the group's four i16 pairs).
static IQ1M_DELTA_PICK: [[u8; 64]; 2] = {
    let mut t = [[0u8; 64]; 2];
    let mut b = 0;
    while b < 64 {
        t[0][b] = (b / 8) as u8;
        t[1][b] = (8 + b / 8) as u8;
        b += 1;
    }
    t
};

// IQ1_M (as `lowbit::Iq1M`): the pair sums of `q y` as those of `(q + 1) y` less those of `y`
// (unsigned grid bytes for `maddubs`, no sign masks), the delta's as those of `y` negated per
// group by a mask; both by the multipliers of each 16, into two accumulators; the end is
// `hsum(v) + 0.125 * hsum(v2)`.
bytes_block!(
    avx512 Iq1M,
    256,
    56,
    292,
    |x, y, acc| {
    let sc = (x.add(48) as *const u64).read_unaligned();
    let bits = (sc >> 12 & 0xf) | (sc >> 24 & 0xf0) | (sc >> 36 & 0xf00) | (sc >> 48 & 0xf000);
    let d = y_d(y) * _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)));
    // the 3-bit multipliers of each 16: bits 0, 3, 6, 9 of each of the four scale words
    let fields = _mm_set_epi64x(0x3936_3330_2926_2320, 0x1916_1310_0906_0300);
    let m = _mm_multishift_epi64_epi8(fields, _mm_set1_epi64x(sc as i64));
    let m = odd(_mm512_cvtepu8_epi32(_mm_and_si128(m, _mm_set1_epi8(7))));
    let mult = multipliers(m, &PER_16, 4);
    // the delta's sign: bit 3 of each group's nibble, bit 3 or 7 of its `qh` byte
    let qh = _mm512_castsi128_si512(_mm_loadu_si128(x.add(32) as *const __m128i));
    let pattern = _mm512_set1_epi64(0x8080_8080_0808_0808u64 as i64);
    let pick = |h: usize| _mm512_loadu_si512(IQ1M_DELTA_PICK[h].as_ptr() as *const _);
    let negative =
        [0, 1].map(|h| _mm512_test_epi8_mask(_mm512_permutexvar_epi8(pick(h), qh), pattern));
    let (mut grid, mut delta) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for (k, m) in mult.iter().enumerate() {
        let q = iq1m_pair(x, k);
        let yv = _mm512_loadu_si512(y.add(Y_QS + 64 * k) as *const _);
        let ys = _mm512_maddubs_epi16(_mm512_set1_epi8(1), yv);
        let p16 = _mm512_sub_epi16(_mm512_maddubs_epi16(q, yv), ys);
        grid = _mm512_dpwssd_epi32(grid, p16, *m);
        let neg = (negative[k / 2] >> (32 * (k % 2))) as u32;
        let d16 = _mm512_mask_sub_epi16(ys, neg, _mm512_setzero_si512(), ys);
        delta = _mm512_dpwssd_epi32(delta, d16, *m);
    }
    let half = |v: __m512i| {
        _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
    };
    fma_i32(acc, d, half(grid));
    acc.v2 = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(half(delta)), acc.v2);
},
    finish | acc | { hsum_f32(acc.v) + 0.125 * hsum_f32(acc.v2) },
    rows_inline "LLVM does not inline this `apply`, which costs a call per block and row."
);

// Q1_0 (as `lowbit::Q1_0`): 128 values over four Q8_0 blocks, two per register, the
// activations negated where a bit is clear by the bits as a mask; the same lanes and fmas.
bytes_block!(
    avx512 Q1_0,
    128,
    18,
    4 * 34,
    |x, y, acc| {
    let ones = _mm512_set1_epi8(1);
    let mut lanes = [_mm256_setzero_ps(); 4];
    for h in 0..2 {
        let bits = (x.add(2 + 8 * h) as *const u64).read_unaligned();
        let (y0, y1) = (y.add(34 * 2 * h + 2), y.add(34 * (2 * h + 1) + 2));
        let yv = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_loadu_si256(y0 as *const __m256i)),
            _mm256_loadu_si256(y1 as *const __m256i),
        );
        let ys = _mm512_mask_sub_epi8(yv, !bits, _mm512_setzero_si512(), yv);
        let v = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, ys));
        lanes[2 * h] = _mm512_castps512_ps256(v);
        lanes[2 * h + 1] = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    }
    let mut block = _mm256_mul_ps(_mm256_set1_ps(f16_at(y)), lanes[0]);
    for (k, l) in lanes.iter().enumerate().skip(1) {
        block = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(y.add(34 * k))), *l, block);
    }
    acc.v = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(x)), block, acc.v);
}
);

/// TQ1_0 (as `lowbit::Tq1_0`): the same trits, two 32-value planes per register met by
/// `vpdpbusd`, the halves added at the end; the same lanes.
pub(crate) struct Tq1_0;

/// `(3 q) >> 8` of each byte (as `lowbit::top_trit`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn top_trit(q: __m512i) -> __m512i {
    // (3 q) >> 8 is (q >= 86) + (q >= 171) for every byte: two compares into masks take
    // fewer operations than the `avg` form
    let one = _mm512_maskz_mov_epi8(
        _mm512_cmpge_epu8_mask(q, _mm512_set1_epi8(86)),
        _mm512_set1_epi8(1),
    );
    _mm512_mask_mov_epi8(
        one,
        _mm512_cmpge_epu8_mask(q, _mm512_set1_epi8(171u8 as i8)),
        _mm512_set1_epi8(2),
    )
}

/// Each byte times 9, wrapping.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
unsafe fn times9(q: __m512i) -> __m512i {
    let q3 = _mm512_add_epi8(q, _mm512_add_epi8(q, q));
    _mm512_add_epi8(q3, _mm512_add_epi8(q3, q3))
}

/// A TQ1_0 block's 256 trits (codes 0..=2) in element order, 64 per register, and `d`.
#[derive(Clone, Copy)]
pub(crate) struct Trits {
    codes: [__m512i; 4],
    d: f32,
}

/// Each byte of `v` times 3, wrapping.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn times3_128(v: __m128i) -> __m128i {
    _mm_add_epi8(v, _mm_add_epi8(v, v))
}

impl Block for Tq1_0 {
    const QK: usize = 256;
    const WB: usize = 54;
    const AB: usize = 292;
    type W = Trits;
    const AVX512: bool = true;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
    unsafe fn decode(x: *const u8) -> Trits {
        // elements 32n + m (n < 5): trit n of byte m; 160 + 16n + m: of byte 32 + m; 240 + 4n
        // + j: of byte 48 + j
        let q = _mm256_loadu_si256(x as *const __m256i);
        let q3 = _mm256_add_epi8(q, _mm256_add_epi8(q, q));
        let p01 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(q), q3);
        let p23 = times9(p01);
        let p4 = _mm512_castsi512_si256(times9(p23));
        let q16 = _mm_loadu_si128(x.add(32) as *const __m128i);
        let q16_3 = times3_128(q16);
        let q16_9 = times3_128(q16_3);
        let q16_27 = times3_128(q16_9);
        let q16_81 = times3_128(q16_27);
        const POW3: [u8; 4] = [1, 3, 9, 27];
        let qh: [u8; 16] = std::array::from_fn(|k| (*x.add(48 + k % 4)).wrapping_mul(POW3[k / 4]));
        let qh = _mm_loadu_si128(qh.as_ptr() as *const __m128i);
        let p45 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(p4), _mm256_set_m128i(q16_3, q16));
        let p67 = _mm512_inserti64x4::<1>(
            _mm512_castsi256_si512(_mm256_set_m128i(q16_27, q16_9)),
            _mm256_set_m128i(qh, q16_81),
        );
        Trits {
            codes: [top_trit(p01), top_trit(p23), top_trit(p45), top_trit(p67)],
            d: f16_at(x.add(52)),
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")]
    unsafe fn apply(w: &Trits, y: *const u8, acc: &mut Acc) {
        let mut sum = _mm512_setzero_si512();
        for (k, codes) in w.codes.iter().enumerate() {
            let yv = _mm512_loadu_si512(y.add(Y_QS + 64 * k) as *const _);
            sum = _mm512_dpbusd_epi32(sum, *codes, yv);
        }
        let sum = _mm256_add_epi32(
            _mm512_castsi512_si256(sum),
            _mm512_extracti64x4_epi64::<1>(sum),
        );
        let bsums = _mm256_madd_epi16(
            _mm256_loadu_si256(y.add(Y_BSUMS) as *const __m256i),
            _mm256_set1_epi16(1),
        );
        fma_i32(acc, y_d(y) * w.d, _mm256_sub_epi32(sum, bsums));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both kernels give the AVX2 ones' bits (which tests/dot.rs holds to the scalar reference),
    /// one row and seven at a time, on random bytes (any are valid blocks) with tame scales.
    #[test]
    fn lattice_kernels_match_the_avx2_ones() {
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
            && available())
        {
            return;
        }
        let mut s = 0x2545_f491_4f6c_dd1du64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let (n, rows) = (768, 7);
        let mut act = vec![0u8; n / 256 * 292];
        let x: Vec<f32> = (0..n)
            .map(|_| (next() % 2001) as f32 / 100.0 - 10.0)
            .collect();
        crate::quantize_activation(TensorType::Q8_K, &x, &mut act).unwrap();
        type Pair = (usize, DotFn, DotFn, RowsFn, RowsFn);
        macro_rules! pair {
            ($wb:expr, $mine:ty, $avx2:ty) => {
                (
                    $wb,
                    dot_entry::<$mine> as DotFn,
                    dot_entry::<$avx2> as DotFn,
                    rows_entry::<$mine> as RowsFn,
                    rows_entry::<$avx2> as RowsFn,
                )
            };
        }
        let kernels: [Pair; 7] = [
            pair!(66, Iq2Xxs, iquants::Iq2Xxs),
            pair!(50, Iq1S, lowbit::Iq1S),
            pair!(56, Iq1M, lowbit::Iq1M),
            pair!(54, Tq1_0, lowbit::Tq1_0),
            pair!(74, Iq2Xs, iquants::Iq2Xs),
            pair!(82, Iq2S, iquants::Iq2S),
            pair!(98, Iq3Xxs, iquants::Iq3Xxs),
        ];
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for (wb, mine, avx2, mine_rows, avx2_rows) in kernels {
            let rb = n / 256 * wb;
            let mut w: Vec<u8> = (0..rows * rb).map(|_| next() as u8).collect();
            for block in w.chunks_exact_mut(wb) {
                let d = 0x2000 + (next() % 0x1800) as u16;
                block[..2].copy_from_slice(&d.to_le_bytes());
                if wb == 56 {
                    // IQ1_M's scale: its top bits on top of the four scale words
                    block[55] = (block[55] & 0x0f) | 0x30;
                }
                if wb == 54 {
                    // TQ1_0's scale is at the end
                    block[52..].copy_from_slice(&d.to_le_bytes());
                }
            }
            for r in w.chunks_exact(rb) {
                assert_eq!(
                    mine(n, r, &act).to_bits(),
                    avx2(n, r, &act).to_bits(),
                    "{wb}"
                );
            }
            let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
            mine_rows(n, &w, rb, &act, &mut a);
            avx2_rows(n, &w, rb, &act, &mut b);
            assert_eq!(bits(&a), bits(&b), "{wb}");
        }
    }

    /// Q1_0's kernel gives the AVX2 one's bits, one row and seven at a time.
    #[test]
    fn q1_0_matches_the_avx2_one() {
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
            && available())
        {
            return;
        }
        let (n, rows) = (640, 7);
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let x: Vec<f32> = (0..n)
            .map(|_| (next() % 2001) as f32 / 100.0 - 10.0)
            .collect();
        let mut act = vec![0u8; n / 32 * 34];
        crate::quantize_activation(TensorType::Q8_0, &x, &mut act).unwrap();
        let rb = n / 128 * 18;
        let mut w: Vec<u8> = (0..rows * rb).map(|_| next() as u8).collect();
        for block in w.chunks_exact_mut(18) {
            let d = 0x2000 + (next() % 0x1800) as u16;
            block[..2].copy_from_slice(&d.to_le_bytes());
        }
        for r in w.chunks_exact(rb) {
            let (a, b) = (
                dot_entry::<Q1_0>(n, r, &act),
                dot_entry::<lowbit::Q1_0>(n, r, &act),
            );
            assert_eq!(a.to_bits(), b.to_bits());
        }
        let (mut a, mut b) = (vec![0f32; rows], vec![0f32; rows]);
        rows_entry::<Q1_0>(n, &w, rb, &act, &mut a);
        rows_entry::<lowbit::Q1_0>(n, &w, rb, &act, &mut b);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&a), bits(&b));
    }
}
