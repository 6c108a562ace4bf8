//! Synthetic files of the mixture-of-experts architectures whose layers differ from the
//! llama shape `synthetic::build` writes: dots1 (leading dense layers, sigmoid routing with a
//! selection bias and grouped top-k, an ungated shared expert) and gpt-oss (attention sinks,
//! biases everywhere, MXFP4 experts, the clamped SwiGLU, alternate sliding layers, YaRN). Each
//! writes its own keys and
//! whole layers; the rest of the file (tokenizer, embedding, output, the weights' generator)
//! is `synthetic::build`'s.

use ferrolm_gguf::{GgufWriter, TensorType, Value};

use crate::synthetic::{Init, SyntheticSpec};

/// Adds one tensor: name, GGML dims, how to draw it, whether it is a matrix (quantized).
pub(crate) type AddTensor<'a> = &'a mut dyn FnMut(String, &[usize], Init, bool);

/// dots1's routing in the synthetic file: 16 experts in 4 groups, 2 groups kept, top-4 of a
/// biased sigmoid, weights renormalized and scaled by 2.5, one shared expert, layer 0 dense.
const DOTS1_LEADING_DENSE: usize = 1;

/// The small spec of an architecture this module writes, if it is one.
pub(crate) fn small(arch: &str) -> Option<SyntheticSpec> {
    match arch {
        "dots1" => {
            let mut s = SyntheticSpec::small("qwen3moe");
            s.arch = arch.to_string();
            s.n_expert = 16;
            s.n_expert_used = 4;
            s.n_ff = 128;
            // llama.cpp's dots1 loads K and V with as many heads as Q.
            s.n_head_kv = s.n_head;
            Some(s)
        }
        "gpt-oss" => {
            let mut s = SyntheticSpec::small("llama");
            s.arch = arch.to_string();
            s.n_expert = 8;
            s.n_expert_used = 4;
            s.n_ff = 128;
            s.rope_base = 150_000.0;
            // Prompts of up to 600 tokens cross it.
            s.sliding_window = Some(64);
            // The experts in MXFP4 as published gpt-oss files have them.
            s.types.insert(0, ("_exps".to_string(), TensorType::MXFP4));
            Some(s)
        }
        _ => None,
    }
}

/// gpt-oss's YaRN in the synthetic file: a factor of 4 over an original context of 256, so
/// that the ramp between interpolated and extrapolated dimensions falls inside a head.
const GPT_OSS_YARN_FACTOR: f32 = 4.0;
const GPT_OSS_YARN_ORIG_CTX: u32 = 256;

/// Writes the keys of `spec.arch` beyond the shared ones (`key` prefixes the architecture).
pub(crate) fn keys(spec: &SyntheticSpec, w: &mut GgufWriter) {
    let key = |s: &str| format!("{}.{s}", spec.arch);
    if spec.arch == "dots1" {
        w.set(
            key("leading_dense_block_count"),
            Value::U32(DOTS1_LEADING_DENSE as u32),
        );
        w.set(key("expert_shared_count"), Value::U32(1));
        w.set(key("expert_gating_func"), Value::U32(2));
        w.set(key("expert_weights_scale"), Value::F32(2.5));
        w.set(key("expert_weights_norm"), Value::Bool(true));
        w.set(key("expert_group_count"), Value::U32(4));
        w.set(key("expert_group_used_count"), Value::U32(2));
    }
    if spec.arch == "gpt-oss" {
        w.set(key("rope.scaling.type"), Value::String("yarn".into()));
        w.set(key("rope.scaling.factor"), Value::F32(GPT_OSS_YARN_FACTOR));
        w.set(
            key("rope.scaling.original_context_length"),
            Value::U32(GPT_OSS_YARN_ORIG_CTX),
        );
    }
}

/// Adds every tensor of layer `i` if this module writes `spec.arch`; false otherwise.
pub(crate) fn layer(spec: &SyntheticSpec, i: usize, add: AddTensor<'_>) -> bool {
    match spec.arch.as_str() {
        "dots1" => {
            dots1_layer(spec, i, add);
            true
        }
        "gpt-oss" => {
            gpt_oss_layer(spec, i, add);
            true
        }
        _ => false,
    }
}

/// Matrices scaled so that activations stay O(1): std about 1/sqrt(fan-in).
fn matrix(fan_in: usize) -> Init {
    Init::Normal(0.7 / (fan_in as f32).sqrt())
}

