//! llama.cpp's tiled batch (`tiled::multi`'s arithmetic) with AVX512-VNNI, the columns in the
//! lanes: eight activation columns rearranged once so that two quads of each sit side by side
//! (`vpdpbusd` of them, biased to unsigned, with two quads of a weight row broadcast), so a
//! block's exact integer sums `S` of eight columns come out in one register without a
//! horizontal sum, and the fmas of `tiled::accumulate` run lane by lane, the same per lane.

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

/// The activation columns rearranged, per (group of 8 columns, block): values + 128 with quad
/// `2i + h` of column `c` at dword `16i + 2c + h`; the scales `d`; the sums of 16 `2p` and `2p + 1` of
/// column `c` as the i16 halves of dword `8p + c`. Missing columns of the last group are zeros.
struct Columns {
    q: Vec<u8>,
    d: Vec<f32>,
    bsums: Vec<i32>,
}

fn rearrange(acts: &[u8], act_stride: usize, n_cols: usize, nb: usize) -> Columns {
    let ng = n_cols.div_ceil(GROUP);
    let mut p = Columns {
        q: vec![128; ng * nb * QBYTES],
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
                    q[((quad / 2 * GROUP + l) * 2 + quad % 2) * 4 + e] = b ^ 0x80;
                }
            }
            p.d[at * GROUP + l] = y.d();
            for pair in 0..QK_K / 32 {
                let (lo, hi) = (y.bsum(2 * pair), y.bsum(2 * pair + 1));
                p.bsums[at * SBYTES + pair * GROUP + l] = (lo & 0xffff) | (hi << 16);
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
    let cols = rearrange(acts, act_stride, n_cols, nb);
    let mut acc = vec![[0f32; GROUP]; n_cols.div_ceil(GROUP)];
    // a row's blocks unpacked and prepared before their products: the stores of one pass are
    // done when the next reads them (a wide load of narrow stores waits for them otherwise)
    let mut blocks: Vec<TiledBlock> = (0..nb).map(|_| TiledBlock::ZERO).collect();
    let mut prepared: Vec<Prepared> = (0..nb).map(|_| Prepared::default()).collect();
    for i in 0..n_rows {
        let row = &rows[i * row_stride..i * row_stride + rb];
        acc.iter_mut().for_each(|a| *a = [0.0; GROUP]);
        for (x, xb) in blocks.iter_mut().zip(row.chunks_exact(block_bytes)) {
            unpack(xb, x);
        }
        for (x, p) in blocks.iter().zip(prepared.iter_mut()) {
            // SAFETY: the features were asserted above.
            unsafe { prepare(x, p) };
        }
        for (kb, (x, p)) in blocks.iter().zip(&prepared).enumerate() {
            // SAFETY: as above; `cols` holds `nb` blocks of every group of `acc`, `kb < nb`.
            unsafe { block_vnni(x, p, &cols, kb, nb, &mut acc) };
        }
        for c in 0..n_cols {
            out[c * n_rows + i] = acc[c / GROUP][c % GROUP];
        }
    }
}

/// What [`block_vnni`] needs of a block besides its values and scales.
#[derive(Default)]
struct Prepared {
    /// What the activations' +128 adds to the sum: 128 * sum over the 16s of multiplier *
    /// sum of values.
    bias: i32,
    /// Whether each 32 has one multiplier (most formats): one multiply for both its 16s.
    paired: bool,
    /// `-dmin` and the minimums as pairs of i16 (`2p` low, `2p + 1` high), if the format has them.
    mins: Option<(f32, [i32; 8])>,
}

#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn prepare(x: &TiledBlock, p: &mut Prepared) {
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
    p.mins = x.mins.as_ref().map(|m| {
        let pairs: [i32; 8] =
            std::array::from_fn(|p| (m.min16[2 * p] & 0xffff) | (m.min16[2 * p + 1] << 16));
        (-m.dmin, pairs)
    });
    p.paired = (0..QK_K / 32).all(|j| x.scale16[2 * j] == x.scale16[2 * j + 1]);
}

/// Lane `l`: `l / 4`.
const QUARTERS: __m512i =
    unsafe { std::mem::transmute([0i32, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]) };

/// One weight block against block `kb` of every group of columns, into their accumulators.
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn block_vnni(
    x: &TiledBlock,
    p: &Prepared,
    cols: &Columns,
    kb: usize,
    nb: usize,
    acc: &mut [[f32; 8]],
) {
    let d = _mm256_set1_ps(x.d);
    for (g, a) in acc.iter_mut().enumerate() {
        let at = g * nb + kb;
        let q = cols.q.as_ptr().add(at * QBYTES);
        let s = if p.paired {
            sums::<true>(x, q)
        } else {
            sums::<false>(x, q)
        };
        let s = _mm256_sub_epi32(s, _mm256_set1_epi32(p.bias));
        let mut r = _mm256_mul_ps(_mm256_cvtepi32_ps(s), d);
        if let Some((neg_dmin, pairs)) = &p.mins {
            let bs = cols.bsums.as_ptr().add(at * SBYTES);
            let mut m = _mm256_setzero_si256();
            for (p, &pair) in pairs.iter().enumerate() {
                let b = _mm256_loadu_si256(bs.add(GROUP * p) as *const __m256i);
                m = _mm256_dpwssd_epi32(m, _mm256_set1_epi32(pair), b);
            }
            r = _mm256_fmadd_ps(_mm256_set1_ps(*neg_dmin), _mm256_cvtepi32_ps(m), r);
        }
        let dy = _mm256_loadu_ps(cols.d.as_ptr().add(at * GROUP));
        let v = _mm256_fmadd_ps(r, dy, _mm256_loadu_ps(a.as_ptr()));
        _mm256_storeu_ps(a.as_mut_ptr(), v);
    }
}

/// The biased sums `S + bias` of one block against one group's block at `q`: the products of
/// each 16 (both 16s of a 32 at once when `PAIRED`, their multipliers being equal) times the
/// multiplier, a column's two lanes added at the end. Not inlined: the broadcasts stay loads
/// rather than being hoisted out of the loop over the groups.
#[inline(never)]
#[target_feature(enable = "avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn sums<const PAIRED: bool>(x: &TiledBlock, q: *const u8) -> __m256i {
    let w = x.w.as_ptr() as *const i64;
    let mut s = _mm512_setzero_si512();
    for j in 0..QK_K / 32 {
        let mut t = [_mm512_setzero_si512(); 2];
        for e in 0..4 {
            let pair = 4 * j + e;
            let y = _mm512_loadu_si512(q.add(64 * pair) as *const _);
            let b = _mm512_set1_epi64(w.add(pair).read_unaligned());
            t[e / 2] = _mm512_dpbusd_epi32(t[e / 2], y, b);
        }
        if PAIRED {
            let t = _mm512_add_epi32(t[0], t[1]);
            s = _mm512_add_epi32(
                s,
                _mm512_mullo_epi32(t, _mm512_set1_epi32(x.scale16[2 * j])),
            );
        } else {
            for (h, t) in t.iter().enumerate() {
                let m = _mm512_set1_epi32(x.scale16[2 * j + h]);
                s = _mm512_add_epi32(s, _mm512_mullo_epi32(*t, m));
            }
        }
    }
    _mm512_cvtepi64_epi32(_mm512_add_epi32(s, _mm512_srli_epi64::<32>(s)))
}
