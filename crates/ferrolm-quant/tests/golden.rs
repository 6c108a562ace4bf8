//! Bit-exactness against the `gguf` Python package (goldens from scripts/quant_golden.py).

mod common;

use ferrolm_quant::{dequantize, quantize, TensorType};

const DEQ_TYPES: &[TensorType] = &[
    TensorType::F32,
    TensorType::F16,
    TensorType::BF16,
    TensorType::Q4_0,
    TensorType::Q4_1,
    TensorType::Q5_0,
    TensorType::Q5_1,
    TensorType::Q8_0,
    TensorType::Q8_1,
    TensorType::Q2_K,
    TensorType::Q3_K,
    TensorType::Q4_K,
    TensorType::Q5_K,
    TensorType::Q6_K,
    TensorType::Q8_K,
    TensorType::IQ4_NL,
    TensorType::MXFP4,
];

const QUANT_TYPES: &[TensorType] = &[
    TensorType::F16,
    TensorType::BF16,
    TensorType::Q4_0,
    TensorType::Q4_1,
    TensorType::Q5_0,
    TensorType::Q5_1,
    TensorType::Q8_0,
    TensorType::Q8_1,
    TensorType::Q8_K,
    TensorType::MXFP4,
];

fn golden(name: &str) -> Vec<u8> {
    let path = format!("{}/tests/golden/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read(&path).unwrap_or_else(|e| panic!("{path}: {e} (run scripts/quant_golden.py)"))
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn dequantize_is_bit_exact_with_gguf() {
    // gguf 0.19.0 has no Q1_0 or Q2_0: those are checked against llama.cpp's compiled
    // to_float in tests/ggml_oracle.rs.
    let later = common::LATER_TYPES
        .iter()
        .filter(|t| !matches!(t, TensorType::Q1_0 | TensorType::Q2_0));
    for &ty in DEQ_TYPES.iter().chain(later) {
        let data = golden(&format!("deq_{}.bin", ty.name()));
        let per_block = ty.block_bytes() + 4 * ty.block_size();
        assert_eq!(data.len() % per_block, 0, "{ty}: golden size");
        let nb = data.len() / per_block;
        assert!(nb >= 16, "{ty}: too few golden blocks");
        let (raw, want) = data.split_at(nb * ty.block_bytes());
        let want = f32s(want);
        let mut got = vec![f32::NAN; want.len()];
        dequantize(ty, raw, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{ty}: element {i}: got {g}, gguf says {w}"
            );
        }
    }
}

#[test]
fn quantize_is_bit_exact_with_gguf() {
    for &ty in QUANT_TYPES {
        let data = golden(&format!("q_{}.bin", ty.name()));
        // Inputs are 16 blocks of the type's block size (32 for the float types).
        let n = 16 * ty.block_size().max(32);
        let (x, want) = data.split_at(4 * n);
        let x = f32s(x);
        assert_eq!(
            want.len(),
            ferrolm_quant::row_bytes(ty, n).unwrap(),
            "{ty}: golden size"
        );
        let mut got = vec![0xAAu8; want.len()];
        quantize(ty, &x, &mut got).unwrap();
        if got != want {
            let i = got.iter().zip(want).position(|(a, b)| a != b).unwrap();
            let bb = ty.block_bytes();
            panic!(
                "{ty}: first difference at byte {i} (block {}, offset {}): got {:?}, gguf {:?}",
                i / bb,
                i % bb,
                &got[i / bb * bb..(i / bb + 1) * bb],
                &want[i / bb * bb..(i / bb + 1) * bb]
            );
        }
    }
}
