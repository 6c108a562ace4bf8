//! A model described as data: hyperparameters and, per layer, every feature the layer carries.
//!
//! An architecture module turns a file's metadata into a [`ModelPlan`]; executors (the CPU
//! forward pass, later the CUDA one) run the plan. A fast path takes the plan apart without
//! `..`, so that a feature added here does not compile there until someone decides.

/// How RoPE pairs up the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(x[2i], x[2i+1])` (llama).
    Normal,
    /// Halves `(x[i], x[i + n/2])` (GPT-NeoX, Qwen, Gemma).
    Neox,
}

/// Rotary position embedding of one attention layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// The pairing of dimensions.
    pub layout: RopeLayout,
    /// How many leading dimensions of each head rotate (the rest pass through).
    pub n_dims: usize,
    /// The base of the frequencies (`rope.freq_base`).
    pub freq_base: f32,
    /// Linear position scaling (`1 / rope.scaling.factor`), 1 when absent.
    pub freq_scale: f32,
    /// Per-frequency divisors (`rope_freqs.weight`, Llama 3 scaling), when the file has them.
    pub freq_factors: bool,
    /// Phi-3 LongRoPE: two sets of per-frequency divisors, chosen by the context size.
    pub long_rope: Option<LongRope>,
    /// Multiplies every cosine and sine (`rope.scaling.attn_factor`, ggml's `attn_factor`
    /// without YaRN), so the scores scale by its square; 1 when absent.
    pub attn_factor: f32,
    /// YaRN scaling (`rope.scaling.type` = `yarn`), if any: `freq_scale` is then
    /// `1 / rope.scaling.factor`, mixed with the unscaled angle per dimension.
    pub yarn: Option<Yarn>,
}

/// YaRN as llama.cpp's `ggml_rope_ext` applies it: per rotated pair `i`, the angle is
/// `interp * (1 - mix) + extrap * mix` with `interp = freq_scale * extrap` and `mix` a ramp
/// between the correction dimensions from `beta_fast` and `beta_slow` (times `ext_factor`);
/// cosines and sines are multiplied by `attn_factor * (1 + 0.1 ln(1 / freq_scale))`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// The context length the model was trained for before scaling
    /// (`rope.scaling.original_context_length`, else `context_length`).
    pub n_ctx_orig: usize,
    /// The extrapolation mix (llama.cpp: 1 for YaRN files).
    pub ext_factor: f32,
    /// The magnitude factor llama.cpp derives (`yarn_attn_factor`).
    pub attn_factor: f32,
    /// Rotations per context where extrapolation starts (llama.cpp: 32).
    pub beta_fast: f32,
    /// Rotations per context where interpolation ends (llama.cpp: 1).
    pub beta_slow: f32,
}

/// YaRN's per-dimension ramp and magnitude for one layer's rotation, as ggml's rope computes
/// them (every executor derives its angles from this one definition).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct YarnRamp {
    /// The first rotated pair the ramp leaves (below it: extrapolated).
    pub low: f32,
    /// The pair past which every pair is interpolated.
    pub high: f32,
    /// The extrapolation mix.
    pub ext_factor: f32,
    /// What every cosine and sine is multiplied by.
    pub mscale: f32,
}

impl YarnRamp {
    /// The ramp of `rope`, when it scales by YaRN.
    pub fn of(rope: &Rope) -> Option<YarnRamp> {
        let y = rope.yarn?;
        // The dimension at which `beta` rotations fit in the original context.
        let corr_dim = |beta: f32| {
            let n_dims = rope.n_dims as f32;
            n_dims * (y.n_ctx_orig as f32 / (beta * 2.0 * std::f32::consts::PI)).ln()
                / (2.0 * rope.freq_base.ln())
        };
        let low = corr_dim(y.beta_fast).floor().max(0.0);
        let high = corr_dim(y.beta_slow).ceil().min(rope.n_dims as f32 - 1.0);
        let mut mscale = y.attn_factor * rope.attn_factor;
        if y.ext_factor != 0.0 {
            mscale *= 1.0 + 0.1 * (1.0 / rope.freq_scale).ln();
        }
        Some(YarnRamp {
            low,
            high,
            ext_factor: y.ext_factor,
            mscale,
        })
    }

    /// 1 for the fast dimensions (extrapolated), 0 for the slow ones (interpolated).
    pub fn ramp(&self, pair: usize) -> f32 {
        let y = (pair as f32 - self.low) / (self.high - self.low).max(0.001);
        1.0 - y.clamp(0.0, 1.0)
    }
}

