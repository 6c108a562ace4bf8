//! Repacked rows: the bytes of a row's blocks regrouped field by field (all the quants, then
//! all the scales), the same size as the GGUF row. GGUF's Q8_0 and Q6_K blocks are 34 and 210
//! bytes, so their quants sit on 2-byte boundaries and a kernel loads them two bytes at a
//! time; regrouped, each chunk's quants start on a 16-byte boundary and load as whole 16-byte
//! words (`Q8_0R`, `Q6_KR` in the kernels). Only rows whose size is a multiple of 16 bytes are
//! regrouped, so that every row starts aligned too. (Q4_0, 18-byte blocks, regrouped the same
//! way decoded slower on an H200: 1B-shaped tg128 1188 -> 1138 tok/s; it stays as it is.)

use ferrolm_gguf::TensorType;

/// A block's fields as (offset, length) in the order a regrouped row stores them, and the
/// block's size.
fn fields(ty: TensorType) -> Option<(usize, &'static [(usize, usize)])> {
    Some(match ty {
        // d (f16), then 32 int8
        TensorType::Q8_0 => (34, &[(2, 32), (0, 2)]),
        // ql[128], qh[64], scales[16], d (f16)
        TensorType::Q6_K => (210, &[(0, 128), (128, 64), (192, 16), (208, 2)]),
        _ => return None,
    })
}

/// The kernels' name for rows of `ty` and `cols` values when they are uploaded regrouped
/// (where `CudaTuning::repack` allows it).
pub fn repacked_type(ty: TensorType, cols: usize) -> Option<&'static str> {
    let (block, _) = fields(ty)?;
    let row_bytes = cols / ty.block_size() * block;
    if !cols.is_multiple_of(ty.block_size()) || !row_bytes.is_multiple_of(16) {
        return None;
    }
    Some(match ty {
        TensorType::Q8_0 => "Q8_0R",
        _ => "Q6_KR",
    })
}

/// `data` (rows of `cols` values of `ty` in GGUF's layout) with each row regrouped; `None`
/// for a type without a regrouped layout.
pub fn repack(ty: TensorType, cols: usize, data: &[u8]) -> Option<Vec<u8>> {
    let (block, fields) = fields(ty)?;
    let nb = cols / ty.block_size();
    let row_bytes = nb * block;
    let mut out = vec![0u8; data.len()];
    for (src, dst) in data
        .chunks_exact(row_bytes)
        .zip(out.chunks_exact_mut(row_bytes))
    {
        let mut at = 0;
        for &(offset, len) in fields {
            for b in 0..nb {
                dst[at..at + len].copy_from_slice(&src[b * block + offset..][..len]);
                at += len;
            }
        }
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn random_rows(ty: TensorType, rows: usize, cols: usize, seed: u32) -> Vec<u8> {
        let mut state = seed;
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect();
        let mut q = vec![0u8; ferrolm_quant::row_bytes(ty, cols).unwrap() * rows];
        ferrolm_quant::quantize(ty, &values, &mut q).unwrap();
        q
    }

    fn half(b: &[u8], at: usize) -> f32 {
        half::f16::from_le_bytes([b[at], b[at + 1]]).to_f32()
    }

    /// Chunk `c` (32 values) of a regrouped row, read at the offsets the kernels' `load` of
    /// Q8_0R / Q6_KR reads (nc: the row's chunks).
    fn kernel_chunk(ty: TensorType, row: &[u8], c: usize, nc: usize) -> Vec<f32> {
        match ty {
            TensorType::Q8_0 => {
                let d = half(row, 32 * nc + 2 * c);
                row[32 * c..32 * c + 32]
                    .iter()
                    .map(|&b| d * (b as i8) as f32)
                    .collect()
            }
            _ => {
                let (nsb, sb, j) = (nc / 8, c / 8, c % 8);
                let (n, k) = (j / 4, j % 4);
                let ql = &row[128 * sb + 64 * n + 32 * (k & 1)..][..32];
                let qh = &row[128 * nsb + 64 * sb + 32 * n..][..32];
                let sc = &row[192 * nsb + 16 * sb + 8 * n + 2 * k..][..2];
                let d = half(row, 208 * nsb + 2 * sb);
                let (lshift, hshift) = ((k >> 1) * 4, 2 * k);
                (0..32)
                    .map(|l| {
                        let q = ((ql[l] >> lshift) & 15) | (((qh[l] >> hshift) & 3) << 4);
                        d * (sc[l / 16] as i8) as f32 * (q as i32 - 32) as f32
                    })
                    .collect()
            }
        }
    }

    fn rb_seed(ty: TensorType) -> u32 {
        ty.block_bytes() as u32
    }

    #[test]
    fn regrouped_rows_hold_the_values_where_the_kernels_read_them() {
        for (ty, cols) in [
            (TensorType::Q8_0, 256),
            (TensorType::Q8_0, 2048),
            (TensorType::Q6_K, 2048),
            (TensorType::Q6_K, 4096),
        ] {
            let rows = 3;
            let data = random_rows(ty, rows, cols, cols as u32 + rb_seed(ty));
            let packed = repack(ty, cols, &data).unwrap();
            assert_eq!(packed.len(), data.len());
            assert_ne!(packed, data, "{ty:?}");
            let rb = data.len() / rows;
            let nc = cols / 32;
            for r in 0..rows {
                let mut want = vec![0f32; cols];
                ferrolm_quant::dequantize(ty, &data[r * rb..(r + 1) * rb], &mut want).unwrap();
                for c in 0..nc {
                    let got = kernel_chunk(ty, &packed[r * rb..(r + 1) * rb], c, nc);
                    assert_eq!(got, want[32 * c..32 * c + 32], "{ty:?} row {r} chunk {c}");
                }
            }
        }
    }

    #[test]
    fn only_rows_of_whole_16_byte_words_are_regrouped() {
        assert_eq!(repacked_type(TensorType::Q8_0, 2048), Some("Q8_0R"));
        assert_eq!(repacked_type(TensorType::Q4_0, 4096), None);
        assert_eq!(repacked_type(TensorType::Q6_K, 14336), Some("Q6_KR"));
        // 576 values: 18 blocks of 34 bytes
        assert_eq!(repacked_type(TensorType::Q8_0, 576), None);
        assert_eq!(repacked_type(TensorType::Q6_K, 1024), None);
        assert_eq!(repacked_type(TensorType::Q4_K, 4096), None);
        assert!(repack(TensorType::Q4_K, 256, &[0; 144]).is_none());
    }
}
