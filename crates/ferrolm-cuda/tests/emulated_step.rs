//! The decode step's launch list run on the CPU: each launch's arguments read by position as its
//! kernel reads them, each kernel's work done by plain host code (the products with the CPU's
//! own quantization and dot kernels), and the logits of every position compared with the CPU
//! model's. CI has no GPU; this checks what the host side decides — which kernels, in which
//! order, on which buffers, with which sizes and scalars — so that a wiring mistake (a buffer
//! swapped, an argument out of place, a norm left out) fails here and not only on the device.
//! What it cannot check is the kernels' own arithmetic (`cuda-check` on a GPU does that).

mod host_math;

use std::collections::HashMap;
use std::sync::Arc;

use host_math::{mean_kl, relative_difference, swiglu_oai, DeltaShape, Rope, Routing};

use ferrolm_cuda::cpu_tier::CpuExperts;
use ferrolm_cuda::schedule::{
    decode_plan_layers, decode_plan_with, Activations, Arg, Buf, DecodePlan, Launch, MATVEC_ROWS,
    MIXED_QKV, TOKEN_RING,
};
use ferrolm_cuda::CudaTuning;
use ferrolm_gguf::{GgufFile, TensorType};
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Logits, Model};

/// Host copies of the step's buffers.
struct Emulator<'f> {
    file: &'f GgufFile,
    plan: &'f DecodePlan,
    f32s: HashMap<Buf, Vec<f32>>,
    u32s: HashMap<Buf, Vec<u32>>,
    /// The quantized activations (Xq) as the CPU lays them out: format and blocks.
    xq: HashMap<Buf, (TensorType, Vec<u8>)>,
    /// The CPU tier's experts, and per tier slot what the step handed it (ids, input).
    host_experts: Option<ferrolm_model::HostExperts>,
    handed: HashMap<usize, (Vec<u32>, Vec<f32>)>,
    /// Per stage (gate, up, down), the stack it holds rows of and the experts staged.
    stages: HashMap<usize, (usize, Vec<u32>)>,
}

fn f16_round(x: &[f32]) -> Vec<f32> {
    let mut h = vec![0u8; 2 * x.len()];
    ferrolm_quant::quantize(TensorType::F16, x, &mut h).unwrap();
    let mut out = vec![0f32; x.len()];
    ferrolm_quant::dequantize(TensorType::F16, &h, &mut out).unwrap();
    out
}

/// The kernels' activation format code as the CPU's type.
fn format_type(code: i32) -> TensorType {
    match code {
        3 => TensorType::Q8_0,
        4 => TensorType::Q8_1,
        5 => TensorType::Q8_K,
        c => panic!("activation format {c}"),
    }
}

