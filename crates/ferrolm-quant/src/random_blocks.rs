//! Random valid blocks for the types this crate cannot quantize (their llama.cpp quantizers
//! search lattices, several only with an importance matrix): random quant bits, each block's
//! scale set so that its dequantized values have a chosen root mean square. What synthetic
//! test files use for such matrices.

use crate::common::{f32_to_f16, u16_at};
use crate::iq::ue4m3_to_f32_half;
use crate::{dequantize, QuantError, TensorType};

/// Where a block keeps the scale that multiplies all of its values.
enum Scale {
    /// An f16 at this byte offset.
    F16(usize),
    /// The f16 `d` and `dmin` of a K-quant with minimums, at these byte offsets (both set to
    /// the same value: the values are linear in the two together).
    WithMin(usize, usize),
    /// IQ1_M's f16, one nibble at the top of each of the four u16 words from byte 48.
    Iq1m,
    /// NVFP4's four unsigned E4M3 sub-block scales (all set alike).
    Nvfp4,
}

fn scale_of(ty: TensorType) -> Option<Scale> {
    use TensorType as T;
    Some(match ty {
        T::IQ2_XXS | T::IQ2_XS | T::IQ2_S | T::IQ3_XXS | T::IQ3_S | T::IQ1_S | T::IQ4_XS => {
            Scale::F16(0)
        }
        T::Q1_0 | T::Q2_0 => Scale::F16(0),
        T::TQ1_0 => Scale::F16(52),
        T::TQ2_0 => Scale::F16(64),
        T::IQ1_M => Scale::Iq1m,
        // K-quants without a quantizer here (their llama.cpp mixes put them beside i-quants)
        T::Q2_K => Scale::WithMin(80, 82),
        T::Q3_K => Scale::F16(108),
        T::Q5_K => Scale::WithMin(0, 2),
        T::NVFP4 => Scale::Nvfp4,
        _ => return None,
    })
}

/// The E4M3 code whose (halved) value is nearest `v`.
fn nearest_ue4m3(v: f32) -> u8 {
    (1u8..0x7f)
        .min_by(|&a, &b| {
            let (da, db) = (
                (ue4m3_to_f32_half(a) - v).abs(),
                (ue4m3_to_f32_half(b) - v).abs(),
            );
            da.total_cmp(&db)
        })
        .unwrap_or(1)
}

fn set_scale(scale: &Scale, block: &mut [u8], d: f32) {
    match *scale {
        Scale::F16(at) => block[at..at + 2].copy_from_slice(&f32_to_f16(d)),
        Scale::WithMin(at, at_min) => {
            block[at..at + 2].copy_from_slice(&f32_to_f16(d));
            block[at_min..at_min + 2].copy_from_slice(&f32_to_f16(d));
        }
        Scale::Iq1m => {
            let bits = u16::from_le_bytes(f32_to_f16(d));
            for k in 0..4 {
                let at = 48 + 2 * k;
                let word = u16_at(block, at) & 0x0fff | (bits >> (4 * k) & 0xf) << 12;
                block[at..at + 2].copy_from_slice(&word.to_le_bytes());
            }
        }
        Scale::Nvfp4 => block[..4].fill(nearest_ue4m3(d)),
    }
}

/// `n` elements of `ty` (a whole number of blocks) as random valid blocks whose values have
/// a root mean square of about `rms` per block; `next_u64` supplies the random bits.
/// Supported: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_XS, TQ1_0, TQ2_0,
/// Q1_0, Q2_0, NVFP4, and the K-quants Q2_K, Q3_K and Q5_K (random scales and minimums; `d`
/// and `dmin` set alike).
pub fn random_blocks(
    ty: TensorType,
    n: usize,
    rms: f32,
    next_u64: &mut dyn FnMut() -> u64,
) -> Result<Vec<u8>, QuantError> {
    let scale = scale_of(ty).ok_or(QuantError::Unsupported {
        ty,
        op: "random blocks",
    })?;
    let mut data = vec![0u8; crate::row_bytes(ty, n)?];
    let mut values = vec![0f32; ty.block_size()];
    for block in data.chunks_exact_mut(ty.block_bytes()) {
        for b in block.iter_mut() {
            *b = next_u64() as u8;
        }
        // Dequantized values are linear in the scale: measure them at 1, then rescale.
        set_scale(&scale, block, 1.0);
        dequantize(ty, block, &mut values)?;
        let ms = values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32;
        let d = if ms > 0.0 { rms / ms.sqrt() } else { rms };
        set_scale(&scale, block, d);
    }
    Ok(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_have_about_the_asked_rms() {
        let mut state = 7u64;
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            state >> 11
        };
        for ty in [
            TensorType::IQ1_S,
            TensorType::IQ1_M,
            TensorType::IQ2_XXS,
            TensorType::IQ2_XS,
            TensorType::IQ2_S,
            TensorType::IQ3_XXS,
            TensorType::IQ3_S,
            TensorType::IQ4_XS,
            TensorType::TQ1_0,
            TensorType::TQ2_0,
            TensorType::Q1_0,
            TensorType::Q2_0,
            TensorType::NVFP4,
            TensorType::Q2_K,
            TensorType::Q3_K,
            TensorType::Q5_K,
        ] {
            let n = 8 * ty.block_size().max(256);
            let data = random_blocks(ty, n, 0.05, &mut next).unwrap();
            let mut v = vec![0f32; n];
            dequantize(ty, &data, &mut v).unwrap();
            let rms = (v.iter().map(|x| x * x).sum::<f32>() / n as f32).sqrt();
            // NVFP4's scales have 3 mantissa bits: within 7%; f16 scales within 1%.
            assert!((rms - 0.05).abs() < 0.0035, "{ty}: rms {rms}");
        }
        assert!(random_blocks(TensorType::Q4_0, 32, 1.0, &mut next).is_err());
    }
}
