//! llama.cpp's tiled batch (`tiled::multi`'s arithmetic) with AVX512-VNNI, the columns in the
//! lanes: eight activation columns rearranged once so that two quads of each sit side by side
//! (`vpdpbusd` of them with two quads of a weight row broadcast), so a block's exact integer
//! sums `S` of eight columns come out in one register without a horizontal sum, and the fmas of
//! `tiled::accumulate` run lane by lane, the same per lane. Also llama.cpp's repacked Q4_K gemm
//! ([`repack_multi_q4_k`]) the same way, and AVX2 unpacking of the K-quants' blocks.

use super::*;
use crate::k_quants::{BlockQ8K, QK_K};
use crate::kernel::DotFn;
use crate::tiled::{TiledBlock, MIN_COLUMNS};

/// Columns per group: one i32 lane each of a 256-bit register.
const GROUP: usize = 8;
/// Bytes of one block of a group's values: 64 quads of 8 columns.
const QBYTES: usize = QK_K * GROUP;
/// Dwords of one block of a group's sums of 16: 8 pairs of 8 columns.
const SBYTES: usize = QK_K / 32 * GROUP;

/// The activation columns rearranged, per (group of 8 columns, block): values + `bias` (0 or
/// 128) with quad `2i + h` of column `c` at dword `16i + 2c + h`; the scales `d`; the sums of
/// 16 `2p` and `2p + 1` of column `c` as the i16 halves of dword `8p + c`. Missing columns of
/// the last group are zeros.
struct Columns {
    q: Vec<u8>,
    d: Vec<f32>,
    bsums: Vec<i32>,
}

fn rearrange(acts: &[u8], act_stride: usize, n_cols: usize, nb: usize, bias: u8) -> Columns {
    let ng = n_cols.div_ceil(GROUP);
    let mut p = Columns {
        q: vec![bias; ng * nb * QBYTES],
        d: vec![0.0; ng * nb * GROUP],
        bsums: vec![0; ng * nb * SBYTES],
    };
    let bytes = std::mem::size_of::<BlockQ8K>();
    for c in 0..n_cols {
        let col: &[BlockQ8K] =
            bytemuck::cast_slice(&acts[c * act_stride..c * act_stride + nb * bytes]);
        let (g, l) = (c / GROUP, c % GROUP);
        for (kb, y) in col.iter().enumerate() {
            let at = g * nb + kb;
            let q = &mut p.q[at * QBYTES..(at + 1) * QBYTES];
            for (quad, v) in y.qs.chunks_exact(4).enumerate() {
                for (e, &b) in v.iter().enumerate() {
                    q[((quad / 2 * GROUP + l) * 2 + quad % 2) * 4 + e] = b.wrapping_add(bias);
                }
            }
            p.d[at * GROUP + l] = y.d();
            for pair in 0..QK_K / 32 {
                p.bsums[at * SBYTES + pair * GROUP + l] =
                    pack(y.bsum(2 * pair), y.bsum(2 * pair + 1));
            }
        }
    }
    p
}

