//! The launch plan of one decode step: which kernels run, in which order, on which buffers.
//!
//! Pure host code (no CUDA), so that CI tests it. The lowering reads the layer plan and the
//! model's bound weights ([`ferrolm_model::weights`]: the CPU's own, matrices as views into the
//! file's bytes, fused tensors as row views), both taken apart without `..` (DESIGN.md
//! principle 2); every field the CUDA path does not serve declines with its name (the
//! declines are all here: the batched passes of `prefill.rs` read this plan and serve all of
//! it but what [`DecodePlan::batched_passes_serve`] says); and the step is a list of
//! [`Launch`]es over symbolic buffers that the device side resolves to addresses once and
//! captures into one CUDA graph. No tensor is looked up by name: each [`MatrixSpec`] says
//! where its bytes are in the file, each [`VectorSpec`] holds its bound values.

use std::ops::Range;

use ferrolm_gguf::TensorType;

use crate::CudaTuning;
use ferrolm_model::plan::{
    Activation, Attention, DeltaNet, Ffn, Gating, KeyHeads, LayerPlan, Mixer, ModelPlan, Moe, Rope,
    RopeLayout, YarnRamp,
};
use ferrolm_model::weights::{
    AttentionWeights, DeltaNetGates, DeltaNetInput, DeltaNetWeights, FfnWeights, LayerWeights,
    Matrix, MixerWeights, MoeBiases, SharedWeights, Vector, Weights,
};

/// Why the CUDA path does not take a model: the plan field (or weight) it does not serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decline {
    /// The plan field, or the weight (`layer 3 feed-forward up (blk.3.ffn_up.weight)`).
    pub field: String,
    /// Its value in this model.
    pub value: String,
}

impl std::fmt::Display for Decline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the CUDA path does not serve {} = {}",
            self.field, self.value
        )
    }
}

fn decline(field: impl Into<String>, value: impl std::fmt::Display) -> Decline {
    Decline {
        field: field.into(),
        value: value.to_string(),
    }
}

/// The kernel-name suffix of the block types the matrix-vector kernels read (all of them
/// compared with the CPU on a GPU by `cuda-check`).
pub fn kernel_type(ty: TensorType) -> Option<&'static str> {
    Some(match ty {
        TensorType::F32 => "F32",
        TensorType::F16 => "F16",
        TensorType::Q8_0 => "Q8_0",
        TensorType::Q4_0 => "Q4_0",
        TensorType::Q4_1 => "Q4_1",
        TensorType::Q5_0 => "Q5_0",
        TensorType::Q5_1 => "Q5_1",
        TensorType::Q4_K => "Q4_K",
        TensorType::Q6_K => "Q6_K",
        TensorType::BF16 => "BF16",
        TensorType::IQ4_NL => "IQ4_NL",
        TensorType::MXFP4 => "MXFP4",
        TensorType::Q2_K => "Q2_K",
        TensorType::Q3_K => "Q3_K",
        TensorType::Q5_K => "Q5_K",
        TensorType::IQ1_S => "IQ1_S",
        TensorType::IQ1_M => "IQ1_M",
        TensorType::IQ2_XXS => "IQ2_XXS",
        TensorType::IQ2_XS => "IQ2_XS",
        TensorType::IQ2_S => "IQ2_S",
        TensorType::IQ3_XXS => "IQ3_XXS",
        TensorType::IQ3_S => "IQ3_S",
        TensorType::IQ4_XS => "IQ4_XS",
        TensorType::TQ1_0 => "TQ1_0",
        TensorType::TQ2_0 => "TQ2_0",
        TensorType::Q1_0 => "Q1_0",
        TensorType::Q2_0 => "Q2_0",
        TensorType::NVFP4 => "NVFP4",
        _ => return None,
    })
}

/// A buffer of the step, resolved to a device address by the executor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// Matrix `i` of [`DecodePlan::matrices`].
    Matrix(usize),
    /// Vector `i` of [`DecodePlan::vectors`] (norm weights, biases, RoPE factors), f32.
    Vector(usize),
    /// The residual stream, `n_embd` f32.
    X,
    /// A normed copy of the residual stream, `n_embd` f32.
    H,
    /// Queries, `max q_dim` f32.
    Q,
    /// Keys of this token, `max kv_dim` f32.
    K,
    /// Values of this token, `max kv_dim` f32.
    V,
    /// The attention output, `max q_dim` f32.
    Attn,
    /// Gate products, `max n_ff` f32.
    Gate,
    /// Up products, `max n_ff` f32.
    Up,
    /// Gated activations, `max n_ff` f32.
    Act,
    /// The logits, `n_vocab` f32.
    Logits,
    /// Split-K partial outputs, `max n_head * splits * head_dim` f32.
    PartO,
    /// Split-K partial max and sum, `max n_head * splits * 2` f32.
    PartMl,
    /// Split-K blocks finished per head (the last one merges), `max n_head` u32, zero between
    /// steps.
    Done,
    /// The activations of the next product quantized as the CPU quantizes them for its row
    /// type (the kernels' XQ layout: `w` int8, then `w / 32` f32 scales, then `w / 32` f32
    /// sums, for the widest input `w`).
    Xq,
    /// How the step chooses its token: `k, top_p, min_p, temperature, n_draws` (i32, f32 x 3,
    /// i32); `k = 0` (as allocated) is greedy.
    SampleCfg,
    /// Uniform draws in [0, 1) for sampling, [`SAMPLE_DRAWS`] f32, in the host sampler's order.
    Draws,
    /// Draws used so far, one u32.
    DrawIdx,
    /// The token id the step embeds (and the greedy choice it writes), one u32.
    Token,
    /// The position the step writes (advanced by the step), one u32.
    Pos,
    /// The chosen ids again, in mapped host memory: [`TOKEN_RING`] u32, the step at position p
    /// writing slot `p % TOKEN_RING`, so that the host reads a step's id while the next runs.
    TokenRing,
    /// A mixture-of-experts layer's router logits, `max_experts` f32.
    Router,
    /// The experts a token's routing chose, best first, `max_used` u32.
    ExpertIds,
    /// Their weights, `max_used` f32.
    ExpertWeights,
    /// Each chosen expert's output, `max_used x n_embd` f32.
    ExpertOut,
    /// The shared expert's output, `n_embd` f32.
    SharedOut,
    /// The shared expert's gate logit, one f32.
    SharedGate,
    /// A gated attention output's gates, `max q_dim` f32 (Qwen3-Next).
    AttnGate,
    /// A delta-net's input projection (`ssm_in`'s rows, or `attn_qkv`'s channels), f32.
    DeltaIn,
    /// Its output gates when projected apart (`attn_gate`), f32.
    DeltaZ,
    /// Its rates, with the decay inputs when fused (`ssm_ba`; `ssm_beta`), f32.
    DeltaBa,
    /// Its decay inputs when projected apart (`ssm_alpha`), f32.
    DeltaAlpha,
    /// The convolution's output (queries, keys, values), f32.
    DeltaConv,
    /// Every value head's gated-normed read-out, f32.
    DeltaOut,
    /// Layer `l`'s convolution state, `(taps - 1) x channels` f32.
    ConvState(usize),
    /// Layer `l`'s delta-rule state, `value heads x head_dim^2` f32.
    SsmState(usize),
    /// How often each of layer `l`'s experts was chosen, u32 (for `--expert-stats` and
    /// `/metrics`).
    ExpertCounts(usize),
    /// The CPU tier's exchange with the CPU (`cpu_tier.rs`): per layer whose chosen experts
    /// the CPU partly computes, its flags, ids, input and the CPU's outputs, in mapped host
    /// memory.
    CpuExchange,
    /// Per layer, how many steps have handed experts to the CPU, u32 (device memory).
    CpuSeq,
    /// Layer `l`'s expert table (`slots.rs`): where each expert's gate, up and down rows are
    /// now (a device slot, or mapped host memory), `3 x n_expert` u64.
    ExpertTable(usize),
    /// The chosen experts' gate (0), up (1) or down (2) rows, staged, `max_used` experts.
    ExpertStage(usize),
    /// `0, 1, .. max_used - 1`: the staged experts' ids, u32.
    SlotIds,
    /// Layer `l`'s keys, `n_ctx x kv_dim` f16.
    KCache(usize),
    /// Layer `l`'s values, `n_ctx x kv_dim` f16.
    VCache(usize),
}

/// One kernel argument.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A buffer's address.
    Buf(Buf),
    /// A null pointer (an absent bias or norm).
    Null,
    /// An `int`.
    I32(i32),
    /// A `float`.
    F32(f32),
    /// A `long long`.
    I64(i64),
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq)]
pub struct Launch {
    /// The kernel's name in the module.
    pub kernel: String,
    /// Grid size (x, y).
    pub grid: (u32, u32),
    /// Threads per block.
    pub block: u32,
    /// The arguments, in order.
    pub args: Vec<Arg>,
    /// Bytes of dynamic shared memory (staged rows; 0 for most kernels).
    pub shared: u32,
}

/// A weight matrix the step reads, in its file's block layout: rows (and columns) of one of
/// the model's bound matrices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatrixSpec {
    /// What it is (`layer 3 attention q`), for messages; never looked up.
    pub label: String,
    /// Where the tensor it reads is in the file's bytes ([`Matrix::tensor_range`]: a stack of
    /// experts whole); `first_row` and `first_col` count from its start.
    pub tensor: Range<usize>,
    /// Its first row in the tensor: a row view of a fused tensor (Phi-3's `attn_qkv` and
    /// `ffn_up` of gate then up rows, a tensor-parallel rank's rows), 0 for a whole one.
    pub first_row: usize,
    /// Its first column in the tensor's rows (a tensor-parallel rank's columns of a
    /// row-parallel product), 0 for whole rows.
    pub first_col: usize,
    /// Columns of the tensor's rows (`cols` unless a column view).
    pub tensor_cols: usize,
    /// How many experts' matrices it stacks (1: a plain matrix).
    pub experts: usize,
    /// Block type.
    pub ty: TensorType,
    /// Rows (output features).
    pub rows: usize,
    /// Columns (input features).
    pub cols: usize,
    /// The kernels' name for its rows: the block type's, or its regrouped layout's when the
    /// matrix is uploaded regrouped ([`crate::repack`]); decided once, with the plan.
    pub kernel: &'static str,
}

impl MatrixSpec {
    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_size() * self.ty.block_bytes()
    }

    /// Bytes of the whole matrix (every expert's rows of a stack).
    pub fn total_bytes(&self) -> u64 {
        (self.rows * self.row_bytes()) as u64
    }

    /// Bytes of one expert's rows of a stack (the whole matrix otherwise).
    pub fn expert_bytes(&self) -> u64 {
        (self.rows / self.experts.max(1) * self.row_bytes()) as u64
    }

    /// Where row `r` of the view is in the tensor's bytes (its columns of a column view).
    pub fn row_range(&self, r: usize) -> std::ops::Range<usize> {
        let block = |cols: usize| cols / self.ty.block_size() * self.ty.block_bytes();
        let start = (self.first_row + r) * block(self.tensor_cols) + block(self.first_col);
        start..start + self.row_bytes()
    }

    /// Its rows' bytes in the file's block layout, from the file's bytes `file`
    /// ([`ferrolm_gguf::GgufFile::file_bytes`]), or `None` when `file` is too short.
    pub fn bytes<'a>(&self, file: &'a [u8]) -> Option<std::borrow::Cow<'a, [u8]>> {
        self.data(file.get(self.tensor.clone())?)
    }

    /// Its rows' bytes in the file's block layout, from the tensor's bytes `tensor`, or `None`
    /// when `tensor` is too short.
    pub fn data<'a>(&self, tensor: &'a [u8]) -> Option<std::borrow::Cow<'a, [u8]>> {
        if self.first_col == 0 && self.tensor_cols == self.cols {
            let rows = self.row_range(0).start..self.row_range(self.rows).start;
            return tensor.get(rows).map(std::borrow::Cow::Borrowed);
        }
        let mut out = Vec::with_capacity(self.rows * self.row_bytes());
        for r in 0..self.rows {
            out.extend_from_slice(tensor.get(self.row_range(r))?);
        }
        Some(std::borrow::Cow::Owned(out))
    }

    /// Whether its rows are uploaded regrouped.
    pub fn repacked(&self) -> bool {
        kernel_type(self.ty) != Some(self.kernel)
    }
}

/// A small f32 vector the step reads: one of the model's bound vectors, shared.
#[derive(Clone, PartialEq)]
pub struct VectorSpec {
    /// What it is (`layer 3 attention q bias`), for messages.
    pub label: String,
    /// Its values, as bound.
    pub values: Vector,
}

impl VectorSpec {
    /// Elements.
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether it has none.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }
}

impl std::fmt::Debug for VectorSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "VectorSpec({}, {} values)", self.label, self.len())
    }
}

/// One layer as the batched prompt pass reads it: its weights (indices into
/// [`DecodePlan::matrices`] and [`DecodePlan::vectors`]) and its token mixer's shape.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerRefs {
    /// `attn_norm.weight` (the mixer's input norm).
    pub attn_norm: usize,
    /// The token mixer: attention or a gated delta-net.
    pub mixer: MixerRefs,
    /// `ffn_norm.weight`.
    pub ffn_norm: usize,
    /// Gate, up and down projections.
    pub ffn: [usize; 3],
    /// The RMS norm of the attention block's output before the residual add (Gemma).
    pub post_attn_norm: Option<usize>,
    /// The RMS norm of the feed-forward block's output before the residual add (Gemma).
    pub post_ffn_norm: Option<usize>,
    /// Each block's output times this before the residual add (1: none; Granite).
    pub residual_scale: f32,
    /// The feed-forward gate's activation.
    pub activation: GateActivation,
    /// A mixture of experts instead of one feed-forward block (`ffn` then holds the expert
    /// tensors).
    pub moe: Option<MoeRefs>,
}

impl LayerRefs {
    /// Floats of one sequence's recurrent states: the convolution's and the delta rule's (zeros
    /// for attention).
    pub fn state_floats(&self) -> [usize; 2] {
        match &self.mixer {
            MixerRefs::DeltaNet(d) => [d.conv_state(), d.ssm_state()],
            MixerRefs::Attention(_) => [0, 0],
        }
    }

    /// The layer's attention, when it mixes tokens by attention.
    pub fn attention(&self) -> Option<&AttentionRefs> {
        match &self.mixer {
            MixerRefs::Attention(a) => Some(a),
            MixerRefs::DeltaNet(_) => None,
        }
    }
}

/// What mixes a layer's tokens.
#[derive(Clone, Debug, PartialEq)]
pub enum MixerRefs {
    /// Self-attention over the layer's KV cache.
    Attention(AttentionRefs),
    /// A gated delta-net over the layer's recurrent state (the decode step only: the batched
    /// passes decline such a model, whose prompts then run as decode steps).
    DeltaNet(DeltaNetRefs),
}

/// An attention layer's weights and shape.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionRefs {
    /// Q, K, V projections.
    pub qkv: [usize; 3],
    /// Their biases, if any.
    pub qkv_bias: Option<[usize; 3]>,
    /// Q and K head norms, if any.
    pub qk_norm: Option<[usize; 2]>,
    /// The attention output projection.
    pub wo: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Dimensions per head.
    pub head_dim: usize,
    /// Rotated dimensions per head.
    pub n_dims: usize,
    /// NeoX pairing (halves) instead of adjacent pairs.
    pub neox: bool,
    /// RoPE base.
    pub freq_base: f32,
    /// RoPE linear scale.
    pub freq_scale: f32,
    /// The frequency divisors (`rope_freqs.weight`, or LongRoPE's set for the context), if
    /// used.
    pub freq_factors: Option<usize>,
    /// The attention factor and YaRN's ramp.
    pub rope_scaling: RopeScaling,
    /// Score scale.
    pub scale: f32,
    /// Sliding window (0: none).
    pub window: usize,
    /// The attention scores' soft cap (0: none; Gemma 2), applied after the scale.
    pub softcap: f32,
    /// The Q projection gives per head the query then as many gate values, and the output is
    /// multiplied by their sigmoid before `wo` (Qwen3-Next; the decode step only).
    pub gated_output: bool,
    /// One logit per head joining each softmax as a column with no value (gpt-oss's
    /// `attn_sinks`; the decode step only).
    pub sinks: Option<usize>,
    /// The output projection's bias (gpt-oss; the decode step only).
    pub out_bias: Option<usize>,
}

/// A gated delta-net layer's weights and shape (see `delta_conv` and `delta_rule` in the
/// kernels, and docs/ARCHITECTURE.md).
#[derive(Clone, Debug, PartialEq)]
pub struct DeltaNetRefs {
    /// `ssm_in` (per key head: its query, key, value heads and their gates), or `attn_qkv`
    /// and `attn_gate` apart (Qwen3.5).
    pub input: DeltaNetProjection,
    /// `ssm_ba` (per key head: its value heads' rates, then their decay inputs), or
    /// `ssm_beta` and `ssm_alpha` apart (Qwen3.5).
    pub gates: DeltaNetProjection,
    /// `ssm_conv1d.weight`: `conv_kernel` taps per channel, the oldest first.
    pub conv: usize,
    /// `ssm_dt.bias` and `ssm_a`, one per value head.
    pub dt_bias: usize,
    /// See `dt_bias`.
    pub a: usize,
    /// `ssm_norm.weight`, one head wide.
    pub norm: usize,
    /// `ssm_out.weight`.
    pub out: usize,
    /// Key heads, value heads, the head size, the convolution's taps.
    pub n_k_heads: usize,
    /// See `n_k_heads`.
    pub n_v_heads: usize,
    /// See `n_k_heads`.
    pub head_dim: usize,
    /// See `n_k_heads`.
    pub conv_kernel: usize,
    /// Value head `h` reads key head `h % n_k_heads` (Qwen3.5) instead of `h / ratio`.
    pub tiled_key_heads: bool,
}

/// A delta-net projection: one fused matrix, or two whose outputs go to two buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeltaNetProjection {
    /// One matrix in the grouped (per key head) layout.
    Fused(usize),
    /// Two matrices.
    Split(usize, usize),
}

impl DeltaNetRefs {
    /// Channels of the convolution: queries, keys and values.
    pub fn channels(&self) -> usize {
        (2 * self.n_k_heads + self.n_v_heads) * self.head_dim
    }

    /// Floats of the convolution's state (the last `conv_kernel - 1` inputs of each channel).
    pub fn conv_state(&self) -> usize {
        (self.conv_kernel - 1) * self.channels()
    }

    /// Floats of the delta rule's state (a `head_dim` square per value head).
    pub fn ssm_state(&self) -> usize {
        self.n_v_heads * self.head_dim * self.head_dim
    }
}

