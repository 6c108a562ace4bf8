//! Random but valid blocks of each type, written directly rather than by quantizing floats
//! (an 8B file is 4 to 16 GB): random quants, with scales chosen so that a matrix's values
//! have about the standard deviation asked for, centred on zero, and every f16 finite.

use ferrolm_gguf::TensorType;
use half::f16;

use crate::error::{ModelError, Result};

/// A small fast generator (wyrand); each chunk of a file gets its own seed.
pub struct Wyrand(u64);

impl Wyrand {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Wyrand {
        Wyrand(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0xa076_1d64_78bd_642f);
        let t = u128::from(self.0) * u128::from(self.0 ^ 0xe703_7ed1_a0b4_28db);
        ((t >> 64) as u64) ^ (t as u64)
    }

    /// Uniform in [-1, 1).
    fn symmetric(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 * (1.0 / 8_388_608.0)) - 1.0
    }

    fn fill_bytes(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next_u64().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next_u64().to_le_bytes();
        rest.copy_from_slice(&last[..rest.len()]);
    }

    /// `v` with a random sign.
    fn signed(&mut self, v: f32) -> f32 {
        if self.next_u64() & 1 == 0 {
            v
        } else {
            -v
        }
    }
}

/// How the values of a tensor are drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Values {
    /// Centred, with about this standard deviation.
    Spread(f32),
    /// 1 plus a spread of this standard deviation (norm weights).
    AroundOne(f32),
}

/// Standard deviation of a uniform integer in `0..n` (about n / sqrt(12)).
fn uniform_std(n: f32) -> f32 {
    n / 12f32.sqrt()
}

/// Uniform in [-1, 1) has standard deviation 1/sqrt(3).
const SQRT3: f32 = 1.732_050_8;

