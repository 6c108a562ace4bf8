//! `ferrolm synth`: writes a synthetic GGUF (random weights, real metadata layout) for parity
//! tests against llama.cpp.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm_gguf::TensorType;
use ferrolm_model::synthetic::{self, SyntheticSpec, TokenizerSource};

/// Flags of `ferrolm synth`.
#[derive(Args, Debug)]
pub struct SynthArgs {
    /// Architecture (one `ferrolm` runs: llama, mistral, qwen2, qwen2moe, qwen3, qwen3moe, dots1, gpt-oss, gemma2, ...).
    #[arg(long, required_unless_present = "shape")]
    pub arch: Option<String>,
    /// A real model's shape instead (smollm2-135m, llama-3.2-1b, llama-3.1-8b, qwen2.5-0.5b),
    /// with `--type` a file type (f16, q4_0, q4_1, q5_0, q5_1, q8_0, q4_k_m, q6_k) mixed as
    /// llama-quantize mixes it; the default model's tokenizer unless `--tokenizer-from`.
    #[arg(long, conflicts_with = "arch")]
    pub shape: Option<String>,
    /// With `--shape`: every matrix in the base type (llama-quantize's `--pure`).
    #[arg(long, requires = "shape")]
    pub pure: bool,
    /// With `--shape`: threads writing the file (0: every core).
    #[arg(long, default_value_t = 0, requires = "shape")]
    pub threads: usize,
    /// Output file.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Layers.
    #[arg(long)]
    pub layers: Option<usize>,
    /// Width of the residual stream.
    #[arg(long)]
    pub embd: Option<usize>,
    /// Query heads.
    #[arg(long)]
    pub heads: Option<usize>,
    /// Key/value heads.
    #[arg(long)]
    pub kv_heads: Option<usize>,
    /// Head size (0: embd / heads).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Feed-forward hidden size.
    #[arg(long)]
    pub ff: Option<usize>,
    /// Experts per layer (0: dense; `llama` with experts is Mixtral-shaped; `qwen3moe` needs
    /// them).
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts each token runs (top-k).
    #[arg(long)]
    pub experts_used: Option<usize>,
    /// Context length written to the file.
    #[arg(long)]
    pub ctx: Option<usize>,
    /// RoPE frequency base.
    #[arg(long)]
    pub rope_base: Option<f32>,
    /// `attention.sliding_window` (0: none).
    #[arg(long)]
    pub sliding_window: Option<u32>,
    /// Write `rope_freqs.weight` (Llama 3 frequency factors).
    #[arg(long)]
    pub rope_freqs: bool,
    /// Phi-3 LongRoPE factors, with this original context length (phi3 only).
    #[arg(long, value_name = "ORIGINAL_CTX")]
    pub long_rope: Option<usize>,
    /// YaRN RoPE scaling: `FACTOR:ORIGINAL_CTX` (`rope.scaling.type` yarn).
    #[arg(long, value_name = "FACTOR:ORIGINAL_CTX")]
    pub yarn: Option<String>,
    /// Tie the output matrix to the embedding.
    #[arg(long)]
    pub tied: bool,
    /// Write Q/K/V and attention-output biases (llama.cpp applies them on the llama family
    /// whenever a file has them).
    #[arg(long)]
    pub attention_biases: bool,
    /// Type of every matrix (`q8_0`, `f16`, ...), or `mixed` for a mix of Q8_0, Q4_1, Q5_0,
    /// Q5_1 and F16.
    #[arg(long = "type", default_value = "mixed")]
    pub ty: String,
    /// Type of the tensors whose name contains PATTERN (`attn_v=f16`, `blk.0.ffn_down=q5_1`);
    /// repeatable, the first match wins, before `--type`.
    #[arg(long = "tensor-type", value_name = "PATTERN=TYPE")]
    pub tensor_types: Vec<String>,
    /// Seed of the weights.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Borrow the tokenizer of this GGUF file (default: a 959-token byte-level BPE).
    #[arg(long)]
    pub tokenizer_from: Option<PathBuf>,
    /// Hybrid files (qwen3next): every N-th layer is attention, the others gated delta-nets.
    #[arg(long)]
    pub full_attention_interval: Option<usize>,
    /// Hybrid files (qwen3next): write the delta-nets' projections as `attn_qkv` + `attn_gate`
    /// instead of the fused `ssm_in`.
    #[arg(long)]
    pub ssm_split: bool,
    /// Hybrid files (qwen3next): the size of every delta-net key and value head
    /// (`ssm.state_size`).
    #[arg(long)]
    pub ssm_state: Option<usize>,
    /// Hybrid files (qwen3next): delta-net key heads (`ssm.group_count`).
    #[arg(long)]
    pub ssm_k_heads: Option<usize>,
    /// Hybrid files (qwen3next): delta-net value heads (`ssm.time_step_rank`).
    #[arg(long)]
    pub ssm_v_heads: Option<usize>,
}