/// A mixture-of-experts layer as the batched passes read it (the decode step's
/// `moe_route` arguments and the matrices).
#[derive(Clone, Debug, PartialEq)]
pub struct MoeRefs {
    /// `ffn_gate_inp.weight`.
    pub router: usize,
    /// The stacked gate, up and down expert tensors.
    pub experts: [usize; 3],
    /// Experts.
    pub n_expert: usize,
    /// Experts a token uses.
    pub n_used: usize,
    /// Each expert's feed-forward width.
    pub n_ff: usize,
    /// `moe_route`'s gating code.
    pub gating: i32,
    /// `exp_probs_b.bias`, if any.
    pub selection_bias: Option<usize>,
    /// Groups and groups used (0, 0: none).
    pub groups: (usize, usize),
    /// Whether the weights are renormalized.
    pub norm_weights: bool,
    /// What they are scaled by (1: not).
    pub weights_scale: f32,
    /// The shared expert, if any.
    pub shared: Option<SharedRefs>,
    /// The router's bias and the stacked gate, up and down biases (gpt-oss; the decode step
    /// only).
    pub biases: Option<(usize, [usize; 3])>,
}

/// A shared expert's matrices.
#[derive(Clone, Debug, PartialEq)]
pub struct SharedRefs {
    /// Gate, up and down.
    pub gate: usize,
    /// See `gate`.
    pub up: usize,
    /// See `gate`.
    pub down: usize,
    /// Its gate's logit row, when gated.
    pub gate_inp: Option<usize>,
    /// Its feed-forward width.
    pub n_ff: usize,
}

/// What the rotation kernels take past the plain angle: the cosines' and sines' magnitude
/// (the attention factor, or YaRN's) and YaRN's ramp (`ext_factor` 0: none).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeScaling {
    /// Multiplies every cosine and sine.
    pub mscale: f32,
    /// YaRN's extrapolation mix (0: the plain angle).
    pub ext_factor: f32,
    /// YaRN's correction dimensions.
    pub low: f32,
    /// See `low`.
    pub high: f32,
}

impl RopeScaling {
    /// The scaling of `rope`, from the one definition of YaRN's ramp.
    pub fn of(rope: &Rope) -> RopeScaling {
        match YarnRamp::of(rope) {
            Some(r) => RopeScaling {
                mscale: r.mscale,
                ext_factor: r.ext_factor,
                low: r.low,
                high: r.high,
            },
            None => RopeScaling {
                mscale: rope.attn_factor,
                ext_factor: 0.0,
                low: 0.0,
                high: 0.0,
            },
        }
    }

    /// Whether the rotation is the plain angle at magnitude 1 (what the fused Q/K/V rotation
    /// computes).
    pub fn is_plain(&self) -> bool {
        self.mscale == 1.0 && self.ext_factor == 0.0
    }

    /// The kernels' trailing arguments: `mscale, ext, low, high`.
    pub fn args(&self) -> [f32; 4] {
        [self.mscale, self.ext_factor, self.low, self.high]
    }
}

/// The activation of a gated feed-forward block the CUDA path serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GateActivation {
    /// `silu(gate) * up` (the llama family).
    Silu,
    /// `gelu(gate) * up` with the CPU's f16-table GELU (Gemma).
    Gelu,
    /// gpt-oss's clamped SwiGLU (the decode step only).
    SwigluOai,
}

impl GateActivation {
    /// The kernels' code for it (`GLU_SILU`, `GLU_GELU`).
    pub fn code(self) -> i32 {
        match self {
            GateActivation::Silu => 0,
            GateActivation::Gelu => 1,
            GateActivation::SwigluOai => 2,
        }
    }

    /// The element-wise kernel of `act(gate) * up` (`swiglu`, `geglu`; the batches' twins add
    /// `_f16` and `_pairs_f16`).
    pub fn kernel(self) -> &'static str {
        match self {
            GateActivation::Silu => "swiglu",
            GateActivation::Gelu => "geglu",
            GateActivation::SwigluOai => "swiglu_oai",
        }
    }
}

/// The expert product kernel for rows of `spec` (`moe_matvecf_T`: quantizing its f32 input
/// as it loads it, where the rows take quantized activations and the activations are
/// Runs of columns `moe_route_f32` splits each f32 router row into: the most of 8, 4, 2 that
/// leaves whole float4s in each, so that the whole matrix is read at once (a warp a run).
pub const ROUTER_MOST_PARTS: usize = 8;

/// [`ROUTER_MOST_PARTS`] or fewer for rows of `d` values.
pub fn router_parts(d: usize) -> usize {
    [8, 4, 2]
        .into_iter()
        .find(|&p| d.is_multiple_of(4 * p))
        .unwrap_or(1)
}

/// quantized; else `moe_matvec_T`).
pub fn expert_product_kernel(spec: &MatrixSpec, quantized_activations: bool) -> String {
    if quantized_activations && activation_format(spec.ty).is_some() {
        format!("moe_matvecf_{}", spec.kernel)
    } else {
        format!("moe_matvec_{}", spec.kernel)
    }
}

/// The launch-list entry of a tensor-parallel plan that sums every rank's `H` (its partial
/// row-parallel product, `n` f32) into every rank's `X`: an NCCL all-reduce on the devices,
/// not a kernel (such plans are emulated on the CPU; no device takes them yet).
pub const ALL_REDUCE: &str = "nccl_all_reduce_add";

/// The output head of a whole model on the device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Head {
    /// `output_norm.weight` (a vector).
    pub out_norm: usize,
    /// The output matrix (the embedding when tied).
    pub output: usize,
}

/// A decode step the CUDA path serves: the weights it reads, the buffer sizes, the launches.
#[derive(Clone, Debug)]
pub struct DecodePlan {
    /// Each layer's weights and shape, for the batched prompt pass.
    pub layers: Vec<LayerRefs>,
    /// `token_embd.weight`.
    pub embd: usize,
    /// The output norm and matrix, when the step ends with the logits (`None`: the first
    /// layers only, `--gpu-layers`).
    pub head: Option<Head>,
    /// Epsilon of every RMS norm.
    pub norm_eps: f32,
    /// Matrices, uploaded once.
    pub matrices: Vec<MatrixSpec>,
    /// Vectors, uploaded once as f32.
    pub vectors: Vec<VectorSpec>,
    /// The launches of one token, in order.
    pub launches: Vec<Launch>,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Vocabulary size (a tensor-parallel rank's part of it: the logits it computes).
    pub n_vocab: usize,
    /// The first of the vocabulary's ids this plan's logits are for (0 but on a tensor-parallel
    /// rank past the first).
    pub vocab_first: usize,
    /// Positions the KV cache holds.
    pub n_ctx: usize,
    /// Split-K factor of the attention.
    pub splits: usize,
    /// Largest query width over the layers.
    pub max_q: usize,
    /// Largest [`Buf::Attn`]: the query width, or a gated Q projection's twice that.
    pub max_attn: usize,
    /// The delta-net layers' largest buffers (zeros: none).
    pub delta: DeltaSizes,
    /// Largest key/value width over the layers.
    pub max_kv: usize,
    /// Largest feed-forward width over the layers.
    pub max_ff: usize,
    /// Largest `n_head * head_dim` partial buffer.
    pub max_part: usize,
    /// Largest `n_head * splits`.
    pub max_heads_splits: usize,
    /// Key/value width per layer (f16 cache rows).
    pub kv_dims: Vec<usize>,
    /// Most experts of a layer (the router's width; 0: no experts).
    pub max_experts: usize,
    /// Most experts a token uses in a layer.
    pub max_used: usize,
    /// What the embedded rows are multiplied by (Gemma, Granite).
    pub embedding_scale: Option<f32>,
    /// What the logits go through: the final soft cap (Gemma 2) and the logit scale they are
    /// divided by (Granite).
    pub logits: LogitAdjust,
    /// The layers whose last chosen experts the CPU computes (`None`: none; `cpu_tier.rs`).
    pub cpu_experts: Option<crate::cpu_tier::CpuExperts>,
    /// The layers whose chosen experts are staged from the slot cache (`None`: none;
    /// `slots.rs`).
    pub staged_experts: Option<crate::slots::StagedExperts>,
}

/// The largest delta-net buffers over the layers, in floats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DeltaSizes {
    /// [`Buf::DeltaIn`].
    pub input: usize,
    /// [`Buf::DeltaZ`].
    pub z: usize,
    /// [`Buf::DeltaBa`].
    pub gates: usize,
    /// [`Buf::DeltaAlpha`].
    pub alpha: usize,
    /// [`Buf::DeltaConv`].
    pub channels: usize,
    /// [`Buf::DeltaOut`].
    pub value: usize,
    /// Most key heads of a layer (a prompt's chunked delta rule keeps their Gram blocks).
    pub key_heads: usize,
}

/// The final soft cap and the logit scale, as the `adjust_logits` kernel takes them.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LogitAdjust {
    /// `tanh(x / cap) * cap` first (`None`: no cap).
    pub softcap: Option<f32>,
    /// Then `x / scale` (`None`: no scale).
    pub scale: Option<f32>,
}

impl LogitAdjust {
    /// Whether the logits are left as the output product gives them.
    pub fn is_none(&self) -> bool {
        self.softcap.is_none() && self.scale.is_none()
    }

    /// The kernel's arguments after the logits and their count: `inv_cap, cap, inv_scale`,
    /// the reciprocals rounded to f32 as the CPU rounds them.
    pub fn args(&self) -> [f32; 3] {
        let (inv_cap, cap) = self.softcap.map_or((0.0, 0.0), |c| (1.0 / c, c));
        [inv_cap, cap, self.scale.map_or(1.0, |s| 1.0 / s)]
    }
}

/// Draws the device holds at a time.
pub const SAMPLE_DRAWS: usize = 4096;

/// Slots of [`Buf::TokenRing`] (the kernels' TOKEN_RING, a power of two): steps the host may
/// queue before reading the first one's id.
pub const TOKEN_RING: usize = 4;

/// The most candidates the device sampler keeps (`top_k` at most this; more falls back to the
/// host's sampler).
pub const SAMPLE_MAX_K: usize = 256;

/// Rows of a matrix-vector block (`ROWS` in the kernels; the gate/up kernel: 2 of each).
pub const MATVEC_ROWS: usize = 4;

/// A product kernel's name: `NAME_TYPE` for f32 inputs, `NAMEq_TYPE` for quantized ones.
fn product_kernel(name: &str, spec: &MatrixSpec, x: Buf) -> String {
    let q = if x == Buf::Xq { "q" } else { "" };
    format!("{name}{q}_{}", spec.kernel)
}

/// The ratio of one RoPE pair's frequency to the previous one's, `freq_base^(-2 / n_dims)`,
/// computed on the host as the CPU computes it (the kernels multiply it up pair by pair).
pub fn theta_scale(freq_base: f32, n_dims: usize) -> f32 {
    freq_base.powf(-2.0 / n_dims as f32)
}

/// The positions a split of the decode attention takes at least (the kernel's ATTN_TILE, a
/// position a thread of its block).
pub const ATTN_TILE: usize = 128;

/// The warps of an `attn_split_warps` block (the kernels' ATTN_WARPS).
pub const ATTN_WARPS: usize = 16;

/// The split-K factor for a context of `n_ctx` positions, a split per `tile` positions at full
/// length: the grid's width, at least 1 and at most 16. Each step the kernel uses a split per
/// `tile` visible positions, up to this many, so a short cache needs no merge.
pub fn splits_for(n_ctx: usize, tile: usize) -> usize {
    n_ctx.div_ceil(tile).clamp(1, 16)
}

/// What the decode products multiply the weights with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activations {
    /// Quantized as the CPU quantizes them (Q8_0, Q8_1 or Q8_K for the row type), with
    /// integer dot products, wherever every matrix reading an input shares one format.
    Quantized,
    /// f32 everywhere (to compare).
    F32,
}

/// The kernels' code (`ACT_*`) for the format the CPU quantizes activations to before
/// multiplying them with rows of `ty` (llama.cpp's `vec_dot_type`), or `None` for rows
/// multiplied with floats. The block types of `QUANTIZED_TYPES` in the kernels.
pub fn activation_format(ty: TensorType) -> Option<i32> {
    match ferrolm_quant::vec_dot_type(ty).ok()? {
        TensorType::Q8_0 => Some(3),
        TensorType::Q8_1 => Some(4),
        TensorType::Q8_K => Some(5),
        _ => None,
    }
}

/// How a block's output joins the residual stream: its post-norm (Gemma), its scale (Granite)
/// and the norms' epsilon.
#[derive(Clone, Copy)]
struct BlockEnd {
    post_norm: Option<usize>,
    scale: f32,
    eps: f32,
}

/// Where an attention layer sits: its index, the model's width, the context, the decode
/// attention's splits and its input norm's weights.
struct AttentionAt {
    layer: usize,
    d: usize,
    n_ctx: usize,
    splits: usize,
    attn_norm: usize,
}

struct Builder {
    matrices: Vec<MatrixSpec>,
    vectors: Vec<VectorSpec>,
    launches: Vec<Launch>,
    activations: Activations,
    /// Which of the tensor-parallel ranks the plan is for.
    rank: Rank,
    /// The switches and sizes (the largest residual product that quantizes its input as it
    /// loads it, [`Builder::product_of_f32`]; staging, [`staged_product`]; repacking).
    tuning: CudaTuning,
}

/// One of `of` tensor-parallel ranks (one GPU each; docs/ARCHITECTURE.md, "Several GPUs"):
/// its share of each layer's heads and feed-forward rows, of the vocabulary's logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rank {
    /// This rank.
    pub index: usize,
    /// Ranks in all.
    pub of: usize,
}

impl Rank {
    /// The whole model on one device.
    pub const ONE: Rank = Rank { index: 0, of: 1 };

    /// How many of `n` units that split evenly this rank takes (the `index`-th run of them),
    /// or the decline naming `field`.
    fn share(&self, n: usize, field: &str) -> Result<usize, Decline> {
        if !n.is_multiple_of(self.of) {
            return Err(decline(
                field,
                format!("{n}, not a multiple of {} ranks", self.of),
            ));
        }
        Ok(n / self.of)
    }

    /// This rank's part of `n` (the vocabulary's rows): as even as they come.
    fn part(&self, n: usize) -> (usize, usize) {
        let first = self.index * n / self.of;
        (first, (self.index + 1) * n / self.of - first)
    }
}

/// Dynamic shared memory a block may use without asking for more.
const SHARED_DEFAULT: usize = 48 * 1024;

/// The staged twin of product kernel `kernel` (`NAMEq_Q4_K` -> `NAMEs_Q4_K`) and its shared
/// memory, for rows of `row_bytes`: a block's [`MATVEC_ROWS`] rows copied into shared memory by
/// the copy engine before the kernel waits for its input (kernels.cu, `rows_dot`). Rows of the
/// [`STAGED_TYPES`] only, of 16-byte multiples (the bulk copy's unit), when a block's rows fit
/// in the default 48 KiB.
pub fn staged_product(kernel: &str, row_bytes: usize) -> Option<(String, u32)> {
    let (base, ty) = STAGED_TYPES
        .iter()
        .find_map(|t| Some((kernel.strip_suffix(&format!("q_{t}"))?, t)))?;
    let bytes = MATVEC_ROWS * row_bytes;
    (row_bytes.is_multiple_of(16) && bytes <= SHARED_DEFAULT)
        .then(|| (format!("{base}s_{ty}"), bytes as u32))
}

/// The kernel types whose products can stage their rows (a `fetch<SHARED>` in kernels.cu).
const STAGED_TYPES: [&str; 4] = ["Q4_K", "Q6_KR", "Q8_0R", "Q4_0"];

/// The (Q and K, V) kernel types whose three products share one launch though V's type
/// differs (`matvec3q_{Q}_{V}`, `matvec3rq_..`, staged `s` where both types stage: kernels.cu's
/// MIXED_QKV): the mixes llama-quantize writes (Gemma 3 270M's Q5_0 with Q8_0 values, Q4_K_M's
/// Q4_K with Q6_K values), a launch fewer in each such layer.
pub const MIXED_QKV: [(&str, &str); 4] = [
    ("Q5_0", "Q8_0"),
    ("Q5_0", "Q8_0R"),
    ("Q4_K", "Q6_KR"),
    ("Q4_K", "Q6_K"),
];

/// The kernel of the mixed launch [`MIXED_QKV`] names for a pair: `base` (`matvec3` or
/// `matvec3r`), staged (`s`) or reading its rows from global memory (`q`).
pub fn mixed_qkv_kernel(base: &str, (qk, v): (&str, &str), staged: bool) -> String {
    format!("{base}{}_{qk}_{v}", if staged { "s" } else { "q" })
}

impl Builder {
    /// The bound matrix `w` whole (`rows x cols`), labelled `label`.
    fn matrix(
        &mut self,
        w: &Matrix,
        label: String,
        rows: usize,
        cols: usize,
    ) -> Result<usize, Decline> {
        self.matrix_rows(w, label, 0, rows, cols)
    }

    /// Rows `first_row..first_row + rows` of the bound matrix `w` (counted from its own first
    /// row: a fused tensor's view starts where the binding put it) as a matrix of their own.
    fn matrix_rows(
        &mut self,
        w: &Matrix,
        label: String,
        first_row: usize,
        rows: usize,
        cols: usize,
    ) -> Result<usize, Decline> {
        let ty = w.ty;
        let Some(plain) = kernel_type(ty) else {
            return Err(decline(format!("{label} ({})", w.name), ty.name()));
        };
        if !cols.is_multiple_of(32) || !cols.is_multiple_of(ty.block_size()) {
            return Err(decline(format!("{label} columns"), cols));
        }
        // (the binding checked the shapes against the plan; a view past them is a wiring
        // mistake here, refused rather than read out of bounds on the device)
        let tensor = w.tensor_range();
        let first_row = w.first_row() + first_row;
        let tensor_rows = tensor.len() / w.row_bytes.max(1);
        if cols > w.cols || first_row + rows > tensor_rows {
            return Err(decline(
                format!("{label} ({})", w.name),
                format!(
                    "rows {first_row}..{} of {cols} columns, {tensor_rows} of {} bound",
                    first_row + rows,
                    w.cols
                ),
            ));
        }
        self.matrices.push(MatrixSpec {
            label,
            tensor,
            first_row,
            first_col: 0,
            tensor_cols: cols,
            experts: 1,
            ty,
            rows,
            cols,
            kernel: self
                .tuning
                .repack
                .then(|| crate::repack::repacked_type(ty, cols))
                .flatten()
                .unwrap_or(plain),
        });
        Ok(self.matrices.len() - 1)
    }