impl<'f> Emulator<'f> {
    fn new(file: &'f GgufFile, plan: &'f DecodePlan) -> Emulator<'f> {
        let mut e = Emulator {
            file,
            plan,
            f32s: HashMap::new(),
            u32s: HashMap::new(),
            xq: HashMap::new(),
            host_experts: None,
            handed: HashMap::new(),
            stages: HashMap::new(),
        };
        e.u32s
            .insert(Buf::SlotIds, (0..plan.max_used as u32).collect());
        for (l, &kv) in plan.kv_dims.iter().enumerate() {
            e.f32s.insert(Buf::KCache(l), vec![0.0; plan.n_ctx * kv]);
            e.f32s.insert(Buf::VCache(l), vec![0.0; plan.n_ctx * kv]);
        }
        e.u32s.insert(Buf::Pos, vec![0]);
        e.u32s.insert(Buf::Token, vec![0]);
        e.u32s.insert(Buf::TokenRing, vec![u32::MAX; TOKEN_RING]);
        e
    }

    fn buf(a: &Arg) -> Option<Buf> {
        match a {
            Arg::Buf(b) => Some(*b),
            Arg::Null => None,
            other => panic!("a buffer argument, found {other:?}"),
        }
    }

    fn i(a: &Arg) -> usize {
        match a {
            Arg::I32(v) => usize::try_from(*v).expect("a size"),
            other => panic!("an int argument, found {other:?}"),
        }
    }

    fn i64(a: &Arg) -> usize {
        match a {
            Arg::I64(v) => usize::try_from(*v).expect("a size"),
            other => panic!("a long argument, found {other:?}"),
        }
    }

    fn f(a: &Arg) -> f32 {
        match a {
            Arg::F32(v) => *v,
            other => panic!("a float argument, found {other:?}"),
        }
    }

    /// The plan's CPU tier, `offset` checked to be `slot`'s part of its exchange.
    fn cpu_tier(&self, name: &str, offset: &Arg, slot: usize) -> &CpuExperts {
        let tier = (self.plan.cpu_experts.as_ref()).expect("a plan with a CPU tier");
        assert_eq!(
            Self::i64(offset),
            slot * tier.stride,
            "{name}: the slot's exchange"
        );
        tier
    }

    /// A vector (weights from the file) or an f32 buffer.
    fn read(&self, b: Buf) -> Vec<f32> {
        match b {
            Buf::Vector(i) => self.plan.vectors[i].values.to_vec(),
            b => self
                .f32s
                .get(&b)
                .unwrap_or_else(|| panic!("{b:?} read before written"))
                .clone(),
        }
    }

    fn write(&mut self, b: Buf, at: usize, values: &[f32]) {
        let v = self.f32s.entry(b).or_default();
        if v.len() < at + values.len() {
            v.resize(at + values.len(), 0.0);
        }
        v[at..at + values.len()].copy_from_slice(values);
    }

    /// Row `r` of matrix `m`, and its type.
    fn row(&self, m: Buf, r: usize) -> (TensorType, &'f [u8]) {
        // (a stage's row r: row r % rows of the expert its slot r / rows holds)
        let (i, r) = match m {
            Buf::Matrix(i) => (i, r),
            Buf::ExpertStage(s) => {
                let (i, ids) = self
                    .stages
                    .get(&s)
                    .expect("a stage read before it was filled");
                let spec = &self.plan.matrices[*i];
                let per = spec.rows / spec.experts;
                let slot = r / per;
                assert!(slot < ids.len(), "slot {slot} of {} staged", ids.len());
                (*i, ids[slot] as usize * per + r % per)
            }
            m => panic!("a matrix argument, found {m:?}"),
        };
        let spec = &self.plan.matrices[i];
        assert!(
            r < spec.rows,
            "row {r} of {} ({} rows)",
            spec.label,
            spec.rows
        );
        let tensor = &self.file.file_bytes()[spec.tensor.clone()];
        (spec.ty, &tensor[spec.row_range(r)])
    }

    /// Rows `rows` of `m` dotted with input `x` (f32, or the quantized activations), as the
    /// CPU multiplies them: the activations in the row type's partner format.
    fn products(&self, m: Buf, rows: usize, cols: usize, x: Buf) -> Vec<f32> {
        self.products_at(m, 0, rows, cols, x, 0)
    }

    /// [`Emulator::products`] of rows `first..first + rows`, with an f32 input read from value
    /// `offset` of `x` on.
    fn products_at(
        &self,
        m: Buf,
        first: usize,
        rows: usize,
        cols: usize,
        x: Buf,
        offset: usize,
    ) -> Vec<f32> {
        let (ty, _) = self.row(m, 0);
        let kernel = ferrolm_quant::dot_kernel(ty).unwrap();
        let act_ty = kernel.activation_type();
        let act = if x == Buf::Xq {
            assert_eq!(offset, 0, "quantized activations are read whole");
            let (fmt, bytes) = self.xq.get(&x).expect("Xq read before written");
            assert_eq!(*fmt, act_ty, "activations quantized for another row type");
            bytes.clone()
        } else {
            let xs = self.read(x);
            let mut a = vec![0u8; ferrolm_quant::row_bytes(act_ty, cols).unwrap()];
            ferrolm_quant::quantize_activation(act_ty, &xs[offset..offset + cols], &mut a).unwrap();
            a
        };
        (first..first + rows)
            .map(|r| kernel.dot(cols, self.row(m, r).1, &act))
            .collect()
    }

    fn quantize_into(&mut self, xq: Buf, values: &[f32], code: i32) {
        assert_eq!(xq, Buf::Xq, "quantized into {xq:?}");
        let ty = format_type(code);
        let mut q = vec![0u8; ferrolm_quant::row_bytes(ty, values.len()).unwrap()];
        ferrolm_quant::quantize_activation(ty, values, &mut q).unwrap();
        self.xq.insert(xq, (ty, q));
    }

    fn rms_norm(&self, x: Buf, w: Buf, n: usize, eps: f32) -> Vec<f32> {
        let (x, w) = (self.read(x), self.read(w));
        let sum: f64 = x[..n].iter().map(|&v| f64::from(v * v)).sum();
        let scale = 1.0 / ((sum / n as f64) as f32 + eps).sqrt();
        (0..n).map(|i| (x[i] * scale) * w[i]).collect()
    }

    /// One decode step: token `id` at position `p` through every launch of the plan.
    fn step(&mut self, id: u32, p: usize) {
        self.u32s.get_mut(&Buf::Token).unwrap()[0] = id;
        self.u32s.get_mut(&Buf::Pos).unwrap()[0] = p as u32;
        let plan = self.plan;
        for l in &plan.launches {
            self.run(l);
        }
    }

    /// Runs one launch.
    fn run(&mut self, l: &Launch) {
        let a = &l.args;
        let name = l.kernel.as_str();
        let product = |n: &str| name.starts_with(n) && name[n.len()..].starts_with(['_', 'q', 's']);
        if name.starts_with("embed_") {
            let d = 32 * Self::i(&a[2]);
            let token = self.u32s[&Buf::Token][0] as usize;
            let (ty, row) = self.row(Self::buf(&a[0]).unwrap(), token);
            let mut x = vec![0f32; d];
            ferrolm_quant::dequantize(ty, row, &mut x).unwrap();
            self.write(Self::buf(&a[4]).unwrap(), 0, &x);
        } else if name == "rms_norm" || name == "rms_norm_q" {
            let n = Self::i(&a[3]);
            let y = self.rms_norm(
                Self::buf(&a[0]).unwrap(),
                Self::buf(&a[1]).unwrap(),
                n,
                Self::f(&a[4]),
            );
            if name == "rms_norm_q" {
                let code = match a[5] {
                    Arg::I32(c) => c,
                    ref o => panic!("{o:?}"),
                };
                self.quantize_into(Self::buf(&a[2]).unwrap(), &y, code);
            } else {
                self.write(Self::buf(&a[2]).unwrap(), 0, &y);
            }
        } else if name == "rms_norm_fq" {
            // rms_norm_fq(x, w, out, xq, n, eps, mode): both outputs of one norm
            let n = Self::i(&a[4]);
            let y = self.rms_norm(
                Self::buf(&a[0]).unwrap(),
                Self::buf(&a[1]).unwrap(),
                n,
                Self::f(&a[5]),
            );
            self.write(Self::buf(&a[2]).unwrap(), 0, &y);
            let code = match a[6] {
                Arg::I32(c) => c,
                ref o => panic!("{o:?}"),
            };
            self.quantize_into(Self::buf(&a[3]).unwrap(), &y, code);
        } else if name == "quantize_act" {
            let n = Self::i(&a[2]);
            let x = self.read(Self::buf(&a[0]).unwrap());
            let code = match a[3] {
                Arg::I32(c) => c,
                ref o => panic!("{o:?}"),
            };
            self.quantize_into(Self::buf(&a[1]).unwrap(), &x[..n], code);
        } else if product("matvec3r") {
            self.qkv_rope(a);
        } else if product("matvec3") {
            let rows = [Self::i(&a[3]), Self::i(&a[4]), Self::i(&a[5])];
            let cols = 32 * Self::i(&a[7]);
            let x = Self::buf(&a[8]).unwrap();
            for p in (0..3).filter(|&p| rows[p] > 0) {
                let mut y = self.products(Self::buf(&a[p]).unwrap(), rows[p], cols, x);
                if let Some(b) = Self::buf(&a[9 + p]) {
                    y.iter_mut().zip(self.read(b)).for_each(|(y, b)| *y += b);
                }
                self.write(Self::buf(&a[12 + p]).unwrap(), 0, &y);
            }
        } else if product("matvec_glu") {
            let (rows, cols) = (Self::i(&a[4]), 32 * Self::i(&a[3]));
            let x = Self::buf(&a[5]).unwrap();
            let g = self.products(Self::buf(&a[0]).unwrap(), rows, cols, x);
            let u = self.products(Self::buf(&a[1]).unwrap(), rows, cols, x);
            let out: Vec<f32> = match Self::i(&a[7]) {
                0 => g
                    .iter()
                    .zip(&u)
                    .map(|(&g, &u)| g / (1.0 + (-g).exp()) * u)
                    .collect(),
                1 => {
                    let mut out = vec![0f32; rows];
                    ferrolm_quant::ggml_vec::geglu(&g, &u, &mut out);
                    out
                }
                2 => g.iter().zip(&u).map(|(&g, &u)| swiglu_oai(g, u)).collect(),
                act => panic!("activation {act}"),
            };
            self.write(Self::buf(&a[6]).unwrap(), 0, &out);
        } else if product("matvec") || product("matvecf") {
            // (matvecf: f32 input, quantized as the CPU quantizes it, as `products` does)
            let (cols, rows) = (32 * Self::i(&a[2]), Self::i(&a[3]));
            let mut y = self.products(
                Self::buf(&a[0]).unwrap(),
                rows,
                cols,
                Self::buf(&a[4]).unwrap(),
            );
            for add in [&a[5], &a[6]] {
                if let Some(b) = Self::buf(add) {
                    y.iter_mut().zip(self.read(b)).for_each(|(y, b)| *y += b);
                }
            }
            self.write(Self::buf(&a[7]).unwrap(), 0, &y);
        } else if name == "swiglu" {
            let n = Self::i(&a[3]);
            let (g, u) = (
                self.read(Self::buf(&a[0]).unwrap()),
                self.read(Self::buf(&a[1]).unwrap()),
            );
            let out: Vec<f32> = (0..n)
                .map(|i| g[i] / (1.0 + (-g[i]).exp()) * u[i])
                .collect();
            self.write(Self::buf(&a[2]).unwrap(), 0, &out);
        } else if name == "moe_route" {
            self.route(a);
        } else if name == "moe_route_f32" {
            // moe_route's arguments, then the f32 router W, h, d, done: the logits W h first
            // (a warp a row: the grid's warps cover the experts), then the routing
            let (ne, d, parts) = (Self::i(&a[4]), Self::i(&a[16]), Self::i(&a[18]));
            assert!(
                l.grid.0 as usize * (l.block as usize / 32) >= ne * parts,
                "{name}: runs of rows left out"
            );
            assert_eq!(d % (4 * parts), 0, "{name}: {parts} runs of whole float4s");
            assert!(
                l.block as usize >= ne,
                "{name}: a thread an expert to route"
            );
            assert_eq!(a[17], Arg::Buf(Buf::Done));
            let h = self.read(Self::buf(&a[15]).unwrap())[..d].to_vec();
            let logits: Vec<f32> = (0..ne)
                .map(|r| {
                    let (ty, row) = self.row(Self::buf(&a[14]).unwrap(), r);
                    assert_eq!(ty, TensorType::F32);
                    let mut w = vec![0f32; d];
                    ferrolm_quant::dequantize(ty, row, &mut w).unwrap();
                    w.iter().zip(&h).map(|(w, h)| w * h).sum()
                })
                .collect();
            self.write(Self::buf(&a[0]).unwrap(), 0, &logits);
            self.route(a);
        } else if product("moe_glu") {
            // moe_glu(G, U, expert_bytes, row_bytes, n_chunks, n_rows, x, ids, out, act, SG, SU,
            // sout, s_rows): a grid row per chosen expert, and the last for SG and SU when given
            let (cols, rows) = (32 * Self::i(&a[4]), Self::i(&a[5]));
            let x = Self::buf(&a[6]).unwrap();
            let shared = Self::buf(&a[10]).map(|sg| [sg, Self::buf(&a[11]).unwrap()]);
            let routed = l.grid.1 as usize - usize::from(shared.is_some());
            // (a block takes MATVEC_ROWS / 2 rows of gate and up; the grid covers the wider)
            let widest = rows.max(if shared.is_some() { Self::i(&a[13]) } else { 0 });
            assert!(
                l.grid.0 as usize * (MATVEC_ROWS / 2) >= widest,
                "{name}: rows left out"
            );
            let ids = self.u32s[&Self::buf(&a[7]).unwrap()].clone();
            assert!(
                ids.len() >= routed,
                "{name}: {routed} grid rows of {} ids",
                ids.len()
            );
            let glu = |g: Vec<f32>, u: Vec<f32>| {
                let mut out = vec![0f32; g.len()];
                match Self::i(&a[9]) {
                    0 => ferrolm_quant::ggml_vec::swiglu(&g, &u, &mut out),
                    _ => ferrolm_quant::ggml_vec::geglu(&g, &u, &mut out),
                }
                out
            };
            for (j, &e) in ids.iter().enumerate().take(routed) {
                let first = e as usize * rows;
                let g = self.products_at(Self::buf(&a[0]).unwrap(), first, rows, cols, x, 0);
                let u = self.products_at(Self::buf(&a[1]).unwrap(), first, rows, cols, x, 0);
                self.write(Self::buf(&a[8]).unwrap(), j * rows, &glu(g, u));
            }
            if let Some([sg, su]) = shared {
                let s_rows = Self::i(&a[13]);
                let (g, u) = (
                    self.products(sg, s_rows, cols, x),
                    self.products(su, s_rows, cols, x),
                );
                self.write(Self::buf(&a[12]).unwrap(), 0, &glu(g, u));
            }
        } else if name.starts_with("moe_matvec") {
            // moe_matvec(W, expert_bytes, row_bytes, n_chunks, n_rows, x, x_stride, x_per, ids,
            // y, SW, sx, sy, s_row_bytes, s_chunks): grid row j reads input j / x_per; the last
            // SW's, when given
            let (cols, rows) = (32 * Self::i(&a[3]), Self::i(&a[4]));
            let (x, stride, per) = (Self::buf(&a[5]).unwrap(), Self::i(&a[6]), Self::i(&a[7]));
            let shared = Self::buf(&a[10]);
            let routed = l.grid.1 as usize - usize::from(shared.is_some());
            let ids = self.u32s[&Self::buf(&a[8]).unwrap()].clone();
            assert!(
                ids.len() >= routed,
                "{name}: {routed} grid rows of {} ids",
                ids.len()
            );
            for (j, &e) in ids.iter().enumerate().take(routed) {
                let w = Self::buf(&a[0]).unwrap();
                let y = self.products_at(w, e as usize * rows, rows, cols, x, j / per * stride);
                self.write(Self::buf(&a[9]).unwrap(), j * rows, &y);
            }
            if let Some(sw) = shared {
                let s_cols = 32 * Self::i(&a[14]);
                let y = self.products(sw, rows, s_cols, Self::buf(&a[11]).unwrap());
                self.write(Self::buf(&a[12]).unwrap(), 0, &y);
            }
        } else if name.starts_with("moe_combine") {
            // moe_combine(ys, w, k, d, shared, shared_gate, x); moe_combine_norm_held[_q] then
            // norm x (eps, nw, out[, format]) as rms_norm and rms_norm_q do
            let (k, d) = (Self::i(&a[2]), Self::i(&a[3]));
            let (ys, w) = (
                self.read(Self::buf(&a[0]).unwrap()),
                self.read(Self::buf(&a[1]).unwrap()),
            );
            let shared = Self::buf(&a[4]).map(|b| self.read(b));
            // (an f32 gate row at a[8]: its dot with the normed input at a[9])
            let logit = match (Self::buf(&a[5]), Self::buf(&a[8])) {
                (Some(b), _) => Some(self.read(b)[0]),
                (None, Some(gw)) => Some(self.products(gw, 1, d, Self::buf(&a[9]).unwrap())[0]),
                _ => None,
            };
            let gate = logit.map(|g| g / (1.0 + (-g).exp()) / g);
            let xb = Self::buf(&a[6]).unwrap();
            let mut x = self.read(xb)[..d].to_vec();
            for (i, x) in x.iter_mut().enumerate() {
                let mut o = ys[i] * w[0];
                for j in 1..k {
                    o += ys[j * d + i] * w[j];
                }
                if let Some(sh) = &shared {
                    o += gate.map_or(sh[i], |g| sh[i] * g);
                }
                *x += o;
            }
            self.write(xb, 0, &x);
            if name != "moe_combine" {
                let y = self.rms_norm(xb, Self::buf(&a[11]).unwrap(), d, Self::f(&a[10]));
                match a.get(13) {
                    Some(&Arg::I32(code)) => {
                        self.quantize_into(Self::buf(&a[12]).unwrap(), &y, code)
                    }
                    _ => self.write(Self::buf(&a[12]).unwrap(), 0, &y),
                }
            }
        } else if name == "geglu" {
            let n = Self::i(&a[3]);
            let (g, u) = (
                self.read(Self::buf(&a[0]).unwrap()),
                self.read(Self::buf(&a[1]).unwrap()),
            );
            let mut out = vec![0f32; n];
            ferrolm_quant::ggml_vec::geglu(&g[..n], &u[..n], &mut out);
            self.write(Self::buf(&a[2]).unwrap(), 0, &out);
        } else if name == "scale_f32" {
            let (x, n, s) = (Self::buf(&a[0]).unwrap(), Self::i64(&a[1]), Self::f(&a[2]));
            let v: Vec<f32> = self.read(x)[..n].iter().map(|v| v * s).collect();
            self.write(x, 0, &v);
        } else if name.starts_with("post_norm_add") {
            // (the _held kernels compute the same as the others)
            let name = name.replace("_held", "");
            let name = name.as_str();
            // post_norm_add(y, w, x, n, eps, scale): x += (norm(y) * w) * scale; _norm and
            // _norm_q then norm x (nw, out[, format]) as rms_norm and rms_norm_q do
            let (n, eps, scale) = (Self::i(&a[3]), Self::f(&a[4]), Self::f(&a[5]));
            let y = Self::buf(&a[0]).unwrap();
            let o = match Self::buf(&a[1]) {
                Some(w) => self.rms_norm(y, w, n, eps),
                None => self.read(y)[..n].to_vec(),
            };
            let xb = Self::buf(&a[2]).unwrap();
            let x: Vec<f32> = self.read(xb)[..n]
                .iter()
                .zip(&o)
                .map(|(x, o)| x + o * scale)
                .collect();
            self.write(xb, 0, &x);
            if name != "post_norm_add" {
                let y = self.rms_norm(xb, Self::buf(&a[6]).unwrap(), n, eps);
                match name {
                    "post_norm_add_norm" => self.write(Self::buf(&a[7]).unwrap(), 0, &y),
                    "post_norm_add_norm_q" => {
                        let code = match a[8] {
                            Arg::I32(c) => c,
                            ref o => panic!("{o:?}"),
                        };
                        self.quantize_into(Self::buf(&a[7]).unwrap(), &y, code);
                    }
                    other => panic!("no emulation of {other}"),
                }
            }
        } else if name == "adjust_logits" {
            // adjust_logits(x, n, inv_cap, cap, inv_scale)
            let (x, n) = (Self::buf(&a[0]).unwrap(), Self::i64(&a[1]));
            let adjust = [Self::f(&a[2]), Self::f(&a[3]), Self::f(&a[4])];
            let v: Vec<f32> = self.read(x)[..n]
                .iter()
                .map(|&v| host_math::adjust_logit(v, adjust))
                .collect();
            self.write(x, 0, &v);
        } else if name == "rope_store" {
            self.rope_store(a);
        } else if name == "attn_rope_split_warps" {
            // rope_store's work on its arguments (q, k, v, q_norm, k_norm, kc, vc, pos,
            // n_head, n_head_kv, hd, then n_dims..), then the attention
            let rope: Vec<Arg> = [&a[0], &a[19], &a[20], &a[21], &a[22], &a[1], &a[2], &a[3]]
                .into_iter()
                .chain(&a[8..11])
                .chain(&a[23..])
                .cloned()
                .collect();
            self.rope_store(&rope);
            self.attention(a);
            let n = Self::i(&a[8]) * Self::i(&a[10]);
            self.quantized_output(&a[7], n, &a[17..19]);
        } else if name == "attn_split" || name == "attn_split_warps" {
            self.attention(a);
            let n = Self::i(&a[8]) * Self::i(&a[10]);
            self.quantized_output(&a[7], n, &a[17..]);
        } else if name == "choose_token" {
            let n = Self::i(&a[1]);
            let logits = self.read(Self::buf(&a[0]).unwrap());
            let best = (0..n).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
            self.u32s.get_mut(&Buf::Token).unwrap()[0] = best as u32;
            if a.get(8) == Some(&Arg::Buf(Buf::TokenRing)) {
                let p = self.u32s[&Buf::Pos][0] as usize;
                self.u32s.get_mut(&Buf::TokenRing).unwrap()[p % TOKEN_RING] = best as u32;
            }
            if Self::i(&a[4]) == 1 {
                self.u32s.get_mut(&Buf::Pos).unwrap()[0] += 1;
            }
        } else if name == "swiglu_oai" {
            let n = Self::i(&a[3]);
            let (g, u) = (
                self.read(Self::buf(&a[0]).unwrap()),
                self.read(Self::buf(&a[1]).unwrap()),
            );
            let out: Vec<f32> = (0..n).map(|i| swiglu_oai(g[i], u[i])).collect();
            self.write(Self::buf(&a[2]).unwrap(), 0, &out);
        } else if name == "moe_stage" {
            // moe_stage(tables, ne, ids, g, u, d, g_bytes, u_bytes, d_bytes): grid row j stages
            // expert ids[j]'s rows of the layer's three stacks into slot j of each stage
            let Some(Buf::ExpertTable(layer)) = Self::buf(&a[0]) else {
                panic!("{name}: a layer's expert table, found {:?}", a[0]);
            };
            let moe = self.plan.layers[layer]
                .moe
                .as_ref()
                .expect("a layer of experts");
            assert_eq!(Self::i(&a[1]), moe.n_expert);
            let ids = self.u32s[&Self::buf(&a[2]).unwrap()][..l.grid.1 as usize].to_vec();
            for (i, &m) in moe.experts.iter().enumerate() {
                assert_eq!(Self::buf(&a[3 + i]), Some(Buf::ExpertStage(i)));
                assert_eq!(
                    Self::i64(&a[6 + i]),
                    self.plan.matrices[m].expert_bytes() as usize
                );
                self.stages.insert(i, (m, ids.clone()));
            }
        } else if name == "moe_cpu_publish" {
            // moe_cpu_publish(ids, k, c, h, d, exchange, offset, seq, slot): the last c ids
            // and h handed to the CPU tier
            let (k, c, d, slot) = (
                Self::i(&a[1]),
                Self::i(&a[2]),
                Self::i(&a[4]),
                Self::i(&a[8]),
            );
            assert_eq!(a[5], Arg::Buf(Buf::CpuExchange));
            assert_eq!(a[7], Arg::Buf(Buf::CpuSeq));
            self.cpu_tier(name, &a[6], slot);
            let ids = self.u32s[&Buf::ExpertIds][k - c..k].to_vec();
            let h = self.read(Self::buf(&a[3]).unwrap())[..d].to_vec();
            assert!(
                self.handed.insert(slot, (ids, h)).is_none(),
                "published twice"
            );
        } else if name == "moe_cpu_wait" {
            // moe_cpu_wait(exchange, offset, seq, slot, ys, k, c, d): the CPU's c outputs into
            // rows k - c .. k - 1 of ys
            let (slot, k, c, d) = (
                Self::i(&a[3]),
                Self::i(&a[5]),
                Self::i(&a[6]),
                Self::i(&a[7]),
            );
            let layer = self.cpu_tier(name, &a[1], slot).layers[slot];
            let (ids, h) = self
                .handed
                .remove(&slot)
                .expect("waited for a request not handed");
            assert_eq!(ids.len(), c);
            let pool = ferrolm_threads::ThreadPool::new(1).unwrap();
            let mut y = vec![0f32; c * d];
            let host = self.host_experts.as_ref().expect("the tier's experts");
            host.outputs(&pool, layer, &ids, &h, &mut y).unwrap();
            self.write(Self::buf(&a[4]).unwrap(), (k - c) * d, &y);
        } else if name == "moe_add_bias" {
            // moe_add_bias(y, bias, ids, rows): grid row j adds expert ids[j]'s rows
            let (yb, rows) = (Self::buf(&a[0]).unwrap(), Self::i(&a[3]));
            let bias = self.read(Self::buf(&a[1]).unwrap());
            let ids = self.u32s[&Buf::ExpertIds].clone();
            let mut y = self.read(yb);
            for (j, &e) in ids.iter().enumerate().take(l.grid.1 as usize) {
                for r in 0..rows {
                    y[j * rows + r] += bias[e as usize * rows + r];
                }
            }
            self.write(yb, 0, &y);
        } else if name == "split_query_gate" {
            // split_query_gate(qg, q, g, n_head, hd): per head hd queries, then hd gates
            let (nh, hd) = (Self::i(&a[3]), Self::i(&a[4]));
            let qg = self.read(Self::buf(&a[0]).unwrap());
            let (mut q, mut g) = (Vec::new(), Vec::new());
            for h in 0..nh {
                q.extend_from_slice(&qg[2 * h * hd..(2 * h + 1) * hd]);
                g.extend_from_slice(&qg[(2 * h + 1) * hd..(2 * h + 2) * hd]);
            }
            self.write(Self::buf(&a[1]).unwrap(), 0, &q);
            self.write(Self::buf(&a[2]).unwrap(), 0, &g);
        } else if name == "sigmoid_mul" {
            let (xb, n) = (Self::buf(&a[0]).unwrap(), Self::i(&a[2]));
            let g = self.read(Self::buf(&a[1]).unwrap());
            let x: Vec<f32> = self.read(xb)[..n]
                .iter()
                .zip(&g)
                .map(|(x, g)| x * (1.0 / (1.0 + (-g).exp())))
                .collect();
            self.write(xb, 0, &x);
            self.quantized_output(&a[0], n, &a[3..]);
        } else if name == "delta_conv" {
            self.delta_conv(a);
        } else if name == "delta_rule" {
            // (the run length changes when loads are issued, not the sums)
            assert!(matches!(Self::i(&a[18]), 1 | 16), "delta_rule's run");
            self.delta_rule(a);
            let n = Self::i(&a[12]) * Self::i(&a[13]);
            self.quantized_output(&a[10], n, &a[16..18]);
        } else if name == "advance_pos" {
            self.u32s.get_mut(&Buf::Pos).unwrap()[0] += 1;
        } else {
            panic!("no emulation of {name}");
        }
    }

    /// A producer's output (`out`) quantized into `xq` in `format` where the launch asks for it
    /// (`[xq, format]` its last two arguments, quantize_lane: as quantize_act).
    fn quantized_output(&mut self, out: &Arg, n: usize, xq_format: &[Arg]) {
        assert_eq!(xq_format.len(), 2, "[xq, format]: {xq_format:?}");
        if let [Arg::Buf(xq), Arg::I32(code)] = *xq_format {
            let y = self.read(Self::buf(out).unwrap());
            self.quantize_into(xq, &y[..n], code);
        }
    }

    /// A recurrent state as the step reads it: zeros at position 0 (and before it is written).
    fn state(&mut self, b: Buf, len: usize) -> Vec<f32> {
        let fresh = self.u32s[&Buf::Pos][0] == 0;
        match self.f32s.get(&b) {
            Some(v) if !fresh => v.clone(),
            _ => vec![0.0; len],
        }
    }

    /// delta_conv(in, fused, w, state, pos, out, channels, taps, key_dim, s, ratio): the
    /// convolution of this token's channels (found in the fused ssm_in layout or contiguous)
    /// with the carried inputs, then SiLU; the state moves on by one.
    fn delta_conv(&mut self, a: &[Arg]) {
        let (fused, channels, taps) = (Self::i(&a[1]) == 1, Self::i(&a[6]), Self::i(&a[7]));
        let (key_dim, s, ratio) = (Self::i(&a[8]), Self::i(&a[9]), Self::i(&a[10]));
        let shape = DeltaShape {
            hk: key_dim / s,
            hv: ratio * key_dim / s,
            s,
            tiled: false,
        };
        assert_eq!(shape.channels(), channels);
        let input = self.read(Self::buf(&a[0]).unwrap());
        let w = self.read(Self::buf(&a[2]).unwrap());
        let sb = Self::buf(&a[3]).unwrap();
        let mut state = self.state(sb, (taps - 1) * channels);
        let x: Vec<f32> = (0..channels)
            .map(|c| input[shape.conv_source(c, fused)])
            .collect();
        let out = host_math::delta_conv(&mut state, &w, &x, taps);
        self.write(sb, 0, &state);
        self.write(Self::buf(&a[5]).unwrap(), 0, &out);
    }

    /// delta_rule(conv, ba, alpha, dt_bias, ssm_a, norm, in_fused, z, state, pos, out, hk, hv,
    /// s, tiled, eps): per value head the L2-normed query and key, the decay and rate, the
    /// state's update and read-out, the gated RMS norm.
    fn delta_rule(&mut self, a: &[Arg]) {
        let shape = DeltaShape {
            hk: Self::i(&a[11]),
            hv: Self::i(&a[12]),
            s: Self::i(&a[13]),
            tiled: Self::i(&a[14]) == 1,
        };
        let (hv, s, eps) = (shape.hv, shape.s, Self::f(&a[15]));
        let conv = self.read(Self::buf(&a[0]).unwrap());
        let ba = self.read(Self::buf(&a[1]).unwrap());
        let (b, al): (Vec<f32>, Vec<f32>) = match Self::buf(&a[2]) {
            Some(alpha) => (ba[..hv].to_vec(), self.read(alpha)[..hv].to_vec()),
            None => (0..hv).map(|vh| shape.fused_gates(&ba, vh)).unzip(),
        };
        let [dt_bias, ssm_a, norm] = [3, 4, 5].map(|i| self.read(Self::buf(&a[i]).unwrap()));
        let z = match Self::buf(&a[7]) {
            Some(z) => self.read(z),
            None => {
                let fused = self.read(Self::buf(&a[6]).unwrap());
                (0..hv * s).map(|i| shape.fused_z(&fused, i)).collect()
            }
        };
        let sb = Self::buf(&a[8]).unwrap();
        let mut state = self.state(sb, hv * s * s);
        let out = host_math::delta_rule(
            shape,
            &mut state,
            &conv,
            (&b, &al, &z),
            (&dt_bias, &ssm_a, &norm),
            eps,
        );
        self.write(sb, 0, &state);
        self.write(Self::buf(&a[10]).unwrap(), 0, &out);
    }

    /// moe_route(logits, sel_bias, ids, weights, ne, k, gating, n_group, n_group_used, norm,
    /// scale): the CPU's routing (routing.rs), written out again.
    fn route(&mut self, a: &[Arg]) {
        let ne = Self::i(&a[4]);
        let routing = Routing {
            k: Self::i(&a[5]),
            gating: Self::i(&a[6]),
            groups: (Self::i(&a[7]), Self::i(&a[8])),
            norm: Self::i(&a[9]) == 1,
            scale: Self::f(&a[10]),
        };
        let logits = self.read(Self::buf(&a[0]).unwrap())[..ne].to_vec();
        let bias = Self::buf(&a[1]).map(|b| self.read(b));
        let (ids, w) = routing.route(&logits, bias.as_deref());
        // The counters (a[11]; the decode step has no padding rows: a[12] null).
        assert_eq!(a[12], Arg::Null);
        if let Some(counts) = Self::buf(&a[11]) {
            let c = self.u32s.entry(counts).or_insert_with(|| vec![0; ne]);
            ids.iter().for_each(|&e| c[e as usize] += 1);
        }
        self.u32s.insert(Self::buf(&a[2]).unwrap(), ids);
        self.write(Self::buf(&a[3]).unwrap(), 0, &w);
    }

    /// rope_store(q, k, v, q_norm, k_norm, kc, vc, pos, n_head, n_head_kv, hd, n_dims, neox,
    /// theta_scale, freq_scale, freq_factors, eps, mscale, ext_factor, low, high).
    fn rope_store(&mut self, a: &[Arg]) {
        let (nh, nkv, hd, n_dims) = (
            Self::i(&a[8]),
            Self::i(&a[9]),
            Self::i(&a[10]),
            Self::i(&a[11]),
        );
        let neox = Self::i(&a[12]) == 1;
        let (theta_scale, freq_scale, eps) = (Self::f(&a[13]), Self::f(&a[14]), Self::f(&a[16]));
        let ff = Self::buf(&a[15]).map(|b| self.read(b));
        let p = self.u32s[&Buf::Pos][0] as usize;
        let norms = [
            Self::buf(&a[3]).map(|b| self.read(b)),
            Self::buf(&a[4]).map(|b| self.read(b)),
        ];
        let (qb, kb, vb) = (
            Self::buf(&a[0]).unwrap(),
            Self::buf(&a[1]).unwrap(),
            Self::buf(&a[2]).unwrap(),
        );
        let (kc, vc) = (Self::buf(&a[5]).unwrap(), Self::buf(&a[6]).unwrap());
        let rope = Rope {
            p,
            n_dims,
            neox,
            theta_scale,
            freq_scale,
            ff,
            scaling: [17, 18, 19, 20].map(|i| Self::f(&a[i])),
        };
        let rotate = |head: &mut [f32], norm: &Option<Vec<f32>>| {
            if let Some(w) = norm {
                let sum: f64 = head.iter().map(|&v| f64::from(v * v)).sum();
                let scale = 1.0 / ((sum / hd as f64) as f32 + eps).sqrt();
                head.iter_mut()
                    .zip(w)
                    .for_each(|(h, w)| *h = (*h * scale) * w);
            }
            rope.rotate(head);
        };
        let mut q = self.read(qb);
        for h in 0..nh {
            rotate(&mut q[h * hd..(h + 1) * hd], &norms[0]);
        }
        self.write(qb, 0, &q[..nh * hd]);
        let mut k = self.read(kb)[..nkv * hd].to_vec();
        for h in 0..nkv {
            rotate(&mut k[h * hd..(h + 1) * hd], &norms[1]);
        }
        let v = self.read(vb)[..nkv * hd].to_vec();
        self.write(kc, p * nkv * hd, &f16_round(&k));
        self.write(vc, p * nkv * hd, &f16_round(&v));
    }

    /// matvec3r(W0, W1, W2, r0, r1, r2, row_bytes, n_chunks, x, b0, b1, b2, y0, kc, vc, pos,
    /// kv_dim, hd, n_dims, theta_scale, freq_scale, freq_factors): the products of the
    /// matrices given, with their biases; queries rotated into y0, keys rotated and values
    /// stored (f16) at the position in the caches.
    fn qkv_rope(&mut self, a: &[Arg]) {
        let cols = 32 * Self::i(&a[7]);
        let x = Self::buf(&a[8]).unwrap();
        let (kv_dim, hd) = (Self::i(&a[16]), Self::i(&a[17]));
        let p = self.u32s[&Buf::Pos][0] as usize;
        let rope = Rope {
            p,
            n_dims: Self::i(&a[18]),
            neox: false,
            theta_scale: Self::f(&a[19]),
            freq_scale: Self::f(&a[20]),
            ff: Self::buf(&a[21]).map(|b| self.read(b)),
            scaling: [1.0, 0.0, 0.0, 0.0],
        };
        for part in 0..3 {
            let Some(m) = Self::buf(&a[part]) else {
                assert_eq!(Self::i(&a[3 + part]), 0, "rows of an absent matrix");
                continue;
            };
            let mut y = self.products(m, Self::i(&a[3 + part]), cols, x);
            if let Some(b) = Self::buf(&a[9 + part]) {
                y.iter_mut().zip(self.read(b)).for_each(|(y, b)| *y += b);
            }
            if part < 2 {
                y.chunks_mut(hd).for_each(|head| rope.rotate(head));
            }
            match part {
                0 => self.write(Self::buf(&a[12]).unwrap(), 0, &y),
                1 => self.write(Self::buf(&a[13]).unwrap(), p * kv_dim, &f16_round(&y)),
                _ => self.write(Self::buf(&a[14]).unwrap(), p * kv_dim, &f16_round(&y)),
            }
        }
    }

    /// attn_split(q, kc, vc, pos, part_o, part_ml, done, out, n_head, n_head_kv, hd, n_splits,
    /// scale, cap, window): plain softmax attention over the visible positions, the scaled
    /// scores soft-capped where cap > 0.
    fn attention(&mut self, a: &[Arg]) {
        let (nh, nkv, hd) = (Self::i(&a[8]), Self::i(&a[9]), Self::i(&a[10]));
        let (scale, cap, window) = (Self::f(&a[12]), Self::f(&a[13]), Self::i(&a[14]));
        let sinks = Self::buf(&a[15]).map(|b| self.read(b));
        let q = f16_round(&self.read(Self::buf(&a[0]).unwrap())[..nh * hd]);
        let (kc, vc) = (
            self.read(Self::buf(&a[1]).unwrap()),
            self.read(Self::buf(&a[2]).unwrap()),
        );
        let len = self.u32s[&Buf::Pos][0] as usize + 1;
        let lo = if window > 0 {
            len.saturating_sub(window)
        } else {
            0
        };
        let mut out = vec![0f32; nh * hd];
        for h in 0..nh {
            let kvh = h / (nh / nkv);
            let sink = sinks.as_ref().map(|s| s[h]);
            let o = host_math::attend(
                &q[h * hd..(h + 1) * hd],
                &kc,
                &vc,
                nkv * hd,
                kvh * hd,
                (lo, len),
                (scale, cap, sink),
            );
            out[h * hd..(h + 1) * hd].copy_from_slice(&o);
        }
        self.write(Self::buf(&a[7]).unwrap(), 0, &out);
    }
}

