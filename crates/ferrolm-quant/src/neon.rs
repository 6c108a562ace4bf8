//! NEON kernels (aarch64, where NEON is part of the base instruction set).
//!
//! Each kernel gives the same bits as the scalar reference, which follows llama.cpp's AVX2
//! lane structure: eight f32 lanes ([`Acc8`], two NEON registers), lane `l` of a 32-element
//! group holding the exact integer sum of the products of elements `4l..4l + 4` ([`quads`]),
//! accumulated with a fused multiply-add by the block scale and reduced as `hsum_float_8`.
//! Integer sums are exact (`vmull_s8`, then widening pairwise adds), so only the float steps
//! have to follow the reference's order. Float rows (F32, F16, BF16) keep the scalar kernels,
//! whose order is llama.cpp's AVX512 one.

use std::arch::aarch64::*;

use crate::common::{e8m0_to_f32_half, f16_to_f32};
use crate::iq::{
    odd_block_iq4_nl, odd_block_mxfp4, ue4m3_to_f32_half, KVALUES_IQ4NL, KVALUES_MXFP4,
};
use crate::iq2::KSIGNS;
use crate::iq_grids::{IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID};
use crate::k_quants::{q3k_scales, scale_min_k4};
use crate::kernel::{DotFn, Simd};
use crate::TensorType;

/// The kernels of this module for `ty`, if it has one.
pub(crate) fn kernel(ty: TensorType) -> Option<Simd> {
    use TensorType as T;
    let dot: DotFn = match ty {
        T::Q4_0 => dot_legacy::<Q4_0>,
        T::Q4_1 => dot_legacy::<Q4_1>,
        T::Q5_0 => dot_legacy::<Q5_0>,
        T::Q5_1 => dot_legacy::<Q5_1>,
        T::Q8_0 => dot_legacy::<Q8_0>,
        T::IQ4_NL => dot_pairs::<Iq4Nl>,
        T::MXFP4 => dot_pairs::<Mxfp4>,
        T::Q2_K => dot_super::<Q2K>,
        T::Q3_K => dot_super::<Q3K>,
        T::Q4_K => dot_super::<Q4K>,
        T::Q5_K => dot_super::<Q5K>,
        T::Q6_K => dot_super::<Q6K>,
        T::IQ4_XS => dot_super::<Iq4Xs>,
        T::IQ2_XXS => dot_super::<Iq2Xxs>,
        T::IQ2_XS => dot_super::<Iq2Xs>,
        T::IQ2_S => dot_super::<Iq2S>,
        T::IQ3_XXS => dot_super::<Iq3Xxs>,
        T::IQ3_S => dot_super::<Iq3S>,
        T::IQ1_S => dot_super::<Iq1S>,
        T::IQ1_M => dot_super::<Iq1M>,
        T::TQ1_0 => dot_super::<Tern<Tq1_0>>,
        T::TQ2_0 => dot_super::<Tern<Tq2_0>>,
        T::Q1_0 => dot_q1_0,
        T::Q2_0 => dot_q2_0,
        T::NVFP4 => dot_nvfp4,
        _ => return None,
    };
    Some(Simd {
        dot,
        rows: None,
        multi: None,
    })
}

/// The number of blocks in `n` elements, after checking that both slices hold them.
fn blocks(n: usize, qk: usize, row: &[u8], wb: usize, act: &[u8], ab: usize) -> usize {
    let nb = n / qk;
    assert!(n.is_multiple_of(qk) && row.len() >= nb * wb && act.len() >= nb * ab);
    nb
}

// ---------------------------------------------------------------------------------------------
// Lanes

/// Eight f32 lanes, as one AVX2 register of the reference: `lo` holds lanes 0..4.
#[derive(Clone, Copy)]
struct Acc8 {
    lo: float32x4_t,
    hi: float32x4_t,
}

impl Acc8 {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Acc8 {
            lo: vdupq_n_f32(0.0),
            hi: vdupq_n_f32(0.0),
        }
    }

    /// `acc[l] = fma(d, s[l], acc[l])`, the reference's `fma8`.
    #[inline(always)]
    unsafe fn fma(&mut self, d: f32, s: Lanes) {
        self.fma2(d, d, s);
    }

    /// As [`Acc8::fma`] with `d0` for lanes 0..4 and `d1` for the others.
    #[inline(always)]
    unsafe fn fma2(&mut self, d0: f32, d1: f32, s: Lanes) {
        self.lo = vfmaq_n_f32(self.lo, vcvtq_f32_s32(s.lo), d0);
        self.hi = vfmaq_n_f32(self.hi, vcvtq_f32_s32(s.hi), d1);
    }

    /// Lane by lane sum of two accumulators.
    #[inline(always)]
    unsafe fn add(self, o: Acc8) -> Acc8 {
        Acc8 {
            lo: vaddq_f32(self.lo, o.lo),
            hi: vaddq_f32(self.hi, o.hi),
        }
    }

    /// `hsum_float_8`: the high half added to the low half, then `(r0 + r2) + (r1 + r3)`.
    #[inline(always)]
    unsafe fn reduce(self) -> f32 {
        reduce4(vaddq_f32(self.hi, self.lo))
    }
}

/// `(r0 + r2) + (r1 + r3)` of four lanes.
#[inline(always)]
unsafe fn reduce4(r: float32x4_t) -> f32 {
    vpadds_f32(vadd_f32(vget_low_f32(r), vget_high_f32(r)))
}

/// Eight i32 lanes: the integer sums of one block before their conversion to f32.
#[derive(Clone, Copy)]
struct Lanes {
    lo: int32x4_t,
    hi: int32x4_t,
}

impl Lanes {
    #[inline(always)]
    unsafe fn zero() -> Self {
        Lanes {
            lo: vdupq_n_s32(0),
            hi: vdupq_n_s32(0),
        }
    }

