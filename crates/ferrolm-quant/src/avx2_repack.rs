//! llama.cpp's repacked Q4_0, IQ4_NL and MXFP4 products (`repack::gemv_b32`'s arithmetic) with AVX2
//! and, where the CPU has it, AVX512-VNNI: eight rows side by side, lane r of one float vector
//! holding row r's chain, as llama.cpp's own kernels hold eight rows, against up to four
//! columns at once; the rest of the rows one at a time. The block sums are exact integers, so
//! how they are added up does not matter; the float steps are the reference's.

use std::arch::x86_64::*;

use super::f16_at;
use crate::legacy::BlockQ8_0;
use crate::repack::Nibbles;

const AB: usize = std::mem::size_of::<BlockQ8_0>();
/// Where the activation's quants start (after its f16 scale).
const QS: usize = 2;

/// `DotKernel::dot` of a repacked row. Handed out only after run-time detection of AVX2, FMA
/// and F16C (`kernel::build_repacked`); `row` and `act` are exactly the blocks of `n`
/// elements.
pub(crate) fn dot<V: Nibbles>(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = n / crate::legacy::QK;
    assert!(row.len() >= nb * V::BYTES && act.len() >= nb * AB);
    // SAFETY: the features were detected before this function was handed out; the loads read
    // within the `nb` blocks of both (checked above).
    unsafe { dot_one::<V>(nb, row.as_ptr(), act.as_ptr()) }
}

/// `DotKernel::dot_rows` of repacked rows, under the same conditions as [`dot`].
pub(crate) fn rows<V: Nibbles>(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    act: &[u8],
    out: &mut [f32],
) {
    multi::<V>(n, rows, row_stride, out.len(), act, 0, 1, out)
}

/// `DotKernel::dot_rows_multi` of repacked rows (every element the gemv's), under the same
/// conditions as [`dot`]: each group of eight rows met by every column while it is in cache.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
pub(crate) fn multi<V: Nibbles>(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    let vnni = super::has_avx512_vnni();
    multi_with::<V>(
        vnni, n, rows, row_stride, n_rows, acts, act_stride, n_cols, out,
    )
}

/// [`multi`], the groups of eight rows by AVX512-VNNI when `vnni` (which the CPU must have),
/// by AVX2 otherwise.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
fn multi_with<V: Nibbles>(
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
    let nb = n / crate::legacy::QK;
    assert!(!vnni || super::has_avx512_vnni());
    if n_rows == 0 || n_cols == 0 {
        return;
    }
    assert!(rows.len() >= (n_rows - 1) * row_stride + nb * V::BYTES);
    assert!(acts.len() >= (n_cols - 1) * act_stride + nb * AB);
    assert!(out.len() >= n_rows * n_cols);
    let octets = n_rows / 8;
    let col = |c: usize| acts.as_ptr().wrapping_add(c * act_stride);
    let group = |g: usize| rows.as_ptr().wrapping_add(8 * g * row_stride);
    if vnni {
        // each column's block sums of quants, computed once for all the rows
        let sums: Vec<i32> = (0..n_cols * nb)
            .map(|i| {
                let at = (i / nb) * act_stride + (i % nb) * AB + QS;
                acts[at..at + crate::legacy::QK]
                    .iter()
                    .map(|&q| q as i8 as i32)
                    .sum()
            })
            .collect();
        let y = |c: usize| (col(c), sums.as_ptr().wrapping_add(c * nb));
        // SAFETY (both): the features were detected; rows 8g..8g + 8, the columns and their
        // sums lie within the checked lengths.
        let quad = |g, cs: [usize; 4]| unsafe {
            dot_eight_vnni::<V, 4>(nb, group(g), row_stride, cs.map(y))
        };
        let one = |g, c| unsafe { dot_eight_vnni::<V, 1>(nb, group(g), row_stride, [y(c)]) };
        eight_row_groups(n_rows, n_cols, out, quad, one);
    } else {
        // SAFETY (both): as in `dot`; rows 8g..8g + 8 and the columns lie within the checked
        // lengths.
        let quad =
            |g, cs: [usize; 4]| unsafe { dot_eight::<V, 4>(nb, group(g), row_stride, cs.map(col)) };
        let one = |g, c| unsafe { dot_eight::<V, 1>(nb, group(g), row_stride, [col(c)]) };
        eight_row_groups(n_rows, n_cols, out, quad, one);
    }
    for i in 8 * octets..n_rows {
        for c in 0..n_cols {
            // SAFETY: as in `dot`; row i and column c lie within the checked lengths.
            out[c * n_rows + i] = unsafe {
                dot_one::<V>(
                    nb,
                    rows.as_ptr().add(i * row_stride),
                    acts.as_ptr().add(c * act_stride),
                )
            };
        }
    }
}

