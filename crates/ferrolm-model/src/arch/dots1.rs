//! dots1 (rednote's dots.llm1): a Qwen3-style decoder (Q/K norms, NeoX RoPE) whose first
//! `leading_dense_block_count` layers are dense and whose other layers are mixtures of
//! experts with a sigmoid (or softmax) router, an optional selection bias `exp_probs_b`,
//! optional grouped top-k, renormalized and scaled weights, and an ungated shared expert of
//! `expert_shared_count` experts' width.

use ferrolm_gguf::GgufFile;

use super::llama::{describe_attention_of, Variant};
use super::{moe_keys, Keys};
use crate::error::{ModelError, Result};
use crate::plan::{Activation, Ffn, ModelPlan, Moe, RopeLayout, SharedExpert};

pub(super) fn describe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    let variant = Variant {
        rope_layout: RopeLayout::Neox,
        qkv_bias: file.tensor("blk.0.attn_q.bias").is_some(),
        qk_norm: true,
    };
    let mut plan = describe_attention_of(file, arch, variant)?;
    let k = Keys { file, arch };
    let n_layer = plan.layers.len();
    let n_dense = k.opt_usize("leading_dense_block_count")?.unwrap_or(0);
    if n_dense > n_layer {
        return Err(ModelError::Invalid(format!(
            "{arch}: {n_dense} leading dense blocks (leading_dense_block_count) of {n_layer} layers"
        )));
    }
    let (n_expert, n_expert_used) = moe_keys::counts(&k)?;
    let n_ff = k.usize("expert_feed_forward_length")?;
    let n_shared = k.usize("expert_shared_count")?;
    if n_ff == 0 || n_shared == 0 {
        return Err(ModelError::Invalid(format!(
            "{arch}: expert_feed_forward_length {n_ff}, expert_shared_count {n_shared}: \
             both must be above 0"
        )));
    }
    let moe = Moe {
        n_expert,
        n_expert_used,
        n_ff,
        activation: Activation::Silu,
        gating: moe_keys::gating(&k)?,
        selection_bias: false,
        groups: moe_keys::groups(&k, n_expert, n_expert_used)?,
        biases: false,
        norm_weights: moe_keys::weights_norm(&k)?,
        weights_scale: moe_keys::weights_scale(&k)?,
        shared: Some(SharedExpert {
            n_ff: n_ff * n_shared,
            gated: false,
        }),
    };
    for (i, layer) in plan.layers.iter_mut().enumerate().skip(n_dense) {
        // llama.cpp loads `exp_probs_b` where the file has it.
        let selection_bias = file.tensor(&format!("blk.{i}.exp_probs_b.bias")).is_some();
        layer.ffn = Ffn::Moe(Moe {
            selection_bias,
            ..moe.clone()
        });
    }
    Ok(plan)
}
