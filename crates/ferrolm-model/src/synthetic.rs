//! Synthetic GGUF files: random weights in the real metadata layout and tensor names of an
//! architecture, for parity tests against llama.cpp on architectures we have no small real
//! file of (MODELS.md, "Synthetic files").
//!
//! Everything is a pure function of the [`SyntheticSpec`]: the weights come from a small
//! counter-free generator (SplitMix64) and are shaped with additions and multiplications only
//! (no `ln`/`cos`, whose last bit may vary between C libraries), so the same spec writes the
//! same bytes on every machine, which the parity tests check by sha256.

use std::path::{Path, PathBuf};

use ferrolm_gguf::{Array, GgufFile, GgufWriter, TensorType, Value};

use crate::error::{ModelError, Result};

mod delta_net;

/// Where the tokenizer of a synthetic file comes from.
#[derive(Clone, Debug, PartialEq)]
pub enum TokenizerSource {
    /// A small byte-level BPE vocabulary (`gpt2` model, `gpt-2` pre-tokenizer) of
    /// [`MINIMAL_VOCAB`] tokens: the 256 bytes, 702 merges, `<|endoftext|>`.
    Minimal,
    /// Every `tokenizer.*` key of a real GGUF file (its vocabulary size becomes `n_vocab`).
    From(PathBuf),
}

/// Tokens in [`TokenizerSource::Minimal`]'s vocabulary.
pub const MINIMAL_VOCAB: usize = 256 + 26 + 26 * 26 + 1;

/// What to write: an architecture's shape, tensor types and seed.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticSpec {
    /// `general.architecture`: `llama`, `mistral`, `qwen2` or `qwen3`.
    pub arch: String,
    /// Layers.
    pub n_layer: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Size of one head (0: `n_embd / n_head`); written as `attention.key_length` and
    /// `value_length` when it differs from that.
    pub head_dim: usize,
    /// Hidden size of the feed-forward network.
    pub n_ff: usize,
    /// Experts per layer (`expert_count`; 0: dense feed-forward blocks). Each expert's hidden
    /// size is `n_ff` (written as `expert_feed_forward_length` too, outside `llama`).
    pub n_expert: usize,
    /// Experts each token runs (`expert_used_count`).
    pub n_expert_used: usize,
    /// Hidden size of the sigmoid-gated shared expert (`expert_shared_feed_forward_length`;
    /// 0: none). Written for `qwen2moe` only, whose layers require it.
    pub n_ff_shexp: usize,
    /// `context_length`.
    pub n_ctx: usize,
    /// `rope.freq_base`.
    pub rope_base: f32,
    /// `attention.layer_norm_rms_epsilon`.
    pub norm_eps: f32,
    /// `attention.sliding_window`, as Mistral files carry it.
    pub sliding_window: Option<u32>,
    /// Writes `rope_freqs.weight` (Llama 3 frequency factors).
    pub rope_freqs: bool,
    /// Phi-3 LongRoPE with this `rope.scaling.original_context_length`: writes
    /// `rope_factors_long`/`short.weight` and `rope.scaling.attn_factor` (phi3 only).
    pub long_rope: Option<usize>,
    /// YaRN scaling `(rope.scaling.factor, rope.scaling.original_context_length)`: writes
    /// `rope.scaling.type` = `yarn` and both keys.
    pub yarn: Option<(f32, usize)>,
    /// Shares the embedding as output matrix (no `output.weight`).
    pub tied_output: bool,
    /// Writes Q/K/V and attention-output biases (which llama.cpp uses on the llama family
    /// whenever a file has them; qwen2's Q/K/V biases are written regardless).
    pub attention_biases: bool,
    /// The type of every matrix without an entry in `types`.
    pub default_type: TensorType,
    /// Per-tensor types: the first entry whose key is a substring of the tensor's name wins
    /// (`("attn_v", F16)`, `("blk.1.ffn_down", Q5_1)`). Norms, biases and `rope_freqs` stay F32.
    pub types: Vec<(String, TensorType)>,
    /// Seed of the weights.
    pub seed: u64,
    /// The tokenizer.
    pub tokenizer: TokenizerSource,
    /// The gated delta-net layers of a hybrid file (`qwen3next`), if any.
    pub delta_net: Option<SyntheticDeltaNet>,
}

