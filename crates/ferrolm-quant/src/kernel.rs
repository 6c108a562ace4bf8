//! Dot-product kernels: the scalar references, and the pick of a SIMD kernel for this CPU.

use std::fmt;
use std::sync::OnceLock;

use crate::{
    float, iq, iq1, iq2, iq3, k_quants, legacy, low_bit, repack, ternary, tiled, vec_dot_type,
    QuantError, TensorType,
};

/// `dot(n, row, act)`: `row` and `act` are exactly the bytes of `n` elements.
pub(crate) type DotFn = fn(usize, &[u8], &[u8]) -> f32;
/// `rows(n, rows, row_stride, act, out)`: `out[i] = dot(row i, act)`; `rows` ends exactly at
/// the end of the last row and `act` is exactly `n` elements.
pub(crate) type RowsFn = fn(usize, &[u8], usize, &[u8], &mut [f32]);

/// `multi(n, rows, row_stride, n_rows, acts, act_stride, n_cols, out)`, lengths checked.
pub(crate) type MultiFn = fn(usize, &[u8], usize, usize, &[u8], usize, usize, &mut [f32]);

/// What a SIMD module offers for one weight type.
pub(crate) struct Simd {
    pub dot: DotFn,
    pub rows: Option<RowsFn>,
    pub multi: Option<MultiFn>,
}

/// The instruction sets a kernel can be written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Isa {
    Scalar,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    Avx2,
    #[cfg_attr(not(target_arch = "aarch64"), allow(dead_code))]
    Neon,
}

impl Isa {
    fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Neon => "neon",
        }
    }
}

/// The best instruction set of this CPU, detected once per process.
fn detected_isa() -> Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            if std::arch::is_aarch64_feature_detected!("neon") {
                return Isa::Neon;
            }
        }
        Isa::Scalar
    })
}

/// Which kernels to hand out: the scalar references or this CPU's, and which of llama.cpp's
/// CPU matrix-product paths to mirror. llama.cpp takes both paths by default; its two
/// switches turn them off (`use_extra_bufts = false` in `llama_model_params`, the environment
/// variable `GGML_CPU_TILED_MM=0`), and ferrolm's goldens exist for both configurations
/// (docs/PARITY.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelOptions {
    /// Only the scalar reference kernels (the same bits, slower): what every SIMD kernel is
    /// tested against.
    pub scalar: bool,
    /// Mirror llama.cpp's CPU_REPACK products where it repacks a weight on this CPU (Q4_K,
    /// Q4_0, IQ4_NL and MXFP4 matrices with a multiple of 8 rows, on x86-64 with AVX2; Q2_K
    /// ones with AVX512; see [`matrix_kernel`]).
    pub repack: bool,
    /// Mirror llama.cpp's tiled matmul for products of 8 or more activation columns (Q2_K..Q6_K,
    /// the 256-element i-quants and IQ4_XS, when not repacked).
    pub tiled: bool,
}

impl Default for KernelOptions {
    /// This CPU's kernels, both of llama.cpp's paths mirrored, as llama.cpp runs by default.
    fn default() -> Self {
        KernelOptions {
            scalar: false,
            repack: true,
            tiled: true,
        }
    }
}

impl KernelOptions {
    /// llama.cpp with both its repacking and its tiled matmul off: `vec_dot` (and llamafile's
    /// tinyBLAS where it applies) for every product.
    pub const PLAIN: KernelOptions = KernelOptions {
        scalar: false,
        repack: false,
        tiled: false,
    };

    fn isa(&self) -> Isa {
        if self.scalar {
            Isa::Scalar
        } else {
            detected_isa()
        }
    }
}

/// A dot-product kernel for rows of one weight type against activations of its
/// [`vec_dot_type`](crate::vec_dot_type), chosen for this CPU.
///
/// Contract for every method: `n` is a multiple of the weight type's block size, `row` (each
/// row) holds at least the bytes of `n` weight elements and `act` at least the bytes of `n`
/// activation elements, and activations are quantized by this crate (Q8 quants in -127..=127).
/// Callers validate user input before; a violated length contract panics.
#[derive(Clone, Copy)]
pub struct DotKernel {
    ty: TensorType,
    act_ty: TensorType,
    block_size: usize,
    row_block_bytes: usize,
    act_block_size: usize,
    act_block_bytes: usize,
    dot: DotFn,
    rows: Option<RowsFn>,
    multi: Option<MultiFn>,
    /// llama.cpp's tiled matmul, for batches of [`tiled::MIN_COLUMNS`] columns or more.
    tiled: Option<MultiFn>,
    isa: Isa,
    splits: bool,
    repacked: bool,
}

