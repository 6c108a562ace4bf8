//! AVX2 + FMA + F16C kernels (x86-64), handed out only after run-time detection.
//!
//! Every kernel is one [`Block`] implementation: how one block of weights meets one block of
//! activations, accumulating into an [`Acc`]. Two generic drivers run them: [`dot_entry`] for
//! one row and [`rows_entry`] for several rows, four at a time, with independent accumulators.
//! The drivers check all lengths in safe code; the `unsafe` inside only reads within them.
//!
//! Integer parts are exact (no 16-bit saturation: weight quants are at most 8 bits and
//! activations are in -127..=127, so every `maddubs` pair sum stays below 2^15); the float
//! accumulation is llama.cpp's AVX2 one (8 lanes of 4-product sums, FMA by the block scale,
//! `hsum_float_8`), so every kernel here gives the same bits as the scalar reference and as
//! llama.cpp (tests/ggml_oracle.rs).

use std::arch::x86_64::*;

use crate::common::e8m0_to_f32_half;
use crate::iq::{KVALUES_IQ4NL, KVALUES_MXFP4};
use crate::kernel::{DotFn, MultiFn, RowsFn, Simd};
use crate::TensorType;

/// A [`Block`] whose unpacked form is its own bytes: `apply` reads the block at `x` against the
/// activation block at `y`; `finish` defaults to `hsum(v) + s`. After `avx512`, a kernel of
/// [`Block::AVX512`].
macro_rules! bytes_block {
    (avx512 $($rest:tt)*) => {
        bytes_block!(@with "avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi",
            true, $($rest)*);
    };
    (@with $features:literal, $avx512:expr, $name:ident, $qk:expr, $wb:expr, $ab:expr,
     |$x:ident, $y:ident, $acc:ident| $apply:block $(, finish |$facc:ident| $finish:block)?
     $(, one_row $one_row:literal)? $(, rows_inline $why:literal)?) => {
        pub(crate) struct $name;
        impl Block for $name {
            const QK: usize = $qk;
            const WB: usize = $wb;
            const AB: usize = $ab;
            type W = *const u8;
            const AVX512: bool = $avx512;
            $(const ONE_ROW: bool = $one_row;)?
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn decode(x: *const u8) -> *const u8 {
                x
            }
            #[inline]
            #[target_feature(enable = $features)]
            unsafe fn apply(&$x: &*const u8, $y: *const u8, $acc: &mut Acc) $apply
            $(
                #[inline]
                #[target_feature(enable = "avx2,fma")]
                unsafe fn finish($facc: &Acc) -> f32 $finish
            )?
            $(
                /// The block's body written out for each row, not `apply` called:
                #[doc = $why]
                #[inline]
                #[target_feature(enable = $features)]
                unsafe fn step4(x: *const u8, stride: usize, $y: *const u8, accs: &mut [Acc; 4]) {
                    for (r, $acc) in accs.iter_mut().enumerate() {
                        let $x = x.add(r * stride);
                        $apply
                    }
                }
            )?
        }
    };
    ($($rest:tt)*) => {
        bytes_block!(@with "avx2,fma,f16c", false, $($rest)*);
    };
}

#[path = "avx2_iquants.rs"]
mod iquants;
#[path = "avx2_lattice512.rs"]
mod lattice512;
#[path = "avx2_lowbit.rs"]
mod lowbit;
#[path = "avx2_repack.rs"]
pub(crate) mod repack_b32;
#[path = "avx2_repack_q2k.rs"]
pub(crate) mod repack_q2k;
#[path = "avx2_tiled.rs"]
pub(crate) mod tiled512;

pub(crate) use iquants::{
    tiled_iq2_s, tiled_iq2_xs, tiled_iq2_xxs, tiled_iq3_s, tiled_iq3_xxs, tiled_iq4_xs,
};
pub(crate) use lowbit::{tiled_iq1_m, tiled_iq1_s};
pub(crate) use tiled512::{tiled_q2_k, tiled_q3_k, tiled_q4_k, tiled_q5_k};

/// The kernels of this module for `ty`, if it has one.
pub(crate) fn kernel(ty: TensorType) -> Option<Simd> {
    use TensorType as T;
    fn pair<B: Block>() -> Simd {
        Simd {
            dot: dot_entry::<B>,
            rows: Some(rows_entry::<B> as RowsFn),
            multi: Some(multi_entry::<B> as MultiFn),
        }
    }
    /// As `pair`, with the AVX-512 VNNI batched tile where the CPU has it.
    fn q0<B: Q0Block>() -> Simd {
        let mut simd = pair::<B>();
        if has_avx512_vnni() {
            simd.multi = Some(multi_entry_512::<B> as MultiFn);
        }
        simd
    }
    /// As `pair`, with the AVX-512 VNNI K-quant tile where the CPU has it.
    fn k<B: KBlock>() -> Simd {
        let mut simd = pair::<B>();
        if has_avx512_vnni() {
            simd.multi = Some(multi_entry_k512::<B> as MultiFn);
        }
        simd
    }
    /// One row and several rows here; batches from the caller (llama.cpp's tiled kernel).
    fn lattice<B: Block>() -> Simd {
        Simd {
            dot: dot_entry::<B>,
            rows: Some(rows_entry::<B> as RowsFn),
            multi: None,
        }
    }
    fn float(dot: DotFn) -> Simd {
        Simd {
            dot,
            rows: None,
            multi: None,
        }
    }
    Some(match ty {
        T::F32 => float(dot_f32),
        T::F16 => float(dot_f16),
        T::BF16 => float(dot_bf16),
        T::Q4_0 => q0::<Q4_0>(),
        T::Q4_1 => pair::<Q4_1>(),
        T::Q5_0 => q0::<Q5_0>(),
        T::Q5_1 => pair::<Q5_1>(),
        T::Q8_0 => q0::<Q8_0>(),
        // vec_dot pairs blocks; llamafile_sgemm (batches) does not
        T::IQ4_NL => Simd {
            dot: dot_pairs_entry::<Iq4Nl>,
            rows: None,
            multi: Some(multi_entry::<Iq4Nl> as MultiFn),
        },
        T::MXFP4 => float(dot_pairs_entry::<Mxfp4>),
        T::Q2_K => pair::<Q2K>(),
        T::Q3_K => pair::<Q3K>(),
        T::Q4_K => k::<Q4K>(),
        T::Q5_K => pair::<Q5K>(),
        T::Q6_K => k::<Q6K>(),
        // batches of 8 or more columns take the tiled kernel (kernel::scalar_multi_fn)
        T::IQ2_XXS if lattice512::available() => lattice::<lattice512::Iq2Xxs>(),
        T::IQ2_XXS => lattice::<iquants::Iq2Xxs>(),
        T::IQ2_XS if lattice512::available() => lattice::<lattice512::Iq2Xs>(),
        T::IQ2_XS => lattice::<iquants::Iq2Xs>(),
        T::IQ2_S if lattice512::available() => lattice::<lattice512::Iq2S>(),
        T::IQ2_S => lattice::<iquants::Iq2S>(),
        T::IQ3_XXS if lattice512::available() => lattice::<lattice512::Iq3Xxs>(),
        T::IQ3_XXS => lattice::<iquants::Iq3Xxs>(),
        T::IQ3_S => lattice::<iquants::Iq3S>(),
        T::IQ4_XS => lattice::<iquants::Iq4Xs>(),
        T::IQ1_S if lattice512::available() => lattice::<lattice512::Iq1S>(),
        T::IQ1_S => lattice::<lowbit::Iq1S>(),
        T::IQ1_M if lattice512::available() => lattice::<lattice512::Iq1M>(),
        T::IQ1_M => lattice::<lowbit::Iq1M>(),
        T::TQ1_0 if lattice512::available() => pair::<lattice512::Tq1_0>(),
        T::TQ1_0 => pair::<lowbit::Tq1_0>(),
        T::TQ2_0 => pair::<lowbit::Tq2_0>(),
        T::Q1_0 if lattice512::available() => Simd {
            multi: pair::<lowbit::Q1_0>().multi,
            ..pair::<lattice512::Q1_0>()
        },
        T::Q1_0 => pair::<lowbit::Q1_0>(),
        T::Q2_0 => pair::<lowbit::Q2_0>(),
        T::NVFP4 => pair::<lowbit::Nvfp4>(),
        _ => return None,
    })
}

/// `tiled::block_step` with AVX2: `maddubs` of `|w|` with the signed activations, `madd` by
/// the multipliers of each 16 values, the lanes summed (exact integers, like the scalar sums),
/// then the same fma into each column's accumulator; the block stays in registers across the
/// columns. Handed out only after run-time detection (`kernel::simd_block_step`).
pub(crate) fn tiled_block_step(
    x: &crate::tiled::TiledBlock,
    ys: &[&crate::k_quants::BlockQ8K],
    acc: &mut [f32],
) {
    // SAFETY: avx2 and fma were detected before this function was handed out; every load reads
    // 32 of the 256 bytes of `x.w` or of a column's `qs`.
    unsafe { tiled_block_step_avx2(x, ys, acc) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn tiled_block_step_avx2(
    x: &crate::tiled::TiledBlock,
    ys: &[&crate::k_quants::BlockQ8K],
    acc: &mut [f32],
) {
    let mut w = [_mm256_setzero_si256(); 8];
    let mut aw = [_mm256_setzero_si256(); 8];
    let mut m = [_mm256_setzero_si256(); 8];
    for g in 0..8 {
        w[g] = load(x.w.as_ptr().add(32 * g) as *const u8);
        aw[g] = _mm256_sign_epi8(w[g], w[g]);
        m[g] = halves(x.scale16[2 * g], x.scale16[2 * g + 1]);
    }
    for (y, a) in ys.iter().zip(acc) {
        let mut sum = _mm256_setzero_si256();
        for g in 0..8 {
            let q = load(y.qs.as_ptr().add(32 * g));
            let p16 = _mm256_maddubs_epi16(aw[g], _mm256_sign_epi8(q, w[g]));
            sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p16, m[g]));
        }
        let s = _mm_add_epi32(
            _mm256_castsi256_si128(sum),
            _mm256_extracti128_si256::<1>(sum),
        );
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        crate::tiled::accumulate(x, _mm_cvtsi128_si32(s), y, a);
    }
}

/// `DotKernel::dot` of a repacked Q4_K row with AVX2: `repack::gemv`'s arithmetic. Handed
/// out only after run-time detection (`kernel::build_repacked`); `row` and `act` are exactly
/// the blocks of `n` elements.
pub(crate) fn repack_dot_q4_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let (xs, ys) = (bytemuck::cast_slice(row), bytemuck::cast_slice(act));
    // SAFETY: avx2 and fma were detected before this function was handed out; the loads read
    // within the blocks.
    unsafe { repack_gemv_avx2(xs, ys) }
}

#[target_feature(enable = "avx2,fma")]
unsafe fn repack_gemv_avx2(
    row: &[crate::k_quants::BlockQ4K],
    col: &[crate::k_quants::BlockQ8K],
) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for (x, y) in row.iter().zip(col) {
        let w = <Q4K as Block>::decode((x as *const crate::k_quants::BlockQ4K).cast());
        let (s, m) = w.block_sums(y);
        acc = (s as f32).mul_add(w.d * y.d(), acc);
        acc_min = (m as f32).mul_add(w.dmin * y.d(), acc_min);
    }
    acc - acc_min
}

/// `DotKernel::dot_rows` of repacked Q4_K rows: `repack::gemv`'s arithmetic, eight rows at a
/// time by AVX512-VNNI where the CPU has it, four at a time by AVX2 (the column's quants loaded
/// once per block for the group, their sums reduced together). Handed out only after run-time
/// detection of AVX2 and FMA (`kernel::build_repacked`).
pub(crate) fn repack_rows_q4_k(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    act: &[u8],
    out: &mut [f32],
) {
    repack_rows_with(has_avx512_vnni(), n, rows, row_stride, act, out)
}