/// The step's logits for `ids` fed one at a time, the CPU model's for the same prompt, and the
/// step's kernels; residual products of at most `on_load_max` values quantize their inputs
/// as they load them.
fn emulate(
    spec: &SyntheticSpec,
    activations: Activations,
    on_load_max: usize,
    ids: &[u32],
) -> (Vec<f32>, Vec<f32>, Vec<String>) {
    // (with the switches not yet measured on a GPU on; `unfused_launches_compute_what_the_cpu_
    // computes` takes the fusions' switches off)
    let tuning = CudaTuning {
        quantized_activations: activations == Activations::Quantized,
        quantize_on_load_max: on_load_max,
        shared_expert_in_grid: true,
        delta_runs: true,
        ..CudaTuning::default()
    };
    emulate_tuned(spec, &tuning, ids)
}

/// [`emulate`] under `tuning`.
fn emulate_tuned(
    spec: &SyntheticSpec,
    tuning: &CudaTuning,
    ids: &[u32],
) -> (Vec<f32>, Vec<f32>, Vec<String>) {
    emulate_tiers(spec, tuning, ids, false, 0)
}

/// [`emulate_tuned`], every mixture-of-experts layer's chosen experts staged from the slot
/// cache first where `staged`, and the last `cpu_experts` of them computed by the CPU (the
/// CPU tier; 0: none).
fn emulate_tiers(
    spec: &SyntheticSpec,
    tuning: &CudaTuning,
    ids: &[u32],
    staged: bool,
    cpu_experts: usize,
) -> (Vec<f32>, Vec<f32>, Vec<String>) {
    let file = Arc::new(GgufFile::from_bytes(synthetic::build(spec).unwrap().to_bytes()).unwrap());
    let model = Model::from_file(file.clone(), 1).unwrap();
    emulate_model(&model, tuning, ids, staged, &[cpu_experts])
}

