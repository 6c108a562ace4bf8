//! The 256-element "K" super-block formats Q2_K..Q6_K and the Q8_K activation format.
//!
//! Each super-block has an f16 scale `d` (and `dmin` for the formats with minimums) and small
//! per-sub-block integer scales; dot products run against Q8_K activations whose `bsums` (sums
//! of 16 consecutive quants) fold the minimums and offsets into one small integer sum.

use bytemuck::{Pod, Zeroable};

use crate::common::{f16_to_f32, f32_to_f16, nearest_int};
use crate::tiled::{TiledBlock, TiledMins};

/// Elements per super-block.
pub(crate) const QK_K: usize = 256;
/// Bytes of the packed 6-bit scales and minimums of Q4_K and Q5_K (and of Q3_K's scales).
pub(crate) const K_SCALE_SIZE: usize = 12;

/// Q2_K: 16 sub-blocks of 16, `x = d * (sc & 15) * q - dmin * (sc >> 4)`, q two bits.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ2K {
    pub scales: [u8; QK_K / 16],
    pub qs: [u8; QK_K / 4],
    pub d: [u8; 2],
    pub dmin: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ2K>() == QK_K / 16 + QK_K / 4 + 4);

/// Q3_K: 16 sub-blocks of 16, `x = d * (sc - 32) * (q - 4 * !hbit)`, 6-bit scales.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ3K {
    pub hmask: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 4],
    pub scales: [u8; K_SCALE_SIZE],
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ3K>() == QK_K / 8 + QK_K / 4 + K_SCALE_SIZE + 2);

/// Q4_K: 8 sub-blocks of 32, `x = d * sc * q - dmin * m`, 6-bit sc and m.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ4K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 4 + K_SCALE_SIZE + QK_K / 2);

/// Q5_K: Q4_K plus a fifth bit per quant in `qh`.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ5K {
    pub d: [u8; 2],
    pub dmin: [u8; 2],
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 4 + K_SCALE_SIZE + QK_K / 8 + QK_K / 2);

/// Q6_K: 16 sub-blocks of 16, `x = d * sc * (q - 32)`, signed 8-bit sc.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [u8; QK_K / 16],
    pub d: [u8; 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == QK_K / 2 + QK_K / 4 + QK_K / 16 + 2);

/// Q8_K (activations): f32 scale, signed byte quants, i16 sums of each 16 quants.
#[repr(C)]
#[derive(Clone, Copy, Pod, Zeroable)]
pub(crate) struct BlockQ8K {
    pub d: [u8; 4],
    pub qs: [u8; QK_K],
    pub bsums: [u8; QK_K / 16 * 2],
}
const _: () = assert!(std::mem::size_of::<BlockQ8K>() == 4 + QK_K + QK_K / 16 * 2);

impl BlockQ8K {
    #[inline(always)]
    pub(crate) fn d(&self) -> f32 {
        f32::from_le_bytes(self.d)
    }
    #[inline(always)]
    pub(crate) fn q(&self) -> &[i8; QK_K] {
        bytemuck::cast_ref(&self.qs)
    }
    #[inline(always)]
    pub(crate) fn bsum(&self, j: usize) -> i32 {
        i16::from_le_bytes([self.bsums[2 * j], self.bsums[2 * j + 1]]) as i32
    }
}

// ---------------------------------------------------------------------------------------------
// Unpacking: integer quants in element order, plus the integer scales.

/// Q2_K quants (0..=3) in element order.
fn q2k_values(b: &BlockQ2K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for chunk in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                q[128 * chunk + 32 * j + l] = ((b.qs[32 * chunk + l] >> (2 * j)) & 3) as i8;
            }
        }
    }
    q
}

/// Q3_K quants (-4..=3) in element order.
fn q3k_values(b: &BlockQ3K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for chunk in 0..2 {
        for j in 0..4 {
            let m = 1u8 << (4 * chunk + j);
            for l in 0..32 {
                let low = ((b.qs[32 * chunk + l] >> (2 * j)) & 3) as i8;
                let sub = if b.hmask[l] & m != 0 { 0 } else { 4 };
                q[128 * chunk + 32 * j + l] = low - sub;
            }
        }
    }
    q
}

