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
}

/// An activation function.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x * sigmoid(x)`.
    Silu,
}

/// One decoder layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerPlan {
    /// Self-attention.
    pub attention: Attention,
    /// Feed-forward.
    pub ffn: Ffn,
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
}
