//! Quantizers without a gguf counterpart (Q4_K, Q6_K, Q8_K details), error cases and the
//! activation quantizer's llama.cpp-specific rounding.

mod common;

use common::Rng;
use ferrolm_quant::{
    dequantize, quantize, quantize_activation, row_bytes, vec_dot_type, QuantError, TensorType,
};

fn round_trip(ty: TensorType, x: &[f32]) -> Vec<f32> {
    let mut q = vec![0u8; row_bytes(ty, x.len()).unwrap()];
    quantize(ty, x, &mut q).unwrap();
    let mut y = vec![0f32; x.len()];
    dequantize(ty, &q, &mut y).unwrap();
    y
}

/// Root-mean-square error relative to the RMS of the input.
fn rel_rmse(x: &[f32], y: &[f32]) -> f32 {
    let e: f32 = x.iter().zip(y).map(|(a, b)| (a - b) * (a - b)).sum();
    let s: f32 = x.iter().map(|a| a * a).sum();
    (e / s).sqrt()
}

#[test]
fn k_quant_round_trips_are_close() {
    let mut rng = Rng::new(7);
    // (type, bound on relative RMS error for Gaussian data); llama.cpp's own numbers are
    // about 0.09 for 4 bits and 0.022 for 6 bits.
    for (ty, bound) in [
        (TensorType::Q4_K, 0.12),
        (TensorType::Q6_K, 0.035),
        (TensorType::Q8_K, 0.01),
        (TensorType::Q4_0, 0.15),
        (TensorType::Q4_1, 0.12),
        (TensorType::Q5_0, 0.07),
        (TensorType::Q5_1, 0.06),
        (TensorType::Q8_0, 0.01),
        (TensorType::MXFP4, 0.25),
    ] {
        for scale in [1e-3f32, 1.0, 300.0] {
            let x = rng.normals(4096, scale);
            let y = round_trip(ty, &x);
            let e = rel_rmse(&x, &y);
            assert!(
                e < bound,
                "{ty} at scale {scale}: relative RMSE {e} >= {bound}"
            );
            assert!(
                e > 0.0,
                "{ty}: a lossy format cannot be exact on random data"
            );
        }
    }
}

#[test]
fn k_quants_of_zeros_and_constants() {
    for ty in [TensorType::Q4_K, TensorType::Q6_K, TensorType::Q8_K] {
        let x = vec![0f32; 512];
        assert_eq!(round_trip(ty, &x), x, "{ty} of zeros");
        let x = vec![0.75f32; 256];
        let y = round_trip(ty, &x);
        assert!(rel_rmse(&x, &y) < 0.02, "{ty} of a constant: {:?}", &y[..4]);
    }
}

#[test]
fn q8_k_uses_the_signed_maximum_and_bsums() {
    let mut rng = Rng::new(11);
    let mut x = rng.normals(512, 2.0);
    x[5] = -50.0; // the signed maximum of block 0 is negative -> it quantizes to +127 * d < 0
    x[300] = 40.0;
    let mut q = vec![0u8; row_bytes(TensorType::Q8_K, 512).unwrap()];
    quantize(TensorType::Q8_K, &x, &mut q).unwrap();
    for (b, block) in q.chunks_exact(292).enumerate() {
        let d = f32::from_le_bytes(block[0..4].try_into().unwrap());
        let qs: Vec<i32> = block[4..260].iter().map(|&v| v as i8 as i32).collect();
        let max = if b == 0 { -50.0f32 } else { 40.0 };
        assert_eq!(d, 1.0 / (-127.0 / max), "block {b}: d");
        let imax = if b == 0 { 5 } else { 300 - 256 };
        assert_eq!(qs[imax], -127, "block {b}: the maximum maps to -127");
        assert!(qs.iter().all(|&v| (-127..=127).contains(&v)));
        for j in 0..16 {
            let bsum = i16::from_le_bytes([block[260 + 2 * j], block[261 + 2 * j]]) as i32;
            assert_eq!(
                bsum,
                qs[16 * j..16 * j + 16].iter().sum::<i32>(),
                "block {b} bsum {j}"
            );
        }
        for (i, &qi) in qs.iter().enumerate() {
            let v = x[256 * b + i];
            assert!(
                (qi as f32 * d - v).abs() <= d.abs() * 0.5001,
                "block {b} element {i}"
            );
        }
    }
}