    /// Columns `first_col..first_col + cols` of every row of the bound matrix `w`
    /// (`tensor_cols` wide) as a matrix of their own: a rank's part of a row-parallel product.
    fn matrix_cols(
        &mut self,
        w: &Matrix,
        label: String,
        rows: usize,
        (first_col, cols, tensor_cols): (usize, usize, usize),
    ) -> Result<usize, Decline> {
        if first_col + cols > tensor_cols || tensor_cols != w.cols {
            return Err(decline(
                format!("{label} ({})", w.name),
                format!("columns {first_col}..{} of {}", first_col + cols, w.cols),
            ));
        }
        let m = self.matrix_rows(w, label.clone(), 0, rows, cols)?;
        let spec = &mut self.matrices[m];
        if !first_col.is_multiple_of(spec.ty.block_size()) {
            return Err(decline(format!("{label} columns"), first_col));
        }
        spec.first_col = first_col;
        spec.tensor_cols = tensor_cols;
        Ok(m)
    }

    /// A row-parallel product's output into the residual stream: the block's own (one rank),
    /// or this rank's partial sum into `H` and their sum over the ranks added to `X`
    /// ([`ALL_REDUCE`]).
    fn reduced_output(&mut self, m: usize, x: Buf, bias: Option<usize>, end: BlockEnd) {
        if self.rank.of == 1 {
            return self.block_output(m, x, bias, end);
        }
        let d = self.matrices[m].rows;
        self.product_of_f32(m, x, bias, None, Buf::H);
        self.push(
            ALL_REDUCE,
            (1, 1),
            0,
            vec![Arg::Buf(Buf::H), Arg::Buf(Buf::X), Arg::I32(d as i32)],
        );
    }

    /// The bound vector `v` of `len` values, labelled `label`.
    fn vector(&mut self, v: &Vector, label: String, len: usize) -> Result<usize, Decline> {
        if v.len() != len {
            return Err(decline(
                label,
                format!("{} values, {len} expected", v.len()),
            ));
        }
        self.vectors.push(VectorSpec {
            label,
            values: v.clone(),
        });
        Ok(self.vectors.len() - 1)
    }

    /// [`Builder::vector`] of `v` where the plan wants it (`wanted`), which the binding bound.
    fn opt_vector(
        &mut self,
        wanted: bool,
        v: &Option<Vector>,
        label: String,
        len: usize,
    ) -> Result<Option<usize>, Decline> {
        match (wanted, v) {
            (false, _) => Ok(None),
            (true, Some(v)) => self.vector(v, label, len).map(Some),
            (true, None) => Err(decline(label, "not bound")),
        }
    }

    fn push(&mut self, kernel: impl Into<String>, grid: (u32, u32), block: u32, args: Vec<Arg>) {
        self.launches.push(Launch {
            kernel: kernel.into(),
            grid,
            block,
            args,
            shared: 0,
        });
    }

    /// [`Builder::push`] for a product over rows of `row_bytes`: its staged twin where there is
    /// one ([`staged_product`]).
    fn push_rows(
        &mut self,
        kernel: String,
        row_bytes: usize,
        grid: (u32, u32),
        block: u32,
        args: Vec<Arg>,
    ) {
        let staged = self
            .tuning
            .stage
            .then(|| staged_product(&kernel, row_bytes))
            .flatten();
        let (kernel, shared) = staged.unwrap_or((kernel, 0));
        self.launches.push(Launch {
            kernel,
            grid,
            block,
            args,
            shared,
        });
    }

    /// `y = W x (+ bias) (+ res)`.
    fn matvec(&mut self, m: usize, x: Buf, bias: Option<usize>, res: Option<Buf>, y: Buf) {
        let kernel = product_kernel("matvec", &self.matrices[m], x);
        self.push_product(kernel, m, x, bias, res, y);
    }

    /// `y = W x (+ bias) (+ res)` for f32 `x`, the input of no other product: W's blocks
    /// quantize x as they load it (`matvecf`) when W is small (rows x columns at most
    /// `on_load_max`; every block reads all of x, rows x columns bytes from L2 in all), which
    /// costs less than a quantize_act launch; else quantize_act, then the product.
    fn product_of_f32(&mut self, m: usize, x: Buf, bias: Option<usize>, res: Option<Buf>, y: Buf) {
        let spec = &self.matrices[m];
        if self.shared_format(&[m]).is_some()
            && spec.rows * spec.cols <= self.tuning.quantize_on_load_max
        {
            let kernel = format!("matvecf_{}", spec.kernel);
            self.push_product(kernel, m, x, bias, res, y);
        } else {
            let cols = spec.cols;
            let x = self.input_for(x, cols, &[m]);
            self.matvec(m, x, bias, res, y);
        }
    }

    /// A block's output `W x` into the residual stream: added by the product itself, or, with
    /// a post-norm (Gemma) or a residual scale (Granite), written to [`Buf::H`] (free by then:
    /// the block's products have read their input) and added by `post_norm_add`.
    fn block_output(&mut self, m: usize, x: Buf, bias: Option<usize>, end: BlockEnd) {
        let BlockEnd {
            post_norm,
            scale,
            eps,
        } = end;
        if post_norm.is_none() && scale == 1.0 {
            return self.product_of_f32(m, x, bias, Some(Buf::X), Buf::X);
        }
        let d = self.matrices[m].rows;
        self.product_of_f32(m, x, bias, None, Buf::H);
        self.push(
            "post_norm_add",
            (1, 1),
            norm_threads(d),
            vec![
                Arg::Buf(Buf::H),
                post_norm.map_or(Arg::Null, |w| Arg::Buf(Buf::Vector(w))),
                Arg::Buf(Buf::X),
                Arg::I32(d as i32),
                Arg::F32(eps),
                Arg::F32(scale),
            ],
        );
    }

    /// Layer `at.layer`'s attention, from its input norm to the residual add: the Q, K and V
    /// products, the rotation and the cache store, the attention, the gate (Qwen3-Next) and the
    /// output product. `rope_freqs` holds the frequency divisors' vector once one layer made it.
    fn attention(
        &mut self,
        (attention, w, weights): (&Attention, &AttentionWeights, &Weights),
        at: &AttentionAt,
        end: BlockEnd,
        rope_freqs: &mut Option<usize>,
    ) -> Result<AttentionRefs, Decline> {
        let b = self;
        let AttentionWeights {
            wq: q_w,
            wk: k_w,
            wv: v_w,
            wo: o_w,
            bq: bq_w,
            bk: bk_w,
            bv: bv_w,
            q_norm: q_norm_w,
            k_norm: k_norm_w,
            bo: bo_w,
            sinks: sinks_w,
        } = w;
        let Attention {
            n_head,
            n_head_kv,
            head_dim,
            qkv_bias,
            qk_norm,
            rope,
            scale,
            // Scaling the queries or the scores is the same product in f32 (but not under a
            // soft cap, below).
            scale_queries,
            softcap,
            sliding_window,
            gated_output,
            sinks,
            out_bias,
        } = attention;
        // The kernels cap the scaled score, as the CPU does when the queries are scaled.
        let softcap = match *softcap {
            Some(c) if !*scale_queries || !c.is_finite() || c <= 0.0 => {
                return Err(decline("attention.softcap", c));
            }
            c => c.unwrap_or(0.0),
        };
        let window = sliding_window.unwrap_or(0);
        if window > i32::MAX as usize {
            return Err(decline("attention.sliding_window", window));
        }
        let Rope {
            layout,
            n_dims,
            freq_base,
            freq_scale,
            freq_factors,
            long_rope,
            attn_factor,
            yarn,
        } = rope;
        // (the scaling's fields are read together, by RopeScaling::of)
        let _ = (yarn, attn_factor);
        let rope_scaling = RopeScaling::of(rope);
        if !rope_scaling.args().iter().all(|v| v.is_finite()) {
            return Err(decline("attention.rope.attn_factor", attn_factor));
        }
        let (nh, nkv, hd) = (*n_head, *n_head_kv, *head_dim);
        if hd == 0 || !hd.is_multiple_of(32) || hd > 256 {
            return Err(decline("attention.head_dim", hd));
        }
        if nkv == 0 || !nh.is_multiple_of(nkv) {
            return Err(decline("attention.n_head_kv", nkv));
        }
        if *n_dims > hd || !n_dims.is_multiple_of(2) {
            return Err(decline("attention.rope.n_dims", n_dims));
        }
        let neox = match layout {
            RopeLayout::Normal => 0,
            RopeLayout::Neox => 1,
        };
        // A tensor-parallel rank's heads (column-parallel Q, K, V; row-parallel output).
        let rank = b.rank;
        if rank.of > 1 && (*qkv_bias || *gated_output || *sinks || *out_bias) {
            return Err(decline("attention", "biases, gates or sinks across ranks"));
        }
        let q_all = nh * hd;
        let (nh, nkv) = (
            rank.share(nh, "attention.n_head")?,
            rank.share(nkv, "attention.n_head_kv")?,
        );
        let (q_dim, kv_dim) = (nh * hd, nkv * hd);
        // A gated output: the Q projection gives per head the query, then as many gates.
        let q_rows = if *gated_output { 2 * q_dim } else { q_dim };
        let AttentionAt {
            layer: l,
            d,
            n_ctx,
            splits,
            attn_norm,
        } = *at;
        let label = |what: &str| format!("layer {l} attention {what}");

        // A rank's rows of Q, K and V (all of them for one rank). Fused Q/K/V (Phi-3's
        // `attn_qkv`) are the binding's row views: one rank takes them as they are.
        if rank.of > 1 && ![q_w, k_w, v_w].iter().all(|m| m.is_whole()) {
            return Err(decline(
                "attention",
                "fused Q/K/V rows (Phi-3) across ranks",
            ));
        }
        let r = rank.index;
        let (wq, wk, wv) = (
            b.matrix_rows(q_w, label("q"), r * q_rows, q_rows, d)?,
            b.matrix_rows(k_w, label("k"), r * kv_dim, kv_dim, d)?,
            b.matrix_rows(v_w, label("v"), r * kv_dim, kv_dim, d)?,
        );
        let h = b.norm_for(Buf::X, attn_norm, d, end.eps, &[wq, wk, wv]);
        let bq = b.opt_vector(*qkv_bias, bq_w, label("q bias"), q_rows)?;
        let bk = b.opt_vector(*qkv_bias, bk_w, label("k bias"), kv_dim)?;
        let bv = b.opt_vector(*qkv_bias, bv_w, label("v bias"), kv_dim)?;
        // The divisors the CPU reads for this context: LongRoPE's long or short set, or Llama
        // 3's factors (one vector for every layer).
        let ff_index = if long_rope.is_some() || *freq_factors {
            let divisors = weights
                .rope_factors(rope, n_ctx)
                .ok_or_else(|| decline("attention.rope.freq_factors", "not bound"))?;
            Some(match *rope_freqs {
                Some(i) => i,
                None => {
                    let i = b.vector(divisors, "RoPE frequency divisors".into(), n_dims / 2)?;
                    *rope_freqs.insert(i)
                }
            })
        } else {
            None
        };
        let ff = ff_index.map_or(Arg::Null, |i| Arg::Buf(Buf::Vector(i)));
        let theta = Arg::F32(theta_scale(*freq_base, *n_dims));
        let vector_arg = |v: Option<usize>| v.map_or(Arg::Null, |i| Arg::Buf(Buf::Vector(i)));
        let qn = vector_arg(b.opt_vector(*qk_norm, q_norm_w, label("q norm"), hd)?);
        let kn = vector_arg(b.opt_vector(*qk_norm, k_norm_w, label("k norm"), hd)?);
        // (a warp per position a block's warps take, where a lane holds 4 or 8 of a head's
        // values; the tiles, a position a thread, otherwise)
        let warps = b.tuning.warp_attention && matches!(hd, 128 | 256);
        // what the attention takes to rotate and store the token itself, where it does
        let mut rotated_by_attention: Option<Vec<Arg>> = None;
        if !*qk_norm && neox == 0 && rope_scaling.is_plain() && !*gated_output {
            // Adjacent rows are rotation pairs: the products rotate and store themselves.
            let rope = [
                Arg::I32(kv_dim as i32),
                Arg::I32(hd as i32),
                Arg::I32(*n_dims as i32),
                theta,
                Arg::F32(*freq_scale),
                ff,
            ];
            b.qkv_rope([(wq, bq), (wk, bk), (wv, bv)], h, l, rope);
        } else {
            // A gated projection goes to Attn (free until the attention writes it), then
            // apart into the queries and the gates.
            let q_out = if *gated_output { Buf::Attn } else { Buf::Q };
            b.matvec3(&[(wq, bq, q_out), (wk, bk, Buf::K), (wv, bv, Buf::V)], h);
            if *gated_output {
                b.push(
                    "split_query_gate",
                    (q_dim.div_ceil(256) as u32, 1),
                    256,
                    vec![
                        Arg::Buf(Buf::Attn),
                        Arg::Buf(Buf::Q),
                        Arg::Buf(Buf::AttnGate),
                        Arg::I32(nh as i32),
                        Arg::I32(hd as i32),
                    ],
                );
            }
            // (the rotation's own arguments: both kernels that rotate end with these)
            let rotation: Vec<Arg> = [
                Arg::I32(*n_dims as i32),
                Arg::I32(neox),
                theta,
                Arg::F32(*freq_scale),
                ff,
                Arg::F32(end.eps),
            ]
            .into_iter()
            .chain(rope_scaling.args().map(Arg::F32))
            .collect();
            let raw = [Arg::Buf(Buf::K), Arg::Buf(Buf::V), qn, kn];
            if warps && b.tuning.rope_in_attention {
                rotated_by_attention = Some(raw.into_iter().chain(rotation).collect());
            } else {
                let caches = [
                    Arg::Buf(Buf::KCache(l)),
                    Arg::Buf(Buf::VCache(l)),
                    Arg::Buf(Buf::Pos),
                    Arg::I32(nh as i32),
                    Arg::I32(nkv as i32),
                    Arg::I32(hd as i32),
                ];
                let args = [Arg::Buf(Buf::Q)]
                    .into_iter()
                    .chain(raw)
                    .chain(caches)
                    .chain(rotation)
                    .collect();
                b.push("rope_store", ((nh + nkv) as u32, 1), 128, args);
            }
        }
        let wo_cols = (rank.index * q_dim, q_dim, q_all);
        let wo = b.matrix_cols(o_w, label("output"), d, wo_cols)?;
        let sink_logits = b.opt_vector(*sinks, sinks_w, label("sinks"), nh)?;
        let wo_bias = b.opt_vector(*out_bias, bo_w, label("output bias"), d)?;
        let mut attn_args = vec![
            Arg::Buf(Buf::Q),
            Arg::Buf(Buf::KCache(l)),
            Arg::Buf(Buf::VCache(l)),
            Arg::Buf(Buf::Pos),
            Arg::Buf(Buf::PartO),
            Arg::Buf(Buf::PartMl),
            Arg::Buf(Buf::Done),
            Arg::Buf(Buf::Attn),
            Arg::I32(nh as i32),
            Arg::I32(nkv as i32),
            Arg::I32(hd as i32),
            Arg::I32(splits as i32),
            Arg::F32(*scale),
            Arg::F32(softcap),
            Arg::I32(window as i32),
            sink_logits.map_or(Arg::Null, |v| Arg::Buf(Buf::Vector(v))),
            Arg::I32(ATTN_TILE as i32),
            Arg::Null,
            Arg::I32(0),
        ];
        let kernel = match rotated_by_attention {
            // (the raw K and V, the norms, then the rotation's arguments)
            Some(r) => {
                attn_args.extend(r);
                "attn_rope_split_warps"
            }
            None if warps => "attn_split_warps",
            None => "attn_split",
        };
        let block = if warps { 32 * ATTN_WARPS as u32 } else { 128 };
        b.push(kernel, (nh as u32, splits as u32), block, attn_args);
        if *gated_output {
            b.push(
                "sigmoid_mul",
                (q_dim.div_ceil(256) as u32, 1),
                256,
                vec![
                    Arg::Buf(Buf::Attn),
                    Arg::Buf(Buf::AttnGate),
                    Arg::I32(q_dim as i32),
                    Arg::Null,
                    Arg::I32(0),
                ],
            );
        }
        // The attention's output is quantized by the output product's blocks or by a launch of
        // its own: with overlapped launches either costs less than the attention quantizing
        // it (counters and fences in every block, the completing block's work in series;
        // measured, PERFORMANCE.md).
        b.reduced_output(wo, Buf::Attn, wo_bias, end);
        let vector_of = |a: Arg| match a {
            Arg::Buf(Buf::Vector(i)) => Some(i),
            _ => None,
        };
        Ok(AttentionRefs {
            qkv: [wq, wk, wv],
            qkv_bias: bq.zip(bk).zip(bv).map(|((q, k), v)| [q, k, v]),
            qk_norm: vector_of(qn).zip(vector_of(kn)).map(|(q, k)| [q, k]),
            wo,
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            n_dims: *n_dims,
            neox: neox == 1,
            freq_base: *freq_base,
            freq_scale: *freq_scale,
            freq_factors: ff_index,
            rope_scaling,
            scale: *scale,
            window,
            softcap,
            gated_output: *gated_output,
            sinks: sink_logits,
            out_bias: wo_bias,
        })
    }

