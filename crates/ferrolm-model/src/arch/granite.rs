//! Granite (3.x dense): the llama decoder with four scales from the metadata: the embedding
//! multiplied by `embedding_scale`, each block's output by `residual_scale` before the residual
//! add, the scores by `attention.scale` (instead of `1/sqrt(head_dim)`), and the logits divided
//! by `logit_scale`.

use ferrolm_gguf::GgufFile;

use super::llama::{describe_variant, Variant};
use super::Keys;
use crate::error::{ModelError, Result};
use crate::plan::{ModelPlan, RopeLayout};

pub(super) fn describe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    let k = Keys { file, arch };
    let mut plan = describe_variant(
        file,
        arch,
        Variant {
            rope_layout: RopeLayout::Normal,
            qkv_bias: false,
            qk_norm: false,
        },
    )?;
    // llama.cpp requires the logit scale and treats 0 (or absence) of the others as "none".
    let logit_scale = k.opt_f32("logit_scale")?.ok_or_else(|| {
        ModelError::Invalid(format!("{arch} file without {}", k.key("logit_scale")))
    })?;
    let nonzero = |v: Option<f32>| v.filter(|&s| s != 0.0);
    let residual = nonzero(k.opt_f32("residual_scale")?);
    let attention = nonzero(k.opt_f32("attention.scale")?);
    for layer in &mut plan.layers {
        layer.residual_scale = residual;
        if let Some(s) = attention {
            layer.attention.scale = s;
        }
    }
    plan.embedding_scale = nonzero(k.opt_f32("embedding_scale")?);
    plan.logit_scale = Some(logit_scale);
    Ok(plan)
}