/// [`repack_rows_q4_k`], eight rows at a time by AVX512-VNNI when `vnni` (which the CPU must
/// have), the rest (or all, without it) by AVX2.
fn repack_rows_with(
    vnni: bool,
    n: usize,
    rows: &[u8],
    row_stride: usize,
    act: &[u8],
    out: &mut [f32],
) {
    use crate::k_quants::{BlockQ4K, BlockQ8K, QK_K};
    let nb = n / QK_K;
    let rb = nb * std::mem::size_of::<BlockQ4K>();
    assert!(act.len() >= nb * std::mem::size_of::<BlockQ8K>());
    assert!(out.is_empty() || rows.len() >= (out.len() - 1) * row_stride + rb);
    assert!(!vnni || has_avx512_vnni());
    let col: &[BlockQ8K] = bytemuck::cast_slice(&act[..nb * std::mem::size_of::<BlockQ8K>()]);
    let row = |i: usize| -> &[BlockQ4K] {
        bytemuck::cast_slice(&rows[i * row_stride..i * row_stride + rb])
    };
    let mut done = 0;
    if vnni {
        let octets = out.len() / 8;
        for g in 0..octets {
            // SAFETY: the AVX512 features were detected (asserted above), avx2, fma and f16c
            // before this function was handed out; the loads read within rows 8g..8g + 8's
            // blocks (the length check above) and the column's.
            let sums = unsafe {
                repack_gemv8_vnni(rows.as_ptr().add(8 * g * row_stride), row_stride, col)
            };
            out[8 * g..8 * g + 8].copy_from_slice(&sums);
        }
        done = 8 * octets;
    }
    let quads = (out.len() - done) / 4;
    for g in 0..quads {
        let i = done + 4 * g;
        let four = [row(i), row(i + 1), row(i + 2), row(i + 3)];
        // SAFETY: avx2 and fma were detected before this function was handed out; the loads
        // read within the four rows' blocks and the column's.
        let sums = unsafe { repack_gemv4_avx2(four, col) };
        out[i..i + 4].copy_from_slice(&sums);
    }
    for (i, o) in out.iter_mut().enumerate().skip(done + 4 * quads) {
        // SAFETY: as above.
        *o = unsafe { repack_gemv_avx2(row(i), col) };
    }
}

/// Eight consecutive rows (`rows`, `row_stride` bytes apart, each `col.len()` Q4_K blocks)
/// against one column, `repack::gemv`'s arithmetic: per block each row's exact `S` (pairs of
/// sub-blocks side by side in 512 bits: `vpmaddubsw`, then the scales by `vpdpwssd`) and `M`,
/// reduced into lane r of two vectors, then one fma per accumulator, lane r row r's chain in
/// block order.
///
/// # Safety
/// The CPU must have AVX2, FMA, F16C, AVX512 F/BW/VL/VNNI; the eight rows' blocks must be
/// readable.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn repack_gemv8_vnni(
    rows: *const u8,
    row_stride: usize,
    col: &[crate::k_quants::BlockQ8K],
) -> [f32; 8] {
    let nibble = _mm512_set1_epi8(0x0f);
    // vpshufb controls over the eight scale bytes (in every 128-bit lane): i16 lanes of the
    // low 256 bits take scale a, of the high 256 bits scale b
    let ctrl = |a: i8, b: i8| {
        let (a, b) = (a as u8 as i32 | 0x8000, b as u8 as i32 | 0x8000);
        let (a, b) = ((a | a << 16), (b | b << 16));
        _mm512_setr_epi32(a, a, a, a, a, a, a, a, b, b, b, b, b, b, b, b)
    };
    // k = 2h + odd: the 64 bytes h of the quants, low (odd = 0) or high nibbles, hold
    // sub-blocks (4h + odd | 4h + 2 + odd)
    let ctl = [ctrl(0, 2), ctrl(1, 3), ctrl(4, 6), ctrl(5, 7)];
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
    let (mut acc, mut acc_min) = (_mm256_setzero_ps(), _mm256_setzero_ps());
    for (b, y) in col.iter().enumerate() {
        let q = y.qs.as_ptr();
        let ys: [__m512i; 4] = std::array::from_fn(|k| {
            let (h, odd) = (k / 2, k % 2);
            let a = load(q.add(128 * h + 32 * odd));
            let c = load(q.add(128 * h + 64 + 32 * odd));
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), c)
        });
        let bsums = y.bsums.as_ptr();
        let bsum32 = _mm_hadd_epi16(
            _mm_loadu_si128(bsums as *const __m128i),
            _mm_loadu_si128(bsums.add(16) as *const __m128i),
        );
        let mut sv = [_mm512_setzero_si512(); 8];
        let mut mv = [_mm_setzero_si128(); 8];
        let mut dm = [0i32; 8];
        for r in 0..8 {
            let x = rows.add(r * row_stride + 144 * b);
            // the row's block four ahead (its three cache lines): eight streams at once are
            // more than the hardware prefetchers keep ahead of (about 3% here)
            if b + 4 < col.len() {
                let f = x.add(4 * 144) as *const i8;
                _mm_prefetch::<_MM_HINT_T0>(f);
                _mm_prefetch::<_MM_HINT_T0>(f.add(64));
                _mm_prefetch::<_MM_HINT_T0>(f.add(128));
            }
            let (sc, mn) = k4_scale_min_bytes(x.add(4));
            let scb = _mm512_broadcast_i32x4(_mm_cvtsi64_si128(i64::from_le_bytes(sc)));
            let mut s = _mm512_setzero_si512();
            for h in 0..2 {
                let raw = _mm512_loadu_si512(x.add(16 + 64 * h) as *const _);
                let lo = _mm512_and_si512(raw, nibble);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(raw), nibble);
                let plo = _mm512_maddubs_epi16(lo, ys[2 * h]);
                let phi = _mm512_maddubs_epi16(hi, ys[2 * h + 1]);
                s = _mm512_dpwssd_epi32(s, plo, _mm512_shuffle_epi8(scb, ctl[2 * h]));
                s = _mm512_dpwssd_epi32(s, phi, _mm512_shuffle_epi8(scb, ctl[2 * h + 1]));
            }
            sv[r] = s;
            let mins = _mm_cvtepu8_epi16(_mm_cvtsi64_si128(i64::from_le_bytes(mn)));
            mv[r] = _mm_madd_epi16(mins, bsum32);
            dm[r] = (x as *const i32).read_unaligned();
        }
        // S: eight rows' 16 lanes to lane r of one vector, halving twice by 128-bit lanes
        let t: [__m512i; 4] = std::array::from_fn(|i| {
            let (a, c) = (sv[2 * i], sv[2 * i + 1]);
            _mm512_add_epi32(
                _mm512_shuffle_i64x2::<0x44>(a, c),
                _mm512_shuffle_i64x2::<0xee>(a, c),
            )
        });
        // 128-bit lane k of u[j]: row 4j + k's four partial sums
        let u: [__m512i; 2] = std::array::from_fn(|j| {
            let (a, c) = (t[2 * j], t[2 * j + 1]);
            _mm512_add_epi32(
                _mm512_shuffle_i64x2::<0x88>(a, c),
                _mm512_shuffle_i64x2::<0xdd>(a, c),
            )
        });
        let c = _mm512_add_epi32(
            _mm512_unpacklo_epi32(u[0], u[1]),
            _mm512_unpackhi_epi32(u[0], u[1]),
        );
        // lane k: (row k, row 4 + k) in its first two i32
        let e = _mm512_add_epi32(c, _mm512_shuffle_epi32::<0b01_00_11_10>(c));
        let s8 = _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, e));
        let m_lo = _mm_hadd_epi32(_mm_hadd_epi32(mv[0], mv[1]), _mm_hadd_epi32(mv[2], mv[3]));
        let m_hi = _mm_hadd_epi32(_mm_hadd_epi32(mv[4], mv[5]), _mm_hadd_epi32(mv[6], mv[7]));
        let m8 = _mm256_set_m128i(m_hi, m_lo);
        let dm = _mm256_loadu_si256(dm.as_ptr() as *const __m256i);
        let d = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(dm));
        let dmin = _mm256_cvtph_ps(_mm256_cvtepi32_epi16(_mm256_srli_epi32::<16>(dm)));
        let yd = _mm256_set1_ps(y.d());
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s8), _mm256_mul_ps(d, yd), acc);
        acc_min = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m8), _mm256_mul_ps(dmin, yd), acc_min);
    }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), _mm256_sub_ps(acc, acc_min));
    out
}

#[target_feature(enable = "avx2,fma")]
unsafe fn repack_gemv4_avx2(
    rows: [&[crate::k_quants::BlockQ4K]; 4],
    col: &[crate::k_quants::BlockQ8K],
) -> [f32; 4] {
    // lane r: row r's accumulators, each its own chain of fmas in block order
    let (mut acc, mut acc_min) = (_mm_setzero_ps(), _mm_setzero_ps());
    let nibble = _mm256_set1_epi8(0x0f);
    for (b, y) in col.iter().enumerate() {
        let q = y.qs.as_ptr();
        let ys: [__m256i; 8] = std::array::from_fn(|j| load(q.add(32 * j)));
        let bsums = y.bsums.as_ptr();
        let bsum32 = _mm_hadd_epi16(
            _mm_loadu_si128(bsums as *const __m128i),
            _mm_loadu_si128(bsums.add(16) as *const __m128i),
        );
        let mut v = [_mm256_setzero_si256(); 4];
        let mut m = [_mm_setzero_si128(); 4];
        let (mut d, mut dmin) = ([0f32; 4], [0f32; 4]);
        for r in 0..4 {
            let x = &rows[r][b];
            let (sc, mn) = k4_scale_min_bytes(x.scales.as_ptr());
            // the eight scales as i16 in both halves; sub-block j's broadcast by a shuffle
            let sc16 = _mm_cvtepu8_epi16(_mm_loadl_epi64(sc.as_ptr() as *const __m128i));
            let sc16 = _mm256_set_m128i(sc16, sc16);
            let scale = |j: i8| {
                _mm256_shuffle_epi8(
                    sc16,
                    _mm256_set1_epi16(i16::from_le_bytes([(2 * j) as u8, (2 * j + 1) as u8])),
                )
            };
            let mut s = _mm256_setzero_si256();
            for c in 0..4 {
                let raw = load(x.qs.as_ptr().add(32 * c));
                let lo = _mm256_and_si256(raw, nibble);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(raw), nibble);
                let plo = _mm256_maddubs_epi16(lo, ys[2 * c]);
                let phi = _mm256_maddubs_epi16(hi, ys[2 * c + 1]);
                s = _mm256_add_epi32(s, _mm256_madd_epi16(plo, scale(2 * c as i8)));
                s = _mm256_add_epi32(s, _mm256_madd_epi16(phi, scale(2 * c as i8 + 1)));
            }
            v[r] = s;
            let mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(mn.as_ptr() as *const __m128i));
            m[r] = _mm_madd_epi16(mins, bsum32);
            (d[r], dmin[r]) = f16_pair((x as *const crate::k_quants::BlockQ4K).cast());
        }
        // lane r of each: row r's exact S and M
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        let hm = _mm_hadd_epi32(_mm_hadd_epi32(m[0], m[1]), _mm_hadd_epi32(m[2], m[3]));
        let yd = _mm_set1_ps(y.d());
        let dd = _mm_mul_ps(_mm_loadu_ps(d.as_ptr()), yd);
        let dm = _mm_mul_ps(_mm_loadu_ps(dmin.as_ptr()), yd);
        acc = _mm_fmadd_ps(_mm_cvtepi32_ps(h), dd, acc);
        acc_min = _mm_fmadd_ps(_mm_cvtepi32_ps(hm), dm, acc_min);
    }
    let mut out = [0f32; 4];
    _mm_storeu_ps(out.as_mut_ptr(), _mm_sub_ps(acc, acc_min));
    out
}

