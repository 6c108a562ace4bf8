//! Generating a continuation: prefill the prompt, then sample and decode one token at a time,
//! streaming text as it completes.

use std::time::{Duration, Instant};

use ferrolm_model::{Logits, ModelError, Session};
use ferrolm_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

use crate::sampler::{Sampler, SamplerParams};

/// What can stop a generation early.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The model failed (context full, bad id, ...).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The tokenizer failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A backend other than the CPU session failed (the GPU).
    #[error("{0}")]
    Backend(String),
    /// The prompt does not fit the context.
    #[error("the prompt has {prompt} tokens but the context holds {n_ctx} (with room for at least one generated token); use a larger --ctx-size or --truncate")]
    PromptTooLong {
        /// Prompt tokens.
        prompt: usize,
        /// Context size.
        n_ctx: usize,
    },
}

/// How to generate.
#[derive(Clone, Debug)]
pub struct GenerateParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// The sampler.
    pub sampler: SamplerParams,
    /// Stop at end-of-generation tokens.
    pub stop_at_eog: bool,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token, or the caller asked to stop.
    Stop,
    /// `max_tokens`, or the context filled.
    Length,
}

/// What a generation produced and how fast.
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated ids (the end-of-generation token excluded).
    pub tokens: Vec<u32>,
    /// The generated text.
    pub text: String,
    /// Why it ended.
    pub finish: FinishReason,
    /// Tokens evaluated as prompt.
    pub prompt_evaluated: usize,
    /// Time spent on the prompt.
    pub prompt_time: Duration,
    /// Time spent generating (from the first sampled token on).
    pub gen_time: Duration,
}

impl Generation {
    /// Prompt tokens per second.
    pub fn pp_tokens_per_s(&self) -> f64 {
        self.prompt_evaluated as f64 / self.prompt_time.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second (each generated token after the first costs one decode).
    pub fn tg_tokens_per_s(&self) -> f64 {
        self.tokens.len().saturating_sub(1) as f64 / self.gen_time.as_secs_f64().max(1e-9)
    }
}

/// What [`generate`] runs on: a forward pass over new ids after what it holds (a CPU
/// [`Session`], or a model split between a GPU and the CPU).
pub trait Forward {
    /// Positions filled so far.
    fn position(&self) -> usize;
    /// Positions the context holds.
    fn n_ctx(&self) -> usize;
    /// Evaluates `ids` after what it holds and returns the logits asked for.
    fn eval(&mut self, ids: &[u32], want: Logits) -> Result<Vec<f32>, GenerateError>;
}

impl Forward for Session<'_> {
    fn position(&self) -> usize {
        Session::position(self)
    }

    fn n_ctx(&self) -> usize {
        Session::n_ctx(self)
    }

    fn eval(&mut self, ids: &[u32], want: Logits) -> Result<Vec<f32>, GenerateError> {
        Ok(Session::eval(self, ids, want)?)
    }
}

/// Evaluates `prompt` after what `session` holds, then generates. `on_text` receives each
/// piece of text as it completes and returns `false` to stop.
pub fn generate(
    session: &mut impl Forward,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<Generation, GenerateError> {
    let n_ctx = session.n_ctx();
    if session.position() + prompt.len() >= n_ctx {
        return Err(GenerateError::PromptTooLong {
            prompt: session.position() + prompt.len(),
            n_ctx,
        });
    }
    let mut sampler = Sampler::new(params.sampler.clone());
    let mut history: Vec<u32> = prompt.to_vec();
    let start = Instant::now();
    let mut logits = session.eval(prompt, Logits::Last)?;
    let prompt_time = start.elapsed();
    let gen_start = Instant::now();
    let mut decoder = StreamDecoder::new(tokenizer);
    let mut out = Generation {
        tokens: Vec::new(),
        text: String::new(),
        finish: FinishReason::Length,
        prompt_evaluated: prompt.len(),
        prompt_time,
        gen_time: Duration::ZERO,
    };
    while out.tokens.len() < params.max_tokens {
        let id = sampler.sample(&logits, &history);
        if params.stop_at_eog && tokenizer.is_eog(id) {
            out.finish = FinishReason::Stop;
            break;
        }
        out.tokens.push(id);
        history.push(id);
        let piece = decoder.push(id)?;
        out.text.push_str(&piece);
        if !piece.is_empty() && !on_text(&piece) {
            out.finish = FinishReason::Stop;
            break;
        }
        if out.tokens.len() == params.max_tokens || session.position() + 1 >= n_ctx {
            break;
        }
        logits = session.eval(&[id], Logits::Last)?;
    }
    let rest = decoder.finish();
    if !rest.is_empty() {
        on_text(&rest);
        out.text.push_str(&rest);
    }
    out.gen_time = gen_start.elapsed();
    Ok(out)
}
