//! Bit-exactness against llama.cpp's own compiled CPU kernels.
//!
//! The goldens in `tests/ggml_oracle/` were made by `scripts/ggml_oracle.py`, which calls the
//! functions of an installed llama.cpp build (ggml with GGML_NATIVE on an AVX512 x86-64 CPU,
//! gcc 12) through ctypes on random inputs. Every comparison here is on f32 (or f64) BITS, for
//! the kernel this CPU picks and for the scalar reference (the two must agree on any machine).

use std::path::PathBuf;

use ferrolm_quant::{
    dequantize, dot_kernel, dot_kernel_scalar, expert_kernel, ggml_vec, matrix_kernel,
    quantize_activation, KernelOptions, TensorType,
};
use half::f16;

struct Rec {
    kind: String,
    ints: Vec<i64>,
    arrays: Vec<Vec<u8>>,
}

fn read(name: &str) -> Vec<Rec> {
    let path: PathBuf = [env!("CARGO_MANIFEST_DIR"), "tests", "ggml_oracle", name]
        .iter()
        .collect();
    let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(&data[..4], b"GGO1");
    let mut p = 4;
    let u32_at = |p: &mut usize| {
        let v = u32::from_le_bytes(data[*p..*p + 4].try_into().unwrap());
        *p += 4;
        v as usize
    };
    let mut recs = Vec::new();
    while p < data.len() {
        let kl = u32_at(&mut p);
        let kind = String::from_utf8(data[p..p + kl].to_vec()).unwrap();
        p += kl;
        let ni = u32_at(&mut p);
        let ints = (0..ni)
            .map(|i| i64::from_le_bytes(data[p + 8 * i..p + 8 * i + 8].try_into().unwrap()))
            .collect();
        p += 8 * ni;
        let na = u32_at(&mut p);
        let mut arrays = Vec::new();
        for _ in 0..na {
            let l = u32_at(&mut p);
            arrays.push(data[p..p + l].to_vec());
            p += l;
        }
        recs.push(Rec { kind, ints, arrays });
    }
    recs
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn f16s(b: &[u8]) -> Vec<f16> {
    b.chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// The kernels to check: this CPU's pick and the scalar reference. The NEON kernels still
/// follow their own accumulation order (not yet ported to llama.cpp's x86 lane structure), so
/// on aarch64 only the scalar reference is held to the x86 goldens.
fn kernels(t: TensorType) -> Vec<ferrolm_quant::DotKernel> {
    let mut v = vec![dot_kernel_scalar(t).unwrap()];
    let k = dot_kernel(t).unwrap();
    if k.isa() != "neon" && k.isa() != "scalar" {
        v.push(k);
    }
    v
}

fn ty(id: i64) -> TensorType {
    TensorType::from_id(id as u32).unwrap()
}

/// Collects mismatches, then fails with all of them listed.
#[derive(Default)]
struct Failures(Vec<String>);

impl Failures {
    fn check(&mut self, what: impl FnOnce() -> String, got: u32, want: u32) {
        if got != want {
            self.0.push(format!(
                "{}: got {} ({got:#010x}), want {} ({want:#010x})",
                what(),
                f32::from_bits(got),
                f32::from_bits(want)
            ));
        }
    }
    fn finish(self, total: usize) {
        if !self.0.is_empty() {
            for f in self.0.iter().take(400) {
                eprintln!("{f}");
            }
            panic!("{} of {total} checks differ from llama.cpp", self.0.len());
        }
    }
}

#[test]
#[cfg_attr(
    target_arch = "aarch64",
    ignore = "x86 goldens: aarch64 quantizes activations as llama.cpp's ARM build rounds"
)]
fn from_float_matches_llama_cpp() {
    let mut fails = Vec::new();
    let recs = read("from_float.bin");
    for r in &recs {
        assert_eq!(r.kind, "from_float");
        let (t, n) = (ty(r.ints[0]), r.ints[1] as usize);
        let x = f32s(&r.arrays[0]);
        let mut out = vec![0u8; r.arrays[1].len()];
        quantize_activation(t, &x, &mut out).unwrap();
        if out != r.arrays[1] {
            fails.push(format!("{t} n={n}"));
        }
        if t == TensorType::F16 {
            let mut h = vec![f16::ZERO; n];
            ggml_vec::f32_to_f16_row(&x, &mut h);
            let hb: Vec<u8> = h.iter().flat_map(|v| v.to_le_bytes()).collect();
            if hb != r.arrays[1] {
                fails.push(format!("f32_to_f16_row n={n}"));
            }
        }
    }
    assert!(fails.is_empty(), "differ from llama.cpp: {fails:?}");
}