    #[inline(always)]
    unsafe fn load(v: &[i32; 8]) -> Self {
        Lanes {
            lo: vld1q_s32(v.as_ptr()),
            hi: vld1q_s32(v.as_ptr().add(4)),
        }
    }

    /// The lanes of the 32 products of `q` with the activation quants at `y`.
    #[inline(always)]
    unsafe fn of(q: [int8x16_t; 2], y: *const u8) -> Self {
        Lanes {
            lo: quads(q[0], lds(y)),
            hi: quads(q[1], lds(y.add(16))),
        }
    }

    /// Adds the lanes of a 32-element group, its first 16 elements scaled by `s0` and the
    /// others by `s1`.
    #[inline(always)]
    unsafe fn add_group(&mut self, q: [int8x16_t; 2], y: *const u8, s0: i32, s1: i32) {
        let g = Lanes::of(q, y);
        self.lo = vmlaq_n_s32(self.lo, g.lo, s0);
        self.hi = vmlaq_n_s32(self.hi, g.hi, s1);
    }

    #[inline(always)]
    unsafe fn sub(self, o: Lanes) -> Lanes {
        Lanes {
            lo: vsubq_s32(self.lo, o.lo),
            hi: vsubq_s32(self.hi, o.hi),
        }
    }
}

/// Four i32 lanes of 16 products: lane `k` sums the products of elements `4k..4k + 4`.
#[inline(always)]
unsafe fn quads(a: int8x16_t, b: int8x16_t) -> int32x4_t {
    let p0 = vpaddlq_s16(vmull_s8(vget_low_s8(a), vget_low_s8(b)));
    let p1 = vpaddlq_s16(vmull_high_s8(a, b));
    vpaddq_s32(p0, p1)
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

/// Low and high nibbles of the 16 bytes at `p` (elements 0..16 and 16..32).
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> [uint8x16_t; 2] {
    let v = ld(p);
    [vandq_u8(v, vdupq_n_u8(0x0f)), vshrq_n_u8(v, 4)]
}

/// Bit `i % 8` in byte `i`: what each byte of a broadcast bit mask tests.
const BITS: [u8; 16] = [1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128];

/// 0x10 in byte `i` where bit `i` of the little-endian u32 at `qh` is set (32 bytes).
#[inline(always)]
unsafe fn q5_high(qh: *const u8) -> [uint8x16_t; 2] {
    let bits = vld1q_u8(BITS.as_ptr());
    let h0 = vcombine_u8(vdup_n_u8(*qh), vdup_n_u8(*qh.add(1)));
    let h1 = vcombine_u8(vdup_n_u8(*qh.add(2)), vdup_n_u8(*qh.add(3)));
    let m = vdupq_n_u8(0x10);
    [
        vandq_u8(vtstq_u8(h0, bits), m),
        vandq_u8(vtstq_u8(h1, bits), m),
    ]
}

/// The codebook values of the 32 nibbles at `qs` (IQ4_NL's packing).
#[inline(always)]
unsafe fn lookup(qs: *const u8, table: &[i8; 16]) -> [int8x16_t; 2] {
    let t = vld1q_s8(table.as_ptr());
    nibbles(qs).map(|n| vqtbl1q_s8(t, n))
}

// ---------------------------------------------------------------------------------------------
// 32-element formats against Q8_0 / Q8_1

/// A 32-element block format: its quants as signed bytes and its scale.
trait Legacy {
    const WB: usize;
    const AB: usize;
    /// Where the activation block's quants start (after `d`, and `s` for Q8_1).
    const YQ: usize;
    /// Whether the format has a minimum, dotted as `m * s` in a scalar sum.
    const MIN: bool = false;
    /// # Safety
    /// `x` has `WB` readable bytes.
    unsafe fn quants(x: *const u8) -> [int8x16_t; 2];
    /// # Safety
    /// `x` has `WB` readable bytes and `y` has `AB`.
    unsafe fn scale(x: *const u8, y: *const u8) -> f32 {
        f16_at(x) * f16_at(y)
    }
}

/// llama.cpp's AVX2 loop of the legacy formats: one accumulator, `hsum_float_8`, plus the
/// minimums' sum, accumulated without fusion.
fn dot_legacy<B: Legacy>(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = blocks(n, 32, row, B::WB, act, B::AB);
    // SAFETY: NEON is baseline on aarch64; `blocks` checked that both slices hold `nb` blocks.
    unsafe {
        let (x, y) = (row.as_ptr(), act.as_ptr());
        let mut acc = Acc8::zero();
        let mut summs = 0f32;
        for b in 0..nb {
            let (x, y) = (x.add(b * B::WB), y.add(b * B::AB));
            if B::MIN {
                summs += f16_at(x.add(2)) * f16_at(y.add(2));
            }
            acc.fma(B::scale(x, y), Lanes::of(B::quants(x), y.add(B::YQ)));
        }
        if B::MIN {
            acc.reduce() + summs
        } else {
            acc.reduce()
        }
    }
}

struct Q4_0;
impl Legacy for Q4_0 {
    const WB: usize = 18;
    const AB: usize = 34;
    const YQ: usize = 2;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> [int8x16_t; 2] {
        nibbles(x.add(2)).map(|q| vsubq_s8(s8(q), vdupq_n_s8(8)))
    }
}

struct Q4_1;
impl Legacy for Q4_1 {
    const WB: usize = 20;
    const AB: usize = 36;
    const YQ: usize = 4;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> [int8x16_t; 2] {
        nibbles(x.add(4)).map(|q| s8(q))
    }
}

/// The five-bit quants of Q5_0 / Q5_1 from the `qh` at `qh` and the nibbles after it.
#[inline(always)]
unsafe fn q5_quants(qh: *const u8) -> [uint8x16_t; 2] {
    let (lo, hi) = (nibbles(qh.add(4)), q5_high(qh));
    [vorrq_u8(lo[0], hi[0]), vorrq_u8(lo[1], hi[1])]
}

struct Q5_0;
impl Legacy for Q5_0 {
    const WB: usize = 22;
    const AB: usize = 34;
    const YQ: usize = 2;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> [int8x16_t; 2] {
        q5_quants(x.add(2)).map(|q| vsubq_s8(s8(q), vdupq_n_s8(16)))
    }
}

struct Q5_1;
impl Legacy for Q5_1 {
    const WB: usize = 24;
    const AB: usize = 36;
    const YQ: usize = 4;
    const MIN: bool = true;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> [int8x16_t; 2] {
        q5_quants(x.add(4)).map(|q| s8(q))
    }
}

struct Q8_0;
impl Legacy for Q8_0 {
    const WB: usize = 34;
    const AB: usize = 34;
    const YQ: usize = 2;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> [int8x16_t; 2] {
        [lds(x.add(2)), lds(x.add(18))]
    }
}

/// A codebook format whose reference pairs blocks (IQ4_NL, MXFP4).
trait Paired: Legacy {
    /// The scalar last block of an odd count.
    const ODD: fn(&[u8], &[u8]) -> f32;
}

/// llama.cpp's AVX2 IQ4_NL / MXFP4 loop: blocks in pairs into two accumulators, their lane
/// sums reduced, then an odd last block in scalar code.
fn dot_pairs<B: Paired>(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = blocks(n, 32, row, B::WB, act, B::AB);
    let pairs = nb / 2;
    // SAFETY: NEON is baseline on aarch64; the loop reads the first `2 * pairs <= nb` blocks.
    let sum = unsafe {
        let (x, y) = (row.as_ptr(), act.as_ptr());
        let mut acc = [Acc8::zero(); 2];
        for b in 0..2 * pairs {
            let (x, y) = (x.add(b * B::WB), y.add(b * B::AB));
            acc[b % 2].fma(B::scale(x, y), Lanes::of(B::quants(x), y.add(B::YQ)));
        }
        acc[0].add(acc[1]).reduce()
    };
    if nb % 2 == 1 {
        let b = nb - 1;
        let odd = B::ODD(
            &row[b * B::WB..(b + 1) * B::WB],
            &act[b * B::AB..(b + 1) * B::AB],
        );
        sum + odd
    } else {
        sum
    }
}

struct Iq4Nl;
impl Legacy for Iq4Nl {
    const WB: usize = 18;
    const AB: usize = 34;
    const YQ: usize = 2;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> [int8x16_t; 2] {
        lookup(x.add(2), &KVALUES_IQ4NL)
    }
}
impl Paired for Iq4Nl {
    const ODD: fn(&[u8], &[u8]) -> f32 = odd_block_iq4_nl;
}

struct Mxfp4;
impl Legacy for Mxfp4 {
    const WB: usize = 17;
    const AB: usize = 34;
    const YQ: usize = 2;
    #[inline(always)]
    unsafe fn quants(x: *const u8) -> [int8x16_t; 2] {
        lookup(x.add(1), &KVALUES_MXFP4)
    }
    #[inline(always)]
    unsafe fn scale(x: *const u8, y: *const u8) -> f32 {
        f16_at(y) * e8m0_to_f32_half(*x)
    }
}
impl Paired for Mxfp4 {
    const ODD: fn(&[u8], &[u8]) -> f32 = odd_block_mxfp4;
}

// ---------------------------------------------------------------------------------------------
// 256-element formats against Q8_K (an f32 `d`, the quants, the i16 sums of each 16)

const Y_QS: usize = 4;
const Q8K_BYTES: usize = 292;

#[inline(always)]
unsafe fn y_d(y: *const u8) -> f32 {
    f32::from_le_bytes([*y, *y.add(1), *y.add(2), *y.add(3)])
}

/// The sum of the activation quants of 16-element group `j`.
#[inline(always)]
unsafe fn bsum(y: *const u8, j: usize) -> i32 {
    let p = y.add(260 + 2 * j);
    i16::from_le_bytes([*p, *p.add(1)]) as i32
}

/// The activation quants of 32-element group `g`.
#[inline(always)]
unsafe fn y_group(y: *const u8, g: usize) -> *const u8 {
    y.add(Y_QS + 32 * g)
}

/// What a 256-element kernel does after its lanes: add Q4_K's minimums in four lanes or
/// Q5_K's in one sum, scale the sum (the lattice i-quants' fixed factor), or add IQ1's
/// deltas (IQ1_S's in one sum, IQ1_M's in eight more lanes) times their step.
enum Tail {
    None,
    Four,
    One,
    Times(f32),
    DeltaOne,
    DeltaLanes,
}

/// IQ1's delta step.
const IQ1_DELTA: f32 = 0.125;

struct SuperAcc {
    v: Acc8,
    v2: Acc8,
    m4: float32x4_t,
    m: f32,
}

trait Super {
    const WB: usize;
    const TAIL: Tail = Tail::None;
    /// # Safety
    /// `x` has `WB` readable bytes and `y` a whole Q8_K block.
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc);
}

