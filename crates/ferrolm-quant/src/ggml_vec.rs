//! Vector functions bit-identical to llama.cpp's CPU `ggml_vec_*` on x86-64 with AVX512F/DQ
//! (the build the project compares against: ggml with GGML_NATIVE, gcc 12).
//!
//! ggml processes full chunks of 16 floats with AVX512 (`ggml_v_expf`, `ggml_v_silu`,
//! `_mm512_reduce_add_ps`) and the last `n % 16` elements with scalar C (`expf` from libm).
//! Every function here reproduces that split: the 16-lane part is emulated lane by lane with
//! `f32::mul_add` for each fused multiply-add (so it gives the same bits on any CPU), and the
//! tail calls `f32::exp`, which is the platform libm's `expf` (glibc's on Linux, as llama.cpp's).
//! On x86-64 with AVX2+FMA+F16C the same arithmetic runs vectorized.

use half::f16;

use crate::common::reduce16;

const EXP_SHIFT: f32 = 12_582_912.0; // 0x1.8p23

/// One lane of ggml's AVX512 `ggml_v_expf` ("adapted from arm limited optimized routine"):
/// `2^n * p(b)` with `n = round(x / ln 2)`, `_mm512_scalef_ps` for the scaling, and 0 / inf
/// when `|n| > 192`.
#[inline(always)]
fn v_expf(x: f32) -> f32 {
    let z = x.mul_add(f32::from_bits(0x3fb8_aa3b), EXP_SHIFT); // 0x1.715476p+0
    let n = z - EXP_SHIFT;
    let b = (-n).mul_add(
        f32::from_bits(0x35bf_be8e),                  // 0x1.7f7d1cp-20
        (-n).mul_add(f32::from_bits(0x3f31_7200), x), // 0x1.62e4p-1
    );
    let u = b * b;
    let j = f32::from_bits(0x3c07_2010) // 0x1.0e4020p-7
        .mul_add(b, f32::from_bits(0x3d2b_9f17)) // 0x1.573e2ep-5
        .mul_add(
            u,
            f32::from_bits(0x3e2a_af33).mul_add(b, f32::from_bits(0x3eff_fedb)), // 0x1.555e66p-3, 0x1.fffdb6p-2
        )
        .mul_add(u, f32::from_bits(0x3f7f_fff6).mul_add(b, 1.0)); // 0x1.ffffecp-1
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    if n.is_nan() {
        return f32::NAN;
    }
    // scalef(j, n) = j * 2^n rounded once: exact in f64, then one rounding to f32 (which also
    // handles the subnormal range like the instruction).
    let p = f64::from_bits(((n as i64 + 1023) as u64) << 52);
    (j as f64 * p) as f32
}

/// One lane of ggml's AVX512 `ggml_v_silu`: `x / (1 + v_expf(0 - x))`.
#[inline(always)]
fn v_silu(x: f32) -> f32 {
    x / (1.0 + v_expf(0.0 - x))
}

/// ggml's scalar `ggml_silu_f32`: `x / (1 + expf(-x))` with libm's `expf`.
#[inline(always)]
fn silu_scalar(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline(always)]
fn swiglu_body(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let n = out.len();
    let np = n - n % 16;
    for i in 0..np {
        out[i] = v_silu(gate[i]) * up[i];
    }
    for i in np..n {
        out[i] = silu_scalar(gate[i]) * up[i];
    }
}

#[inline(always)]
fn silu_body(x: &[f32], out: &mut [f32]) {
    let n = out.len();
    let np = n - n % 16;
    for i in 0..np {
        out[i] = v_silu(x[i]);
    }
    for i in np..n {
        out[i] = silu_scalar(x[i]);
    }
}

#[inline(always)]
fn soft_max_body(x: &[f32], out: &mut [f32], max: f32) -> f64 {
    let n = out.len();
    let np = n - n % 16;
    let mut sum = 0f64;
    for (xs, os) in x[..np].chunks_exact(16).zip(out[..np].chunks_exact_mut(16)) {
        let mut v = [0f32; 16];
        for l in 0..16 {
            v[l] = v_expf(xs[l] - max);
        }
        os.copy_from_slice(&v);
        sum += reduce16(&v) as f64;
    }
    for i in np..n {
        let v = (x[i] - max).exp();
        sum += v as f64;
        out[i] = v;
    }
    sum
}

