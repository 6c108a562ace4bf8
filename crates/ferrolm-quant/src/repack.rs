//! llama.cpp's CPU_REPACK products for Q4_K and Q2_K (`ggml_gemv/gemm_q4_K_8x8_q8_K`,
//! `..._q2_K_8x8_q8_K`), which its x86 build takes for a 2-D weight with a multiple of 8 rows
//! (Q4_K whenever the CPU has AVX2, Q2_K when the build has AVX512): the weights are re-laid
//! in tiles of 8 rows at load, and the sums run in another order than `vec_dot`'s. Only the
//! arithmetic matters here (each output is one row against one column), so the rows stay as
//! they are in the file.
//!
//! Per 256-element block, with exact integers `S` (the scaled quants against the activation)
//! and `M` (the minimums against the activation's sums):
//! * gemv (a batch's last `n % 4` columns, and every single column):
//!   `acc = fma(S, d * d_y, acc)`, `acc_min = fma(M, dmin * d_y, acc_min)` once per block;
//! * gemm (the batch's first `n - n % 4` columns): the same two fmas once per part of the
//!   block, with `S` and `M` of that part: Q4_K's parts are its 64-element pairs of
//!   sub-blocks, Q2_K's its two 128-element halves (the eight sub-blocks one pass of its
//!   kernels reads);
//!
//! and the output is `acc - acc_min`. The AVX2 and AVX512 builds of both agree element for
//! element (their lanes hold different outputs, never parts of one).

use crate::common::f16_to_f32;
use crate::k_quants::{scale_min_k4, BlockQ2K, BlockQ4K, BlockQ8K, QK_K};
use crate::legacy::{BlockQ8_0, QK};
use crate::TensorType;

/// Whether llama.cpp b11312, built for this CPU, repacks a 2-D weight of `ty` with `rows` rows
/// (`ggml_repack_get_optimal_repack_type`) and ferrolm mirrors its product: Q4_K, Q4_0, IQ4_NL
/// and MXFP4 with AVX2, Q2_K with AVX512 (`ggml_cpu_has_avx512`: the build's AVX512F, which a
/// native build has exactly when the CPU has it). On aarch64 llama.cpp's tiles are other ones
/// (Q4_K 8x4 with dotprod), not mirrored.
pub(crate) fn mirrors(ty: TensorType, rows: usize) -> bool {
    let isa = match ty {
        TensorType::Q4_K | TensorType::Q4_0 | TensorType::IQ4_NL | TensorType::MXFP4 => {
            cpu_has_avx2()
        }
        TensorType::Q2_K => cpu_has_avx512(),
        _ => false,
    };
    isa && rows.is_multiple_of(8)
}

fn cpu_has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn cpu_has_avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx512f") && cpu_has_avx2()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// A K-quant block with minimums whose repacked products are mirrored: Q4_K, Q2_K.
pub(crate) trait MinBlock: bytemuck::Pod {
    /// The block's scale `d` and minimums' scale `dmin`.
    fn d_dmin(&self) -> (f32, f32);
}

impl MinBlock for BlockQ4K {
    fn d_dmin(&self) -> (f32, f32) {
        (f16_to_f32(self.d), f16_to_f32(self.dmin))
    }
}

impl MinBlock for BlockQ2K {
    fn d_dmin(&self) -> (f32, f32) {
        (f16_to_f32(self.d), f16_to_f32(self.dmin))
    }
}

/// Exact integer sums of one block against one column, per part of the gemm's step: `(S, M)`.
pub(crate) type PartSums<B, const P: usize> = fn(&B, &BlockQ8K) -> [(i32, i32); P];

/// Q4_K's [`PartSums`] in scalar code: per 64 elements.
pub(crate) fn pair_sums(x: &BlockQ4K, y: &BlockQ8K) -> [(i32, i32); 4] {
    let q = y.q();
    std::array::from_fn(|p| {
        let (mut s, mut m) = (0, 0);
        for j in [2 * p, 2 * p + 1] {
            let (scale, min) = scale_min_k4(j, &x.scales);
            // sub-block j: low nibbles of bytes 32p.. for even j, high nibbles for odd j
            let dot: i32 = (0..32)
                .map(|l| {
                    let byte = x.qs[32 * p + l];
                    let w = if j % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    w as i32 * q[32 * j + l] as i32
                })
                .sum();
            s += scale as i32 * dot;
            m += min as i32 * (y.bsum(2 * j) + y.bsum(2 * j + 1));
        }
        (s, m)
    })
}