#[test]
fn vec_dot_matches_llama_cpp() {
    check_vec_dots(&read("vec_dot.bin"));
}

/// The block types added later (i-quants, ternary, Q1_0, Q2_0, NVFP4) on random valid blocks:
/// llama.cpp's compiled `to_float` and `vec_dot`.
#[test]
fn later_types_match_llama_cpp() {
    let recs = read("more_types.bin");
    let mut fails = Failures::default();
    let mut total = 0;
    for r in recs.iter().filter(|r| r.kind == "to_float") {
        let (t, n) = (ty(r.ints[0]), r.ints[1] as usize);
        let want = f32s(&r.arrays[1]);
        let mut got = vec![f32::NAN; n];
        dequantize(t, &r.arrays[0], &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            total += 1;
            fails.check(|| format!("{t} to_float [{i}]"), g.to_bits(), w.to_bits());
        }
    }
    fails.finish(total);
    let dots: Vec<Rec> = recs.into_iter().filter(|r| r.kind == "vec_dot").collect();
    assert!(dots.len() >= 13 * 5, "too few vec_dot records");
    check_vec_dots(&dots);
}

fn check_vec_dots(recs: &[Rec]) {
    let mut fails = Failures::default();
    let mut total = 0;
    for r in recs {
        let (t, n) = (ty(r.ints[0]), r.ints[1] as usize);
        let (row, act) = (&r.arrays[0], &r.arrays[1]);
        let want = f32s(&r.arrays[2])[0].to_bits();
        for k in kernels(t) {
            total += 2;
            let got = k.dot(n, row, act).to_bits();
            fails.check(|| format!("{t} {} dot n={n}", k.isa()), got, want);
            let mut out = [0f32; 1];
            k.dot_rows(n, row, row.len(), act, &mut out);
            fails.check(
                || format!("{t} {} dot_rows n={n}", k.isa()),
                out[0].to_bits(),
                want,
            );
        }
    }
    fails.finish(total);
}

/// Several identical rows through `dot_rows` (SIMD kernels run four rows at a time).
#[test]
fn dot_rows_matches_llama_cpp() {
    let recs = read("vec_dot.bin");
    let mut fails = Failures::default();
    let mut total = 0;
    for r in &recs {
        let (t, n) = (ty(r.ints[0]), r.ints[1] as usize);
        let (row, act) = (&r.arrays[0], &r.arrays[1]);
        let want = f32s(&r.arrays[2])[0].to_bits();
        let rows: Vec<u8> = (0..6).flat_map(|_| row.iter().copied()).collect();
        for k in kernels(t) {
            let mut out = [0f32; 6];
            k.dot_rows(n, &rows, row.len(), act, &mut out);
            for (i, o) in out.iter().enumerate() {
                total += 1;
                fails.check(
                    || format!("{t} {} dot_rows[{i}] n={n}", k.isa()),
                    o.to_bits(),
                    want,
                );
            }
        }
    }
    fails.finish(total);
}

/// `dot_rows_multi` against llamafile_sgemm, the path llama.cpp's mul_mat takes for batches.
#[test]
fn dot_rows_multi_matches_llama_cpp_sgemm() {
    let recs = read("sgemm.bin");
    let mut fails = Failures::default();
    let mut total = 0;
    for r in &recs {
        let t = ty(r.ints[0]);
        let (m, nc, k) = (r.ints[1] as usize, r.ints[2] as usize, r.ints[3] as usize);
        let (a, b) = (&r.arrays[0], &r.arrays[1]);
        let want = f32s(&r.arrays[2]);
        for kern in kernels(t) {
            let mut out = vec![0f32; m * nc];
            kern.dot_rows_multi(k, a, a.len() / m, m, b, b.len() / nc, nc, &mut out);
            for (i, (o, w)) in out.iter().zip(&want).enumerate() {
                total += 1;
                fails.check(
                    || format!("{t} {} multi m={m} n={nc} k={k} [{i}]", kern.isa()),
                    o.to_bits(),
                    w.to_bits(),
                );
            }
        }
    }
    fails.finish(total);
}