fn use_simd() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[i] = silu(gate[i]) * up[i]`, bit-identical to llama.cpp's `ggml_vec_swiglu_f32(n, out,
/// gate, up)`: the AVX512 `ggml_v_silu` on chunks of 16, `ggml_silu_f32` (libm `expf`) on the
/// last `n % 16`.
///
/// # Panics
/// If the three slices differ in length.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == out.len() && up.len() == out.len(),
        "swiglu: lengths differ"
    );
    #[cfg(target_arch = "x86_64")]
    if use_simd() {
        // SAFETY: avx2 and fma were detected just above.
        #[allow(unsafe_code)]
        unsafe {
            x86::swiglu(gate, up, out)
        };
        return;
    }
    swiglu_body(gate, up, out)
}

/// `out[i] = x[i] / (1 + exp(-x[i]))`, bit-identical to llama.cpp's `ggml_vec_silu_f32`.
///
/// # Panics
/// If the slices differ in length.
pub fn silu(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "silu: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if use_simd() {
        // SAFETY: avx2 and fma were detected just above.
        #[allow(unsafe_code)]
        unsafe {
            x86::silu(x, out)
        };
        return;
    }
    silu_body(x, out)
}

/// `out[i] = exp(x[i] - max)`, returning the sum of `out` as ggml accumulates it (f64 sum of
/// per-16 `_mm512_reduce_add_ps`, then the scalar tail): bit-identical to llama.cpp's
/// `ggml_vec_soft_max_f32(n, out, x, max)`. The caller divides by the sum (llama.cpp's
/// soft_max op scales by `1.0 / sum` computed in f64 and rounded to f32).
///
/// # Panics
/// If the slices differ in length.
pub fn soft_max(x: &[f32], out: &mut [f32], max: f32) -> f64 {
    assert_eq!(x.len(), out.len(), "soft_max: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if use_simd() {
        // SAFETY: avx2 and fma were detected just above.
        #[allow(unsafe_code)]
        return unsafe { x86::soft_max(x, out, max) };
    }
    soft_max_body(x, out, max)
}

/// `gelu(x)` by the tanh approximation, as ggml's scalar `ggml_gelu_f32` computes it:
/// `0.5 x (1 + tanh(sqrt(2/pi) x (1 + 0.044715 x^2)))` in f32, with gcc's contraction of
/// `1 + a*x*x` into a fused multiply-add; `tanh` correctly rounded (through f64).
fn gelu_scalar(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    const GELU_COEF_A: f32 = 0.044_715;
    let inner = (GELU_COEF_A * x).mul_add(x, 1.0);
    let t = (f64::from(SQRT_2_OVER_PI * x * inner)).tanh() as f32;
    0.5 * x * (1.0 + t)
}

/// ggml's `ggml_table_gelu_f16`: `gelu` of every f16, rounded to f16 (ggml_cpu_init fills it
/// once; with GGML_GELU_FP16, which the CPU backend defines, every f32 GELU reads it).
fn gelu_table() -> &'static [f16] {
    static TABLE: std::sync::OnceLock<Vec<f16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|i| {
                let g = gelu_scalar(f16::from_bits(i).to_f32());
                if g.is_nan() {
                    // F16C's conversion quiets a NaN and drops its payload.
                    f16::from_bits(if g.is_sign_negative() { 0xfe00 } else { 0x7e00 })
                } else {
                    f16::from_f32(g)
                }
            })
            .collect()
    })
}

/// ggml's GELU table, for the oracle test (`table[bits of an f16] = gelu` as f16).
pub fn gelu_f16_table() -> &'static [f16] {
    gelu_table()
}

#[inline(always)]
fn gelu_lookup(table: &[f16], x: f32) -> f32 {
    table[f16::from_f32(x).to_bits() as usize].to_f32()
}

/// `out[i] = gelu(x[i])`, bit-identical to llama.cpp's `ggml_vec_gelu_f32` (GGML_GELU_FP16):
/// 0 at or below -10, `x` at or above 10, otherwise the table entry of `x` rounded to f16.
///
/// # Panics
/// If the slices differ in length.
pub fn gelu(x: &[f32], out: &mut [f32]) {
    assert_eq!(x.len(), out.len(), "gelu: lengths differ");
    let table = gelu_table();
    for (o, &v) in out.iter_mut().zip(x) {
        *o = if v <= -10.0 {
            0.0
        } else if v >= 10.0 {
            v
        } else {
            gelu_lookup(table, v)
        };
    }
}

