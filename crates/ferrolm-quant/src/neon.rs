//! NEON kernels (aarch64, where NEON is part of the base instruction set).
//!
//! Same structure as the AVX2 module: one [`Block`] step per format, generic drivers that
//! check lengths in safe code. Byte products are widened with `vmull_s8` (exact for i8 x i8)
//! and pairwise-added into i32 lanes, so integer parts equal the scalar reference exactly.
//! F16 rows use the scalar kernel here: the f16 vector types are not stable in Rust yet.

use std::arch::aarch64::*;

use crate::common::{e8m0_to_f32_half, f16_to_f32};
use crate::iq::{KVALUES_IQ4NL, KVALUES_MXFP4};
use crate::k_quants::{q3k_scales, scale_min_k4};
use crate::kernel::{DotFn, Simd};
use crate::TensorType;

/// The kernels of this module for `ty`, if it has one.
pub(crate) fn kernel(ty: TensorType) -> Option<Simd> {
    use TensorType as T;
    fn one<B: Block>() -> Simd {
        float(dot_entry::<B>)
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
        T::BF16 => float(dot_bf16),
        T::Q4_0 => one::<Q4_0>(),
        T::Q4_1 => one::<Q4_1>(),
        T::Q5_0 => one::<Q5_0>(),
        T::Q5_1 => one::<Q5_1>(),
        T::Q8_0 => one::<Q8_0>(),
        T::IQ4_NL => one::<Iq4Nl>(),
        T::MXFP4 => one::<Mxfp4>(),
        T::Q2_K => one::<Q2K>(),
        T::Q3_K => one::<Q3K>(),
        T::Q4_K => one::<Q4K>(),
        T::Q5_K => one::<Q5K>(),
        T::Q6_K => one::<Q6K>(),
        _ => return None,
    })
}

struct Acc {
    v: float32x4_t,
    s: f32,
}

trait Block {
    const QK: usize;
    const WB: usize;
    const AB: usize;
    /// # Safety
    /// `x` has `WB` readable bytes and `y` has `AB`.
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc);
}

fn dot_entry<B: Block>(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = n / B::QK;
    assert!(n % B::QK == 0 && row.len() >= nb * B::WB && act.len() >= nb * B::AB);
    // SAFETY: NEON is baseline on aarch64; the loop reads `nb` blocks of each slice, which
    // the assert above keeps in bounds.
    unsafe {
        let mut acc = Acc {
            v: vdupq_n_f32(0.0),
            s: 0.0,
        };
        let (x, y) = (row.as_ptr(), act.as_ptr());
        for b in 0..nb {
            B::step(x.add(b * B::WB), y.add(b * B::AB), &mut acc);
        }
        vaddvq_f32(acc.v) + acc.s
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// Sum of the 16 products of two i8 vectors, spread over 4 i32 lanes.
#[inline(always)]
unsafe fn dot16(a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let p0 = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    let p1 = vmull_high_s8(a, b);
    vaddq_s32(vpaddlq_s16(p0), vpaddlq_s16(p1))
}

#[inline(always)]
unsafe fn ld(p: *const u8) -> uint8x16_t {
    vld1q_u8(p)
}

#[inline(always)]
unsafe fn lds(p: *const u8) -> int8x16_t {
    vld1q_s8(p as *const i8)
}

#[inline(always)]
unsafe fn s8(v: uint8x16_t) -> int8x16_t {
    vreinterpretq_s8_u8(v)
}

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> f32 {
    f16_to_f32([*p, *p.add(1)])
}

#[inline(always)]
unsafe fn fma_i32(acc: &mut Acc, d: f32, sum: int32x4_t) {
    acc.v = vfmaq_n_f32(acc.v, vcvtq_f32_s32(sum), d);
}

/// Low and high nibbles of the 16 bytes at `p` (elements 0..16 and 16..32).
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> (uint8x16_t, uint8x16_t) {
    let v = ld(p);
    (vandq_u8(v, vdupq_n_u8(0x0f)), vshrq_n_u8(v, 4))
}

/// 0x10 in byte `i` where bit `i` of the little-endian u32 at `qh` is set (32 bytes).
#[inline(always)]
unsafe fn q5_high(qh: *const u8) -> (uint8x16_t, uint8x16_t) {
    const BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];
    let bits = vld1q_u8(BITS.as_ptr());
    let h0 = vcombine_u8(vdup_n_u8(*qh), vdup_n_u8(*qh.add(1)));
    let h1 = vcombine_u8(vdup_n_u8(*qh.add(2)), vdup_n_u8(*qh.add(3)));
    let m = vdupq_n_u8(0x10);
    (
        vandq_u8(vtstq_u8(h0, bits), m),
        vandq_u8(vtstq_u8(h1, bits), m),
    )
}

// ---------------------------------------------------------------------------------------------
// Legacy formats

struct Q4_0;
impl Block for Q4_0 {
    const QK: usize = 32;
    const WB: usize = 18;
    const AB: usize = 34;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let (lo, hi) = nibbles(x.add(2));
        let eight = vdupq_n_s8(8);
        let a = dot16(vsubq_s8(s8(lo), eight), lds(y.add(2)));
        let b = dot16(vsubq_s8(s8(hi), eight), lds(y.add(18)));
        fma_i32(acc, f16_at(x) * f16_at(y), vaddq_s32(a, b));
    }
}