/// `tiled::multi` (below [`MIN_COLUMNS`] columns exactly that), from 8 columns with the
/// columns in the lanes. Handed out only after run-time detection of AVX512-VNNI
/// (`kernel::tiled_fn`).
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
pub(crate) fn multi(
    unpack: crate::tiled::Unpack,
    block_bytes: usize,
    dot: DotFn,
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    if n_cols < MIN_COLUMNS {
        return crate::tiled::multi(
            unpack,
            block_bytes,
            dot,
            crate::tiled::block_step,
            n,
            rows,
            row_stride,
            n_rows,
            acts,
            act_stride,
            n_cols,
            out,
        );
    }
    assert!(has_avx512_vnni());
    let nb = n / QK_K;
    let rb = nb * block_bytes;
    assert!(out.len() >= n_rows * n_cols);
    let mut blocks: Vec<TiledBlock> = (0..nb).map(|_| TiledBlock::ZERO).collect();
    if n_rows == 0 || nb == 0 {
        out[..n_rows * n_cols].fill(0.0);
        return;
    }
    // `vpdpbusd` takes unsigned bytes: the values of a format with minimums are (0..=31), met
    // as they are by the signed activations; the others (signed) meet the activations biased
    // to unsigned, their sum less `Prepared::bias`
    unpack(&rows[..block_bytes], &mut blocks[0]);
    let unsigned = blocks[0].mins.is_some();
    let cols = rearrange(acts, act_stride, n_cols, nb, if unsigned { 0 } else { 128 });
    let mut acc = vec![[[0f32; GROUP]; 2]; n_cols.div_ceil(GROUP)];
    // two rows at a time (each activation load serves both); a row's blocks unpacked and
    // prepared before their products: the stores of one pass are done when the next reads them
    // (a wide load of narrow stores waits for them otherwise)
    blocks.resize_with(2 * nb, || TiledBlock::ZERO);
    let mut prepared: Vec<Prepared> = (0..2 * nb).map(|_| Prepared::default()).collect();
    let mut i = 0;
    while i < n_rows {
        let r = if i + 1 < n_rows { 2 } else { 1 };
        for h in 0..r {
            let row = &rows[(i + h) * row_stride..(i + h) * row_stride + rb];
            let xs = &mut blocks[h * nb..(h + 1) * nb];
            for (x, xb) in xs.iter_mut().zip(row.chunks_exact(block_bytes)) {
                unpack(xb, x);
            }
        }
        for (x, p) in blocks.iter().zip(prepared.iter_mut()).take(r * nb) {
            // SAFETY: the features were asserted above.
            unsafe { prepare(x, p) };
        }
        acc.iter_mut().for_each(|a| *a = [[0.0; GROUP]; 2]);
        for kb in 0..nb {
            // SAFETY: as above; `cols` holds `nb` blocks of every group of `acc`, `kb < nb`.
            unsafe {
                if r == 2 {
                    let xs = [&blocks[kb], &blocks[nb + kb]];
                    block_vnni::<2>(
                        xs,
                        [&prepared[kb], &prepared[nb + kb]],
                        &cols,
                        kb,
                        nb,
                        &mut acc,
                    );
                } else {
                    block_vnni::<1>([&blocks[kb]], [&prepared[kb]], &cols, kb, nb, &mut acc);
                }
            }
        }
        for h in 0..r {
            for c in 0..n_cols {
                out[c * n_rows + i + h] = acc[c / GROUP][h][c % GROUP];
            }
        }
        i += r;
    }
}

/// What [`block_vnni`] needs of a block besides its values and scales.
#[derive(Default)]
struct Prepared {
    /// What the activations' +128 adds to the sum of a format without minimums: 128 * sum
    /// over the 16s of multiplier * sum of values.
    bias: i32,
    /// Whether each 32 has one multiplier (most formats): one multiply for both its 16s.
    paired: bool,
    /// `-dmin` and the minimums as pairs of i16 (`2p` low, `2p + 1` high), if the format has them.
    mins: Option<(f32, [i32; 8])>,
}

#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn prepare(x: &TiledBlock, p: &mut Prepared) {
    p.paired = (0..QK_K / 32).all(|j| x.scale16[2 * j] == x.scale16[2 * j + 1]);
    if let Some(m) = &x.mins {
        let pairs: [i32; 8] = std::array::from_fn(|p| pack(m.min16[2 * p], m.min16[2 * p + 1]));
        p.mins = Some((-m.dmin, pairs));
        p.bias = 0;
        return;
    }
    p.mins = None;
    let ones = _mm512_set1_epi8(1);
    let scales = _mm512_loadu_si512(x.scale16.as_ptr() as *const _);
    let mut bias = _mm512_setzero_si512();
    for k in 0..4 {
        let w = _mm512_loadu_si512(x.w.as_ptr().add(64 * k) as *const _);
        // lane l: the multiplier of 16 number 4k + l / 4
        let lanes = _mm512_permutexvar_epi32(
            _mm512_add_epi32(_mm512_set1_epi32(4 * k as i32), QUARTERS),
            scales,
        );
        let sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, w);
        bias = _mm512_add_epi32(bias, _mm512_mullo_epi32(sums, lanes));
    }
    p.bias = _mm512_reduce_add_epi32(_mm512_slli_epi32::<7>(bias));
}

