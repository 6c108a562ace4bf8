//! The llama family: llama (Llama 2/3, Mistral, SmolLM2, TinyLlama; Mixtral with experts),
//! mistral, qwen2 (QKV biases), qwen2moe (QKV biases, experts and a sigmoid-gated shared
//! expert), qwen3 (Q/K norms), qwen3moe (Q/K norms, experts). One decoder shape with a few switches.

use ferrolm_gguf::GgufFile;

use super::Keys;
use crate::error::{ModelError, Result};
use crate::plan::{
    Activation, Attention, Ffn, Gating, LayerPlan, Mixer, ModelPlan, Moe, Rope, RopeLayout,
    SharedExpert,
};

/// What distinguishes the members of the family.
pub(super) struct Variant {
    pub rope_layout: RopeLayout,
    pub qkv_bias: bool,
    pub qk_norm: bool,
}

fn variant(arch: &str) -> Variant {
    match arch {
        "qwen2" | "qwen2moe" => Variant {
            rope_layout: RopeLayout::Neox,
            qkv_bias: true,
            qk_norm: false,
        },
        "qwen3" | "qwen3moe" => Variant {
            rope_layout: RopeLayout::Neox,
            qkv_bias: false,
            qk_norm: true,
        },
        _ => Variant {
            rope_layout: RopeLayout::Normal,
            qkv_bias: false,
            qk_norm: false,
        },
    }
}

pub(super) fn describe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    // llama.cpp runs experts in `llama` files (Mixtral) and requires them in `qwen3moe`.
    let experts = match arch {
        "llama" => Experts::Allowed,
        "qwen3moe" | "qwen2moe" => Experts::Required,
        _ => Experts::Refused,
    };
    let mut plan = describe_decoder(file, arch, variant(arch), experts)?;
    optional_biases(file, &mut plan)?;
    Ok(plan)
}

/// llama.cpp loads Q/K/V and attention-output biases on these architectures whenever a file
/// carries them (and applies them), so they are used here too: a file whose first layer has
/// them must have them in every layer. Feed-forward biases, which llama.cpp's `llama` also
/// loads, have no place in the plan: refused by name rather than ignored.
fn optional_biases(file: &GgufFile, plan: &mut ModelPlan) -> Result<()> {
    let has = |name: String| file.tensor(&name).is_some();
    let qkv = ["attn_q", "attn_k", "attn_v"]
        .iter()
        .any(|t| has(format!("blk.0.{t}.bias")));
    let out = has("blk.0.attn_output.bias".to_string());
    for (i, layer) in plan.layers.iter_mut().enumerate() {
        layer.attention.qkv_bias |= qkv;
        layer.attention.out_bias |= out;
        for t in ["ffn_gate", "ffn_up", "ffn_down"] {
            let name = format!("blk.{i}.{t}.bias");
            if has(name.clone()) {
                return Err(ModelError::Unsupported {
                    what: "feed-forward bias",
                    value: name,
                });
            }
        }
    }
    Ok(())
}

/// Whether an architecture's layers may be mixtures of experts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Experts {
    Refused,
    Allowed,
    Required,
    /// The caller describes the feed-forward blocks: every layer starts dense here.
    Elsewhere,
}

/// The plan of a llama-shaped decoder of `arch` (the keys every such decoder shares); other
/// families start from it and add what they carry.
pub(super) fn describe_variant(file: &GgufFile, arch: &str, v: Variant) -> Result<ModelPlan> {
    describe_decoder(file, arch, v, Experts::Refused)
}

/// Like [`describe_variant`] for a family that describes its own mixture-of-experts layers:
/// every layer starts as a dense block of `feed_forward_length`.
pub(super) fn describe_attention_of(file: &GgufFile, arch: &str, v: Variant) -> Result<ModelPlan> {
    describe_decoder(file, arch, v, Experts::Elsewhere)
}