    /// Layer `l`'s gated delta-net, from its input norm to the residual add: the input and
    /// gate projections, `delta_conv` (the convolution, its state advanced), `delta_rule`
    /// (per value head the state's update, read-out and gated norm) and `ssm_out`.
    fn delta_net(
        &mut self,
        (net, w): (&DeltaNet, &DeltaNetWeights),
        l: usize,
        attn_norm: usize,
        end: BlockEnd,
    ) -> Result<DeltaNetRefs, Decline> {
        let DeltaNet {
            n_k_heads: hk,
            n_v_heads: hv,
            key_heads,
            head_dim: s,
            conv_kernel: taps,
        } = *net;
        // A thread per value dimension (the kernel's shared rows hold 256).
        if s == 0 || !s.is_multiple_of(32) || s > 256 {
            return Err(decline("delta_net.head_dim", s));
        }
        if hk == 0 || !hv.is_multiple_of(hk) || hv == 0 {
            return Err(decline("delta_net.n_v_heads", format!("{hv} over {hk}")));
        }
        // (delta_conv_rows' runs of tokens: at least taps - 1 long)
        if taps == 0 || taps > 16 {
            return Err(decline("delta_net.conv_kernel", taps));
        }
        let DeltaNetWeights {
            input: input_w,
            gates: gates_w,
            conv: conv_w,
            dt_bias: dt_bias_w,
            a: a_w,
            norm: norm_w,
            out: out_w,
        } = w;
        let d = self.matrices[0].cols;
        let label = |what: &str| format!("layer {l} delta-net {what}");
        let (key_dim, value_dim) = (hk * s, hv * s);
        let channels = net.conv_channels();
        let input = match input_w {
            DeltaNetInput::Split { qkv, gate } => DeltaNetProjection::Split(
                self.matrix(qkv, label("qkv"), channels, d)?,
                self.matrix(gate, label("gate"), value_dim, d)?,
            ),
            DeltaNetInput::Fused(m) => {
                let rows = 2 * key_dim + 2 * value_dim;
                DeltaNetProjection::Fused(self.matrix(m, label("input"), rows, d)?)
            }
        };
        let gates = match gates_w {
            DeltaNetGates::Split { beta, alpha } => DeltaNetProjection::Split(
                self.matrix(beta, label("beta"), hv, d)?,
                self.matrix(alpha, label("alpha"), hv, d)?,
            ),
            DeltaNetGates::Fused(m) => {
                DeltaNetProjection::Fused(self.matrix(m, label("beta and alpha"), 2 * hv, d)?)
            }
        };
        let conv = self.vector(conv_w, label("convolution"), channels * taps)?;
        let dt_bias = self.vector(dt_bias_w, label("dt bias"), hv)?;
        let a = self.vector(a_w, label("a"), hv)?;
        let norm = self.vector(norm_w, label("norm"), s)?;
        let out = self.matrix(out_w, label("output"), d, value_dim)?;
        let products = |p: DeltaNetProjection, first: Buf, second: Buf| match p {
            DeltaNetProjection::Fused(m) => vec![(m, first)],
            DeltaNetProjection::Split(m1, m2) => vec![(m1, first), (m2, second)],
        };
        let mut all = products(input, Buf::DeltaIn, Buf::DeltaZ);
        all.extend(products(gates, Buf::DeltaBa, Buf::DeltaAlpha));
        let mats: Vec<usize> = all.iter().map(|p| p.0).collect();
        let h = self.norm_for(Buf::X, attn_norm, d, end.eps, &mats);
        // (the input and gate projections in one launch where they share a type)
        let parts: Vec<_> = all.iter().map(|&(m, y)| (m, None, y)).collect();
        self.matvec3(&parts, h);
        let fused = matches!(input, DeltaNetProjection::Fused(_));
        self.push(
            "delta_conv",
            (channels.div_ceil(128) as u32, 1),
            128,
            vec![
                Arg::Buf(Buf::DeltaIn),
                Arg::I32(i32::from(fused)),
                Arg::Buf(Buf::Vector(conv)),
                Arg::Buf(Buf::ConvState(l)),
                Arg::Buf(Buf::Pos),
                Arg::Buf(Buf::DeltaConv),
                Arg::I32(channels as i32),
                Arg::I32(taps as i32),
                Arg::I32(key_dim as i32),
                Arg::I32(s as i32),
                Arg::I32((hv / hk) as i32),
            ],
        );
        let split_gates = matches!(gates, DeltaNetProjection::Split(..));
        self.push(
            "delta_rule",
            (hv as u32, 1),
            s as u32,
            vec![
                Arg::Buf(Buf::DeltaConv),
                Arg::Buf(Buf::DeltaBa),
                if split_gates {
                    Arg::Buf(Buf::DeltaAlpha)
                } else {
                    Arg::Null
                },
                Arg::Buf(Buf::Vector(dt_bias)),
                Arg::Buf(Buf::Vector(a)),
                Arg::Buf(Buf::Vector(norm)),
                Arg::Buf(Buf::DeltaIn),
                if fused {
                    Arg::Null
                } else {
                    Arg::Buf(Buf::DeltaZ)
                },
                Arg::Buf(Buf::SsmState(l)),
                Arg::Buf(Buf::Pos),
                Arg::Buf(Buf::DeltaOut),
                Arg::I32(hk as i32),
                Arg::I32(hv as i32),
                Arg::I32(s as i32),
                Arg::I32(i32::from(key_heads == KeyHeads::Tiled)),
                Arg::F32(end.eps),
                Arg::Null,
                Arg::I32(0),
                Arg::I32(if self.tuning.delta_runs { 16 } else { 1 }),
            ],
        );
        self.block_output(out, Buf::DeltaOut, None, end);
        Ok(DeltaNetRefs {
            input,
            gates,
            conv,
            dt_bias,
            a,
            norm,
            out,
            n_k_heads: hk,
            n_v_heads: hv,
            head_dim: s,
            conv_kernel: taps,
            tiled_key_heads: key_heads == KeyHeads::Tiled,
        })
    }

    /// `n_expert` matrices of `rows x cols` stacked in one tensor (`ffn_*_exps`), read in
    /// their file layout (an expert's rows `rows x row_bytes` from the previous one's).
    fn experts(
        &mut self,
        stack: &[Matrix],
        label: String,
        n_expert: usize,
        rows: usize,
        cols: usize,
    ) -> Result<usize, Decline> {
        // (the binding's experts are row views of one 3-D tensor, in order)
        let Some(first) = stack.first().filter(|_| stack.len() == n_expert) else {
            return Err(decline(
                label,
                format!("{} of {n_expert} experts", stack.len()),
            ));
        };
        let in_order = stack
            .iter()
            .enumerate()
            .all(|(e, m)| m.tensor_range() == first.tensor_range() && m.first_row() == e * rows);
        if !in_order {
            return Err(decline(label, "experts that are not one stack in order"));
        }
        let m = self.matrix_rows(first, label, 0, n_expert * rows, cols)?;
        let spec = &mut self.matrices[m];
        spec.kernel = kernel_type(spec.ty).expect("checked by matrix");
        spec.experts = n_expert;
        Ok(m)
    }

    /// Layer `l`'s mixture of experts, from its norm to the residual add: the router, the
    /// routing (`moe_route`), the chosen experts' gate/up and down products (a grid row per
    /// chosen expert, its rows found from the ids on the device), the shared expert, and the
    /// weighted sum into the residual stream (`moe_combine`). Returns what the batched
    /// passes read of it.
    #[allow(clippy::too_many_arguments)]
    fn moe(
        &mut self,
        (m, w): (&Moe, &FfnWeights),
        l: usize,
        d: usize,
        ffn_norm: usize,
        eps: f32,
        act: GateActivation,
    ) -> Result<MoeRefs, Decline> {
        let Moe {
            n_expert: ne,
            n_expert_used: k,
            n_ff,
            activation: _,
            gating,
            selection_bias,
            groups,
            biases,
            norm_weights,
            weights_scale,
            shared,
        } = *m;
        let FfnWeights::Moe {
            router: router_w,
            gate: gate_w,
            up: up_w,
            down: down_w,
            shared: shared_w,
            biases: biases_w,
        } = w
        else {
            return Err(decline(
                format!("layer {l} ffn"),
                "dense weights for experts",
            ));
        };
        let MoeBiases {
            router: router_bias_w,
            selection: selection_w,
            gate: gate_bias_w,
            up: up_bias_w,
            down: down_bias_w,
        } = &**biases_w;
        let label = |what: &str| format!("layer {l} experts' {what}");
        if ne == 0 || ne > 1024 || k == 0 || k > ne {
            return Err(decline("ffn.moe.n_expert_used", format!("{k} of {ne}")));
        }
        let (n_group, n_group_used) = groups.map_or((0, 0), |g| (g.n_group, g.n_group_used));
        if n_group > 64 {
            return Err(decline("ffn.moe.groups", n_group));
        }
        let router = self.matrix(router_w, label("router"), ne, d)?;
        let gate = self.experts(gate_w, label("gate"), ne, n_ff, d)?;
        let up = self.experts(up_w, label("up"), ne, n_ff, d)?;
        let down = self.experts(down_w, label("down"), ne, d, n_ff)?;
        let bias = self.opt_vector(selection_bias, selection_w, label("selection bias"), ne)?;
        // gpt-oss's router and experts' biases.
        let router_bias = self.opt_vector(biases, router_bias_w, label("router bias"), ne)?;
        let gate_bias = self.opt_vector(biases, gate_bias_w, label("gate bias"), ne * n_ff)?;
        let up_bias = self.opt_vector(biases, up_bias_w, label("up bias"), ne * n_ff)?;
        let down_bias = self.opt_vector(biases, down_bias_w, label("down bias"), ne * d)?;
        let expert_biases = gate_bias
            .zip(up_bias)
            .zip(down_bias)
            .map(|((g, u), d)| [g, u, d]);
        // The normed input in f32 (H); each product's quantized copy in Xq, made again only
        // when the format changes (`held`: what Xq holds now). The router's copy comes from
        // the norm's launch (`rms_norm_fq`); an f32 router's, the experts' gate and up read
        // (one fewer launch than a quantize_act after the routing).
        let glu_format = (self.matrices[gate].ty == self.matrices[up].ty
            && expert_biases.is_none())
        .then(|| self.shared_format(&[gate, up]))
        .flatten();
        let norm_format = self.shared_format(&[router]).or(glu_format);
        self.rms_norm_f32_and(ffn_norm, d, eps, norm_format);
        let mut held = norm_format;
        let mut input = |b: &mut Builder, mats: &[usize]| match b.shared_format(mats) {
            None => Buf::H,
            Some(f) if held == Some(f) => Buf::Xq,
            Some(f) => {
                held = Some(f);
                b.input_for(Buf::H, d, mats)
            }
        };
        let x = input(self, &[router]);
        // An f32 router of at most 1024 rows without a bias: its product in the routing's
        // launch where the tuning asks for it (`moe_route_f32`).
        let joined = self.tuning.router_in_route
            && self.matrices[router].ty == TensorType::F32
            && router_bias.is_none()
            && x == Buf::H
            && ne <= 1024
            && d.is_multiple_of(4);
        if !joined {
            self.matvec(router, x, router_bias, None, Buf::Router);
        }
        let gating = match gating {
            Gating::Softmax => 0,
            Gating::Sigmoid => 1,
            Gating::SoftmaxAfterTopK => 2,
        };
        // (moe_route_f32: a warp a run of a router row's columns, and a thread an expert in the
        // block that routes)
        let parts = router_parts(d);
        let (kernel, grid, threads) = if joined {
            let threads = ne.next_multiple_of(32).max(128);
            (
                "moe_route_f32",
                (ne * parts).div_ceil(threads / 32),
                threads,
            )
        } else {
            ("moe_route", 1, ne.next_multiple_of(32))
        };
        let mut route_args = vec![
            Arg::Buf(Buf::Router),
            bias.map_or(Arg::Null, |v| Arg::Buf(Buf::Vector(v))),
            Arg::Buf(Buf::ExpertIds),
            Arg::Buf(Buf::ExpertWeights),
            Arg::I32(ne as i32),
            Arg::I32(k as i32),
            Arg::I32(gating),
            Arg::I32(n_group as i32),
            Arg::I32(n_group_used as i32),
            Arg::I32(i32::from(norm_weights)),
            Arg::F32(weights_scale.unwrap_or(1.0)),
            Arg::Buf(Buf::ExpertCounts(l)),
            Arg::Null,
            Arg::I32(0),
        ];
        if joined {
            route_args.extend([
                Arg::Buf(Buf::Matrix(router)),
                Arg::Buf(Buf::H),
                Arg::I32(d as i32),
                Arg::Buf(Buf::Done),
                Arg::I32(parts as i32),
            ]);
        }
        self.push(kernel, (grid as u32, 1), threads as u32, route_args);
        // The shared expert's matrices (bound after the routed experts', as the plan lists
        // them); where their types match the routed experts', its products are one more grid
        // row of theirs.
        let shared_mats = match shared {
            None => None,
            Some(sh) => {
                let Some(SharedWeights {
                    gate_inp: gate_inp_w,
                    gate: gate_w,
                    up: up_w,
                    down: down_w,
                }) = shared_w.as_deref()
                else {
                    return Err(decline(label("shared expert"), "not bound"));
                };
                let sg = self.matrix(gate_w, label("shared gate"), sh.n_ff, d)?;
                let su = self.matrix(up_w, label("shared up"), sh.n_ff, d)?;
                let sd = self.matrix(down_w, label("shared down"), d, sh.n_ff)?;
                Some((sh, [sg, su, sd], gate_inp_w))
            }
        };
        let ty = |b: &Builder, m: usize| b.matrices[m].ty;
        let in_grid = shared_mats.as_ref().is_some_and(|&(_, [sg, su, sd], _)| {
            self.tuning.shared_expert_in_grid
                && expert_biases.is_none()
                && ty(self, gate) == ty(self, up)
                && [(sg, gate), (su, up), (sd, down)]
                    .iter()
                    .all(|&(s, r)| ty(self, s) == ty(self, r))
        });
        let in_grid_glu = shared_mats
            .filter(|_| in_grid)
            .map(|(sh, [sg, su, _], _)| (sg, su, sh.n_ff));
        if self.matrices[gate].ty == self.matrices[up].ty && expert_biases.is_none() {
            let x = input(self, &[gate, up]);
            self.expert_glu(gate, up, x, n_ff, k, act, in_grid_glu);
        } else {
            // Gate and up apart, each quantizing the normed input as it loads it, their
            // biases added before the activation.
            self.expert_product(gate, n_ff, Buf::H, 0, k, Buf::Gate, None);
            self.expert_product(up, n_ff, Buf::H, 0, k, Buf::Up, None);
            if let Some([gb, ub, _]) = expert_biases {
                self.expert_bias(Buf::Gate, gb, n_ff, k);
                self.expert_bias(Buf::Up, ub, n_ff, k);
            }
            self.glu(act, [Buf::Gate, Buf::Up, Buf::Act], k * n_ff);
        }
        // The down products quantize their f32 inputs as they load them. (In the grid, the
        // shared expert's gate logit comes first: its product may quantize H into Xq, which
        // the down products do not read.)
        let mut shared_refs = None;
        if !in_grid {
            self.expert_product(down, d, Buf::Act, n_ff, k, Buf::ExpertOut, None);
            if let Some([_, _, db]) = expert_biases {
                self.expert_bias(Buf::ExpertOut, db, d, k);
            }
        }
        if let Some((sh, [sg, su, sd], gate_inp_w)) = shared_mats {
            let mut gate_inp = None;
            if in_grid {
                // (its gate/up products ran in the routed experts' launch, into Gate)
            } else if self.matrices[sg].ty == self.matrices[su].ty {
                let x = input(self, &[sg, su]);
                self.matvec_glu(sg, su, x, Buf::Gate, act);
            } else {
                // (Act is free: the routed experts' down products have read it)
                let x = input(self, &[sg]);
                self.matvec(sg, x, None, None, Buf::Up);
                let x = input(self, &[su]);
                self.matvec(su, x, None, None, Buf::Act);
                self.glu(act, [Buf::Up, Buf::Act, Buf::Gate], sh.n_ff);
            }
            if sh.gated {
                // (before the down product, which may quantize its own input into Xq)
                let Some(gate_inp_w) = gate_inp_w else {
                    return Err(decline(label("shared gate's input"), "not bound"));
                };
                let gi = self.matrix(gate_inp_w, label("shared gate's input"), 1, d)?;
                if !self.tuning.fused_moe_combine || self.matrices[gi].ty != TensorType::F32 {
                    let x = input(self, &[gi]);
                    self.matvec(gi, x, None, None, Buf::SharedGate);
                }
                // (an f32 row: the combination takes its dot with H itself, one launch fewer)
                gate_inp = Some(gi);
            }
            if in_grid {
                let sh_down = (sd, Buf::Gate, Buf::SharedOut);
                self.expert_product(down, d, Buf::Act, n_ff, k, Buf::ExpertOut, Some(sh_down));
            } else {
                self.product_of_f32(sd, Buf::Gate, None, None, Buf::SharedOut);
            }
            shared_refs = Some(SharedRefs {
                gate: sg,
                up: su,
                down: sd,
                gate_inp,
                n_ff: sh.n_ff,
            });
        }
        let gate_inp = shared_refs.as_ref().and_then(|s| s.gate_inp);
        let f32_gate = gate_inp
            .filter(|&g| self.tuning.fused_moe_combine && self.matrices[g].ty == TensorType::F32);
        self.push(
            "moe_combine",
            (d.div_ceil(256) as u32, 1),
            256,
            vec![
                Arg::Buf(Buf::ExpertOut),
                Arg::Buf(Buf::ExpertWeights),
                Arg::I32(k as i32),
                Arg::I32(d as i32),
                shared_refs
                    .as_ref()
                    .map_or(Arg::Null, |_| Arg::Buf(Buf::SharedOut)),
                match f32_gate {
                    None => gate_inp.map_or(Arg::Null, |_| Arg::Buf(Buf::SharedGate)),
                    Some(_) => Arg::Null,
                },
                Arg::Buf(Buf::X),
                Arg::Null,
                f32_gate.map_or(Arg::Null, |g| Arg::Buf(Buf::Matrix(g))),
                f32_gate.map_or(Arg::Null, |_| Arg::Buf(Buf::H)),
            ],
        );
        Ok(MoeRefs {
            router,
            experts: [gate, up, down],
            n_expert: ne,
            n_used: k,
            n_ff,
            gating,
            selection_bias: bias,
            groups: (n_group, n_group_used),
            norm_weights,
            weights_scale: weights_scale.unwrap_or(1.0),
            shared: shared_refs,
            biases: router_bias.zip(expert_biases),
        })
    }

    /// The `k` chosen experts' products of stacked matrix `m` (`rows` a expert) with the f32
    /// input `x` (`x_stride` values apart per expert; 0: one input for all), quantized as
    /// they load it where the rows take quantized activations; expert `j`'s rows into `y`
    /// from `j * rows` on. `shared`: a matrix of as many rows and the same type (the shared
    /// expert's), its input and output, as one more grid row.
    #[allow(clippy::too_many_arguments)]
    fn expert_product(
        &mut self,
        m: usize,
        rows: usize,
        x: Buf,
        x_stride: usize,
        k: usize,
        y: Buf,
        shared: Option<(usize, Buf, Buf)>,
    ) {
        let spec = &self.matrices[m];
        let (rb, cols) = (spec.row_bytes(), spec.cols);
        let kernel = expert_product_kernel(spec, self.activations == Activations::Quantized);
        let k_rows = k + usize::from(shared.is_some());
        let (s_rb, s_cols) = shared.map_or((0, 0), |s| {
            let m = &self.matrices[s.0];
            (m.row_bytes(), m.cols)
        });
        self.push(
            kernel,
            (rows.div_ceil(MATVEC_ROWS) as u32, k_rows as u32),
            self.tuning.matvec_threads(cols / 32, rows * k_rows),
            vec![
                Arg::Buf(Buf::Matrix(m)),
                Arg::I64((rows * rb) as i64),
                Arg::I32(rb as i32),
                Arg::I32((cols / 32) as i32),
                Arg::I32(rows as i32),
                Arg::Buf(x),
                Arg::I32(x_stride as i32),
                Arg::I32(1),
                Arg::Buf(Buf::ExpertIds),
                Arg::Buf(y),
                shared.map_or(Arg::Null, |s| Arg::Buf(Buf::Matrix(s.0))),
                shared.map_or(Arg::Null, |s| Arg::Buf(s.1)),
                shared.map_or(Arg::Null, |s| Arg::Buf(s.2)),
                Arg::I32(s_rb as i32),
                Arg::I32((s_cols / 32) as i32),
            ],
        );
    }