impl fmt::Debug for DotKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DotKernel")
            .field("ty", &self.ty)
            .field("act_ty", &self.act_ty)
            .field("isa", &self.isa.name())
            .field("repacked", &self.repacked)
            .finish()
    }
}

impl DotKernel {
    #[inline(always)]
    fn sizes(&self, n: usize) -> (usize, usize) {
        assert!(
            n.is_multiple_of(self.block_size),
            "{}: n = {n} is not a multiple of the block size {}",
            self.ty,
            self.block_size
        );
        // A weight block spans one or more activation blocks (Q1_0: 128 over four Q8_0s).
        (
            n / self.block_size * self.row_block_bytes,
            n / self.act_block_size * self.act_block_bytes,
        )
    }

    /// Dot of one weight row (`n` elements, GGUF bytes of the weight type) with an activation
    /// vector already quantized to the activation type (`n` elements).
    #[inline]
    pub fn dot(&self, n: usize, row: &[u8], act: &[u8]) -> f32 {
        let (rb, ab) = self.sizes(n);
        assert!(
            row.len() >= rb,
            "{}: row has {} bytes, needs {rb}",
            self.ty,
            row.len()
        );
        assert!(
            act.len() >= ab,
            "{}: activation has {} bytes, needs {ab}",
            self.act_ty,
            act.len()
        );
        (self.dot)(n, &row[..rb], &act[..ab])
    }

    /// `out[i] = dot(row i, act)` for `out.len()` rows starting every `row_stride` bytes of
    /// `rows`. SIMD kernels may process several rows at a time to reuse activation loads.
    pub fn dot_rows(&self, n: usize, rows: &[u8], row_stride: usize, act: &[u8], out: &mut [f32]) {
        let (rb, ab) = self.sizes(n);
        if out.is_empty() {
            return;
        }
        assert!(
            row_stride >= rb,
            "{}: row stride {row_stride} < row bytes {rb}",
            self.ty
        );
        let need = (out.len() - 1) * row_stride + rb;
        assert!(
            rows.len() >= need,
            "{}: rows have {} bytes, need {need}",
            self.ty,
            rows.len()
        );
        assert!(
            act.len() >= ab,
            "{}: activation has {} bytes, needs {ab}",
            self.act_ty,
            act.len()
        );
        let (rows, act) = (&rows[..need], &act[..ab]);
        match self.rows {
            Some(f) => f(n, rows, row_stride, act, out),
            None => {
                for (i, o) in out.iter_mut().enumerate() {
                    *o = (self.dot)(n, &rows[i * row_stride..i * row_stride + rb], act);
                }
            }
        }
    }

