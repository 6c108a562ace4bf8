//! GGUF block formats: layouts, dequantization, quantization and CPU dot-product kernels.
//!
//! * [`dequantize`] turns GGUF block bytes of any supported [`TensorType`] into f32, bit-exact
//!   with ggml's reference (and with the `gguf` Python package).
//! * [`quantize`] writes f32 values as blocks with ggml's reference quantizers
//!   (`quantize_row_*_ref`); [`quantize_activation`] writes them the way llama.cpp's CPU backend
//!   quantizes activations on this machine's architecture.
//! * [`random_blocks`] writes random valid blocks of the types without a quantizer here (the
//!   i-quants, TQ1_0, TQ2_0, Q1_0, Q2_0, NVFP4, and Q2_K, Q3_K, Q5_K) at a chosen scale, for
//!   synthetic files.
//! * [`dot_kernel`] picks, once per process, the fastest dot product of a weight row with an
//!   activation vector quantized to [`vec_dot_type`]; [`dot_kernel_scalar`] is the reference
//!   every SIMD kernel is tested against.
//! * [`ggml_vec`]: swiglu, silu, soft_max, f16 dot and f32->f16 rows as llama.cpp computes them.
//!
//! Bit-exactness with llama.cpp: [`quantize_activation`], every [`DotKernel`] (scalar and
//! AVX2) and [`ggml_vec`] give the same f32 bits as llama.cpp's CPU backend built for an
//! AVX512 x86-64 CPU (GGML_NATIVE, gcc 12): the scalar code emulates its SIMD lane structure
//! with `f32::mul_add`, so this holds on any CPU (the aarch64 NEON kernels follow the same
//! structure, tested under qemu). `tests/ggml_oracle.rs` checks it against goldens made by
//! `scripts/ggml_oracle.py` with llama.cpp's own compiled functions.
//!
//! llama.cpp's other CPU paths are mirrored as its default configuration takes them, each
//! behind a switch of [`KernelOptions`]: its CPU_REPACK products of Q4_K, Q4_0, IQ4_NL and
//! MXFP4 weights (`repack`, for the tensors [`matrix_kernel`] is asked about: 2-D, a multiple
//! of 8 rows, x86-64 with AVX2) and of Q2_K weights (the same, with AVX512), 3-D expert tensors
//! among them ([`expert_kernel`]: its gemv for every routed row), and its tiled
//! matmul for batches of 8 or more columns (`tiled`: Q2_K..Q6_K, the i-quants, IQ4_XS, when
//! not repacked; the AVX512-VNNI microkernel's arithmetic). Not mirrored: llama.cpp's aarch64
//! tiles.
#![deny(missing_docs)]
// `unsafe` lives only in the SIMD modules (`avx2`, `neon`), around the intrinsics.
#![deny(unsafe_code)]

mod common;
mod float;
pub mod ggml_vec;
mod iq;
mod iq1;
mod iq2;
mod iq3;
mod iq_grids;
mod k_quants;
mod kernel;
mod legacy;
mod low_bit;
mod random_blocks;
mod repack;
mod ternary;
mod tiled;
pub mod vecops;

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)] // intrinsics; each entry point checks lengths in safe code first
mod avx2;
#[cfg(target_arch = "aarch64")]
#[allow(unsafe_code)] // intrinsics; each entry point checks lengths in safe code first
mod neon;

pub use ferrolm_gguf::TensorType;
pub use kernel::{
    dot_kernel, dot_kernel_scalar, dot_kernel_with, expert_kernel, matrix_kernel, DotKernel,
    KernelOptions,
};
pub use random_blocks::random_blocks;

/// What went wrong converting or multiplying blocks.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    /// The operation is not implemented for this tensor type.
    #[error("tensor type {ty} is not supported for {op}")]
    Unsupported {
        /// The type asked for.
        ty: TensorType,
        /// The operation: "dequantize", "quantize", "dot product", ...
        op: &'static str,
    },
    /// The element count is not a whole number of blocks.
    #[error("{ty}: {n} elements is not a multiple of the block size {block_size}")]
    PartialBlock {
        /// The type.
        ty: TensorType,
        /// The element count given.
        n: usize,
        /// Elements per block of `ty`.
        block_size: usize,
    },
    /// A byte buffer does not hold exactly the blocks for the element count.
    #[error("{ty}: {n} elements take {expected} bytes, but the buffer has {actual}")]
    BufferSize {
        /// The type.
        ty: TensorType,
        /// The element count.
        n: usize,
        /// Bytes `n` elements of `ty` take.
        expected: usize,
        /// Bytes given.
        actual: usize,
    },
}

/// Bytes taken by `n` elements of `ty`; an error when `n` is not a whole number of blocks.
pub fn row_bytes(ty: TensorType, n: usize) -> Result<usize, QuantError> {
    let block_size = ty.block_size();
    if !n.is_multiple_of(block_size) {
        return Err(QuantError::PartialBlock { ty, n, block_size });
    }
    Ok(n / block_size * ty.block_bytes())
}