/// The recurrent layers of a synthetic hybrid file: their `ssm.*` keys and schedule.
#[derive(Clone, Debug, PartialEq)]
pub struct SyntheticDeltaNet {
    /// `ssm.state_size`: the size of every key and value head.
    pub state_size: usize,
    /// `ssm.group_count`: key heads.
    pub group_count: usize,
    /// `ssm.time_step_rank`: value heads.
    pub time_step_rank: usize,
    /// `ssm.conv_kernel`.
    pub conv_kernel: usize,
    /// `full_attention_interval`: every this-th layer is attention, the others recurrent.
    pub full_attention_interval: usize,
    /// Writes the projections as `attn_qkv` + `attn_gate` instead of the fused `ssm_in`.
    pub split_projections: bool,
}

impl SyntheticSpec {
    /// A small file of `arch` (4 layers, 256 wide, 8 heads, 512 feed-forward) that exercises
    /// what distinguishes the architecture: GQA everywhere, `head_dim != n_embd / n_head` for
    /// qwen3, a sliding window key for llama/mistral; matrices in a mix of Q8_0, Q4_1, Q5_0,
    /// Q5_1 and F16 (the block types whose dot products ferrolm mirrors bit for bit).
    ///
    /// gemma2/gemma3: 6 layers (Gemma 3's default pattern slides five of six), a 64-position
    /// window (so that prompts cross it), 8 heads of 48 (head size independent of the width);
    /// granite: its four scales (see [`build`]).
    pub fn small(arch: &str) -> SyntheticSpec {
        if let Some(s) = crate::synthetic_moe::small(arch) {
            return s;
        }
        if arch == "qwen3next" {
            return SyntheticSpec::small_qwen3next();
        }
        if arch == "qwen35" {
            return SyntheticSpec::small_qwen35();
        }
        if arch == "qwen35moe" {
            // Qwen3-Next's experts in Qwen3.5's layout.
            return SyntheticSpec {
                arch: arch.into(),
                ..SyntheticSpec::small_qwen3next()
            };
        }
        let qwen = arch.starts_with("qwen");
        let mistral_like = arch == "llama" || arch == "mistral";
        if arch.starts_with("gemma") {
            let mut s = SyntheticSpec::small("llama");
            s.arch = arch.to_string();
            s.n_layer = 6;
            s.head_dim = 48;
            s.norm_eps = 1e-6;
            s.sliding_window = Some(64);
            s.tied_output = true;
            s.rope_base = if arch == "gemma3" {
                1_000_000.0
            } else {
                10_000.0
            };
            return s;
        }
        SyntheticSpec {
            arch: arch.to_string(),
            n_layer: 4,
            n_embd: 256,
            n_head: 8,
            n_head_kv: 2,
            head_dim: if arch.starts_with("qwen3") { 48 } else { 0 },
            n_ff: if arch.ends_with("moe") { 256 } else { 512 },
            n_expert: if arch.ends_with("moe") { 8 } else { 0 },
            n_expert_used: if arch.ends_with("moe") { 2 } else { 0 },
            n_ff_shexp: if arch == "qwen2moe" { 384 } else { 0 },
            n_ctx: 2048,
            rope_base: if qwen { 1_000_000.0 } else { 10_000.0 },
            norm_eps: if qwen { 1e-6 } else { 1e-5 },
            sliding_window: mistral_like.then_some(64),
            rope_freqs: false,
            long_rope: None,
            yarn: None,
            tied_output: false,
            attention_biases: false,
            default_type: TensorType::Q8_0,
            types: mixed_types(),
            seed: 42,
            tokenizer: TokenizerSource::Minimal,
            delta_net: None,
        }
    }