struct Q4_1;
impl Block for Q4_1 {
    const QK: usize = 32;
    const WB: usize = 20;
    const AB: usize = 36;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let (lo, hi) = nibbles(x.add(4));
        let a = dot16(s8(lo), lds(y.add(4)));
        let b = dot16(s8(hi), lds(y.add(20)));
        fma_i32(acc, f16_at(x) * f16_at(y), vaddq_s32(a, b));
        acc.s += f16_at(x.add(2)) * f16_at(y.add(2));
    }
}

struct Q5_0;
impl Block for Q5_0 {
    const QK: usize = 32;
    const WB: usize = 22;
    const AB: usize = 34;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let (lo, hi) = nibbles(x.add(6));
        let (h0, h1) = q5_high(x.add(2));
        let sixteen = vdupq_n_s8(16);
        let q0 = vsubq_s8(s8(vorrq_u8(lo, h0)), sixteen);
        let q1 = vsubq_s8(s8(vorrq_u8(hi, h1)), sixteen);
        let sum = vaddq_s32(dot16(q0, lds(y.add(2))), dot16(q1, lds(y.add(18))));
        fma_i32(acc, f16_at(x) * f16_at(y), sum);
    }
}

struct Q5_1;
impl Block for Q5_1 {
    const QK: usize = 32;
    const WB: usize = 24;
    const AB: usize = 36;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let (lo, hi) = nibbles(x.add(8));
        let (h0, h1) = q5_high(x.add(4));
        let q0 = s8(vorrq_u8(lo, h0));
        let q1 = s8(vorrq_u8(hi, h1));
        let sum = vaddq_s32(dot16(q0, lds(y.add(4))), dot16(q1, lds(y.add(20))));
        fma_i32(acc, f16_at(x) * f16_at(y), sum);
        acc.s += f16_at(x.add(2)) * f16_at(y.add(2));
    }
}

struct Q8_0;
impl Block for Q8_0 {
    const QK: usize = 32;
    const WB: usize = 34;
    const AB: usize = 34;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let a = dot16(lds(x.add(2)), lds(y.add(2)));
        let b = dot16(lds(x.add(18)), lds(y.add(18)));
        fma_i32(acc, f16_at(x) * f16_at(y), vaddq_s32(a, b));
    }
}

