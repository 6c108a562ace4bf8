//! Small numeric helpers shared by the block formats.

use half::f16;

/// Reads a little-endian IEEE half stored as two bytes.
#[inline(always)]
pub(crate) fn f16_to_f32(b: [u8; 2]) -> f32 {
    f16::from_le_bytes(b).to_f32()
}

/// Rounds to the nearest half (ties to even) and returns its two little-endian bytes.
#[inline(always)]
pub(crate) fn f32_to_f16(x: f32) -> [u8; 2] {
    f16::from_f32(x).to_le_bytes()
}

/// ggml's `nearest_int`: round half to even through the 1.5 * 2^23 trick; valid for
/// |x| <= 4194303, which every caller guarantees.
#[inline(always)]
pub(crate) fn nearest_int(x: f32) -> i32 {
    let v = x + 12_582_912.0f32;
    (v.to_bits() & 0x007f_ffff) as i32 - 0x0040_0000
}

/// C's `roundf`: round half away from zero.
#[inline(always)]
pub(crate) fn roundf(x: f32) -> f32 {
    x.round()
}

/// ggml's `GGML_E8M0_TO_FP32_HALF`: 2^(e - 128) as an f32, subnormal for e < 2.
#[inline(always)]
pub(crate) fn e8m0_to_f32_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

/// ggml's `hsum_float_8` (and llamafile's `hsum(__m256)`): the high half added to the low
/// half, then `(r0 + r2) + (r1 + r3)`.
#[inline(always)]
pub(crate) fn reduce8(x: &[f32; 8]) -> f32 {
    let r = [x[4] + x[0], x[5] + x[1], x[6] + x[2], x[7] + x[3]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// gcc's `_mm512_reduce_add_ps`: the high 8 lanes added to the low 8, then [`reduce8`].
#[inline(always)]
pub(crate) fn reduce16(x: &[f32; 16]) -> f32 {
    let mut h = [0f32; 8];
    for i in 0..8 {
        h[i] = x[i + 8] + x[i];
    }
    reduce8(&h)
}

/// The eight f32 lanes ggml's AVX2 kernels get from one 32-element block: lane `l` is the
/// integer sum of the products of elements `4l..4l+4` (what `maddubs` + `madd`, or `dpbusd`,
/// leave in each 32-bit lane), converted to f32.
#[inline(always)]
pub(crate) fn lanes8(w: &[i32; 32], y: &[i8; 32]) -> [f32; 8] {
    let mut s = [0f32; 8];
    for (l, s) in s.iter_mut().enumerate() {
        let mut t = 0i32;
        for k in 4 * l..4 * l + 4 {
            t += w[k] * y[k] as i32;
        }
        *s = t as f32;
    }
    s
}

/// `acc[l] = fma(d, s[l], acc[l])` (`_mm256_fmadd_ps` with a broadcast scale).
#[inline(always)]
pub(crate) fn fma8(acc: &mut [f32; 8], d: f32, s: &[f32; 8]) {
    for (a, &s) in acc.iter_mut().zip(s) {
        *a = d.mul_add(s, *a);
    }
}

/// The little-endian u16 at byte `i` of `b`.
#[inline(always)]
pub(crate) fn u16_at(b: &[u8], i: usize) -> u16 {
    u16::from_le_bytes([b[i], b[i + 1]])
}

/// The little-endian u32 at byte `i` of `b`.
#[inline(always)]
pub(crate) fn u32_at(b: &[u8], i: usize) -> u32 {
    u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]])
}
