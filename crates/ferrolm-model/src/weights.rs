//! Binding the tensors a plan needs, with their shapes checked: matrices stay quantized in the
//! mapped file; norms and biases (small) are read into `f32`.
//!
//! The bound weights are what every executor reads: the CPU's forward pass, and the CUDA
//! backend's lowering, which uploads these very matrices (their bytes in the file, fused
//! tensors' row views included) and vectors, and never looks a tensor up by name. Their types
//! are plain data, read-only to other crates (they only ever get a shared reference), with
//! every field public so that a fast path can take them apart without `..` (DESIGN.md,
//! principle 2): a weight added later does not compile there until somebody decides.

use std::ops::Range;
use std::sync::Arc;

use ferrolm_gguf::{GgufFile, TensorType};
use ferrolm_quant::{DotKernel, KernelOptions};

use crate::error::{ModelError, Result};
use crate::plan::{DeltaNet, Ffn, Mixer, ModelPlan, Rope};

/// A small vector read into `f32` at binding (a norm's weights, a bias, RoPE's divisors),
/// shared by the executors that read it (the CUDA backend uploads the same values).
pub type Vector = Arc<[f32]>;

/// A weight matrix in the file: `rows` rows of `cols` elements in the blocks of `ty`; a whole
/// 2-D tensor, or a run of rows of one (a fused tensor's part, one expert of a stack).
#[derive(Clone, Debug)]
pub struct Matrix {
    /// The tensor's name (with the rows of a view: `blk.0.attn_qkv.weight[0..512]`), for
    /// messages.
    pub name: String,
    /// The block type.
    pub ty: TensorType,
    /// Output features.
    pub rows: usize,
    /// Input features (the row length).
    pub cols: usize,
    /// Bytes per row.
    pub row_bytes: usize,
    /// Where the data is in the file.
    pub(crate) range: Range<usize>,
    /// Where the whole tensor it is rows of is in the file (`range` for a whole tensor; a 3-D
    /// stack of experts counts as one tensor of `n_expert x rows` rows).
    pub(crate) tensor: Range<usize>,
    /// Its first row in that tensor.
    pub(crate) first_row: usize,
    /// The dot-product kernel of its products, chosen at load (`ferrolm_quant::matrix_kernel`:
    /// whether llama.cpp repacks the tensor on this CPU).
    pub(crate) kernel: DotKernel,
}

impl Matrix {
    /// The matrix's bytes within the file's bytes.
    pub fn data<'f>(&self, file: &'f [u8]) -> &'f [u8] {
        &file[self.range.clone()]
    }

    /// Where its bytes are in the file's bytes ([`ferrolm_gguf::GgufFile::file_bytes`]).
    pub fn range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// Where the bytes of the tensor it is rows of are in the file's bytes (its own for a
    /// whole tensor; the whole stack for an expert's matrix).
    pub fn tensor_range(&self) -> Range<usize> {
        self.tensor.clone()
    }

    /// Its first row in that tensor (0 for a whole tensor).
    pub fn first_row(&self) -> usize {
        self.first_row
    }

    /// Whether it is its tensor entire, not a row view (of a fused tensor, of a stack).
    pub fn is_whole(&self) -> bool {
        self.range == self.tensor
    }
}

/// The weights of one decoder layer.
#[derive(Debug)]
pub struct LayerWeights {
    /// The token mixer's input norm (`attn_norm`).
    pub attn_norm: Vector,
    /// The token mixer: attention or a gated delta-net.
    pub mixer: MixerWeights,
    /// The norm of the mixer's output before the residual add (Gemma), where the plan has one.
    pub post_attn_norm: Option<Vector>,
    /// The feed-forward block's input norm.
    pub ffn_norm: Vector,
    /// The norm of the feed-forward output before the residual add (Gemma), where the plan has
    /// one.
    pub post_ffn_norm: Option<Vector>,
    /// The feed-forward block.
    pub ffn: FfnWeights,
}