#[test]
fn q8_1_stores_the_scaled_sum() {
    let mut rng = Rng::new(3);
    let x = rng.normals(256, 1.0);
    for quant in [quantize, quantize_activation] {
        let mut q = vec![0u8; row_bytes(TensorType::Q8_1, 256).unwrap()];
        quant(TensorType::Q8_1, &x, &mut q).unwrap();
        for (block, x) in q.chunks_exact(36).zip(x.chunks_exact(32)) {
            // s uses the f32 scale, before its rounding to f16.
            let d = x.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
            assert_eq!(
                half::f16::from_le_bytes([block[0], block[1]]),
                half::f16::from_f32(d)
            );
            let s = half::f16::from_le_bytes([block[2], block[3]]).to_f32();
            let sum: i32 = block[4..].iter().map(|&v| v as i8 as i32).sum();
            assert_eq!(s, half::f16::from_f32(sum as f32 * d).to_f32());
        }
    }
}

#[test]
fn activation_rounding_follows_llama_cpp_simd() {
    // 63.5 / 127 * 127 = 63.5 exactly under id = 127 / amax: the reference (roundf) gives 64,
    // llama.cpp's AVX and NEON paths round half to even, 64 as well; 62.5 separates them.
    let mut x = vec![0f32; 32];
    x[0] = 127.0;
    x[1] = 62.5;
    x[2] = -62.5;
    let mut r = vec![0u8; 34];
    let mut a = vec![0u8; 34];
    quantize(TensorType::Q8_0, &x, &mut r).unwrap();
    quantize_activation(TensorType::Q8_0, &x, &mut a).unwrap();
    assert_eq!(
        (r[3] as i8, r[4] as i8),
        (63, -63),
        "reference rounds half away from zero"
    );
    if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
        assert_eq!(
            (a[3] as i8, a[4] as i8),
            (62, -62),
            "SIMD paths round half to even"
        );
    } else {
        assert_eq!(a, r);
    }
}

#[test]
fn errors_name_the_problem() {
    let mut out = vec![0f32; 32];
    let e = quantize(TensorType::IQ2_XXS, &[0f32; 256], &mut [0u8; 66]).unwrap_err();
    assert!(matches!(
        e,
        QuantError::Unsupported {
            ty: TensorType::IQ2_XXS,
            ..
        }
    ));
    assert!(e.to_string().contains("IQ2_XXS"), "{e}");
    let e = dequantize(TensorType::Q4_0, &[0u8; 17], &mut out).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::BufferSize {
                expected: 18,
                actual: 17,
                ..
            }
        ),
        "{e}"
    );
    let e = dequantize(TensorType::Q4_0, &[0u8; 18], &mut out[..31]).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::PartialBlock {
                n: 31,
                block_size: 32,
                ..
            }
        ),
        "{e}"
    );
    let e = quantize(TensorType::Q2_K, &[0f32; 256], &mut [0u8; 84]).unwrap_err();
    assert!(matches!(e, QuantError::Unsupported { .. }), "{e}");
    assert!(vec_dot_type(TensorType::I32).is_err());
    assert_eq!(row_bytes(TensorType::Q6_K, 512), Ok(420));
    assert!(row_bytes(TensorType::Q6_K, 500).is_err());
}

#[test]
fn vec_dot_types_match_llama_cpp() {
    use TensorType as T;
    for (w, a) in [
        (T::Q4_0, T::Q8_0),
        (T::Q5_0, T::Q8_0),
        (T::Q8_0, T::Q8_0),
        (T::IQ4_NL, T::Q8_0),
        (T::MXFP4, T::Q8_0),
        (T::Q4_1, T::Q8_1),
        (T::Q5_1, T::Q8_1),
        (T::Q2_K, T::Q8_K),
        (T::Q3_K, T::Q8_K),
        (T::Q4_K, T::Q8_K),
        (T::Q5_K, T::Q8_K),
        (T::Q6_K, T::Q8_K),
        (T::F16, T::F16),
        (T::BF16, T::BF16),
        (T::F32, T::F32),
    ] {
        assert_eq!(vec_dot_type(w), Ok(a), "{w}");
    }
}

