//! Phi-3: the llama decoder with NeoX RoPE (over `rope.dimension_count` of each head's
//! dimensions: partial rotary when that is fewer), queries scaled by `1/sqrt(head_dim)` before
//! the product (llama.cpp's graph), and fused tensors: `attn_qkv` (Q, K, V rows one after the
//! other) and `ffn_up` holding gate then up (`2 * n_ff` rows), which the weight binder splits
//! into row views. LongRoPE files (`rope_factors_long`/`short`, picked by context length at run
//! time in llama.cpp) are refused by name; llama.cpp disables Phi-3's sliding window, and so
//! does this.

use ferrolm_gguf::GgufFile;

use super::llama::{describe_variant, Variant};
use crate::error::{ModelError, Result};
use crate::plan::{ModelPlan, RopeLayout};

pub(super) fn describe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    for name in ["rope_factors_long.weight", "rope_factors_short.weight"] {
        if file.tensor(name).is_some() {
            return Err(ModelError::Unsupported {
                what: "Phi-3 LongRoPE frequency factors",
                value: name.to_string(),
            });
        }
    }
    let mut plan = describe_variant(
        file,
        arch,
        Variant {
            rope_layout: RopeLayout::Neox,
            qkv_bias: false,
            qk_norm: false,
        },
    )?;
    for layer in &mut plan.layers {
        layer.attention.scale_queries = true;
    }
    Ok(plan)
}
