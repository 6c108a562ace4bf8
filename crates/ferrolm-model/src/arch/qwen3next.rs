//! qwen3next (Qwen3-Next): a hybrid of gated delta-net layers and attention layers, every
//! layer a mixture of experts with a sigmoid-gated shared expert.
//!
//! * Which layers are recurrent: `attention.recurrent_layers` (one flag per layer) if the file
//!   has it, otherwise every layer but each `full_attention_interval`-th (default 4), as
//!   llama.cpp b11312 decides.
//! * The delta-net's sizes come from the `ssm.*` keys: `state_size` (the size of every key and
//!   value head), `group_count` (key heads), `time_step_rank` (value heads), `inner_size` (all
//!   value heads together), `conv_kernel`; every `ssm_*` tensor of a recurrent layer is checked
//!   against them here, so that a file whose keys and tensors disagree is refused naming both.
//!   Both of llama.cpp's layouts are served: the fused `ssm_in` of published files, and
//!   `attn_qkv` + `attn_gate`.
//! * Attention layers: Q/K norms, NeoX RoPE over `rope.dimension_count` dimensions (partial),
//!   and a gated output (the Q projection yields a gate per head).
//! * The norm before the feed-forward block is `post_attention_norm` (see [`super::ffn_norm_tensor`]).

use ferrolm_gguf::GgufFile;

use super::llama::{describe_moe_variant, Variant};
use super::Keys;
use crate::error::{ModelError, Result};
use crate::plan::{DeltaNet, Mixer, ModelPlan, RopeLayout};

pub(super) fn describe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    let variant = Variant {
        rope_layout: RopeLayout::Neox,
        qkv_bias: false,
        qk_norm: true,
    };
    // llama.cpp refuses qwen3next files without experts ("cannot have zero experts").
    let mut plan = describe_moe_variant(file, arch, variant)?;
    let k = Keys { file, arch };
    let net = delta_net(&k)?;
    let recurrent = recurrent_layers(&k, plan.layers.len())?;
    for (i, (layer, recurrent)) in plan.layers.iter_mut().zip(recurrent).enumerate() {
        layer.attention.gated_output = true;
        if recurrent {
            check_tensors(file, i, plan.n_embd, &net)?;
            layer.mixer = Mixer::GatedDeltaNet(net);
        }
    }
    Ok(plan)
}

/// The delta-net sizes the `ssm.*` keys give, checked against each other.
fn delta_net(k: &Keys<'_>) -> Result<DeltaNet> {
    let head_dim = k.usize("ssm.state_size")?;
    let n_k_heads = k.usize("ssm.group_count")?;
    let n_v_heads = k.usize("ssm.time_step_rank")?;
    let inner = k.usize("ssm.inner_size")?;
    let conv_kernel = k.usize("ssm.conv_kernel")?;
    let invalid = |m: String| Err(ModelError::Invalid(format!("{}: {m}", k.arch)));
    if head_dim == 0 || n_k_heads == 0 || n_v_heads == 0 || conv_kernel == 0 {
        return invalid(format!(
            "ssm.state_size {head_dim}, ssm.group_count {n_k_heads}, ssm.time_step_rank \
             {n_v_heads} and ssm.conv_kernel {conv_kernel} must all be above 0"
        ));
    }
    if !n_v_heads.is_multiple_of(n_k_heads) {
        return invalid(format!(
            "ssm.time_step_rank {n_v_heads} (value heads) is not a multiple of \
             ssm.group_count {n_k_heads} (key heads)"
        ));
    }
    if inner != head_dim * n_v_heads {
        return invalid(format!(
            "ssm.inner_size {inner} is not ssm.state_size {head_dim} x ssm.time_step_rank \
             {n_v_heads}"
        ));
    }
    // The state of one head is head_dim^2 floats: refuse sizes no file of this world has
    // before anything is allocated from them.
    if head_dim > 4096 || n_v_heads > 4096 || conv_kernel > 64 {
        return invalid(format!(
            "state size {head_dim}, {n_v_heads} value heads or conv kernel {conv_kernel} \
             out of range"
        ));
    }
    Ok(DeltaNet {
        n_k_heads,
        n_v_heads,
        head_dim,
        conv_kernel,
    })
}