/// Every group of eight rows (`g`) against every column into `out` (column c at
/// `c * n_rows`): `quad(g, columns)` four columns at a time, `one(g, c)` for the rest.
fn eight_row_groups(
    n_rows: usize,
    n_cols: usize,
    out: &mut [f32],
    quad: impl Fn(usize, [usize; 4]) -> [[f32; 8]; 4],
    one: impl Fn(usize, usize) -> [[f32; 8]; 1],
) {
    for g in 0..n_rows / 8 {
        let mut store = |c: usize, s: &[f32; 8]| {
            out[c * n_rows + 8 * g..c * n_rows + 8 * g + 8].copy_from_slice(s)
        };
        let quads = n_cols / 4;
        for q in 0..quads {
            let cs = [4 * q, 4 * q + 1, 4 * q + 2, 4 * q + 3];
            for (c, s) in cs.into_iter().zip(&quad(g, cs)) {
                store(c, s);
            }
        }
        for c in 4 * quads..n_cols {
            store(c, &one(g, c)[0]);
        }
    }
}

/// [`dot_eight`] by AVX512-VNNI: the eight rows' blocks transposed so that lane r holds row
/// r's quants four by four, offset to unsigned bytes for `vpdpbusd`, which then sums straight
/// into lane r; the offset comes back off through the column's block sums (`ys`' second
/// pointers). Exact integers all along, as in the reference.
#[inline]
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn dot_eight_vnni<V: Nibbles, const C: usize>(
    nb: usize,
    x: *const u8,
    stride: usize,
    ys: [(*const u8, *const i32); C],
) -> [[f32; 8]; C] {
    const OFFSET: i32 = 128;
    let table = _mm256_add_epi8(table_of(&V::VALUES), _mm256_set1_epi8(OFFSET as u8 as i8));
    let m = _mm256_set1_epi8(0x0f);
    let mut acc = [_mm256_setzero_ps(); C];
    for b in 0..nb {
        let xb = |r: usize| x.add(r * stride + b * V::BYTES);
        let pair = |r: usize| {
            let lo = _mm_loadu_si128(xb(r).add(V::SCALE_BYTES) as *const __m128i);
            let hi = _mm_loadu_si128(xb(r + 4).add(V::SCALE_BYTES) as *const __m128i);
            _mm256_set_m128i(hi, lo)
        };
        // rows r and r + 4 in the two halves, then a transpose of four by four within each
        // half: t[j] holds the jth four bytes of every row, lane r row r
        let (a0, a1, a2, a3) = (pair(0), pair(1), pair(2), pair(3));
        let (u0, u1) = (_mm256_unpacklo_epi32(a0, a1), _mm256_unpackhi_epi32(a0, a1));
        let (u2, u3) = (_mm256_unpacklo_epi32(a2, a3), _mm256_unpackhi_epi32(a2, a3));
        let t = [
            _mm256_unpacklo_epi64(u0, u2),
            _mm256_unpackhi_epi64(u0, u2),
            _mm256_unpacklo_epi64(u1, u3),
            _mm256_unpackhi_epi64(u1, u3),
        ];
        // the low nibbles of group j meet the activation's group j, the high ones the group
        // half a block further
        let w: [__m256i; 8] = std::array::from_fn(|k| {
            let nib = if k < 4 {
                _mm256_and_si256(t[k], m)
            } else {
                _mm256_and_si256(_mm256_srli_epi16(t[k - 4], 4), m)
            };
            _mm256_shuffle_epi8(table, nib)
        });
        let dx = row_scales::<V>(xb);
        for (acc, (y, ysum)) in acc.iter_mut().zip(ys) {
            let yb = y.add(b * AB);
            let yq = yb.add(QS) as *const i32;
            let quad = |k: usize| _mm256_set1_epi32(yq.add(k).read_unaligned());
            let mut even = _mm256_set1_epi32(-OFFSET * *ysum.add(b));
            let mut odd = _mm256_setzero_si256();
            for k in (0..8).step_by(2) {
                even = _mm256_dpbusd_epi32(even, w[k], quad(k));
                odd = _mm256_dpbusd_epi32(odd, w[k + 1], quad(k + 1));
            }
            let s = _mm256_add_epi32(even, odd);
            let d = _mm256_mul_ps(dx, _mm256_set1_ps(f16_at(yb)));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, *acc);
        }
    }
    acc.map(|a| std::mem::transmute::<__m256, [f32; 8]>(a))
}