/// [`emulate_tiers`] on a loaded model (its experts resident or streamed), the CPU tier's
/// count of the i-th MoE layer `cpu_counts[i % cpu_counts.len()]`.
fn emulate_model(
    model: &Model,
    tuning: &CudaTuning,
    ids: &[u32],
    staged: bool,
    cpu_counts: &[usize],
) -> (Vec<f32>, Vec<f32>, Vec<String>) {
    let file = model.file();
    let n_layer = model.plan().layers.len();
    let plan = decode_plan_with(
        model.plan(),
        model.weights(),
        ids.len() + 1,
        n_layer,
        tuning,
    )
    .unwrap();
    let moe_layers: Vec<usize> = (0..n_layer)
        .filter(|&l| plan.layers[l].moe.is_some())
        .collect();
    let slotted = if staged { &moe_layers[..] } else { &[] };
    let plan = plan.with_expert_slots(slotted).unwrap();
    let each: Vec<(usize, usize)> = (moe_layers.iter().enumerate())
        .map(|(i, &l)| (l, cpu_counts[i % cpu_counts.len()]))
        .collect();
    let plan = plan.with_cpu_experts_each(&each).unwrap();
    // (a launch over an empty grid is an error on a GPU)
    for x in &plan.launches {
        assert!(x.grid.0 > 0 && x.grid.1 > 0, "{} over no blocks", x.kernel);
    }
    let mut e = Emulator::new(file, &plan);
    if let Some(tier) = &plan.cpu_experts {
        e.host_experts = Some(model.host_experts(&tier.layers).unwrap());
    }
    let mut logits = Vec::new();
    for (p, &id) in ids.iter().enumerate() {
        e.step(id, p);
        logits.extend_from_slice(&e.f32s[&Buf::Logits][..plan.n_vocab]);
        assert_eq!(
            e.u32s[&Buf::Pos][0] as usize,
            p + 1,
            "the step advances the position"
        );
        assert_eq!(
            e.u32s[&Buf::TokenRing][p % TOKEN_RING],
            e.u32s[&Buf::Token][0],
            "the host's ring holds the step's choice in the position's slot"
        );
    }
    let cpu = model.session(ids.len() + 1).eval(ids, Logits::All).unwrap();
    // Each layer's expert counters as the CPU counts the same tokens' routing: the sum always,
    // the counts up to a choice a dozen positions that a near tie flips (one choice moved).
    for (l, cpu_counts) in model.expert_counts().iter().enumerate() {
        if cpu_counts.is_empty() {
            continue;
        }
        let device: Vec<u64> = e
            .u32s
            .get(&Buf::ExpertCounts(l))
            .expect("the step counts each layer's experts")
            .iter()
            .map(|&c| u64::from(c))
            .collect();
        assert_eq!(device.iter().sum::<u64>(), cpu_counts.iter().sum::<u64>());
        let apart: u64 = device
            .iter()
            .zip(cpu_counts)
            .map(|(a, b)| a.abs_diff(*b))
            .sum();
        assert!(
            apart <= 2 * (ids.len() as u64).div_ceil(12),
            "layer {l}: counts {device:?} against the CPU's {cpu_counts:?}"
        );
    }
    let kernels = plan.launches.iter().map(|l| l.kernel.clone()).collect();
    (logits, cpu, kernels)
}