/// Like [`describe_variant`] for a decoder whose every layer is a mixture of experts.
pub(super) fn describe_moe_variant(file: &GgufFile, arch: &str, v: Variant) -> Result<ModelPlan> {
    describe_decoder(file, arch, v, Experts::Required)
}

/// The feed-forward block of every layer: dense, or (with `expert_count > 0` where the
/// architecture allows it) a softmax-routed mixture of experts, which llama.cpp's `llama` and
/// `qwen3moe` graphs build with renormalized top-k weights and no weight scale.
fn ffn_of(k: &Keys<'_>, experts: Experts) -> Result<Ffn> {
    let n_expert = k.opt_usize("expert_count")?.unwrap_or(0);
    let dense = |k: &Keys<'_>| -> Result<Ffn> {
        Ok(Ffn::Gated {
            n_ff: k.usize("feed_forward_length")?,
            activation: Activation::Silu,
        })
    };
    match (experts, n_expert) {
        // (gpt-oss has no dense layer: its files need no feed_forward_length.)
        (Experts::Elsewhere, _) => Ok(Ffn::Gated {
            n_ff: k.opt_usize("feed_forward_length")?.unwrap_or(0),
            activation: Activation::Silu,
        }),
        (Experts::Required, 0) => Err(ModelError::Invalid(format!(
            "{}: expert_count must be above 0",
            k.arch
        ))),
        (Experts::Refused, n) if n > 0 => Err(ModelError::Unsupported {
            what: "mixture-of-experts layers (expert_count)",
            value: format!("{n} in a {} file", k.arch),
        }),
        (_, 0) => dense(k),
        (_, n_expert) => {
            let n_expert_used = k.opt_usize("expert_used_count")?.unwrap_or(0);
            if n_expert_used == 0 || n_expert_used > n_expert {
                return Err(ModelError::Invalid(format!(
                    "{}: {n_expert_used} experts used of {n_expert} (expert_used_count)",
                    k.arch
                )));
            }
            // qwen2moe: a shared expert gated by a sigmoid, routed weights not renormalized;
            // qwen3next and qwen35moe: the same shared expert, routed weights renormalized.
            let qwen2moe = k.arch == "qwen2moe";
            let shared = if qwen2moe || k.arch == "qwen3next" || k.arch == "qwen35moe" {
                let n_ff = match k.opt_usize("expert_shared_feed_forward_length")? {
                    Some(n) if n > 0 => n,
                    _ => k.usize("feed_forward_length")?,
                };
                Some(SharedExpert { n_ff, gated: true })
            } else {
                if let Some(n) = k.opt_usize("expert_shared_feed_forward_length")? {
                    if n > 0 {
                        return Err(ModelError::Unsupported {
                            what: "shared experts (expert_shared_feed_forward_length)",
                            value: format!("{n} in a {} file", k.arch),
                        });
                    }
                }
                None
            };
            let n_ff = match k.opt_usize("expert_feed_forward_length")? {
                Some(n) if n > 0 && k.arch != "llama" => n,
                _ if k.arch == "llama" => k.usize("feed_forward_length")?,
                _ => k.usize("feed_forward_length")? / n_expert_used,
            };
            Ok(Ffn::Moe(Moe {
                n_expert,
                n_expert_used,
                n_ff,
                activation: Activation::Silu,
                gating: Gating::Softmax,
                selection_bias: false,
                // llama.cpp applies grouped top-k to any file with more than one group.
                groups: super::moe_keys::groups(k, n_expert, n_expert_used)?,
                biases: false,
                norm_weights: !qwen2moe,
                weights_scale: None,
                shared,
            }))
        }
    }
}