/// Q8_K keeps the first value of the largest magnitude as its signed maximum, as llama.cpp's
/// loop does (`if (ax > amax)`), also where a later value of the opposite sign ties it, where
/// the tie is in the same eight-lane column, and where NaNs or only zeros are around.
#[test]
fn q8_k_signed_maximum_is_the_first_of_ties() {
    let mut rng = Rng::new(5);
    /// Per block: the tied values (position, value) and a NaN's position.
    type Case<'a> = (&'a [(usize, f32)], Option<usize>);
    let cases: [Case; 6] = [
        (&[(3, 9.0), (11, -9.0)], None),   // same lane (3 and 11 = 3 + 8)
        (&[(12, -9.0), (200, 9.0)], None), // other lanes
        (&[(255, -9.0)], None),            // the last element
        (&[(0, 9.0), (1, -9.0)], Some(7)), // with a NaN before the maximum's lane
        (&[(70, -9.0), (71, 9.0)], Some(69)),
        (&[], None), // all zeros
    ];
    let mut x = Vec::new();
    for (ties, nan) in cases {
        let mut b: Vec<f32> = if ties.is_empty() {
            vec![0.0; 256]
        } else {
            rng.normals(256, 2.0)
        };
        for &(i, v) in ties {
            b[i] = v;
        }
        if let Some(i) = nan {
            b[i] = f32::NAN;
        }
        x.extend(b);
    }
    let mut q = vec![0u8; row_bytes(TensorType::Q8_K, x.len()).unwrap()];
    quantize(TensorType::Q8_K, &x, &mut q).unwrap();
    for (b, (ties, _)) in cases.iter().enumerate() {
        let block = &q[292 * b..292 * (b + 1)];
        let d = f32::from_le_bytes(block[0..4].try_into().unwrap());
        match ties.first() {
            Some(&(i, v)) => {
                assert_eq!(d.to_bits(), (1.0 / (-127.0 / v)).to_bits(), "block {b}: d");
                assert_eq!(block[4 + i] as i8, -127, "block {b}: the first maximum");
            }
            None => assert!(block.iter().all(|&v| v == 0), "block {b}: zeros"),
        }
    }
}

/// `geglu` (eight at a time where the CPU has F16C) against the scalar definition, bit for
/// bit: random gates and the edges (±10, beyond, NaN, infinities, signed zeros), a length
/// that leaves a remainder.
#[test]
fn geglu_matches_its_scalar_definition() {
    use ferrolm_quant::ggml_vec;
    let mut rng = Rng::new(21);
    let table = ggml_vec::gelu_f16_table();
    let edges = [
        -10.0f32,
        10.0,
        -10.000001,
        9.999999,
        11.0,
        -11.0,
        0.0,
        -0.0,
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        65504.0,
        1e-8,
    ];
    let n = 1003;
    let g: Vec<f32> = (0..n)
        .map(|i| {
            if i % 7 == 0 {
                edges[(i / 7) % edges.len()]
            } else {
                rng.normal() * 6.0
            }
        })
        .collect();
    let u: Vec<f32> = (0..n).map(|_| rng.normal() * 3.0).collect();
    let mut out = vec![0f32; n];
    ggml_vec::geglu(&g, &u, &mut out);
    for i in 0..n {
        let want = if g[i] <= -10.0 {
            0.0
        } else if g[i] >= 10.0 {
            g[i] * u[i]
        } else {
            table[half::f16::from_f32(g[i]).to_bits() as usize].to_f32() * u[i]
        };
        assert_eq!(out[i].to_bits(), want.to_bits(), "g={} u={}", g[i], u[i]);
    }
}

/// `f32_to_f16_row` (F16C eight at a time where the CPU has it) equals `half`'s conversion
/// value by value: random values, ties, overflow, subnormals, infinities, NaN, and a length
/// that leaves a remainder.
#[test]
fn f32_to_f16_row_matches_half() {
    use ferrolm_quant::ggml_vec;
    let mut rng = Rng::new(8);
    let edges = [
        65504.0f32,
        65520.0,
        1e6,
        -1e6,
        6e-8,
        3e-8,
        1e-10,
        -0.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1.0 + 1.0 / 2048.0,
        1.0 + 3.0 / 2048.0,
    ];
    let n = 517;
    let x: Vec<f32> = (0..n)
        .map(|i| {
            if i % 5 == 0 {
                edges[(i / 5) % edges.len()]
            } else {
                rng.normal() * 100.0
            }
        })
        .collect();
    let mut h = vec![half::f16::ZERO; n];
    ggml_vec::f32_to_f16_row(&x, &mut h);
    for i in 0..n {
        assert_eq!(
            h[i].to_bits(),
            half::f16::from_f32(x[i]).to_bits(),
            "x={}",
            x[i]
        );
    }
}