/// Two i16 as the halves of an i32, `lo` in the low one.
fn pack(lo: i32, hi: i32) -> i32 {
    (lo & 0xffff) | (hi << 16)
}

/// Lane `l`: `l / 4`.
const QUARTERS: __m512i =
    unsafe { std::mem::transmute([0i32, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]) };

/// `R` rows' weight blocks against block `kb` of every group of columns, into their
/// accumulators (`acc[g][r]`).
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_vnni<const R: usize>(
    xs: [&TiledBlock; R],
    ps: [&Prepared; R],
    cols: &Columns,
    kb: usize,
    nb: usize,
    acc: &mut [[[f32; GROUP]; 2]],
) {
    // all rows' 32s with one multiplier, else each 16 by its own (always right)
    let paired = ps.iter().all(|p| p.paired);
    let unsigned = ps[0].mins.is_some();
    for (g, a) in acc.iter_mut().enumerate() {
        let at = g * nb + kb;
        let q = cols.q.as_ptr().add(at * QBYTES);
        let s = match (paired, unsigned) {
            (true, true) => sums::<R, true, true>(xs, q),
            (true, false) => sums::<R, true, false>(xs, q),
            (false, true) => sums::<R, false, true>(xs, q),
            (false, false) => sums::<R, false, false>(xs, q),
        };
        let dy = _mm256_loadu_ps(cols.d.as_ptr().add(at * GROUP));
        for r in 0..R {
            let (x, p) = (xs[r], ps[r]);
            let s = _mm256_sub_epi32(s[r], _mm256_set1_epi32(p.bias));
            let mut v = _mm256_mul_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(x.d));
            if let Some((neg_dmin, pairs)) = &p.mins {
                let bs = cols.bsums.as_ptr().add(at * SBYTES);
                let mut m = _mm256_setzero_si256();
                for (p, &pair) in pairs.iter().enumerate() {
                    let b = _mm256_loadu_si256(bs.add(GROUP * p) as *const __m256i);
                    m = _mm256_dpwssd_epi32(m, _mm256_set1_epi32(pair), b);
                }
                v = _mm256_fmadd_ps(_mm256_set1_ps(*neg_dmin), _mm256_cvtepi32_ps(m), v);
            }
            let v = _mm256_fmadd_ps(v, dy, _mm256_loadu_ps(a[r].as_ptr()));
            _mm256_storeu_ps(a[r].as_mut_ptr(), v);
        }
    }
}