/// Whole products through llama.cpp's mul_mat in its default configuration: Q4_K, Q4_0,
/// IQ4_NL, MXFP4 and (an AVX512 build) Q2_K weights repacked (its gemm for the first `n - n % 4` columns, its gemv for the rest) and the
/// K-quants' tiled matmul from 8 columns; each compared with the kernel [`matrix_kernel`]
/// hands out for such a tensor (scalar and this CPU's), and column by column for the batch
/// split the CPU backend makes between threads (parts starting at multiples of 4).
#[test]
fn products_match_llama_cpp_default_paths() {
    let recs = read("products.bin");
    let mut fails = Failures::default();
    let mut total = 0;
    for r in &recs {
        assert_eq!(r.kind, "mul_mat");
        let t = ty(r.ints[0]);
        let [k, m, nc, repacked] = [1, 2, 3, 4].map(|i| r.ints[i] as usize);
        let (w, q) = (&r.arrays[0], &r.arrays[1]);
        let want = f32s(&r.arrays[2]);
        let (rb, ab) = (w.len() / m, q.len() / nc);
        for scalar in [true, false] {
            let options = KernelOptions {
                scalar,
                ..Default::default()
            };
            // a tensor of 3 rows is never repacked; one of m (a multiple of 8) is, with AVX2
            // (Q2_K: with AVX512)
            let kern = matrix_kernel(t, if repacked == 1 { m } else { 3 }, &options).unwrap();
            if repacked == 1 && !kern.repacked() {
                #[cfg(target_arch = "x86_64")]
                assert!(
                    !std::arch::is_x86_feature_detected!("avx2")
                        || (t == TensorType::Q2_K
                            && !std::arch::is_x86_feature_detected!("avx512f"))
                );
                continue; // nor does llama.cpp built for this CPU
            }
            let mut out = vec![0f32; m * nc];
            kern.dot_rows_multi(k, w, rb, m, q, ab, nc, &mut out);
            if kern.splits_by_column() {
                // the first part of 4 columns alone, as a thread of the CPU backend takes it
                let part = 4.min(nc);
                let mut head = vec![0f32; m * part];
                kern.dot_rows_multi(k, w, rb, m, q, ab, part, &mut head);
                if nc >= 4 {
                    assert_eq!(head, out[..m * part], "{t}: a part of 4 columns");
                }
            }
            for (i, (o, want)) in out.iter().zip(&want).enumerate() {
                total += 1;
                fails.check(
                    || format!("{t} {} repacked={repacked} m={m} n={nc} [{i}]", kern.isa()),
                    o.to_bits(),
                    want.to_bits(),
                );
            }
        }
    }
    fails.finish(total);
}

/// Expert products through llama.cpp's mul_mat_id with the 3-D weights repacked (its gemv
/// for every routed row), each expert's tokens as ferrolm's MoE layers give them to the
/// kernel [`expert_kernel`] hands out: as one batch, and one token at a time.
#[test]
fn expert_products_match_llama_cpp_repacked() {
    let recs = read("products_id.bin");
    let mut fails = Failures::default();
    let mut total = 0;
    for r in &recs {
        assert_eq!(r.kind, "mul_mat_id");
        let t = ty(r.ints[0]);
        let [k, m, n_expert, n_used, n_tok] = [1, 2, 3, 4, 5].map(|i| r.ints[i] as usize);
        let (w, q) = (&r.arrays[0], &r.arrays[1]);
        let ids: Vec<usize> = r.arrays[2]
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()) as usize)
            .collect();
        let want = f32s(&r.arrays[3]);
        let (rb, ab) = (w.len() / (n_expert * m), q.len() / n_tok);
        for scalar in [true, false] {
            let options = KernelOptions {
                scalar,
                ..Default::default()
            };
            let kern = expert_kernel(t, m, &options).unwrap();
            if !kern.repacked() {
                #[cfg(target_arch = "x86_64")]
                assert!(
                    !std::arch::is_x86_feature_detected!("avx2")
                        || (t == TensorType::Q2_K
                            && !std::arch::is_x86_feature_detected!("avx512f"))
                );
                continue; // nor does llama.cpp built for this CPU
            }
            for e in 0..n_expert {
                let rows = &w[e * m * rb..(e + 1) * m * rb];
                // the (token, slot) pairs routed to expert e, their columns side by side
                let routed: Vec<usize> = (0..n_tok * n_used).filter(|&p| ids[p] == e).collect();
                let acts: Vec<u8> = routed
                    .iter()
                    .flat_map(|&p| q[p / n_used * ab..(p / n_used + 1) * ab].to_vec())
                    .collect();
                let mut batch = vec![0f32; m * routed.len()];
                kern.dot_rows_multi(k, rows, rb, m, &acts, ab, routed.len(), &mut batch);
                for (c, &p) in routed.iter().enumerate() {
                    let mut one = vec![0f32; m];
                    kern.dot_rows(k, rows, rb, &acts[c * ab..(c + 1) * ab], &mut one);
                    for i in 0..m {
                        let want = want[p * m + i].to_bits();
                        let what =
                            || format!("{t} {} m={m} n={n_tok} expert {e} [{p}, {i}]", kern.isa());
                        total += 2;
                        fails.check(what, batch[c * m + i].to_bits(), want);
                        fails.check(|| format!("{} alone", what()), one[i].to_bits(), want);
                    }
                }
            }
        }
    }
    // (llama.cpp repacks the experts for x86 with AVX2 only: elsewhere nothing is compared)
    #[cfg(target_arch = "x86_64")]
    assert!(total > 0 || !std::arch::is_x86_feature_detected!("avx2"));
    fails.finish(total);
}