/// LongRoPE's choice of divisors (`rope_factors_long.weight` / `rope_factors_short.weight`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LongRope {
    /// `rope.scaling.original_context_length` (the trained context length when absent).
    pub original_context: usize,
}

impl LongRope {
    /// Whether a sequence with room for `n_ctx` positions rotates with the long factors.
    /// llama.cpp (b11312) rounds the context size up to a multiple of 256 before comparing,
    /// and so does this, so that both pick the same set for the same context size.
    pub fn uses_long(&self, n_ctx: usize) -> bool {
        n_ctx.next_multiple_of(256) > self.original_context
    }
}

/// The attention of one layer.
#[derive(Clone, Debug, PartialEq)]
pub struct Attention {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_head_kv: usize,
    /// Dimensions per head.
    pub head_dim: usize,
    /// Biases on the Q, K and V projections (Qwen2).
    pub qkv_bias: bool,
    /// RMS norms over each query and key head before RoPE (Qwen3).
    pub qk_norm: bool,
    /// The rotary embedding.
    pub rope: Rope,
    /// The scale of the scores (`1/sqrt(head_dim)` unless the architecture says otherwise).
    pub scale: f32,
    /// Where `scale` applies: `true` multiplies the queries (f32, before they are rounded to
    /// f16 for the product) and leaves the scores unscaled (Gemma); `false` scales the scores.
    pub scale_queries: bool,
    /// Attention logit soft-cap `c`: scores become `c * tanh(scores / c)` before the softmax
    /// (Gemma 2).
    pub softcap: Option<f32>,
    /// Sliding-window attention: a query at position `p` sees keys at `p - window + 1 ..= p`
    /// (llama.cpp's standard SWA); the cache of such a layer keeps only a ring of positions.
    pub sliding_window: Option<usize>,
    /// The Q projection yields, per head, the query and then as many gate values; the attention
    /// output is multiplied by `sigmoid(gate)` before the output projection (Qwen3-Next).
    pub gated_output: bool,
    /// A learned logit per head (`attn_sinks.weight`) that joins each softmax as one more
    /// column with no value (gpt-oss): it takes probability from the keys.
    pub sinks: bool,
    /// A bias on the output projection (`attn_output.bias`, gpt-oss).
    pub out_bias: bool,
}

/// What mixes information across positions in a layer.
#[derive(Clone, Debug, PartialEq)]
pub enum Mixer {
    /// Self-attention over the KV cache, as the layer's [`Attention`] describes.
    Attention,
    /// A gated delta-net block (linear attention with a fixed-size recurrent state); the
    /// layer's [`Attention`] is then unused.
    GatedDeltaNet(DeltaNet),
}

/// A gated delta-net block (Qwen3-Next's linear-attention layers): a short causal convolution
/// over the projected Q/K/V, then per value head a `head_dim x head_dim` state updated by the
/// delta rule with a per-token decay and rate, read out by the query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNet {
    /// Query/key heads (`ssm.group_count`).
    pub n_k_heads: usize,
    /// Value heads (`ssm.time_step_rank`), a multiple of `n_k_heads`.
    pub n_v_heads: usize,
    /// Which key head each value head reads.
    pub key_heads: KeyHeads,
    /// Size of every key and value head (`ssm.state_size`).
    pub head_dim: usize,
    /// Taps of the causal depthwise convolution (`ssm.conv_kernel`).
    pub conv_kernel: usize,
}

/// How a delta-net's value heads share its fewer key heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyHeads {
    /// Value head `h` reads key head `h / (n_v_heads / n_k_heads)` (Qwen3-Next).
    Grouped,
    /// Value head `h` reads key head `h % n_k_heads` (Qwen3.5).
    Tiled,
}

impl DeltaNet {
    /// Channels of the convolution: queries, keys and values.
    pub fn conv_channels(&self) -> usize {
        (2 * self.n_k_heads + self.n_v_heads) * self.head_dim
    }
}

/// The feed-forward block of one layer.
#[derive(Clone, Debug, PartialEq)]
pub enum Ffn {
    /// `down(act(gate(x)) * up(x))`.
    Gated {
        /// Hidden size.
        n_ff: usize,
        /// The activation applied to the gate.
        activation: Activation,
    },
    /// A mixture of experts: a router picks `n_expert_used` of `n_expert` gated FFNs per
    /// token and sums their outputs, each weighted by its routing probability.
    Moe(Moe),
}