/// The sums `S` (`S + bias` unless `UNSIGNED`: see [`multi`]) of `R` rows' blocks against one
/// group's block at `q`: the products of each 16 (both 16s of a 32 at once when `PAIRED`, their
/// multipliers being equal) times the multiplier, a column's two lanes added at the end. Not
/// inlined: the broadcasts stay loads rather than being hoisted out of the loop over the groups.
#[inline(never)]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn sums<const R: usize, const PAIRED: bool, const UNSIGNED: bool>(
    xs: [&TiledBlock; R],
    q: *const u8,
) -> [__m256i; R] {
    let mut s = [_mm512_setzero_si512(); R];
    for j in 0..QK_K / 32 {
        let mut t = [[_mm512_setzero_si512(); 2]; R];
        for e in 0..4 {
            let pair = 4 * j + e;
            let y = _mm512_loadu_si512(q.add(64 * pair) as *const _);
            for r in 0..R {
                let w = (xs[r].w.as_ptr() as *const i64).add(pair).read_unaligned();
                let b = _mm512_set1_epi64(w);
                t[r][e / 2] = if UNSIGNED {
                    _mm512_dpbusd_epi32(t[r][e / 2], b, y)
                } else {
                    _mm512_dpbusd_epi32(t[r][e / 2], y, b)
                };
            }
        }
        for r in 0..R {
            let sc = &xs[r].scale16;
            if PAIRED {
                let t = _mm512_add_epi32(t[r][0], t[r][1]);
                let m = _mm512_set1_epi32(sc[2 * j]);
                s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(t, m));
            } else {
                for (h, t) in t[r].iter().enumerate() {
                    let m = _mm512_set1_epi32(sc[2 * j + h]);
                    s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(*t, m));
                }
            }
        }
    }
    let mut out = [_mm256_setzero_si256(); R];
    for r in 0..R {
        out[r] = _mm512_cvtepi64_epi32(_mm512_add_epi32(s[r], _mm512_srli_epi64::<32>(s[r])));
    }
    out
}

/// A repacked Q4_K block as [`gemm_block`] meets it: the nibbles in element order, `d`, `dmin`,
/// the sub-blocks' scales and their minimums doubled into i16 pairs (one factor of both sums of
/// 16 of a sub-block).
struct Q4KBlock {
    w: [u8; QK_K],
    d: f32,
    dmin: f32,
    scales: [i32; 8],
    mins: [i32; 8],
}

impl Q4KBlock {
    const ZERO: Q4KBlock = Q4KBlock {
        w: [0; QK_K],
        d: 0.0,
        dmin: 0.0,
        scales: [0; 8],
        mins: [0; 8],
    };
}

/// `x` unpacked into `t`.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_q4_k(x: &crate::k_quants::BlockQ4K, t: &mut Q4KBlock) {
    k4_values::<false>(x.qs.as_ptr(), std::ptr::null(), t.w.as_mut_ptr());
    let (sc, mn) = k4_scale_min_bytes(x.scales.as_ptr());
    t.d = f16_at(x.d.as_ptr());
    t.dmin = f16_at(x.dmin.as_ptr());
    t.scales = sc.map(|s| s as i32);
    t.mins = mn.map(|m| pack(m as i32, m as i32));
}

/// `repack::multi_q4_k` (llama.cpp's CPU_REPACK gemm for the first `n_cols - n_cols % 4`
/// columns, its gemv for the rest) with the gemm's columns in the lanes as in [`multi`]: the
/// nibbles unsigned, no bias; per 64 elements the same two fmas in every lane. Handed out only
/// after run-time detection of AVX512-VNNI (`avx2::repack_multi_q4_k`); lengths as
/// `DotKernel::dot_rows_multi` checked them.
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
    use crate::k_quants::BlockQ4K;
    assert!(has_avx512_vnni());
    let gemm_cols = n_cols - n_cols % 4;
    let nb = n / QK_K;
    let rb = nb * std::mem::size_of::<BlockQ4K>();
    assert!(out.len() >= n_rows * n_cols);
    if gemm_cols > 0 {
        let cols = rearrange(acts, act_stride, gemm_cols, nb, 0);
        let ng = gemm_cols.div_ceil(GROUP);
        // two rows at a time, as `multi`: acc[g][r] holds row r's `acc` and `acc_min`
        let mut acc = vec![[[[0f32; GROUP]; 2]; 2]; ng];
        let mut blocks: Vec<Q4KBlock> = (0..2 * nb).map(|_| Q4KBlock::ZERO).collect();
        let mut i = 0;
        while i < n_rows {
            let r = if i + 1 < n_rows { 2 } else { 1 };
            for h in 0..r {
                let at = (i + h) * row_stride;
                let row: &[BlockQ4K] = bytemuck::cast_slice(&rows[at..at + rb]);
                for (x, t) in row.iter().zip(&mut blocks[h * nb..(h + 1) * nb]) {
                    // SAFETY: the features were asserted above; the loads read within `x`.
                    unsafe { unpack_q4_k(x, t) };
                }
            }
            acc.iter_mut().for_each(|a| *a = [[[0.0; GROUP]; 2]; 2]);
            for b in 0..nb {
                for (g, a) in acc.iter_mut().enumerate() {
                    // SAFETY: as above; `cols` holds `nb` blocks of each of the `ng` groups.
                    unsafe {
                        if r == 2 {
                            gemm_block::<2>([&blocks[b], &blocks[nb + b]], &cols, g * nb + b, a);
                        } else {
                            gemm_block::<1>([&blocks[b]], &cols, g * nb + b, a);
                        }
                    }
                }
            }
            for h in 0..r {
                for c in 0..gemm_cols {
                    let a = &acc[c / GROUP][h];
                    out[c * n_rows + i + h] = a[0][c % GROUP] - a[1][c % GROUP];
                }
            }
            i += r;
        }
    }
    if n_cols > gemm_cols {
        super::repack_multi_with(
            true,
            n,
            rows,
            row_stride,
            n_rows,
            &acts[gemm_cols * act_stride..],
            act_stride,
            n_cols - gemm_cols,
            &mut out[gemm_cols * n_rows..],
        );
    }
}

