//! Gemma 2 and Gemma 3: the llama decoder with the embedding scaled by `sqrt(n_embd)`, RMS
//! norms after attention and after the feed-forward block as well as before, a GELU-gated
//! feed-forward, queries scaled before the product, and interleaved sliding-window layers.
//! Gemma 2 adds attention and final logit soft-caps; Gemma 3 adds Q/K norms and a separate
//! RoPE base for its sliding-window layers. (Gemma's norm weights are stored with the `1 +`
//! already added by the converter, so they apply as any RMS norm weight.)

use ferrolm_gguf::{Array, GgufFile, Value};

use super::llama::{describe_variant, Variant};
use super::Keys;
use crate::error::{ModelError, Result};
use crate::plan::{Activation, Ffn, ModelPlan, RopeLayout};

pub(super) fn describe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    let gemma3 = arch == "gemma3";
    let mut plan = describe_variant(
        file,
        arch,
        Variant {
            rope_layout: RopeLayout::Neox,
            qkv_bias: false,
            qk_norm: gemma3,
        },
    )?;
    let k = Keys { file, arch };
    let n_layer = plan.layers.len();
    // Which layers slide (llama.cpp's defaults: Gemma 2 every other layer, Gemma 3 five of
    // six; a `sliding_window_pattern` key overrides, as a period or as one flag per layer).
    let window = match k.opt_usize("attention.sliding_window")? {
        Some(0) => None,
        Some(w) => Some(w),
        None if gemma3 => None,
        None => Some(4096),
    };
    let pattern: Vec<bool> = match file
        .metadata()
        .get(&k.key("attention.sliding_window_pattern"))
    {
        Some(Value::Array(Array::Bool(flags))) if flags.len() == n_layer => flags.clone(),
        Some(Value::Array(a)) => {
            return Err(ModelError::Invalid(format!(
                "sliding_window_pattern has {} entries for {n_layer} layers",
                a.len()
            )))
        }
        _ => {
            let period = k
                .opt_usize("attention.sliding_window_pattern")?
                .unwrap_or(if gemma3 { 6 } else { 2 });
            (0..n_layer)
                .map(|il| period == 0 || il % period < period - 1)
                .collect()
        }
    };
    let base_swa = match k.opt_f32("rope.freq_base_swa")? {
        Some(b) => b,
        // Gemma 3's local layers use 10000 unless the file says otherwise; Gemma 2's share the
        // global base.
        None if gemma3 => 10_000.0,
        None => plan
            .layers
            .first()
            .map_or(10_000.0, |l| l.attention.rope.freq_base),
    };
    // Gemma 2 caps always (llama.cpp's defaults 50 and 30 when the keys are absent); Gemma 3
    // only the final logits, and only when the key is there and not 0.
    let attn_softcap = if gemma3 {
        None
    } else {
        Some(k.opt_f32("attn_logit_softcapping")?.unwrap_or(50.0))
    };
    let final_softcap = if gemma3 {
        k.opt_f32("final_logit_softcapping")?.filter(|&c| c != 0.0)
    } else {
        Some(k.opt_f32("final_logit_softcapping")?.unwrap_or(30.0))
    };
    let n_embd = plan.n_embd;
    for (il, layer) in plan.layers.iter_mut().enumerate() {
        let a = &mut layer.attention;
        // llama.cpp: 1/sqrt(head_dim) (n_embd / n_head for the 27B models, which it names by
        // their layer count).
        let big = matches!((gemma3, n_layer), (true, 62) | (false, 46));
        let d = if big { n_embd / a.n_head } else { a.head_dim };
        a.scale = 1.0 / (d as f32).sqrt();
        a.scale_queries = true;
        a.softcap = attn_softcap;
        if window.is_some() && pattern[il] {
            a.sliding_window = window;
            a.rope.freq_base = base_swa;
            if gemma3 {
                a.rope.freq_scale = 1.0;
            }
        }
        // Dense: describe_variant refuses experts.
        if let Ffn::Gated { activation, .. } = &mut layer.ffn {
            *activation = Activation::GeluTanh;
        }
        layer.post_attention_norm = true;
        layer.post_ffn_norm = true;
    }
    plan.embedding_scale = Some((n_embd as f32).sqrt());
    plan.final_logit_softcap = final_softcap;
    if !gemma3 {
        // Gemma 2 always shares the embedding as output matrix.
        plan.tied_output = true;
    }
    Ok(plan)
}