    /// Each of the `k` chosen experts' rows of the stacked bias `v` (`rows` an expert) added to
    /// its product's rows in `y`.
    fn expert_bias(&mut self, y: Buf, v: usize, rows: usize, k: usize) {
        self.push(
            "moe_add_bias",
            (rows.div_ceil(256) as u32, k as u32),
            256,
            vec![
                Arg::Buf(y),
                Arg::Buf(Buf::Vector(v)),
                Arg::Buf(Buf::ExpertIds),
                Arg::I32(rows as i32),
            ],
        );
    }

    /// The `k` chosen experts' gate and up products (one type) and the gated activation,
    /// expert `j`'s into `Act` from `j * n_ff` on; `shared`: the shared expert's gate and up
    /// (the same type and width) and its rows as one more grid row, into `Gate`.
    #[allow(clippy::too_many_arguments)]
    fn expert_glu(
        &mut self,
        g: usize,
        u: usize,
        x: Buf,
        n_ff: usize,
        k: usize,
        act: GateActivation,
        shared: Option<(usize, usize, usize)>,
    ) {
        let spec = &self.matrices[g];
        let (rb, cols) = (spec.row_bytes(), spec.cols);
        let kernel = product_kernel("moe_glu", spec, x);
        let k_rows = k + usize::from(shared.is_some());
        let s_rows = shared.map_or(0, |s| s.2);
        self.push_rows(
            kernel,
            rb,
            (
                n_ff.max(s_rows).div_ceil(MATVEC_ROWS / 2) as u32,
                k_rows as u32,
            ),
            self.tuning.matvec_threads(cols / 32, 2 * n_ff * k_rows),
            vec![
                Arg::Buf(Buf::Matrix(g)),
                Arg::Buf(Buf::Matrix(u)),
                Arg::I64((n_ff * rb) as i64),
                Arg::I32(rb as i32),
                Arg::I32((cols / 32) as i32),
                Arg::I32(n_ff as i32),
                Arg::Buf(x),
                Arg::Buf(Buf::ExpertIds),
                Arg::Buf(Buf::Act),
                Arg::I32(act.code()),
                shared.map_or(Arg::Null, |s| Arg::Buf(Buf::Matrix(s.0))),
                shared.map_or(Arg::Null, |s| Arg::Buf(Buf::Matrix(s.1))),
                shared.map_or(Arg::Null, |_| Arg::Buf(Buf::Gate)),
                Arg::I32(s_rows as i32),
            ],
        );
    }

    /// A launch of the product kernel `kernel` (matvec's arguments).
    fn push_product(
        &mut self,
        kernel: String,
        m: usize,
        x: Buf,
        bias: Option<usize>,
        res: Option<Buf>,
        y: Buf,
    ) {
        let spec = &self.matrices[m];
        let (rows, cols, rb) = (spec.rows, spec.cols, spec.row_bytes());
        self.push_rows(
            kernel,
            rb,
            (rows.div_ceil(MATVEC_ROWS) as u32, 1),
            self.tuning.matvec_threads(cols / 32, rows),
            vec![
                Arg::Buf(Buf::Matrix(m)),
                Arg::I32(rb as i32),
                Arg::I32((cols / 32) as i32),
                Arg::I32(rows as i32),
                Arg::Buf(x),
                bias.map_or(Arg::Null, |b| Arg::Buf(Buf::Vector(b))),
                res.map_or(Arg::Null, Arg::Buf),
                Arg::Buf(y),
            ],
        );
    }

    /// Products of two or three matrices with one input: one launch when they share a type and
    /// width (or are a pair of [`MIXED_QKV`]), one each otherwise. A missing third matrix is
    /// a null pointer of no rows.
    fn matvec3(&mut self, parts: &[(usize, Option<usize>, Buf)], x: Buf) {
        let first = &self.matrices[parts[0].0];
        let same = parts.iter().all(|p| {
            let m = &self.matrices[p.0];
            m.ty == first.ty && m.cols == first.cols
        });
        let mixed = match parts {
            &[q, k, v] => self.mixed_qkv("matvec3", [q.0, k.0, v.0], x),
            _ => None,
        };
        if parts.len() > 3 || !same && mixed.is_none() {
            for &(m, bias, y) in parts {
                self.matvec(m, x, bias, None, y);
            }
            return;
        }
        let kernel = product_kernel("matvec3", first, x);
        let (cols, rb) = (first.cols, first.row_bytes());
        let part = |i: usize| parts.get(i).copied();
        let rows: Vec<usize> = (0..3)
            .map(|i| part(i).map_or(0, |p| self.matrices[p.0].rows))
            .collect();
        let total: usize = rows.iter().sum();
        let mut args = vec![];
        args.extend((0..3).map(|i| part(i).map_or(Arg::Null, |p| Arg::Buf(Buf::Matrix(p.0)))));
        args.extend(rows.iter().map(|&r| Arg::I32(r as i32)));
        args.push(Arg::I32(rb as i32));
        args.push(Arg::I32((cols / 32) as i32));
        args.push(Arg::Buf(x));
        args.extend((0..3).map(|i| {
            part(i)
                .and_then(|p| p.1)
                .map_or(Arg::Null, |b| Arg::Buf(Buf::Vector(b)))
        }));
        args.extend((0..3).map(|i| part(i).map_or(Arg::Null, |p| Arg::Buf(p.2))));
        let grid = (total.div_ceil(MATVEC_ROWS) as u32, 1);
        let block = self.tuning.matvec_threads(cols / 32, total);
        match mixed {
            Some(m) => self.push_mixed(m, grid, block, args),
            None => self.push_rows(kernel, rb, grid, block, args),
        }
    }

    /// The launch of Q, K and V products of `mats` where Q and K share a kernel type and V's
    /// differs, as a pair of [`MIXED_QKV`] (quantized input `x`, Q and K filling whole blocks
    /// of rows): its kernel, V's row bytes, and the shared memory it stages its rows in.
    fn mixed_qkv(&self, base: &str, mats: [usize; 3], x: Buf) -> Option<(String, usize, u32)> {
        let [q, k, v] = mats.map(|m| &self.matrices[m]);
        let pair = (q.kernel, v.kernel);
        let fits = self.tuning.mixed_qkv
            && x == Buf::Xq
            && k.kernel == q.kernel
            && k.cols == q.cols
            && v.cols == q.cols
            && (q.rows + k.rows).is_multiple_of(MATVEC_ROWS)
            && MIXED_QKV.contains(&pair);
        if !fits {
            return None;
        }
        let (rb0, rb1) = (q.row_bytes(), v.row_bytes());
        let bytes = MATVEC_ROWS * rb0.max(rb1);
        let staged = self.tuning.stage
            && STAGED_TYPES.contains(&pair.0)
            && STAGED_TYPES.contains(&pair.1)
            && rb0.is_multiple_of(16)
            && rb1.is_multiple_of(16)
            && bytes <= SHARED_DEFAULT;
        let shared = if staged { bytes as u32 } else { 0 };
        Some((mixed_qkv_kernel(base, pair, staged), rb1, shared))
    }

    /// A launch [`Builder::mixed_qkv`] chose, `args` those of `matvec3` or `matvec3r`.
    fn push_mixed(
        &mut self,
        (kernel, v_row_bytes, shared): (String, usize, u32),
        grid: (u32, u32),
        block: u32,
        mut args: Vec<Arg>,
    ) {
        args.push(Arg::I32(v_row_bytes as i32));
        self.launches.push(Launch {
            kernel,
            grid,
            block,
            args,
            shared,
        });
    }

    /// `out = act(G x) * (U x)` in one launch (G and U of one type).
    fn matvec_glu(&mut self, g: usize, u: usize, x: Buf, out: Buf, act: GateActivation) {
        let spec = &self.matrices[g];
        let kernel = product_kernel("matvec_glu", spec, x);
        let (rows, cols, rb) = (spec.rows, spec.cols, spec.row_bytes());
        self.push_rows(
            kernel,
            rb,
            (rows.div_ceil(MATVEC_ROWS / 2) as u32, 1),
            self.tuning.matvec_threads(cols / 32, 2 * rows),
            vec![
                Arg::Buf(Buf::Matrix(g)),
                Arg::Buf(Buf::Matrix(u)),
                Arg::I32(rb as i32),
                Arg::I32((cols / 32) as i32),
                Arg::I32(rows as i32),
                Arg::Buf(x),
                Arg::Buf(out),
                Arg::I32(act.code()),
            ],
        );
    }

    /// `out = act(g) * u` over `n` f32 values.
    fn glu(&mut self, act: GateActivation, [g, u, out]: [Buf; 3], n: usize) {
        self.push(
            act.kernel(),
            (n.div_ceil(256) as u32, 1),
            256,
            vec![Arg::Buf(g), Arg::Buf(u), Arg::Buf(out), Arg::I32(n as i32)],
        );
    }

    /// The Q, K and V products with the rotation and the cache store of layer `l` in their
    /// epilogue (`matvec3r`, RoPE's normal layout, no Q/K norms): one launch per run of
    /// consecutive matrices of one type and width. `rope`: kv_dim, head_dim, n_dims,
    /// theta_scale, freq_scale, frequency factors.
    fn qkv_rope(&mut self, parts: [(usize, Option<usize>); 3], x: Buf, l: usize, rope: [Arg; 6]) {
        let mixed = self.mixed_qkv("matvec3r", parts.map(|p| p.0), x);
        let mut start = 0;
        while start < 3 {
            let first = &self.matrices[parts[start].0];
            let (ty, cols, rb) = (first.ty, first.cols, first.row_bytes());
            let kernel = product_kernel("matvec3r", first, x);
            let mut end = if mixed.is_some() { 3 } else { start + 1 };
            while end < 3 && {
                let m = &self.matrices[parts[end].0];
                m.ty == ty && m.cols == cols
            } {
                end += 1;
            }
            let run = |i: usize| (start..end).contains(&i);
            let mut args: Vec<Arg> = (0..3)
                .map(|i| {
                    if run(i) {
                        Arg::Buf(Buf::Matrix(parts[i].0))
                    } else {
                        Arg::Null
                    }
                })
                .collect();
            let rows: Vec<usize> = (0..3)
                .map(|i| {
                    if run(i) {
                        self.matrices[parts[i].0].rows
                    } else {
                        0
                    }
                })
                .collect();
            args.extend(rows.iter().map(|&r| Arg::I32(r as i32)));
            args.push(Arg::I32(rb as i32));
            args.push(Arg::I32((cols / 32) as i32));
            args.push(Arg::Buf(x));
            args.extend((0..3).map(|i| match parts[i].1 {
                Some(v) if run(i) => Arg::Buf(Buf::Vector(v)),
                _ => Arg::Null,
            }));
            args.extend([
                Arg::Buf(Buf::Q),
                Arg::Buf(Buf::KCache(l)),
                Arg::Buf(Buf::VCache(l)),
                Arg::Buf(Buf::Pos),
            ]);
            args.extend(rope);
            let total: usize = rows.iter().sum();
            let grid = (total.div_ceil(MATVEC_ROWS) as u32, 1);
            let block = self.tuning.matvec_threads(cols / 32, total);
            match mixed.clone() {
                Some(m) => self.push_mixed(m, grid, block, args),
                None => self.push_rows(kernel, rb, grid, block, args),
            }
            start = end;
        }
    }

    /// The format every matrix of `mats` reads its input in, when they share one and the
    /// activations are quantized.
    fn shared_format(&self, mats: &[usize]) -> Option<i32> {
        if self.activations == Activations::F32 {
            return None;
        }
        let first = activation_format(self.matrices[mats[0]].ty)?;
        mats.iter()
            .all(|&m| activation_format(self.matrices[m].ty) == Some(first))
            .then_some(first)
    }

    /// The RMS norm of `x` (weights `w`) as the input of the products of `mats`: quantized
    /// into [`Buf::Xq`] in the same launch when they share a format, else f32 in [`Buf::H`].
    /// After a block's `post_norm_add` the norm of the residual stream joins that launch
    /// (`post_norm_add_norm`, `_q`).
    fn norm_for(&mut self, x: Buf, w: usize, n: usize, eps: f32, mats: &[usize]) -> Buf {
        let format = self.shared_format(mats);
        let out = if format.is_some() { Buf::Xq } else { Buf::H };
        let after_post_norm = self
            .launches
            .last()
            .is_some_and(|l| l.kernel == "post_norm_add" && l.args[2] == Arg::Buf(x));
        if after_post_norm {
            // (a lane's 8 values held in registers where the block's warps cover n)
            let held = self.tuning.held_post_norm;
            let l = self.launches.last_mut().expect("a launch");
            let held = held && 8 * l.block as usize >= n;
            l.kernel = match (format, held) {
                (Some(_), false) => "post_norm_add_norm_q",
                (None, false) => "post_norm_add_norm",
                (Some(_), true) => "post_norm_add_norm_held_q",
                (None, true) => "post_norm_add_norm_held",
            }
            .into();
            l.args.extend([Arg::Buf(Buf::Vector(w)), Arg::Buf(out)]);
            l.args.extend(format.map(Arg::I32));
            return out;
        }
        // After a mixture of experts' combination of one token: the same, by one block.
        let after_moe = self.tuning.fused_moe_combine
            && norm_threads(n) * 8 >= n as u32
            && self.launches.last().is_some_and(|l| {
                l.kernel == "moe_combine" && l.grid.1 == 1 && l.args[6] == Arg::Buf(x)
            });
        if after_moe {
            let l = self.launches.last_mut().expect("a launch");
            l.kernel = match format {
                Some(_) => "moe_combine_norm_held_q",
                None => "moe_combine_norm_held",
            }
            .into();
            (l.grid, l.block) = ((1, 1), norm_threads(n));
            l.args
                .extend([Arg::F32(eps), Arg::Buf(Buf::Vector(w)), Arg::Buf(out)]);
            l.args.extend(format.map(Arg::I32));
            return out;
        }
        self.rms_norm(x, w, out, n, eps, format);
        out
    }

    /// `x` (n values) as the input of the products of `mats`: quantized into [`Buf::Xq`] when
    /// they share a format, else `x` itself.
    fn input_for(&mut self, x: Buf, n: usize, mats: &[usize]) -> Buf {
        let Some(format) = self.shared_format(mats) else {
            return x;
        };
        if self.quantized_by_producer(x, n, format) {
            return Buf::Xq;
        }
        // A warp per 256 values, four to a block.
        self.push(
            "quantize_act",
            (n.div_ceil(256 * 4) as u32, 1),
            128,
            vec![
                Arg::Buf(x),
                Arg::Buf(Buf::Xq),
                Arg::I32(n as i32),
                Arg::I32(format),
            ],
        );
        Buf::Xq
    }

    /// Whether the last launch writes `x` (n values) a warp per 32 consecutive values and can
    /// quantize them itself (Q8_0 and Q8_1, `quantize_lane`): then it is asked to, into
    /// [`Buf::Xq`] (two arguments of its own, null and 0 until then), and no quantize_act
    /// launch follows.
    fn quantized_by_producer(&mut self, x: Buf, n: usize, format: i32) -> bool {
        if !self.tuning.producer_quantize || !matches!(format, 3 | 4) {
            return false;
        }
        let Some(l) = self.launches.last_mut() else {
            return false;
        };
        let i = |a: &Arg| match *a {
            Arg::I32(v) => v as usize,
            _ => 0,
        };
        // (the output's argument, the row's width and where xq and its format go, as each
        // kernel has them)
        let (out, width, at) = match l.kernel.as_str() {
            "attn_split" | "attn_split_warps" | "attn_rope_split_warps" => {
                (&l.args[7], i(&l.args[8]) * i(&l.args[10]), 17)
            }
            "delta_rule" => (&l.args[10], i(&l.args[12]) * i(&l.args[13]), 16),
            "sigmoid_mul" => (&l.args[0], i(&l.args[2]), 3),
            _ => return false,
        };
        if *out != Arg::Buf(x) || width != n || l.args[at] != Arg::Null {
            return false;
        }
        l.args[at] = Arg::Buf(Buf::Xq);
        l.args[at + 1] = Arg::I32(format);
        true
    }

    /// The RMS norm of the residual stream (weights `w`) in f32 into [`Buf::H`], and quantized
    /// in `format` into [`Buf::Xq`] by the same launch where there is one.
    fn rms_norm_f32_and(&mut self, w: usize, n: usize, eps: f32, format: Option<i32>) {
        let Some(format) = format else {
            return self.rms_norm(Buf::X, w, Buf::H, n, eps, None);
        };
        self.push(
            "rms_norm_fq",
            (1, 1),
            norm_threads(n),
            vec![
                Arg::Buf(Buf::X),
                Arg::Buf(Buf::Vector(w)),
                Arg::Buf(Buf::H),
                Arg::Buf(Buf::Xq),
                Arg::I32(n as i32),
                Arg::F32(eps),
                Arg::I32(format),
            ],
        );
    }

    /// `out = x / rms(x) * w` over `n` values, in f32, or quantized for `format`
    /// (`rms_norm_q`, the kernels' `ACT_*`).
    fn rms_norm(&mut self, x: Buf, w: usize, out: Buf, n: usize, eps: f32, format: Option<i32>) {
        let mut args = vec![
            Arg::Buf(x),
            Arg::Buf(Buf::Vector(w)),
            Arg::Buf(out),
            Arg::I32(n as i32),
            Arg::F32(eps),
        ];
        args.extend(format.map(Arg::I32));
        let kernel = if format.is_some() {
            "rms_norm_q"
        } else {
            "rms_norm"
        };
        self.push(kernel, (1, 1), norm_threads(n), args);
    }
}

/// Threads of the one block that norms `n` values (`rms_norm*`, `post_norm_add*`): a warp per
/// group of 256, at most 32.
fn norm_threads(n: usize) -> u32 {
    32 * n.div_ceil(256).clamp(1, 32) as u32
}

/// The decode step of `plan` with its bound `weights` (`Model::weights`, or
/// [`ferrolm_model::weights::bind`] of the plan) and a cache of `n_ctx` positions, or the
/// first field or weight the CUDA path does not serve.
pub fn decode_plan(
    plan: &ModelPlan,
    weights: &Weights,
    n_ctx: usize,
) -> Result<DecodePlan, Decline> {
    decode_plan_layers(
        plan,
        weights,
        n_ctx,
        plan.layers.len(),
        Activations::Quantized,
    )
}