fn ids(n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761).wrapping_add(i) % 900)
        .collect()
}

/// The plan's launches, run by the emulator, reproduce the CPU model: with quantized
/// activations (rows of several types, Q/K/V biases, Q/K norms, frequency factors, a tied
/// output) and with f32 ones.
#[test]
fn the_decode_step_computes_what_the_cpu_computes() {
    let mut cases = Vec::new();
    for arch in ["llama", "qwen2", "qwen3"] {
        let mut s = SyntheticSpec::small(arch);
        s.n_layer = 2;
        // (the CUDA path serves heads of a multiple of 32 dimensions)
        s.head_dim = 64;
        cases.push(s);
    }
    // Past the llama family: Gemma 2 (soft caps), Gemma 3 (Q/K norms, local RoPE base) with
    // post-norms, GELU, the embedding scale and sliding windows; Granite's four scales.
    for arch in ["gemma2", "gemma3", "granite", "phi3"] {
        let mut s = SyntheticSpec::small(arch);
        s.head_dim = 64;
        s.sliding_window = s.sliding_window.map(|_| 8);
        cases.push(s);
    }
    // RoPE scalings: Phi-3's LongRoPE (its short factors at this context, and the attention
    // factor), YaRN on a llama file.
    let mut long_rope = SyntheticSpec::small("phi3");
    long_rope.head_dim = 64;
    long_rope.long_rope = Some(16);
    cases.push(long_rope);
    // Mixtures of experts: qwen3moe (softmax, renormalized), qwen2moe (a gated shared
    // expert, not renormalized), Mixtral-style llama; dots1 below.
    for arch in ["qwen3moe", "qwen2moe", "llama"] {
        let mut s = SyntheticSpec::small(arch);
        s.head_dim = 64;
        if arch == "llama" {
            s.n_expert = 8;
            s.n_expert_used = 2;
            s.n_ff = 256;
        }
        cases.push(s);
    }
    // Qwen3-30B-A3B's layout: an f32 router, the rest Q4_0 (the experts' quantized input
    // made by the norm's launch, which the router reads in f32).
    let mut f32_router = SyntheticSpec::small("qwen3moe");
    f32_router.head_dim = 64;
    f32_router.default_type = TensorType::Q4_0;
    f32_router.types = vec![("ffn_gate_inp".into(), TensorType::F32)];
    cases.push(f32_router);
    // Hybrids: gated delta-net layers beside attention with a gated output; qwen3next's fused
    // projections and its split ones, Qwen3.5's (value heads tiling the key heads) with dense
    // and with expert feed-forward blocks.
    for arch in ["qwen3next", "qwen35", "qwen35moe"] {
        cases.push(SyntheticSpec::small(arch));
    }

    let mut split = SyntheticSpec::small("qwen3next");
    if let Some(net) = split.delta_net.as_mut() {
        net.split_projections = true;
    }
    cases.push(split);
    let mut yarn = SyntheticSpec::small("llama");
    yarn.n_layer = 2;
    yarn.head_dim = 64;
    yarn.yarn = Some((4.0, 512));
    cases.push(yarn);
    let mut freqs = SyntheticSpec::small("llama");
    freqs.n_layer = 2;
    freqs.rope_freqs = true;
    freqs.tied_output = true;
    freqs.default_type = TensorType::Q4_K;
    cases.push(freqs);
    // One type everywhere: the residual products quantize their inputs as they load them, or
    // after a quantize_act launch.
    let mut uniform = SyntheticSpec::small("llama");
    uniform.n_layer = 2;
    uniform.default_type = TensorType::Q4_0;
    uniform.types = Vec::new();
    cases.push(uniform);
    // Q, K, V and gate, up of different types: separate products and activation; K and up in
    // a format the others do not share (Q8_K against Q8_0): their inputs stay f32.
    let mut mixed = SyntheticSpec::small("llama");
    mixed.n_layer = 2;
    mixed.default_type = TensorType::Q4_0;
    mixed.types = vec![
        ("attn_k".into(), TensorType::Q4_K),
        ("ffn_up".into(), TensorType::Q8_0),
    ];
    cases.push(mixed);
    // Q and K of one type, V of another, in one launch (llama-quantize's mixes): Q4_K with
    // Q6_K values (RoPE in the epilogue), Gemma 3's Q5_0 with Q8_0 values (Q/K norms after).
    let mut q4_k = SyntheticSpec::small("llama");
    q4_k.n_layer = 2;
    q4_k.head_dim = 64;
    q4_k.default_type = TensorType::Q4_K;
    q4_k.types = vec![("attn_v".into(), TensorType::Q6_K)];
    cases.push(q4_k);
    let mut gemma = SyntheticSpec::small("gemma3");
    gemma.head_dim = 64;
    gemma.sliding_window = Some(8);
    gemma.default_type = TensorType::Q5_0;
    gemma.types = vec![("attn_v".into(), TensorType::Q8_0)];
    cases.push(gemma);
    for spec in &cases {
        check_emulated(spec, 24);
    }
    // dots1: sigmoid routing with a selection bias, grouped top-k, scaled weights, an ungated
    // shared expert, a leading dense layer. Its group scores (sums of two sigmoids) sit close
    // enough that at the fourth position the emulator's 1% difference in the first layer's
    // output (f16 attention) flips a group, and from there its tokens differ as any two
    // backends' would: the positions before it are compared.
    let mut dots1 = SyntheticSpec::small("dots1");
    dots1.head_dim = 64;
    check_emulated(&dots1, 3);
    // gpt-oss: attention sinks, Q/K/V and output biases, alternating sliding windows, YaRN,
    // MXFP4 experts with biases under softmax-after-top-k routing, the clamped SwiGLU. Its
    // sinks leave the keys small probabilities, which the CPU rounds to f16 and the kernels
    // keep in f32: positions sit near 5e-4 apart (dropping the sinks or the experts' biases
    // puts them at 1e-1), and at the tenth an expert's choice flips; the nine before it are
    // compared.
    let mut gpt_oss = SyntheticSpec::small("gpt-oss");
    gpt_oss.sliding_window = Some(8);
    check_emulated(&gpt_oss, 9);
}