/// `R` rows' blocks against block `at` of a group's columns, into their `acc` and `acc_min`
/// (`acc[r]`): per 64 elements (two sub-blocks) `S` and `M` of each column, then the gemm's two
/// fmas. Not inlined, as [`sums`].
#[inline(never)]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn gemm_block<const R: usize>(
    ts: [&Q4KBlock; R],
    cols: &Columns,
    at: usize,
    acc: &mut [[[f32; GROUP]; 2]; 2],
) {
    let q = cols.q.as_ptr().add(at * QBYTES);
    let bs = cols.bsums.as_ptr().add(at * SBYTES);
    let yd = _mm256_loadu_ps(cols.d.as_ptr().add(at * GROUP));
    let mut dd = [_mm256_setzero_ps(); R];
    let mut dm = [_mm256_setzero_ps(); R];
    let mut a = [_mm256_setzero_ps(); R];
    let mut am = [_mm256_setzero_ps(); R];
    for r in 0..R {
        dd[r] = _mm256_mul_ps(_mm256_set1_ps(ts[r].d), yd);
        dm[r] = _mm256_mul_ps(_mm256_set1_ps(ts[r].dmin), yd);
        a[r] = _mm256_loadu_ps(acc[r][0].as_ptr());
        am[r] = _mm256_loadu_ps(acc[r][1].as_ptr());
    }
    for p in 0..4 {
        let mut s = [_mm512_setzero_si512(); R];
        let mut m = [_mm256_setzero_si256(); R];
        for j in [2 * p, 2 * p + 1] {
            let mut dot = [_mm512_setzero_si512(); R];
            for e in 0..4 {
                let pair = 4 * j + e;
                let y = _mm512_loadu_si512(q.add(64 * pair) as *const _);
                for r in 0..R {
                    let w = (ts[r].w.as_ptr() as *const i64).add(pair).read_unaligned();
                    dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi64(w), y);
                }
            }
            let sums = _mm256_loadu_si256(bs.add(GROUP * j) as *const __m256i);
            for r in 0..R {
                let scale = _mm512_set1_epi32(ts[r].scales[j]);
                s[r] = _mm512_add_epi32(s[r], _mm512_mullo_epi32(dot[r], scale));
                m[r] = _mm256_dpwssd_epi32(m[r], _mm256_set1_epi32(ts[r].mins[j]), sums);
            }
        }
        for r in 0..R {
            let sr = _mm512_add_epi32(s[r], _mm512_srli_epi64::<32>(s[r]));
            let sr = _mm512_cvtepi64_epi32(sr);
            a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sr), dd[r], a[r]);
            am[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(m[r]), dm[r], am[r]);
        }
    }
    for r in 0..R {
        _mm256_storeu_ps(acc[r][0].as_mut_ptr(), a[r]);
        _mm256_storeu_ps(acc[r][1].as_mut_ptr(), am[r]);
    }
}