/// The weights of a layer's token mixer.
#[derive(Debug)]
pub enum MixerWeights {
    /// Self-attention.
    Attention(AttentionWeights),
    /// A gated delta-net.
    DeltaNet(DeltaNetWeights),
}

/// The projections, biases and norms of an attention block.
#[derive(Debug)]
pub struct AttentionWeights {
    /// The Q projection (with a gated output: per head the query's rows, then its gate's).
    pub wq: Matrix,
    /// The K projection.
    pub wk: Matrix,
    /// The V projection.
    pub wv: Matrix,
    /// The output projection.
    pub wo: Matrix,
    /// The Q projection's bias, where the plan has Q/K/V biases.
    pub bq: Option<Vector>,
    /// The K projection's bias.
    pub bk: Option<Vector>,
    /// The V projection's bias.
    pub bv: Option<Vector>,
    /// The queries' per-head RMS norm, one head wide, where the plan has Q/K norms.
    pub q_norm: Option<Vector>,
    /// The keys' per-head RMS norm.
    pub k_norm: Option<Vector>,
    /// The output projection's bias (`attn_output.bias`).
    pub bo: Option<Vector>,
    /// One logit per query head (`attn_sinks.weight`).
    pub sinks: Option<Vector>,
}

/// The tensors of a gated delta-net block.
#[derive(Debug)]
pub struct DeltaNetWeights {
    /// The input projections, in one of llama.cpp's two layouts.
    pub input: DeltaNetInput,
    /// The projections of the rates `b` and decay inputs `a`.
    pub gates: DeltaNetGates,
    /// The convolution taps, `conv_kernel` per channel (`ssm_conv1d`).
    pub conv: Vector,
    /// Per value head: the bias added to `a` (`ssm_dt.bias`).
    pub dt_bias: Vector,
    /// Per value head: `-exp(A_log)` (`ssm_a`).
    pub a: Vector,
    /// The gated RMS norm's weight, one head wide (`ssm_norm`).
    pub norm: Vector,
    /// The output projection (`ssm_out`).
    pub out: Matrix,
}

/// The projections of a delta-net's queries, keys, values and output gates `z`.
#[derive(Debug)]
pub enum DeltaNetInput {
    /// `ssm_in`: per key head its query, its key, its value heads, their gates (the layout of
    /// published files).
    Fused(Matrix),
    /// `attn_qkv` (all queries, all keys, all values: the convolution's channel order) and
    /// `attn_gate` (all gates).
    Split {
        /// The queries', keys' and values' rows.
        qkv: Matrix,
        /// The gates' rows.
        gate: Matrix,
    },
}

/// The projections of a delta-net's per-value-head rates `b` and decay inputs `a`.
#[derive(Debug)]
pub enum DeltaNetGates {
    /// `ssm_ba`: per key head, the rates of its value heads, then their decay inputs
    /// (Qwen3-Next).
    Fused(Matrix),
    /// `ssm_beta` and `ssm_alpha`, one row per value head (Qwen3.5).
    Split {
        /// The rates' rows.
        beta: Matrix,
        /// The decay inputs' rows.
        alpha: Matrix,
    },
}

/// The matrices of a feed-forward block.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // one per layer, read every token: inline beats a box
pub enum FfnWeights {
    /// One gated FFN (a fused `ffn_up` of gate then up rows bound as two row views).
    Dense {
        /// The gate projection.
        gate: Matrix,
        /// The up projection.
        up: Matrix,
        /// The down projection.
        down: Matrix,
    },
    /// A router and, per expert, a gated FFN (each expert a contiguous matrix of the 3-D
    /// `ffn_*_exps` tensors: a row view of the stack).
    Moe {
        /// The router's logits, one row per expert.
        router: Matrix,
        /// Each expert's gate projection.
        gate: Vec<Matrix>,
        /// Each expert's up projection.
        up: Vec<Matrix>,
        /// Each expert's down projection.
        down: Vec<Matrix>,
        /// The shared expert, if any.
        shared: Option<Box<SharedWeights>>,
        /// Biases of the router and of the experts, and the selection bias, where the plan
        /// has them.
        biases: Box<MoeBiases>,
    },
}