/// The spec the flags describe.
pub fn spec(args: &SynthArgs) -> Result<SyntheticSpec> {
    let known = ferrolm_model::arch::supported();
    let arch = args.arch.as_deref().unwrap_or_default();
    if !known.contains(&arch) {
        bail!(
            "cannot synthesize architecture {arch:?} (supported: {})",
            known.join(", ")
        );
    }
    let mut s = SyntheticSpec::small(arch);
    let set = |v: Option<usize>, d: &mut usize| {
        if let Some(v) = v {
            *d = v;
        }
    };
    set(args.layers, &mut s.n_layer);
    set(args.embd, &mut s.n_embd);
    set(args.heads, &mut s.n_head);
    set(args.kv_heads, &mut s.n_head_kv);
    set(args.head_dim, &mut s.head_dim);
    set(args.ff, &mut s.n_ff);
    set(args.ctx, &mut s.n_ctx);
    set(args.experts, &mut s.n_expert);
    set(args.experts_used, &mut s.n_expert_used);
    if let Some(b) = args.rope_base {
        s.rope_base = b;
    }
    if let Some(w) = args.sliding_window {
        s.sliding_window = (w != 0).then_some(w);
    }
    s.rope_freqs = args.rope_freqs;
    s.long_rope = args.long_rope;
    if let Some(y) = &args.yarn {
        let parsed = y
            .split_once(':')
            .and_then(|(f, n)| Some((f.parse::<f32>().ok()?, n.parse::<usize>().ok()?)));
        s.yarn = Some(parsed.with_context(|| format!("--yarn {y:?} is not FACTOR:ORIGINAL_CTX"))?);
    }
    s.tied_output = args.tied;
    s.attention_biases = args.attention_biases;
    if !args.ty.eq_ignore_ascii_case("mixed") {
        s.default_type = parse_type(&args.ty)?;
        s.types.clear();
    }
    let mut types = Vec::new();
    for t in &args.tensor_types {
        let (pattern, ty) = t
            .split_once('=')
            .with_context(|| format!("--tensor-type {t:?} is not PATTERN=TYPE"))?;
        types.push((pattern.to_string(), parse_type(ty)?));
    }
    types.append(&mut s.types);
    s.types = types;
    if let Some(seed) = args.seed {
        s.seed = seed;
    }
    if let Some(p) = &args.tokenizer_from {
        s.tokenizer = TokenizerSource::From(p.clone());
    }
    let hybrid_flags = [
        args.full_attention_interval,
        args.ssm_state,
        args.ssm_k_heads,
        args.ssm_v_heads,
    ];
    if hybrid_flags.iter().any(Option::is_some) || args.ssm_split {
        let Some(net) = s.delta_net.as_mut() else {
            bail!(
                "--full-attention-interval, --ssm-split and --ssm-* are for hybrid architectures (qwen3next)"
            );
        };
        set(
            args.full_attention_interval,
            &mut net.full_attention_interval,
        );
        set(args.ssm_state, &mut net.state_size);
        set(args.ssm_k_heads, &mut net.group_count);
        set(args.ssm_v_heads, &mut net.time_step_rank);
        net.split_projections = args.ssm_split;
    }
    Ok(s)
}

fn parse_type(name: &str) -> Result<TensorType> {
    TensorType::ALL
        .iter()
        .find(|t| t.name().eq_ignore_ascii_case(name))
        .copied()
        .with_context(|| format!("unknown tensor type {name:?}"))
}

/// Runs `ferrolm synth`.
pub fn run(args: SynthArgs) -> Result<()> {
    if let Some(shape) = &args.shape {
        return super::synth_shape::run(&args, shape);
    }
    let s = spec(&args)?;
    synthetic::write(&s, &args.output)
        .with_context(|| format!("cannot write {}", args.output.display()))?;
    eprintln!(
        "ferrolm: wrote {} ({} layers, {} wide)",
        args.output.display(),
        s.n_layer,
        s.n_embd
    );
    Ok(())
}