/// One block's quants (the nibble bytes at `qs`) looked up in `table` and multiplied with the
/// activation's signed bytes `y`: partial sums in i32 lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn block_products(table: __m256i, qs: *const u8, y: __m256i) -> __m256i {
    let packed = _mm_loadu_si128(qs as *const __m128i);
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(packed, m);
    let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), m);
    let w = _mm256_shuffle_epi8(table, _mm256_set_m128i(hi, lo));
    // |w| times y with w's sign: maddubs' pairs stay far from saturation for both tables
    let pairs = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
    _mm256_madd_epi16(pairs, _mm256_set1_epi16(1))
}

#[inline]
#[target_feature(enable = "avx2")]
unsafe fn table_of(values: &[i8; 16]) -> __m256i {
    _mm256_broadcastsi128_si256(_mm_loadu_si128(values.as_ptr() as *const __m128i))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_one<V: Nibbles>(nb: usize, x: *const u8, y: *const u8) -> f32 {
    let table = table_of(&V::VALUES);
    let mut acc = 0f32;
    for b in 0..nb {
        let (xb, yb) = (x.add(b * V::BYTES), y.add(b * AB));
        let p = block_products(
            table,
            xb.add(V::SCALE_BYTES),
            _mm256_loadu_si256(yb.add(QS).cast()),
        );
        let s = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
        let s = _mm_cvtsi128_si32(s);
        acc = (s as f32).mul_add(block_scale::<V>(xb) * f16_at(yb), acc);
    }
    acc
}

/// Rows `x`, `x + stride`, ... (eight) against the `C` columns `ys`: lane r of output c is row
/// r's chain against column c. Each row's block is decoded once for all the columns.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_eight<V: Nibbles, const C: usize>(
    nb: usize,
    x: *const u8,
    stride: usize,
    ys: [*const u8; C],
) -> [[f32; 8]; C] {
    let table = table_of(&V::VALUES);
    let m = _mm_set1_epi8(0x0f);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [_mm256_setzero_ps(); C];
    for b in 0..nb {
        let xb = |r: usize| x.add(r * stride + b * V::BYTES);
        let w: [__m256i; 8] = std::array::from_fn(|r| {
            let packed = _mm_loadu_si128(xb(r).add(V::SCALE_BYTES) as *const __m128i);
            let lo = _mm_and_si128(packed, m);
            let hi = _mm_and_si128(_mm_srli_epi16(packed, 4), m);
            _mm256_shuffle_epi8(table, _mm256_set_m128i(hi, lo))
        });
        let aw: [__m256i; 8] = std::array::from_fn(|r| _mm256_sign_epi8(w[r], w[r]));
        let dx = row_scales::<V>(xb);
        for (acc, y) in acc.iter_mut().zip(ys) {
            let yb = y.add(b * AB);
            let yq = _mm256_loadu_si256(yb.add(QS).cast());
            // |w| times y with w's sign: maddubs' pairs stay far from saturation
            let p: [__m256i; 8] = std::array::from_fn(|r| {
                let pairs = _mm256_maddubs_epi16(aw[r], _mm256_sign_epi8(yq, w[r]));
                _mm256_madd_epi16(pairs, ones)
            });
            let s = lane_sums(&p);
            let d = _mm256_mul_ps(dx, _mm256_set1_ps(f16_at(yb)));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, *acc);
        }
    }
    acc.map(|a| std::mem::transmute::<__m256, [f32; 8]>(a))
}

/// Lane r: the sum of `p[r]`'s lanes.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn lane_sums(p: &[__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(p[0], p[1]);
    let h23 = _mm256_hadd_epi32(p[2], p[3]);
    let h45 = _mm256_hadd_epi32(p[4], p[5]);
    let h67 = _mm256_hadd_epi32(p[6], p[7]);
    let h0123 = _mm256_hadd_epi32(h01, h23);
    let h4567 = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256(h0123, h4567, 0x20),
        _mm256_permute2x128_si256(h0123, h4567, 0x31),
    )
}