/// `rope_rotate` (FMA instructions where the CPU has them) against the same rotation written
/// with `f32::mul_add`, bit for bit, in both layouts, with elements past the pairs untouched.
#[test]
fn rope_rotate_matches_its_scalar_definition() {
    use ferrolm_quant::ggml_vec;
    let mut rng = Rng::new(5);
    let hd = 70;
    let pairs = 29; // partial rotation: the last 12 elements pass through
    let cos_sin: Vec<(f32, f32)> = (0..pairs)
        .map(|i| {
            let a = rng.normal() * 40.0 + i as f32;
            (a.cos(), a.sin())
        })
        .collect();
    let head: Vec<f32> = (0..hd).map(|_| rng.normal() * 5.0).collect();
    let rotate =
        |x0: f32, x1: f32, c: f32, s: f32| (x0.mul_add(c, -(x1 * s)), x0.mul_add(s, x1 * c));
    for neox in [false, true] {
        let mut got = head.clone();
        ggml_vec::rope_rotate(&mut got, &cos_sin, neox);
        let mut want = head.clone();
        for (i, &(c, s)) in cos_sin.iter().enumerate() {
            let (a, b) = if neox {
                (i, i + pairs)
            } else {
                (2 * i, 2 * i + 1)
            };
            (want[a], want[b]) = rotate(head[a], head[b], c, s);
        }
        for i in 0..hd {
            assert_eq!(
                got[i].to_bits(),
                want[i].to_bits(),
                "neox {neox}, element {i}"
            );
        }
    }
}

/// Q8_0 activations (compiled for AVX2 where the CPU has it) against llama.cpp's x86 recipe
/// written out plainly: the largest magnitude in one pass (NaNs never win), `id = 127 / amax`,
/// round half to even, `d = amax / 127` as f16; random blocks and blocks with ties, NaNs,
/// signed zeros and zeros only.
#[test]
fn q8_0_activations_follow_the_x86_recipe() {
    let mut rng = Rng::new(17);
    let mut x: Vec<f32> = (0..32 * 40).map(|_| rng.normal() * 3.0).collect();
    x[32..64].fill(0.0);
    x[64..96].iter_mut().for_each(|v| *v = -0.0);
    x[96] = f32::NAN;
    x[100] = -7.0;
    x[101] = 7.0; // a tie of magnitudes
    x[128] = 127.0;
    x[129] = 62.5; // a tie of rounding
    x[130] = -62.5;
    let mut got = vec![0u8; 34 * 40];
    quantize_activation(TensorType::Q8_0, &x, &mut got).unwrap();
    for (b, block) in x.chunks(32).enumerate() {
        let amax = block
            .iter()
            .fold(0.0f32, |a, &v| if v.abs() > a { v.abs() } else { a });
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let d = half::f16::from_f32(amax / 127.0);
        let out = &got[34 * b..34 * (b + 1)];
        assert_eq!(out[..2], d.to_le_bytes(), "block {b}: d");
        for (i, &v) in block.iter().enumerate() {
            let want = (v * id).round_ties_even() as i32 as i8;
            assert_eq!(out[2 + i] as i8, want, "block {b}, element {i}");
        }
    }
}

#[test]
fn lattice_tables_render_as_c() {
    let c = ferrolm_quant::lattice_tables_c();
    for (name, n) in [
        ("IQ2XXS_GRID", 256),
        ("IQ2XS_GRID", 512),
        ("IQ2S_GRID", 1024),
        ("IQ1S_GRID", 2048),
        ("IQ3XXS_GRID", 256),
        ("IQ3S_GRID", 512),
    ] {
        let line = c
            .lines()
            .find(|l| l.contains(&format!(" {name}[")))
            .unwrap_or_else(|| panic!("{name} missing"));
        assert!(line.starts_with("__device__ const u"), "{line:.40}");
        assert!(line.contains(&format!("[{n}]")), "{name}: {line:.40}");
        assert_eq!(line.matches("0x").count(), n, "{name}");
    }
    // IQ2_XXS's second entry, as ggml-common.h has it.
    assert!(c.contains("{0x0808080808080808u,0x080808080808082bu,"));
}