    /// Several activation columns at once (prompt processing): for each column `c` of
    /// `n_cols` (starting every `act_stride` bytes of `acts`) and each of `n_rows` rows,
    /// `out[c * n_rows + i] = dot(row i, column c)`. Each weight row is read once per group
    /// of columns while it is hot in cache.
    ///
    /// Every element is bit-identical to what llama.cpp's `ggml_compute_forward_mul_mat`
    /// computes for the same product on an AVX512 x86-64 build (GGML_NATIVE, default
    /// options, weights in a plain CPU buffer), on any CPU:
    /// * one column: `vec_dot` (as [`DotKernel::dot`]);
    /// * Q8_0, Q4_0, Q5_0, IQ4_NL with >= 2 columns: llamafile_sgemm's `tinyBLAS_Q0_AVX`,
    ///   which per element is one 8-lane FMA accumulator over the blocks and `hsum` -- the
    ///   same as `vec_dot` for Q8_0/Q4_0/Q5_0, but not for IQ4_NL (whose `vec_dot` pairs
    ///   blocks into two accumulators);
    /// * F32, F16, BF16 with >= 2 columns, `n` a multiple of 16 (32 for BF16) and `n_rows` a
    ///   multiple of 4: llamafile_sgemm's `tinyBLAS<16, __m512>` (one 16-lane FMA accumulator,
    ///   `vdpbf16ps` pairs for BF16, then `_mm512_reduce_add_ps`); otherwise `vec_dot`. A
    ///   caller splitting a matrix between threads must keep the row count of each part a
    ///   multiple of 4 to get llama.cpp's choice, which is made for the whole matrix;
    /// * with [`KernelOptions::tiled`], Q2_K..Q6_K, the 256-element i-quants and IQ4_XS with >= 8
    ///   columns: llama.cpp's tiled matmul (crate docs); a repacked kernel
    ///   ([`DotKernel::repacked`]): llama.cpp's CPU_REPACK gemm for the first `n_cols - n_cols %
    ///   4` columns and its gemv for the rest (for Q4_0, IQ4_NL and MXFP4 the two agree per element);
    /// * every other type: `vec_dot` per element (Q4_1, Q5_1 and the K-quants are not taken by
    ///   llamafile_sgemm).
    #[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
    pub fn dot_rows_multi(
        &self,
        n: usize,
        rows: &[u8],
        row_stride: usize,
        n_rows: usize,
        acts: &[u8],
        act_stride: usize,
        n_cols: usize,
        out: &mut [f32],
    ) {
        let (rb, ab) = self.sizes(n);
        if n_rows == 0 || n_cols == 0 {
            return;
        }
        assert!(
            out.len() >= n_rows * n_cols,
            "output has {} < {n_rows} x {n_cols}",
            out.len()
        );
        assert!(
            row_stride >= rb && act_stride >= ab,
            "strides shorter than one row"
        );
        let need_r = (n_rows - 1) * row_stride + rb;
        let need_a = (n_cols - 1) * act_stride + ab;
        assert!(
            rows.len() >= need_r,
            "{}: rows have {} bytes, need {need_r}",
            self.ty,
            rows.len()
        );
        assert!(
            acts.len() >= need_a,
            "{}: acts have {} bytes, need {need_a}",
            self.act_ty,
            acts.len()
        );
        if n_cols == 1 {
            return self.dot_rows(n, rows, row_stride, acts, &mut out[..n_rows]);
        }
        if let Some(kind) = float::float_kind(self.ty) {
            if float::tinyblas_applies(kind, n, n_rows, n_cols) {
                // The scalar kernel keeps to the scalar definition (the reference the tests
                // compare the SIMD tiles with).
                let batch = match self.isa {
                    Isa::Scalar => float::tinyblas_body,
                    _ => float::tinyblas,
                };
                return batch(
                    kind,
                    n,
                    &rows[..need_r],
                    row_stride,
                    n_rows,
                    &acts[..need_a],
                    act_stride,
                    n_cols,
                    out,
                );
            }
        }
        let batch = match self.tiled {
            Some(tiled) if n_cols >= tiled::MIN_COLUMNS => Some(tiled),
            _ => self.multi,
        };
        if let Some(f) = batch {
            return f(
                n,
                &rows[..need_r],
                row_stride,
                n_rows,
                &acts[..need_a],
                act_stride,
                n_cols,
                out,
            );
        }
        for i in 0..n_rows {
            let row = &rows[i * row_stride..i * row_stride + rb];
            for c in 0..n_cols {
                let act = &acts[c * act_stride..c * act_stride + ab];
                out[c * n_rows + i] = (self.dot)(n, row, act);
            }
        }
    }

    /// Name of the implementation picked ("avx2", "neon", "scalar") for benchmarks and logs.
    pub fn isa(&self) -> &'static str {
        self.isa.name()
    }

    /// Whether a batch may be split by columns between threads, each part starting at a
    /// multiple of 4 columns and given to [`DotKernel::dot_rows_multi`] alone, with the same
    /// results as the whole batch; false where llama.cpp's choice depends on the whole batch
    /// (the tiled kernels, the float and IQ4_NL tiles).
    pub fn splits_by_column(&self) -> bool {
        self.splits
    }

    /// Whether this kernel mirrors llama.cpp's repacked (CPU_REPACK) products ([`matrix_kernel`]).
    pub fn repacked(&self) -> bool {
        self.repacked
    }

    /// The weight type of the rows.
    pub fn weight_type(&self) -> TensorType {
        self.ty
    }

    /// The type the activation vector must be quantized to ([`vec_dot_type`] of the weights).
    pub fn activation_type(&self) -> TensorType {
        self.act_ty
    }
}