    /// A small Qwen3-Next file: 4 layers (three gated delta-net layers, then attention),
    /// 256 wide; attention of 4 heads of 64 (2 KV heads) with a gated output and 16 of 64
    /// dimensions rotating; delta-nets of 4 key heads and 8 value heads of 32, a 4-tap
    /// convolution; every layer 8 experts (top-2) of 128 plus a gated shared expert of 256.
    pub fn small_qwen3next() -> SyntheticSpec {
        SyntheticSpec {
            arch: "qwen3next".into(),
            n_head: 4,
            head_dim: 64,
            n_ff: 128,
            n_expert: 8,
            n_expert_used: 2,
            n_ff_shexp: 256,
            rope_base: 10_000_000.0,
            sliding_window: None,
            delta_net: Some(SyntheticDeltaNet {
                state_size: 32,
                group_count: 4,
                time_step_rank: 8,
                conv_kernel: 4,
                full_attention_interval: 4,
                split_projections: false,
            }),
            ..SyntheticSpec::small("qwen3")
        }
    }

    /// A small Qwen3.5 file: [`SyntheticSpec::small_qwen3next`]'s attention and delta-nets
    /// (in Qwen3.5's layout: `attn_qkv` + `attn_gate`, `ssm_beta` + `ssm_alpha`, value heads
    /// tiling the key heads; `rope.dimension_sections` [3, 3, 2, 0] over the 16 rotated
    /// dimensions) with dense feed-forward blocks of 512.
    pub fn small_qwen35() -> SyntheticSpec {
        SyntheticSpec {
            arch: "qwen35".into(),
            n_ff: 512,
            n_expert: 0,
            n_expert_used: 0,
            n_ff_shexp: 0,
            ..SyntheticSpec::small_qwen3next()
        }
    }

    /// The head size.
    pub fn head_dim(&self) -> usize {
        if self.head_dim == 0 {
            self.n_embd / self.n_head.max(1)
        } else {
            self.head_dim
        }
    }
}

/// The default mix of block types across tensors.
pub fn mixed_types() -> Vec<(String, TensorType)> {
    [
        ("token_embd", TensorType::Q8_0),
        ("output.weight", TensorType::Q8_0),
        ("attn_q.", TensorType::Q5_0),
        ("attn_k.", TensorType::Q4_1),
        ("attn_v.", TensorType::F16),
        ("attn_output", TensorType::Q5_1),
        ("ffn_gate", TensorType::Q8_0),
        ("ffn_up", TensorType::Q5_1),
        ("ffn_down", TensorType::Q4_1),
    ]
    .into_iter()
    .map(|(k, t)| (k.to_string(), t))
    .collect()
}

/// SplitMix64, and values shaped from it with exact arithmetic only.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1), 24 bits.
    fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 * (1.0 / 16_777_216.0)
    }

    /// About normal with mean 0 and standard deviation `std` (Irwin-Hall of four uniforms).
    fn normal(&mut self, std: f32) -> f32 {
        let s = self.uniform() + self.uniform() + self.uniform() + self.uniform();
        (s - 2.0) * 1.732_050_8 * std
    }
}

/// One tensor to write: GGML dims and how to draw it.
pub(crate) enum Init {
    Normal(f32),
    /// 1 + normal(std): norm weights.
    AroundOne(f32),
    /// Llama 3 style frequency factors: 1 for the fast dimensions, rising to 8.
    FreqFactors,
    /// Uniform in `[lo, hi)`.
    Uniform(f32, f32),
    /// LongRoPE's short factors: 1 rising to 1.25.
    ShortFactors,
    /// LongRoPE's long factors: 1 rising to 24, steeply enough to move the fast dimensions too.
    LongFactors,
}

/// Writes the file `spec` describes at `path`.
pub fn write(spec: &SyntheticSpec, path: impl AsRef<Path>) -> Result<()> {
    build(spec)?.write_file(path)?;
    Ok(())
}