fn dot_super<B: Super>(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = blocks(n, 256, row, B::WB, act, Q8K_BYTES);
    // SAFETY: NEON is baseline on aarch64; `blocks` checked that both slices hold `nb` blocks.
    unsafe {
        let (x, y) = (row.as_ptr(), act.as_ptr());
        let mut acc = SuperAcc {
            v: Acc8::zero(),
            v2: Acc8::zero(),
            m4: vdupq_n_f32(0.0),
            m: 0.0,
        };
        for b in 0..nb {
            B::step(x.add(b * B::WB), y.add(b * Q8K_BYTES), &mut acc);
        }
        match B::TAIL {
            Tail::None => acc.v.reduce(),
            Tail::Four => acc.v.reduce() + reduce4(acc.m4),
            Tail::One => acc.v.reduce() + acc.m,
            Tail::Times(f) => f * acc.v.reduce(),
            Tail::DeltaOne => acc.v.reduce() + IQ1_DELTA * acc.m,
            Tail::DeltaLanes => acc.v.reduce() + IQ1_DELTA * acc.v2.reduce(),
        }
    }
}

/// The 2-bit fields at `shift` of the bytes of `q` (32 elements).
#[inline(always)]
unsafe fn crumbs(q: [uint8x16_t; 2], shift: i8) -> [uint8x16_t; 2] {
    let sh = vdupq_n_s8(-shift);
    q.map(|q| vandq_u8(vshlq_u8(q, sh), vdupq_n_u8(3)))
}