fn scalar_fn(ty: TensorType) -> Option<DotFn> {
    use TensorType as T;
    Some(match ty {
        T::F32 => float::dot_f32,
        T::F16 => float::dot_f16,
        T::BF16 => float::dot_bf16,
        T::Q4_0 => legacy::dot_q4_0_q8_0,
        T::Q4_1 => legacy::dot_q4_1_q8_1,
        T::Q5_0 => legacy::dot_q5_0_q8_0,
        T::Q5_1 => legacy::dot_q5_1_q8_1,
        T::Q8_0 => legacy::dot_q8_0_q8_0,
        T::Q2_K => k_quants::dot_q2_k_q8_k,
        T::Q3_K => k_quants::dot_q3_k_q8_k,
        T::Q4_K => k_quants::dot_q4_k_q8_k,
        T::Q5_K => k_quants::dot_q5_k_q8_k,
        T::Q6_K => k_quants::dot_q6_k_q8_k,
        T::IQ4_NL => iq::dot_iq4_nl_q8_0,
        T::MXFP4 => iq::dot_mxfp4_q8_0,
        T::NVFP4 => iq::dot_nvfp4_q8_0,
        T::IQ4_XS => iq::dot_iq4_xs_q8_k,
        T::IQ2_XXS => iq2::dot_iq2_xxs_q8_k,
        T::IQ2_XS => iq2::dot_iq2_xs_q8_k,
        T::IQ2_S => iq2::dot_iq2_s_q8_k,
        T::IQ3_XXS => iq3::dot_iq3_xxs_q8_k,
        T::IQ3_S => iq3::dot_iq3_s_q8_k,
        T::IQ1_S => iq1::dot_iq1_s_q8_k,
        T::IQ1_M => iq1::dot_iq1_m_q8_k,
        T::TQ1_0 => ternary::dot_tq1_0_q8_k,
        T::TQ2_0 => ternary::dot_tq2_0_q8_k,
        T::Q1_0 => low_bit::dot_q1_0_q8_0,
        T::Q2_0 => low_bit::dot_q2_0_q8_0,
        _ => return None,
    })
}