/// The vectors a mixture-of-experts layer may add: `ffn_gate_inp.bias` (`n_expert`),
/// `exp_probs_b.bias` (`n_expert`), and per expert its gate, up (`n_ff` each) and down
/// (`n_embd`) biases, expert after expert.
#[derive(Debug, Default)]
pub struct MoeBiases {
    /// The router's bias, where the plan has biases.
    pub router: Option<Vector>,
    /// The selection bias, where the plan has one.
    pub selection: Option<Vector>,
    /// Every expert's gate bias, expert after expert.
    pub gate: Option<Vector>,
    /// Every expert's up bias.
    pub up: Option<Vector>,
    /// Every expert's down bias.
    pub down: Option<Vector>,
}

/// A shared expert's matrices and, if gated, its gate (`ffn_gate_inp_shexp`, one row).
#[derive(Debug)]
pub struct SharedWeights {
    /// The gate's logit row, when gated.
    pub gate_inp: Option<Matrix>,
    /// The gate projection.
    pub gate: Matrix,
    /// The up projection.
    pub up: Matrix,
    /// The down projection.
    pub down: Matrix,
}

/// All the weights of a model.
#[derive(Debug)]
pub struct Weights {
    /// The token embedding (kept as it is for its row lookups).
    pub token_embd: Matrix,
    /// The output norm.
    pub output_norm: Vector,
    /// The output projection (the embedding's bytes again when the output is tied).
    pub output: Matrix,
    /// Llama 3's frequency divisors, where the plan has them.
    pub rope_freqs: Option<Vector>,
    /// LongRoPE's divisors: (long, short).
    pub long_rope: Option<(Vector, Vector)>,
    /// Each layer's.
    pub layers: Vec<LayerWeights>,
}

impl Weights {
    /// The frequency divisors of `rope` for a sequence with room for `n_ctx` positions:
    /// LongRoPE's long or short set, or Llama 3's factors.
    pub fn rope_factors(&self, rope: &Rope, n_ctx: usize) -> Option<&Vector> {
        match (&rope.long_rope, &self.long_rope) {
            (Some(lr), Some((long, short))) => Some(if lr.uses_long(n_ctx) { long } else { short }),
            _ => self.rope_freqs.as_ref(),
        }
    }
}

struct Binder<'a> {
    file: &'a GgufFile,
    kernels: &'a KernelOptions,
}