#[inline(always)]
unsafe fn lookup(qs: *const u8, table: &[i8; 16]) -> (int8x16_t, int8x16_t) {
    let t = vld1q_s8(table.as_ptr());
    let (lo, hi) = nibbles(qs);
    (vqtbl1q_s8(t, lo), vqtbl1q_s8(t, hi))
}

struct Iq4Nl;
impl Block for Iq4Nl {
    const QK: usize = 32;
    const WB: usize = 18;
    const AB: usize = 34;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let (q0, q1) = lookup(x.add(2), &KVALUES_IQ4NL);
        let sum = vaddq_s32(dot16(q0, lds(y.add(2))), dot16(q1, lds(y.add(18))));
        fma_i32(acc, f16_at(x) * f16_at(y), sum);
    }
}

struct Mxfp4;
impl Block for Mxfp4 {
    const QK: usize = 32;
    const WB: usize = 17;
    const AB: usize = 34;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let (q0, q1) = lookup(x.add(1), &KVALUES_MXFP4);
        let sum = vaddq_s32(dot16(q0, lds(y.add(2))), dot16(q1, lds(y.add(18))));
        fma_i32(acc, e8m0_to_f32_half(*x) * f16_at(y), sum);
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants against Q8_K (d f32 at 0, qs at 4, bsums i16 at 260)

const Y_QS: usize = 4;

#[inline(always)]
unsafe fn y_d(y: *const u8) -> f32 {
    f32::from_le_bytes([*y, *y.add(1), *y.add(2), *y.add(3)])
}

#[inline(always)]
unsafe fn bsum(y: *const u8, j: usize) -> i32 {
    let p = y.add(260 + 2 * j);
    i16::from_le_bytes([*p, *p.add(1)]) as i32
}

/// `acc += scale * sum(q * y)` over the 16 elements at `q` and `y` (q as i8, y at `yp`).
#[inline(always)]
unsafe fn group16(acc: int32x4_t, q: int8x16_t, yp: *const u8, scale: i32) -> int32x4_t {
    vmlaq_n_s32(acc, dot16(q, lds(yp)), scale)
}

struct Q2K;
impl Block for Q2K {
    const QK: usize = 256;
    const WB: usize = 84;
    const AB: usize = 292;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let sc = &*(x as *const [u8; 16]);
        let m3 = vdupq_n_u8(3);
        let mut sum = vdupq_n_s32(0);
        for chunk in 0..2 {
            let q = [ld(x.add(16 + 32 * chunk)), ld(x.add(16 + 32 * chunk + 16))];
            let yb = y.add(Y_QS + 128 * chunk);
            for j in 0..4 {
                let is = 8 * chunk + 2 * j;
                let sh = vdupq_n_s8(-2 * j as i8);
                for h in 0..2 {
                    let v = s8(vandq_u8(vshlq_u8(q[h], sh), m3));
                    sum = group16(sum, v, yb.add(32 * j + 16 * h), (sc[is + h] & 0x0f) as i32);
                }
            }
        }
        let summs: i32 = (0..16).map(|j| bsum(y, j) * (sc[j] >> 4) as i32).sum();
        let yd = y_d(y);
        fma_i32(acc, yd * f16_at(x.add(80)), sum);
        acc.s -= yd * f16_at(x.add(82)) * summs as f32;
    }
}