/// Q3_K's sixteen signed scales (-32..=31).
pub(crate) fn q3k_scales(s: &[u8; K_SCALE_SIZE]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = (s[i % 8] >> (4 * (i / 8))) & 0x0f;
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Scale and minimum of sub-block `j` of Q4_K/Q5_K's packed 6-bit fields.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Q4_K quants (0..=15) in element order.
fn q4k_values(b: &BlockQ4K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for c in 0..4 {
        for l in 0..32 {
            q[64 * c + l] = (b.qs[32 * c + l] & 0x0f) as i8;
            q[64 * c + 32 + l] = (b.qs[32 * c + l] >> 4) as i8;
        }
    }
    q
}

/// Q5_K quants (0..=31) in element order.
fn q5k_values(b: &BlockQ5K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for c in 0..4 {
        for l in 0..32 {
            let h0 = ((b.qh[l] >> (2 * c)) & 1) << 4;
            let h1 = ((b.qh[l] >> (2 * c + 1)) & 1) << 4;
            q[64 * c + l] = ((b.qs[32 * c + l] & 0x0f) | h0) as i8;
            q[64 * c + 32 + l] = ((b.qs[32 * c + l] >> 4) | h1) as i8;
        }
    }
    q
}

/// Q6_K quants (-32..=31) in element order.
fn q6k_values(b: &BlockQ6K) -> [i8; QK_K] {
    let mut q = [0i8; QK_K];
    for chunk in 0..2 {
        let ql = &b.ql[64 * chunk..64 * chunk + 64];
        let qh = &b.qh[32 * chunk..32 * chunk + 32];
        let y = &mut q[128 * chunk..128 * chunk + 128];
        for l in 0..32 {
            y[l] = ((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) as i8 - 32;
            y[l + 32] = ((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
            y[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
            y[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
        }
    }
    q
}

// ---------------------------------------------------------------------------------------------
// Dequantize

pub(crate) fn dequantize_q2_k(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ2K] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let min = f16_to_f32(b.dmin);
        let q = q2k_values(b);
        for (g, (y, q)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let dl = d * (b.scales[g] & 0x0f) as f32;
            let ml = min * (b.scales[g] >> 4) as f32;
            for (y, &q) in y.iter_mut().zip(q) {
                *y = dl * q as f32 - ml;
            }
        }
    }
}

pub(crate) fn dequantize_q3_k(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ3K] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let sc = q3k_scales(&b.scales);
        let q = q3k_values(b);
        for (g, (y, q)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let dl = d * sc[g] as f32;
            for (y, &q) in y.iter_mut().zip(q) {
                *y = dl * q as f32;
            }
        }
    }
}

pub(crate) fn dequantize_q4_k(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ4K] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let min = f16_to_f32(b.dmin);
        let q = q4k_values(b);
        for (j, (y, q)) in y.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
            let (sc, m) = scale_min_k4(j, &b.scales);
            let dl = d * sc as f32;
            let ml = min * m as f32;
            for (y, &q) in y.iter_mut().zip(q) {
                *y = dl * q as f32 - ml;
            }
        }
    }
}

pub(crate) fn dequantize_q5_k(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ5K] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let min = f16_to_f32(b.dmin);
        let q = q5k_values(b);
        for (j, (y, q)) in y.chunks_exact_mut(32).zip(q.chunks_exact(32)).enumerate() {
            let (sc, m) = scale_min_k4(j, &b.scales);
            let dl = d * sc as f32;
            let ml = min * m as f32;
            for (y, &q) in y.iter_mut().zip(q) {
                *y = dl * q as f32 - ml;
            }
        }
    }
}

pub(crate) fn dequantize_q6_k(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ6K] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = f16_to_f32(b.d);
        let q = q6k_values(b);
        for (g, (y, q)) in y.chunks_exact_mut(16).zip(q.chunks_exact(16)).enumerate() {
            let dl = d * b.scales[g] as i8 as f32;
            for (y, &q) in y.iter_mut().zip(q) {
                *y = dl * q as f32;
            }
        }
    }
}