/// The repacked products' exact sums of one Q4_K block (decoded as for `vec_dot`: `K4`, its
/// sub-block `j`'s nibbles in `q[j]`) against one column.
impl K4 {
    /// Per 64-element pair `p` (sub-blocks `2p`, `2p + 1`): `S_p` (scales times quants times the
    /// activation) in lane `p` of the first vector, `M_p` (minimums times the activation's sums
    /// of 32, which fit in i16) in lane `p` of the second.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pair_sums(&self, y: &crate::k_quants::BlockQ8K) -> (__m128i, __m128i) {
        let q = y.qs.as_ptr();
        let pair: [__m256i; 4] = std::array::from_fn(|p| {
            let pa = _mm256_maddubs_epi16(self.q[2 * p], load(q.add(64 * p)));
            let pb = _mm256_maddubs_epi16(self.q[2 * p + 1], load(q.add(64 * p + 32)));
            _mm256_add_epi32(
                _mm256_madd_epi16(pa, self.scv[2 * p]),
                _mm256_madd_epi16(pb, self.scv[2 * p + 1]),
            )
        });
        // after two hadds, lane p of the two halves' sum is pair p's
        let h = _mm256_hadd_epi32(
            _mm256_hadd_epi32(pair[0], pair[1]),
            _mm256_hadd_epi32(pair[2], pair[3]),
        );
        let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
        (h, self.min_sums(y))
    }

    /// `M_p` per pair, as in [`K4::pair_sums`].
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn min_sums(&self, y: &crate::k_quants::BlockQ8K) -> __m128i {
        let bsums = y.bsums.as_ptr();
        let bsum32 = _mm_hadd_epi16(
            _mm_loadu_si128(bsums as *const __m128i),
            _mm_loadu_si128(bsums.add(16) as *const __m128i),
        );
        _mm_madd_epi16(self.mins, bsum32)
    }

    /// Eight lanes whose sum is the whole block's `S`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scaled_lanes(&self, y: &crate::k_quants::BlockQ8K) -> __m256i {
        let q = y.qs.as_ptr();
        let mut s = _mm256_setzero_si256();
        for j in 0..8 {
            let p16 = _mm256_maddubs_epi16(self.q[j], load(q.add(32 * j)));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p16, self.scv[j]));
        }
        s
    }

    /// The whole block's `S` and `M` (the sums of [`K4::pair_sums`], in fewer reductions).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn block_sums(&self, y: &crate::k_quants::BlockQ8K) -> (i32, i32) {
        let s = self.scaled_lanes(y);
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        // lanes 0 and 1 after two hadds: the sums of s's and of the minimums' four lanes
        let h = _mm_hadd_epi32(s, self.min_sums(y));
        let h = _mm_hadd_epi32(h, h);
        (_mm_cvtsi128_si32(h), _mm_extract_epi32::<1>(h))
    }
}

/// `repack::multi_q4_k` with AVX2, the same arithmetic: each block of a row decoded once and
/// met by every column. Handed out only after run-time detection (`kernel::build_repacked`);
/// lengths as `DotKernel::dot_rows_multi` checked them.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
pub(crate) fn repack_multi_q4_k(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    if has_avx512_vnni() {
        return tiled512::repack_multi_q4_k(
            n, rows, row_stride, n_rows, acts, act_stride, n_cols, out,
        );
    }
    repack_multi_with(
        false, n, rows, row_stride, n_rows, acts, act_stride, n_cols, out,
    )
}

/// [`repack_multi_q4_k`], its pair sums by AVX512-VNNI (`vnni`, which the CPU must have) or
/// AVX2.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
fn repack_multi_with(
    vnni: bool,
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    use crate::k_quants::{BlockQ4K, BlockQ8K, QK_K};
    let nb = n / QK_K;
    let (rb, ab) = (
        nb * std::mem::size_of::<BlockQ4K>(),
        nb * std::mem::size_of::<BlockQ8K>(),
    );
    assert!(n_rows == 0 || rows.len() >= (n_rows - 1) * row_stride + rb);
    assert!(n_cols == 0 || acts.len() >= (n_cols - 1) * act_stride + ab);
    assert!(out.len() >= n_rows * n_cols);
    let cols: Vec<&[BlockQ8K]> = (0..n_cols)
        .map(|c| bytemuck::cast_slice(&acts[c * act_stride..c * act_stride + ab]))
        .collect();
    let gemm_cols = n_cols - n_cols % 4;
    let (mut acc, mut acc_min) = (vec![0f32; n_cols], vec![0f32; n_cols]);
    assert!(!vnni || has_avx512_vnni());
    for i in 0..n_rows {
        let row: &[BlockQ4K] = bytemuck::cast_slice(&rows[i * row_stride..i * row_stride + rb]);
        acc.fill(0.0);
        acc_min.fill(0.0);
        if vnni {
            // SAFETY: the AVX512 features were detected above; the loads as below.
            unsafe { repack_row_vnni(row, &cols, gemm_cols, &mut acc, &mut acc_min) };
        } else {
            // SAFETY: avx2 and fma were detected before this function was handed out; the
            // loads read within the row's blocks, the columns' blocks and the accumulators.
            unsafe { repack_row_avx2(row, &cols, gemm_cols, &mut acc, &mut acc_min) };
        }
        for c in 0..n_cols {
            out[c * n_rows + i] = acc[c] - acc_min[c];
        }
    }
}

/// One row of [`repack_multi_q4_k`] into each column's `acc` and `acc_min`: gemm columns eight
/// at a time in vectors (each lane its own column's chain of fmas, in the same order), the
/// rest one by one.
#[target_feature(enable = "avx2,fma")]
unsafe fn repack_row_avx2(
    row: &[crate::k_quants::BlockQ4K],
    cols: &[&[crate::k_quants::BlockQ8K]],
    gemm_cols: usize,
    acc: &mut [f32],
    acc_min: &mut [f32],
) {
    for (b, x) in row.iter().enumerate() {
        let block = <Q4K as Block>::decode((x as *const crate::k_quants::BlockQ4K).cast());
        let sums = |y: &crate::k_quants::BlockQ8K| block.pair_sums(y);
        repack_block_fmas(&block, cols, b, gemm_cols, acc, acc_min, sums);
    }
}

/// [`repack_row_avx2`] with the pair sums by AVX512-VNNI (`vpdpbusd` over each 64-element
/// pair, then the scales by `vpmulld`): the same exact integers, the same fmas.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn repack_row_vnni(
    row: &[crate::k_quants::BlockQ4K],
    cols: &[&[crate::k_quants::BlockQ8K]],
    gemm_cols: usize,
    acc: &mut [f32],
    acc_min: &mut [f32],
) {
    let nibble = _mm512_set1_epi8(0x0f);
    for (b, x) in row.iter().enumerate() {
        let block = <Q4K as Block>::decode((x as *const crate::k_quants::BlockQ4K).cast());
        // pair p: sub-block 2p's nibbles then 2p + 1's, and their scales as i32 lanes
        let (sc, _) = k4_scale_min_bytes(x.scales.as_ptr());
        let w: [__m512i; 4] = std::array::from_fn(|p| {
            let raw = _mm256_loadu_si256(x.qs.as_ptr().add(32 * p) as *const __m256i);
            let raw = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(raw), raw);
            let hi = _mm512_srli_epi16::<4>(raw);
            _mm512_and_si512(_mm512_mask_blend_epi64(0xf0, raw, hi), nibble)
        });
        let scale: [__m512i; 4] = std::array::from_fn(|p| {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_set1_epi32(sc[2 * p] as i32)),
                _mm256_set1_epi32(sc[2 * p + 1] as i32),
            )
        });
        let sums = |y: &crate::k_quants::BlockQ8K| -> (__m128i, __m128i) {
            let q = y.qs.as_ptr();
            let pair: [__m256i; 4] = std::array::from_fn(|p| {
                let y64 = _mm512_loadu_si512(q.add(64 * p) as *const _);
                let v = _mm512_mullo_epi32(
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[p], y64),
                    scale[p],
                );
                _mm256_add_epi32(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64::<1>(v))
            });
            let h = _mm256_hadd_epi32(
                _mm256_hadd_epi32(pair[0], pair[1]),
                _mm256_hadd_epi32(pair[2], pair[3]),
            );
            let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h));
            (h, block.min_sums(y))
        };
        repack_block_fmas(&block, cols, b, gemm_cols, acc, acc_min, sums);
    }
}

/// The fmas of one block of a row into every column's accumulators, given its pair sums:
/// gemm columns eight at a time in vectors (each lane its own column's chain, in order), the
/// rest one by one.
#[inline(always)]
#[allow(clippy::too_many_arguments)] // a block, the columns and their accumulators
unsafe fn repack_block_fmas(
    block: &K4,
    cols: &[&[crate::k_quants::BlockQ8K]],
    b: usize,
    gemm_cols: usize,
    acc: &mut [f32],
    acc_min: &mut [f32],
    sums: impl Fn(&crate::k_quants::BlockQ8K) -> (__m128i, __m128i),
) {
    let wide = gemm_cols - gemm_cols % 8;
    let (d, dmin) = (block.d, block.dmin);
    for c0 in (0..wide).step_by(8) {
        let mut s = [_mm_setzero_si128(); 8];
        let mut m = [_mm_setzero_si128(); 8];
        let mut yd = [0f32; 8];
        for j in 0..8 {
            let y = &cols[c0 + j][b];
            (s[j], m[j]) = sums(y);
            yd[j] = y.d();
        }
        let yd = _mm256_loadu_ps(yd.as_ptr());
        let (dd, dm) = (
            _mm256_mul_ps(_mm256_set1_ps(d), yd),
            _mm256_mul_ps(_mm256_set1_ps(dmin), yd),
        );
        let (s, m) = (pairs_by_column(&s), pairs_by_column(&m));
        let mut a = _mm256_loadu_ps(acc.as_ptr().add(c0));
        let mut am = _mm256_loadu_ps(acc_min.as_ptr().add(c0));
        for p in 0..4 {
            a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[p]), dd, a);
            am = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m[p]), dm, am);
        }
        _mm256_storeu_ps(acc.as_mut_ptr().add(c0), a);
        _mm256_storeu_ps(acc_min.as_mut_ptr().add(c0), am);
    }
    for c in wide..cols.len() {
        let y = &cols[c][b];
        let (sv, mv) = sums(y);
        let (mut s, mut m) = ([0i32; 4], [0i32; 4]);
        _mm_storeu_si128(s.as_mut_ptr() as *mut __m128i, sv);
        _mm_storeu_si128(m.as_mut_ptr() as *mut __m128i, mv);
        let (dd, dm) = (d * y.d(), dmin * y.d());
        let (a, am) = (&mut acc[c], &mut acc_min[c]);
        if c < gemm_cols {
            for p in 0..4 {
                *a = (s[p] as f32).mul_add(dd, *a);
                *am = (m[p] as f32).mul_add(dm, *am);
            }
        } else {
            *a = (s.iter().sum::<i32>() as f32).mul_add(dd, *a);
            *am = (m.iter().sum::<i32>() as f32).mul_add(dm, *am);
        }
    }
}

/// Eight columns' four pair sums (`v[j]` lane `p`: column `j`, pair `p`) as four vectors of
/// eight columns (`out[p]` lane `j`).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pairs_by_column(v: &[__m128i; 8]) -> [__m256i; 4] {
    // columns j and j + 4 side by side, then a 4 x 4 transpose in each 128-bit half
    let r: [__m256i; 4] = std::array::from_fn(|j| _mm256_set_m128i(v[j + 4], v[j]));
    let t0 = _mm256_unpacklo_epi32(r[0], r[1]);
    let t1 = _mm256_unpackhi_epi32(r[0], r[1]);
    let t2 = _mm256_unpacklo_epi32(r[2], r[3]);
    let t3 = _mm256_unpackhi_epi32(r[2], r[3]);
    [
        _mm256_unpacklo_epi64(t0, t2),
        _mm256_unpackhi_epi64(t0, t2),
        _mm256_unpacklo_epi64(t1, t3),
        _mm256_unpackhi_epi64(t1, t3),
    ]
}

/// llama.cpp's x86 activation quantizers (Q8_0 with `127 / amax` and round half to even;
/// Q8_K) compiled for AVX2, so that their element loops vectorize 8 wide: the same scalar
/// code and arithmetic, so the same bytes. `ty` must be Q8_0 or Q8_K, `dst` exactly the
/// blocks of `src`.
///
/// # Safety
/// AVX2, FMA and F16C are available.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn quantize_activation(ty: TensorType, src: &[f32], dst: &mut [u8]) {
    match ty {
        TensorType::Q8_0 => {
            crate::legacy::quantize_q8_0_with(src, dst, crate::legacy::Rounding::X86)
        }
        TensorType::Q8_K => crate::k_quants::quantize_q8_k(src, dst),
        _ => unreachable!("only the Q8 activation types"),
    }
}

/// A running sum: a vector part (summed horizontally at the end) and a scalar part.
#[derive(Clone, Copy)]
struct Acc {
    v: __m256,
    s: f32,
    /// Q4_K's four-lane accumulator of minimum corrections (`acc_m` in llama.cpp).
    m: __m128,
    /// A second 8-lane accumulator (IQ1_M's delta part, `accum2` in llama.cpp).
    v2: __m256,
}