fn put_f16(out: &mut [u8], v: f32) {
    out[..2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Packs eight 6-bit scales and mins as Q4_K and Q5_K store them.
fn pack_k_scales(sc: &[u8; 8], m: &[u8; 8], out: &mut [u8]) {
    for j in 0..4 {
        out[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        out[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        out[j + 8] = (sc[j + 4] & 0xf) | ((m[j + 4] & 0xf) << 4);
    }
}

/// Fills `out`, whole blocks of `ty`, with random values drawn as `values` says.
pub fn fill(ty: TensorType, values: Values, rng: &mut Wyrand, out: &mut [u8]) -> Result<()> {
    let bb = ty.block_bytes();
    if !out.len().is_multiple_of(bb) {
        return Err(ModelError::Invalid(format!(
            "{} bytes are not whole {ty} blocks",
            out.len()
        )));
    }
    let (std, offset) = match values {
        Values::Spread(s) => (s, 0.0),
        Values::AroundOne(s) => (s, 1.0),
    };
    if offset != 0.0 && !matches!(ty, TensorType::F32 | TensorType::F16) {
        return Err(ModelError::Invalid(format!(
            "values around one are written as F32 or F16, not {ty}"
        )));
    }
    match ty {
        TensorType::F32 => {
            for c in out.chunks_exact_mut(4) {
                let v = offset + rng.symmetric() * SQRT3 * std;
                c.copy_from_slice(&v.to_le_bytes());
            }
        }
        TensorType::F16 => {
            for c in out.chunks_exact_mut(2) {
                put_f16(c, offset + rng.symmetric() * SQRT3 * std);
            }
        }
        TensorType::Q8_0 => {
            // d * q, q uniform in -127..=127.
            let d = std / uniform_std(255.0);
            for b in out.chunks_exact_mut(bb) {
                rng.fill_bytes(&mut b[2..]);
                for q in &mut b[2..] {
                    if *q == 0x80 {
                        *q = 0x81;
                    }
                }
                put_f16(b, d);
            }
        }
        TensorType::Q4_0 | TensorType::Q5_0 => {
            // d * (q - 8) or d * (q - 16); the sign of d alternates at random, centring
            // the values.
            let levels = if ty == TensorType::Q4_0 { 16.0 } else { 32.0 };
            let d = std / uniform_std(levels);
            for b in out.chunks_exact_mut(bb) {
                rng.fill_bytes(&mut b[2..]);
                put_f16(b, rng.signed(d));
            }
        }
        TensorType::Q4_1 | TensorType::Q5_1 => {
            // d * q + m with m = -d * (levels - 1) / 2: centred.
            let levels = if ty == TensorType::Q4_1 { 16.0 } else { 32.0 };
            let d = rng.signed(std / uniform_std(levels));
            for b in out.chunks_exact_mut(bb) {
                rng.fill_bytes(&mut b[4..]);
                put_f16(b, d);
                put_f16(&mut b[2..], -d * (levels - 1.0) / 2.0);
            }
        }
        TensorType::Q4_K | TensorType::Q5_K => {
            // Per sub-block d * sc * q - dmin * m with even sc in 8..=14, m = sc / 2 and
            // dmin = d * (levels - 1): d * sc * (q - (levels - 1) / 2), centred.
            let (levels, quant_start) = if ty == TensorType::Q4_K {
                (16.0, 16)
            } else {
                (32.0, 16)
            };
            let d = std / (11.0 * uniform_std(levels));
            for b in out.chunks_exact_mut(bb) {
                rng.fill_bytes(&mut b[quant_start..]);
                let bits = rng.next_u64();
                let mut sc = [0u8; 8];
                let mut m = [0u8; 8];
                for j in 0..8 {
                    sc[j] = 8 + 2 * ((bits >> (2 * j)) & 3) as u8;
                    m[j] = sc[j] / 2;
                }
                pack_k_scales(&sc, &m, &mut b[4..16]);
                let d = rng.signed(d);
                put_f16(b, d);
                put_f16(&mut b[2..], d * (levels - 1.0));
            }
        }
        TensorType::Q6_K => {
            // ql[128] qh[64] scales[16] d: d * sc * (q - 32), sc = ±(8..=15).
            let d = std / (11.5 * uniform_std(64.0));
            for b in out.chunks_exact_mut(bb) {
                rng.fill_bytes(&mut b[..192]);
                let bits = rng.next_u64();
                for j in 0..16 {
                    let mag = 8 + ((bits >> (4 * j)) & 7) as i8;
                    let neg = (bits >> (4 * j + 3)) & 1 == 1;
                    b[192 + j] = (if neg { -mag } else { mag }) as u8;
                }
                put_f16(&mut b[208..], d);
            }
        }
        other => {
            return Err(ModelError::Invalid(format!(
                "cannot write random {other} blocks (known: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, \
                 Q8_0, Q4_K, Q5_K, Q6_K)"
            )))
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every writer's values, read back through ferrolm's dequantization, are finite, centred
    /// and about as spread as asked.
    #[test]
    fn values_have_the_spread_asked_for() {
        let types = [
            TensorType::F32,
            TensorType::F16,
            TensorType::Q4_0,
            TensorType::Q4_1,
            TensorType::Q5_0,
            TensorType::Q5_1,
            TensorType::Q8_0,
            TensorType::Q4_K,
            TensorType::Q5_K,
            TensorType::Q6_K,
        ];
        let n = 256 * 64;
        for ty in types {
            let mut data = vec![0u8; ferrolm_quant::row_bytes(ty, n).unwrap()];
            fill(ty, Values::Spread(0.02), &mut Wyrand::new(5), &mut data).unwrap();
            let mut v = vec![0f32; n];
            ferrolm_quant::dequantize(ty, &data, &mut v).unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{ty}");
            let mean = v.iter().sum::<f32>() / n as f32;
            let std = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n as f32).sqrt();
            assert!(mean.abs() < 0.002, "{ty}: mean {mean}");
            assert!((0.015..0.027).contains(&std), "{ty}: std {std}");
        }
        let mut norm = vec![0u8; 4 * 64];
        fill(
            TensorType::F32,
            Values::AroundOne(0.1),
            &mut Wyrand::new(1),
            &mut norm,
        )
        .unwrap();
        assert!(norm.chunks(4).all(|c| {
            let x = f32::from_le_bytes(c.try_into().unwrap());
            (0.8..1.2).contains(&x)
        }));
        assert!(fill(
            TensorType::Q4_K,
            Values::AroundOne(0.1),
            &mut Wyrand::new(1),
            &mut [0; 144]
        )
        .is_err());
        assert!(fill(
            TensorType::Q4_0,
            Values::Spread(1.0),
            &mut Wyrand::new(1),
            &mut [0; 17]
        )
        .is_err());
    }
}