pub(crate) fn dequantize_q8_k(src: &[u8], dst: &mut [f32]) {
    let blocks: &[BlockQ8K] = bytemuck::cast_slice(src);
    for (b, y) in blocks.iter().zip(dst.chunks_exact_mut(QK_K)) {
        let d = b.d();
        for (y, &q) in y.iter_mut().zip(b.q()) {
            *y = q as f32 * d;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Quantize (ggml's `quantize_row_*_ref` without importance weights)

const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `make_qx_quants` with `rmse_type == 1` and no importance weights (w = x^2).
fn make_qx_quants(x: &[f32], nmax: i32, l_out: &mut [i8]) -> f32 {
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l_out.fill(0);
        return 0.0;
    }
    let clamp = |l: i32| l.clamp(-nmax, nmax - 1);
    let mut iscale = -(nmax as f32) / max;
    let mut sumlx = 0.0f32;
    let mut suml2 = 0.0f32;
    for (i, &v) in x.iter().enumerate() {
        let l = clamp(nearest_int(iscale * v));
        l_out[i] = (l + nmax) as i8;
        let w = v * v;
        sumlx += w * v * l as f32;
        suml2 += w * l as f32 * l as f32;
    }
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        iscale = -(nmax as f32 + 0.1f32 * is as f32) / max;
        sumlx = 0.0;
        suml2 = 0.0;
        for &v in x {
            let l = clamp(nearest_int(iscale * v));
            let w = v * v;
            sumlx += w * v * l as f32;
            suml2 += w * l as f32 * l as f32;
        }
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (i, &v) in x.iter().enumerate() {
                let l = clamp(nearest_int(iscale * v));
                l_out[i] = (nmax + l) as i8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// ggml's `make_qkx2_quants`: scale and (negated) minimum minimizing a weighted error.
#[allow(clippy::too_many_arguments)] // mirrors the reference algorithm's knobs one to one
fn make_qkx2_quants(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    l_out: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
    use_mad: bool,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l_out.fill(0);
        return (0.0, -min);
    }
    let err = |diff: f32| if use_mad { diff.abs() } else { diff * diff };
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l_out[i] = l as u8;
        let diff = scale * l as f32 + min - x[i];
        best_error += weights[i] * err(diff);
    }
    if nstep < 1 {
        return (scale, -min);
    }
    let mut laux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let l = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = l as u8;
            let w = weights[i];
            let lf = l as f32;
            sum_l += w * lf;
            sum_l2 += w * lf * lf;
            sum_xl += w * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                cur_error += weights[i] * err(diff);
            }
            if cur_error < best_error {
                l_out[..n].copy_from_slice(&laux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

pub(crate) fn quantize_q4_k(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ4K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_K).zip(blocks) {
        let mut l = [0u8; QK_K];
        let mut scales = [0.0f32; QK_K / 32];
        let mut mins = [0.0f32; QK_K / 32];
        let mut max_scale = 0.0f32;
        let mut max_min = 0.0f32;
        for j in 0..QK_K / 32 {
            let xs = &x[32 * j..32 * j + 32];
            let sum_x2: f32 = xs.iter().fold(0.0, |a, &v| a + v * v);
            let av_x = (sum_x2 / 32.0).sqrt();
            let mut weights = [0.0f32; 32];
            for (w, &v) in weights.iter_mut().zip(xs) {
                *w = av_x + v.abs();
            }
            let (s, m) = make_qkx2_quants(
                xs,
                &weights,
                15,
                &mut l[32 * j..32 * j + 32],
                -1.0,
                0.1,
                20,
                false,
            );
            scales[j] = s;
            mins[j] = m;
            if s > max_scale {
                max_scale = s;
            }
            if m > max_min {
                max_min = m;
            }
        }
        let inv_scale = if max_scale > 0.0 {
            63.0 / max_scale
        } else {
            0.0
        };
        let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
        y.scales = [0; K_SCALE_SIZE];
        for j in 0..QK_K / 32 {
            let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
            let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
            if j < 4 {
                y.scales[j] = ls;
                y.scales[j + 4] = lm;
            } else {
                y.scales[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
                y.scales[j - 4] |= (ls >> 4) << 6;
                y.scales[j] |= (lm >> 4) << 6;
            }
        }
        y.d = f32_to_f16(max_scale / 63.0);
        y.dmin = f32_to_f16(max_min / 63.0);
        for j in 0..QK_K / 32 {
            let (sc, m) = scale_min_k4(j, &y.scales);
            let d = f16_to_f32(y.d) * sc as f32;
            if d == 0.0 {
                continue;
            }
            let dm = f16_to_f32(y.dmin) * m as f32;
            for ii in 0..32 {
                let q = nearest_int((x[32 * j + ii] + dm) / d).clamp(0, 15);
                l[32 * j + ii] = q as u8;
            }
        }
        for c in 0..QK_K / 64 {
            for i in 0..32 {
                y.qs[32 * c + i] = l[64 * c + i] | (l[64 * c + 32 + i] << 4);
            }
        }
    }
}

pub(crate) fn quantize_q6_k(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ6K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_K).zip(blocks) {
        let mut l = [0i8; QK_K];
        let mut scales = [0.0f32; QK_K / 16];
        let mut max_scale = 0.0f32;
        let mut max_abs_scale = 0.0f32;
        for ib in 0..QK_K / 16 {
            let s = make_qx_quants(&x[16 * ib..16 * ib + 16], 32, &mut l[16 * ib..16 * ib + 16]);
            scales[ib] = s;
            if s.abs() > max_abs_scale {
                max_abs_scale = s.abs();
                max_scale = s;
            }
        }
        if max_abs_scale < GROUP_MAX_EPS {
            *y = BlockQ6K::zeroed();
            continue;
        }
        let iscale = -128.0f32 / max_scale;
        y.d = f32_to_f16(1.0 / iscale);
        for (ys, &s) in y.scales.iter_mut().zip(&scales) {
            *ys = nearest_int(iscale * s).min(127) as i8 as u8;
        }
        for j in 0..QK_K / 16 {
            let d = f16_to_f32(y.d) * y.scales[j] as i8 as f32;
            if d == 0.0 {
                continue;
            }
            for ii in 0..16 {
                let q = nearest_int(x[16 * j + ii] / d).clamp(-32, 31);
                l[16 * j + ii] = (q + 32) as i8;
            }
        }
        let l: [u8; QK_K] = bytemuck::cast(l);
        for chunk in 0..2 {
            let (j, ql, qh) = (128 * chunk, 64 * chunk, 32 * chunk);
            for i in 0..32 {
                let q1 = l[j + i] & 0x0f;
                let q2 = l[j + i + 32] & 0x0f;
                let q3 = l[j + i + 64] & 0x0f;
                let q4 = l[j + i + 96] & 0x0f;
                y.ql[ql + i] = q1 | (q3 << 4);
                y.ql[ql + i + 32] = q2 | (q4 << 4);
                y.qh[qh + i] = (l[j + i] >> 4)
                    | ((l[j + i + 32] >> 4) << 2)
                    | ((l[j + i + 64] >> 4) << 4)
                    | ((l[j + i + 96] >> 4) << 6);
            }
        }
    }
}

#[inline(always)] // into `avx2::quantize_activation`, to be compiled for AVX2 there
pub(crate) fn quantize_q8_k(src: &[f32], dst: &mut [u8]) {
    let blocks: &mut [BlockQ8K] = bytemuck::cast_slice_mut(dst);
    for (x, y) in src.chunks_exact(QK_K).zip(blocks) {
        // llama.cpp keeps the first value of the largest magnitude (NaNs never win); the
        // largest magnitude in eight independent lanes (which vectorizes), then its first
        // position, give the same value
        let mut lanes = [0.0f32; 8];
        for chunk in x.chunks_exact(8) {
            for (m, &v) in lanes.iter_mut().zip(chunk) {
                if v.abs() > *m {
                    *m = v.abs();
                }
            }
        }
        let amax = lanes.iter().fold(0.0f32, |a, &m| if m > a { m } else { a });
        if amax == 0.0 {
            *y = BlockQ8K::zeroed();
            continue;
        }
        let max = x[x
            .iter()
            .position(|v| v.abs() == amax)
            .expect("amax is one of x")];
        let iscale = -127.0f32 / max;
        for (q, &v) in y.qs.iter_mut().zip(x) {
            *q = nearest_int(iscale * v).min(127) as i8 as u8;
        }
        for j in 0..QK_K / 16 {
            let sum: i32 = y.qs[16 * j..16 * j + 16]
                .iter()
                .map(|&q| q as i8 as i32)
                .sum();
            y.bsums[2 * j..2 * j + 2].copy_from_slice(&(sum as i16).to_le_bytes());
        }
        y.d = (1.0 / iscale).to_le_bytes();
    }
}

// ---------------------------------------------------------------------------------------------
// Scalar dot products against Q8_K

/// The eight i32 lanes llama.cpp's AVX2 K-quant kernels build for one super-block (as f32):
/// the block is processed 32 elements per 256-bit register, so lane `l` sums, over the eight
/// 32-element groups `g`, `scale(g, l) * sum(q * y)` of elements `32g + 4l .. 32g + 4l + 4`.
#[inline(always)]
pub(crate) fn k_lanes(
    q: &[i8; QK_K],
    y: &[i8; QK_K],
    scale: impl Fn(usize, usize) -> i32,
) -> [f32; 8] {
    let mut lanes = [0i32; 8];
    for g in 0..QK_K / 32 {
        for (l, lane) in lanes.iter_mut().enumerate() {
            let mut t = 0i32;
            for k in 32 * g + 4 * l..32 * g + 4 * l + 4 {
                t += q[k] as i32 * y[k] as i32;
            }
            *lane += scale(g, l) * t;
        }
    }
    lanes.map(|v| v as f32)
}

/// Q4_K / Q5_K minimums against the activation's sums, as llama.cpp's AVX2 kernels pair them
/// (`_mm_madd_epi16(mins, hadd(bsums))`): lane `k` of 4 is
/// `min[2k] * ysum[2k] + min[2k + 1] * ysum[2k + 1]` with `ysum[j]` the sum of group `j`.
#[inline(always)]
fn mins_lanes(scales: &[u8; K_SCALE_SIZE], y: &BlockQ8K) -> [i32; 4] {
    let mut prod = [0i32; 4];
    for (k, p) in prod.iter_mut().enumerate() {
        for j in [2 * k, 2 * k + 1] {
            let ysum = y.bsum(2 * j) + y.bsum(2 * j + 1);
            *p += scale_min_k4(j, scales).1 as i32 * ysum;
        }
    }
    prod
}

pub(crate) fn dot_q2_k_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ2K] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8K] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let yd = y.d();
        let d = yd * f16_to_f32(x.d);
        let dmin = -yd * f16_to_f32(x.dmin);
        // minimums first: lane l = min[2l] * bsum[2l] + min[2l + 1] * bsum[2l + 1]
        let mut prod = [0f32; 8];
        for (l, p) in prod.iter_mut().enumerate() {
            *p = (y.bsum(2 * l) * (x.scales[2 * l] >> 4) as i32
                + y.bsum(2 * l + 1) * (x.scales[2 * l + 1] >> 4) as i32) as f32;
        }
        crate::common::fma8(&mut acc, dmin, &prod);
        let lanes = k_lanes(&q2k_values(x), y.q(), |g, l| {
            (x.scales[2 * g + l / 4] & 0x0f) as i32
        });
        crate::common::fma8(&mut acc, d, &lanes);
    }
    crate::common::reduce8(&acc)
}