/// [`decode_plan`] for the first `gpu_layers` layers only (`--gpu-layers`): the step embeds the
/// token, runs those layers and advances the position; the residual stream it leaves in
/// [`Buf::X`] goes on through the CPU's layers and output head. All layers or more: the
/// whole model.
pub fn decode_plan_layers(
    plan: &ModelPlan,
    weights: &Weights,
    n_ctx: usize,
    gpu_layers: usize,
    activations: Activations,
) -> Result<DecodePlan, Decline> {
    let tuning = CudaTuning {
        quantized_activations: activations == Activations::Quantized,
        ..CudaTuning::default()
    };
    decode_plan_with(plan, weights, n_ctx, gpu_layers, &tuning)
}

/// [`decode_plan_layers`] as `tuning` says (the activations' format, the largest residual
/// product that quantizes its input as it loads it, staging, repacking, block sizes).
pub fn decode_plan_with(
    plan: &ModelPlan,
    weights: &Weights,
    n_ctx: usize,
    gpu_layers: usize,
    tuning: &CudaTuning,
) -> Result<DecodePlan, Decline> {
    decode_plan_rank((plan, weights), n_ctx, gpu_layers, tuning, Rank::ONE)
}

/// The decode steps of `ranks` tensor-parallel devices, rank by rank: each holds its share of
/// every layer's heads (Q, K, V rows; the output's columns; its KV heads' cache) and
/// feed-forward rows (gate and up rows; down's columns), the ranks' partial sums of the
/// row-parallel products added together by [`ALL_REDUCE`] entries, and its part of the
/// vocabulary's logits (the embedding whole). The llama family's dense layers only so far
/// (docs/ARCHITECTURE.md, "Several GPUs"); emulated on the CPU, not yet run on devices.
pub fn tensor_parallel_plans(
    plan: &ModelPlan,
    weights: &Weights,
    n_ctx: usize,
    ranks: usize,
    tuning: &CudaTuning,
) -> Result<Vec<DecodePlan>, Decline> {
    if ranks == 0 {
        return Err(decline("tensor_parallel", 0));
    }
    (0..ranks)
        .map(|index| {
            let rank = Rank { index, of: ranks };
            decode_plan_rank((plan, weights), n_ctx, plan.layers.len(), tuning, rank)
        })
        .collect()
}

/// The one lowering: every public `decode_plan*` and [`tensor_parallel_plans`] come here.
fn decode_plan_rank(
    (plan, weights): (&ModelPlan, &Weights),
    n_ctx: usize,
    gpu_layers: usize,
    tuning: &CudaTuning,
    rank: Rank,
) -> Result<DecodePlan, Decline> {
    let activations = if tuning.quantized_activations {
        Activations::Quantized
    } else {
        Activations::F32
    };
    // Every field, no `..`: a field added to the plan stops this from compiling until someone
    // decides whether the CUDA path serves it.
    let ModelPlan {
        // (it names the tensors, which the binding read)
        architecture: _,
        n_embd,
        n_vocab,
        n_ctx_train: _,
        norm_eps,
        layers,
        tied_output,
        embedding_scale,
        final_logit_softcap,
        logit_scale,
    } = plan;
    let Weights {
        token_embd,
        output_norm,
        output,
        // (read through Weights::rope_factors, as the CPU reads them)
        rope_freqs: _,
        long_rope: _,
        layers: layer_weights,
    } = weights;
    if layer_weights.len() != layers.len() {
        return Err(decline(
            "weights",
            format!("{} layers bound for {}", layer_weights.len(), layers.len()),
        ));
    }
    for (field, v) in [
        ("embedding_scale", embedding_scale),
        ("final_logit_softcap", final_logit_softcap),
        ("logit_scale", logit_scale),
    ] {
        if let Some(v) = v.filter(|v| !v.is_finite() || *v == 0.0) {
            return Err(decline(field, v));
        }
    }
    let (d, n_vocab, eps) = (*n_embd, *n_vocab, *norm_eps);
    if !d.is_multiple_of(32) {
        return Err(decline("n_embd", d));
    }
    if n_vocab == 0 || n_vocab > i32::MAX as usize {
        return Err(decline("n_vocab", n_vocab));
    }
    if n_ctx == 0 || n_ctx > u32::MAX as usize / 2 {
        return Err(decline("n_ctx", n_ctx));
    }
    let splits = splits_for(n_ctx, ATTN_TILE);
    let mut b = Builder {
        matrices: Vec::new(),
        vectors: Vec::new(),
        launches: Vec::new(),
        activations,
        rank,
        tuning: tuning.clone(),
    };
    let embd = b.matrix(token_embd, "token embedding".into(), n_vocab, d)?;
    let embd_ty = b.matrices[embd].kernel;
    let row_bytes = b.matrices[embd].row_bytes();
    b.push(
        format!("embed_{embd_ty}"),
        ((d / 32).div_ceil(128) as u32, 1),
        128,
        vec![
            Arg::Buf(Buf::Matrix(embd)),
            Arg::I32(row_bytes as i32),
            Arg::I32((d / 32) as i32),
            Arg::Buf(Buf::Token),
            Arg::Buf(Buf::X),
        ],
    );
    if let Some(s) = *embedding_scale {
        b.push(
            "scale_f32",
            (d.div_ceil(256) as u32, 1),
            256,
            vec![Arg::Buf(Buf::X), Arg::I64(d as i64), Arg::F32(s)],
        );
    }
    let (mut max_q, mut max_kv, mut max_ff, mut max_part, mut max_hs) = (0, 0, 0, 0, 0);
    let mut max_attn = 0;
    let mut delta = DeltaSizes::default();
    let (mut max_experts, mut max_used) = (0, 0);
    let mut kv_dims = Vec::new();
    let mut refs = Vec::new();
    let mut rope_freqs: Option<usize> = None;
    for (l, (layer, w)) in layers
        .iter()
        .zip(layer_weights)
        .enumerate()
        .take(gpu_layers)
    {
        let LayerPlan {
            attention,
            mixer,
            ffn,
            post_attention_norm,
            post_ffn_norm,
            residual_scale,
        } = layer;
        let LayerWeights {
            attn_norm: attn_norm_w,
            mixer: mixer_w,
            post_attn_norm: post_attn_norm_w,
            ffn_norm: ffn_norm_w,
            post_ffn_norm: post_ffn_norm_w,
            ffn: ffn_w,
        } = w;
        let label = |what: &str| format!("layer {l} {what}");
        if let Some(v) = residual_scale.filter(|v| !v.is_finite()) {
            return Err(decline("residual_scale", v));
        }
        if rank.of > 1 {
            let across = |field: &str| Err(decline(field, format!("across {} ranks", rank.of)));
            if matches!(mixer, Mixer::GatedDeltaNet(_)) || matches!(ffn, Ffn::Moe(_)) {
                return across("layer");
            }
            if *post_attention_norm || *post_ffn_norm || residual_scale.is_some() {
                return across("post-norms and residual scales");
            }
        }
        let gate_activation = |a: &Activation| match a {
            Activation::Silu => Ok(GateActivation::Silu),
            Activation::GeluTanh => Ok(GateActivation::Gelu),
            Activation::SwigluOai => Ok(GateActivation::SwigluOai),
        };
        let (n_ff, activation) = match ffn {
            Ffn::Gated { n_ff, activation } => {
                (rank.share(*n_ff, "ffn.n_ff")?, gate_activation(activation)?)
            }
            Ffn::Moe(m) => {
                // The routed experts' activations side by side; the shared expert's in Gate.
                max_experts = max_experts.max(m.n_expert);
                max_used = max_used.max(m.n_expert_used);
                max_ff = max_ff.max(m.shared.map_or(0, |s| s.n_ff));
                (m.n_expert_used * m.n_ff, gate_activation(&m.activation)?)
            }
        };
        max_ff = max_ff.max(n_ff);

        let attn_norm = b.vector(attn_norm_w, label("input norm"), d)?;
        let post_attn_norm = b.opt_vector(
            *post_attention_norm,
            post_attn_norm_w,
            label("post-attention norm"),
            d,
        )?;
        let residual_scale = residual_scale.unwrap_or(1.0);
        let block = BlockEnd {
            post_norm: post_attn_norm,
            scale: residual_scale,
            eps,
        };
        let mixer = match (mixer, mixer_w) {
            (Mixer::Attention, MixerWeights::Attention(aw)) => {
                let at = AttentionAt {
                    layer: l,
                    d,
                    n_ctx,
                    splits,
                    attn_norm,
                };
                let a = b.attention((attention, aw, weights), &at, block, &mut rope_freqs)?;
                let (q_dim, kv_dim) = (a.n_head * a.head_dim, a.n_head_kv * a.head_dim);
                max_q = max_q.max(q_dim);
                max_attn = max_attn.max(if a.gated_output { 2 * q_dim } else { q_dim });
                max_kv = max_kv.max(kv_dim);
                max_part = max_part.max(a.n_head * splits * a.head_dim);
                max_hs = max_hs.max(a.n_head * splits);
                kv_dims.push(kv_dim);
                MixerRefs::Attention(a)
            }
            (Mixer::GatedDeltaNet(net), MixerWeights::DeltaNet(dw)) => {
                let r = b.delta_net((net, dw), l, attn_norm, block)?;
                let (channels, value) = (r.channels(), r.n_v_heads * r.head_dim);
                let key_dim = r.n_k_heads * r.head_dim;
                delta.channels = delta.channels.max(channels);
                delta.value = delta.value.max(value);
                delta.key_heads = delta.key_heads.max(r.n_k_heads);
                match r.input {
                    DeltaNetProjection::Fused(_) => {
                        delta.input = delta.input.max(2 * key_dim + 2 * value);
                    }
                    DeltaNetProjection::Split(..) => {
                        delta.input = delta.input.max(channels);
                        delta.z = delta.z.max(value);
                    }
                }
                match r.gates {
                    DeltaNetProjection::Fused(_) => delta.gates = delta.gates.max(2 * r.n_v_heads),
                    DeltaNetProjection::Split(..) => {
                        delta.gates = delta.gates.max(r.n_v_heads);
                        delta.alpha = delta.alpha.max(r.n_v_heads);
                    }
                }
                kv_dims.push(0);
                MixerRefs::DeltaNet(r)
            }
            _ => return Err(decline(label("mixer"), "weights of another kind")),
        };

        let post_ffn = b.opt_vector(*post_ffn_norm, post_ffn_norm_w, label("post-ffn norm"), d)?;
        let ffn_norm = b.vector(ffn_norm_w, label("ffn norm"), d)?;
        if !n_ff.is_multiple_of(32) {
            return Err(decline("ffn.n_ff", n_ff));
        }
        let (ffn_mats, moe) = if let Ffn::Moe(m) = ffn {
            if post_ffn.is_some() || residual_scale != 1.0 {
                return Err(decline(
                    "ffn",
                    "mixture of experts with a post-norm or scale",
                ));
            }
            let moe = b.moe((m, ffn_w), l, d, ffn_norm, eps, activation)?;
            (moe.experts, Some(moe))
        } else {
            let FfnWeights::Dense {
                gate: gate_w,
                up: up_w,
                down: down_w,
            } = ffn_w
            else {
                return Err(decline(label("ffn"), "experts' weights for a dense block"));
            };
            // A rank's rows of gate and up (all of them for one rank). Without ffn_gate,
            // ffn_up holds the gate's rows then up's (Phi-3): the binding's row views, which
            // one rank takes as they are.
            if rank.of > 1 && !(gate_w.is_whole() && up_w.is_whole()) {
                return Err(decline(
                    "ffn",
                    "fused gate and up rows (Phi-3) across ranks",
                ));
            }
            let first = rank.index * n_ff;
            let (gate, up) = (
                b.matrix_rows(gate_w, label("ffn gate"), first, n_ff, d)?,
                b.matrix_rows(up_w, label("ffn up"), first, n_ff, d)?,
            );
            let down_cols = (rank.index * n_ff, n_ff, n_ff * rank.of);
            let down = b.matrix_cols(down_w, label("ffn down"), d, down_cols)?;
            let h = b.norm_for(Buf::X, ffn_norm, d, eps, &[gate, up]);
            if b.matrices[gate].ty == b.matrices[up].ty {
                b.matvec_glu(gate, up, h, Buf::Act, activation);
            } else {
                b.matvec(gate, h, None, None, Buf::Gate);
                b.matvec(up, h, None, None, Buf::Up);
                b.glu(activation, [Buf::Gate, Buf::Up, Buf::Act], n_ff);
            }
            let end = BlockEnd {
                post_norm: post_ffn,
                ..block
            };
            b.reduced_output(down, Buf::Act, None, end);
            ([gate, up, down], None)
        };
        refs.push(LayerRefs {
            attn_norm,
            mixer,
            ffn_norm,
            ffn: ffn_mats,
            post_attn_norm,
            post_ffn_norm: post_ffn,
            residual_scale,
            activation,
            moe,
        });
    }
    let logits = LogitAdjust {
        softcap: *final_logit_softcap,
        scale: *logit_scale,
    };
    // A tensor-parallel rank's part of the vocabulary's logits (the whole of them for one).
    let (vocab_first, n_vocab) = rank.part(n_vocab);
    let head = if gpu_layers >= layers.len() {
        let out_norm = b.vector(output_norm, "output norm".into(), d)?;
        // (a tied output is the embedding's bytes again: one matrix on one device)
        let output = if *tied_output && rank.of == 1 {
            embd
        } else {
            b.matrix_rows(output, "output".into(), vocab_first, n_vocab, d)?
        };
        let h = b.norm_for(Buf::X, out_norm, d, eps, &[output]);
        b.matvec(output, h, None, None, Buf::Logits);
        if !logits.is_none() {
            let [inv_cap, cap, inv_scale] = logits.args();
            b.push(
                "adjust_logits",
                (n_vocab.div_ceil(256) as u32, 1),
                256,
                vec![
                    Arg::Buf(Buf::Logits),
                    Arg::I64(n_vocab as i64),
                    Arg::F32(inv_cap),
                    Arg::F32(cap),
                    Arg::F32(inv_scale),
                ],
            );
        }
        if rank.of > 1 {
            // (the choice is over every rank's logits: the host's, for now)
            b.push("advance_pos", (1, 1), 32, vec![Arg::Buf(Buf::Pos)]);
        } else {
            b.push(
                "choose_token",
                (1, 1),
                1024,
                vec![
                    Arg::Buf(Buf::Logits),
                    Arg::I32(n_vocab as i32),
                    Arg::Buf(Buf::Token),
                    Arg::Buf(Buf::Pos),
                    Arg::I32(1),
                    Arg::Buf(Buf::SampleCfg),
                    Arg::Buf(Buf::Draws),
                    Arg::Buf(Buf::DrawIdx),
                    Arg::Buf(Buf::TokenRing),
                ],
            );
        }
        Some(Head { out_norm, output })
    } else {
        b.push("advance_pos", (1, 1), 32, vec![Arg::Buf(Buf::Pos)]);
        None
    };
    Ok(DecodePlan {
        layers: refs,
        embd,
        head,
        norm_eps: eps,
        matrices: b.matrices,
        vectors: b.vectors,
        launches: b.launches,
        n_embd: d,
        n_vocab,
        vocab_first,
        n_ctx,
        splits,
        max_q,
        max_attn,
        delta,
        max_kv,
        max_ff,
        max_part,
        max_heads_splits: max_hs,
        kv_dims,
        max_experts,
        max_used,
        embedding_scale: *embedding_scale,
        logits,
        cpu_experts: None,
        staged_experts: None,
    })
}

impl DecodePlan {
    /// Whether the batched passes (prompt batches, several sequences a step) serve every layer:
    /// all of them do but a gated attention output with Q/K/V biases (which no architecture
    /// has): such a model's prompts run as decode steps, one sequence at a time.
    pub fn batched_passes_serve(&self) -> bool {
        self.layers.iter().all(|r| {
            r.attention()
                .is_none_or(|a| !(a.gated_output && a.qkv_bias.is_some()))
        })
    }

    /// The plan for a device without bulk copies (before compute capability 9.0): staged
    /// products become their plain twins (`NAMEs_T` -> `NAMEq_T`, no shared memory).
    pub fn unstaged(self) -> DecodePlan {
        self.unstaged_where(|_| true)
    }

    /// [`DecodePlan::unstaged`] for the products reading a matrix `host` says lives in host
    /// memory (a bulk copy into shared memory reads device memory only).
    pub fn unstaged_where(mut self, host: impl Fn(usize) -> bool) -> DecodePlan {
        for l in self.launches.iter_mut().filter(|l| l.shared > 0) {
            let reads_host = l
                .args
                .iter()
                .any(|a| matches!(a, Arg::Buf(Buf::Matrix(m)) if host(*m)));
            if !reads_host {
                continue;
            }
            if let Some(i) = l.kernel.rfind("s_") {
                l.kernel.replace_range(i..i + 1, "q");
            }
            l.shared = 0;
        }
        self
    }

    /// Weight bytes one token reads (every matrix once, the embedding one row, an expert stack
    /// the chosen experts' rows).
    pub fn weight_bytes_per_token(&self) -> u64 {
        self.weight_bytes_per_token_of(|_| true)
    }

    /// [`DecodePlan::weight_bytes_per_token`] of the matrices `of` picks.
    pub fn weight_bytes_per_token_of(&self, of: impl Fn(usize) -> bool) -> u64 {
        let mut seen = std::collections::HashSet::new();
        let mut total = 0u64;
        for l in &self.launches {
            for a in &l.args {
                let Arg::Buf(Buf::Matrix(m)) = a else {
                    continue;
                };
                let spec = &self.matrices[*m];
                if !of(*m) {
                    continue;
                }
                if l.kernel.starts_with("embed_") {
                    total += spec.row_bytes() as u64;
                } else if seen.insert(*m) {
                    // (a stack's launch has a grid row per chosen expert, and one more for
                    // a shared expert's matrix beside it)
                    let beside = l.args.iter().any(
                        |a| matches!(a, Arg::Buf(Buf::Matrix(s)) if self.matrices[*s].experts <= 1),
                    );
                    total += if spec.experts > 1 {
                        spec.expert_bytes() * (l.grid.1 as u64 - u64::from(beside))
                    } else {
                        spec.total_bytes()
                    };
                }
            }
        }
        total
    }

    /// Bytes of every matrix the device holds.
    pub fn weight_bytes_total(&self) -> u64 {
        self.matrices.iter().map(MatrixSpec::total_bytes).sum()
    }

