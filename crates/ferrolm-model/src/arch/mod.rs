//! Architectures: each turns a file's metadata into a [`ModelPlan`], owning its own keys.

mod dots1;
mod gemma;
mod gpt_oss;
mod granite;
mod llama;
mod moe_keys;
mod phi3;
mod qwen3next;
mod rope_scaling;

use ferrolm_gguf::GgufFile;

use crate::error::{ModelError, Result};
use crate::plan::ModelPlan;

/// A function that describes one architecture.
type Describe = fn(&GgufFile, &str) -> Result<ModelPlan>;

/// Every architecture we run, by the name `general.architecture` gives.
const ARCHITECTURES: &[(&str, Describe)] = &[
    ("llama", llama::describe),
    ("mistral", llama::describe),
    ("qwen2", llama::describe),
    ("qwen2moe", llama::describe),
    ("qwen3", llama::describe),
    ("qwen3moe", llama::describe),
    ("dots1", dots1::describe),
    ("gpt-oss", gpt_oss::describe),
    ("gemma2", gemma::describe),
    ("gemma3", gemma::describe),
    ("granite", granite::describe),
    ("phi3", phi3::describe),
    ("qwen3next", qwen3next::describe),
    ("qwen35", qwen3next::describe_qwen35),
    ("qwen35moe", qwen3next::describe_qwen35moe),
];

/// The norm before the feed-forward block, where an architecture names it otherwise than
/// `ffn_norm` (Qwen3-Next keeps the Hugging Face name of that norm).
const FFN_NORM_TENSORS: &[(&str, &str)] = &[
    ("qwen3next", "post_attention_norm"),
    ("qwen35", "post_attention_norm"),
    ("qwen35moe", "post_attention_norm"),
    ("gpt-oss", "post_attention_norm"),
];

/// The name (without `blk.N.` and `.weight`) of the norm before each feed-forward block.
pub fn ffn_norm_tensor(arch: &str) -> &'static str {
    FFN_NORM_TENSORS
        .iter()
        .find(|(a, _)| *a == arch)
        .map_or("ffn_norm", |(_, name)| name)
}

/// The names of the architectures we run.
pub fn supported() -> Vec<&'static str> {
    ARCHITECTURES.iter().map(|(n, _)| *n).collect()
}

/// The plan of the model in `file`.
pub fn describe(file: &GgufFile) -> Result<ModelPlan> {
    let arch = file.metadata().get_str("general.architecture")?;
    let (_, describe) = ARCHITECTURES
        .iter()
        .find(|(name, _)| *name == arch)
        .ok_or_else(|| ModelError::UnknownArchitecture(arch.to_string(), supported().join(", ")))?;
    // Every layer has tensors of its own: a layer count beyond the tensor count is a hostile or
    // broken file, refused before a plan is sized by it.
    let key = format!("{arch}.block_count");
    if let Some(n) = file.metadata().opt_u64(&key)? {
        if n > file.tensors().len() as u64 {
            return Err(ModelError::Invalid(format!(
                "{key} is {n} but the file has only {} tensors",
                file.tensors().len()
            )));
        }
    }
    let plan = describe(file, arch)?;
    check_sizes(&plan)?;
    Ok(plan)
}

/// Sizes the forward pass divides by or allocates from must not be zero: such a file is
/// refused here, naming the key, instead of failing (or panicking) in the forward pass.
fn check_sizes(plan: &ModelPlan) -> Result<()> {
    let arch = &plan.architecture;
    let zero = |key: &str| -> Result<()> {
        Err(ModelError::Invalid(format!(
            "{arch}.{key} is 0: the model would have nothing to compute"
        )))
    };
    if plan.n_embd == 0 {
        return zero("embedding_length");
    }
    if plan.n_vocab == 0 {
        return zero("vocab_size (or the rows of token_embd.weight)");
    }
    if plan.layers.is_empty() {
        return zero("block_count");
    }
    if plan.n_ctx_train == 0 {
        return zero("context_length");
    }
    for layer in &plan.layers {
        if layer.mixer == crate::plan::Mixer::Attention {
            let a = &layer.attention;
            if a.head_dim == 0 {
                return zero("attention.key_length (the head size)");
            }
            if a.n_head == 0 || a.n_head_kv == 0 {
                return zero("attention.head_count or attention.head_count_kv");
            }
        }
        match &layer.ffn {
            crate::plan::Ffn::Gated { n_ff: 0, .. } => return zero("feed_forward_length"),
            crate::plan::Ffn::Moe(m) if m.n_ff == 0 => return zero("expert_feed_forward_length"),
            crate::plan::Ffn::Moe(m) if m.n_expert == 0 || m.n_expert_used == 0 => {
                return zero("expert_count or expert_used_count")
            }
            _ => {}
        }
    }
    Ok(())
}

/// Reads the keys every decoder shares, under the architecture's prefix.
pub(crate) struct Keys<'a> {
    pub file: &'a GgufFile,
    pub arch: &'a str,
}

impl Keys<'_> {
    pub fn key(&self, suffix: &str) -> String {
        format!("{}.{suffix}", self.arch)
    }

    pub fn usize(&self, suffix: &str) -> Result<usize> {
        Ok(self.file.metadata().get_u64(&self.key(suffix))? as usize)
    }

    /// A size the model divides by or allocates from: 0 is refused, naming the key.
    pub fn nonzero_usize(&self, suffix: &str) -> Result<usize> {
        match self.usize(suffix)? {
            0 => Err(ModelError::Invalid(format!(
                "{} is 0: the model would have nothing to compute",
                self.key(suffix)
            ))),
            n => Ok(n),
        }
    }

    pub fn opt_usize(&self, suffix: &str) -> Result<Option<usize>> {
        Ok(self
            .file
            .metadata()
            .opt_u64(&self.key(suffix))?
            .map(|v| v as usize))
    }

    pub fn opt_f32(&self, suffix: &str) -> Result<Option<f32>> {
        Ok(self.file.metadata().opt_f32(&self.key(suffix))?)
    }

    pub fn opt_str(&self, suffix: &str) -> Result<Option<&str>> {
        Ok(self.file.metadata().opt_str(&self.key(suffix))?)
    }
}