pub(crate) fn dot_q3_k_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ3K] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8K] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let d = y.d() * f16_to_f32(x.d);
        let sc = q3k_scales(&x.scales);
        let lanes = k_lanes(&q3k_values(x), y.q(), |g, l| sc[2 * g + l / 4] as i32);
        crate::common::fma8(&mut acc, d, &lanes);
    }
    crate::common::reduce8(&acc)
}

pub(crate) fn dot_q4_k_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ4K] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8K] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    let mut acc_m = [0f32; 4];
    for (x, y) in xs.iter().zip(ys) {
        let yd = y.d();
        let d = yd * f16_to_f32(x.d);
        let dmin = -yd * f16_to_f32(x.dmin);
        let prod = mins_lanes(&x.scales, y);
        for k in 0..4 {
            acc_m[k] = dmin.mul_add(prod[k] as f32, acc_m[k]);
        }
        let lanes = k_lanes(&q4k_values(x), y.q(), |g, _| {
            scale_min_k4(g, &x.scales).0 as i32
        });
        crate::common::fma8(&mut acc, d, &lanes);
    }
    crate::common::reduce8(&acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
}

pub(crate) fn dot_q5_k_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ5K] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8K] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    for (x, y) in xs.iter().zip(ys) {
        let yd = y.d();
        let d = yd * f16_to_f32(x.d);
        let dmin = -yd * f16_to_f32(x.dmin);
        let prod: i32 = mins_lanes(&x.scales, y).iter().sum();
        summs = dmin.mul_add(prod as f32, summs); // gcc fused this one
        let lanes = k_lanes(&q5k_values(x), y.q(), |g, _| {
            scale_min_k4(g, &x.scales).0 as i32
        });
        crate::common::fma8(&mut acc, d, &lanes);
    }
    crate::common::reduce8(&acc) + summs
}