/// A mixture-of-experts feed-forward block (`ffn_gate_inp`, `ffn_{gate,up,down}_exps`).
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    /// Experts in the layer.
    pub n_expert: usize,
    /// Experts each token runs (top-k).
    pub n_expert_used: usize,
    /// Hidden size of each expert.
    pub n_ff: usize,
    /// The activation applied to each expert's gate.
    pub activation: Activation,
    /// How router logits become expert probabilities.
    pub gating: Gating,
    /// A per-expert bias added to the probabilities for selection only
    /// (`exp_probs_b.bias`, DeepSeek-V3 style): the weights use the unbiased probabilities.
    pub selection_bias: bool,
    /// Grouped top-k: only experts of the best groups may be selected, if any.
    pub groups: Option<ExpertGroups>,
    /// Biases on the router (`ffn_gate_inp.bias`) and on every expert's gate, up and down
    /// projections (`ffn_{gate,up,down}_exps.bias`, gpt-oss).
    pub biases: bool,
    /// The selected experts' weights divided by their sum (Mixtral, Qwen3-MoE).
    pub norm_weights: bool,
    /// The selected experts' weights multiplied by this (`expert_weights_scale`), if any.
    pub weights_scale: Option<f32>,
    /// A shared expert every token runs besides its routed ones (Qwen2-MoE), if any.
    pub shared: Option<SharedExpert>,
}

/// A gated FFN every token runs besides the routed experts (`ffn_{gate,up,down}_shexp`), its
/// output added to theirs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedExpert {
    /// Hidden size (`expert_shared_feed_forward_length`, else `feed_forward_length`).
    pub n_ff: usize,
    /// Whether the output is scaled per token by `sigmoid(ffn_gate_inp_shexp . x)` (Qwen2-MoE).
    pub gated: bool,
}

/// How a router's logits become the probabilities experts are selected and weighted by
/// (llama.cpp's `expert_gating_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over all experts, then top-k of the probabilities (Mixtral, Qwen-MoE; value 1).
    Softmax,
    /// An independent sigmoid per expert, then top-k (DeepSeek-V3, dots.llm1; value 2).
    Sigmoid,
    /// Top-k of the raw logits, then a softmax over the k selected only (gpt-oss; value 3).
    SoftmaxAfterTopK,
}

impl Gating {
    /// The gating of llama.cpp's `expert_gating_func` value, if it is one we run.
    pub fn from_gguf(value: u64) -> Option<Gating> {
        match value {
            1 => Some(Gating::Softmax),
            2 => Some(Gating::Sigmoid),
            3 => Some(Gating::SoftmaxAfterTopK),
            _ => None,
        }
    }
}

/// Grouped top-k (`expert_group_count`, `expert_group_used_count`): the experts split into
/// `n_group` equal groups in index order; each group scores the sum of its two best selection
/// probabilities; experts outside the `n_group_used` best groups cannot be selected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertGroups {
    /// Groups.
    pub n_group: usize,
    /// Groups a token's experts may come from.
    pub n_group_used: usize,
}

/// An activation function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)`.
    Silu,
    /// GELU, tanh approximation (through ggml's f16 table).
    GeluTanh,
    /// gpt-oss's clamped SwiGLU: `g = min(g, limit)`, `u = clamp(u, -limit, limit)`,
    /// `g * sigmoid(alpha * g) * (u + 1)`, with llama.cpp's fixed alpha 1.702 and limit 7.
    SwigluOai,
}

/// One decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPlan {
    /// Self-attention (what [`Mixer::Attention`] runs).
    pub attention: Attention,
    /// The token mixer: attention, or a recurrent block.
    pub mixer: Mixer,
    /// Feed-forward.
    pub ffn: Ffn,
    /// An RMS norm (`post_attention_norm.weight`) on the attention output before the residual
    /// add (Gemma 2/3).
    pub post_attention_norm: bool,
    /// An RMS norm (`post_ffw_norm.weight`) on the feed-forward output before the residual add
    /// (Gemma 2/3).
    pub post_ffn_norm: bool,
    /// Both block outputs multiplied by this before the residual add (Granite).
    pub residual_scale: Option<f32>,
}

