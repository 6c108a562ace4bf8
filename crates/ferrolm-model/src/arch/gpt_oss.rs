//! gpt-oss (llama.cpp's `openai-moe`): a NeoX-RoPE decoder whose even layers use a sliding
//! window (`attention.sliding_window_pattern`, default 2), with attention sinks, biases on the
//! Q/K/V and output projections, and in every layer a mixture of experts routed by top-k of
//! the biased router logits then a softmax over the k, experts with biases and the clamped
//! SwiGLU; the feed-forward norm is stored as `post_attention_norm`. YaRN RoPE where the file
//! says so (`arch::rope_scaling`).

use ferrolm_gguf::{Array, GgufFile};

use super::llama::{describe_attention_of, Variant};
use super::{moe_keys, Keys};
use crate::error::{ModelError, Result};
use crate::plan::{Activation, Ffn, Gating, ModelPlan, Moe, RopeLayout};

pub(super) fn describe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    let variant = Variant {
        rope_layout: RopeLayout::Neox,
        // llama.cpp loads Q/K/V biases where the file has them.
        qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
        qk_norm: false,
    };
    let mut plan = describe_attention_of(file, arch, variant)?;
    let k = Keys { file, arch };
    if file.tensor("output.weight").is_none() {
        return Err(ModelError::MissingTensor("output.weight".into()));
    }
    let window = k.usize("attention.sliding_window")?;
    if window == 0 {
        return Err(ModelError::Invalid(format!(
            "{}: a window of 0",
            k.key("attention.sliding_window")
        )));
    }
    let swa = sliding_layers(&k, plan.layers.len())?;
    let freq_base_swa = k.opt_f32("rope.freq_base_swa")?;
    let (n_expert, n_expert_used) = moe_keys::counts(&k)?;
    let n_ff = k.usize("expert_feed_forward_length")?;
    let moe = Moe {
        n_expert,
        n_expert_used,
        n_ff,
        activation: Activation::SwigluOai,
        gating: Gating::SoftmaxAfterTopK,
        selection_bias: false,
        groups: moe_keys::groups(&k, n_expert, n_expert_used)?,
        biases: true,
        norm_weights: false,
        // llama.cpp's gpt-oss reads no weights scale.
        weights_scale: None,
        shared: None,
    };
    for (layer, sliding) in plan.layers.iter_mut().zip(swa) {
        let a = &mut layer.attention;
        a.sinks = true;
        a.out_bias = true;
        a.scale = 1.0 / (a.rope.n_dims as f32).sqrt();
        if sliding {
            a.sliding_window = Some(window);
            if let Some(b) = freq_base_swa {
                a.rope.freq_base = b;
            }
        }
        layer.ffn = Ffn::Moe(moe.clone());
    }
    plan.tied_output = false;
    Ok(plan)
}

/// Which layers slide: `attention.sliding_window_pattern` as one flag per layer, or as a
/// period `n` (layer `i` slides when `i % n < n - 1`; 0: all), default 2 (even layers).
fn sliding_layers(k: &Keys<'_>, n_layer: usize) -> Result<Vec<bool>> {
    let key = k.key("attention.sliding_window_pattern");
    let meta = k.file.metadata();
    if let Some(a) = meta.opt_array(&key)? {
        return match a {
            Array::Bool(v) if v.len() >= n_layer => Ok(v[..n_layer].to_vec()),
            other => Err(ModelError::Invalid(format!(
                "{key}: expected {n_layer} booleans, found {} values",
                other.len()
            ))),
        };
    }
    let n = k
        .opt_usize("attention.sliding_window_pattern")?
        .unwrap_or(2);
    Ok((0..n_layer).map(|i| n == 0 || i % n < n - 1).collect())
}