/// The scales of eight blocks (at `xb(0)`..`xb(7)`) as f32 lanes.
#[inline]
#[target_feature(enable = "avx2,f16c")]
unsafe fn row_scales<V: Nibbles>(xb: impl Fn(usize) -> *const u8) -> __m256 {
    if V::SCALE_BYTES == 2 {
        let d = |r: usize| i16::from_le_bytes([*xb(r), *xb(r).add(1)]);
        _mm256_cvtph_ps(_mm_setr_epi16(
            d(0),
            d(1),
            d(2),
            d(3),
            d(4),
            d(5),
            d(6),
            d(7),
        ))
    } else {
        let d: [f32; 8] = std::array::from_fn(|r| block_scale::<V>(xb(r)));
        _mm256_loadu_ps(d.as_ptr())
    }
}

/// The scale of the block at `x`.
#[inline(always)]
unsafe fn block_scale<V: Nibbles>(x: *const u8) -> f32 {
    V::scale(std::slice::from_raw_parts(x, V::SCALE_BYTES))
}

#[cfg(test)]
mod tests {
    use crate::avx2::tiled512::tests::stream;
    use crate::{matrix_kernel, KernelOptions, TensorType};

    /// `count` rows of `n` elements of `ty` (Q8_0 activations when `None`): a scale of moderate
    /// size (an e8m0 one for MXFP4, at times the smallest), then random bytes (the activation's
    /// within Q8_0's range, often at its extremes).
    fn blocks(
        count: usize,
        n: usize,
        ty: Option<TensorType>,
        next: &mut impl FnMut() -> u64,
    ) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..count * n / 32 {
            if ty == Some(TensorType::MXFP4) {
                out.push(match next() % 8 {
                    0 => (next() % 2) as u8,
                    _ => 110 + (next() % 30) as u8,
                });
            } else {
                let h = 0x2000 + (next() % 0x2000) as u16;
                out.extend(h.to_le_bytes());
            }
            for _ in 0..if ty.is_none() { 32 } else { 16 } {
                out.push(match (ty, next() % 8) {
                    (Some(_), _) => next() as u8,
                    (None, 0) => 127,
                    (None, 1) => -127i8 as u8,
                    (None, _) => ((next() % 255) as i32 - 127) as i8 as u8,
                });
            }
        }
        out
    }

    /// The AVX2 and AVX512-VNNI paths give the scalar reference's bits for single dots, rows
    /// and batches: row counts off the groups of eight, column counts off the gemm's four.
    #[test]
    fn avx2_matches_the_scalar_reference() {
        if !(is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        {
            return;
        }
        let mut next = stream(0x2545_f491_4f6c_dd1d);
        let scalar = KernelOptions {
            scalar: true,
            ..Default::default()
        };
        for ty in [TensorType::Q4_0, TensorType::IQ4_NL, TensorType::MXFP4] {
            let fast = matrix_kernel(ty, 64, &KernelOptions::default()).unwrap();
            let reference = matrix_kernel(ty, 64, &scalar).unwrap();
            assert!(fast.repacked() && reference.repacked() && fast.isa() == "avx2");
            for (n, n_rows, n_cols) in [(32, 1, 1), (224, 3, 5), (224, 13, 7), (4096, 29, 6)] {
                let rows = blocks(n_rows, n, Some(ty), &mut next);
                let acts = blocks(n_cols, n, None, &mut next);
                let (rb, ab) = (rows.len() / n_rows, acts.len() / n_cols);
                let what = format!("{ty} {n_rows} x {n} x {n_cols}");
                let mut got = vec![0f32; n_rows * n_cols];
                fast.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut got);
                let mut want = vec![0f32; n_rows * n_cols];
                reference.dot_rows_multi(n, &rows, rb, n_rows, &acts, ab, n_cols, &mut want);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{what}");
                for vnni in [false, super::super::has_avx512_vnni()] {
                    let multi = match ty {
                        TensorType::Q4_0 => super::multi_with::<crate::repack::Q4_0>,
                        TensorType::IQ4_NL => super::multi_with::<crate::repack::Iq4Nl>,
                        _ => super::multi_with::<crate::repack::Mxfp4>,
                    };
                    got.fill(0.0);
                    multi(vnni, n, &rows, rb, n_rows, &acts, ab, n_cols, &mut got);
                    assert_eq!(bits(&got), bits(&want), "{what}: vnni {vnni}");
                }
                let mut got_rows = vec![0f32; n_rows];
                fast.dot_rows(n, &rows, rb, &acts[..ab], &mut got_rows);
                assert_eq!(bits(&got_rows), bits(&want[..n_rows]), "{what}: rows");
                for i in 0..n_rows {
                    let one = fast.dot(n, &rows[i * rb..(i + 1) * rb], &acts[..ab]);
                    assert_eq!(one.to_bits(), want[i].to_bits(), "{what}: row {i}");
                }
            }
        }
    }
}