/// A whole model.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelPlan {
    /// The architecture name from the file (`llama`, `qwen2`, ...).
    pub architecture: String,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Vocabulary size (rows of the embedding).
    pub n_vocab: usize,
    /// Context length the model was trained for.
    pub n_ctx_train: usize,
    /// Epsilon of every RMS norm.
    pub norm_eps: f32,
    /// The layers, in order.
    pub layers: Vec<LayerPlan>,
    /// The output matrix is the token embedding (no `output.weight`).
    pub tied_output: bool,
    /// The embedding rows multiplied by this (Gemma: `sqrt(n_embd)`; Granite: its
    /// `embedding_scale`).
    pub embedding_scale: Option<f32>,
    /// Final logit soft-cap `c`: logits become `c * tanh(logits / c)` (Gemma 2).
    pub final_logit_softcap: Option<f32>,
    /// Logits divided by this, as `logits * (1 / s)` (Granite's `logit_scale`).
    pub logit_scale: Option<f32>,
}

impl LayerPlan {
    /// Whether this layer is the plain llama layer (pre-norms, SwiGLU, scores scaled after the
    /// product, no window, no caps, no extra norms or scales); otherwise the first feature it
    /// carries beyond that, by name. A fast path that serves only llama layers declines with
    /// this (DESIGN.md principle 2): the plan is taken apart without `..`, so a field added
    /// later does not compile here until someone decides.
    pub fn beyond_llama(&self) -> Option<&'static str> {
        let LayerPlan {
            attention:
                Attention {
                    n_head: _,
                    n_head_kv: _,
                    head_dim: _,
                    qkv_bias: _,
                    qk_norm: _,
                    rope:
                        Rope {
                            layout: _,
                            n_dims: _,
                            freq_base: _,
                            freq_scale: _,
                            freq_factors: _,
                            long_rope,
                            attn_factor,
                            yarn,
                        },
                    scale: _,
                    scale_queries,
                    softcap,
                    sliding_window,
                    gated_output,
                    sinks,
                    out_bias,
                },
            mixer,
            ffn,
            post_attention_norm,
            post_ffn_norm,
            residual_scale,
        } = self;
        let recurrent = match mixer {
            Mixer::Attention => false,
            Mixer::GatedDeltaNet(DeltaNet {
                n_k_heads: _,
                n_v_heads: _,
                key_heads: _,
                head_dim: _,
                conv_kernel: _,
            }) => true,
        };
        let (activation, moe) = match ffn {
            Ffn::Gated {
                n_ff: _,
                activation,
            } => (*activation, false),
            Ffn::Moe(Moe {
                n_expert: _,
                n_expert_used: _,
                n_ff: _,
                activation,
                gating: _,
                selection_bias: _,
                groups: _,
                biases: _,
                norm_weights: _,
                weights_scale: _,
                shared: _,
            }) => (*activation, true),
        };
        [
            (recurrent, "gated delta-net layer"),
            (*gated_output, "gated attention output"),
            (moe, "mixture-of-experts feed-forward"),
            (*scale_queries, "queries scaled before the product"),
            (long_rope.is_some(), "LongRoPE frequency factors"),
            (*attn_factor != 1.0, "RoPE attention factor"),
            (softcap.is_some(), "attention logit soft-cap"),
            (sliding_window.is_some(), "sliding-window attention"),
            (yarn.is_some(), "YaRN rope scaling"),
            (*sinks, "attention sinks"),
            (*out_bias, "attention output bias"),
            (
                activation != Activation::Silu,
                "an activation other than SiLU",
            ),
            (*post_attention_norm, "post-attention norm"),
            (*post_ffn_norm, "post-feed-forward norm"),
            (residual_scale.is_some(), "residual scale"),
        ]
        .into_iter()
        .find_map(|(has, what)| has.then_some(what))
    }
}

impl ModelPlan {
    /// Like [`LayerPlan::beyond_llama`] for the whole model: the first feature, of any layer
    /// or of the model (embedding scale, final soft-cap, logit scale), beyond a llama model.
    pub fn beyond_llama(&self) -> Option<&'static str> {
        let ModelPlan {
            architecture: _,
            n_embd: _,
            n_vocab: _,
            n_ctx_train: _,
            norm_eps: _,
            layers,
            tied_output: _,
            embedding_scale,
            final_logit_softcap,
            logit_scale,
        } = self;
        layers.iter().find_map(LayerPlan::beyond_llama).or_else(|| {
            [
                (embedding_scale.is_some(), "embedding scale"),
                (final_logit_softcap.is_some(), "final logit soft-cap"),
                (logit_scale.is_some(), "logit scale"),
            ]
            .into_iter()
            .find_map(|(has, what)| has.then_some(what))
        })
    }
}