/// An f32 router's product in the routing's launch (`moe_route_f32`,
/// `FERROLM_CUDA_ROUTER_IN_ROUTE=1`) on Qwen3-30B-A3B's layout (the rest Q4_0) and on the
/// default qwen3moe file (a quantized router: not joined): the CPU's logits still.
#[test]
fn the_router_in_the_routing_launch_computes_what_the_cpu_computes() {
    let tuning = CudaTuning {
        router_in_route: true,
        ..CudaTuning::default()
    };
    let mut f32_router = SyntheticSpec::small("qwen3moe");
    f32_router.head_dim = 64;
    f32_router.default_type = TensorType::Q4_0;
    f32_router.types = vec![("ffn_gate_inp".into(), TensorType::F32)];
    let mut plain = SyntheticSpec::small("qwen3moe");
    plain.head_dim = 64;
    for (spec, joined) in [(&f32_router, true), (&plain, false)] {
        let (gpu, cpu, kernels) = emulate_tuned(spec, &tuning, &ids(12));
        let fused = kernels.iter().any(|k| k == "moe_route_f32");
        assert_eq!(fused, joined, "{joined}: {kernels:?}");
        assert_eq!(kernels.iter().any(|k| k == "moe_route"), !joined);
        // (the f32 router's product launched apart only where not joined)
        assert!(!kernels.iter().any(|k| k == "matvec_F32"), "{kernels:?}");
        let kl = mean_kl(&cpu, &gpu, cpu.len() / 12);
        assert!(kl < 1e-3, "joined {joined}: mean KL {kl:.3e}");
    }
}

/// The MoE files the tiers' tests run: Qwen3-30B-A3B's layout (Q4_0, an f32 router), gpt-oss
/// (expert biases, gate and up apart) and qwen2moe (a gated shared expert).
fn tier_files() -> [SyntheticSpec; 3] {
    let mut qwen3 = SyntheticSpec::small("qwen3moe");
    qwen3.head_dim = 64;
    qwen3.default_type = TensorType::Q4_0;
    qwen3.types = vec![("ffn_gate_inp".into(), TensorType::F32)];
    let mut gpt_oss = SyntheticSpec::small("gpt-oss");
    gpt_oss.sliding_window = Some(8);
    let mut qwen2 = SyntheticSpec::small("qwen2moe");
    qwen2.head_dim = 64;
    [qwen3, gpt_oss, qwen2]
}

/// The CPU tier (`FERROLM_CUDA_CPU_EXPERTS`): the last chosen experts of every MoE layer
/// computed by the CPU, handed over after the routing and taken back before the weighted sum,
/// the GPU's launches taking the first slots only. On Qwen3-30B-A3B's layout, gpt-oss (expert
/// biases, the gate and up apart) and qwen2moe (a gated shared expert beside them): the CPU's
/// logits still; a shared expert in the routed experts' grid is refused, saying so.
#[test]
fn experts_on_the_cpu_tier_compute_what_the_cpu_computes() {
    let [qwen3, gpt_oss, mut qwen2] = tier_files();
    let tuning = CudaTuning::default();
    for spec in [&qwen3, &gpt_oss, &qwen2] {
        let (_, _, plain) = emulate_tiers(spec, &tuning, &ids(2), false, 0);
        let (gpu, cpu, kernels) = emulate_tiers(spec, &tuning, &ids(9), false, 1);
        let kl = mean_kl(&cpu, &gpu, cpu.len() / 9);
        assert!(kl < 1e-3, "{}: mean KL {kl:.3e}", spec.arch);
        let moe_layers = spec.n_layer;
        for k in ["moe_cpu_publish", "moe_cpu_wait"] {
            let n = kernels.iter().filter(|&x| x == k).count();
            assert_eq!(n, moe_layers, "{}: {k} in {kernels:?}", spec.arch);
        }
        assert_eq!(kernels.len(), plain.len() + 2 * moe_layers, "{}", spec.arch);
        // Every chosen expert on the CPU (experts streamed from the file): no routed expert
        // product left on the GPU, the CPU's logits still.
        let k = spec.n_expert_used;
        let (gpu, cpu, kernels) = emulate_tiers(spec, &tuning, &ids(9), false, k);
        let kl = mean_kl(&cpu, &gpu, cpu.len() / 9);
        assert!(
            kl < 1e-3,
            "{}, all {k} on the CPU: mean KL {kl:.3e}",
            spec.arch
        );
        assert!(
            !kernels.iter().any(|x| x.starts_with("moe_matvec")
                || x.starts_with("moe_add_bias")
                || x.starts_with("moe_glu")),
            "{}: {kernels:?}",
            spec.arch
        );
        assert!(kernels.iter().any(|x| x.starts_with("moe_combine")));
        // A count of each layer's own (chosen per kind of layer): 0, 1, all, and k - 1 in
        // turn; a layer at 0 keeps its experts on the GPU and hands the CPU nothing.
        let file =
            Arc::new(GgufFile::from_bytes(synthetic::build(spec).unwrap().to_bytes()).unwrap());
        let model = Model::from_file(file, 1).unwrap();
        let counts = [0, 1, k, k - 1];
        let (gpu, cpu, kernels) = emulate_model(&model, &tuning, &ids(9), false, &counts);
        let kl = mean_kl(&cpu, &gpu, cpu.len() / 9);
        assert!(
            kl < 1e-3,
            "{}, counts {counts:?}: mean KL {kl:.3e}",
            spec.arch
        );
        let shared = (0..spec.n_layer).filter(|i| counts[i % 4] > 0).count();
        let waits = kernels.iter().filter(|&x| x == "moe_cpu_wait").count();
        assert_eq!(waits, shared, "{}: {kernels:?}", spec.arch);
    }
    // (one type throughout: the shared expert rides in the routed experts' grid)
    qwen2.default_type = TensorType::Q4_0;
    qwen2.types = Vec::new();
    let file =
        Arc::new(GgufFile::from_bytes(synthetic::build(&qwen2).unwrap().to_bytes()).unwrap());
    let model = Model::from_file(file, 1).unwrap();
    let plan_of = |t: &CudaTuning| {
        decode_plan_with(model.plan(), model.weights(), 8, qwen2.n_layer, t).unwrap()
    };
    let refusal = |plan: DecodePlan, c: usize| match plan.with_cpu_experts(&[0], c) {
        Err(e) => e.to_string(),
        Ok(_) => panic!("{c} experts a layer on the CPU accepted"),
    };
    let in_grid = CudaTuning {
        shared_expert_in_grid: true,
        ..CudaTuning::default()
    };
    let e = refusal(plan_of(&in_grid), 1);
    assert!(e.contains("the shared expert"), "{e}");
    let e = refusal(plan_of(&tuning), 64);
    assert!(e.contains("past the 60"), "{e}");
    let e = refusal(plan_of(&tuning), 3);
    assert!(e.contains("more than it chooses"), "{e}");
}

/// A model larger than host memory (its experts streamed from the file through a small
/// cache): the layers the budget leaves off the GPU have the CPU compute every chosen expert,
/// read through the model's cache, and the GPU none (`moe_cpu_publish` and `moe_cpu_wait`
/// around no routed products): the CPU's logits, on Qwen3-30B-A3B's layout, gpt-oss and
/// qwen2moe, the cache reading experts from the file.
#[test]
fn experts_streamed_from_the_file_feed_the_cpu_tier() {
    use ferrolm_model::{ExpertMode, LoadOptions};
    for spec in tier_files() {
        let path = std::env::temp_dir().join(format!(
            "ferrolm-streamed-tier-{}-{}.gguf",
            spec.arch,
            std::process::id()
        ));
        synthetic::write(&spec, &path).unwrap();
        let options = LoadOptions {
            threads: 1,
            experts: ExpertMode::Streamed {
                cache_bytes: 4 << 20,
            },
            ..Default::default()
        };
        let model = Model::load_with(&path, &options).unwrap();
        let k = spec.n_expert_used;
        let (gpu, cpu, kernels) =
            emulate_model(&model, &CudaTuning::default(), &ids(9), false, &[k]);
        let kl = mean_kl(&cpu, &gpu, cpu.len() / 9);
        assert!(kl < 1e-3, "{}: mean KL {kl:.3e}", spec.arch);
        let waits = kernels.iter().filter(|&x| x == "moe_cpu_wait").count();
        assert_eq!(waits, spec.n_layer, "{}", spec.arch);
        assert!(
            !kernels.iter().any(|x| x.starts_with("moe_matvec")),
            "{kernels:?}"
        );
        let st = model.expert_cache_stats().unwrap();
        assert!(st.misses > 0 && st.bytes_read > 0, "{}: {st:?}", spec.arch);
        std::fs::remove_file(&path).unwrap();
    }
}

