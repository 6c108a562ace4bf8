//! Shared helpers for tests and the benchmark: a small deterministic PRNG and random rows of
//! every block type with sane scales.
#![allow(dead_code)] // each test binary uses a different subset

use ferrolm_quant::{quantize, TensorType};

/// SplitMix64: deterministic, dependency-free.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
    /// Roughly standard normal (sum of uniforms).
    pub fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.uniform()).sum::<f32>() * 1.732 - 3.464
    }
    pub fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
    pub fn normals(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }
}

/// The block types added after the first set (the i-quants, ternary, Q1_0, Q2_0, NVFP4).
pub const LATER_TYPES: &[TensorType] = &[
    TensorType::IQ2_XXS,
    TensorType::IQ2_XS,
    TensorType::IQ2_S,
    TensorType::IQ3_XXS,
    TensorType::IQ3_S,
    TensorType::IQ1_S,
    TensorType::IQ1_M,
    TensorType::IQ4_XS,
    TensorType::TQ1_0,
    TensorType::TQ2_0,
    TensorType::Q1_0,
    TensorType::Q2_0,
    TensorType::NVFP4,
];

fn sane_f16(rng: &mut Rng) -> [u8; 2] {
    let v = rng.normal() * 0.05 + 0.001;
    half::f16::from_f32(v).to_le_bytes()
}

/// Byte offsets of the f16 scale fields of a block.
fn f16_fields(ty: TensorType) -> &'static [usize] {
    use TensorType as T;
    match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL | T::Q1_0 | T::Q2_0 => &[0],
        T::IQ2_XXS | T::IQ2_XS | T::IQ2_S | T::IQ3_XXS | T::IQ3_S | T::IQ1_S | T::IQ4_XS => &[0],
        T::TQ1_0 => &[52],
        T::TQ2_0 => &[64],
        T::Q4_1 | T::Q5_1 | T::Q8_1 | T::Q4_K | T::Q5_K => &[0, 2],
        T::Q2_K => &[80, 82],
        T::Q3_K => &[108],
        T::Q6_K => &[208],
        _ => &[],
    }
}

/// A random row of `n` weights of `ty`: random quants, sane scales (never inf/NaN).
pub fn random_row(ty: TensorType, n: usize, rng: &mut Rng) -> Vec<u8> {
    match ty {
        TensorType::F32 | TensorType::F16 | TensorType::BF16 => {
            let x = rng.normals(n, 1.0);
            let mut out = vec![0u8; ferrolm_quant::row_bytes(ty, n).unwrap()];
            quantize(ty, &x, &mut out).unwrap();
            out
        }
        _ => {
            let bb = ty.block_bytes();
            let mut out = rng.bytes(n / ty.block_size() * bb);
            for block in out.chunks_exact_mut(bb) {
                for &off in f16_fields(ty) {
                    block[off..off + 2].copy_from_slice(&sane_f16(rng));
                }
                if ty == TensorType::MXFP4 {
                    block[0] = 110 + (rng.next_u64() % 30) as u8;
                }
                if ty == TensorType::IQ1_M {
                    // The f16 scale lives in the top nibbles of the four u16 scale words.
                    let d = u16::from_le_bytes(sane_f16(rng));
                    for k in 0..4 {
                        let at = 48 + 2 * k + 1;
                        block[at] = (block[at] & 0x0f) | (((d >> (4 * k)) & 0xf) as u8) << 4;
                    }
                }
            }
            out
        }
    }
}

/// A random activation vector of `n` values quantized to `act_ty` as the engine does.
pub fn random_act(act_ty: TensorType, n: usize, rng: &mut Rng) -> (Vec<f32>, Vec<u8>) {
    let x = rng.normals(n, 1.0);
    let mut out = vec![0u8; ferrolm_quant::row_bytes(act_ty, n).unwrap()];
    ferrolm_quant::quantize_activation(act_ty, &x, &mut out).unwrap();
    (x, out)
}
