//! Phi-3: the llama decoder with NeoX RoPE (over `rope.dimension_count` of each head's
//! dimensions: partial rotary when that is fewer), queries scaled by `1/sqrt(head_dim)` before
//! the product (llama.cpp's graph), and fused tensors: `attn_qkv` (Q, K, V rows one after the
//! other) and `ffn_up` holding gate then up (`2 * n_ff` rows), which the weight binder splits
//! into row views. llama.cpp disables Phi-3's sliding window, and so does this.
//!
//! LongRoPE (the 128k-context files): `rope_factors_long.weight` and `rope_factors_short.weight`
//! divide each rotating pair's frequency; llama.cpp picks the long set when the context it was
//! created with exceeds `rope.scaling.original_context_length` (see [`LongRope::uses_long`]),
//! and scales cosine and sine by `rope.scaling.attn_factor` whichever set it uses.

use ferrolm_gguf::GgufFile;

use super::llama::{describe_variant, Variant};
use super::Keys;
use crate::error::{ModelError, Result};
use crate::plan::{LongRope, ModelPlan, RopeLayout};

pub(super) fn describe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    let mut plan = describe_variant(
        file,
        arch,
        Variant {
            rope_layout: RopeLayout::Neox,
            qkv_bias: false,
            qk_norm: false,
        },
    )?;
    let long_rope = match (
        file.tensor("rope_factors_long.weight").is_some(),
        file.tensor("rope_factors_short.weight").is_some(),
    ) {
        (false, false) => None,
        (true, true) => {
            let k = Keys { file, arch };
            let original_context = k
                .opt_usize("rope.scaling.original_context_length")?
                .unwrap_or(plan.n_ctx_train);
            Some(LongRope { original_context })
        }
        (long, _) => {
            let missing = if long { "short" } else { "long" };
            return Err(ModelError::MissingTensor(format!(
                "rope_factors_{missing}.weight (LongRoPE needs both sets of factors)"
            )));
        }
    };
    for layer in &mut plan.layers {
        layer.attention.scale_queries = true;
        layer.attention.rope.long_rope = long_rope;
    }
    Ok(plan)
}