fn check_buffer(ty: TensorType, n: usize, bytes: usize) -> Result<(), QuantError> {
    let expected = row_bytes(ty, n)?;
    if expected != bytes {
        return Err(QuantError::BufferSize {
            ty,
            n,
            expected,
            actual: bytes,
        });
    }
    Ok(())
}

type DequantFn = fn(&[u8], &mut [f32]);
type QuantFn = fn(&[f32], &mut [u8]);

fn dequant_fn(ty: TensorType) -> Option<DequantFn> {
    use TensorType as T;
    Some(match ty {
        T::F32 => float::dequantize_f32,
        T::F16 => float::dequantize_f16,
        T::BF16 => float::dequantize_bf16,
        T::Q4_0 => legacy::dequantize_q4_0,
        T::Q4_1 => legacy::dequantize_q4_1,
        T::Q5_0 => legacy::dequantize_q5_0,
        T::Q5_1 => legacy::dequantize_q5_1,
        T::Q8_0 => legacy::dequantize_q8_0,
        T::Q8_1 => legacy::dequantize_q8_1,
        T::Q2_K => k_quants::dequantize_q2_k,
        T::Q3_K => k_quants::dequantize_q3_k,
        T::Q4_K => k_quants::dequantize_q4_k,
        T::Q5_K => k_quants::dequantize_q5_k,
        T::Q6_K => k_quants::dequantize_q6_k,
        T::Q8_K => k_quants::dequantize_q8_k,
        T::IQ4_NL => iq::dequantize_iq4_nl,
        T::MXFP4 => iq::dequantize_mxfp4,
        T::IQ4_XS => iq::dequantize_iq4_xs,
        T::NVFP4 => iq::dequantize_nvfp4,
        T::IQ2_XXS => iq2::dequantize_iq2_xxs,
        T::IQ2_XS => iq2::dequantize_iq2_xs,
        T::IQ2_S => iq2::dequantize_iq2_s,
        T::IQ3_XXS => iq3::dequantize_iq3_xxs,
        T::IQ3_S => iq3::dequantize_iq3_s,
        T::IQ1_S => iq1::dequantize_iq1_s,
        T::IQ1_M => iq1::dequantize_iq1_m,
        T::TQ1_0 => ternary::dequantize_tq1_0,
        T::TQ2_0 => ternary::dequantize_tq2_0,
        T::Q1_0 => low_bit::dequantize_q1_0,
        T::Q2_0 => low_bit::dequantize_q2_0,
        _ => return None,
    })
}

/// Dequantize `dst.len()` elements from GGUF block bytes `src` of type `ty`.
///
/// Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q2_K..Q6_K, Q8_K, IQ4_NL,
/// MXFP4, the i-quants IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ4_XS, the
/// ternary TQ1_0 and TQ2_0, Q1_0, Q2_0 and NVFP4. `src` must hold exactly the blocks of
/// `dst.len()` elements.
pub fn dequantize(ty: TensorType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let f = dequant_fn(ty).ok_or(QuantError::Unsupported {
        ty,
        op: "dequantize",
    })?;
    check_buffer(ty, dst.len(), src.len())?;
    f(src, dst);
    Ok(())
}

fn quant_fn(ty: TensorType) -> Option<QuantFn> {
    use legacy::Rounding;
    use TensorType as T;
    Some(match ty {
        T::F32 => float::quantize_f32,
        T::F16 => float::quantize_f16,
        T::BF16 => float::quantize_bf16,
        T::Q4_0 => legacy::quantize_q4_0,
        T::Q4_1 => legacy::quantize_q4_1,
        T::Q5_0 => legacy::quantize_q5_0,
        T::Q5_1 => legacy::quantize_q5_1,
        T::Q8_0 => |s, d| legacy::quantize_q8_0_with(s, d, Rounding::Reference),
        T::Q8_1 => |s, d| legacy::quantize_q8_1_with(s, d, Rounding::Reference),
        T::Q4_K => k_quants::quantize_q4_k,
        T::Q6_K => k_quants::quantize_q6_k,
        T::Q8_K => k_quants::quantize_q8_k,
        T::MXFP4 => iq::quantize_mxfp4,
        _ => return None,
    })
}

/// Quantize f32 values into blocks of `ty` with ggml's reference quantizers.
///
/// Supported: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q8_1, Q8_K, Q4_K, Q6_K, MXFP4
/// (K-quants without importance weights). `dst` must be exactly the blocks of `src.len()`
/// elements.
pub fn quantize(ty: TensorType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    let f = quant_fn(ty).ok_or(QuantError::Unsupported { ty, op: "quantize" })?;
    check_buffer(ty, src.len(), dst.len())?;
    f(src, dst);
    Ok(())
}

