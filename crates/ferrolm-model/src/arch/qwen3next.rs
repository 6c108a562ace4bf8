//! qwen3next (Qwen3-Next) and qwen35 (Qwen3.5, dense): hybrids of gated delta-net layers and
//! attention layers. Qwen3-Next's every layer is a mixture of experts with a sigmoid-gated
//! shared expert; Qwen3.5's feed-forward blocks are dense, its delta-nets take `attn_qkv` +
//! `attn_gate` and separate `ssm_beta`/`ssm_alpha`, its value heads tile the key heads, and
//! its RoPE is interleaved multi-section (see [`check_rope_sections`]).
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

use super::llama::{describe_moe_variant, describe_variant, Variant};
use super::Keys;
use crate::error::{ModelError, Result};
use crate::plan::{DeltaNet, KeyHeads, Mixer, ModelPlan, RopeLayout};

/// Which member of the family a file is.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    /// qwen3next: experts in every layer, fused `ssm_ba`, value heads grouped per key head.
    Qwen3Next,
    /// qwen35: dense feed-forward blocks, `attn_qkv` + `attn_gate`, separate `ssm_beta` and
    /// `ssm_alpha`, value heads tiled over the key heads, interleaved multi-section RoPE.
    Qwen35,
    /// qwen35moe: qwen35 with qwen3next's experts and gated shared expert.
    Qwen35Moe,
}

impl Family {
    /// Whether the delta-nets and RoPE are Qwen3.5's.
    fn qwen35(self) -> bool {
        matches!(self, Family::Qwen35 | Family::Qwen35Moe)
    }
}

pub(super) fn describe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    describe_family(file, arch, Family::Qwen3Next)
}

pub(super) fn describe_qwen35(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    describe_family(file, arch, Family::Qwen35)
}

pub(super) fn describe_qwen35moe(file: &GgufFile, arch: &str) -> Result<ModelPlan> {
    describe_family(file, arch, Family::Qwen35Moe)
}

fn describe_family(file: &GgufFile, arch: &str, family: Family) -> Result<ModelPlan> {
    let variant = Variant {
        rope_layout: RopeLayout::Neox,
        qkv_bias: false,
        qk_norm: true,
    };
    let mut plan = match family {
        // llama.cpp refuses qwen3next files without experts ("cannot have zero experts")...
        Family::Qwen3Next | Family::Qwen35Moe => describe_moe_variant(file, arch, variant)?,
        // ... and qwen35 files with them (qwen35moe is another architecture).
        Family::Qwen35 => describe_variant(file, arch, variant)?,
    };
    let k = Keys { file, arch };
    if family.qwen35() {
        let n_rot = plan.layers.first().map_or(0, |l| l.attention.rope.n_dims);
        check_rope_sections(&k, n_rot)?;
    }
    let mut net = delta_net(&k)?;
    if family.qwen35() {
        net.key_heads = KeyHeads::Tiled;
    }
    let recurrent = recurrent_layers(&k, plan.layers.len())?;
    for (i, (layer, recurrent)) in plan.layers.iter_mut().zip(recurrent).enumerate() {
        layer.attention.gated_output = true;
        if recurrent {
            check_tensors(file, i, plan.n_embd, &net, family)?;
            layer.mixer = Mixer::GatedDeltaNet(net);
        }
    }
    Ok(plan)
}

/// Qwen3.5 rotates with interleaved multi-section RoPE (`rope.dimension_sections`: the
/// rotated pairs cycle through time, height and width sections, and a fourth section). For
/// text every token's time, height and width positions are its position and the fourth is 0:
/// pairs in the first three sections rotate exactly as NeoX RoPE does, pairs in the fourth do
/// not rotate. Files whose sections leave any rotated pair to the fourth are refused.
fn check_rope_sections(k: &Keys<'_>, n_rot: usize) -> Result<()> {
    let key = k.key("rope.dimension_sections");
    let sections = k.file.metadata().get_int_array(&key)?;
    if sections.len() != 4 || sections.iter().any(|&x| !(0..=4096).contains(&x)) {
        return Err(ModelError::Invalid(format!(
            "{key} must be 4 sizes, found {sections:?}"
        )));
    }
    let s: Vec<usize> = sections.iter().map(|&x| x as usize).collect();
    let total: usize = s.iter().sum();
    let text_position = |pair: usize| {
        let sector = pair % total.max(1);
        (sector.is_multiple_of(3) && sector < 3 * s[0])
            || (sector % 3 == 1 && sector < 3 * s[1])
            || (sector % 3 == 2 && sector < 3 * s[2])
    };
    if total == 0 || total > n_rot || !(0..n_rot / 2).all(text_position) {
        return Err(ModelError::Unsupported {
            what: "rope.dimension_sections that leave rotated pairs to the fourth section",
            value: format!("{sections:?} over {n_rot} rotated dimensions ({key})"),
        });
    }
    Ok(())
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
        key_heads: KeyHeads::Grouped,
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
fn check_tensors(
    file: &GgufFile,
    i: usize,
    n_embd: usize,
    net: &DeltaNet,
    family: Family,
) -> Result<()> {
    let key_dim = net.n_k_heads * net.head_dim;
    let value_dim = net.n_v_heads * net.head_dim;
    let sizes = "ssm.state_size, ssm.group_count and ssm.time_step_rank";
    let rank = "ssm.time_step_rank";
    let n = |s: &str| format!("blk.{i}.{s}");
    // llama.cpp's two qwen3next layouts: the fused `ssm_in` (published files), or `attn_qkv`
    // with `attn_gate` (qwen35's only one).
    let split = family.qwen35()
        || (file.tensor(&n("ssm_in.weight")).is_none()
            && file.tensor(&n("attn_qkv.weight")).is_some());
    let mut wanted: Vec<(String, Vec<usize>, &str)> = if split {
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
    match family {
        Family::Qwen3Next => {
            wanted.push((n("ssm_ba.weight"), vec![n_embd, 2 * net.n_v_heads], rank));
        }
        Family::Qwen35 | Family::Qwen35Moe => {
            wanted.push((n("ssm_beta.weight"), vec![n_embd, net.n_v_heads], rank));
            wanted.push((n("ssm_alpha.weight"), vec![n_embd, net.n_v_heads], rank));
        }
    }
    wanted.extend([
        (
            n("ssm_conv1d.weight"),
            vec![net.conv_kernel, net.conv_channels()],
            "ssm.conv_kernel, ssm.state_size, ssm.group_count and ssm.time_step_rank",
        ),
        (n("ssm_dt.bias"), vec![net.n_v_heads], rank),
        (n("ssm_a"), vec![net.n_v_heads], rank),
        (n("ssm_norm.weight"), vec![net.head_dim], "ssm.state_size"),
        (n("ssm_out.weight"), vec![value_dim, n_embd], sizes),
    ]);
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