struct Q3K;
impl Block for Q3K {
    const QK: usize = 256;
    const WB: usize = 110;
    const AB: usize = 292;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let sc = q3k_scales(&*(x.add(96) as *const [u8; 12]));
        let hm = [ld(x), ld(x.add(16))];
        let m3 = vdupq_n_u8(3);
        let mut sum = vdupq_n_s32(0);
        for chunk in 0..2 {
            let q = [ld(x.add(32 + 32 * chunk)), ld(x.add(48 + 32 * chunk))];
            let yb = y.add(Y_QS + 128 * chunk);
            for j in 0..4 {
                let is = 8 * chunk + 2 * j;
                let sh = vdupq_n_s8(-2 * j as i8);
                let hbit = vdupq_n_u8(1 << (4 * chunk + j));
                for h in 0..2 {
                    let low = vandq_u8(vshlq_u8(q[h], sh), m3);
                    // 4 where the high bit is set: u = low + 4 * hbit, the quant is u - 4.
                    let high = vandq_u8(vtstq_u8(hm[h], hbit), vdupq_n_u8(4));
                    let v = s8(vorrq_u8(low, high));
                    sum = group16(sum, v, yb.add(32 * j + 16 * h), sc[is + h] as i32);
                }
            }
        }
        let offs: i32 = (0..16).map(|g| sc[g] as i32 * bsum(y, g)).sum();
        let total = vaddvq_s32(sum) - 4 * offs;
        acc.s += f16_at(x.add(108)) * y_d(y) * total as f32;
    }
}

/// Q4_K/Q5_K: eight scales, and the mins dotted with the bsums.
#[inline(always)]
unsafe fn k4_scales_mins(x: *const u8, y: *const u8) -> ([i32; 8], i32) {
    let s = &*(x.add(4) as *const [u8; 12]);
    let mut sc = [0i32; 8];
    let mut summs = 0;
    for (j, sc) in sc.iter_mut().enumerate() {
        let (d, m) = scale_min_k4(j, s);
        *sc = d as i32;
        summs += m as i32 * (bsum(y, 2 * j) + bsum(y, 2 * j + 1));
    }
    (sc, summs)
}

struct Q4K;
impl Block for Q4K {
    const QK: usize = 256;
    const WB: usize = 144;
    const AB: usize = 292;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let (sc, summs) = k4_scales_mins(x, y);
        let mut sum = vdupq_n_s32(0);
        for c in 0..4 {
            let yb = y.add(Y_QS + 64 * c);
            for h in 0..2 {
                let (lo, hi) = nibbles(x.add(16 + 32 * c + 16 * h));
                sum = group16(sum, s8(lo), yb.add(16 * h), sc[2 * c]);
                sum = group16(sum, s8(hi), yb.add(32 + 16 * h), sc[2 * c + 1]);
            }
        }
        let yd = y_d(y);
        fma_i32(acc, f16_at(x) * yd, sum);
        acc.s -= f16_at(x.add(2)) * yd * summs as f32;
    }
}

struct Q5K;
impl Block for Q5K {
    const QK: usize = 256;
    const WB: usize = 176;
    const AB: usize = 292;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let (sc, summs) = k4_scales_mins(x, y);
        let qh = [ld(x.add(16)), ld(x.add(32))];
        let m16 = vdupq_n_u8(16);
        let mut sum = vdupq_n_s32(0);
        for c in 0..4 {
            let yb = y.add(Y_QS + 64 * c);
            let b0 = vdupq_n_u8(1 << (2 * c));
            let b1 = vdupq_n_u8(2 << (2 * c));
            for (h, &qh) in qh.iter().enumerate() {
                let (lo, hi) = nibbles(x.add(48 + 32 * c + 16 * h));
                let lo = vorrq_u8(lo, vandq_u8(vtstq_u8(qh, b0), m16));
                let hi = vorrq_u8(hi, vandq_u8(vtstq_u8(qh, b1), m16));
                sum = group16(sum, s8(lo), yb.add(16 * h), sc[2 * c]);
                sum = group16(sum, s8(hi), yb.add(32 + 16 * h), sc[2 * c + 1]);
            }
        }
        let yd = y_d(y);
        fma_i32(acc, f16_at(x) * yd, sum);
        acc.s -= f16_at(x.add(2)) * yd * summs as f32;
    }
}