/// One block format's inner step.
trait Block {
    /// Elements per block.
    const QK: usize;
    /// Bytes per weight block.
    const WB: usize;
    /// Bytes per activation block.
    const AB: usize;
    /// The weight block unpacked, shared by all activation columns it meets.
    type W: Copy;
    /// Whether the kernel needs AVX-512 (BMI2, F, BW, VL, VNNI, VBMI), detected before it is
    /// handed out: the block loops then have those features too.
    const AVX512: bool = false;
    /// Whether several rows go one at a time, not four side by side (a kernel that needs
    /// all the registers: four rows' accumulators and steps interleaved spill).
    const ONE_ROW: bool = false;
    /// Unpacks the weight block at `x`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; `x` has `WB` readable bytes.
    unsafe fn decode(x: *const u8) -> Self::W;
    /// Adds the dot of an unpacked weight block with the activation block at `y` to `acc`.
    ///
    /// # Safety
    /// As for `decode`, and `y` has `AB` readable bytes.
    unsafe fn apply(w: &Self::W, y: *const u8, acc: &mut Acc);
    /// `apply(decode(x))`: one weight block against one activation block.
    ///
    /// # Safety
    /// As for `apply`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        Self::apply(&Self::decode(x), y, acc)
    }
    /// `step` of the blocks of four rows `stride` bytes apart at `x`, into `acc[r]`.
    ///
    /// # Safety
    /// As for `step`, for each of the four rows.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn step4(x: *const u8, stride: usize, y: *const u8, acc: &mut [Acc; 4]) {
        Self::step(x, y, &mut acc[0]);
        Self::step(x.add(stride), y, &mut acc[1]);
        Self::step(x.add(2 * stride), y, &mut acc[2]);
        Self::step(x.add(3 * stride), y, &mut acc[3]);
    }
    /// The dot from a finished accumulator: `hsum_float_8(v) + s`.
    ///
    /// # Safety
    /// AVX2 is available.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn finish(acc: &Acc) -> f32 {
        hsum_f32(acc.v) + acc.s
    }
}

/// One row: checks lengths, then runs the block loop.
fn dot_entry<B: Block>(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = n / B::QK;
    assert!(n.is_multiple_of(B::QK) && row.len() >= nb * B::WB && act.len() >= nb * B::AB);
    // SAFETY: `kernel` hands these functions out only after `is_x86_feature_detected!` found
    // avx2, fma and f16c; the loop reads `nb` blocks, which the assert above keeps in bounds.
    unsafe {
        if B::AVX512 {
            dot_blocks_512::<B>(nb, row.as_ptr(), act.as_ptr())
        } else {
            dot_blocks::<B>(nb, row.as_ptr(), act.as_ptr())
        }
    }
}

/// Several rows `row_stride` bytes apart: checks lengths, then four rows per pass.
fn rows_entry<B: Block>(n: usize, rows: &[u8], row_stride: usize, act: &[u8], out: &mut [f32]) {
    let nb = n / B::QK;
    assert!(n.is_multiple_of(B::QK) && act.len() >= nb * B::AB && row_stride >= nb * B::WB);
    if out.is_empty() {
        return;
    }
    assert!(rows.len() >= (out.len() - 1) * row_stride + nb * B::WB);
    // SAFETY: as in `dot_entry`; row `i` starts at `i * row_stride` and the assert above keeps
    // its `nb` blocks inside `rows` for every `i < out.len()`.
    unsafe {
        if B::AVX512 {
            rows_blocks_512::<B>(nb, rows.as_ptr(), row_stride, act.as_ptr(), out)
        } else {
            rows_blocks::<B>(nb, rows.as_ptr(), row_stride, act.as_ptr(), out)
        }
    }
}

/// Blocks per row of a batched product, after checking that `n_rows` strided rows,
/// `n_cols` strided columns and the outputs lie inside their slices (what the tiles'
/// pointer arithmetic relies on); `None` when there is nothing to do.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
fn tile_blocks<B: Block>(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &[f32],
) -> Option<usize> {
    let nb = n / B::QK;
    assert!(n.is_multiple_of(B::QK) && row_stride >= nb * B::WB && act_stride >= nb * B::AB);
    if n_rows == 0 || n_cols == 0 {
        return None;
    }
    assert!(rows.len() >= (n_rows - 1) * row_stride + nb * B::WB);
    assert!(acts.len() >= (n_cols - 1) * act_stride + nb * B::AB);
    assert!(out.len() >= n_rows * n_cols);
    Some(nb)
}

/// Several activation columns: `out[c * n_rows + i] = dot(row i, column c)`. Each weight
/// block is unpacked once for four columns.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
fn multi_entry<B: Block>(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    let Some(nb) = tile_blocks::<B>(n, rows, row_stride, n_rows, acts, act_stride, n_cols, out)
    else {
        return;
    };
    // SAFETY: as in `dot_entry`; row `i < n_rows` and column `c < n_cols` stay inside their
    // slices by `tile_blocks`' asserts, and every output index is below `n_rows * n_cols`.
    unsafe {
        let multi = if B::AVX512 {
            multi_blocks_512_lanes::<B>
        } else {
            multi_blocks::<B>
        };
        multi(
            nb,
            rows.as_ptr(),
            row_stride,
            n_rows,
            acts.as_ptr(),
            act_stride,
            n_cols,
            out,
        )
    }
}

/// The batched tile: weight rows x activation columns (see `multi_blocks`).
const TILE_R: usize = 2;
const TILE_C: usize = 8;

/// The batched tile's loops (`multi_blocks`), for the kernels of AVX2 and (`_512`) those of
/// AVX-512 ([`Block::AVX512`]), as [`block_loops`].
macro_rules! multi_loops {
    ($multi:ident, $dot:ident, $features:literal) => {
        // The tile's accumulators are indexed by row and column, which the loops name.
        #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
        #[target_feature(enable = $features)]
        unsafe fn $multi<B: Block>(
            nb: usize,
            x: *const u8,
            row_stride: usize,
            n_rows: usize,
            y: *const u8,
            act_stride: usize,
            n_cols: usize,
            out: &mut [f32],
        ) {
            const C: usize = 4;
            let zero = Acc {
                v: _mm256_setzero_ps(),
                s: 0.0,
                m: _mm_setzero_ps(),
                v2: _mm256_setzero_ps(),
            };
            // R rows x C columns at a time: each activation block is loaded once for the R
            // rows, each weight block decoded once for the C columns. Every output keeps its own
            // accumulator, fed block by block in order, so the tile shape does not change a
            // single bit.
            const R: usize = TILE_R;
            const CT: usize = TILE_C;
            let mut i0 = 0;
            while i0 + R <= n_rows {
                let xr: [*const u8; R] = std::array::from_fn(|r| x.add((i0 + r) * row_stride));
                let mut c0 = 0;
                while c0 + CT <= n_cols {
                    let mut acc = [[zero; CT]; R];
                    for b in 0..nb {
                        let w: [B::W; R] = std::array::from_fn(|r| B::decode(xr[r].add(b * B::WB)));
                        for k in 0..CT {
                            let yk = y.add((c0 + k) * act_stride + b * B::AB);
                            for r in 0..R {
                                B::apply(&w[r], yk, &mut acc[r][k]);
                            }
                        }
                    }
                    for k in 0..CT {
                        for r in 0..R {
                            out[(c0 + k) * n_rows + i0 + r] = B::finish(&acc[r][k]);
                        }
                    }
                    c0 += CT;
                }
                for c in c0..n_cols {
                    for r in 0..R {
                        out[c * n_rows + i0 + r] = $dot::<B>(nb, xr[r], y.add(c * act_stride));
                    }
                }
                i0 += R;
            }
            for i in i0..n_rows {
                let xr = x.add(i * row_stride);
                let mut c0 = 0;
                while c0 + C <= n_cols {
                    let mut acc = [zero; C];
                    for b in 0..nb {
                        let w = B::decode(xr.add(b * B::WB));
                        for (k, acc) in acc.iter_mut().enumerate() {
                            B::apply(&w, y.add((c0 + k) * act_stride + b * B::AB), acc);
                        }
                    }
                    for (k, acc) in acc.iter().enumerate() {
                        out[(c0 + k) * n_rows + i] = B::finish(acc);
                    }
                    c0 += C;
                }
                for c in c0..n_cols {
                    out[c * n_rows + i] = $dot::<B>(nb, xr, y.add(c * act_stride));
                }
            }
        }
    };
}

multi_loops!(multi_blocks, dot_blocks, "avx2,fma,f16c");
multi_loops!(
    multi_blocks_512_lanes,
    dot_blocks_512,
    "avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi"
);

/// Whether the AVX-512 parts that `multi_blocks_512` uses are available.
pub(crate) fn has_avx512_vnni() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && std::arch::is_x86_feature_detected!("avx512vnni")
}

/// Blocks of signed quants with one scale, met by Q8_0 activations (scale f16 at byte 0,
/// quants at byte 2): Q4_0, Q5_0, Q8_0.
trait Q0Block: Block<W = (__m256i, __m256i, f32)> {
    /// What `decode_u` adds to every quant.
    const OFFSET: u8;
    /// The block's quants plus `OFFSET`, as unsigned bytes, and its scale `d`.
    ///
    /// # Safety
    /// As for `Block::decode`.
    unsafe fn decode_u(x: *const u8) -> (__m256i, f32);
}
impl Q0Block for Q4_0 {
    const OFFSET: u8 = 8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode_u(x: *const u8) -> (__m256i, f32) {
        (nibbles_16(x.add(2)), f16_at(x))
    }
}
impl Q0Block for Q5_0 {
    const OFFSET: u8 = 16;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode_u(x: *const u8) -> (__m256i, f32) {
        (q5_bytes(x.add(2), x.add(6)), f16_at(x))
    }
}
impl Q0Block for Q8_0 {
    const OFFSET: u8 = 128;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode_u(x: *const u8) -> (__m256i, f32) {
        // q + 128 as u8 is q with its top bit flipped
        let q = _mm256_xor_si256(load(x.add(2)), _mm256_set1_epi8(-128));
        (q, f16_at(x))
    }
}

/// `multi_entry` with the AVX-512 VNNI tile (see `multi_blocks_512`).
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
fn multi_entry_512<B: Q0Block>(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    let Some(nb) = tile_blocks::<B>(n, rows, row_stride, n_rows, acts, act_stride, n_cols, out)
    else {
        return;
    };
    // SAFETY: `kernel` hands this function out only after `is_x86_feature_detected!` found
    // avx2, fma, f16c and (`has_avx512_vnni`) avx512f/bw/vl/vnni; row `i < n_rows` and column
    // `c < n_cols` stay inside their slices by `tile_blocks`' asserts, and every output index
    // is below `n_rows * n_cols`.
    unsafe {
        multi_blocks_512::<B>(
            nb,
            rows.as_ptr(),
            row_stride,
            n_rows,
            acts.as_ptr(),
            act_stride,
            n_cols,
            out,
        )
    }
}