/// Per layer, whether it is a gated delta-net layer.
fn recurrent_layers(k: &Keys<'_>, n_layer: usize) -> Result<Vec<bool>> {
    let key = k.key("attention.recurrent_layers");
    if k.file.metadata().contains(&key) {
        let flags = k.file.metadata().get_int_array(&key)?;
        if flags.len() != n_layer {
            return Err(ModelError::Invalid(format!(
                "{key} has {} entries for {n_layer} layers",
                flags.len()
            )));
        }
        return Ok(flags.into_iter().map(|f| f != 0).collect());
    }
    let interval = k.opt_usize("full_attention_interval")?.unwrap_or(4);
    if interval == 0 {
        return Err(ModelError::Invalid(format!(
            "{} is 0",
            k.key("full_attention_interval")
        )));
    }
    Ok((0..n_layer).map(|i| (i + 1) % interval != 0).collect())
}

/// Checks that recurrent layer `i` has every tensor the delta-net needs, shaped as the keys
/// say; an error names the tensor and the keys it disagrees with.
fn check_tensors(file: &GgufFile, i: usize, n_embd: usize, net: &DeltaNet) -> Result<()> {
    let key_dim = net.n_k_heads * net.head_dim;
    let value_dim = net.n_v_heads * net.head_dim;
    let sizes = "ssm.state_size, ssm.group_count and ssm.time_step_rank";
    let n = |s: &str| format!("blk.{i}.{s}");
    // llama.cpp's two layouts: the fused `ssm_in` (published files), or `attn_qkv` with
    // `attn_gate`.
    let split =
        file.tensor(&n("ssm_in.weight")).is_none() && file.tensor(&n("attn_qkv.weight")).is_some();
    let projections: Vec<(String, Vec<usize>, &str)> = if split {
        vec![
            (
                n("attn_qkv.weight"),
                vec![n_embd, 2 * key_dim + value_dim],
                sizes,
            ),
            (n("attn_gate.weight"), vec![n_embd, value_dim], sizes),
        ]
    } else {
        vec![(
            n("ssm_in.weight"),
            vec![n_embd, 2 * key_dim + 2 * value_dim],
            sizes,
        )]
    };
    let others: [(String, Vec<usize>, &str); 6] = [
        (
            n("ssm_conv1d.weight"),
            vec![net.conv_kernel, net.conv_channels()],
            "ssm.conv_kernel, ssm.state_size, ssm.group_count and ssm.time_step_rank",
        ),
        (n("ssm_dt.bias"), vec![net.n_v_heads], "ssm.time_step_rank"),
        (n("ssm_a"), vec![net.n_v_heads], "ssm.time_step_rank"),
        (
            n("ssm_ba.weight"),
            vec![n_embd, 2 * net.n_v_heads],
            "ssm.time_step_rank",
        ),
        (n("ssm_norm.weight"), vec![net.head_dim], "ssm.state_size"),
        (n("ssm_out.weight"), vec![value_dim, n_embd], sizes),
    ];
    let wanted = projections.into_iter().chain(others);
    for (name, dims, keys) in wanted {
        let t = file
            .tensor(&name)
            .ok_or_else(|| ModelError::MissingTensor(name.clone()))?;
        let mut found = t.dims.clone();
        while found.len() > dims.len() && found.last() == Some(&1) {
            found.pop();
        }
        let expected: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        if found != expected {
            return Err(ModelError::Invalid(format!(
                "tensor {name:?} has shape {:?} but {keys} give {expected:?}",
                t.dims
            )));
        }
    }
    Ok(())
}