/// The file `spec` describes, ready to write (add or replace keys and tensors before writing
/// to make a broken file).
pub fn build(spec: &SyntheticSpec) -> Result<GgufWriter> {
    let invalid = |m: String| ModelError::Invalid(m);
    let hd = spec.head_dim();
    if spec.n_head == 0 || spec.n_head_kv == 0 || !spec.n_head.is_multiple_of(spec.n_head_kv) {
        return Err(invalid(format!(
            "{} query heads cannot share {} key/value heads",
            spec.n_head, spec.n_head_kv
        )));
    }
    if spec.n_layer == 0 || spec.n_embd == 0 || spec.n_ff == 0 || hd == 0 || !hd.is_multiple_of(2) {
        return Err(invalid(format!(
            "cannot build {} layers of width {}, feed-forward {}, head size {hd}",
            spec.n_layer, spec.n_embd, spec.n_ff
        )));
    }
    let mut w = GgufWriter::new();
    let arch = spec.arch.as_str();
    let n_vocab = tokenizer(&mut w, &spec.tokenizer)?;
    let key = |s: &str| format!("{arch}.{s}");
    let u32v = |n: usize| Value::U32(n as u32);
    w.set("general.architecture", Value::String(arch.to_string()));
    // (llama.cpp applies a tokenizer workaround, looking up `</s>`, to files whose name contains
    // "phi3" or "phi-3".)
    let name = if arch == "phi3" { "p-three" } else { arch };
    w.set("general.name", Value::String(format!("synthetic-{name}")));
    w.set(key("context_length"), u32v(spec.n_ctx));
    w.set(key("embedding_length"), u32v(spec.n_embd));
    w.set(key("block_count"), u32v(spec.n_layer));
    w.set(key("feed_forward_length"), u32v(spec.n_ff));
    if spec.n_expert > 0 {
        if spec.n_expert_used == 0 || spec.n_expert_used > spec.n_expert {
            return Err(invalid(format!(
                "{} experts used of {}",
                spec.n_expert_used, spec.n_expert
            )));
        }
        w.set(key("expert_count"), u32v(spec.n_expert));
        w.set(key("expert_used_count"), u32v(spec.n_expert_used));
        if arch != "llama" {
            w.set(key("expert_feed_forward_length"), u32v(spec.n_ff));
        }
        if spec.n_ff_shexp > 0 {
            w.set(
                key("expert_shared_feed_forward_length"),
                u32v(spec.n_ff_shexp),
            );
        }
    }
    w.set(key("attention.head_count"), u32v(spec.n_head));
    w.set(key("attention.head_count_kv"), u32v(spec.n_head_kv));
    w.set(
        key("attention.layer_norm_rms_epsilon"),
        Value::F32(spec.norm_eps),
    );
    w.set(key("rope.freq_base"), Value::F32(spec.rope_base));
    // Phi-3 with partial rotary: three quarters of each head rotate; Qwen3-Next: a quarter.
    let n_rot = match arch {
        "phi3" => (hd * 3 / 4) & !1,
        "qwen3next" | "qwen35" | "qwen35moe" => (hd / 4) & !1,
        _ => hd,
    };
    if let Some(net) = &spec.delta_net {
        delta_net::keys(&mut w, arch, net);
    }
    w.set(key("rope.dimension_count"), u32v(n_rot));
    if hd * spec.n_head != spec.n_embd {
        w.set(key("attention.key_length"), u32v(hd));
        w.set(key("attention.value_length"), u32v(hd));
    }
    if let Some(sw) = spec.sliding_window {
        w.set(key("attention.sliding_window"), Value::U32(sw));
    }
    if let Some((factor, orig)) = spec.yarn {
        w.set(key("rope.scaling.type"), Value::String("yarn".into()));
        w.set(key("rope.scaling.factor"), Value::F32(factor));
        w.set(key("rope.scaling.original_context_length"), u32v(orig));
    }
    if let Some(orig) = spec.long_rope {
        if arch != "phi3" || orig == 0 {
            return Err(invalid(format!(
                "LongRoPE over an original context of {orig} in {arch} (phi3 only)"
            )));
        }
        w.set(key("rope.scaling.original_context_length"), u32v(orig));
        // Phi-3's converter: sqrt(1 + ln(scale) / ln(original context)); log2 keeps the ratio
        // and is exact for powers of two.
        let scale = (spec.n_ctx as f64 / orig as f64).max(1.0);
        let attn_factor = (1.0 + scale.log2() / (orig as f64).log2()).sqrt();
        w.set(
            key("rope.scaling.attn_factor"),
            Value::F32(attn_factor as f32),
        );
    }
    if arch == "llama" || arch == "mistral" {
        w.set(key("vocab_size"), u32v(n_vocab));
    }
    let gemma = arch == "gemma2" || arch == "gemma3";
    if arch == "gemma2" {
        // Caps small enough to bite on O(1) random-weight scores and logits.
        w.set(key("attn_logit_softcapping"), Value::F32(4.0));
        w.set(key("final_logit_softcapping"), Value::F32(3.0));
    }
    if arch == "granite" {
        w.set(key("embedding_scale"), Value::F32(3.0));
        w.set(key("residual_scale"), Value::F32(0.5));
        w.set(key("attention.scale"), Value::F32(0.09));
        w.set(key("logit_scale"), Value::F32(0.75));
    }
    crate::synthetic_moe::keys(spec, &mut w);

    let (d, q_dim, kv_dim) = (spec.n_embd, spec.n_head * hd, spec.n_head_kv * hd);
    let matrix_type = |name: &str| {
        spec.types
            .iter()
            .find(|(k, _)| name.contains(k.as_str()))
            .map_or(spec.default_type, |(_, t)| *t)
    };
    let mut tensors: Vec<(String, Vec<u64>, Init, bool)> = Vec::new();
    let mut add = |name: String, dims: &[usize], init: Init, is_matrix: bool| {
        tensors.push((
            name,
            dims.iter().map(|&x| x as u64).collect(),
            init,
            is_matrix,
        ))
    };
    // Embedding rows of unit scale (each is normalized before use); matrices scaled so that
    // activations stay O(1): std about 1/sqrt(fan-in).
    add(
        "token_embd.weight".into(),
        &[d, n_vocab],
        Init::Normal(1.0),
        true,
    );
    let m = |fan_in: usize| Init::Normal(0.7 / (fan_in as f32).sqrt());
    let recurrent = |i: usize| {
        spec.delta_net
            .as_ref()
            .is_some_and(|net| delta_net::is_recurrent(net, i))
    };
    // A gated attention output doubles the Q projection (per head: query, then gate).
    let q_rows = if ["qwen3next", "qwen35", "qwen35moe"].contains(&arch) {
        2 * q_dim
    } else {
        q_dim
    };
    for i in 0..spec.n_layer {
        if crate::synthetic_moe::layer(spec, i, &mut add) {
            continue;
        }
        let n = |s: &str| format!("blk.{i}.{s}");
        add(n("attn_norm.weight"), &[d], Init::AroundOne(0.1), false);
        if let (Some(net), true) = (&spec.delta_net, recurrent(i)) {
            for (name, dims, init, is_matrix) in delta_net::layer_tensors(arch, net, i, d) {
                add(name, &dims, init, is_matrix);
            }
        } else if arch == "phi3" {
            add(n("attn_qkv.weight"), &[d, q_dim + 2 * kv_dim], m(d), true);
        } else {
            add(n("attn_q.weight"), &[d, q_rows], m(d), true);
            add(n("attn_k.weight"), &[d, kv_dim], m(d), true);
            add(n("attn_v.weight"), &[d, kv_dim], m(d), true);
        }
        if arch == "qwen2" || arch == "qwen2moe" || spec.attention_biases {
            add(n("attn_q.bias"), &[q_dim], Init::Normal(0.1), false);
            add(n("attn_k.bias"), &[kv_dim], Init::Normal(0.1), false);
            add(n("attn_v.bias"), &[kv_dim], Init::Normal(0.1), false);
        }
        if spec.attention_biases {
            add(n("attn_output.bias"), &[d], Init::Normal(0.1), false);
        }
        let q_norms = [
            "qwen3",
            "qwen3moe",
            "gemma3",
            "qwen3next",
            "qwen35",
            "qwen35moe",
        ]
        .contains(&arch);
        if q_norms && !recurrent(i) {
            add(n("attn_q_norm.weight"), &[hd], Init::AroundOne(0.2), false);
            add(n("attn_k_norm.weight"), &[hd], Init::AroundOne(0.2), false);
        }
        if !recurrent(i) {
            add(n("attn_output.weight"), &[q_dim, d], m(q_dim), true);
        }
        if gemma {
            add(
                n("post_attention_norm.weight"),
                &[d],
                Init::AroundOne(0.1),
                false,
            );
        }
        // Qwen3-Next names the norm before the feed-forward block post_attention_norm.
        let ffn_norm = crate::arch::ffn_norm_tensor(arch);
        add(
            n(&format!("{ffn_norm}.weight")),
            &[d],
            Init::AroundOne(0.1),
            false,
        );
        let (ff, ne) = (spec.n_ff, spec.n_expert);
        if ne > 0 {
            // A router wider than the other matrices: clearer winners, fewer near-tied picks.
            let router = Init::Normal(2.0 / (d as f32).sqrt());
            add(n("ffn_gate_inp.weight"), &[d, ne], router, true);
            add(n("ffn_gate_exps.weight"), &[d, ff, ne], m(d), true);
            add(n("ffn_up_exps.weight"), &[d, ff, ne], m(d), true);
            add(n("ffn_down_exps.weight"), &[ff, d, ne], m(ff), true);
            let sf = spec.n_ff_shexp;
            if sf > 0 {
                // The shared expert's gate: one F32 row (llama.cpp keeps vectors unquantized).
                let gate = Init::Normal(1.0 / (d as f32).sqrt());
                add(n("ffn_gate_inp_shexp.weight"), &[d], gate, false);
                add(n("ffn_gate_shexp.weight"), &[d, sf], m(d), true);
                add(n("ffn_up_shexp.weight"), &[d, sf], m(d), true);
                add(n("ffn_down_shexp.weight"), &[sf, d], m(sf), true);
            }
        } else if arch == "phi3" {
            add(n("ffn_up.weight"), &[d, 2 * spec.n_ff], m(d), true);
        } else {
            add(n("ffn_gate.weight"), &[d, spec.n_ff], m(d), true);
            add(n("ffn_up.weight"), &[d, spec.n_ff], m(d), true);
        }
        if ne == 0 {
            add(n("ffn_down.weight"), &[spec.n_ff, d], m(spec.n_ff), true);
        }
        if gemma {
            add(n("post_ffw_norm.weight"), &[d], Init::AroundOne(0.1), false);
        }
    }
    add(
        "output_norm.weight".into(),
        &[d],
        Init::AroundOne(0.1),
        false,
    );
    if !spec.tied_output {
        add("output.weight".into(), &[d, n_vocab], m(d / 8), true);
    }
    if spec.long_rope.is_some() {
        add(
            "rope_factors_long.weight".into(),
            &[n_rot / 2],
            Init::LongFactors,
            false,
        );
        add(
            "rope_factors_short.weight".into(),
            &[n_rot / 2],
            Init::ShortFactors,
            false,
        );
    }
    if spec.rope_freqs {
        add(
            "rope_freqs.weight".into(),
            &[hd / 2],
            Init::FreqFactors,
            false,
        );
    }

    let mut rng = Rng(spec.seed);
    for (place, (name, dims, init, is_matrix)) in tensors.into_iter().enumerate() {
        let n: usize = dims.iter().product::<u64>() as usize;
        let ty = if is_matrix {
            matrix_type(&name)
        } else {
            TensorType::F32
        };
        if let (Init::Normal(std), true) = (&init, n > PARALLEL_VALUES) {
            let seed = spec.seed ^ (place as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            if let Some(data) = normal_in_parallel(ty, n, dims[0] as usize, *std, seed) {
                w.add_tensor(name, &dims, ty, data)?;
                continue;
            }
        }
        let values: Vec<f32> = match init {
            Init::Normal(std) => (0..n).map(|_| rng.normal(std)).collect(),
            Init::AroundOne(std) => (0..n).map(|_| 1.0 + rng.normal(std)).collect(),
            Init::Uniform(lo, hi) => (0..n).map(|_| lo + (hi - lo) * rng.uniform()).collect(),
            Init::FreqFactors => (0..n)
                .map(|j| 1.0 + 7.0 * (j as f32 / (n.max(2) - 1) as f32))
                .collect(),
            Init::ShortFactors => (0..n)
                .map(|j| 1.0 + 0.25 * (j as f32 / (n.max(2) - 1) as f32))
                .collect(),
            Init::LongFactors => (0..n)
                .map(|j| {
                    let t = j as f32 / (n.max(2) - 1) as f32;
                    1.0 + 3.0 * t + 20.0 * t * t
                })
                .collect(),
        };
        let bytes = ferrolm_quant::row_bytes(ty, n)
            .map_err(|e| invalid(format!("{name}: {ty} for {n} values: {e}")))?;
        let mut data = vec![0u8; bytes];
        match ferrolm_quant::quantize(ty, &values, &mut data) {
            Ok(()) => {}
            // No quantizer here (the i-quants, TQ1_0, ...): random valid blocks of the values' RMS.
            Err(ferrolm_quant::QuantError::Unsupported { .. }) => {
                let rms = (values.iter().map(|v| v * v).sum::<f32>() / n.max(1) as f32).sqrt();
                data = ferrolm_quant::random_blocks(ty, n, rms, &mut || rng.next_u64())
                    .map_err(|e| invalid(format!("{name}: cannot write {ty}: {e}")))?;
            }
            Err(e) => return Err(invalid(format!("{name}: cannot quantize to {ty}: {e}"))),
        }
        w.add_tensor(name, &dims, ty, data)?;
    }
    Ok(w)
}

/// Tensors of more values than this draw them in chunks of rows on every core, each chunk from
/// its own stream (seeded by the spec's seed, the tensor's place and the chunk's), so that
/// files of real models' sizes take seconds; smaller ones draw from the file's one stream. (The
/// files whose outputs the tests compare with llama.cpp's are all far smaller.)
const PARALLEL_VALUES: usize = 1 << 26;

/// Values a chunk of [`normal_in_parallel`] draws, at least (whole rows).
const CHUNK_VALUES: usize = 1 << 22;

/// `n` values of standard deviation `std` in rows of `row` as type `ty`, drawn and quantized
/// chunk by chunk on every core; `None` where `ty` has no quantizer here or `row` is not a
/// whole number of its blocks (the caller draws them in one stream).
fn normal_in_parallel(
    ty: TensorType,
    n: usize,
    row: usize,
    std: f32,
    seed: u64,
) -> Option<Vec<u8>> {
    let row_bytes = ferrolm_quant::row_bytes(ty, row).ok()?;
    let mut probe = vec![0u8; row_bytes];
    ferrolm_quant::quantize(ty, &vec![0.0; row], &mut probe).ok()?;
    if row == 0 || !n.is_multiple_of(row) {
        return None;
    }
    let rows_per_chunk = CHUNK_VALUES.div_ceil(row);
    let mut data = vec![0u8; n / row * row_bytes];
    let chunks: Vec<(usize, &mut [u8])> = data
        .chunks_mut(rows_per_chunk * row_bytes)
        .enumerate()
        .collect();
    let work = std::sync::Mutex::new(chunks);
    let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        for _ in 0..threads {
            scope.spawn(|| loop {
                let Some((c, out)) = work.lock().map_or(None, |mut w| w.pop()) else {
                    return;
                };
                let mut rng = Rng(seed ^ (c as u64).wrapping_mul(0xbf58_476d_1ce4_e5b9));
                let values: Vec<f32> = (0..out.len() / row_bytes * row)
                    .map(|_| rng.normal(std))
                    .collect();
                if ferrolm_quant::quantize(ty, &values, out).is_err() {
                    failed.store(true, std::sync::atomic::Ordering::Relaxed);
                }
            });
        }
    });
    (!failed.into_inner()).then_some(data)
}