/// The expert slot cache (`FERROLM_CUDA_EXPERT_SLOTS`): each chosen expert's rows staged
/// (`moe_stage`) and the products reading the stage: the very logits of the plain step, on
/// Qwen3-30B-A3B's layout, gpt-oss (expert biases by the chosen ids) and qwen2moe (a shared
/// expert beside them), alone and with the CPU tier after it.
#[test]
fn staged_experts_give_the_plain_step_s_logits() {
    let [qwen3, gpt_oss, qwen2] = tier_files();
    let tuning = CudaTuning::default();
    for spec in [&qwen3, &gpt_oss, &qwen2] {
        let (plain, cpu, plain_kernels) = emulate_tiers(spec, &tuning, &ids(9), false, 0);
        let (staged, _, kernels) = emulate_tiers(spec, &tuning, &ids(9), true, 0);
        assert!(
            plain
                .iter()
                .zip(&staged)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{}: the staged step's logits differ",
            spec.arch
        );
        let stages = kernels.iter().filter(|&k| k == "moe_stage").count();
        assert_eq!(stages, spec.n_layer, "{}: {kernels:?}", spec.arch);
        assert_eq!(kernels.len(), plain_kernels.len() + spec.n_layer);
        let (both, _, kernels) = emulate_tiers(spec, &tuning, &ids(9), true, 1);
        let kl = mean_kl(&cpu, &both, cpu.len() / 9);
        assert!(
            kl < 1e-3,
            "{} staged, CPU tier: mean KL {kl:.3e}",
            spec.arch
        );
        assert_eq!(kernels.len(), plain_kernels.len() + 3 * spec.n_layer);
    }
}

/// A shared expert whose rows match the routed experts' in type rides in their launches as
/// one more grid row (`FERROLM_CUDA_SHARED_IN_GRID`): two launches a layer fewer,
/// the CPU's logits still. A hybrid (gated shared expert) and qwen2moe, one type throughout.
#[test]
fn the_shared_expert_in_the_experts_grid_computes_what_the_cpu_computes() {
    // (shared experts of 256 and 384 beside routed ones of 128 and 256)
    let mut specs = vec![
        SyntheticSpec::small_qwen3next(),
        SyntheticSpec::small("qwen2moe"),
    ];
    for spec in &mut specs {
        spec.default_type = TensorType::Q4_0;
        spec.types = Vec::new();
        if spec.head_dim == 0 {
            spec.head_dim = 64;
        }
    }
    for spec in &specs {
        let mut counts = vec![];
        for in_grid in [false, true] {
            let tuning = CudaTuning {
                shared_expert_in_grid: in_grid,
                ..CudaTuning::default()
            };
            let (gpu, cpu, kernels) = emulate_tuned(spec, &tuning, &ids(12));
            let kl = mean_kl(&cpu, &gpu, cpu.len() / 12);
            assert!(
                kl < 1e-3,
                "{} in_grid {in_grid}: mean KL {kl:.3e}",
                spec.arch
            );
            counts.push(kernels.len());
        }
        // (gate/up and down of the shared expert in every MoE layer, the 4 layers)
        assert_eq!(
            counts[0] - counts[1],
            2 * spec.n_layer,
            "{}: {counts:?}",
            spec.arch
        );
    }
}

/// The post-norms through shared memory (`FERROLM_CUDA_NO_HELD_POST_NORM`, and what a norm
/// wider than a held block's lanes takes) compute what the CPU computes too.
#[test]
fn the_gemma_switches_compute_what_the_cpu_computes() {
    let mut spec = SyntheticSpec::small("gemma3");
    spec.head_dim = 64;
    spec.sliding_window = Some(8);
    let tuning = CudaTuning {
        held_post_norm: false,
        ..CudaTuning::default()
    };
    let (gpu, cpu, kernels) = emulate_tuned(&spec, &tuning, &ids(24));
    assert!(
        kernels.iter().any(|k| k == "post_norm_add_norm_q"),
        "{kernels:?}"
    );
    for k in ["post_norm_add_norm", "post_norm_add_norm_q"] {
        let defined = format!("__global__ void {k}(");
        assert!(ferrolm_cuda::kernels::SOURCE.contains(&defined), "{k}");
    }
    let kl = mean_kl(&cpu, &gpu, cpu.len() / 24);
    assert!(kl < 1e-3, "mean KL {kl:.3e}");
    assert!(relative_difference(&cpu, &gpu) < 2e-2);
}

/// Heads of 128 and 256 values: the warps' attention, which rotates and stores the token
/// itself where asked (`rope_in_attention`), over a context longer than a split.
#[test]
fn the_warps_attention_rotates_and_stores_the_token_itself() {
    let mut gemma = SyntheticSpec::small("gemma3");
    gemma.head_dim = 256;
    gemma.sliding_window = Some(8);
    let mut qwen3 = SyntheticSpec::small("qwen3");
    qwen3.n_layer = 2;
    qwen3.head_dim = 128;
    let mut next = SyntheticSpec::small("qwen3next");
    next.head_dim = 128;
    for spec in [gemma, qwen3, next] {
        for on in [true, false] {
            let tuning = CudaTuning {
                rope_in_attention: on,
                producer_quantize: on,
                ..CudaTuning::default()
            };
            let n = 140;
            let (gpu, cpu, kernels) = emulate_tuned(&spec, &tuning, &ids(n));
            let fused = kernels.iter().any(|k| k == "attn_rope_split_warps");
            assert_eq!(fused, on, "{}: {kernels:?}", spec.arch);
            assert_eq!(
                kernels.iter().any(|k| k == "rope_store"),
                !on,
                "{}",
                spec.arch
            );
            let kl = mean_kl(&cpu, &gpu, cpu.len() / n);
            assert!(kl < 1e-3, "{} {on}: mean KL {kl:.3e}", spec.arch);
            assert!(relative_difference(&cpu, &gpu) < 2e-2, "{} {on}", spec.arch);
        }
    }
}

/// The fusions' switches off (`FERROLM_CUDA_NO_FUSED_COMBINE`, `_NO_PRODUCER_QUANT`,
/// `_NO_ROPE_IN_ATTENTION`; the shared expert's own launches) on the files that take those paths: the
/// hybrids, the shared experts, a Q8_0-read attention output.
#[test]
fn unfused_launches_compute_what_the_cpu_computes() {
    let mut specs: Vec<SyntheticSpec> = ["qwen3next", "qwen35moe", "qwen2moe", "qwen3moe"]
        .into_iter()
        .map(SyntheticSpec::small)
        .collect();
    for s in specs.iter_mut().skip(2) {
        s.head_dim = 64;
    }
    for spec in &specs {
        let tuning = CudaTuning {
            quantize_on_load_max: 0,
            producer_quantize: false,
            fused_moe_combine: false,
            shared_expert_in_grid: false,
            rope_in_attention: false,
            ..CudaTuning::default()
        };
        let (gpu, cpu, kernels) = emulate_tuned(spec, &tuning, &ids(9));
        assert!(
            kernels
                .iter()
                .all(|k| !k.starts_with("moe_combine_norm") && !k.starts_with("attn_rope")),
            "{kernels:?}"
        );
        let kl = mean_kl(&cpu, &gpu, cpu.len() / 9);
        assert!(kl < 1e-3, "{}: mean KL {kl:.3e}", spec.arch);
        assert!(relative_difference(&cpu, &gpu) < 2e-2, "{}", spec.arch);
    }
}

/// [`emulate`] of `spec` over `n` positions in each activation mode, against the CPU.
fn check_emulated(spec: &SyntheticSpec, n: usize) {
    for (act, on_load_max) in [
        (Activations::Quantized, usize::MAX),
        (Activations::Quantized, 0),
        (Activations::F32, usize::MAX),
    ] {
        let (gpu, cpu, kernels) = emulate(spec, act, on_load_max, &ids(n));
        if spec.types.iter().any(|(t, _)| t == "attn_k") && act == Activations::Quantized {
            // the mixed file: K's input f32 (Q8_K against Q8_0), the activation separate,
            // quantized by the down product as it loads it or by a launch of its own
            let down = if on_load_max == 0 {
                "quantize_act"
            } else {
                "matvecf_Q4_0"
            };
            for k in ["matvec3r_Q4_K", "matvecq_Q4_0", "swiglu", down] {
                // (a quantized-input product may be its staged twin, `s` for `q`)
                let staged = k.replace("q_", "s_");
                assert!(
                    kernels.iter().any(|n| n == k || *n == staged),
                    "no {k} in {kernels:?}"
                );
            }
        }
        if spec.types.iter().any(|(t, _)| t == "attn_v") && act == Activations::Quantized {
            let mixed = |n: &String| {
                n.starts_with("matvec3")
                    && MIXED_QKV
                        .iter()
                        .any(|(qk, v)| n.ends_with(&format!("_{qk}_{v}")))
            };
            assert!(
                kernels.iter().any(mixed),
                "no mixed Q/K/V launch in {kernels:?}"
            );
        }
        if spec.n_expert > 0 {
            // (a token's expert outputs combined and the next norm taken by one launch)
            assert!(
                kernels
                    .iter()
                    .any(|k| k.starts_with("moe_combine_norm_held")),
                "{kernels:?}"
            );
        }
        if spec.types.is_empty() && act == Activations::Quantized {
            let (present, absent) = if on_load_max == 0 {
                ("quantize_act", "matvecf_Q4_0")
            } else {
                ("matvecf_Q4_0", "quantize_act")
            };
            assert!(kernels.iter().any(|n| n == present), "{kernels:?}");
            assert!(kernels.iter().all(|n| n != absent), "{kernels:?}");
        }
        let n_vocab = cpu.len() / n;
        let kl = mean_kl(&cpu, &gpu, n_vocab);
        let rel = relative_difference(&cpu, &gpu);
        eprintln!(
            "{} {act:?} (on load up to {on_load_max}): mean KL {kl:.3e}, logits {rel:.2e} apart",
            spec.arch
        );
        assert!(kl < 1e-3, "{} {act:?}: mean KL {kl:.3e}", spec.arch);
        // (a file whose logits are large has a KL near 0 whatever happens)
        assert!(rel < 2e-2, "{} {act:?}: logits {rel:.3e} apart", spec.arch);
    }
}