/// `out[i] = gelu(gate[i]) * up[i]`, bit-identical to llama.cpp's `ggml_vec_geglu_f32(n, out,
/// gate, up)` (GGML_GELU_FP16: the f16 table, 0 at or below -10, `gate * up` at or above 10).
///
/// # Panics
/// If the three slices differ in length.
pub fn geglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    assert!(
        gate.len() == out.len() && up.len() == out.len(),
        "geglu: lengths differ"
    );
    let table = gelu_table();
    #[cfg(target_arch = "x86_64")]
    if use_simd() {
        // SAFETY: avx2 and f16c were detected just above; the lengths are equal (asserted).
        #[allow(unsafe_code)]
        unsafe {
            x86::geglu(gate, up, out, table)
        };
        return;
    }
    geglu_body(gate, up, out, table);
}

fn geglu_body(gate: &[f32], up: &[f32], out: &mut [f32], table: &[f16]) {
    for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
        *o = if g <= -10.0 {
            0.0
        } else if g >= 10.0 {
            g * u
        } else {
            gelu_lookup(table, g) * u
        };
    }
}

/// Dot product of two f16 vectors of any length, bit-identical to llama.cpp's
/// `ggml_vec_dot_f16` with AVX512 (GGML_F16_STEP 64: four 16-lane f32 accumulators fed by
/// fused multiply-adds, reduced as `(acc0 + acc2) + (acc1 + acc3)` then
/// `_mm512_reduce_add_ps`, widened to f64; the last `n % 64` products added in f64; the sum
/// rounded to f32).
///
/// # Panics
/// If the slices differ in length.
pub fn dot_f16(x: &[f16], y: &[f16]) -> f32 {
    assert_eq!(x.len(), y.len(), "dot_f16: lengths differ");
    #[cfg(target_arch = "x86_64")]
    if use_simd() {
        // SAFETY: avx2, fma and f16c were detected just above; both slices hold `len` halves.
        #[allow(unsafe_code)]
        return unsafe { x86::dot_f16(x.len(), x.as_ptr() as *const u8, y.as_ptr() as *const u8) };
    }
    dot_f16_lanes(x.len(), |k| x[k].to_f32(), |k| y[k].to_f32())
}

#[inline(always)]
fn half_at(b: &[u8], k: usize) -> f32 {
    f16::from_le_bytes([b[2 * k], b[2 * k + 1]]).to_f32()
}

#[inline(always)]
fn bf16_at(b: &[u8], k: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[2 * k], b[2 * k + 1]]) as u32) << 16)
}

#[inline(always)]
fn f32_at(b: &[u8], k: usize) -> f32 {
    f32::from_le_bytes([b[4 * k], b[4 * k + 1], b[4 * k + 2], b[4 * k + 3]])
}

/// [`dot_f16`] on little-endian f16 bytes, scalar emulation (the kernels' reference).
pub(crate) fn dot_f16_bytes(n: usize, x: &[u8], y: &[u8]) -> f32 {
    dot_f16_lanes(n, |k| half_at(x, k), |k| half_at(y, k))
}

/// The 4 x 16-lane FMA main loop of ggml's AVX512 `ggml_vec_dot_f16` / `ggml_vec_dot_f32`
/// (GGML_F32_STEP = GGML_F16_STEP = 64) and its reduction.
#[inline(always)]
fn main_4x16(np: usize, x: impl Fn(usize) -> f32, y: impl Fn(usize) -> f32) -> f32 {
    let mut acc = [[0f32; 16]; 4];
    for i in (0..np).step_by(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            for (l, a) in a.iter_mut().enumerate() {
                let k = i + 16 * j + l;
                *a = x(k).mul_add(y(k), *a);
            }
        }
    }
    reduce_4x16(&acc)
}

#[inline(always)]
fn dot_f16_lanes(n: usize, x: impl Fn(usize) -> f32, y: impl Fn(usize) -> f32) -> f32 {
    let np = n & !63;
    let mut sumf = main_4x16(np, &x, &y) as f64;
    for k in np..n {
        sumf += (x(k) * y(k)) as f64;
    }
    sumf as f32
}