struct Q2K;
impl Super for Q2K {
    const WB: usize = 84;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let sc = &*(x as *const [u8; 16]);
        let yd = y_d(y);
        let d = yd * f16_at(x.add(80));
        let dmin = -yd * f16_at(x.add(82));
        // the minimums first, lane `l` pairing groups `2l` and `2l + 1`
        let prod: [i32; 8] = std::array::from_fn(|l| {
            bsum(y, 2 * l) * (sc[2 * l] >> 4) as i32
                + bsum(y, 2 * l + 1) * (sc[2 * l + 1] >> 4) as i32
        });
        acc.v.fma(dmin, Lanes::load(&prod));
        let mut s = Lanes::zero();
        for chunk in 0..2 {
            let q = [ld(x.add(16 + 32 * chunk)), ld(x.add(32 + 32 * chunk))];
            for j in 0..4 {
                let g = 4 * chunk + j;
                let v = crumbs(q, 2 * j as i8).map(|v| s8(v));
                let (s0, s1) = ((sc[2 * g] & 0x0f) as i32, (sc[2 * g + 1] & 0x0f) as i32);
                s.add_group(v, y_group(y, g), s0, s1);
            }
        }
        acc.v.fma(d, s);
    }
}

struct Q3K;
impl Super for Q3K {
    const WB: usize = 110;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let sc = q3k_scales(&*(x.add(96) as *const [u8; 12]));
        let hm = [ld(x), ld(x.add(16))];
        let mut s = Lanes::zero();
        for chunk in 0..2 {
            let q = [ld(x.add(32 + 32 * chunk)), ld(x.add(48 + 32 * chunk))];
            for j in 0..4 {
                let g = 4 * chunk + j;
                let hbit = vdupq_n_u8(1 << g);
                let low = crumbs(q, 2 * j as i8);
                // the quant is `low - 4` where its high bit is clear
                let v: [int8x16_t; 2] = std::array::from_fn(|h| {
                    let high = vandq_u8(vtstq_u8(hm[h], hbit), vdupq_n_u8(4));
                    vsubq_s8(s8(vorrq_u8(low[h], high)), vdupq_n_s8(4))
                });
                s.add_group(v, y_group(y, g), sc[2 * g] as i32, sc[2 * g + 1] as i32);
            }
        }
        acc.v.fma(y_d(y) * f16_at(x.add(108)), s);
    }
}

/// Q4_K / Q5_K: the eight group scales, and the minimums against the activation sums in
/// llama.cpp's four lanes (`min[2k] * ysum[2k] + min[2k + 1] * ysum[2k + 1]`).
#[inline(always)]
unsafe fn k4_scales_mins(x: *const u8, y: *const u8) -> ([i32; 8], [i32; 4]) {
    let s = &*(x.add(4) as *const [u8; 12]);
    let mut sc = [0i32; 8];
    let mut prod = [0i32; 4];
    for (j, sc) in sc.iter_mut().enumerate() {
        let (d, m) = scale_min_k4(j, s);
        *sc = d as i32;
        prod[j / 2] += m as i32 * (bsum(y, 2 * j) + bsum(y, 2 * j + 1));
    }
    (sc, prod)
}

/// The lanes of Q4_K / Q5_K: group `2c` in the low nibbles of the 32 bytes of chunk `c`,
/// group `2c + 1` in the high ones, each with the fifth bits `high` adds.
#[inline(always)]
unsafe fn k4_lanes(
    qs: *const u8,
    y: *const u8,
    sc: &[i32; 8],
    high: impl Fn(usize) -> [[uint8x16_t; 2]; 2],
) -> Lanes {
    let mut s = Lanes::zero();
    for c in 0..4 {
        let (a, b) = (nibbles(qs.add(32 * c)), nibbles(qs.add(32 * c + 16)));
        let h = high(c);
        let lo = [vorrq_u8(a[0], h[0][0]), vorrq_u8(b[0], h[0][1])].map(|v| s8(v));
        let hi = [vorrq_u8(a[1], h[1][0]), vorrq_u8(b[1], h[1][1])].map(|v| s8(v));
        s.add_group(lo, y_group(y, 2 * c), sc[2 * c], sc[2 * c]);
        s.add_group(hi, y_group(y, 2 * c + 1), sc[2 * c + 1], sc[2 * c + 1]);
    }
    s
}

struct Q4K;
impl Super for Q4K {
    const WB: usize = 144;
    const TAIL: Tail = Tail::Four;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let yd = y_d(y);
        let (d, dmin) = (yd * f16_at(x), -yd * f16_at(x.add(2)));
        let (sc, prod) = k4_scales_mins(x, y);
        acc.m4 = vfmaq_n_f32(acc.m4, vcvtq_f32_s32(vld1q_s32(prod.as_ptr())), dmin);
        let zero = [[vdupq_n_u8(0); 2]; 2];
        acc.v.fma(d, k4_lanes(x.add(16), y, &sc, |_| zero));
    }
}