/// The tiled matmul's batch kernel for `ty` (llama.cpp's from 8 columns, see `tiled`), if it
/// has one; `fast` computes the exact integer block sums with AVX2 where the CPU has it, with
/// the columns in the lanes of AVX512-VNNI where it has that (`avx2::tiled512`).
fn tiled_fn(ty: TensorType, fast: bool) -> Option<MultiFn> {
    use TensorType as T;
    #[cfg(target_arch = "x86_64")]
    let fast = fast && matches!(detected_isa(), Isa::Avx2);
    // `$simd` unpacks with AVX2 where there is such a function (else the scalar `$unpack`)
    macro_rules! tiled {
        ($ty:expr, $unpack:path, $dot:path) => {
            tiled!($ty, $unpack, $unpack, $dot)
        };
        ($ty:expr, $unpack:path, $simd:expr, $dot:path) => {{
            let (scalar, simd): (MultiFn, MultiFn) = (
                |n, rows, rs, nr, acts, as_, nc, out| {
                    let (bytes, sum) = ($ty.block_bytes(), tiled::block_step);
                    tiled::multi(
                        $unpack, bytes, $dot, sum, n, rows, rs, nr, acts, as_, nc, out,
                    )
                },
                |n, rows, rs, nr, acts, as_, nc, out| {
                    let (bytes, sum) = ($ty.block_bytes(), simd_block_step());
                    tiled::multi($simd, bytes, $dot, sum, n, rows, rs, nr, acts, as_, nc, out)
                },
            );
            #[cfg(target_arch = "x86_64")]
            if fast && crate::avx2::has_avx512_vnni() {
                return Some(|n, rows, rs, nr, acts, as_, nc, out| {
                    let bytes = $ty.block_bytes();
                    crate::avx2::tiled512::multi(
                        $simd, bytes, $dot, n, rows, rs, nr, acts, as_, nc, out,
                    )
                });
            }
            if fast {
                simd
            } else {
                scalar
            }
        }};
    }
    // the AVX2 unpacking on x86-64, the scalar one elsewhere
    #[cfg(target_arch = "x86_64")]
    macro_rules! avx2_or {
        ($avx2:ident, $scalar:path) => {
            crate::avx2::$avx2
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    macro_rules! avx2_or {
        ($avx2:ident, $scalar:path) => {
            $scalar
        };
    }
    Some(match ty {
        // below 8 columns these use the scalar `vec_dot`, as the tiled kernels are rare there
        T::Q2_K => tiled!(
            T::Q2_K,
            k_quants::tiled_q2_k,
            avx2_or!(tiled_q2_k, k_quants::tiled_q2_k),
            k_quants::dot_q2_k_q8_k
        ),
        T::Q3_K => tiled!(
            T::Q3_K,
            k_quants::tiled_q3_k,
            avx2_or!(tiled_q3_k, k_quants::tiled_q3_k),
            k_quants::dot_q3_k_q8_k
        ),
        T::Q4_K => tiled!(
            T::Q4_K,
            k_quants::tiled_q4_k,
            avx2_or!(tiled_q4_k, k_quants::tiled_q4_k),
            k_quants::dot_q4_k_q8_k
        ),
        T::Q5_K => tiled!(
            T::Q5_K,
            k_quants::tiled_q5_k,
            avx2_or!(tiled_q5_k, k_quants::tiled_q5_k),
            k_quants::dot_q5_k_q8_k
        ),
        T::Q6_K => tiled!(T::Q6_K, k_quants::tiled_q6_k, k_quants::dot_q6_k_q8_k),
        T::IQ4_XS => tiled!(
            T::IQ4_XS,
            iq::tiled_iq4_xs,
            avx2_or!(tiled_iq4_xs, iq::tiled_iq4_xs),
            iq::dot_iq4_xs_q8_k
        ),
        T::IQ2_XXS => tiled!(
            T::IQ2_XXS,
            iq2::tiled_iq2_xxs,
            avx2_or!(tiled_iq2_xxs, iq2::tiled_iq2_xxs),
            iq2::dot_iq2_xxs_q8_k
        ),
        T::IQ2_XS => tiled!(
            T::IQ2_XS,
            iq2::tiled_iq2_xs,
            avx2_or!(tiled_iq2_xs, iq2::tiled_iq2_xs),
            iq2::dot_iq2_xs_q8_k
        ),
        T::IQ2_S => tiled!(
            T::IQ2_S,
            iq2::tiled_iq2_s,
            avx2_or!(tiled_iq2_s, iq2::tiled_iq2_s),
            iq2::dot_iq2_s_q8_k
        ),
        T::IQ3_XXS => tiled!(
            T::IQ3_XXS,
            iq3::tiled_iq3_xxs,
            avx2_or!(tiled_iq3_xxs, iq3::tiled_iq3_xxs),
            iq3::dot_iq3_xxs_q8_k
        ),
        T::IQ3_S => tiled!(
            T::IQ3_S,
            iq3::tiled_iq3_s,
            avx2_or!(tiled_iq3_s, iq3::tiled_iq3_s),
            iq3::dot_iq3_s_q8_k
        ),
        T::IQ1_S => tiled!(
            T::IQ1_S,
            iq1::tiled_iq1_s,
            avx2_or!(tiled_iq1_s, iq1::tiled_iq1_s),
            iq1::dot_iq1_s_q8_k
        ),
        T::IQ1_M => tiled!(
            T::IQ1_M,
            iq1::tiled_iq1_m,
            avx2_or!(tiled_iq1_m, iq1::tiled_iq1_m),
            iq1::dot_iq1_m_q8_k
        ),
        _ => return None,
    })
}

/// The tiled kernel's block step in this CPU's instructions.
fn simd_block_step() -> tiled::BlockStep {
    #[cfg(target_arch = "x86_64")]
    if matches!(detected_isa(), Isa::Avx2) {
        // (with AVX512-VNNI the whole batch is `avx2::tiled512::multi`)
        return crate::avx2::tiled_block_step;
    }
    tiled::block_step
}

/// Whether a batch of `ty` may be split by columns (tokens) between threads: the quantized
/// types whose batched outputs equal their single dots bit for bit; not the float and IQ4_NL
/// ones (llamafile's tiles over the rows), nor a tiled kernel (its choice is made on the whole
/// batch).
fn splits_by_column(ty: TensorType, tiled: bool) -> bool {
    use TensorType as T;
    !tiled
        && matches!(
            ty,
            T::Q4_0
                | T::Q4_1
                | T::Q5_0
                | T::Q5_1
                | T::Q8_0
                | T::Q2_K
                | T::Q3_K
                | T::Q4_K
                | T::Q5_K
                | T::Q6_K
                | T::TQ1_0
                | T::TQ2_0
                | T::Q1_0
                | T::Q2_0
                | T::NVFP4
        )
}

fn build(ty: TensorType, options: &KernelOptions) -> Result<DotKernel, QuantError> {
    let unsupported = QuantError::Unsupported {
        ty,
        op: "dot product",
    };
    let act_ty = vec_dot_type(ty)?;
    let scalar = scalar_fn(ty).ok_or(unsupported)?;
    let isa = options.isa();
    let simd: Option<Simd> = match isa {
        Isa::Scalar => None,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => crate::avx2::kernel(ty),
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => crate::neon::kernel(ty),
        #[allow(unreachable_patterns)]
        _ => None,
    };
    let tiled = if options.tiled {
        tiled_fn(ty, simd.is_some())
    } else {
        None
    };
    // IQ4_NL's batches follow llamafile's order, not its vec_dot's
    let plain_batch = (ty == TensorType::IQ4_NL).then_some(iq::multi_iq4_nl_q8_0 as MultiFn);
    let (Simd { dot, rows, multi }, isa) = match simd {
        Some(simd) => (
            Simd {
                multi: simd.multi.or(plain_batch),
                ..simd
            },
            isa,
        ),
        None => (
            Simd {
                dot: scalar,
                rows: None,
                multi: plain_batch,
            },
            Isa::Scalar,
        ),
    };
    debug_assert!(ty.block_size().is_multiple_of(act_ty.block_size()));
    Ok(DotKernel {
        ty,
        act_ty,
        block_size: ty.block_size(),
        row_block_bytes: ty.block_bytes(),
        act_block_size: act_ty.block_size(),
        act_block_bytes: act_ty.block_bytes(),
        dot,
        rows,
        multi,
        tiled,
        isa,
        splits: splits_by_column(ty, tiled.is_some()),
        repacked: false,
    })
}

/// The kernel of a repacked Q4_K, Q2_K, Q4_0, IQ4_NL or MXFP4 matrix (`repack`).
fn build_repacked(ty: TensorType, options: &KernelOptions) -> Result<DotKernel, QuantError> {
    let plain = build(ty, options)?;
    let (dot, rows, multi): (DotFn, Option<RowsFn>, MultiFn) = match (ty, plain.isa) {
        (TensorType::Q4_0, isa) => b32_repacked::<repack::Q4_0>(isa),
        (TensorType::IQ4_NL, isa) => b32_repacked::<repack::Iq4Nl>(isa),
        (TensorType::MXFP4, isa) => b32_repacked::<repack::Mxfp4>(isa),
        (TensorType::Q2_K, isa) => q2_k_repacked(isa),
        #[cfg(target_arch = "x86_64")]
        (_, Isa::Avx2) => (
            crate::avx2::repack_dot_q4_k,
            Some(crate::avx2::repack_rows_q4_k),
            crate::avx2::repack_multi_q4_k,
        ),
        (_, _) => (
            |n, row, act| repack::dot_k(repack::pair_sums, n, row, act),
            None,
            |n, rows, rs, nr, acts, as_, nc, out| {
                repack::multi_k(repack::pair_sums, n, rows, rs, nr, acts, as_, nc, out)
            },
        ),
    };
    Ok(DotKernel {
        dot,
        rows,
        multi: Some(multi),
        tiled: None,
        splits: true,
        repacked: true,
        ..plain
    })
}

/// The functions of a repacked Q2_K matrix for `isa`.
fn q2_k_repacked(isa: Isa) -> (DotFn, Option<RowsFn>, MultiFn) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        use crate::avx2::repack_q2k;
        return (repack_q2k::dot, Some(repack_q2k::rows), repack_q2k::multi);
    }
    let _ = isa; // the scalar reference for every other instruction set
    (
        |n, row, act| repack::dot_k(repack::half_sums_q2_k, n, row, act),
        None,
        |n, rows, rs, nr, acts, as_, nc, out| {
            repack::multi_k(repack::half_sums_q2_k, n, rows, rs, nr, acts, as_, nc, out)
        },
    )
}

