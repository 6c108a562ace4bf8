//! `rope.scaling.*`: none, linear, or YaRN, with the factors llama.cpp derives for YaRN
//! (llama-context.cpp: `yarn_ext_factor` 1, `yarn_attn_factor` from the scale factor,
//! `beta_fast` 32, `beta_slow` 1, the original context from the file).

use super::Keys;
use crate::error::{ModelError, Result};
use crate::plan::Yarn;

/// llama.cpp's defaults for the YaRN ramp.
const BETA_FAST: f32 = 32.0;
const BETA_SLOW: f32 = 1.0;

/// The frequency scale and, for YaRN, its parameters.
pub(crate) fn of(k: &Keys<'_>, n_ctx_train: usize) -> Result<(f32, Option<Yarn>)> {
    // llama.cpp: a factor of 0 (or none) means no scaling.
    let factor = k.opt_f32("rope.scaling.factor")?.unwrap_or(0.0);
    let freq_scale = if factor == 0.0 { 1.0 } else { 1.0 / factor };
    match k.opt_str("rope.scaling.type")? {
        // (LongRoPE's factors are Phi-3's tensors; the type alone scales like linear.)
        None | Some("linear" | "longrope") => Ok((freq_scale, None)),
        Some("none") => Ok((1.0, None)),
        Some("yarn") => {
            if !(factor.is_finite() && factor >= 0.0) {
                return Err(ModelError::Invalid(format!(
                    "{}: YaRN scaling factor {factor}",
                    k.key("rope.scaling.factor")
                )));
            }
            // get_mscale(factor, 1), then cancelled by 1 / (1 + 0.1 ln factor) as llama.cpp
            // does (its `rope_attn_factor` is the plan's `Rope::attn_factor`).
            let scale = 1.0 / freq_scale;
            let mscale = if scale <= 1.0 {
                1.0
            } else {
                0.1 * scale.ln() + 1.0
            };
            let attn_factor = mscale * (1.0 / (1.0 + 0.1 * scale.ln()));
            let n_ctx_orig = k
                .opt_usize("rope.scaling.original_context_length")?
                .filter(|&n| n > 0)
                .unwrap_or(n_ctx_train);
            Ok((
                freq_scale,
                Some(Yarn {
                    n_ctx_orig,
                    ext_factor: 1.0,
                    attn_factor,
                    beta_fast: BETA_FAST,
                    beta_slow: BETA_SLOW,
                }),
            ))
        }
        Some(other) => Err(ModelError::Unsupported {
            what: "rope scaling type",
            value: other.to_string(),
        }),
    }
}