/// Q2_K's [`PartSums`] in scalar code: per 128-element half `h`, whose 16-element sub-block
/// `is = 8h + 2j + k` holds bits `2j..2j + 2` of bytes `32h + 16k..` (scale in the low nibble
/// of `scales[is]`, minimum in the high one).
pub(crate) fn half_sums_q2_k(x: &BlockQ2K, y: &BlockQ8K) -> [(i32, i32); 2] {
    let q = y.q();
    std::array::from_fn(|h| {
        let (mut s, mut m) = (0, 0);
        for j in 0..4 {
            for k in 0..2 {
                let is = 8 * h + 2 * j + k;
                let dot: i32 = (16 * k..16 * k + 16)
                    .map(|l| {
                        let w = (x.qs[32 * h + l] >> (2 * j)) & 3;
                        w as i32 * q[128 * h + 32 * j + l] as i32
                    })
                    .sum();
                s += (x.scales[is] & 0x0f) as i32 * dot;
                m += (x.scales[is] >> 4) as i32 * y.bsum(is);
            }
        }
        (s, m)
    })
}

/// One row against one column as the gemv computes it.
pub(crate) fn gemv<B: MinBlock, const P: usize>(
    sums: PartSums<B, P>,
    row: &[B],
    col: &[BlockQ8K],
) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for (x, y) in row.iter().zip(col) {
        let (s, m) = sums(x, y)
            .iter()
            .fold((0, 0), |(s, m), &(ps, pm)| (s + ps, m + pm));
        let (d, dmin) = x.d_dmin();
        acc = (s as f32).mul_add(d * y.d(), acc);
        acc_min = (m as f32).mul_add(dmin * y.d(), acc_min);
    }
    acc - acc_min
}

/// One row against one column as the gemm computes it.
pub(crate) fn gemm<B: MinBlock, const P: usize>(
    sums: PartSums<B, P>,
    row: &[B],
    col: &[BlockQ8K],
) -> f32 {
    let (mut acc, mut acc_min) = (0f32, 0f32);
    for (x, y) in row.iter().zip(col) {
        let (d, dmin) = x.d_dmin();
        let (d, dmin) = (d * y.d(), dmin * y.d());
        for (s, m) in sums(x, y) {
            acc = (s as f32).mul_add(d, acc);
            acc_min = (m as f32).mul_add(dmin, acc_min);
        }
    }
    acc - acc_min
}

/// `DotKernel::dot` of a repacked Q4_K or Q2_K row: the gemv.
pub(crate) fn dot_k<B: MinBlock, const P: usize>(
    sums: PartSums<B, P>,
    n: usize,
    row: &[u8],
    act: &[u8],
) -> f32 {
    debug_assert!(n.is_multiple_of(QK_K));
    gemv(sums, bytemuck::cast_slice(row), bytemuck::cast_slice(act))
}