#[test]
fn vec_functions_match_llama_cpp() {
    let recs = read("vec.bin");
    let mut fails = Failures::default();
    let mut total = 0;
    for r in &recs {
        let n = r.ints[0] as usize;
        match r.kind.as_str() {
            "swiglu" => {
                let (g, u, want) = (f32s(&r.arrays[0]), f32s(&r.arrays[1]), f32s(&r.arrays[2]));
                let mut out = vec![0f32; n];
                ggml_vec::swiglu(&g, &u, &mut out);
                for i in 0..n {
                    total += 1;
                    fails.check(
                        || format!("swiglu n={n} [{i}] g={}", g[i]),
                        out[i].to_bits(),
                        want[i].to_bits(),
                    );
                }
            }
            "silu" => {
                let (x, want) = (f32s(&r.arrays[0]), f32s(&r.arrays[1]));
                let mut out = vec![0f32; n];
                ggml_vec::silu(&x, &mut out);
                for i in 0..n {
                    total += 1;
                    fails.check(
                        || format!("silu n={n} [{i}] x={}", x[i]),
                        out[i].to_bits(),
                        want[i].to_bits(),
                    );
                }
            }
            "soft_max" => {
                let x = f32s(&r.arrays[0]);
                let max = f32s(&r.arrays[1])[0];
                let want = f32s(&r.arrays[2]);
                let want_sum = f64::from_le_bytes(r.arrays[3][..8].try_into().unwrap());
                let mut out = vec![0f32; n];
                let sum = ggml_vec::soft_max(&x, &mut out, max);
                for i in 0..n {
                    total += 1;
                    fails.check(
                        || format!("soft_max n={n} [{i}] x-max={}", x[i] - max),
                        out[i].to_bits(),
                        want[i].to_bits(),
                    );
                }
                total += 1;
                if sum.to_bits() != want_sum.to_bits() {
                    fails
                        .0
                        .push(format!("soft_max n={n} sum {sum} != {want_sum}"));
                }
            }
            "dot_f16" => {
                let (x, y) = (f16s(&r.arrays[0]), f16s(&r.arrays[1]));
                let want = f32s(&r.arrays[2])[0];
                total += 1;
                fails.check(
                    || format!("dot_f16 n={n}"),
                    ggml_vec::dot_f16(&x, &y).to_bits(),
                    want.to_bits(),
                );
            }
            k => panic!("unknown record {k}"),
        }
    }
    fails.finish(total);
}

#[test]
#[cfg_attr(
    target_arch = "aarch64",
    ignore = "x86 goldens: gelu(-inf) is a NaN whose sign bit differs between x86 and ARM"
)]
fn gelu_table_matches_llama_cpp() {
    let recs = read("gelu.bin");
    let want: Vec<u16> = recs[0].arrays[0]
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect();
    assert_eq!(want.len(), 65536);
    let table = ggml_vec::gelu_f16_table();
    let mut fails = Failures::default();
    for (i, &w) in want.iter().enumerate() {
        fails.check(
            || format!("gelu table [{i:#06x}] x={}", f16::from_bits(i as u16)),
            u32::from(table[i].to_bits()),
            u32::from(w),
        );
    }
    fails.finish(want.len());
    // geglu: the table inside (-10, 10), the edges outside.
    let g = [-11.0f32, -10.0, -0.5, 0.0, 0.3, 2.0, 9.99, 10.0, 12.0];
    let u = [2.0f32; 9];
    let mut out = [0f32; 9];
    ggml_vec::geglu(&g, &u, &mut out);
    assert_eq!(out[0], 0.0);
    assert_eq!(out[1], 0.0);
    assert_eq!(out[7], 20.0);
    assert_eq!(out[8], 24.0);
    let t = |x: f32| f16::from_bits(want[f16::from_f32(x).to_bits() as usize]).to_f32();
    assert_eq!(out[2], t(-0.5) * 2.0);
    assert_eq!(out[5], t(2.0) * 2.0);
}
