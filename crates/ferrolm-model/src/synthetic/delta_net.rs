//! The gated delta-net part of a synthetic hybrid file (`qwen3next`): its keys and the
//! tensors of a recurrent layer, in llama.cpp's fused `ssm_in` layout.

use ferrolm_gguf::{GgufWriter, Value};

use super::{Init, SyntheticDeltaNet};

/// One tensor to write: name, GGML dims, how to draw it, whether it is a matrix (quantized).
pub(super) type Tensor = (String, Vec<usize>, Init, bool);

/// Writes the `ssm.*` keys and the attention schedule.
pub(super) fn keys(w: &mut GgufWriter, arch: &str, net: &SyntheticDeltaNet) {
    let u = |n: usize| Value::U32(n as u32);
    let key = |s: &str| format!("{arch}.{s}");
    w.set(key("ssm.conv_kernel"), u(net.conv_kernel));
    w.set(key("ssm.state_size"), u(net.state_size));
    w.set(key("ssm.group_count"), u(net.group_count));
    w.set(key("ssm.time_step_rank"), u(net.time_step_rank));
    w.set(
        key("ssm.inner_size"),
        u(net.state_size * net.time_step_rank),
    );
    w.set(
        key("full_attention_interval"),
        u(net.full_attention_interval),
    );
    if arch.starts_with("qwen35") {
        // Interleaved multi-section RoPE over the rotated pairs (8 for a 16-dimension rotation).
        let sections = ferrolm_gguf::Array::I32(vec![3, 3, 2, 0]);
        w.set(key("rope.dimension_sections"), Value::Array(sections));
    }
}

/// Whether layer `i` is recurrent under the spec's schedule.
pub(super) fn is_recurrent(net: &SyntheticDeltaNet, i: usize) -> bool {
    !(i + 1).is_multiple_of(net.full_attention_interval.max(1))
}

/// The tensors of recurrent layer `i` of a model `d` wide. Scales keep the state in a useful
/// range: decays `exp(softplus(a + dt) * ssm_a)` mostly between 0.8 and 1 (memory of tens
/// of tokens), rates `sigmoid(b)` around one half.
pub(super) fn layer_tensors(
    arch: &str,
    net: &SyntheticDeltaNet,
    i: usize,
    d: usize,
) -> Vec<Tensor> {
    let qwen35 = arch.starts_with("qwen35");
    let s = net.state_size;
    let (key_dim, value_dim) = (net.group_count * s, net.time_step_rank * s);
    let hv = net.time_step_rank;
    let n = |x: &str| format!("blk.{i}.{x}");
    let dims = |v: &[usize]| v.to_vec();
    let m = |fan_in: usize| Init::Normal(0.7 / (fan_in as f32).sqrt());
    // Qwen3.5 has only the split layout.
    let mut tensors = if net.split_projections || qwen35 {
        vec![
            (
                n("attn_qkv.weight"),
                dims(&[d, 2 * key_dim + value_dim]),
                m(d),
                true,
            ),
            (n("attn_gate.weight"), dims(&[d, value_dim]), m(d), true),
        ]
    } else {
        vec![(
            n("ssm_in.weight"),
            dims(&[d, 2 * key_dim + 2 * value_dim]),
            m(d),
            true,
        )]
    };
    if qwen35 {
        tensors.push((n("ssm_beta.weight"), dims(&[d, hv]), m(d), true));
        tensors.push((n("ssm_alpha.weight"), dims(&[d, hv]), m(d), true));
    } else {
        tensors.push((n("ssm_ba.weight"), dims(&[d, 2 * hv]), m(d), true));
    }
    tensors.extend([
        (
            n("ssm_conv1d.weight"),
            dims(&[net.conv_kernel, 2 * key_dim + value_dim]),
            Init::Normal(0.5),
            false,
        ),
        (
            n("ssm_dt.bias"),
            dims(&[hv]),
            Init::Uniform(-3.0, -1.0),
            false,
        ),
        (n("ssm_a"), dims(&[hv]), Init::Uniform(-1.0, -0.2), false),
        (
            n("ssm_norm.weight"),
            dims(&[s]),
            Init::AroundOne(0.1),
            false,
        ),
        (
            n("ssm_out.weight"),
            dims(&[value_dim, d]),
            m(value_dim),
            true,
        ),
    ]);
    tensors
}
