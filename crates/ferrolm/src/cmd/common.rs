//! What several commands share: loading a model with its tokenizer, sampling flags.

use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use ferrolm_engine::SamplerParams;
use ferrolm_gguf::GgufFile;
use ferrolm_model::Model;
use ferrolm_tokenizer::Tokenizer;

use crate::models;

/// `-m` and `-t`.
#[derive(Args, Clone, Debug)]
pub struct ModelArgs {
    /// A GGUF file or a known model's name (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(short, long)]
    pub model: Option<String>,
    /// Threads (0: every core).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
}

/// Sampling flags.
#[derive(Args, Clone, Debug)]
pub struct SamplingArgs {
    /// Temperature (0: greedy).
    #[arg(long, default_value_t = 0.8)]
    pub temp: f32,
    /// Top-k (0: off).
    #[arg(long, default_value_t = 40)]
    pub top_k: usize,
    /// Top-p (1: off).
    #[arg(long, default_value_t = 0.95)]
    pub top_p: f32,
    /// Min-p (0: off).
    #[arg(long, default_value_t = 0.05)]
    pub min_p: f32,
    /// Repetition penalty (1: off).
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    /// Presence penalty (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    /// Frequency penalty (0: off).
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    /// Seed of the draws (default: from the clock).
    #[arg(long)]
    pub seed: Option<u64>,
}

impl SamplingArgs {
    /// The sampler these flags describe.
    pub fn params(&self) -> SamplerParams {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        SamplerParams {
            temperature: self.temp,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            penalty_last_n: 64,
            seed,
        }
    }
}

/// A model and its tokenizer from one file.
pub fn load(args: &ModelArgs) -> Result<(Model, Tokenizer)> {
    let path = models::resolve(args.model.as_deref())?;
    let file = Arc::new(GgufFile::open(&path)?);
    let tokenizer = Tokenizer::from_metadata(file.metadata())
        .with_context(|| format!("reading the tokenizer of {}", path.display()))?;
    let model = Model::from_file(file, args.threads)
        .with_context(|| format!("loading {}", path.display()))?;
    Ok((model, tokenizer))
}

/// The context size: `--ctx-size` if given (0: default), capped by the model's trained length.
pub fn context_size(model: &Model, requested: usize) -> usize {
    let trained = model.plan().n_ctx_train;
    if requested == 0 {
        trained.min(4096)
    } else {
        requested.min(trained)
    }
}