/// The 32 bytes at `p` where a format has high bits (`ON`), else zeros.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn high_bits<const ON: bool>(p: *const u8) -> __m256i {
    if ON {
        _mm256_loadu_si256(p as *const __m256i)
    } else {
        _mm256_setzero_si256()
    }
}

/// Q4_K's (`Q5 = false`) or Q5_K's values (0..=31) in element order into `w`: the nibbles of
/// `qs`, with Q5_K the fifth bits of `qh`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn k4_values<const Q5: bool>(qs: *const u8, qh: *const u8, w: *mut u8) {
    let (nibble, one) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
    let mut high = high_bits::<Q5>(qh);
    for p in 0..4 {
        let raw = _mm256_loadu_si256(qs.add(32 * p) as *const __m256i);
        for (h, v) in [raw, _mm256_srli_epi16::<4>(raw)].into_iter().enumerate() {
            let mut v = _mm256_and_si256(v, nibble);
            if Q5 {
                // bit 2p + h of each qh byte (the bits above within a byte are masked off)
                v = _mm256_or_si256(v, _mm256_slli_epi16::<4>(_mm256_and_si256(high, one)));
                high = _mm256_srli_epi16::<1>(high);
            }
            _mm256_storeu_si256(w.add(64 * p + 32 * h) as *mut __m256i, v);
        }
    }
}

/// The tiled kernel's view of a Q4_K block (`k_quants::tiled_q4_k`) into `t`, with AVX2.
/// Handed out only after run-time detection (`kernel::tiled_fn`).
pub(crate) fn tiled_q4_k(b: &[u8], t: &mut TiledBlock) {
    let x: &crate::k_quants::BlockQ4K = bytemuck::from_bytes(b);
    // SAFETY: avx2 was detected; the loads read within the block.
    unsafe { k4_values::<false>(x.qs.as_ptr(), std::ptr::null(), t.w.as_mut_ptr() as *mut u8) };
    k4_view(t, x.d, x.dmin, &x.scales);
}

/// The tiled kernel's view of a Q5_K block into `t`, with AVX2 (as [`tiled_q4_k`]).
pub(crate) fn tiled_q5_k(b: &[u8], t: &mut TiledBlock) {
    let x: &crate::k_quants::BlockQ5K = bytemuck::from_bytes(b);
    // SAFETY: as in `tiled_q4_k`.
    unsafe { k4_values::<true>(x.qs.as_ptr(), x.qh.as_ptr(), t.w.as_mut_ptr() as *mut u8) };
    k4_view(t, x.d, x.dmin, &x.scales);
}

/// Q4_K's and Q5_K's scales and minimums, one per 32 values.
fn k4_view(t: &mut TiledBlock, d: [u8; 2], dmin: [u8; 2], scales: &[u8; 12]) {
    // SAFETY: avx2 and f16c were detected (`tiled_q4_k`); the reads stay within the arrays, the
    // stores within `t`.
    unsafe {
        let (sc, mn) = k4_scale_min_bytes(scales.as_ptr());
        t.d = f16_at(d.as_ptr());
        twice(sc, &mut t.scale16);
        let mut min16 = [0; 16];
        twice(mn, &mut min16);
        t.mins = Some(crate::tiled::TiledMins {
            dmin: f16_at(dmin.as_ptr()),
            min16,
        });
    }
}