struct Q5K;
impl Super for Q5K {
    const WB: usize = 176;
    const TAIL: Tail = Tail::One;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let yd = y_d(y);
        let (d, dmin) = (yd * f16_at(x), -yd * f16_at(x.add(2)));
        let (sc, prod) = k4_scales_mins(x, y);
        acc.m = dmin.mul_add(prod.iter().sum::<i32>() as f32, acc.m);
        let qh = [ld(x.add(16)), ld(x.add(32))];
        let bit = |b: u8| qh.map(|h| vandq_u8(vtstq_u8(h, vdupq_n_u8(b)), vdupq_n_u8(16)));
        let high = |c: usize| [bit(1 << (2 * c)), bit(2 << (2 * c))];
        acc.v.fma(d, k4_lanes(x.add(48), y, &sc, high));
    }
}

struct Q6K;
impl Super for Q6K {
    const WB: usize = 210;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let sc = &*(x.add(192) as *const [i8; 16]);
        let (m4, m3) = (vdupq_n_u8(0x0f), vdupq_n_u8(3));
        let mut s = Lanes::zero();
        for chunk in 0..2 {
            // the four 32-element groups of the chunk, in halves of 16, as unsigned quants
            let parts = [0, 16].map(|h| {
                let ql0 = ld(x.add(64 * chunk + h));
                let ql1 = ld(x.add(64 * chunk + 32 + h));
                let qh = ld(x.add(128 + 32 * chunk + h));
                let top = |k: i32| {
                    vshlq_u8(
                        vandq_u8(vshlq_u8(qh, vdupq_n_s8(-2 * k as i8)), m3),
                        vdupq_n_s8(4),
                    )
                };
                [
                    vorrq_u8(vandq_u8(ql0, m4), top(0)),
                    vorrq_u8(vandq_u8(ql1, m4), top(1)),
                    vorrq_u8(vshrq_n_u8(ql0, 4), top(2)),
                    vorrq_u8(vshrq_n_u8(ql1, 4), top(3)),
                ]
            });
            for (k, (&p0, &p1)) in parts[0].iter().zip(&parts[1]).enumerate() {
                let g = 4 * chunk + k;
                let v = [s8(p0), s8(p1)];
                s.add_group(v, y_group(y, g), sc[2 * g] as i32, sc[2 * g + 1] as i32);
            }
        }
        // the quants' offset off each lane, as llama.cpp pairs the scaled sums
        let sc = |j: usize| sc[j] as i32;
        let offs: [i32; 8] = std::array::from_fn(|l| {
            32 * (bsum(y, 2 * l) * sc(2 * l) + bsum(y, 2 * l + 1) * sc(2 * l + 1))
        });
        acc.v
            .fma(y_d(y) * f16_at(x.add(208)), s.sub(Lanes::load(&offs)));
    }
}

struct Iq4Xs;
impl Super for Iq4Xs {
    const WB: usize = 136;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let h = u16::from_le_bytes([*x.add(2), *x.add(3)]);
        let mut s = Lanes::zero();
        for g in 0..8 {
            let l = (*x.add(4 + g / 2) >> (4 * (g % 2))) & 0x0f;
            let scale = (l as u16 | ((h >> (2 * g)) & 3) << 4) as i32 - 32;
            let q = lookup(x.add(8 + 16 * g), &KVALUES_IQ4NL);
            s.add_group(q, y_group(y, g), scale, scale);
        }
        acc.v.fma(f16_at(x) * y_d(y), s);
    }
}

// ---------------------------------------------------------------------------------------------
// Lattice i-quants: each 8 elements a grid entry of magnitudes and a byte of signs

/// The 32 values of four grid entries (8 magnitudes each), negated where `signs` has a bit.
#[inline(always)]
unsafe fn signed_grid(words: [u64; 4], signs: [u8; 4]) -> [int8x16_t; 2] {
    let bits = vld1q_u8(BITS.as_ptr());
    std::array::from_fn(|h| {
        let v = vcombine_s8(vcreate_s8(words[2 * h]), vcreate_s8(words[2 * h + 1]));
        let s = vcombine_u8(vdup_n_u8(signs[2 * h]), vdup_n_u8(signs[2 * h + 1]));
        // `(v ^ m) - m` negates where the mask `m` is all ones
        let m = s8(vtstq_u8(s, bits));
        vsubq_s8(veorq_s8(v, m), m)
    })
}

#[inline(always)]
unsafe fn u16_at(p: *const u8) -> u16 {
    u16::from_le_bytes([*p, *p.add(1)])
}

#[inline(always)]
unsafe fn u32_at(p: *const u8) -> u32 {
    u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)])
}

/// A lattice i-quant: the grid entries, signs and odd multipliers `2s + 1` of its
/// 32-element groups, summed into lanes as [`Super`] does, times `d_x * d_y`.
trait Lattice {
    const WB: usize;
    const FACTOR: Tail;
    /// Group `g`'s grid words, sign bytes and the multipliers of its two halves.
    /// # Safety
    /// `x` has `WB` readable bytes.
    unsafe fn group(x: *const u8, g: usize) -> ([u64; 4], [u8; 4], i32, i32);
}

impl<L: Lattice> Super for L {
    const WB: usize = L::WB;
    const TAIL: Tail = L::FACTOR;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let mut s = Lanes::zero();
        for g in 0..8 {
            let (words, signs, s0, s1) = L::group(x, g);
            s.add_group(signed_grid(words, signs), y_group(y, g), s0, s1);
        }
        acc.v.fma(f16_at(x) * y_d(y), s);
    }
}