fn describe_decoder(
    file: &GgufFile,
    arch: &str,
    v: Variant,
    experts: Experts,
) -> Result<ModelPlan> {
    let k = Keys { file, arch };
    let n_embd = k.nonzero_usize("embedding_length")?;
    let n_layer = k.nonzero_usize("block_count")?;
    let n_head = k.usize("attention.head_count")?;
    let n_head_kv = k.opt_usize("attention.head_count_kv")?.unwrap_or(n_head);
    if n_head == 0 || n_head_kv == 0 || n_head % n_head_kv != 0 {
        return Err(ModelError::Invalid(format!(
            "{n_head} query heads cannot share {n_head_kv} key/value heads"
        )));
    }
    let head_dim = match k.opt_usize("attention.key_length")? {
        Some(d) => d,
        None if n_embd % n_head == 0 => n_embd / n_head,
        None => {
            return Err(ModelError::Invalid(format!(
                "{n_embd} wide but {n_head} heads"
            )));
        }
    };
    if head_dim == 0 {
        return Err(ModelError::Invalid(format!(
            "the head size is 0 ({} is 0, or {} is smaller than the head count)",
            k.key("attention.key_length"),
            k.key("embedding_length")
        )));
    }
    if let Some(vd) = k.opt_usize("attention.value_length")? {
        if vd != head_dim {
            return Err(ModelError::Unsupported {
                what: "value head size different from key head size",
                value: format!("{vd} vs {head_dim}"),
            });
        }
    }
    let n_rot = k.opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
    if n_rot > head_dim || n_rot % 2 != 0 || head_dim % 2 != 0 {
        return Err(ModelError::Invalid(format!(
            "rope over {n_rot} of {head_dim} dimensions"
        )));
    }
    let freq_base = k.opt_f32("rope.freq_base")?.unwrap_or(10000.0);
    let n_ctx_train = k.opt_usize("context_length")?.unwrap_or(4096);
    let (freq_scale, yarn) = super::rope_scaling::of(&k, n_ctx_train)?;
    let norm_eps = k
        .opt_f32("attention.layer_norm_rms_epsilon")?
        .unwrap_or(1e-5);
    let embd = file
        .tensor("token_embd.weight")
        .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
    let n_vocab = match k.opt_usize("vocab_size")? {
        Some(n) => n,
        None => embd.dims.get(1).copied().unwrap_or(0) as usize,
    };
    let ffn = ffn_of(&k, experts)?;
    // llama.cpp's qwen2moe has no tied output: it requires `output.weight`.
    if arch == "qwen2moe" && file.tensor("output.weight").is_none() {
        return Err(ModelError::MissingTensor("output.weight".into()));
    }
    let attention = Attention {
        n_head,
        n_head_kv,
        head_dim,
        qkv_bias: v.qkv_bias,
        qk_norm: v.qk_norm,
        rope: Rope {
            layout: v.rope_layout,
            n_dims: n_rot,
            freq_base,
            freq_scale,
            freq_factors: file.tensor("rope_freqs.weight").is_some(),
            long_rope: None,
            // llama.cpp multiplies its RoPE attention factor by this key for every architecture.
            attn_factor: k.opt_f32("rope.scaling.attn_factor")?.unwrap_or(1.0),
            yarn,
        },
        scale: 1.0 / (head_dim as f32).sqrt(),
        scale_queries: false,
        softcap: None,
        // llama.cpp's llama, mistral, qwen2 and qwen3 read no sliding-window key (a Mistral
        // file's `attention.sliding_window` is ignored there, so it is here).
        sliding_window: None,
        gated_output: false,
        sinks: false,
        out_bias: false,
    };
    let layer = LayerPlan {
        attention,
        mixer: Mixer::Attention,
        ffn,
        post_attention_norm: false,
        post_ffn_norm: false,
        residual_scale: None,
    };
    Ok(ModelPlan {
        architecture: arch.to_string(),
        n_embd,
        n_vocab,
        n_ctx_train,
        norm_eps,
        layers: vec![layer; n_layer],
        tied_output: file.tensor("output.weight").is_none(),
        embedding_scale: None,
        final_logit_softcap: None,
        logit_scale: None,
    })
}