/// Each of eight bytes twice, as i32.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn twice(v: [u8; 8], out: &mut [i32; 16]) {
    let v = _mm_cvtsi64_si128(i64::from_le_bytes(v));
    let v = _mm_unpacklo_epi8(v, v);
    let at = out.as_mut_ptr() as *mut __m256i;
    _mm256_storeu_si256(at, _mm256_cvtepu8_epi32(v));
    _mm256_storeu_si256(at.add(1), _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v)));
}

/// The tiled kernel's view of a Q2_K block (`k_quants::tiled_q2_k`) into `t`, with AVX2.
/// Handed out only after run-time detection (`kernel::tiled_fn`).
pub(crate) fn tiled_q2_k(b: &[u8], t: &mut TiledBlock) {
    let x: &crate::k_quants::BlockQ2K = bytemuck::from_bytes(b);
    // SAFETY: avx2 was detected; the loads read within the block, the stores within `t.w`.
    unsafe { low2_values::<false>(x.qs.as_ptr(), std::ptr::null(), t.w.as_mut_ptr()) };
    // SAFETY: f16c was detected (as above).
    t.d = unsafe { f16_at(x.d.as_ptr()) };
    t.scale16 = x.scales.map(|s| (s & 0x0f) as i32);
    t.mins = Some(crate::tiled::TiledMins {
        // SAFETY: as above.
        dmin: unsafe { f16_at(x.dmin.as_ptr()) },
        min16: x.scales.map(|s| (s >> 4) as i32),
    });
}

/// The tiled kernel's view of a Q3_K block into `t`, with AVX2 (as [`tiled_q2_k`]).
pub(crate) fn tiled_q3_k(b: &[u8], t: &mut TiledBlock) {
    let x: &crate::k_quants::BlockQ3K = bytemuck::from_bytes(b);
    // SAFETY: as in `tiled_q2_k`.
    unsafe { low2_values::<true>(x.qs.as_ptr(), x.hmask.as_ptr(), t.w.as_mut_ptr()) };
    // SAFETY: as in `tiled_q2_k`.
    t.d = unsafe { f16_at(x.d.as_ptr()) };
    t.scale16 = crate::k_quants::q3k_scales(&x.scales).map(|s| s as i32);
    t.mins = None;
}