/// IQ3's eight values of two 4-magnitude grid entries.
#[inline(always)]
fn pair(a: u32, b: u32) -> u64 {
    a as u64 | (b as u64) << 32
}

/// The multipliers of IQ2_XS / IQ2_S: a 4-bit scale per 16 elements.
#[inline(always)]
fn halves(scale: u8) -> (i32, i32) {
    (2 * (scale & 0x0f) as i32 + 1, 2 * (scale >> 4) as i32 + 1)
}

struct Iq2Xxs;
impl Lattice for Iq2Xxs {
    const WB: usize = 66;
    const FACTOR: Tail = Tail::Times(0.125);
    #[inline(always)]
    unsafe fn group(x: *const u8, g: usize) -> ([u64; 4], [u8; 4], i32, i32) {
        let (grid, aux) = (u32_at(x.add(2 + 8 * g)), u32_at(x.add(6 + 8 * g)));
        let words = std::array::from_fn(|l| IQ2XXS_GRID[(grid >> (8 * l) & 0xff) as usize]);
        let signs = std::array::from_fn(|l| KSIGNS[(aux >> (7 * l) & 127) as usize]);
        let m = 2 * (aux >> 28) as i32 + 1;
        (words, signs, m, m)
    }
}

struct Iq2Xs;
impl Lattice for Iq2Xs {
    const WB: usize = 74;
    const FACTOR: Tail = Tail::Times(0.125);
    #[inline(always)]
    unsafe fn group(x: *const u8, g: usize) -> ([u64; 4], [u8; 4], i32, i32) {
        let q: [u16; 4] = std::array::from_fn(|l| u16_at(x.add(2 + 8 * g + 2 * l)));
        let words = q.map(|q| IQ2XS_GRID[(q & 511) as usize]);
        let signs = q.map(|q| KSIGNS[(q >> 9) as usize]);
        let (s0, s1) = halves(*x.add(66 + g));
        (words, signs, s0, s1)
    }
}

struct Iq2S;
impl Lattice for Iq2S {
    const WB: usize = 82;
    const FACTOR: Tail = Tail::Times(0.125);
    #[inline(always)]
    unsafe fn group(x: *const u8, g: usize) -> ([u64; 4], [u8; 4], i32, i32) {
        let qh = *x.add(66 + g) as usize;
        let words = std::array::from_fn(|l| {
            IQ2S_GRID[*x.add(2 + 4 * g + l) as usize | (qh << (8 - 2 * l) & 0x300)]
        });
        let signs = std::array::from_fn(|l| *x.add(34 + 4 * g + l));
        let (s0, s1) = halves(*x.add(74 + g));
        (words, signs, s0, s1)
    }
}

struct Iq3Xxs;
impl Lattice for Iq3Xxs {
    const WB: usize = 98;
    const FACTOR: Tail = Tail::Times(0.25);
    #[inline(always)]
    unsafe fn group(x: *const u8, g: usize) -> ([u64; 4], [u8; 4], i32, i32) {
        let aux = u32_at(x.add(66 + 4 * g));
        let q = x.add(2 + 8 * g);
        let grid = |i: usize| IQ3XXS_GRID[*q.add(i) as usize];
        let words = std::array::from_fn(|l| pair(grid(2 * l), grid(2 * l + 1)));
        let signs = std::array::from_fn(|l| KSIGNS[(aux >> (7 * l) & 127) as usize]);
        let m = 2 * (aux >> 28) as i32 + 1;
        (words, signs, m, m)
    }
}

struct Iq3S;
impl Lattice for Iq3S {
    const WB: usize = 110;
    const FACTOR: Tail = Tail::None;
    #[inline(always)]
    unsafe fn group(x: *const u8, g: usize) -> ([u64; 4], [u8; 4], i32, i32) {
        let qh = *x.add(66 + g) as usize;
        let q = x.add(2 + 8 * g);
        let words = std::array::from_fn(|l| {
            let i1 = *q.add(2 * l) as usize | (qh << (8 - 2 * l) & 256);
            let i2 = *q.add(2 * l + 1) as usize | (qh << (7 - 2 * l) & 256);
            pair(IQ3S_GRID[i1], IQ3S_GRID[i2])
        });
        let signs = std::array::from_fn(|l| *x.add(74 + 4 * g + l));
        let m = 2 * ((*x.add(106 + g / 2) >> (4 * (g % 2))) & 0x0f) as i32 + 1;
        (words, signs, m, m)
    }
}

// ---------------------------------------------------------------------------------------------
// IQ1_S / IQ1_M: grid entries of -1, 0, 1 and a signed delta per 8 (IQ1_S: per 32) elements

/// The 32 values of four IQ1 grid entries.
#[inline(always)]
unsafe fn iq1_grid(idx: [usize; 4]) -> [int8x16_t; 2] {
    let w = idx.map(|i| vcreate_s8(IQ1S_GRID[i]));
    [vcombine_s8(w[0], w[1]), vcombine_s8(w[2], w[3])]
}

struct Iq1S;
impl Super for Iq1S {
    const WB: usize = 50;
    const TAIL: Tail = Tail::DeltaOne;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let mut s = Lanes::zero();
        let mut sumi1 = 0i32;
        for g in 0..8 {
            let qh = u16_at(x.add(34 + 2 * g)) as usize;
            let idx =
                std::array::from_fn(|l| *x.add(2 + 4 * g + l) as usize | (qh >> (3 * l) & 7) << 8);
            let m = 2 * (qh >> 12 & 7) as i32 + 1;
            s.add_group(iq1_grid(idx), y_group(y, g), m, m);
            let sign = if qh & 0x8000 != 0 { -1 } else { 1 };
            sumi1 += (bsum(y, 2 * g) + bsum(y, 2 * g + 1)) * sign * m;
        }
        let d = y_d(y) * f16_at(x);
        acc.v.fma(d, s);
        acc.m = d.mul_add(sumi1 as f32, acc.m);
    }
}