/// `DotKernel::dot_rows_multi` of repacked Q4_K or Q2_K rows: the gemm for the first
/// `n_cols - n_cols % 4` columns, the gemv for the rest (`forward_mul_mat_one_chunk`). A caller
/// splitting a batch by columns must start every part at a multiple of 4.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
pub(crate) fn multi_k<B: MinBlock, const P: usize>(
    sums: PartSums<B, P>,
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    let nb = n / QK_K;
    let (rb, ab) = (
        nb * std::mem::size_of::<B>(),
        nb * std::mem::size_of::<BlockQ8K>(),
    );
    let tiled_cols = n_cols - n_cols % 4;
    for c in 0..n_cols {
        let col: &[BlockQ8K] = bytemuck::cast_slice(&acts[c * act_stride..c * act_stride + ab]);
        let product = if c < tiled_cols { gemm } else { gemv };
        for i in 0..n_rows {
            let row: &[B] = bytemuck::cast_slice(&rows[i * row_stride..i * row_stride + rb]);
            out[c * n_rows + i] = product(sums, row, col);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Q4_0, IQ4_NL and MXFP4 (`ggml_gemv/gemm_q4_0_8x8_q8_0`, `..._iq4_nl_...`, `..._mxfp4_...`):
// llama.cpp's x86 build repacks them whenever the CPU has AVX2 and a 2-D weight has a multiple
// of 8 rows. Its gemv and gemm (AVX2 and AVX512 alike) look each nibble up in the type's
// table, sum a block against the activation's block exactly in integers (`S`), then per block
// `acc = fma(S, d * d_y, acc)` in one float chain per output, from zero. The gemm and the gemv
// agree element for element, so a batch's split between them does not matter.

/// The three types share a block layout (a scale, then 16 bytes of nibbles: elements 0..16
/// in the low halves, 16..32 in the high ones) and differ in their nibbles' values and in how
/// the scale is stored.
pub(crate) trait Nibbles {
    const VALUES: [i8; 16];
    /// The bytes of the scale, before the nibbles.
    const SCALE_BYTES: usize;
    /// A block's scale, from its first `SCALE_BYTES` bytes.
    fn scale(block: &[u8]) -> f32;
    /// A block's bytes.
    const BYTES: usize = Self::SCALE_BYTES + QK / 2;
}

/// Q4_0: `q - 8`, an f16 scale.
pub(crate) struct Q4_0;
impl Nibbles for Q4_0 {
    const VALUES: [i8; 16] = [-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7];
    const SCALE_BYTES: usize = 2;
    fn scale(block: &[u8]) -> f32 {
        f16_to_f32([block[0], block[1]])
    }
}

/// IQ4_NL: its codebook, an f16 scale.
pub(crate) struct Iq4Nl;
impl Nibbles for Iq4Nl {
    const VALUES: [i8; 16] = crate::iq::KVALUES_IQ4NL;
    const SCALE_BYTES: usize = 2;
    fn scale(block: &[u8]) -> f32 {
        f16_to_f32([block[0], block[1]])
    }
}

/// MXFP4: the doubled e2m1 values, an e8m0 exponent halved to match.
pub(crate) struct Mxfp4;
impl Nibbles for Mxfp4 {
    const VALUES: [i8; 16] = crate::iq::KVALUES_MXFP4;
    const SCALE_BYTES: usize = 1;
    fn scale(block: &[u8]) -> f32 {
        crate::common::e8m0_to_f32_half(block[0])
    }
}

/// One row against one column as the gemv (and the gemm) computes it.
pub(crate) fn gemv_b32<V: Nibbles>(row: &[u8], col: &[BlockQ8_0]) -> f32 {
    let mut acc = 0f32;
    for (x, y) in row.chunks_exact(V::BYTES).zip(col) {
        let qs = &x[V::SCALE_BYTES..];
        let s: i32 = (0..QK / 2)
            .map(|l| {
                let (lo, hi) = (qs[l] & 0x0f, qs[l] >> 4);
                V::VALUES[lo as usize] as i32 * y.qs[l] as i8 as i32
                    + V::VALUES[hi as usize] as i32 * y.qs[l + QK / 2] as i8 as i32
            })
            .sum();
        acc = (s as f32).mul_add(V::scale(x) * f16_to_f32(y.d), acc);
    }
    acc
}

/// `DotKernel::dot` of a repacked Q4_0, IQ4_NL or MXFP4 row.
pub(crate) fn dot_b32<V: Nibbles>(n: usize, row: &[u8], act: &[u8]) -> f32 {
    debug_assert!(n.is_multiple_of(QK));
    gemv_b32::<V>(row, bytemuck::cast_slice(act))
}

/// `DotKernel::dot_rows_multi` of repacked Q4_0, IQ4_NL or MXFP4 rows: every element the
/// gemv's.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
pub(crate) fn multi_b32<V: Nibbles>(
    n: usize,
    rows: &[u8],
    row_stride: usize,
    n_rows: usize,
    acts: &[u8],
    act_stride: usize,
    n_cols: usize,
    out: &mut [f32],
) {
    let nb = n / QK;
    let (rb, ab) = (nb * V::BYTES, nb * std::mem::size_of::<BlockQ8_0>());
    for c in 0..n_cols {
        let col = &acts[c * act_stride..c * act_stride + ab];
        for i in 0..n_rows {
            out[c * n_rows + i] = dot_b32::<V>(n, &rows[i * row_stride..i * row_stride + rb], col);
        }
    }
}