/// The functions of a repacked Q4_0, IQ4_NL or MXFP4 matrix for `isa`.
fn b32_repacked<V: repack::Nibbles>(isa: Isa) -> (DotFn, Option<RowsFn>, MultiFn) {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        use crate::avx2::repack_b32;
        return (
            repack_b32::dot::<V>,
            Some(repack_b32::rows::<V>),
            repack_b32::multi::<V>,
        );
    }
    let _ = isa; // the scalar reference for every other instruction set
    (repack::dot_b32::<V>, None, repack::multi_b32::<V>)
}

/// A dot-product kernel for rows of `ty`, chosen once at run time for this CPU (AVX2+FMA+F16C
/// on x86-64 when detected, NEON on aarch64, scalar otherwise or for types without a SIMD
/// kernel), mirroring llama.cpp's tiled matmul by default. [`DotKernel::isa`] says which.
pub fn dot_kernel(ty: TensorType) -> Result<DotKernel, QuantError> {
    build(ty, &KernelOptions::default())
}

/// The scalar reference kernel for the same contract, following ggml's integer arithmetic;
/// what the SIMD kernels are tested against.
pub fn dot_kernel_scalar(ty: TensorType) -> Result<DotKernel, QuantError> {
    build(
        ty,
        &KernelOptions {
            scalar: true,
            ..Default::default()
        },
    )
}