    /// Bytes of the whole KV cache (keys and values, f16), with the recurrent layers' states.
    pub fn kv_bytes_total(&self) -> u64 {
        let keys: u64 = self
            .kv_dims
            .iter()
            .map(|&kv| 2 * 2 * (kv * self.n_ctx) as u64)
            .sum();
        keys + self.state_bytes()
    }

    /// Bytes of the KV cache read by a token at position `pos` (keys and values, f16), with
    /// the recurrent layers' states (read and written once a token).
    pub fn kv_bytes_at(&self, pos: usize) -> u64 {
        let keys: u64 = self
            .kv_dims
            .iter()
            .map(|&kv| 2 * 2 * kv as u64 * (pos as u64 + 1))
            .sum();
        keys + self.state_bytes()
    }

    /// Bytes of the recurrent layers' states (f32).
    pub fn state_bytes(&self) -> u64 {
        self.layers
            .iter()
            .map(|r| 4 * r.state_floats().iter().sum::<usize>() as u64)
            .sum()
    }

    /// Whether some layer keeps a recurrent state (which holds only the latest position).
    pub fn recurrent(&self) -> bool {
        self.layers.iter().any(|r| r.attention().is_none())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use ferrolm_model::plan::{Attention, Ffn, LayerPlan, Mixer, Rope};

    pub(crate) fn plan(n_layer: usize, head_dim: usize) -> ModelPlan {
        let layer = LayerPlan {
            attention: Attention {
                n_head: 8,
                n_head_kv: 2,
                head_dim,
                qkv_bias: false,
                qk_norm: false,
                rope: Rope {
                    layout: RopeLayout::Normal,
                    n_dims: head_dim,
                    freq_base: 10000.0,
                    freq_scale: 1.0,
                    freq_factors: false,
                    long_rope: None,
                    attn_factor: 1.0,
                    yarn: None,
                },
                scale: 1.0 / (head_dim as f32).sqrt(),
                scale_queries: false,
                softcap: None,
                sliding_window: None,
                gated_output: false,
                sinks: false,
                out_bias: false,
            },
            mixer: Mixer::Attention,
            ffn: Ffn::Gated {
                n_ff: 512,
                activation: Activation::Silu,
            },
            post_attention_norm: false,
            post_ffn_norm: false,
            residual_scale: None,
        };
        ModelPlan {
            architecture: "llama".into(),
            n_embd: 256,
            n_vocab: 1000,
            n_ctx_train: 2048,
            norm_eps: 1e-5,
            layers: vec![layer; n_layer],
            tied_output: false,
            embedding_scale: None,
            final_logit_softcap: None,
            logit_scale: None,
        }
    }

    /// [`plan`] of two layers, the second a mixture of 8 experts (top-2) of 256.
    pub(crate) fn moe_plan() -> ModelPlan {
        let mut pl = plan(2, 64);
        pl.layers[1].ffn = Ffn::Moe(ferrolm_model::plan::Moe {
            n_expert: 8,
            n_expert_used: 2,
            n_ff: 256,
            activation: Activation::Silu,
            gating: Gating::Softmax,
            selection_bias: false,
            groups: None,
            biases: false,
            norm_weights: true,
            weights_scale: None,
            shared: None,
        });
        pl
    }

    /// `plan`'s weights, bound by ferrolm-model from a file written for it: every tensor the
    /// binding reads, of the type `ty` gives it by name (norms, biases and RoPE's divisors
    /// f32), the matrices zeros, each vector filled with its index in the file.
    pub(crate) fn try_bound(
        plan: &ModelPlan,
        ty: impl Fn(&str) -> TensorType,
    ) -> ferrolm_model::Result<Weights> {
        let mut tensors: Vec<(String, Vec<usize>, bool)> = Vec::new();
        let mut add = |name: &str, dims: &[usize], matrix: bool| {
            tensors.push((name.to_string(), dims.to_vec(), matrix));
        };
        let d = plan.n_embd;
        add("token_embd.weight", &[d, plan.n_vocab], true);
        if !plan.tied_output {
            add("output.weight", &[d, plan.n_vocab], true);
        }
        add("output_norm.weight", &[d], false);
        let rope = &plan.layers[0].attention.rope;
        if rope.freq_factors {
            add("rope_freqs.weight", &[rope.n_dims / 2], false);
        }
        if rope.long_rope.is_some() {
            add("rope_factors_long.weight", &[rope.n_dims / 2], false);
            add("rope_factors_short.weight", &[rope.n_dims / 2], false);
        }
        for (l, layer) in plan.layers.iter().enumerate() {
            let n = |s: &str| format!("blk.{l}.{s}");
            let a = &layer.attention;
            let q_dim = a.n_head * a.head_dim;
            let q_rows = if a.gated_output { 2 * q_dim } else { q_dim };
            let kv = a.n_head_kv * a.head_dim;
            add(&n("attn_norm.weight"), &[d], false);
            add(&n("attn_q.weight"), &[d, q_rows], true);
            add(&n("attn_k.weight"), &[d, kv], true);
            add(&n("attn_v.weight"), &[d, kv], true);
            add(&n("attn_output.weight"), &[q_dim, d], true);
            if a.qkv_bias {
                add(&n("attn_q.bias"), &[q_rows], false);
                add(&n("attn_k.bias"), &[kv], false);
                add(&n("attn_v.bias"), &[kv], false);
            }
            if a.qk_norm {
                add(&n("attn_q_norm.weight"), &[a.head_dim], false);
                add(&n("attn_k_norm.weight"), &[a.head_dim], false);
            }
            if a.out_bias {
                add(&n("attn_output.bias"), &[d], false);
            }
            if a.sinks {
                add(&n("attn_sinks.weight"), &[a.n_head], false);
            }
            if layer.post_attention_norm {
                add(&n("post_attention_norm.weight"), &[d], false);
            }
            add(&n("ffn_norm.weight"), &[d], false);
            if layer.post_ffn_norm {
                add(&n("post_ffw_norm.weight"), &[d], false);
            }
            match &layer.ffn {
                Ffn::Gated { n_ff, .. } => {
                    add(&n("ffn_gate.weight"), &[d, *n_ff], true);
                    add(&n("ffn_up.weight"), &[d, *n_ff], true);
                    add(&n("ffn_down.weight"), &[*n_ff, d], true);
                }
                Ffn::Moe(m) => {
                    let (ne, ff) = (m.n_expert, m.n_ff);
                    add(&n("ffn_gate_inp.weight"), &[d, ne], true);
                    add(&n("ffn_gate_exps.weight"), &[d, ff, ne], true);
                    add(&n("ffn_up_exps.weight"), &[d, ff, ne], true);
                    add(&n("ffn_down_exps.weight"), &[ff, d, ne], true);
                    if m.selection_bias {
                        add(&n("exp_probs_b.bias"), &[ne], false);
                    }
                    if m.biases {
                        add(&n("ffn_gate_inp.bias"), &[ne], false);
                        add(&n("ffn_gate_exps.bias"), &[ff, ne], false);
                        add(&n("ffn_up_exps.bias"), &[ff, ne], false);
                        add(&n("ffn_down_exps.bias"), &[d, ne], false);
                    }
                    if let Some(sh) = m.shared {
                        if sh.gated {
                            add(&n("ffn_gate_inp_shexp.weight"), &[d], true);
                        }
                        add(&n("ffn_gate_shexp.weight"), &[d, sh.n_ff], true);
                        add(&n("ffn_up_shexp.weight"), &[d, sh.n_ff], true);
                        add(&n("ffn_down_shexp.weight"), &[sh.n_ff, d], true);
                    }
                }
            }
        }
        let mut w = ferrolm_gguf::GgufWriter::new();
        for (i, (name, dims, matrix)) in tensors.into_iter().enumerate() {
            let elements: usize = dims.iter().product();
            let (t, data) = if matrix {
                let t = ty(&name);
                (t, vec![0u8; elements / t.block_size() * t.block_bytes()])
            } else {
                let v = (i as f32).to_le_bytes();
                (TensorType::F32, v.repeat(elements))
            };
            let dims: Vec<u64> = dims.iter().map(|&x| x as u64).collect();
            w.add_tensor(name, &dims, t, data).unwrap();
        }
        let file = ferrolm_gguf::GgufFile::from_bytes(w.to_bytes()).unwrap();
        ferrolm_model::weights::bind(&file, plan, &ferrolm_quant::KernelOptions::default())
    }

    /// [`try_bound`] for a file the binding takes.
    pub(crate) fn bound(plan: &ModelPlan, ty: impl Fn(&str) -> TensorType) -> Weights {
        try_bound(plan, ty).unwrap()
    }

    /// `plan`'s weights, every matrix of type `ty`.
    pub(crate) fn all(plan: &ModelPlan, ty: TensorType) -> Weights {
        bound(plan, |_| ty)
    }

    #[test]
    fn the_first_layers_alone_end_with_the_residual_stream() {
        let pl = plan(4, 32);
        let weights = all(&pl, TensorType::Q4_0);
        let p = decode_plan_layers(&pl, &weights, 512, 2, Activations::Quantized).unwrap();
        assert_eq!(p.layers.len(), 2);
        assert!(p.head.is_none());
        assert_eq!(p.launches.len(), 1 + 7 * 2 + 1);
        assert_eq!(p.launches.last().unwrap().kernel, "advance_pos");
        assert!(p.matrices.iter().all(|m| !m.label.starts_with("layer 2")));
        // As many layers as the model has, or more: the whole model.
        let whole = decode_plan_layers(&pl, &weights, 512, 9, Activations::Quantized).unwrap();
        assert!(whole.head.is_some());
        assert_eq!(whole.layers.len(), 4);
    }

    #[test]
    fn a_token_is_three_launches_and_seven_per_layer() {
        let p = decode_plan(&plan(4, 32), &all(&plan(4, 32), TensorType::Q4_0), 512).unwrap();
        // Per layer: norm (quantizing), Q/K/V (rotating and storing keys and values),
        // attention (its split-K merge in the last block), the output product (quantizing
        // its input as it loads it), norm, gate/up, down (the same); then the norm, the output
        // and the argmax.
        assert_eq!(p.launches.len(), 1 + 7 * 4 + 3);
        let kernels: Vec<&str> = p.launches[1..8].iter().map(|l| l.kernel.as_str()).collect();
        assert_eq!(
            kernels,
            [
                "rms_norm_q",
                "matvec3rs_Q4_0",
                "attn_split",
                "matvecf_Q4_0",
                "rms_norm_q",
                "matvec_glus_Q4_0",
                "matvecf_Q4_0"
            ]
        );
        assert_eq!(p.launches[4].args[4], Arg::Buf(Buf::Attn));
        assert_eq!(p.launches[7].args[4], Arg::Buf(Buf::Act));
        // A down product too large for every block to read all of its f32 input (1024 x
        // 16384): the activation quantized by a launch of its own into Xq, which it reads.
        let mut wide = plan(1, 32);
        wide.n_embd = 1024;
        for layer in &mut wide.layers {
            layer.ffn = Ffn::Gated {
                n_ff: 16384,
                activation: Activation::Silu,
            };
        }
        let p = decode_plan(&wide, &all(&wide, TensorType::Q4_0), 512).unwrap();
        assert_eq!(p.launches.len(), 1 + 8 + 3);
        assert_eq!(p.launches[4].kernel, "matvecf_Q4_0");
        assert_eq!(p.launches[7].kernel, "quantize_act");
        assert_eq!(p.launches[7].args[1], Arg::Buf(Buf::Xq));
        assert_eq!(p.launches[7].args[3], Arg::I32(3));
        assert_eq!(p.launches[8].kernel, "matvecs_Q4_0");
        assert_eq!(p.launches[8].args[4], Arg::Buf(Buf::Xq));
        // NEOX rotation pairs are not adjacent rows: the products, then rope_store.
        let mut neox = plan(4, 32);
        for layer in &mut neox.layers {
            layer.attention.rope.layout = RopeLayout::Neox;
        }
        let p = decode_plan(&neox, &all(&neox, TensorType::Q4_0), 512).unwrap();
        assert_eq!(p.launches.len(), 1 + 8 * 4 + 3);
        assert_eq!(p.launches[2].kernel, "matvec3s_Q4_0");
        assert_eq!(p.launches[3].kernel, "rope_store");
        // With f32 activations: no quantizing launches.
        let pl = plan(4, 32);
        let f =
            decode_plan_layers(&pl, &all(&pl, TensorType::Q4_0), 512, 4, Activations::F32).unwrap();
        assert_eq!(f.launches.len(), 1 + 7 * 4 + 3);
        assert!(f.launches.iter().all(|l| !l.kernel.contains("q_")));
        assert!(p.launches.iter().all(|l| l.kernel != "attn_combine"));
        assert_eq!(p.launches[0].kernel, "embed_Q4_0");
        assert_eq!(p.launches.last().unwrap().kernel, "choose_token");
        // 4 layers x 7 matrices + embedding + output.
        assert_eq!(p.matrices.len(), 4 * 7 + 2);
        assert_eq!(p.splits, 4);
        // Mixed types: Q, K, V and gate, up launch one by one, with a separate activation,
        // which the down product quantizes as it loads it.
        let mixed = |name: &str| {
            if name.contains("attn_k") || name.contains("ffn_up") {
                TensorType::Q8_0
            } else {
                TensorType::Q4_0
            }
        };
        let p = decode_plan(&pl, &bound(&pl, mixed), 512).unwrap();
        assert_eq!(p.launches.len(), 1 + 11 * 4 + 3);
        assert!(p.launches.iter().all(|l| l.kernel != "quantize_act"));
        let swiglu = p
            .launches
            .iter()
            .position(|l| l.kernel == "swiglu")
            .unwrap();
        assert_eq!(p.launches[swiglu + 1].kernel, "matvecf_Q4_0");
        // Q4_0 and Q4_K rows read their inputs in different formats (Q8_0, Q8_K): an input
        // shared by both stays f32.
        let formats = |name: &str| {
            if name.contains("attn_k") {
                TensorType::Q4_K
            } else {
                TensorType::Q4_0
            }
        };
        let p = decode_plan(&pl, &bound(&pl, formats), 512).unwrap();
        assert_eq!(p.launches[1].kernel, "rms_norm");
        assert_eq!(p.launches[2].kernel, "matvec3r_Q4_0");
        assert_eq!(p.launches[3].kernel, "matvec3r_Q4_K");
        assert_eq!(p.launches[4].kernel, "matvec3r_Q4_0");
    }

    const TYPES: [&str; 17] = [
        "F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K", "BF16", "IQ4_NL",
        "MXFP4", "Q2_K", "Q3_K", "Q5_K", "Q8_0R", "Q6_KR",
    ];

    #[test]
    fn every_kernel_launched_is_in_the_source() {
        for ty in [
            TensorType::F32,
            TensorType::F16,
            TensorType::Q8_0,
            TensorType::Q4_0,
            TensorType::Q4_1,
            TensorType::Q5_0,
            TensorType::Q5_1,
            TensorType::Q4_K,
            TensorType::Q6_K,
            TensorType::BF16,
            TensorType::IQ4_NL,
            TensorType::MXFP4,
            TensorType::Q2_K,
            TensorType::Q3_K,
            TensorType::Q5_K,
        ] {
            let mut pl = plan(2, 64);
            pl.n_embd = 512;
            // Layer 1 a mixture of experts, with a gated shared expert; Gemma's fields.
            let mut moe = pl.clone();
            moe.layers[1].ffn = Ffn::Moe(ferrolm_model::plan::Moe {
                n_expert: 8,
                n_expert_used: 2,
                n_ff: 256,
                activation: Activation::Silu,
                gating: Gating::Softmax,
                selection_bias: true,
                groups: None,
                biases: false,
                norm_weights: true,
                weights_scale: None,
                shared: Some(ferrolm_model::plan::SharedExpert {
                    n_ff: 256,
                    gated: true,
                }),
            });
            let mut gemma = pl.clone();
            gemma.embedding_scale = Some(4.0);
            gemma.final_logit_softcap = Some(30.0);
            for layer in &mut gemma.layers {
                layer.post_attention_norm = true;
                layer.post_ffn_norm = true;
            }
            let launches: Vec<Launch> = [pl, moe, gemma]
                .iter()
                .flat_map(|pl| decode_plan(pl, &all(pl, ty), 4096).unwrap().launches)
                .collect();
            for l in &launches {
                let needle = format!("void {}(", l.kernel);
                // NAME_T from a macro over a type list: `void NAME_##T(` or, for the products,
                // `void NAME##S(` with S = `_##T` (ALL_TYPES) or `q_##T` (QUANTIZED_TYPES).
                let src = crate::kernels::SOURCE.as_str();
                let list = |name: &str| {
                    let start = src.find(&format!("#define {name}(X)")).expect("type list");
                    &src[start..start + src[start..].find("\n\n").expect("list end")]
                };
                let found = src.contains(&needle)
                    || TYPES.iter().any(|t| {
                        let Some(base) = l.kernel.strip_suffix(&format!("_{t}")) else {
                            return false;
                        };
                        let entry = format!("X({t})");
                        match base.strip_suffix('q') {
                            Some(product) if src.contains(&format!("void {product}##S(")) => {
                                list("QUANTIZED_TYPES").contains(&entry)
                            }
                            // NAMEs_T: the staged products of the types listed after the others.
                            _ if base.strip_suffix('s').is_some_and(|product| {
                                src.contains(&format!("void {product}##S("))
                            }) =>
                            {
                                src.contains(&format!("FOR_PRODUCTS({t}, true, s_{t}, true)"))
                                    && l.shared > 0
                            }
                            _ if base.ends_with("matvecf") => {
                                src.contains(&format!("void {base}_##T("))
                                    && list("QUANTIZED_TYPES").contains(&entry)
                            }
                            _ => {
                                (src.contains(&format!("void {base}_##T("))
                                    || src.contains(&format!("void {base}##S(")))
                                    && list("ALL_TYPES").contains(&entry)
                            }
                        }
                    });
                assert!(found, "kernel {} is not in the source", l.kernel);
                assert!(l.block <= 1024 && l.block % 32 == 0, "{}", l.kernel);
            }
        }
    }

    /// Q and K of one type with V of another (llama-quantize's mixes) in one launch where
    /// kernels.cu instantiates the pair, its blocks reading V's rows with V's row bytes (the
    /// launch's last argument); other pairs in a launch each.
    #[test]
    fn q_and_k_of_one_type_and_v_of_another_share_a_launch() {
        let src = crate::kernels::SOURCE.as_str();
        let mut seen = std::collections::BTreeSet::new();
        // (V's rows regrouped where their width allows: Q6_KR at 2048, Q8_0R at 256)
        for (qk, v, width, rope) in [
            (TensorType::Q4_K, TensorType::Q6_K, 2048, true),
            (TensorType::Q4_K, TensorType::Q6_K, 256, true),
            (TensorType::Q5_0, TensorType::Q8_0, 256, true),
            (TensorType::Q5_0, TensorType::Q8_0, 640, true),
            (TensorType::Q4_0, TensorType::Q8_0, 256, false),
        ] {
            let mut pl = plan(2, 64);
            pl.n_embd = width;
            let types = |name: &str| if name.contains("attn_v") { v } else { qk };
            for stage in [true, false] {
                let tuning = CudaTuning {
                    stage,
                    ..CudaTuning::default()
                };
                let p = decode_plan_with(&pl, &bound(&pl, types), 512, 2, &tuning).unwrap();
                let qkv: Vec<&Launch> = p
                    .launches
                    .iter()
                    .filter(|l| l.kernel.starts_with("matvec3r"))
                    .collect();
                if !rope {
                    assert_eq!(
                        qkv.len(),
                        4,
                        "{qk:?} with {v:?}: a launch for Q and K, one for V"
                    );
                    continue;
                }
                assert_eq!(
                    qkv.len(),
                    2,
                    "{qk:?} with {v:?}: a launch a layer: {:?}",
                    qkv.iter().map(|l| &l.kernel).collect::<Vec<_>>()
                );
                for l in qkv {
                    let [q, _, vm] = [0, 1, 2].map(|i| match l.args[i] {
                        Arg::Buf(Buf::Matrix(m)) => &p.matrices[m],
                        ref a => panic!("{a:?}"),
                    });
                    let staged = l.shared > 0;
                    let both_stage =
                        STAGED_TYPES.contains(&q.kernel) && STAGED_TYPES.contains(&vm.kernel);
                    assert_eq!(staged, stage && both_stage, "{}", l.kernel);
                    let pair = (q.kernel, vm.kernel);
                    assert!(MIXED_QKV.contains(&pair));
                    seen.insert(l.kernel.clone());
                    assert_eq!(l.kernel, mixed_qkv_kernel("matvec3r", pair, staged));
                    assert_eq!(l.args.len(), 23);
                    assert_eq!(l.args[6], Arg::I32(q.row_bytes() as i32));
                    assert_eq!(l.args[22], Arg::I32(vm.row_bytes() as i32));
                    assert_ne!(q.row_bytes(), vm.row_bytes());
                    let (s, flag) = if staged {
                        ("s", "true")
                    } else {
                        ("q", "false")
                    };
                    let instance = format!(
                        "MIXED_QKV({}, {}, {s}_{}_{}, {flag}, {flag})",
                        q.kernel, vm.kernel, q.kernel, vm.kernel
                    );
                    assert!(src.contains(&instance), "no {instance}");
                }
            }
        }
        // (each pair, and the staged instance)
        assert_eq!(seen.len(), MIXED_QKV.len() + 1, "{seen:?}");
        // Every pair listed has its kernels in the source.
        for (qk, v) in MIXED_QKV {
            for base in ["matvec3", "matvec3r"] {
                let name = mixed_qkv_kernel(base, (qk, v), false);
                let s = name.strip_prefix(base).unwrap();
                assert!(src.contains(&format!("MIXED_QKV({qk}, {v}, {s}, false, false)")));
            }
        }
    }

    #[test]
    fn weight_bytes_count_each_matrix_once_and_one_embedding_row() {
        let mut pl = plan(1, 32);
        pl.tied_output = true;
        let p = decode_plan(&pl, &all(&pl, TensorType::Q8_0), 256).unwrap();
        let row = 256 / 32 * 34;
        // q (256 rows), k, v (64 each), o (256), gate, up (512 each), down (256): all 256 wide
        // but down (512 wide); the output is the embedding (1000 rows) plus one embedded row.
        let expect =
            (256 + 64 + 64 + 256 + 512 + 512) * row + 256 * (512 / 32 * 34) + 1000 * row + row;
        assert_eq!(p.weight_bytes_per_token(), expect as u64);
    }

    /// A token reads the chosen experts' rows of a stack, not the whole stack: two experts more
    /// per token read two experts' gate, up and down rows more.
    #[test]
    fn an_expert_stack_counts_the_chosen_experts_rows_per_token() {
        let with_used = |k: usize| {
            let mut pl = moe_plan();
            if let Ffn::Moe(m) = &mut pl.layers[1].ffn {
                m.n_expert_used = k;
            }
            decode_plan(&pl, &all(&pl, TensorType::Q8_0), 256).unwrap()
        };
        let (two, four) = (with_used(2), with_used(4));
        let stack = |p: &DecodePlan| -> Vec<u64> {
            p.matrices
                .iter()
                .filter(|m| m.experts > 1)
                .map(MatrixSpec::expert_bytes)
                .collect()
        };
        let expert_bytes: u64 = stack(&two).iter().sum();
        assert_eq!(stack(&two).len(), 3);
        assert_eq!(
            four.weight_bytes_per_token() - two.weight_bytes_per_token(),
            2 * expert_bytes
        );
        assert!(two.weight_bytes_per_token() < two.weight_bytes_total());
        // None of it from host memory unless a matrix lives there.
        assert_eq!(two.weight_bytes_per_token_of(|_| false), 0);
    }

    /// An f32 router before quantized experts (Qwen3-30B-A3B's files): the feed-forward norm's
    /// launch quantizes the experts' input beside its f32 output, no quantize_act after.
    #[test]
    fn an_f32_router_leaves_the_experts_input_to_the_norm() {
        let pl = moe_plan();
        let weights = bound(&pl, |name| {
            if name.contains("ffn_gate_inp") {
                TensorType::F32
            } else {
                TensorType::Q4_0
            }
        });
        let p = decode_plan(&pl, &weights, 256).unwrap();
        let kernels: Vec<&str> = p.launches.iter().map(|l| l.kernel.as_str()).collect();
        let route = kernels.iter().position(|&k| k == "moe_route").unwrap();
        assert_eq!(kernels[route - 1], "matvec_F32");
        assert_eq!(kernels[route - 2], "rms_norm_fq");
        assert!(!kernels.contains(&"quantize_act"), "{kernels:?}");
        assert!(kernels[route + 1].starts_with("moe_glu"), "{kernels:?}");
        assert_eq!(p.launches[route + 1].args[6], Arg::Buf(Buf::Xq));
    }

    #[test]
    fn fields_the_path_does_not_serve_decline_by_name() {
        let e = decode_plan(&plan(1, 48), &all(&plan(1, 48), TensorType::Q8_0), 256).unwrap_err();
        assert_eq!(e.field, "attention.head_dim");
        // A type the binding does not take is the binding's error, naming the tensor; one it
        // binds and the kernels do not read declines naming the layer and the weight.
        let one = plan(1, 32);
        let q8_k = |name: &str| {
            if name == "blk.0.ffn_up.weight" {
                TensorType::Q8_K
            } else {
                TensorType::Q8_0
            }
        };
        let e = try_bound(&one, q8_k).unwrap_err();
        assert!(e.to_string().contains("blk.0.ffn_up.weight"), "{e}");
        assert!(try_bound(&one, |_| TensorType::Q8_1).is_err());
        let mut unread = None;
        for &ty in TensorType::ALL {
            if kernel_type(ty).is_some() || 256 % ty.block_size() != 0 {
                continue;
            }
            let ty_of = |name: &str| {
                if name == "blk.0.ffn_up.weight" {
                    ty
                } else {
                    TensorType::Q8_0
                }
            };
            let Ok(weights) = try_bound(&one, ty_of) else {
                continue;
            };
            unread = Some((ty, decode_plan(&one, &weights, 256).unwrap_err()));
        }
        // (none today: the kernels read every type the CPU binds; a type added to one and not
        // the other declines here)
        if let Some((ty, e)) = unread {
            assert_eq!(e.field, "layer 0 ffn up (blk.0.ffn_up.weight)");
            assert_eq!(e.value, ty.name());
        }
        let mut odd = plan(1, 32);
        odd.n_embd = 100;
        assert_eq!(
            decode_plan(&odd, &all(&odd, TensorType::F32), 256)
                .unwrap_err()
                .field,
            "n_embd"
        );
        // Gemma's and Granite's fields plan: post-norms, a GELU gate, the scales and caps.
        let mut gemma_like = plan(1, 32);
        gemma_like.layers[0].post_attention_norm = true;
        gemma_like.layers[0].post_ffn_norm = true;
        gemma_like.layers[0].residual_scale = Some(0.22);
        gemma_like.layers[0].attention.softcap = Some(50.0);
        gemma_like.layers[0].attention.scale_queries = true;
        gemma_like.layers[0].ffn = Ffn::Gated {
            n_ff: 512,
            activation: Activation::GeluTanh,
        };
        gemma_like.embedding_scale = Some(8.0);
        gemma_like.final_logit_softcap = Some(30.0);
        gemma_like.logit_scale = Some(8.0);
        let gemma_weights = all(&gemma_like, TensorType::F32);
        let dp = decode_plan(&gemma_like, &gemma_weights, 256).unwrap();
        let kernels: Vec<&str> = dp.launches.iter().map(|l| l.kernel.as_str()).collect();
        for k in ["scale_f32", "post_norm_add_norm_held", "adjust_logits"] {
            assert!(kernels.contains(&k), "no {k} in {kernels:?}");
        }
        let glu = dp
            .launches
            .iter()
            .find(|l| l.kernel.starts_with("matvec_glu"));
        assert_eq!(glu.and_then(|l| l.args.last()), Some(&Arg::I32(1)), "GELU");
        assert_eq!(
            kernels
                .iter()
                .filter(|k| k.starts_with("post_norm_add"))
                .count(),
            2,
            "one per block, each with the norm after it"
        );
        // The bound vector itself, shared.
        let bound_norm = gemma_weights.layers[0].post_attn_norm.as_ref().unwrap();
        let v = &dp.vectors[dp.layers[0].post_attn_norm.unwrap()];
        assert!(std::sync::Arc::ptr_eq(&v.values, bound_norm));
        assert_eq!(v.label, "layer 0 post-attention norm");
        assert_eq!(dp.logits.args(), [1.0 / 30.0, 30.0, 0.125]);
        // A cap on scores the queries' scale has not reached is not what the kernels compute.
        let mut unscaled = gemma_like.clone();
        unscaled.layers[0].attention.scale_queries = false;
        let e = decode_plan(&unscaled, &all(&unscaled, TensorType::F32), 256).unwrap_err();
        assert_eq!(e.field, "attention.softcap");
        let mut zero = plan(1, 32);
        zero.logit_scale = Some(0.0);
        let e = decode_plan(&zero, &all(&zero, TensorType::F32), 256).unwrap_err();
        assert_eq!(e.field, "logit_scale");
        let mut oai = plan(1, 32);
        oai.layers[0].ffn = Ffn::Gated {
            n_ff: 512,
            activation: Activation::SwigluOai,
        };
        // The clamped SwiGLU's code.
        let dp = decode_plan(&oai, &all(&oai, TensorType::F32), 256).unwrap();
        let glu = dp
            .launches
            .iter()
            .find(|l| l.kernel.starts_with("matvec_glu"));
        assert_eq!(glu.and_then(|l| l.args.last()), Some(&Arg::I32(2)));
        // RoPE scalings plan: LongRoPE's divisors for the context and its attention factor.
        let mut long_rope = plan(1, 32);
        long_rope.layers[0].attention.rope.long_rope = Some(ferrolm_model::plan::LongRope {
            original_context: 4096,
        });
        long_rope.layers[0].attention.rope.attn_factor = 1.19;
        let lr_weights = all(&long_rope, TensorType::F32);
        let short = decode_plan(&long_rope, &lr_weights, 256).unwrap();
        let long = decode_plan(&long_rope, &lr_weights, 8192).unwrap();
        let divisors = |p: &DecodePlan| {
            p.vectors[p.layers[0].attention().unwrap().freq_factors.unwrap()]
                .values
                .clone()
        };
        let (bound_long, bound_short) = lr_weights.long_rope.as_ref().unwrap();
        assert!(std::sync::Arc::ptr_eq(&divisors(&short), bound_short));
        assert!(std::sync::Arc::ptr_eq(&divisors(&long), bound_long));
        assert_eq!(
            short.layers[0].attention().unwrap().rope_scaling.args(),
            [1.19, 0.0, 0.0, 0.0]
        );
        let rope = short
            .launches
            .iter()
            .find(|l| l.kernel == "rope_store")
            .unwrap();
        assert_eq!(
            rope.args[17],
            Arg::F32(1.19),
            "the magnitude reaches the rotation"
        );
    }

    #[test]
    fn splits_grow_with_the_context_and_stay_bounded() {
        assert_eq!(splits_for(1, ATTN_TILE), 1);
        assert_eq!(splits_for(128, ATTN_TILE), 1);
        assert_eq!(splits_for(129, ATTN_TILE), 2);
        assert_eq!(splits_for(513, ATTN_TILE), 5);
        assert_eq!(splits_for(1 << 20, ATTN_TILE), 16);
        assert_eq!(splits_for(128, 16), 8);
        assert_eq!(splits_for(513, 16), 16);
    }

    #[test]
    fn products_stage_rows_of_whole_16_byte_words_that_fit() {
        let s = |k: &str, rb: usize| staged_product(k, rb);
        assert_eq!(s("matvecq_Q4_0", 144), Some(("matvecs_Q4_0".into(), 576)));
        assert_eq!(
            s("matvec_gluq_Q4_K", 2304),
            Some(("matvec_glus_Q4_K".into(), 9216))
        );
        assert_eq!(
            s("matvec3rq_Q6_KR", 11760),
            Some(("matvec3rs_Q6_KR".into(), 47040))
        );
        // 18 chunks of Q4_0 (a 576-wide row): 324 bytes, not whole 16-byte words
        assert_eq!(s("matvecq_Q4_0", 324), None);
        // four 14336-wide Q8_0 rows: more than 48 KiB
        assert_eq!(s("matvecq_Q8_0R", 15232), None);
        // types without a shared-memory fetch, f32 inputs, inputs quantized on load
        assert_eq!(s("matvecq_Q5_0", 352), None);
        assert_eq!(s("matvec_Q4_K", 2304), None);
        assert_eq!(s("matvecf_Q4_K", 2304), None);
        let p = decode_plan(&plan(2, 64), &all(&plan(2, 64), TensorType::Q4_K), 256).unwrap();
        let staged: Vec<&Launch> = p.launches.iter().filter(|l| l.shared > 0).collect();
        assert!(!staged.is_empty());
        for l in staged {
            assert!(l.kernel.contains("s_Q4_K"), "{}", l.kernel);
            let rb = p.matrices.iter().map(|m| m.row_bytes());
            assert!(rb
                .into_iter()
                .any(|rb| l.shared as usize == MATVEC_ROWS * rb));
        }
    }

    #[test]
    fn a_device_without_bulk_copies_gets_the_plain_products() {
        let staged = decode_plan(&plan(2, 64), &all(&plan(2, 64), TensorType::Q4_K), 256).unwrap();
        let plain = staged.clone().unstaged();
        assert!(staged.launches.iter().any(|l| l.shared > 0));
        assert!(plain.launches.iter().all(|l| l.shared == 0));
        for (s, p) in staged.launches.iter().zip(&plain.launches) {
            if s.shared > 0 {
                assert_eq!(p.kernel, s.kernel.replace("s_Q4_K", "q_Q4_K"));
            } else {
                assert_eq!(p, s);
            }
        }
    }

    #[test]
    fn the_attention_quantizes_the_output_products_input_itself() {
        let pl = plan(2, 64);
        for (on, ty, asked) in [
            (true, TensorType::Q4_0, true),
            (true, TensorType::Q4_K, false),
            (false, TensorType::Q4_0, false),
        ] {
            let tuning = CudaTuning {
                producer_quantize: on,
                quantize_on_load_max: 0,
                ..CudaTuning::default()
            };
            let p = decode_plan_with(&pl, &all(&pl, ty), 256, 1, &tuning).unwrap();
            let at = p
                .launches
                .iter()
                .position(|l| l.kernel.starts_with("attn_split"))
                .unwrap();
            let (attn, next) = (&p.launches[at], &p.launches[at + 1]);
            // Q8_0 for Q4_0 rows: the attention's blocks; Q8_K (Q4_K): a launch of its own
            assert_eq!(attn.args[17] == Arg::Buf(Buf::Xq), asked, "{on} {ty:?}");
            assert_eq!(next.kernel == "quantize_act", !asked, "{on} {ty:?}");
            if asked {
                assert_eq!(attn.args[18], Arg::I32(3));
                assert_eq!(next.args[4], Arg::Buf(Buf::Xq));
            }
        }
    }

    #[test]
    fn heads_of_128_and_256_values_attend_by_warps() {
        let src = crate::kernels::SOURCE.as_str();
        assert!(src.contains(&format!("#define ATTN_WARPS {ATTN_WARPS}\n")));
        for (hd, warps) in [(64, false), (128, true), (256, true)] {
            for on in [true, false] {
                let pl = plan(2, hd);
                let tuning = CudaTuning {
                    warp_attention: on,
                    ..CudaTuning::default()
                };
                let p =
                    decode_plan_with(&pl, &all(&pl, TensorType::Q8_0), 512, 1, &tuning).unwrap();
                let attn: Vec<_> = p
                    .launches
                    .iter()
                    .filter(|l| l.kernel.starts_with("attn_split"))
                    .collect();
                assert!(!attn.is_empty());
                for l in attn {
                    let (kernel, block) = if warps && on {
                        ("attn_split_warps", 32 * ATTN_WARPS as u32)
                    } else {
                        ("attn_split", ATTN_TILE as u32)
                    };
                    assert_eq!((l.kernel.as_str(), l.block), (kernel, block), "{hd} {on}");
                    assert_eq!(l.args.len(), 19);
                }
            }
        }
    }

    #[test]
    fn the_step_hands_its_token_to_the_host_ring() {
        let p = decode_plan(&plan(2, 64), &all(&plan(2, 64), TensorType::Q4_K), 256).unwrap();
        let choose = p.launches.last().unwrap();
        assert_eq!(choose.kernel, "choose_token");
        assert_eq!(choose.args.last(), Some(&Arg::Buf(Buf::TokenRing)));
        assert!(TOKEN_RING.is_power_of_two());
        let src = crate::kernels::SOURCE.as_str();
        assert!(src.contains(&format!("#define TOKEN_RING {TOKEN_RING}\n")));
        assert!(src.contains("u32* draw_idx, u32* ring)"));
        // The first layers alone choose nothing: no ring.
        let pl = plan(4, 64);
        let part = decode_plan_layers(
            &pl,
            &all(&pl, TensorType::Q4_K),
            256,
            2,
            Activations::Quantized,
        )
        .unwrap();
        assert!(part
            .launches
            .iter()
            .all(|l| !l.args.contains(&Arg::Buf(Buf::TokenRing))));
    }
}