/// Quantize an activation vector into `ty` (a [`vec_dot_type`]) exactly as llama.cpp's CPU
/// backend does on this architecture, which differs from [`quantize`] for Q8_0 and Q8_1:
/// on x86-64 llama.cpp's AVX path uses `127 / amax` and rounds half to even, on aarch64 its
/// NEON path uses `1 / d` and rounds half to even; elsewhere it is the reference (`roundf`).
/// Q8_K and the float types are the same as [`quantize`].
pub fn quantize_activation(ty: TensorType, src: &[f32], dst: &mut [u8]) -> Result<(), QuantError> {
    use legacy::Rounding;
    let rounding = if cfg!(target_arch = "x86_64") {
        Rounding::X86
    } else if cfg!(target_arch = "aarch64") {
        Rounding::Arm
    } else {
        Rounding::Reference
    };
    #[cfg(target_arch = "x86_64")]
    if matches!(ty, TensorType::Q8_0 | TensorType::Q8_K) {
        check_buffer(ty, src.len(), dst.len())?;
        if std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c")
        {
            // SAFETY: avx2, fma and f16c were detected just above; the sizes were checked.
            #[allow(unsafe_code)]
            unsafe {
                avx2::quantize_activation(ty, src, dst)
            };
            return Ok(());
        }
    }
    match ty {
        TensorType::Q8_0 => {
            check_buffer(ty, src.len(), dst.len())?;
            legacy::quantize_q8_0_with(src, dst, rounding);
            Ok(())
        }
        TensorType::Q8_1 => {
            check_buffer(ty, src.len(), dst.len())?;
            legacy::quantize_q8_1_with(src, dst, rounding);
            Ok(())
        }
        _ => quantize(ty, src, dst),
    }
}

/// The activation format llama.cpp's CPU backend dots rows of `ty` against (its
/// `vec_dot_type`): Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4, NVFP4, Q1_0, Q2_0 -> Q8_0; Q4_1, Q5_1 ->
/// Q8_1; K-quants, the 256-element i-quants, TQ1_0 and TQ2_0 -> Q8_K; F32, F16, BF16 ->
/// themselves.
pub fn vec_dot_type(ty: TensorType) -> Result<TensorType, QuantError> {
    use TensorType as T;
    Ok(match ty {
        T::Q4_0 | T::Q5_0 | T::Q8_0 | T::IQ4_NL | T::MXFP4 | T::NVFP4 | T::Q1_0 | T::Q2_0 => {
            T::Q8_0
        }
        T::Q4_1 | T::Q5_1 => T::Q8_1,
        T::Q2_K | T::Q3_K | T::Q4_K | T::Q5_K | T::Q6_K => T::Q8_K,
        T::IQ1_S | T::IQ1_M | T::IQ2_XXS | T::IQ2_XS | T::IQ2_S | T::IQ3_XXS | T::IQ3_S => T::Q8_K,
        T::IQ4_XS | T::TQ1_0 | T::TQ2_0 => T::Q8_K,
        T::F32 | T::F16 | T::BF16 => ty,
        _ => {
            return Err(QuantError::Unsupported {
                ty,
                op: "dot product",
            })
        }
    })
}

/// The i-quants' lattice tables as CUDA C definitions (`__device__ const u64 IQ2XXS_GRID[256] =
/// {...};` and likewise IQ2XS_GRID, IQ2S_GRID, IQ1S_GRID, and the u32 IQ3XXS_GRID, IQ3S_GRID),
/// for device code that reads them (ferrolm-cuda's `kernels_iquants.cu`); `u64`/`u32` are the
/// typedefs of that source.
pub fn lattice_tables_c() -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let mut table = |name: &str, ty: &str, words: &mut dyn Iterator<Item = u64>, digits: usize| {
        let body: Vec<String> = words.map(|w| format!("0x{w:0digits$x}u")).collect();
        let _ = writeln!(
            s,
            "__device__ const {ty} {name}[{}] = {{{}}};",
            body.len(),
            body.join(",")
        );
    };
    table(
        "IQ2XXS_GRID",
        "u64",
        &mut iq_grids::IQ2XXS_GRID.iter().copied(),
        16,
    );
    table(
        "IQ2XS_GRID",
        "u64",
        &mut iq_grids::IQ2XS_GRID.iter().copied(),
        16,
    );
    table(
        "IQ2S_GRID",
        "u64",
        &mut iq_grids::IQ2S_GRID.iter().copied(),
        16,
    );
    table(
        "IQ1S_GRID",
        "u64",
        &mut iq_grids::IQ1S_GRID.iter().copied(),
        16,
    );
    let w32 = |t: &'static [u32]| t.iter().map(|&w| w as u64);
    table("IQ3XXS_GRID", "u32", &mut w32(&iq_grids::IQ3XXS_GRID), 8);
    table("IQ3S_GRID", "u32", &mut w32(&iq_grids::IQ3S_GRID), 8);
    s
}