/// `multi_blocks` for `Q0Block`s, two columns per 512-bit register: lanes 0..8 hold one
/// column's accumulator and lanes 8..16 the next one's, each exactly the AVX2 `Acc::v` of that
/// output. The integer block sums come from `vpdpbusd` ((q + OFFSET) times y, four bytes per
/// i32 lane, as `maddubs` + `madd` group them, less OFFSET times the sum of those y; exact, no
/// saturation or overflow either way), the scale is
/// the same f32 product `d * dy`, and the FMA, the conversion and the final `hsum_float_8`
/// are lane for lane the AVX2 ones, so every output keeps its bits. What depends on the
/// columns alone (each pair's quants side by side, scales, offset corrections) is prepared
/// once per call, and each group of 4 rows is decoded once for all the column tiles.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn multi_blocks_512<B: Q0Block>(
    nb: usize,
    x: *const u8,
    row_stride: usize,
    n_rows: usize,
    y: *const u8,
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    const R: usize = 4;
    // column pairs per tile
    const P: usize = 4;
    let finish = |v: __m256| {
        B::finish(&Acc {
            v,
            s: 0.0,
            m: _mm_setzero_ps(),
            v2: _mm256_setzero_ps(),
        })
    };
    // What each pair of columns of the full tiles brings to each block, the same for every
    // row: pair k's block b at k * nb + b.
    let full_pairs = n_cols / (2 * P) * P;
    let offset = _mm512_set1_epi8(B::OFFSET as i8);
    let mut pair_blocks: Vec<Q0Pair> = Vec::with_capacity(full_pairs * nb);
    for k in 0..full_pairs {
        for b in 0..nb {
            let y0 = y.add(2 * k * act_stride + b * B::AB);
            let y1 = y0.add(act_stride);
            let yq =
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(load(y0.add(2))), load(y1.add(2)));
            let dy = _mm512_mask_blend_ps(
                0xff00,
                _mm512_set1_ps(f16_at(y0)),
                _mm512_set1_ps(f16_at(y1)),
            );
            // -OFFSET * (sum of each four y), so that adding (q + OFFSET) * y gives
            // the exact sum of q * y (|sums| < 2^17: no overflow anywhere)
            let base = _mm512_sub_epi32(
                _mm512_setzero_si512(),
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, yq),
            );
            pair_blocks.push(Q0Pair { yq, dy, base });
        }
    }
    // The 4 rows' blocks decoded once for all the column tiles: block b of row r at b * R + r.
    let mut quants: Vec<__m256i> = Vec::with_capacity(nb * R);
    let mut scales: Vec<f32> = Vec::with_capacity(nb * R);
    let mut i0 = 0;
    while i0 + R <= n_rows {
        let xr: [*const u8; R] = std::array::from_fn(|r| x.add((i0 + r) * row_stride));
        if full_pairs > 0 {
            quants.clear();
            scales.clear();
            for b in 0..nb {
                for r in 0..R {
                    let (q, d) = B::decode_u(xr[r].add(b * B::WB));
                    quants.push(q);
                    scales.push(d);
                }
            }
        }
        let mut c0 = 0;
        while c0 + 2 * P <= n_cols {
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            for b in 0..nb {
                let mut qu = [_mm512_setzero_si512(); R];
                let mut d = [_mm512_setzero_ps(); R];
                for r in 0..R {
                    qu[r] = _mm512_broadcast_i64x4(quants[b * R + r]);
                    d[r] = _mm512_set1_ps(scales[b * R + r]);
                }
                for p in 0..P {
                    let Q0Pair { yq, dy, base } = pair_blocks[(c0 / 2 + p) * nb + b];
                    for r in 0..R {
                        let sum = _mm512_dpbusd_epi32(base, qu[r], yq);
                        acc[r][p] = _mm512_fmadd_ps(
                            _mm512_mul_ps(d[r], dy),
                            _mm512_cvtepi32_ps(sum),
                            acc[r][p],
                        );
                    }
                }
            }
            for p in 0..P {
                for r in 0..R {
                    let v = acc[r][p];
                    let lo = _mm512_castps512_ps256(v);
                    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
                    out[(c0 + 2 * p) * n_rows + i0 + r] = finish(lo);
                    out[(c0 + 2 * p + 1) * n_rows + i0 + r] = finish(hi);
                }
            }
            c0 += 2 * P;
        }
        for c in c0..n_cols {
            for r in 0..R {
                out[c * n_rows + i0 + r] = dot_blocks::<B>(nb, xr[r], y.add(c * act_stride));
            }
        }
        i0 += R;
    }
    for i in i0..n_rows {
        let xr = x.add(i * row_stride);
        for c in 0..n_cols {
            out[c * n_rows + i] = dot_blocks::<B>(nb, xr, y.add(c * act_stride));
        }
    }
}

/// Two Q8_0 activation blocks (columns) side by side, as `multi_blocks_512` reads them:
/// lanes 0..8 (bytes 0..32) are the first column's, lanes 8..16 the second's.
#[derive(Clone, Copy)]
struct Q0Pair {
    /// The two blocks' quants.
    yq: __m512i,
    /// Each block's scale, eight times.
    dy: __m512,
    /// -OFFSET times each four quants' sum: the start of the block's integer sums.
    base: __m512i,
}

/// Two Q8_K activation blocks (columns) side by side, as `multi_blocks_k512` reads them:
/// their `KPair`, and each group's 32 quants of both (lanes 0..8 the first column's).
#[derive(Clone, Copy)]
struct KPairBlock {
    pair: KPair,
    quants: [__m512i; 8],
}

/// What `multi_blocks_k512` needs of two Q8_K activation blocks (columns) side by side:
/// lanes 0..8 (bytes 0..32) belong to the first column, lanes 8..16 to the second.
#[derive(Clone, Copy)]
struct KPair {
    /// Each column's sixteen bsums.
    bsums: __m512i,
    /// Each column's `hadd(bsums)` (eight i16 sums of two bsums).
    q8s: __m256i,
    /// Each column's d, eight times.
    yd: __m512,
    /// Each column's -d, four times.
    nyd: __m256,
}

/// K-quant blocks (met by Q8_K activations) that `multi_blocks_k512` runs: the block's
/// integer sum is, lane for lane, `start` plus the sum over groups `j` of
/// `madd(maddubs(q_j, y_j), s_j)`, as in their AVX2 `apply`.
trait KBlock: Block {
    /// Group `j`'s 32 unsigned quants.
    fn q(w: &Self::W, j: usize) -> __m256i;
    /// Group `j`'s 16-bit scales, as `madd` applies them.
    fn s(w: &Self::W, j: usize) -> __m256i;
    /// What `start` needs of the weight block, computed once per block.
    ///
    /// # Safety
    /// AVX2 is available.
    unsafe fn pre(w: &Self::W) -> __m256i;
    /// The block's `d` and `dmin` (0 where the format has none).
    fn d_dmin(w: &Self::W) -> (f32, f32);
    /// The integer sum's starting value against `pair`, from `pre`.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI (and AVX2, FMA, F16C) are available.
    unsafe fn start(pre: __m256i, pair: &KPair) -> __m512i;
    /// Adds the block's finished integer `sum` to the pair's accumulators: `v` as `Acc::v`
    /// (one column per half), `m` as Q4_K's `Acc::m` (one column per 128-bit half).
    ///
    /// # Safety
    /// As for `start`.
    unsafe fn add(w: &KUnpacked, pair: &KPair, sum: __m512i, v: &mut __m512, m: &mut __m256);
    /// The block at `x` as the tile reads it.
    ///
    /// # Safety
    /// As for `Block::decode`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn unpack(x: *const u8) -> KUnpacked {
        let w = Self::decode(x);
        let (d, dmin) = Self::d_dmin(&w);
        KUnpacked {
            q: std::array::from_fn(|j| Self::q(&w, j)),
            // (from_fn's closure would not inherit the target features: spelled out)
            s: [
                scale_pair(Self::s(&w, 0), Self::s(&w, 1)),
                scale_pair(Self::s(&w, 2), Self::s(&w, 3)),
                scale_pair(Self::s(&w, 4), Self::s(&w, 5)),
                scale_pair(Self::s(&w, 6), Self::s(&w, 7)),
            ],
            pre: Self::pre(&w),
            d,
            dmin,
        }
    }
}

/// A K-quant block unpacked once per call of `multi_blocks_k512` and read by every column
/// tile: the groups' quants, the groups' scales two by two as `vpdpwssd` reads them, `pre`
/// and the block's scales.
#[derive(Clone, Copy)]
struct KUnpacked {
    q: [__m256i; 8],
    /// Groups `2i` and `2i + 1`: each 16-bit lane pair holds (scale of group 2i, scale of
    /// group 2i + 1) for the bytes of that lane.
    s: [__m256i; 4],
    pre: __m256i,
    d: f32,
    dmin: f32,
}

/// The scale lanes of two groups, `a` in the low and `b` in the high 16 bits of each 32-bit
/// lane (`a` and `b` hold each lane's scale in both halves, as `madd` applies them).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scale_pair(a: __m256i, b: __m256i) -> __m256i {
    _mm256_blend_epi16::<0xaa>(a, _mm256_slli_epi32::<16>(b))
}

impl KBlock for Q4K {
    #[inline(always)]
    fn q(w: &K4, j: usize) -> __m256i {
        w.q[j]
    }
    #[inline(always)]
    fn s(w: &K4, j: usize) -> __m256i {
        w.scv[j]
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pre(w: &K4) -> __m256i {
        _mm256_set_m128i(w.mins, w.mins)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn start(_: __m256i, _: &KPair) -> __m512i {
        _mm512_setzero_si512()
    }
    fn d_dmin(w: &K4) -> (f32, f32) {
        (w.d, w.dmin)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn add(w: &KUnpacked, pair: &KPair, sum: __m512i, v: &mut __m512, m: &mut __m256) {
        // as `k4_apply`: the minimums with dmin = -y.d * x.dmin into `m`, then y.d * x.d
        let prod = _mm256_madd_epi16(w.pre, pair.q8s);
        let dmin = _mm256_mul_ps(pair.nyd, _mm256_set1_ps(w.dmin));
        *m = _mm256_fmadd_ps(dmin, _mm256_cvtepi32_ps(prod), *m);
        let d = _mm512_mul_ps(pair.yd, _mm512_set1_ps(w.d));
        *v = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sum), *v);
    }
}

impl KBlock for Q6K {
    #[inline(always)]
    fn q(w: &K6, j: usize) -> __m256i {
        w.u[j]
    }
    #[inline(always)]
    fn s(w: &K6, j: usize) -> __m256i {
        w.scv[j]
    }
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pre(w: &K6) -> __m256i {
        // -32 * scale, in -4096..=4096: fits i16
        _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(w.sc16, 5))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn start(pre: __m256i, pair: &KPair) -> __m512i {
        // the quants are u - 32: -32 * madd(scales, bsums), lane for lane
        _mm512_madd_epi16(_mm512_broadcast_i64x4(pre), pair.bsums)
    }
    fn d_dmin(w: &K6) -> (f32, f32) {
        (w.d, 0.0)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn add(w: &KUnpacked, pair: &KPair, sum: __m512i, v: &mut __m512, _: &mut __m256) {
        let d = _mm512_mul_ps(_mm512_set1_ps(w.d), pair.yd);
        *v = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(sum), *v);
    }
}

/// Two 256-bit vectors as one 512-bit vector (`a` in the low half).
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn join(a: __m256i, b: __m256i) -> __m512i {
    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(a), b)
}

/// 32 bytes at `y0` and 32 at `y1`, as one 512-bit vector.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn y_pair(y0: *const u8, y1: *const u8) -> __m512i {
    join(load(y0), load(y1))
}

/// The `KPair` of the Q8_K blocks (columns) at `y0` and `y1`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn k_pair(y0: *const u8, y1: *const u8) -> KPair {
    let (b0, b1) = (bsums(y0), bsums(y1));
    let q8s0 = _mm_hadd_epi16(
        _mm256_castsi256_si128(b0),
        _mm256_extracti128_si256::<1>(b0),
    );
    let q8s1 = _mm_hadd_epi16(
        _mm256_castsi256_si128(b1),
        _mm256_extracti128_si256::<1>(b1),
    );
    let (d0, d1) = (y_d(y0), y_d(y1));
    KPair {
        bsums: join(b0, b1),
        q8s: _mm256_set_m128i(q8s1, q8s0),
        yd: _mm512_mask_blend_ps(0xff00, _mm512_set1_ps(d0), _mm512_set1_ps(d1)),
        nyd: _mm256_blend_ps::<0xf0>(_mm256_set1_ps(-d0), _mm256_set1_ps(-d1)),
    }
}

/// `multi_entry` with the AVX-512 VNNI K-quant tile (see `multi_blocks_k512`).
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
fn multi_entry_k512<B: KBlock>(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    let Some(nb) = tile_blocks::<B>(n, rows, row_stride, n_rows, acts, act_stride, n_cols, out)
    else {
        return;
    };
    // SAFETY: as in `multi_entry_512`.
    unsafe {
        multi_blocks_k512::<B>(
            nb,
            rows.as_ptr(),
            row_stride,
            n_rows,
            acts.as_ptr(),
            act_stride,
            n_cols,
            out,
        )
    }
}