impl Binder<'_> {
    fn info(&self, name: &str, dims: &[u64]) -> Result<&ferrolm_gguf::TensorInfo> {
        let t = self
            .file
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.into()))?;
        // Trailing 1s are equivalent to fewer dimensions.
        let trimmed: Vec<u64> = {
            let mut d = t.dims.clone();
            while d.len() > dims.len() && d.last() == Some(&1) {
                d.pop();
            }
            d
        };
        if trimmed != dims {
            return Err(ModelError::WrongShape {
                name: name.into(),
                expected: dims.to_vec(),
                found: t.dims.clone(),
            });
        }
        Ok(t)
    }

    /// The kernel of a tensor of `ty`: a 2-D weight's of `rows` rows, or (`None`) one that
    /// llama.cpp does not repack.
    fn kernel(&self, name: &str, ty: TensorType, rows: Option<usize>) -> Result<DotKernel> {
        match rows {
            Some(rows) => ferrolm_quant::matrix_kernel(ty, rows, self.kernels),
            None => ferrolm_quant::dot_kernel_with(ty, self.kernels),
        }
        .map_err(|_| ModelError::UnsupportedTensorType {
            name: name.into(),
            ty,
        })
    }

    fn matrix(&self, name: &str, cols: usize, rows: usize) -> Result<Matrix> {
        self.matrix_as(name, cols, rows, true)
    }

    /// A matrix whose kernel mirrors llama.cpp's repacked products where it would repack the
    /// tensor (`repackable`: not the token embedding, which it keeps for its row lookups).
    fn matrix_as(&self, name: &str, cols: usize, rows: usize, repackable: bool) -> Result<Matrix> {
        let t = self.info(name, &[cols as u64, rows as u64])?;
        let kernel = self.kernel(name, t.ty, repackable.then_some(rows))?;
        let start = (self.file.data_offset() + t.offset) as usize;
        Ok(Matrix {
            name: name.into(),
            ty: t.ty,
            rows,
            cols,
            row_bytes: t.size as usize / rows.max(1),
            range: start..start + t.size as usize,
            tensor: start..start + t.size as usize,
            first_row: 0,
            kernel,
        })
    }

    /// A one-row matrix of `cols` stored as a vector (`[cols]`, or `[cols, 1]`).
    fn row(&self, name: &str, cols: usize) -> Result<Matrix> {
        let t = self.info(name, &[cols as u64])?;
        let kernel = self.kernel(name, t.ty, None)?;
        let start = (self.file.data_offset() + t.offset) as usize;
        Ok(Matrix {
            name: name.into(),
            ty: t.ty,
            rows: 1,
            cols,
            row_bytes: t.size as usize,
            range: start..start + t.size as usize,
            tensor: start..start + t.size as usize,
            first_row: 0,
            kernel,
        })
    }

    /// The `n_expert` matrices of `cols` x `rows` stacked in the 3-D tensor `name`, one view
    /// each.
    fn experts(
        &self,
        name: &str,
        cols: usize,
        rows: usize,
        n_expert: usize,
    ) -> Result<Vec<Matrix>> {
        let t = self.info(name, &[cols as u64, rows as u64, n_expert as u64])?;
        // llama.cpp repacks a 3-D expert tensor (only 3-D: one of a single expert is a 2-D
        // tensor, which its `mul_mat_id` path does not take) as it does a 2-D weight
        let kernel = if n_expert > 1 {
            ferrolm_quant::expert_kernel(t.ty, rows, self.kernels).map_err(|_| {
                ModelError::UnsupportedTensorType {
                    name: name.into(),
                    ty: t.ty,
                }
            })?
        } else {
            self.kernel(name, t.ty, None)?
        };
        let start = (self.file.data_offset() + t.offset) as usize;
        let per_expert = t.size as usize / n_expert.max(1);
        Ok((0..n_expert)
            .map(|e| Matrix {
                name: format!("{name}[{e}]"),
                ty: t.ty,
                rows,
                cols,
                row_bytes: per_expert / rows.max(1),
                range: start + e * per_expert..start + (e + 1) * per_expert,
                tensor: start..start + t.size as usize,
                first_row: e * rows,
                kernel,
            })
            .collect())
    }

    /// Row views `[r0, r0 + n)` of each `(r0, n)` of a fused matrix of `cols` x `rows`.
    fn split(&self, name: &str, cols: usize, parts: &[(usize, usize)]) -> Result<Vec<Matrix>> {
        let rows = parts.iter().map(|p| p.1).sum();
        let whole = self.matrix(name, cols, rows)?;
        Ok(parts
            .iter()
            .map(|&(r0, n)| Matrix {
                name: format!("{name}[{r0}..{}]", r0 + n),
                ty: whole.ty,
                rows: n,
                cols,
                row_bytes: whole.row_bytes,
                range: whole.range.start + r0 * whole.row_bytes
                    ..whole.range.start + (r0 + n) * whole.row_bytes,
                tensor: whole.range.clone(),
                first_row: r0,
                kernel: whole.kernel,
            })
            .collect())
    }

    fn vector(&self, name: &str, len: usize) -> Result<Vector> {
        let t = self.info(name, &[len as u64])?;
        let mut v = vec![0.0; len];
        ferrolm_quant::dequantize(t.ty, self.file.tensor_data(t), &mut v).map_err(|_| {
            ModelError::UnsupportedTensorType {
                name: name.into(),
                ty: t.ty,
            }
        })?;
        Ok(v.into())
    }

    /// A small 2-D tensor of `rows` rows of `cols` read into `f32` (per-expert biases), if
    /// `wanted`.
    fn opt_matrix_f32(
        &self,
        name: &str,
        cols: usize,
        rows: usize,
        wanted: bool,
    ) -> Result<Option<Vector>> {
        if !wanted {
            return Ok(None);
        }
        let t = self.info(name, &[cols as u64, rows as u64])?;
        let mut v = vec![0.0; cols * rows];
        ferrolm_quant::dequantize(t.ty, self.file.tensor_data(t), &mut v).map_err(|_| {
            ModelError::UnsupportedTensorType {
                name: name.into(),
                ty: t.ty,
            }
        })?;
        Ok(Some(v.into()))
    }

    fn opt_vector(&self, name: &str, len: usize, wanted: bool) -> Result<Option<Vector>> {
        if wanted {
            self.vector(name, len).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Binds every tensor `plan` needs from `file`, with the kernels `kernels` say.
pub fn bind(file: &GgufFile, plan: &ModelPlan, kernels: &KernelOptions) -> Result<Weights> {
    let b = Binder { file, kernels };
    let d = plan.n_embd;
    // (kept as it is for its row lookups, as llama.cpp keeps it)
    let token_embd = b.matrix_as("token_embd.weight", d, plan.n_vocab, false)?;
    if ferrolm_quant::dequantize(token_embd.ty, &[], &mut []).is_err() {
        return Err(ModelError::UnsupportedTensorType {
            name: token_embd.name,
            ty: token_embd.ty,
        });
    }
    let output = if plan.tied_output {
        // llama.cpp loads a tied head as a tensor of its own (the embedding's bytes again),
        // which its CPU backend repacks like any other weight: the same kernel choice here.
        b.matrix("token_embd.weight", d, plan.n_vocab)?
    } else {
        b.matrix("output.weight", d, plan.n_vocab)?
    };
    let rope_freqs = match plan.layers.first() {
        Some(l) if l.attention.rope.freq_factors => {
            Some(b.vector("rope_freqs.weight", l.attention.rope.n_dims / 2)?)
        }
        _ => None,
    };
    let long_rope = match plan.layers.first() {
        Some(l) if l.attention.rope.long_rope.is_some() => {
            let n = l.attention.rope.n_dims / 2;
            Some((
                b.vector("rope_factors_long.weight", n)?,
                b.vector("rope_factors_short.weight", n)?,
            ))
        }
        _ => None,
    };
    let ffn_norm = crate::arch::ffn_norm_tensor(&plan.architecture);
    let mut layers = Vec::with_capacity(plan.layers.len());
    for (i, l) in plan.layers.iter().enumerate() {
        let n = |s: &str| format!("blk.{i}.{s}");
        let mixer = match &l.mixer {
            Mixer::Attention => MixerWeights::Attention(bind_attention(&b, l, i, d)?),
            Mixer::GatedDeltaNet(net) => MixerWeights::DeltaNet(bind_delta_net(&b, net, i, d)?),
        };
        let ffn = match &l.ffn {
            Ffn::Gated { n_ff, .. } => {
                let n_ff = *n_ff;
                let fused_up = file.tensor(&n("ffn_gate.weight")).is_none()
                    && file
                        .tensor(&n("ffn_up.weight"))
                        .is_some_and(|t| t.dims.get(1) == Some(&(2 * n_ff as u64)));
                let [gate, up]: [Matrix; 2] = if fused_up {
                    let v = b.split(&n("ffn_up.weight"), d, &[(0, n_ff), (n_ff, n_ff)])?;
                    v.try_into().expect("two parts")
                } else {
                    [
                        b.matrix(&n("ffn_gate.weight"), d, n_ff)?,
                        b.matrix(&n("ffn_up.weight"), d, n_ff)?,
                    ]
                };
                FfnWeights::Dense {
                    gate,
                    up,
                    down: b.matrix(&n("ffn_down.weight"), n_ff, d)?,
                }
            }
            Ffn::Moe(m) => {
                let router = b.matrix(&n("ffn_gate_inp.weight"), d, m.n_expert)?;
                FfnWeights::Moe {
                    router,
                    gate: b.experts(&n("ffn_gate_exps.weight"), d, m.n_ff, m.n_expert)?,
                    up: b.experts(&n("ffn_up_exps.weight"), d, m.n_ff, m.n_expert)?,
                    down: b.experts(&n("ffn_down_exps.weight"), m.n_ff, d, m.n_expert)?,
                    shared: match m.shared {
                        Some(s) => Some(Box::new(SharedWeights {
                            gate_inp: if s.gated {
                                Some(b.row(&n("ffn_gate_inp_shexp.weight"), d)?)
                            } else {
                                None
                            },
                            gate: b.matrix(&n("ffn_gate_shexp.weight"), d, s.n_ff)?,
                            up: b.matrix(&n("ffn_up_shexp.weight"), d, s.n_ff)?,
                            down: b.matrix(&n("ffn_down_shexp.weight"), s.n_ff, d)?,
                        })),
                        None => None,
                    },
                    biases: Box::new(MoeBiases {
                        router: b.opt_vector(&n("ffn_gate_inp.bias"), m.n_expert, m.biases)?,
                        selection: b.opt_vector(
                            &n("exp_probs_b.bias"),
                            m.n_expert,
                            m.selection_bias,
                        )?,
                        gate: b.opt_matrix_f32(
                            &n("ffn_gate_exps.bias"),
                            m.n_ff,
                            m.n_expert,
                            m.biases,
                        )?,
                        up: b.opt_matrix_f32(
                            &n("ffn_up_exps.bias"),
                            m.n_ff,
                            m.n_expert,
                            m.biases,
                        )?,
                        down: b.opt_matrix_f32(
                            &n("ffn_down_exps.bias"),
                            d,
                            m.n_expert,
                            m.biases,
                        )?,
                    }),
                }
            }
        };
        layers.push(LayerWeights {
            attn_norm: b.vector(&n("attn_norm.weight"), d)?,
            mixer,
            post_attn_norm: b.opt_vector(
                &n("post_attention_norm.weight"),
                d,
                l.post_attention_norm,
            )?,
            ffn_norm: b.vector(&n(&format!("{ffn_norm}.weight")), d)?,
            post_ffn_norm: b.opt_vector(&n("post_ffw_norm.weight"), d, l.post_ffn_norm)?,
            ffn,
        });
    }
    Ok(Weights {
        token_embd,
        output_norm: b.vector("output_norm.weight", d)?,
        output,
        rope_freqs,
        long_rope,
        layers,
    })
}

/// The attention weights of layer `i`.
fn bind_attention(
    b: &Binder<'_>,
    l: &crate::plan::LayerPlan,
    i: usize,
    d: usize,
) -> Result<AttentionWeights> {
    let file = b.file;
    let a = &l.attention;
    let n = |s: &str| format!("blk.{i}.{s}");
    // A gated output doubles the Q projection: per head, the query then its gate.
    let q_dim = a.n_head * a.head_dim;
    let q_rows = if a.gated_output { 2 * q_dim } else { q_dim };
    let kv_dim = a.n_head_kv * a.head_dim;
    // Fused Q/K/V (`attn_qkv`, Phi-3) and gate/up (`ffn_up` of 2 * n_ff rows, gate first,
    // without `ffn_gate`) are bound as row views: each output row is the same dot product.
    let [wq, wk, wv]: [Matrix; 3] = if file.tensor(&n("attn_qkv.weight")).is_some() {
        let parts = [(0, q_rows), (q_rows, kv_dim), (q_rows + kv_dim, kv_dim)];
        let v = b.split(&n("attn_qkv.weight"), d, &parts)?;
        v.try_into().expect("three parts")
    } else {
        [
            b.matrix(&n("attn_q.weight"), d, q_rows)?,
            b.matrix(&n("attn_k.weight"), d, kv_dim)?,
            b.matrix(&n("attn_v.weight"), d, kv_dim)?,
        ]
    };
    Ok(AttentionWeights {
        wq,
        wk,
        wv,
        wo: b.matrix(&n("attn_output.weight"), q_dim, d)?,
        bq: b.opt_vector(&n("attn_q.bias"), q_rows, a.qkv_bias)?,
        bk: b.opt_vector(&n("attn_k.bias"), kv_dim, a.qkv_bias)?,
        bv: b.opt_vector(&n("attn_v.bias"), kv_dim, a.qkv_bias)?,
        q_norm: b.opt_vector(&n("attn_q_norm.weight"), a.head_dim, a.qk_norm)?,
        k_norm: b.opt_vector(&n("attn_k_norm.weight"), a.head_dim, a.qk_norm)?,
        bo: b.opt_vector(&n("attn_output.bias"), d, a.out_bias)?,
        sinks: b.opt_vector(&n("attn_sinks.weight"), a.n_head, a.sinks)?,
    })
}

/// The delta-net tensors of layer `i` (shapes already checked against the keys by the
/// architecture; checked again here, as every binding is).
fn bind_delta_net(b: &Binder<'_>, net: &DeltaNet, i: usize, d: usize) -> Result<DeltaNetWeights> {
    let n = |s: &str| format!("blk.{i}.{s}");
    let key_dim = net.n_k_heads * net.head_dim;
    let value_dim = net.n_v_heads * net.head_dim;
    let conv_name = n("ssm_conv1d.weight");
    let conv_len = net.conv_kernel * net.conv_channels();
    let t = b.info(
        &conv_name,
        &[net.conv_kernel as u64, net.conv_channels() as u64],
    )?;
    let mut conv = vec![0f32; conv_len];
    ferrolm_quant::dequantize(t.ty, b.file.tensor_data(t), &mut conv).map_err(|_| {
        ModelError::UnsupportedTensorType {
            name: conv_name.clone(),
            ty: t.ty,
        }
    })?;
    Ok(DeltaNetWeights {
        input: if b.file.tensor(&n("ssm_in.weight")).is_none()
            && b.file.tensor(&n("attn_qkv.weight")).is_some()
        {
            DeltaNetInput::Split {
                qkv: b.matrix(&n("attn_qkv.weight"), d, 2 * key_dim + value_dim)?,
                gate: b.matrix(&n("attn_gate.weight"), d, value_dim)?,
            }
        } else {
            DeltaNetInput::Fused(b.matrix(&n("ssm_in.weight"), d, 2 * key_dim + 2 * value_dim)?)
        },
        gates: if b.file.tensor(&n("ssm_ba.weight")).is_none()
            && b.file.tensor(&n("ssm_beta.weight")).is_some()
        {
            DeltaNetGates::Split {
                beta: b.matrix(&n("ssm_beta.weight"), d, net.n_v_heads)?,
                alpha: b.matrix(&n("ssm_alpha.weight"), d, net.n_v_heads)?,
            }
        } else {
            DeltaNetGates::Fused(b.matrix(&n("ssm_ba.weight"), d, 2 * net.n_v_heads)?)
        },
        conv: conv.into(),
        dt_bias: b.vector(&n("ssm_dt.bias"), net.n_v_heads)?,
        a: b.vector(&n("ssm_a"), net.n_v_heads)?,
        norm: b.vector(&n("ssm_norm.weight"), net.head_dim)?,
        out: b.matrix(&n("ssm_out.weight"), value_dim, d)?,
    })
}