/// The comparison can fail: a launch list with one argument out of place (the attention's
/// output written where the next product does not read it) is far from the CPU.
/// A delta-net layer's fused input and gate projections (one type) are one launch.
#[test]
fn a_delta_net_layer_projects_its_input_and_gates_in_one_launch() {
    let spec = SyntheticSpec::small("qwen3next");
    let file = Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
    let model = Model::from_file(file, 1).unwrap();
    let layers = model.plan().layers.len();
    let plan = decode_plan_layers(
        model.plan(),
        model.weights(),
        64,
        layers,
        Activations::Quantized,
    )
    .unwrap();
    let both = plan.launches.iter().find(|l| {
        l.kernel.starts_with("matvec3")
            && l.args.contains(&Arg::Buf(Buf::DeltaIn))
            && l.args.contains(&Arg::Buf(Buf::DeltaBa))
    });
    assert!(
        both.is_some(),
        "{:?}",
        plan.launches.iter().map(|l| &l.kernel).collect::<Vec<_>>()
    );
}

#[test]
fn a_misplaced_argument_is_caught() {
    let mut spec = SyntheticSpec::small("llama");
    spec.n_layer = 2;
    let file = Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
    let model = Model::from_file(file.clone(), 1).unwrap();
    let n = 12;
    let mut plan =
        decode_plan_layers(model.plan(), model.weights(), n + 1, 2, Activations::F32).unwrap();
    let attn = plan
        .launches
        .iter()
        .position(|l| l.kernel == "attn_split")
        .unwrap();
    plan.launches[attn].args[7] = Arg::Buf(Buf::Gate);
    // the output product reads what the attention of the step before left in Attn
    let mut e = Emulator::new(&file, &plan);
    e.f32s.insert(Buf::Attn, vec![0.0; plan.max_q]);
    let mut logits = Vec::new();
    for (p, &id) in ids(n).iter().enumerate() {
        e.step(id, p);
        logits.extend_from_slice(&e.f32s[&Buf::Logits][..plan.n_vocab]);
    }
    let cpu = model.session(n + 1).eval(&ids(n), Logits::All).unwrap();
    let kl = mean_kl(&cpu, &logits, plan.n_vocab);
    let rel = relative_difference(&cpu, &logits);
    assert!(
        kl > 1e-2 && rel > 2e-2,
        "mean KL {kl:.3e}, logits {rel:.3e} apart"
    );
}

/// A change made to a plan's launches, on purpose.
type Mutation = Box<dyn Fn(&mut DecodePlan)>;

/// The same for the hybrids' and gpt-oss's launches: value heads reading the wrong key heads
/// (Qwen3.5's tiling taken for Qwen3-Next's grouping), the fused projection read as a split
/// one, every layer's delta-rule state in one buffer, the sinks left out, the experts' biases
/// left out: each moves the logits far from the CPU's.
#[test]
fn a_wrong_argument_of_the_new_launches_is_caught() {
    let n = 12;
    let flip = |kernel: &'static str, arg: usize, value: Arg| {
        move |p: &mut DecodePlan| {
            for l in p.launches.iter_mut().filter(|l| l.kernel == kernel) {
                l.args[arg] = value;
            }
        }
    };
    let drop =
        |kernel: &'static str| move |p: &mut DecodePlan| p.launches.retain(|l| l.kernel != kernel);
    let cases: [(&str, Mutation); 5] = [
        ("qwen35", Box::new(flip("delta_rule", 14, Arg::I32(0)))),
        ("qwen3next", Box::new(flip("delta_conv", 1, Arg::I32(0)))),
        (
            "qwen3next",
            Box::new(flip("delta_rule", 8, Arg::Buf(Buf::DeltaAlpha))),
        ),
        ("gpt-oss", Box::new(flip("attn_split", 15, Arg::Null))),
        ("gpt-oss", Box::new(drop("moe_add_bias"))),
    ];
    for (arch, mutate) in cases {
        let spec = SyntheticSpec::small(arch);
        let file =
            Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
        let model = Model::from_file(file.clone(), 1).unwrap();
        let layers = model.plan().layers.len();
        let tuning = CudaTuning {
            ..CudaTuning::default()
        };
        let mut plan =
            decode_plan_with(model.plan(), model.weights(), n + 1, layers, &tuning).unwrap();
        mutate(&mut plan);
        let mut e = Emulator::new(&file, &plan);
        let mut logits = Vec::new();
        for (p, &id) in ids(n).iter().enumerate() {
            e.step(id, p);
            logits.extend_from_slice(&e.f32s[&Buf::Logits][..plan.n_vocab]);
        }
        let cpu = model.session(n + 1).eval(&ids(n), Logits::All).unwrap();
        let rel = relative_difference(&cpu, &logits);
        assert!(rel > 2e-2, "{arch}: logits {rel:.3e} apart");
    }
}

/// `--gpu-layers`: the first layers' step ends with the residual stream (and the position
/// advanced); the CPU's remaining layers and output head, continued from it, give the CPU
/// model's logits.
#[test]
fn the_first_layers_hand_the_cpu_their_residual_stream() {
    let mut spec = SyntheticSpec::small("llama");
    spec.n_layer = 4;
    let file = Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
    let model = Model::from_file(file.clone(), 1).unwrap();
    let ids = ids(16);
    let first = 2;
    let plan = decode_plan_layers(
        model.plan(),
        model.weights(),
        ids.len() + 1,
        first,
        Activations::Quantized,
    )
    .unwrap();
    assert!(plan.head.is_none());
    let mut e = Emulator::new(&file, &plan);
    let mut hidden = Vec::new();
    for (p, &id) in ids.iter().enumerate() {
        e.step(id, p);
        assert_eq!(e.u32s[&Buf::Pos][0] as usize, p + 1);
        hidden.extend_from_slice(&e.f32s[&Buf::X][..plan.n_embd]);
    }
    let split = model
        .session(ids.len() + 1)
        .eval_from(&ids, first, &hidden, Logits::All)
        .unwrap();
    let cpu = model
        .session(ids.len() + 1)
        .eval(&ids, Logits::All)
        .unwrap();
    let (kl, rel) = (
        mean_kl(&cpu, &split, plan.n_vocab),
        relative_difference(&cpu, &split),
    );
    assert!(
        kl < 1e-3 && rel < 2e-2,
        "mean KL {kl:.3e}, logits {rel:.3e} apart"
    );
    // Handing over after the wrong number of layers is caught.
    let wrong = model
        .session(ids.len() + 1)
        .eval_from(&ids, first + 1, &hidden, Logits::All)
        .unwrap();
    assert!(relative_difference(&cpu, &wrong) > 2e-2);
}

/// Tensor parallelism's partitioning (issue 22; no multi-GPU machine yet): 2 and 4 ranks' launch
/// lists, each with its share of the heads and feed-forward rows and its part of the
/// vocabulary, run in lockstep, every `ALL_REDUCE` entry summing the ranks' partial products
/// into each rank's residual stream; the ranks' logits side by side are the CPU model's. A
/// rank's partial left out of the sum is caught.
#[test]
fn tensor_parallel_ranks_compute_what_the_cpu_computes() {
    use ferrolm_cuda::schedule::{tensor_parallel_plans, ALL_REDUCE};
    let mut spec = SyntheticSpec::small("llama");
    spec.n_layer = 2;
    spec.head_dim = 64;
    spec.n_head = 4;
    spec.n_head_kv = 4;
    spec.sliding_window = None;
    let file = Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
    let model = Model::from_file(file.clone(), 1).unwrap();
    let n = 10;
    let cpu = model.session(n + 1).eval(&ids(n), Logits::All).unwrap();
    let n_vocab = cpu.len() / n;
    let run = |ranks: usize, drop_rank: Option<usize>| -> Vec<f32> {
        let plans = tensor_parallel_plans(
            model.plan(),
            model.weights(),
            n + 1,
            ranks,
            &CudaTuning::default(),
        )
        .unwrap();
        let mut emus: Vec<Emulator> = plans.iter().map(|p| Emulator::new(&file, p)).collect();
        let mut logits = Vec::new();
        for (p, &id) in ids(n).iter().enumerate() {
            for e in &mut emus {
                e.u32s.get_mut(&Buf::Token).unwrap()[0] = id;
                e.u32s.get_mut(&Buf::Pos).unwrap()[0] = p as u32;
            }
            for i in 0..plans[0].launches.len() {
                let l = &plans[0].launches[i];
                assert!(plans.iter().all(|q| q.launches[i].kernel == l.kernel));
                if l.kernel != ALL_REDUCE {
                    for (e, q) in emus.iter_mut().zip(&plans) {
                        e.run(&q.launches[i]);
                    }
                    continue;
                }
                let d = Emulator::i(&l.args[2]);
                let mut sum = vec![0f32; d];
                for (r, e) in emus.iter().enumerate() {
                    if drop_rank != Some(r) {
                        let h = e.read(Buf::H);
                        sum.iter_mut().zip(&h).for_each(|(s, h)| *s += h);
                    }
                }
                for e in &mut emus {
                    let x: Vec<f32> = e.read(Buf::X)[..d]
                        .iter()
                        .zip(&sum)
                        .map(|(x, s)| x + s)
                        .collect();
                    e.write(Buf::X, 0, &x);
                }
            }
            let mut row = Vec::new();
            for (e, q) in emus.iter().zip(&plans) {
                assert_eq!(q.vocab_first, row.len());
                row.extend_from_slice(&e.f32s[&Buf::Logits][..q.n_vocab]);
            }
            assert_eq!(row.len(), n_vocab);
            logits.extend(row);
        }
        logits
    };
    for ranks in [2, 4] {
        let tp = run(ranks, None);
        let (kl, rel) = (mean_kl(&cpu, &tp, n_vocab), relative_difference(&cpu, &tp));
        eprintln!("{ranks} ranks: mean KL {kl:.3e}, logits {rel:.2e} apart");
        assert!(
            kl < 1e-3 && rel < 2e-2,
            "{ranks} ranks: mean KL {kl:.3e}, {rel:.3e}"
        );
    }
    let dropped = run(2, Some(1));
    assert!(relative_difference(&cpu, &dropped) > 2e-2);
}