struct Iq1M;
impl Super for Iq1M {
    const WB: usize = 56;
    const TAIL: Tail = Tail::DeltaLanes;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let sc: [u16; 4] = std::array::from_fn(|k| u16_at(x.add(48 + 2 * k)));
        // the f16 scale lives in the top nibbles of the four scale words
        let bits = (sc[0] >> 12) | (sc[1] >> 8 & 0x00f0) | (sc[2] >> 4 & 0x0f00) | (sc[3] & 0xf000);
        let d = y_d(y) * f16_to_f32(bits.to_le_bytes());
        let mult = |j: usize| 2 * (sc[j / 4] >> (3 * (j % 4)) & 7) as i32 + 1;
        let (mut s, mut delta) = (Lanes::zero(), Lanes::zero());
        for g in 0..8 {
            let nib: [u8; 4] = std::array::from_fn(|l| {
                let k = 4 * g + l;
                *x.add(32 + k / 2) >> (4 * (k % 2)) & 0x0f
            });
            let idx =
                std::array::from_fn(|l| *x.add(4 * g + l) as usize | (nib[l] as usize & 7) << 8);
            let sign = nib.map(|n| vdup_n_s8(if n & 8 != 0 { -1 } else { 1 }));
            let signs = [vcombine_s8(sign[0], sign[1]), vcombine_s8(sign[2], sign[3])];
            let (m0, m1) = (mult(2 * g), mult(2 * g + 1));
            s.add_group(iq1_grid(idx), y_group(y, g), m0, m1);
            delta.add_group(signs, y_group(y, g), m0, m1);
        }
        acc.v.fma(d, s);
        acc.v2.fma(d, delta);
    }
}

// ---------------------------------------------------------------------------------------------
// Ternary formats: codes 0, 1, 2 for -1, 0, 1, the offset taken off with the activation sums

/// A ternary format: the unsigned codes of its 32-element groups.
trait Ternary {
    const WB: usize;
    /// Where `d` is.
    const D: usize;
    /// # Safety
    /// `x` has `WB` readable bytes.
    unsafe fn codes(x: *const u8, g: usize) -> [uint8x16_t; 2];
}

/// A ternary format as a [`Super`] kernel (apart from the [`Lattice`] ones).
struct Tern<T>(T);

impl<T: Ternary> Super for Tern<T> {
    const WB: usize = T::WB;
    #[inline(always)]
    unsafe fn step(x: *const u8, y: *const u8, acc: &mut SuperAcc) {
        let mut s = Lanes::zero();
        for g in 0..8 {
            s.add_group(T::codes(x, g).map(|c| s8(c)), y_group(y, g), 1, 1);
        }
        // lane `l` takes the offset of groups `2l` and `2l + 1`, as the reference does
        let offs: [i32; 8] = std::array::from_fn(|l| bsum(y, 2 * l) + bsum(y, 2 * l + 1));
        acc.v
            .fma(y_d(y) * f16_at(x.add(T::D)), s.sub(Lanes::load(&offs)));
    }
}

/// The base-3 digit of each byte of `v` that `pow` (a power of 3 per byte) selects:
/// `((v * pow) mod 256 * 3) >> 8`.
#[inline(always)]
unsafe fn trits(v: uint8x16_t, pow: uint8x16_t) -> uint8x16_t {
    let m = vmulq_u8(v, pow);
    let lo = vshrn_n_u16(vmull_u8(vget_low_u8(m), vdup_n_u8(3)), 8);
    let hi = vshrn_n_u16(vmull_high_u8(m, vdupq_n_u8(3)), 8);
    vcombine_u8(lo, hi)
}

const POW3: [u8; 5] = [1, 3, 9, 27, 81];

#[allow(non_camel_case_types)]
struct Tq1_0;
impl Ternary for Tq1_0 {
    const WB: usize = 54;
    const D: usize = 52;
    #[inline(always)]
    unsafe fn codes(x: *const u8, g: usize) -> [uint8x16_t; 2] {
        let pow = |n: usize| vdupq_n_u8(POW3[n]);
        match g {
            // the first groups: digit `g` of each byte of the first part of `qs`
            0..5 => [trits(ld(x), pow(g)), trits(ld(x.add(16)), pow(g))],
            // then two digits a group of the rest of `qs`
            5 | 6 => {
                let b = ld(x.add(32));
                [trits(b, pow(2 * g - 10)), trits(b, pow(2 * g - 9))]
            }
            // its last digit, then the digits of the `qh` bytes
            _ => {
                const QH_POW: [u8; 16] = [1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27];
                let qh = vreinterpretq_u8_u32(vdupq_n_u32(u32_at(x.add(48))));
                [
                    trits(ld(x.add(32)), pow(4)),
                    trits(qh, vld1q_u8(QH_POW.as_ptr())),
                ]
            }
        }
    }
}

#[allow(non_camel_case_types)]
struct Tq2_0;
impl Ternary for Tq2_0 {
    const WB: usize = 66;
    const D: usize = 64;
    #[inline(always)]
    unsafe fn codes(x: *const u8, g: usize) -> [uint8x16_t; 2] {
        let q = x.add(32 * (g / 4));
        crumbs([ld(q), ld(q.add(16))], 2 * (g % 4) as i8)
    }
}

// ---------------------------------------------------------------------------------------------
// Q1_0, Q2_0 and NVFP4: blocks spanning several Q8_0 blocks

const Q8_0_BYTES: usize = 34;

