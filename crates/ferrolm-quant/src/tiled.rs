//! llama.cpp's tiled matmul (ggml-cpu/tiled, taken for the K-quants Q2_K..Q6_K, the i-quants
//! and IQ4_XS when a product has at least 8 activation columns and its weights are not
//! repacked), as its AVX512-VNNI microkernel computes each output: per 256-element block an
//! exact integer `S = sum over sub-blocks of scale * sum(w * y)` of the weight's integer values
//! `w` and the Q8_K activation, then `r = S * d_row`, for the formats with minimums
//! `r = fma(-dmin, M, S * d_row)` with the exact `M = sum(min * bsum)`, and
//! `acc = fma(r, d_y, acc)` in block order (the add and the last multiply contracted by gcc),
//! from `acc = 0`.

use crate::k_quants::{BlockQ8K, QK_K};
use crate::kernel::DotFn;

/// Columns from which llama.cpp takes the tiled path (`ggml_tiled_min_batch`).
pub(crate) const MIN_COLUMNS: usize = 8;

/// One weight block as the tiled kernel sees it: the row scale (ggml's `d` with the format's
/// constant folded in), integer values in element order and a scale per 16 elements.
pub(crate) struct TiledBlock {
    pub d: f32,
    pub w: [i8; QK_K],
    pub scale16: [i32; QK_K / 16],
    /// The minimums of Q2_K, Q4_K and Q5_K.
    pub mins: Option<TiledMins>,
}

impl TiledBlock {
    /// A block of zeros (a slot to unpack into).
    pub const ZERO: TiledBlock = TiledBlock {
        d: 0.0,
        w: [0; QK_K],
        scale16: [0; QK_K / 16],
        mins: None,
    };
}

/// A format's minimums: `dmin` and an integer minimum per 16 elements (a 32-element
/// sub-block's repeated), met by the activation's sums of 16.
pub(crate) struct TiledMins {
    pub dmin: f32,
    pub min16: [i32; QK_K / 16],
}

/// Unpacks one block's bytes into a [`TiledBlock`] (in place: the block is large).
pub(crate) type Unpack = fn(&[u8], &mut TiledBlock);

/// `acc = fma(r, d_y, acc)` for the block's exact integer sum `s` against column `y`, `r` as
/// the module comment says.
#[inline(always)]
pub(crate) fn accumulate(x: &TiledBlock, s: i32, y: &BlockQ8K, acc: &mut f32) {
    let r = match &x.mins {
        None => s as f32 * x.d,
        Some(m) => {
            let sums: i32 = (0..QK_K / 16).map(|j| m.min16[j] * y.bsum(j)).sum();
            (-m.dmin).mul_add(sums as f32, s as f32 * x.d)
        }
    };
    *acc = r.mul_add(y.d(), *acc);
}

/// One block against the same block of several activation columns, into their accumulators:
/// `acc[c] = fma(S_c * d_row, d_y(c), acc[c])` with `S_c` the exact integer sum over 16s of
/// `scale * sum(w * y_c)` (any order gives it).
pub(crate) type BlockStep = fn(&TiledBlock, &[&BlockQ8K], &mut [f32]);

/// [`BlockStep`] in scalar code.
pub(crate) fn block_step(x: &TiledBlock, ys: &[&BlockQ8K], acc: &mut [f32]) {
    for (y, a) in ys.iter().zip(acc) {
        let q = y.q();
        let mut s = 0i32;
        for (j, &scale) in x.scale16.iter().enumerate() {
            let t: i32 = (16 * j..16 * j + 16)
                .map(|k| x.w[k] as i32 * q[k] as i32)
                .sum();
            s += scale * t;
        }
        accumulate(x, s, y, a);
    }
}

/// `DotKernel::dot_rows_multi` for a tiled type: `vec_dot` (`dot`) below [`MIN_COLUMNS`]
/// columns, the tiled kernel's arithmetic from there: each weight block unpacked once and met
/// by every column, each column's accumulator in block order.
#[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
pub(crate) fn multi(
    unpack: Unpack,
    block_bytes: usize,
    dot: DotFn,
    step: BlockStep,
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
    let (rb, ab) = (nb * block_bytes, nb * std::mem::size_of::<BlockQ8K>());
    let cols: Vec<&[BlockQ8K]> = (0..n_cols)
        .map(|c| bytemuck::cast_slice(&acts[c * act_stride..c * act_stride + ab]))
        .collect();
    let (mut ys, mut acc) = (Vec::with_capacity(n_cols), vec![0f32; n_cols]);
    let mut x = TiledBlock::ZERO;
    for i in 0..n_rows {
        let row = &rows[i * row_stride..i * row_stride + rb];
        if n_cols < MIN_COLUMNS {
            for c in 0..n_cols {
                out[c * n_rows + i] = dot(n, row, &acts[c * act_stride..c * act_stride + ab]);
            }
            continue;
        }
        acc.fill(0.0);
        for (kb, xb) in row.chunks_exact(block_bytes).enumerate() {
            unpack(xb, &mut x);
            ys.clear();
            ys.extend(cols.iter().map(|col| &col[kb]));
            step(&x, &ys, &mut acc);
        }
        for (c, &a) in acc.iter().enumerate() {
            out[c * n_rows + i] = a;
        }
    }
}