struct Q6K;
impl Block for Q6K {
    const QK: usize = 256;
    const WB: usize = 210;
    const AB: usize = 292;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut Acc) {
        let sc = &*(x.add(192) as *const [i8; 16]);
        let m4 = vdupq_n_u8(0x0f);
        let m3 = vdupq_n_u8(3);
        let mut sum = vdupq_n_s32(0);
        for chunk in 0..2 {
            let yb = y.add(Y_QS + 128 * chunk);
            for h in 0..2 {
                let ql0 = ld(x.add(64 * chunk + 16 * h));
                let ql1 = ld(x.add(64 * chunk + 32 + 16 * h));
                let qh = ld(x.add(128 + 32 * chunk + 16 * h));
                let parts = [
                    vorrq_u8(vandq_u8(ql0, m4), vshlq_n_u8(vandq_u8(qh, m3), 4)),
                    vorrq_u8(
                        vandq_u8(ql1, m4),
                        vshlq_n_u8(vandq_u8(vshrq_n_u8(qh, 2), m3), 4),
                    ),
                    vorrq_u8(
                        vshrq_n_u8(ql0, 4),
                        vshlq_n_u8(vandq_u8(vshrq_n_u8(qh, 4), m3), 4),
                    ),
                    vorrq_u8(vshrq_n_u8(ql1, 4), vshlq_n_u8(vshrq_n_u8(qh, 6), 4)),
                ];
                for (k, u) in parts.into_iter().enumerate() {
                    let g = 8 * chunk + 2 * k + h;
                    sum = group16(sum, s8(u), yb.add(32 * k + 16 * h), sc[g] as i32);
                }
            }
        }
        let offs: i32 = (0..16).map(|g| sc[g] as i32 * bsum(y, g)).sum();
        let total = vaddvq_s32(sum) - 32 * offs;
        acc.s += f16_at(x.add(208)) * y_d(y) * total as f32;
    }
}

// ---------------------------------------------------------------------------------------------
// Float rows

fn dot_f32(n: usize, row: &[u8], act: &[u8]) -> f32 {
    assert!(row.len() >= 4 * n && act.len() >= 4 * n);
    // SAFETY: NEON is baseline; every load reads inside the first `4 * n` bytes (assert above).
    unsafe {
        let (x, y) = (row.as_ptr() as *const f32, act.as_ptr() as *const f32);
        let mut acc = [vdupq_n_f32(0.0); 4];
        let mut i = 0;
        while i + 16 <= n {
            for (k, a) in acc.iter_mut().enumerate() {
                let o = i + 4 * k;
                *a = vfmaq_f32(*a, vld1q_f32(x.add(o)), vld1q_f32(y.add(o)));
            }
            i += 16;
        }
        let mut s = vaddvq_f32(vaddq_f32(
            vaddq_f32(acc[0], acc[1]),
            vaddq_f32(acc[2], acc[3]),
        ));
        while i < n {
            s += x.add(i).read_unaligned() * y.add(i).read_unaligned();
            i += 1;
        }
        s
    }
}

fn dot_bf16(n: usize, row: &[u8], act: &[u8]) -> f32 {
    assert!(row.len() >= 2 * n && act.len() >= 2 * n);
    // SAFETY: NEON is baseline; every load reads inside the first `2 * n` bytes (assert above).
    unsafe {
        let (x, y) = (row.as_ptr() as *const u16, act.as_ptr() as *const u16);
        let widen = |p: *const u16| vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16));
        let mut acc = [vdupq_n_f32(0.0); 2];
        let mut i = 0;
        while i + 8 <= n {
            acc[0] = vfmaq_f32(acc[0], widen(x.add(i)), widen(y.add(i)));
            acc[1] = vfmaq_f32(acc[1], widen(x.add(i + 4)), widen(y.add(i + 4)));
            i += 8;
        }
        let mut s = vaddvq_f32(vaddq_f32(acc[0], acc[1]));
        while i < n {
            let a = f32::from_bits((x.add(i).read_unaligned() as u32) << 16);
            let b = f32::from_bits((y.add(i).read_unaligned() as u32) << 16);
            s += a * b;
            i += 1;
        }
        s
    }
}