/// Writes the tokenizer keys; returns the vocabulary size.
fn tokenizer(w: &mut GgufWriter, source: &TokenizerSource) -> Result<usize> {
    match source {
        TokenizerSource::From(path) => {
            let file = GgufFile::open(path)?;
            let mut n_vocab = 0;
            for (k, v) in file.metadata().iter() {
                if k.starts_with("tokenizer.") {
                    if k == "tokenizer.ggml.tokens" {
                        if let Value::Array(a) = v {
                            n_vocab = a.len();
                        }
                    }
                    w.set(k, v.clone());
                }
            }
            if n_vocab == 0 {
                return Err(ModelError::Invalid(format!(
                    "{} has no tokenizer.ggml.tokens to borrow",
                    path.display()
                )));
            }
            Ok(n_vocab)
        }
        TokenizerSource::Minimal => {
            // GPT-2's byte-to-unicode mapping: printable bytes stand for themselves, the others
            // for 256 + their rank.
            let mut byte_char = [' '; 256];
            let mut extra = 0u32;
            for b in 0..256u32 {
                let printable =
                    (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
                byte_char[b as usize] = if printable {
                    char::from_u32(b).unwrap()
                } else {
                    extra += 1;
                    char::from_u32(255 + extra).unwrap()
                };
            }
            let mut tokens: Vec<String> = byte_char.iter().map(|c| c.to_string()).collect();
            let mut merges = Vec::new();
            let space = byte_char[b' ' as usize];
            for a in 'a'..='z' {
                merges.push(format!("{space} {a}"));
                tokens.push(format!("{space}{a}"));
            }
            for a in 'a'..='z' {
                for b in 'a'..='z' {
                    merges.push(format!("{a} {b}"));
                    tokens.push(format!("{a}{b}"));
                }
            }
            tokens.push("<|endoftext|>".into());
            let mut types = vec![1i32; tokens.len()];
            let eot = tokens.len() - 1;
            types[eot] = 3;
            debug_assert_eq!(tokens.len(), MINIMAL_VOCAB);
            w.set("tokenizer.ggml.model", Value::String("gpt2".into()));
            w.set("tokenizer.ggml.pre", Value::String("gpt-2".into()));
            w.set(
                "tokenizer.ggml.tokens",
                Value::Array(Array::String(tokens.clone())),
            );
            w.set("tokenizer.ggml.token_type", Value::Array(Array::I32(types)));
            w.set("tokenizer.ggml.merges", Value::Array(Array::String(merges)));
            w.set("tokenizer.ggml.bos_token_id", Value::U32(eot as u32));
            w.set("tokenizer.ggml.eos_token_id", Value::U32(eot as u32));
            w.set("tokenizer.ggml.add_bos_token", Value::Bool(false));
            Ok(tokens.len())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_spec_same_bytes_and_loads() {
        let mut spec = SyntheticSpec::small("qwen3");
        spec.n_layer = 1;
        let a = build(&spec).unwrap().to_bytes();
        assert_eq!(a, build(&spec).unwrap().to_bytes());
        spec.seed += 1;
        assert_ne!(a, build(&spec).unwrap().to_bytes());
        let file = std::sync::Arc::new(GgufFile::from_bytes(a).unwrap());
        let model = crate::Model::from_file(file, 1).unwrap();
        assert_eq!(model.plan().n_vocab, MINIMAL_VOCAB);
        assert_eq!(model.plan().layers[0].attention.head_dim, 48);
    }

    /// A large tensor's values, drawn chunk by chunk on every core: the same bytes every time,
    /// of the spread asked for, each chunk its own draw; no quantizer, no parallel draw.
    #[test]
    fn large_tensors_draw_in_parallel_the_same_bytes_every_time() {
        let (row, rows) = (2048, 2 * CHUNK_VALUES / 2048 + 3);
        let n = row * rows;
        let a = normal_in_parallel(TensorType::Q8_0, n, row, 0.02, 7).unwrap();
        assert_eq!(
            a,
            normal_in_parallel(TensorType::Q8_0, n, row, 0.02, 7).unwrap()
        );
        assert_ne!(
            a,
            normal_in_parallel(TensorType::Q8_0, n, row, 0.02, 8).unwrap()
        );
        let mut v = vec![0f32; n];
        ferrolm_quant::dequantize(TensorType::Q8_0, &a, &mut v).unwrap();
        let std = (v.iter().map(|x| x * x).sum::<f32>() / n as f32).sqrt();
        assert!((std - 0.02).abs() < 0.001, "std {std}");
        // (the first rows of the first and second chunks differ)
        let chunk = CHUNK_VALUES.div_ceil(row) * row;
        assert_ne!(v[..row], v[chunk..chunk + row]);
        assert!(normal_in_parallel(TensorType::IQ2_XXS, n, row, 0.02, 7).is_none());
        assert!(normal_in_parallel(TensorType::Q8_0, n, 33, 0.02, 7).is_none());
    }
}