fn dots1_layer(spec: &SyntheticSpec, i: usize, add: AddTensor<'_>) {
    let n = |s: &str| format!("blk.{i}.{s}");
    let hd = spec.head_dim();
    let (d, q_dim, kv_dim) = (spec.n_embd, spec.n_head * hd, spec.n_head_kv * hd);
    let (ff, ne) = (spec.n_ff, spec.n_expert);
    add(n("attn_norm.weight"), &[d], Init::AroundOne(0.1), false);
    add(n("attn_q.weight"), &[d, q_dim], matrix(d), true);
    add(n("attn_k.weight"), &[d, kv_dim], matrix(d), true);
    add(n("attn_v.weight"), &[d, kv_dim], matrix(d), true);
    add(n("attn_q_norm.weight"), &[hd], Init::AroundOne(0.2), false);
    add(n("attn_k_norm.weight"), &[hd], Init::AroundOne(0.2), false);
    add(n("attn_output.weight"), &[q_dim, d], matrix(q_dim), true);
    add(n("ffn_norm.weight"), &[d], Init::AroundOne(0.1), false);
    if i < DOTS1_LEADING_DENSE {
        add(n("ffn_gate.weight"), &[d, ff], matrix(d), true);
        add(n("ffn_up.weight"), &[d, ff], matrix(d), true);
        add(n("ffn_down.weight"), &[ff, d], matrix(ff), true);
        return;
    }
    // A wide router: clear winners; a selection bias large enough to change some picks.
    let router = Init::Normal(2.0 / (d as f32).sqrt());
    add(n("ffn_gate_inp.weight"), &[d, ne], router, true);
    add(n("exp_probs_b.bias"), &[ne], Init::Normal(0.3), false);
    add(n("ffn_gate_exps.weight"), &[d, ff, ne], matrix(d), true);
    add(n("ffn_up_exps.weight"), &[d, ff, ne], matrix(d), true);
    add(n("ffn_down_exps.weight"), &[ff, d, ne], matrix(ff), true);
    add(n("ffn_gate_shexp.weight"), &[d, ff], matrix(d), true);
    add(n("ffn_up_shexp.weight"), &[d, ff], matrix(d), true);
    add(n("ffn_down_shexp.weight"), &[ff, d], matrix(ff), true);
}

fn gpt_oss_layer(spec: &SyntheticSpec, i: usize, add: AddTensor<'_>) {
    let n = |s: &str| format!("blk.{i}.{s}");
    let hd = spec.head_dim();
    let (d, q_dim, kv_dim) = (spec.n_embd, spec.n_head * hd, spec.n_head_kv * hd);
    let (ff, ne) = (spec.n_ff, spec.n_expert);
    let bias = || Init::Normal(0.1);
    add(n("attn_norm.weight"), &[d], Init::AroundOne(0.1), false);
    add(n("attn_q.weight"), &[d, q_dim], matrix(d), true);
    add(n("attn_k.weight"), &[d, kv_dim], matrix(d), true);
    add(n("attn_v.weight"), &[d, kv_dim], matrix(d), true);
    add(n("attn_q.bias"), &[q_dim], bias(), false);
    add(n("attn_k.bias"), &[kv_dim], bias(), false);
    add(n("attn_v.bias"), &[kv_dim], bias(), false);
    add(n("attn_output.weight"), &[q_dim, d], matrix(q_dim), true);
    add(n("attn_output.bias"), &[d], bias(), false);
    // Sinks around 1: comparable with the scores, so they take a visible share.
    add(
        n("attn_sinks.weight"),
        &[spec.n_head],
        Init::AroundOne(1.0),
        false,
    );
    add(
        n("post_attention_norm.weight"),
        &[d],
        Init::AroundOne(0.1),
        false,
    );
    let router = Init::Normal(2.0 / (d as f32).sqrt());
    add(n("ffn_gate_inp.weight"), &[d, ne], router, true);
    add(n("ffn_gate_inp.bias"), &[ne], Init::Normal(0.5), false);
    // Gate and up wide enough that some values pass the SwiGLU's clamp at 7.
    let wide = || Init::Normal(2.5 / (d as f32).sqrt());
    add(n("ffn_gate_exps.weight"), &[d, ff, ne], wide(), true);
    add(n("ffn_up_exps.weight"), &[d, ff, ne], wide(), true);
    add(
        n("ffn_down_exps.weight"),
        &[ff, d, ne],
        Init::Normal(0.2 / (ff as f32).sqrt()),
        true,
    );
    add(n("ffn_gate_exps.bias"), &[ff, ne], bias(), false);
    add(n("ffn_up_exps.bias"), &[ff, ne], bias(), false);
    add(n("ffn_down_exps.bias"), &[d, ne], bias(), false);
}