pub(crate) fn dot_q6_k_q8_k(_n: usize, row: &[u8], act: &[u8]) -> f32 {
    let xs: &[BlockQ6K] = bytemuck::cast_slice(row);
    let ys: &[BlockQ8K] = bytemuck::cast_slice(act);
    let mut acc = [0f32; 8];
    for (x, y) in xs.iter().zip(ys) {
        let d = y.d() * f16_to_f32(x.d);
        // unsigned quants (0..=63); the 32 offset comes off per lane below
        let u = q6k_values(x).map(|q| q + 32);
        let sc = |j: usize| x.scales[j] as i8 as i32;
        let lanes = k_lanes(&u, y.q(), |g, l| sc(2 * g + l / 4));
        let mut lanes = lanes.map(|v| v as i32);
        for (l, v) in lanes.iter_mut().enumerate() {
            *v -= 32 * (y.bsum(2 * l) * sc(2 * l) + y.bsum(2 * l + 1) * sc(2 * l + 1));
        }
        crate::common::fma8(&mut acc, d, &lanes.map(|v| v as f32));
    }
    crate::common::reduce8(&acc)
}

// ---------------------------------------------------------------------------------------------
// The tiled matmul's view of each block (`tiled`): values with the format's offset taken off,
// the scale (and minimum) of every 16 elements.