/// llama.cpp's `ggml_vec_dot_f32` as gcc 12 compiled it with AVX512: the 4 x 16-lane main
/// loop, then an f32 tail where gcc vectorized the products of whole 16- and then 8-element
/// groups (multiplied, then added one by one) and fused the last `< 8` into `vfmadd231ss`.
pub(crate) fn dot_f32_bytes(n: usize, x: &[u8], y: &[u8]) -> f32 {
    let (x, y) = (|k| f32_at(x, k), |k| f32_at(y, k));
    let np = n & !63;
    let mut sumf = main_4x16(np, x, y);
    f32_tail(np, n, &mut sumf, x, y);
    sumf
}

#[inline(always)]
fn f32_tail(
    np: usize,
    n: usize,
    sumf: &mut f32,
    x: impl Fn(usize) -> f32,
    y: impl Fn(usize) -> f32,
) {
    let t = n - np;
    let rem = t % 16;
    let unfused = (t - rem) + if rem >= 8 { 8 } else { 0 };
    for k in np..np + unfused {
        *sumf += x(k) * y(k);
    }
    for k in np + unfused..n {
        *sumf = x(k).mul_add(y(k), *sumf);
    }
}

/// llama.cpp's `ggml_vec_dot_bf16` with AVX512-BF16: two 16-lane accumulators fed 32 elements
/// at a time by `vdpbf16ps` (lane `l` adds the product of elements `2l + 1`, then of `2l`, each
/// a fused add of an exact product), each reduced with `_mm512_reduce_add_ps` into an f64 sum,
/// then the tail in f64. (`vdpbf16ps` also flushes subnormals, which real weights never are;
/// that is not emulated.)
pub(crate) fn dot_bf16_bytes(n: usize, x: &[u8], y: &[u8]) -> f32 {
    let (x, y) = (|k| bf16_at(x, k), |k| bf16_at(y, k));
    let np = n / 64 * 64;
    let mut c = [[0f32; 16]; 2];
    for i in (0..np).step_by(64) {
        for (h, c) in c.iter_mut().enumerate() {
            for (l, c) in c.iter_mut().enumerate() {
                let k = i + 32 * h + 2 * l;
                *c = x(k + 1).mul_add(y(k + 1), *c);
                *c = x(k).mul_add(y(k), *c);
            }
        }
    }
    let mut sumf = 0f64;
    sumf += reduce16(&c[0]) as f64;
    sumf += reduce16(&c[1]) as f64;
    for k in np..n {
        sumf += (x(k) * y(k)) as f64;
    }
    sumf as f32
}