/// Q2_K's (`Q3 = false`, 0..=3) or Q3_K's values (-4..=3: 4 off where the `hmask` bit is
/// clear) in element order into `w`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn low2_values<const Q3: bool>(qs: *const u8, hmask: *const u8, w: *mut i8) {
    let (three, one) = (_mm256_set1_epi8(3), _mm256_set1_epi8(1));
    let mut high = high_bits::<Q3>(hmask);
    for chunk in 0..2 {
        let mut raw = _mm256_loadu_si256(qs.add(32 * chunk) as *const __m256i);
        for j in 0..4 {
            let mut v = _mm256_and_si256(raw, three);
            raw = _mm256_srli_epi16::<2>(raw);
            if Q3 {
                // bit 4 chunk + j of each hmask byte: 0 or 4 added to `low - 4`
                let h = _mm256_slli_epi16::<2>(_mm256_and_si256(high, one));
                v = _mm256_sub_epi8(_mm256_add_epi8(v, h), _mm256_set1_epi8(4));
                high = _mm256_srli_epi16::<1>(high);
            }
            _mm256_storeu_si256(w.add(128 * chunk + 32 * j) as *mut __m256i, v);
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::{dot_kernel_scalar, matrix_kernel, KernelOptions, TensorType};

    /// A xorshift stream.
    pub(crate) fn stream(seed: u64) -> impl FnMut() -> u64 {
        let mut s = seed;
        move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        }
    }

    /// `count` Q8_K rows of `n` elements: random quants, often at the extremes, their sums.
    fn act_rows(n: usize, count: usize, next: &mut impl FnMut() -> u64) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..count * n / 256 {
            let d = (next() % 1000) as f32 / 997.0 + 0.01;
            let q: Vec<i8> = (0..256)
                .map(|_| match next() % 8 {
                    0 => 127,
                    1 => -127,
                    _ => ((next() % 255) as i32 - 127) as i8,
                })
                .collect();
            out.extend(d.to_le_bytes());
            out.extend(q.iter().map(|&v| v as u8));
            for j in 0..16 {
                let s: i16 = q[16 * j..16 * j + 16].iter().map(|&v| v as i16).sum();
                out.extend(s.to_le_bytes());
            }
        }
        out
    }

    /// `count` weight rows of `n` elements of `ty`: random bytes with moderate f16 scales for
    /// the K-quants (at the byte offsets given), random valid blocks for the others.
    fn weight_rows(
        ty: TensorType,
        n: usize,
        count: usize,
        next: &mut impl FnMut() -> u64,
    ) -> Vec<u8> {
        use TensorType as T;
        let rb = crate::row_bytes(ty, n).unwrap();
        let mut out = vec![0u8; rb * count];
        let scales: &[usize] = match ty {
            T::Q2_K => &[80, 82],
            T::Q3_K => &[108],
            T::Q4_K | T::Q5_K => &[0, 2],
            T::Q6_K => &[208],
            _ => &[],
        };
        for row in out.chunks_exact_mut(rb) {
            if scales.is_empty() {
                row.copy_from_slice(&crate::random_blocks(ty, n, 1.0, next).unwrap());
                continue;
            }
            row.iter_mut().for_each(|b| *b = next() as u8);
            for block in row.chunks_exact_mut(ty.block_bytes()) {
                for &at in scales {
                    let h = 0x2000 + (next() % 0x1c00) as u16;
                    block[at..at + 2].copy_from_slice(&h.to_le_bytes());
                }
            }
        }
        out
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The columns-in-lanes tiled batch and the repacked Q4_K gemm give the scalar reference's
    /// bits: odd row counts, column counts off the groups of 8 (and off the gemm's 4).
    #[test]
    fn columns_in_lanes_match_the_scalar_reference() {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
        if !(avx2 && super::has_avx512_vnni()) {
            return;
        }
        let mut next = stream(0x9e37_79b9_7f4a_7c15);
        use TensorType as T;
        for ty in [
            T::Q2_K,
            T::Q3_K,
            T::Q4_K,
            T::Q5_K,
            T::Q6_K,
            T::IQ1_S,
            T::IQ1_M,
            T::IQ2_XXS,
            T::IQ2_XS,
            T::IQ2_S,
            T::IQ3_XXS,
            T::IQ3_S,
            T::IQ4_XS,
        ] {
            for (n, n_rows, n_cols) in [(256, 3, 8), (768, 5, 13), (512, 8, 29), (512, 16, 10)] {
                let rows = weight_rows(ty, n, n_rows, &mut next);
                let acts = act_rows(n, n_cols, &mut next);
                let (rb, ab) = (rows.len() / n_rows, acts.len() / n_cols);
                // of a matrix of 16 rows: Q4_K through the repacked gemm (and gemv for the last
                // columns), also for a part of 3 or 5 of its rows
                for matrix in [n_rows, 16] {
                    let fast = matrix_kernel(ty, matrix, &KernelOptions::default()).unwrap();
                    let reference = if fast.repacked() {
                        let options = KernelOptions {
                            scalar: true,
                            ..Default::default()
                        };
                        matrix_kernel(ty, matrix, &options).unwrap()
                    } else {
                        dot_kernel_scalar(ty).unwrap()
                    };
                    let mut got = vec![0f32; n_rows * n_cols];
                    fast.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut got);
                    let mut want = vec![0f32; n_rows * n_cols];
                    reference.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut want);
                    let what = format!("{ty} {n_rows} of {matrix} x {n} x {n_cols}");
                    assert_eq!(bits(&got), bits(&want), "{what}");
                }
            }
        }
    }
}