/// Q1_0's 32 signs at `qs` (one bit each) as +1 / -1.
#[inline(always)]
unsafe fn q1_signs(qs: *const u8) -> [int8x16_t; 2] {
    let bits = vld1q_u8(BITS.as_ptr());
    std::array::from_fn(|h| {
        let b = vcombine_u8(vdup_n_u8(*qs.add(2 * h)), vdup_n_u8(*qs.add(2 * h + 1)));
        let two = vandq_u8(vtstq_u8(b, bits), vdupq_n_u8(2));
        vsubq_s8(s8(two), vdupq_n_s8(1))
    })
}

/// The reference's Q1_0 loop: per weight block, the lanes of its four Q8_0 blocks scaled by
/// their `d` (the first a product, the others fused), then fused by the weight's `d`.
fn dot_q1_0(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = blocks(n, 128, row, 18, act, 4 * Q8_0_BYTES);
    // SAFETY: NEON is baseline on aarch64; `blocks` checked that both slices hold `nb` blocks.
    unsafe {
        let (x, y) = (row.as_ptr(), act.as_ptr());
        let mut acc = Acc8::zero();
        for b in 0..nb {
            let (x, y) = (x.add(18 * b), y.add(4 * Q8_0_BYTES * b));
            let mut block = Acc8::zero();
            for k in 0..4 {
                let y = y.add(Q8_0_BYTES * k);
                let s = Lanes::of(q1_signs(x.add(2 + 4 * k)), y.add(2));
                if k == 0 {
                    block.lo = vmulq_n_f32(vcvtq_f32_s32(s.lo), f16_at(y));
                    block.hi = vmulq_n_f32(vcvtq_f32_s32(s.hi), f16_at(y));
                } else {
                    block.fma(f16_at(y), s);
                }
            }
            let d0 = f16_at(x);
            acc.lo = vfmaq_n_f32(acc.lo, block.lo, d0);
            acc.hi = vfmaq_n_f32(acc.hi, block.hi, d0);
        }
        acc.reduce()
    }
}

/// The 2-bit codes of the 32 elements in the 8 bytes at `qs`, four to a byte.
#[inline(always)]
unsafe fn q2_codes(qs: *const u8) -> [uint8x16_t; 2] {
    const SPREAD: [u8; 32] = [
        0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 6, 6, 6, 6, 7, 7,
        7, 7,
    ];
    const SHIFT: [i8; 16] = [0, -2, -4, -6, 0, -2, -4, -6, 0, -2, -4, -6, 0, -2, -4, -6];
    let b = vcombine_u8(vld1_u8(qs), vdup_n_u8(0));
    let shift = vld1q_s8(SHIFT.as_ptr());
    std::array::from_fn(|h| {
        let bytes = vqtbl1q_u8(b, vld1q_u8(SPREAD.as_ptr().add(16 * h)));
        vandq_u8(vshlq_u8(bytes, shift), vdupq_n_u8(3))
    })
}

/// The reference's Q2_0 loop is scalar in its floats: the integer sum of each Q8_0 block
/// times its `d`, summed, times the weight's `d`, summed.
fn dot_q2_0(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = blocks(n, 64, row, 18, act, 2 * Q8_0_BYTES);
    // SAFETY: NEON is baseline on aarch64; `blocks` checked that both slices hold `nb` blocks.
    unsafe {
        let (x, y) = (row.as_ptr(), act.as_ptr());
        let mut sumf = 0f32;
        for b in 0..nb {
            let (x, y) = (x.add(18 * b), y.add(2 * Q8_0_BYTES * b));
            let mut sumi = 0f32;
            for k in 0..2 {
                let y = y.add(Q8_0_BYTES * k);
                let v = q2_codes(x.add(2 + 8 * k)).map(|c| vsubq_s8(s8(c), vdupq_n_s8(1)));
                let s = Lanes::of(v, y.add(2));
                let sum = vaddvq_s32(vaddq_s32(s.lo, s.hi));
                sumi += f16_at(y) * sum as f32;
            }
            sumf += f16_at(x) * sumi;
        }
        sumf
    }
}

/// NVFP4's 32 values of sub-blocks `2h` and `2h + 1` (each 8 bytes: low nibbles first).
#[inline(always)]
unsafe fn nvfp4_values(qs: *const u8) -> [int8x16_t; 2] {
    let t = vld1q_s8(KVALUES_MXFP4.as_ptr());
    std::array::from_fn(|s| {
        let b = vld1_u8(qs.add(8 * s));
        let codes = vcombine_u8(vand_u8(b, vdup_n_u8(0x0f)), vshr_n_u8(b, 4));
        vqtbl1q_s8(t, codes)
    })
}

/// The reference's NVFP4 loop: per Q8_0 block the lanes of two sub-blocks, each half fused
/// with its sub-block's scale times the activation's `d`.
fn dot_nvfp4(n: usize, row: &[u8], act: &[u8]) -> f32 {
    let nb = blocks(n, 64, row, 36, act, 2 * Q8_0_BYTES);
    // SAFETY: NEON is baseline on aarch64; `blocks` checked that both slices hold `nb` blocks.
    unsafe {
        let (x, y) = (row.as_ptr(), act.as_ptr());
        let mut acc = Acc8::zero();
        for b in 0..nb {
            let (x, y) = (x.add(36 * b), y.add(2 * Q8_0_BYTES * b));
            for h in 0..2 {
                let y = y.add(Q8_0_BYTES * h);
                let s = Lanes::of(nvfp4_values(x.add(4 + 16 * h)), y.add(2));
                let dy = f16_at(y);
                let scale = |k: usize| ue4m3_to_f32_half(*x.add(2 * h + k)) * dy;
                acc.fma2(scale(0), scale(1), s);
            }
        }
        acc.reduce()
    }
}