/// `multi_blocks` for Q4_K and Q6_K: 4 weight rows x 8 columns, two columns per 512-bit
/// register (lanes 0..8 and 8..16, each exactly the AVX2 `Acc::v` of its output; Q4_K's
/// `Acc::m` as the two 128-bit halves of a 256-bit register). A block's integer sum adds the
/// same `madd(maddubs(q, y), scales)` lanes as the AVX2 `apply` (exact i32 sums, so their
/// order does not matter), and the scale products, conversions and FMAs are the AVX2 ones in
/// the same order, so every output keeps its bits. Each group of 4 rows is unpacked once
/// (`KUnpacked`: quants as bytes, scale pairs, `pre`, d and dmin) and read by every column
/// tile of the call, rather than decoded again for each 8 columns.
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn multi_blocks_k512<B: KBlock>(
    nb: usize,
    x: *const u8,
    row_stride: usize,
    n_rows: usize,
    y: *const u8,
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    // weight rows per tile (the literal arrays below have R entries)
    const R: usize = 4;
    // column pairs per tile
    const P: usize = 4;
    // The 4 rows' blocks, unpacked once for all the column tiles: block b of row r at
    // b * R + r.
    let mut unpacked = Vec::with_capacity(nb * R);
    // What each pair of columns of the full tiles brings to each block, the same for every
    // row: pair k's block b at k * nb + b.
    let full_pairs = n_cols / (2 * P) * P;
    let mut pair_blocks: Vec<KPairBlock> = Vec::with_capacity(full_pairs * nb);
    for k in 0..full_pairs {
        for b in 0..nb {
            let y0 = y.add(2 * k * act_stride + b * B::AB);
            let y1 = y0.add(act_stride);
            let mut quants = [_mm512_setzero_si512(); 8];
            for (j, q) in quants.iter_mut().enumerate() {
                *q = y_pair(y0.add(Y_QS + 32 * j), y1.add(Y_QS + 32 * j));
            }
            pair_blocks.push(KPairBlock {
                pair: k_pair(y0, y1),
                quants,
            });
        }
    }
    let mut i0 = 0;
    while i0 + R <= n_rows {
        let xr: [*const u8; R] = std::array::from_fn(|r| x.add((i0 + r) * row_stride));
        if full_pairs > 0 {
            unpacked.clear();
            for b in 0..nb {
                for r in 0..R {
                    unpacked.push(B::unpack(xr[r].add(b * B::WB)));
                }
            }
        }
        let mut c0 = 0;
        while c0 + 2 * P <= n_cols {
            let mut v = [[_mm512_setzero_ps(); P]; R];
            let mut m = [[_mm256_setzero_ps(); P]; R];
            for b in 0..nb {
                let w = &unpacked[b * R..(b + 1) * R];
                let pb: [&KPairBlock; P] =
                    std::array::from_fn(|p| &pair_blocks[(c0 / 2 + p) * nb + b]);
                let pairs: [KPair; P] = std::array::from_fn(|p| pb[p].pair);
                let mut sum = [[_mm512_setzero_si512(); P]; R];
                for r in 0..R {
                    for p in 0..P {
                        sum[r][p] = B::start(w[r].pre, &pairs[p]);
                    }
                }
                // Two groups at a time: `vpdpbusd` gives each group's four-byte sums (|sum| <=
                // 4 * 63 * 128 < 2^15), the two groups' sums go into the two i16 halves of
                // each lane, and `vpdpwssd` with the two groups' scales in the same halves
                // adds sum_j * s_j + sum_j1 * s_j1: the `madd(maddubs(q, y), s)` lanes of
                // both groups, exactly.
                let zero = _mm512_setzero_si512();
                for j in (0..8).step_by(2) {
                    let y0: [__m512i; P] = std::array::from_fn(|p| pb[p].quants[j]);
                    let y1: [__m512i; P] = std::array::from_fn(|p| pb[p].quants[j + 1]);
                    for r in 0..R {
                        let q0 = _mm512_broadcast_i64x4(w[r].q[j]);
                        let q1 = _mm512_broadcast_i64x4(w[r].q[j + 1]);
                        let s = _mm512_broadcast_i64x4(w[r].s[j / 2]);
                        for p in 0..P {
                            let d0 = _mm512_dpbusd_epi32(zero, q0, y0[p]);
                            let d1 = _mm512_dpbusd_epi32(zero, q1, y1[p]);
                            let both = _mm512_mask_blend_epi16(
                                0xaaaa_aaaa,
                                d0,
                                _mm512_slli_epi32::<16>(d1),
                            );
                            sum[r][p] = _mm512_dpwssd_epi32(sum[r][p], both, s);
                        }
                    }
                }
                for r in 0..R {
                    for p in 0..P {
                        B::add(&w[r], &pairs[p], sum[r][p], &mut v[r][p], &mut m[r][p]);
                    }
                }
            }
            for p in 0..P {
                for r in 0..R {
                    let (vv, mm) = (v[r][p], m[r][p]);
                    let halves = [
                        (_mm512_castps512_ps256(vv), _mm256_castps256_ps128(mm)),
                        (
                            _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(vv))),
                            _mm256_extractf128_ps::<1>(mm),
                        ),
                    ];
                    for (h, (hv, hm)) in halves.into_iter().enumerate() {
                        let acc = Acc {
                            v: hv,
                            s: 0.0,
                            m: hm,
                            v2: _mm256_setzero_ps(),
                        };
                        out[(c0 + 2 * p + h) * n_rows + i0 + r] = B::finish(&acc);
                    }
                }
            }
            c0 += 2 * P;
        }
        for c in c0..n_cols {
            for r in 0..R {
                out[c * n_rows + i0 + r] = dot_blocks::<B>(nb, xr[r], y.add(c * act_stride));
            }
        }
        i0 += R;
    }
    for i in i0..n_rows {
        let xr = x.add(i * row_stride);
        for c in 0..n_cols {
            out[c * n_rows + i] = dot_blocks::<B>(nb, xr, y.add(c * act_stride));
        }
    }
}

/// The kernels that accumulate blocks in pairs (IQ4_NL, MXFP4): one row.
fn dot_pairs_entry<B: Block + OddBlock>(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = n / B::QK;
    assert!(n.is_multiple_of(B::QK) && row.len() >= nb * B::WB && act.len() >= nb * B::AB);
    // SAFETY: as in `dot_entry`.
    let sumf = unsafe { dot_pairs::<B>(nb, row.as_ptr(), act.as_ptr()) };
    if nb % 2 == 1 {
        let b = nb - 1;
        sumf + B::odd_block(
            &row[b * B::WB..(b + 1) * B::WB],
            &act[b * B::AB..(b + 1) * B::AB],
        )
    } else {
        sumf
    }
}

/// The scalar last block of an odd block count.
trait OddBlock {
    fn odd_block(x: &[u8], y: &[u8]) -> f32;
}

/// llama.cpp's AVX2 IQ4_NL / MXFP4 loop: even blocks into `acc1`, odd ones into `acc2`,
/// `hsum_float_8(acc1 + acc2)`; a last unpaired block is left to the caller.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_pairs<B: Block>(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let zero = Acc {
        v: _mm256_setzero_ps(),
        s: 0.0,
        m: _mm_setzero_ps(),
        v2: _mm256_setzero_ps(),
    };
    let (mut a1, mut a2) = (zero, zero);
    let mut b = 0;
    while b + 1 < nb {
        B::step(x.add(b * B::WB), y.add(b * B::AB), &mut a1);
        B::step(x.add((b + 1) * B::WB), y.add((b + 1) * B::AB), &mut a2);
        b += 2;
    }
    hsum_f32(_mm256_add_ps(a1.v, a2.v))
}

/// The one-row and several-row block loops (`dot_blocks`, `rows_blocks`), for the kernels of
/// AVX2 and (`_512`, so that their steps inline) those of AVX-512 ([`Block::AVX512`]).
macro_rules! block_loops {
    ($dot:ident, $rows:ident, $features:literal) => {
        #[target_feature(enable = $features)]
        unsafe fn $dot<B: Block>(nb: usize, x: *const u8, y: *const u8) -> f32 {
            let mut acc = Acc {
                v: _mm256_setzero_ps(),
                s: 0.0,
                m: _mm_setzero_ps(),
                v2: _mm256_setzero_ps(),
            };
            for b in 0..nb {
                B::step(x.add(b * B::WB), y.add(b * B::AB), &mut acc);
            }
            B::finish(&acc)
        }

        #[target_feature(enable = $features)]
        unsafe fn $rows<B: Block>(
            nb: usize,
            x: *const u8,
            stride: usize,
            y: *const u8,
            out: &mut [f32],
        ) {
            let mut i = 0;
            while !B::ONE_ROW && i + 4 <= out.len() {
                let zero = Acc {
                    v: _mm256_setzero_ps(),
                    s: 0.0,
                    m: _mm_setzero_ps(),
                    v2: _mm256_setzero_ps(),
                };
                let mut acc = [zero; 4];
                let base = x.add(i * stride);
                // Decode streams each weight once from memory: fetch the group of rows after
                // next while this one computes (4 rows are `4 * nb * WB` contiguous bytes when
                // the stride is the row length: `4 * WB` of them per block). Prefetching past
                // the end is harmless.
                let ahead = base.wrapping_add(8 * stride);
                for b in 0..nb {
                    let mut line = 0;
                    while line < 4 * B::WB {
                        _mm_prefetch::<_MM_HINT_T0>(
                            ahead.wrapping_add(b * 4 * B::WB + line) as *const i8
                        );
                        line += 64;
                    }
                    let yb = y.add(b * B::AB);
                    let xb = base.add(b * B::WB);
                    B::step4(xb, stride, yb, &mut acc);
                }
                for r in 0..4 {
                    out[i + r] = B::finish(&acc[r]);
                }
                i += 4;
            }
            while i < out.len() {
                out[i] = $dot::<B>(nb, x.add(i * stride), y);
                i += 1;
            }
        }
    };
}

block_loops!(dot_blocks, rows_blocks, "avx2,fma,f16c");
block_loops!(
    dot_blocks_512,
    rows_blocks_512,
    "avx2,fma,f16c,bmi2,avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi"
);

// ---------------------------------------------------------------------------------------------
// Helpers

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum_f32(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load(p: *const u8) -> __m256i {
    _mm256_loadu_si256(p as *const __m256i)
}

/// 16 bytes of packed nibbles -> 32 bytes: low nibbles (elements 0..16) then high (16..32).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn nibbles_16(p: *const u8) -> __m256i {
    let x = _mm_loadu_si128(p as *const __m128i);
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(x, m);
    let hi = _mm_and_si128(_mm_srli_epi16(x, 4), m);
    _mm256_set_m128i(hi, lo)
}

/// Signed bytes times signed bytes, summed in groups of four into 8 i32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_i8(x: __m256i, y: __m256i) -> __m256i {
    let ax = _mm256_sign_epi8(x, x);
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// `dot_i8(x, y)` with `ax = |x|` precomputed.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_abs_i8(ax: __m256i, x: __m256i, y: __m256i) -> __m256i {
    let sy = _mm256_sign_epi8(y, x);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ax, sy), _mm256_set1_epi16(1))
}

/// Unsigned bytes times signed bytes, summed in groups of four into 8 i32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dot_u8_i8(x: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(x, y), _mm256_set1_epi16(1))
}

/// Sixteen signed byte scales (one per 16 elements) -> for each 32-element group `k`, the
/// 16-bit scale vector `[sc[2k]; 8] ++ [sc[2k + 1]; 8]` that `madd` applies to `maddubs`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pair_scales(sc: __m128i) -> [__m256i; 8] {
    let mut out = [_mm256_setzero_si256(); 8];
    for (k, o) in out.iter_mut().enumerate() {
        let lo = (2 * k) as i8;
        let hi = lo + 1;
        let mask = _mm_setr_epi8(
            lo, lo, lo, lo, lo, lo, lo, lo, hi, hi, hi, hi, hi, hi, hi, hi,
        );
        *o = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, mask));
    }
    out
}

/// Bit `i` of `bits` -> byte `i` of the result: 0xFF where set, 0 where clear.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bits_to_bytes(bits: u32) -> __m256i {
    let v = _mm256_set1_epi32(bits as i32);
    let spread = _mm256_shuffle_epi8(
        v,
        _mm256_set_epi64x(
            0x0303_0303_0303_0303,
            0x0202_0202_0202_0202,
            0x0101_0101_0101_0101,
            0x0000_0000_0000_0000,
        ),
    );
    let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask)
}

/// A block's 32 grid indices as u16, entries 8k..8k + 8 in vector k: entry `j` is byte `j` of
/// the 32 at `low` with `high` of word `j / 4` of `words` on top (`high` gets each word four
/// times in a row, once per entry of its group, and places the bits that entry takes).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn grid_indices(
    low: *const u8,
    words: __m128i,
    high: impl Fn(__m128i) -> __m128i,
) -> [__m128i; 4] {
    let (r0, r1) = (
        _mm_unpacklo_epi16(words, words),
        _mm_unpackhi_epi16(words, words),
    );
    let low = [
        _mm_loadu_si128(low as *const __m128i),
        _mm_loadu_si128(low.add(16) as *const __m128i),
    ];
    let z = _mm_setzero_si128();
    [
        _mm_or_si128(
            _mm_unpacklo_epi8(low[0], z),
            high(_mm_unpacklo_epi32(r0, r0)),
        ),
        _mm_or_si128(
            _mm_unpackhi_epi8(low[0], z),
            high(_mm_unpackhi_epi32(r0, r0)),
        ),
        _mm_or_si128(
            _mm_unpacklo_epi8(low[1], z),
            high(_mm_unpacklo_epi32(r1, r1)),
        ),
        _mm_or_si128(
            _mm_unpackhi_epi8(low[1], z),
            high(_mm_unpackhi_epi32(r1, r1)),
        ),
    ]
}