/// A kernel for rows of `ty` as `options` say, for products whose weights llama.cpp keeps as
/// they are (a token embedding, the tensor of a single expert): no repacking (3-D expert
/// tensors: [`expert_kernel`]).
pub fn dot_kernel_with(ty: TensorType, options: &KernelOptions) -> Result<DotKernel, QuantError> {
    build(ty, options)
}

/// The kernel for the products of one expert of a 3-D expert tensor of `ty` (more than one
/// expert) with `rows` rows per expert, as `options` say. llama.cpp repacks such a tensor
/// under the same conditions as a 2-D one ([`matrix_kernel`]) and its `mul_mat_id` then runs
/// the gemv for every routed row, whatever the batch: there every element is the gemv's (for
/// Q4_0, IQ4_NL and MXFP4 the gemm's too; for Q4_K and Q2_K not); elsewhere
/// [`dot_kernel_with`].
pub fn expert_kernel(
    ty: TensorType,
    rows: usize,
    options: &KernelOptions,
) -> Result<DotKernel, QuantError> {
    if !(options.repack && repack::mirrors(ty, rows)) {
        return build(ty, options);
    }
    let kernel = build_repacked(ty, options)?;
    // no gemm: a batch is the gemv's, column by column (or, scalar, `dot` per element)
    let multi = match ty {
        TensorType::Q4_K | TensorType::Q2_K => gemv_columns(ty, kernel.isa),
        _ => kernel.multi,
    };
    Ok(DotKernel { multi, ..kernel })
}

/// A batch of repacked Q4_K or Q2_K rows as the gemv's rows, one column at a time, for `isa`.
fn gemv_columns(ty: TensorType, isa: Isa) -> Option<MultiFn> {
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx2 {
        /// `rows` for each column.
        #[allow(clippy::too_many_arguments)] // two strided matrices and their shapes
        fn columns<const Q2: bool>(
            n: usize,
            rows: &[u8],
            row_stride: usize,
            n_rows: usize,
            acts: &[u8],
            act_stride: usize,
            n_cols: usize,
            out: &mut [f32],
        ) {
            let gemv: RowsFn = if Q2 {
                crate::avx2::repack_q2k::rows
            } else {
                crate::avx2::repack_rows_q4_k
            };
            for c in 0..n_cols {
                let out = &mut out[c * n_rows..(c + 1) * n_rows];
                gemv(n, rows, row_stride, &acts[c * act_stride..], out);
            }
        }
        return Some(if ty == TensorType::Q2_K {
            columns::<true>
        } else {
            columns::<false>
        });
    }
    let _ = (ty, isa);
    None
}

/// The kernel for the products of a 2-D weight tensor of `ty` with `rows` rows (its whole
/// row count, also for a view of some of its rows), as `options` say: where llama.cpp built
/// for this CPU repacks such a tensor at load and ferrolm mirrors it ([`KernelOptions::repack`];
/// Q4_K, Q4_0, IQ4_NL and MXFP4 with AVX2, Q2_K with AVX512), its gemv/gemm arithmetic ([`DotKernel::repacked`]); otherwise
/// [`dot_kernel_with`].
pub fn matrix_kernel(
    ty: TensorType,
    rows: usize,
    options: &KernelOptions,
) -> Result<DotKernel, QuantError> {
    if options.repack && repack::mirrors(ty, rows) {
        build_repacked(ty, options)
    } else {
        build(ty, options)
    }
}