/// `GGML_F32x16_REDUCE` over four accumulators: `x0 + x2`, `x1 + x3`, their sum, then
/// `_mm512_reduce_add_ps`.
#[inline(always)]
pub(crate) fn reduce_4x16(acc: &[[f32; 16]; 4]) -> f32 {
    let mut s = [0f32; 16];
    for l in 0..16 {
        s[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    reduce16(&s)
}

/// f32 to f16 rounding to nearest even, bit-identical to llama.cpp's `ggml_cpu_fp32_to_fp16`
/// (`vcvtps2ph` with rounding mode 0, which is what `half` computes too).
///
/// # Panics
/// If the slices differ in length.
pub fn f32_to_f16_row(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len(), "f32_to_f16_row: lengths differ");
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if use_simd() {
        // SAFETY: f16c was detected just above; the lengths are equal (asserted).
        #[allow(unsafe_code)]
        unsafe {
            done = x86::f32_to_f16_row(src, dst)
        };
    }
    for (d, &s) in dst[done..].iter_mut().zip(&src[done..]) {
        *d = f16::from_f32(s);
    }
}

/// RoPE's rotation of one head by precomputed `(cos, sin)` pairs, pair `i` being elements
/// `(2i, 2i + 1)` (`neox == false`) or `(i, i + half)` (`neox == true`, `half = cos_sin.len()`);
/// elements past the pairs pass through. Rounded as llama.cpp's gcc build computes `x0*c - x1*s`
/// and `x0*s + x1*c`: the first product of each contracted into a fused multiply-add. With FMA
/// detected the fused multiply-adds are instructions rather than calls to libm's `fmaf` (same
/// bits either way).
///
/// # Panics
/// If `head` is shorter than the pairs need.
pub fn rope_rotate(head: &mut [f32], cos_sin: &[(f32, f32)], neox: bool) {
    assert!(
        head.len() >= 2 * cos_sin.len(),
        "rope_rotate: head too short"
    );
    #[cfg(target_arch = "x86_64")]
    if use_simd() {
        // SAFETY: fma was detected just above; the length is checked above.
        #[allow(unsafe_code)]
        unsafe {
            x86::rope_rotate(head, cos_sin, neox)
        };
        return;
    }
    rope_rotate_body(head, cos_sin, neox);
}

#[inline(always)]
fn rope_rotate_body(head: &mut [f32], cos_sin: &[(f32, f32)], neox: bool) {
    let rotate =
        |x0: f32, x1: f32, c: f32, s: f32| (x0.mul_add(c, -(x1 * s)), x0.mul_add(s, x1 * c));
    if neox {
        let half = cos_sin.len();
        let (lo, hi) = head.split_at_mut(half);
        for ((a, b), &(c, s)) in lo.iter_mut().zip(hi.iter_mut()).zip(cos_sin) {
            (*a, *b) = rotate(*a, *b, c, s);
        }
    } else {
        for (pair, &(c, s)) in head.chunks_exact_mut(2).zip(cos_sin) {
            (pair[0], pair[1]) = rotate(pair[0], pair[1], c, s);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use half::f16;

    /// The bodies compiled with FMA enabled, so LLVM can vectorize the lane-wise `mul_add`s
    /// (same arithmetic, same bits).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
        super::swiglu_body(gate, up, out)
    }

    /// `rope_rotate_body` with FMA enabled: `mul_add` becomes `vfmadd`, not a libm call.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn rope_rotate(head: &mut [f32], cos_sin: &[(f32, f32)], neox: bool) {
        super::rope_rotate_body(head, cos_sin, neox)
    }

    /// `geglu` eight at a time: the same f16 rounding of the gate (F16C, as `half` does on
    /// this CPU), the same table entry, the same products and the same cases.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn geglu(gate: &[f32], up: &[f32], out: &mut [f32], table: &[f16]) {
        assert!(table.len() == 1 << 16 && gate.len() == out.len() && up.len() == out.len());
        let n = out.len() / 8 * 8;
        let (lo, hi) = (_mm256_set1_ps(-10.0), _mm256_set1_ps(10.0));
        for i in (0..n).step_by(8) {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let mut h = [0u16; 8];
            _mm_storeu_si128(
                h.as_mut_ptr() as *mut __m128i,
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(g),
            );
            // any u16 indexes the 65536-entry table
            let t = h.map(|k| table.get_unchecked(k as usize).to_bits());
            let looked_up = _mm256_cvtph_ps(_mm_loadu_si128(t.as_ptr() as *const __m128i));
            let r = _mm256_blendv_ps(
                _mm256_mul_ps(looked_up, u),
                _mm256_mul_ps(g, u),
                _mm256_cmp_ps::<_CMP_GE_OQ>(g, hi),
            );
            let r = _mm256_blendv_ps(r, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LE_OQ>(g, lo));
            _mm256_storeu_ps(out.as_mut_ptr().add(i), r);
        }
        super::geglu_body(&gate[n..], &up[n..], &mut out[n..], table);
    }

    /// The whole groups of eight of `src` to f16 (F16C, round to nearest even, as `half`
    /// does on this CPU); returns how many were written.
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn f32_to_f16_row(src: &[f32], dst: &mut [f16]) -> usize {
        assert_eq!(src.len(), dst.len());
        let n = src.len() / 8 * 8;
        for i in (0..n).step_by(8) {
            let h =
                _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(i)));
            _mm_storeu_si128(dst.as_mut_ptr().add(i) as *mut __m128i, h);
        }
        n
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn silu(x: &[f32], out: &mut [f32]) {
        super::silu_body(x, out)
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn soft_max(x: &[f32], out: &mut [f32], max: f32) -> f64 {
        super::soft_max_body(x, out, max)
    }

    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load8(p: *const u8) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn load8_f32(p: *const u8) -> __m256 {
        _mm256_loadu_ps(p as *const f32)
    }

    /// The 4 x 16-lane accumulators as 8 AVX2 registers (lanes 0..8 and 8..16 of each),
    /// reduced as `GGML_F32x16_REDUCE`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn main_4x16<const HALF: bool>(np: usize, x: *const u8, y: *const u8) -> f32 {
        let elem = if HALF { 2 } else { 4 };
        let load = |p: *const u8| if HALF { load8(p) } else { load8_f32(p) };
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut i = 0;
        while i < np {
            for (h, a) in acc.iter_mut().enumerate() {
                let o = (i + 8 * h) * elem;
                *a = _mm256_fmadd_ps(load(x.add(o)), load(y.add(o)), *a);
            }
            i += 64;
        }
        // (acc0 + acc2) + (acc1 + acc3), per 8-lane half, then the 16-lane reduction
        let lo = _mm256_add_ps(_mm256_add_ps(acc[0], acc[4]), _mm256_add_ps(acc[2], acc[6]));
        let hi = _mm256_add_ps(_mm256_add_ps(acc[1], acc[5]), _mm256_add_ps(acc[3], acc[7]));
        hsum8(_mm256_add_ps(hi, lo))
    }

    /// `ggml_vec_dot_f16`; `x` and `y` hold `n` f16 each.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_f16(n: usize, x: *const u8, y: *const u8) -> f32 {
        let np = n & !63;
        let mut sumf = main_4x16::<true>(np, x, y) as f64;
        let (xs, ys) = (x as *const f16, y as *const f16);
        for k in np..n {
            sumf +=
                (xs.add(k).read_unaligned().to_f32() * ys.add(k).read_unaligned().to_f32()) as f64;
        }
        sumf as f32
    }

    /// `ggml_vec_dot_f32`; `x` and `y` hold `n` f32 each.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(crate) unsafe fn dot_f32(n: usize, x: *const u8, y: *const u8) -> f32 {
        let np = n & !63;
        let mut sumf = main_4x16::<false>(np, x, y);
        let (xs, ys) = (x as *const f32, y as *const f32);
        super::f32_tail(
            np,
            n,
            &mut sumf,
            |k| xs.add(k).read_unaligned(),
            |k| ys.add(k).read_unaligned(),
        );
        sumf
    }

    /// `ggml_vec_dot_bf16` (the `vdpbf16ps` loop); `x` and `y` hold `n` bf16 each.
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn dot_bf16(n: usize, x: *const u8, y: *const u8) -> f32 {
        let np = n / 64 * 64;
        let hi_mask = _mm256_set1_epi32(0xffff_0000u32 as i32);
        // c[2h] and c[2h + 1]: lanes 0..8 and 8..16 of accumulator h
        let mut c = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i < np {
            for (q, c) in c.iter_mut().enumerate() {
                let o = 2 * (i + 16 * q);
                let xv = _mm256_loadu_si256(x.add(o) as *const __m256i);
                let yv = _mm256_loadu_si256(y.add(o) as *const __m256i);
                let (xo, yo) = (
                    _mm256_castsi256_ps(_mm256_and_si256(xv, hi_mask)),
                    _mm256_castsi256_ps(_mm256_and_si256(yv, hi_mask)),
                );
                let (xe, ye) = (
                    _mm256_castsi256_ps(_mm256_slli_epi32(xv, 16)),
                    _mm256_castsi256_ps(_mm256_slli_epi32(yv, 16)),
                );
                *c = _mm256_fmadd_ps(xo, yo, *c);
                *c = _mm256_fmadd_ps(xe, ye, *c);
            }
            i += 64;
        }
        let mut sumf = 0f64;
        sumf += hsum8(_mm256_add_ps(c[1], c[0])) as f64;
        sumf += hsum8(_mm256_add_ps(c[3], c[2])) as f64;
        for k in np..n {
            let b = |p: *const u8| {
                f32::from_bits(
                    (u16::from_le_bytes([*p.add(2 * k), *p.add(2 * k + 1)]) as u32) << 16,
                )
            };
            sumf += (b(x) * b(y)) as f64;
        }
        sumf as f32
    }

    /// ggml's `hsum_float_8`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub(crate) unsafe fn hsum8(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_extractf128_ps(v, 1), _mm256_castps256_ps128(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }
}