/// Dword `k` (< 4) of each half of `v` in all four dwords of that half (one `pshufd`).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn dword_spread(v: __m256i, k: usize) -> __m256i {
    match k {
        0 => _mm256_shuffle_epi32::<0x00>(v),
        1 => _mm256_shuffle_epi32::<0x55>(v),
        2 => _mm256_shuffle_epi32::<0xaa>(v),
        _ => _mm256_shuffle_epi32::<0xff>(v),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_i32(acc: &mut Acc, d: f32, sum: __m256i) {
    acc.v = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(sum), acc.v);
}

/// `madd` multipliers for 32 elements: `lo` for the first 16, `hi` for the second 16.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn halves(lo: i32, hi: i32) -> __m256i {
    _mm256_set_m128i(_mm_set1_epi16(hi as i16), _mm_set1_epi16(lo as i16))
}

/// The f16 at `p` as f32, with F16C (the `half` crate would check the CPU on every call).
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_at(p: *const u8) -> f32 {
    let h = u16::from_le_bytes([*p, *p.add(1)]);
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(h as i32)))
}

/// Two consecutive f16 at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16_pair(p: *const u8) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
}

/// Two consecutive f16 at `p` in lanes 0 and 1.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn f16x2(p: *const u8) -> __m128 {
    _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()))
}

/// `(x0 * y0, x1 * y1)` of lanes 0 and 1.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn pair_products(x: __m128, y: __m128) -> (f32, f32) {
    let p = _mm_mul_ps(x, y);
    (_mm_cvtss_f32(p), _mm_cvtss_f32(_mm_movehdup_ps(p)))
}

// ---------------------------------------------------------------------------------------------
// Legacy formats against Q8_0 / Q8_1 (Q8_0: d at 0, qs at 2; Q8_1: d at 0, s at 2, qs at 4)

struct Q4_0;
impl Block for Q4_0 {
    const QK: usize = 32;
    const WB: usize = 18;
    const AB: usize = 34;
    /// (signed quants, their absolute values, d)
    type W = (__m256i, __m256i, f32);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> Self::W {
        let q = _mm256_sub_epi8(nibbles_16(x.add(2)), _mm256_set1_epi8(8));
        (q, _mm256_sign_epi8(q, q), f16_at(x))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(&(q, aq, d): &Self::W, y: *const u8, acc: &mut Acc) {
        let sum = dot_abs_i8(aq, q, load(y.add(2)));
        fma_i32(acc, d * f16_at(y), sum);
    }
}

struct Q4_1;
impl Block for Q4_1 {
    const QK: usize = 32;
    const WB: usize = 20;
    const AB: usize = 36;
    /// (quants, [d, m, ..])
    type W = (__m256i, __m128);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> Self::W {
        (nibbles_16(x.add(4)), f16x2(x))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(&(q, dm): &Self::W, y: *const u8, acc: &mut Acc) {
        let sum = dot_u8_i8(q, load(y.add(4)));
        let (dd, ms) = pair_products(dm, f16x2(y));
        fma_i32(acc, dd, sum);
        acc.s += ms;
    }
}

/// Q5 quants (0..=31) from the 4 `qh` bytes at `qh` and 16 nibble bytes at `qs`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn q5_bytes(qh: *const u8, qs: *const u8) -> __m256i {
    let bits = u32::from_le_bytes([*qh, *qh.add(1), *qh.add(2), *qh.add(3)]);
    let high = _mm256_and_si256(bits_to_bytes(bits), _mm256_set1_epi8(0x10));
    _mm256_or_si256(nibbles_16(qs), high)
}

struct Q5_0;
impl Block for Q5_0 {
    const QK: usize = 32;
    const WB: usize = 22;
    const AB: usize = 34;
    /// (signed quants, their absolute values, d)
    type W = (__m256i, __m256i, f32);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> Self::W {
        let q = _mm256_sub_epi8(q5_bytes(x.add(2), x.add(6)), _mm256_set1_epi8(16));
        (q, _mm256_sign_epi8(q, q), f16_at(x))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(&(q, aq, d): &Self::W, y: *const u8, acc: &mut Acc) {
        let sum = dot_abs_i8(aq, q, load(y.add(2)));
        fma_i32(acc, d * f16_at(y), sum);
    }
}

struct Q5_1;
impl Block for Q5_1 {
    const QK: usize = 32;
    const WB: usize = 24;
    const AB: usize = 36;
    /// (quants, [d, m, ..])
    type W = (__m256i, __m128);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> Self::W {
        (q5_bytes(x.add(4), x.add(8)), f16x2(x))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(&(q, dm): &Self::W, y: *const u8, acc: &mut Acc) {
        let sum = dot_u8_i8(q, load(y.add(4)));
        let (dd, ms) = pair_products(dm, f16x2(y));
        fma_i32(acc, dd, sum);
        acc.s += ms;
    }
}

struct Q8_0;
impl Block for Q8_0 {
    const QK: usize = 32;
    const WB: usize = 34;
    const AB: usize = 34;
    /// (signed quants, their absolute values, d)
    type W = (__m256i, __m256i, f32);
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> Self::W {
        let q = load(x.add(2));
        (q, _mm256_sign_epi8(q, q), f16_at(x))
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(&(q, aq, d): &Self::W, y: *const u8, acc: &mut Acc) {
        let sum = dot_abs_i8(aq, q, load(y.add(2)));
        fma_i32(acc, d * f16_at(y), sum);
    }
}

/// 16 nibble bytes at `qs` looked up in a 16-entry signed table.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn lookup_16(qs: *const u8, table: &[i8; 16]) -> __m256i {
    let t = _mm256_broadcastsi128_si256(_mm_loadu_si128(table.as_ptr() as *const __m128i));
    _mm256_shuffle_epi8(t, nibbles_16(qs))
}

struct Iq4Nl;
impl Block for Iq4Nl {
    const QK: usize = 32;
    const WB: usize = 18;
    const AB: usize = 34;
    type W = *const u8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> *const u8 {
        x
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(&x: &*const u8, y: *const u8, acc: &mut Acc) {
        let sum = dot_i8(lookup_16(x.add(2), &KVALUES_IQ4NL), load(y.add(2)));
        fma_i32(acc, f16_at(x) * f16_at(y), sum);
    }
}

impl OddBlock for Iq4Nl {
    fn odd_block(x: &[u8], y: &[u8]) -> f32 {
        crate::iq::odd_block_iq4_nl(x, y)
    }
}

impl OddBlock for Mxfp4 {
    fn odd_block(x: &[u8], y: &[u8]) -> f32 {
        crate::iq::odd_block_mxfp4(x, y)
    }
}

struct Mxfp4;
impl Block for Mxfp4 {
    const QK: usize = 32;
    const WB: usize = 17;
    const AB: usize = 34;
    type W = *const u8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> *const u8 {
        x
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(&x: &*const u8, y: *const u8, acc: &mut Acc) {
        let sum = dot_i8(lookup_16(x.add(1), &KVALUES_MXFP4), load(y.add(2)));
        fma_i32(acc, e8m0_to_f32_half(*x) * f16_at(y), sum);
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants against Q8_K (d f32 at 0, qs at 4, bsums i16 at 260)

const Y_QS: usize = 4;
const Y_BSUMS: usize = 260;

#[inline(always)]
unsafe fn y_d(y: *const u8) -> f32 {
    f32::from_le_bytes([*y, *y.add(1), *y.add(2), *y.add(3)])
}

/// The activation's sixteen bsums as i16 lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn bsums(y: *const u8) -> __m256i {
    load(y.add(Y_BSUMS))
}

/// Sixteen i16 scales (one per 16 elements) dotted with the bsums: 8 i32 partial sums.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn scales_dot_bsums(scales16: __m256i, y: *const u8) -> __m256i {
    _mm256_madd_epi16(scales16, bsums(y))
}

/// Q3_K's 12 packed bytes -> sixteen 6-bit scales as bytes 0..=63 (offset 32 not removed).
#[inline(always)]
unsafe fn q3k_scale_bytes(p: *const u8) -> [u8; 16] {
    const KMASK1: u32 = 0x0303_0303;
    const KMASK2: u32 = 0x0f0f_0f0f;
    let a0 = (p as *const u32).read_unaligned();
    let a1 = (p.add(4) as *const u32).read_unaligned();
    let tmp = (p.add(8) as *const u32).read_unaligned();
    let out = [
        (a0 & KMASK2) | ((tmp & KMASK1) << 4),
        (a1 & KMASK2) | (((tmp >> 2) & KMASK1) << 4),
        ((a0 >> 4) & KMASK2) | (((tmp >> 4) & KMASK1) << 4),
        ((a1 >> 4) & KMASK2) | (((tmp >> 6) & KMASK1) << 4),
    ];
    std::mem::transmute::<[u32; 4], [u8; 16]>(out)
}

/// Q4_K/Q5_K's 12 packed bytes -> (eight 6-bit scales, eight 6-bit mins).
#[inline(always)]
unsafe fn k4_scale_min_bytes(p: *const u8) -> ([u8; 8], [u8; 8]) {
    const KMASK1: u32 = 0x3f3f_3f3f;
    const KMASK2: u32 = 0x0f0f_0f0f;
    const KMASK3: u32 = 0x0303_0303;
    let u0 = (p as *const u32).read_unaligned();
    let u1 = (p.add(4) as *const u32).read_unaligned();
    let u2 = (p.add(8) as *const u32).read_unaligned();
    let sc = [u0 & KMASK1, (u2 & KMASK2) | (((u0 >> 6) & KMASK3) << 4)];
    let mn = [
        u1 & KMASK1,
        ((u2 >> 4) & KMASK2) | (((u1 >> 6) & KMASK3) << 4),
    ];
    (
        std::mem::transmute::<[u32; 2], [u8; 8]>(sc),
        std::mem::transmute::<[u32; 2], [u8; 8]>(mn),
    )
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn low2(v: __m256i, shift: i32) -> __m256i {
    let s = _mm_cvtsi32_si128(shift);
    _mm256_and_si256(_mm256_srl_epi16(v, s), _mm256_set1_epi8(3))
}

struct Q2K;
impl Block for Q2K {
    const QK: usize = 256;
    const WB: usize = 84;
    const AB: usize = 292;
    type W = *const u8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> *const u8 {
        x
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(&x: &*const u8, y: *const u8, acc: &mut Acc) {
        let sc = _mm_loadu_si128(x as *const __m128i);
        let scv = pair_scales(_mm_and_si128(sc, _mm_set1_epi8(0x0f)));
        let mut sum = _mm256_setzero_si256();
        for chunk in 0..2 {
            let q = load(x.add(16 + 32 * chunk));
            for j in 0..4 {
                let is = 8 * chunk + 2 * j;
                let qj = low2(q, 2 * j as i32);
                let yv = load(y.add(Y_QS + 128 * chunk + 32 * j));
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(qj, yv), scv[is / 2]);
                sum = _mm256_add_epi32(sum, p);
            }
        }
        let mins = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sc, 4), _mm_set1_epi8(0x0f)));
        let summs = scales_dot_bsums(mins, y);
        let yd = y_d(y);
        let (d, dmin) = f16_pair(x.add(80));
        // llama.cpp adds the minimums first
        fma_i32(acc, -yd * dmin, summs);
        fma_i32(acc, yd * d, sum);
    }
}

struct Q3K;
impl Block for Q3K {
    const QK: usize = 256;
    const WB: usize = 110;
    const AB: usize = 292;
    type W = *const u8;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> *const u8 {
        x
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(&x: &*const u8, y: *const u8, acc: &mut Acc) {
        let sb = q3k_scale_bytes(x.add(96));
        let sc = _mm_sub_epi8(
            _mm_loadu_si128(sb.as_ptr() as *const __m128i),
            _mm_set1_epi8(32),
        );
        let scv = pair_scales(sc);
        let hm = load(x);
        let mut sum = _mm256_setzero_si256();
        for chunk in 0..2 {
            let q = load(x.add(32 + 32 * chunk));
            for j in 0..4 {
                let is = 8 * chunk + 2 * j;
                let hbit = _mm256_and_si256(
                    _mm256_srl_epi16(hm, _mm_cvtsi32_si128((4 * chunk + j) as i32)),
                    _mm256_set1_epi8(1),
                );
                // as llama.cpp: low bits times y, minus 4 * y where the high bit is clear
                let hsub = _mm256_slli_epi16(_mm256_xor_si256(hbit, _mm256_set1_epi8(1)), 2);
                let yv = load(y.add(Y_QS + 128 * chunk + 32 * j));
                let p16 = _mm256_sub_epi16(
                    _mm256_maddubs_epi16(low2(q, 2 * j as i32), yv),
                    _mm256_maddubs_epi16(hsub, yv),
                );
                let s = _mm256_madd_epi16(p16, scv[is / 2]);
                sum = _mm256_add_epi32(sum, s);
            }
        }
        fma_i32(acc, f16_at(x.add(108)) * y_d(y), sum);
    }
}

/// Q4_K/Q5_K unpacked: 8 vectors of 32 quants (sub-block order), their scales, the mins,
/// and d, dmin.
#[derive(Clone, Copy)]
struct K4 {
    q: [__m256i; 8],
    scv: [__m256i; 8],
    /// The eight minimums as i16 lanes.
    mins: __m128i,
    d: f32,
    dmin: f32,
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_apply<const Q5: bool>(w: &K4, y: *const u8, acc: &mut Acc) {
    let mut sum = _mm256_setzero_si256();
    for c in 0..4 {
        let y0 = load(y.add(Y_QS + 64 * c));
        let y1 = load(y.add(Y_QS + 64 * c + 32));
        let p0 = _mm256_madd_epi16(_mm256_maddubs_epi16(w.q[2 * c], y0), w.scv[2 * c]);
        let p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(w.q[2 * c + 1], y1), w.scv[2 * c + 1]);
        sum = _mm256_add_epi32(sum, _mm256_add_epi32(p0, p1));
    }
    // llama.cpp: q8s = hadd(bsums), prod = madd(mins, q8s); Q4_K accumulates prod in four
    // lanes, Q5_K its total in a scalar (both by FMA with dmin = -y.d * x.dmin).
    let b = bsums(y);
    let q8s = _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256::<1>(b));
    let prod = _mm_madd_epi16(w.mins, q8s);
    let yd = y_d(y);
    let dmin = -yd * w.dmin;
    if Q5 {
        let p = _mm_add_epi32(prod, _mm_unpackhi_epi64(prod, prod));
        let p = _mm_add_epi32(p, _mm_shuffle_epi32::<0b01>(p));
        acc.s = dmin.mul_add(_mm_cvtsi128_si32(p) as f32, acc.s);
    } else {
        acc.m = _mm_fmadd_ps(_mm_set1_ps(dmin), _mm_cvtepi32_ps(prod), acc.m);
    }
    fma_i32(acc, yd * w.d, sum);
}

/// Scales, mins and d/dmin of a Q4_K/Q5_K block (quants left zero).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_header(x: *const u8) -> K4 {
    let (sc, mn) = k4_scale_min_bytes(x.add(4));
    let (d, dmin) = f16_pair(x);
    K4 {
        q: [_mm256_setzero_si256(); 8],
        scv: sc.map(|v| _mm256_set1_epi16(v as i16)),
        mins: _mm_cvtepu8_epi16(_mm_loadl_epi64(mn.as_ptr() as *const __m128i)),
        d,
        dmin,
    }
}

struct Q4K;
impl Block for Q4K {
    const QK: usize = 256;
    const WB: usize = 144;
    const AB: usize = 292;
    type W = K4;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> K4 {
        let mut w = k4_header(x);
        let m4 = _mm256_set1_epi8(0x0f);
        for c in 0..4 {
            let q = load(x.add(16 + 32 * c));
            w.q[2 * c] = _mm256_and_si256(q, m4);
            w.q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        }
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(w: &K4, y: *const u8, acc: &mut Acc) {
        k4_apply::<false>(w, y, acc)
    }
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn finish(acc: &Acc) -> f32 {
        let m = _mm_add_ps(acc.m, _mm_movehl_ps(acc.m, acc.m));
        let m = _mm_add_ss(m, _mm_movehdup_ps(m));
        hsum_f32(acc.v) + _mm_cvtss_f32(m)
    }
}

struct Q5K;
impl Block for Q5K {
    const QK: usize = 256;
    const WB: usize = 176;
    const AB: usize = 292;
    type W = K4;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> K4 {
        let mut w = k4_header(x);
        let m4 = _mm256_set1_epi8(0x0f);
        let one = _mm256_set1_epi8(1);
        let qh = load(x.add(16));
        for c in 0..4 {
            let q = load(x.add(48 + 32 * c));
            let h0 = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32)), one);
            let h1 = _mm256_and_si256(
                _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * c as i32 + 1)),
                one,
            );
            w.q[2 * c] = _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_slli_epi16(h0, 4));
            w.q[2 * c + 1] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
                _mm256_slli_epi16(h1, 4),
            );
        }
        w
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(w: &K4, y: *const u8, acc: &mut Acc) {
        k4_apply::<true>(w, y, acc)
    }
}