pub(crate) fn tiled_q2_k(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockQ2K = bytemuck::from_bytes(b);
    *t = TiledBlock {
        d: f16_to_f32(b.d),
        w: q2k_values(b),
        scale16: b.scales.map(|s| (s & 0x0f) as i32),
        mins: Some(TiledMins {
            dmin: f16_to_f32(b.dmin),
            min16: b.scales.map(|s| (s >> 4) as i32),
        }),
    }
}

pub(crate) fn tiled_q3_k(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockQ3K = bytemuck::from_bytes(b);
    *t = TiledBlock {
        d: f16_to_f32(b.d),
        w: q3k_values(b),
        scale16: q3k_scales(&b.scales).map(|s| s as i32),
        mins: None,
    }
}

/// Q4_K and Q5_K: a scale and a minimum per 32 elements.
fn tiled_k4(
    t: &mut TiledBlock,
    d: [u8; 2],
    dmin: [u8; 2],
    scales: &[u8; K_SCALE_SIZE],
    w: [i8; QK_K],
) {
    *t = TiledBlock {
        d: f16_to_f32(d),
        w,
        scale16: std::array::from_fn(|j| scale_min_k4(j / 2, scales).0 as i32),
        mins: Some(TiledMins {
            dmin: f16_to_f32(dmin),
            min16: std::array::from_fn(|j| scale_min_k4(j / 2, scales).1 as i32),
        }),
    }
}

pub(crate) fn tiled_q4_k(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockQ4K = bytemuck::from_bytes(b);
    tiled_k4(t, b.d, b.dmin, &b.scales, q4k_values(b))
}

pub(crate) fn tiled_q5_k(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockQ5K = bytemuck::from_bytes(b);
    tiled_k4(t, b.d, b.dmin, &b.scales, q5k_values(b))
}

pub(crate) fn tiled_q6_k(b: &[u8], t: &mut TiledBlock) {
    let b: &BlockQ6K = bytemuck::from_bytes(b);
    *t = TiledBlock {
        d: f16_to_f32(b.d),
        w: q6k_values(b),
        scale16: b.scales.map(|s| s as i8 as i32),
        mins: None,
    }
}