/// Q6_K unpacked: 8 vectors of 32 unsigned quants (element order), scales, d.
#[derive(Clone, Copy)]
struct K6 {
    u: [__m256i; 8],
    scv: [__m256i; 8],
    sc16: __m256i,
    d: f32,
}

struct Q6K;
impl Block for Q6K {
    const QK: usize = 256;
    const WB: usize = 210;
    const AB: usize = 292;
    type W = K6;
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode(x: *const u8) -> K6 {
        let m4 = _mm256_set1_epi8(0x0f);
        let mut u = [_mm256_setzero_si256(); 8];
        for chunk in 0..2 {
            let ql0 = load(x.add(64 * chunk));
            let ql1 = load(x.add(64 * chunk + 32));
            let qh = load(x.add(128 + 32 * chunk));
            let parts = [
                (_mm256_and_si256(ql0, m4), low2(qh, 0)),
                (_mm256_and_si256(ql1, m4), low2(qh, 2)),
                (_mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4), low2(qh, 4)),
                (_mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4), low2(qh, 6)),
            ];
            for (k, (l, h)) in parts.into_iter().enumerate() {
                u[4 * chunk + k] = _mm256_or_si256(l, _mm256_slli_epi16(h, 4));
            }
        }
        let sc = _mm_loadu_si128(x.add(192) as *const __m128i);
        K6 {
            u,
            scv: pair_scales(sc),
            sc16: _mm256_cvtepi8_epi16(sc),
            d: f16_at(x.add(208)),
        }
    }
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn apply(w: &K6, y: *const u8, acc: &mut Acc) {
        let mut sum = _mm256_setzero_si256();
        for (k, &u) in w.u.iter().enumerate() {
            let yv = load(y.add(Y_QS + 32 * k));
            let s = _mm256_madd_epi16(_mm256_maddubs_epi16(u, yv), w.scv[k]);
            sum = _mm256_add_epi32(sum, s);
        }
        // The quants are u - 32: take 32 * sum(scale * bsum) off, exactly.
        sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(scales_dot_bsums(w.sc16, y), 5));
        fma_i32(acc, w.d * y_d(y), sum);
    }
}

// ---------------------------------------------------------------------------------------------
// Float rows (block size 1: any n)

fn dot_f32(n: usize, row: &[u8], act: &[u8]) -> f32 {
    assert!(row.len() >= 4 * n && act.len() >= 4 * n);
    // SAFETY: detected features as in `dot_entry`; `n` f32 fit in both slices (assert above).
    unsafe { crate::ggml_vec::x86::dot_f32(n, row.as_ptr(), act.as_ptr()) }
}

fn dot_f16(n: usize, row: &[u8], act: &[u8]) -> f32 {
    assert!(row.len() >= 2 * n && act.len() >= 2 * n);
    // SAFETY: detected features as in `dot_entry`; `n` f16 fit in both slices (assert above).
    unsafe { crate::ggml_vec::x86::dot_f16(n, row.as_ptr(), act.as_ptr()) }
}

fn dot_bf16(n: usize, row: &[u8], act: &[u8]) -> f32 {
    assert!(row.len() >= 2 * n && act.len() >= 2 * n);
    // SAFETY: detected features as in `dot_entry`; `n` bf16 fit in both slices (assert above).
    unsafe { crate::ggml_vec::x86::dot_bf16(n, row.as_ptr(), act.as_ptr()) }
}

#[cfg(test)]
mod batch_tests {
    use crate::k_quants::{quantize_q4_k, quantize_q6_k, quantize_q8_k, BlockQ8K};

    /// The tiled kernel's block step in AVX2 gives the scalar one's bits (the AVX512-VNNI batch:
    /// `tiled512::tests`), on
    /// a format with minimums (Q4_K) and one with signed values and int8 multipliers (Q6_K).
    #[test]
    fn tiled_block_steps_agree_across_instruction_sets() {
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma"))
        {
            return;
        }
        let x: Vec<f32> = (0..256)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 17.0)
            .collect();
        let mut ys = Vec::new();
        for c in 0..5 {
            let a: Vec<f32> = (0..256)
                .map(|i| ((i * (c + 3) % 89) as f32 - 44.0) * 0.3)
                .collect();
            let mut b = vec![0u8; 292];
            quantize_q8_k(&a, &mut b);
            ys.push(*bytemuck::from_bytes::<BlockQ8K>(&b));
        }
        let ys: Vec<&BlockQ8K> = ys.iter().collect();
        let (mut q4, mut q6) = (vec![0u8; 144], vec![0u8; 210]);
        quantize_q4_k(&x, &mut q4);
        quantize_q6_k(&x, &mut q6);
        let (mut b4, mut b6) = (
            crate::tiled::TiledBlock::ZERO,
            crate::tiled::TiledBlock::ZERO,
        );
        crate::k_quants::tiled_q4_k(&q4, &mut b4);
        crate::k_quants::tiled_q6_k(&q6, &mut b6);
        for block in [b4, b6] {
            let run = |step: crate::tiled::BlockStep| {
                let mut acc = vec![0.5f32; ys.len()];
                step(&block, &ys, &mut acc);
                acc.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            };
            let want = run(crate::tiled::block_step);
            assert_eq!(run(super::tiled_block_step), want, "AVX2");
        }
    }

    /// The repacked Q4_K batch's two instruction sets give the scalar reference's bits (the
    /// oracle goldens check the one this CPU picks against llama.cpp).
    #[test]
    fn repacked_batches_agree_across_instruction_sets() {
        if !(std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma"))
        {
            return;
        }
        let (n, n_rows, n_cols) = (512, 5, 13);
        let mut seed = 7u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5
        };
        let mut quantized = |count: usize, bytes: usize, q: fn(&[f32], &mut [u8])| {
            let mut out = vec![0u8; count * bytes];
            for c in out.chunks_exact_mut(bytes) {
                let x: Vec<f32> = (0..n).map(|_| next()).collect();
                q(&x, c);
            }
            out
        };
        let (rb, ab) = (n / 256 * 144, n / 256 * 292);
        let rows = quantized(n_rows, rb, quantize_q4_k);
        let acts = quantized(n_cols, ab, quantize_q8_k);
        let mut want = vec![0f32; n_rows * n_cols];
        crate::repack::multi_k(
            crate::repack::pair_sums,
            n,
            &rows,
            rb,
            n_rows,
            &acts,
            ab,
            n_cols,
            &mut want,
        );
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        for vnni in [false, true] {
            if vnni && !super::has_avx512_vnni() {
                continue;
            }
            let mut got = vec![0f32; n_rows * n_cols];
            super::repack_multi_with(vnni, n, &rows, rb, n_rows, &acts, ab, n_cols, &mut got);
            assert_eq!(bits(&got), bits(&want), "vnni {vnni}");
        }
        // the gemv: eight rows at a time (VNNI), four, one
        let (n_rows, n) = (29, 1024);
        let (rb, ab) = (n / 256 * 144, n / 256 * 292);
        let rows = quantized(n_rows, rb, quantize_q4_k);
        let act = quantized(1, ab, quantize_q8_k);
        for vnni in [false, true] {
            if vnni && !super::has_avx512_vnni() {
                continue;
            }
            let mut gemv = vec![0f32; n_rows];
            super::repack_rows_with(vnni, n, &rows, rb, &act, &mut gemv);
            for (i, g) in gemv.iter().enumerate() {
                let one = crate::repack::dot_k(
                    crate::repack::pair_sums,
                    n,
                    &rows[i * rb..(i + 1) * rb],
                    &act,
                );
                assert_eq!(g.to_bits(), one.to_bits(), "gemv row {i}, vnni {vnni}");
            }
        }
    }
}
