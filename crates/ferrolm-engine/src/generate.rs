//! Generating a continuation: prefill the prompt, then sample and decode one token at a time,
//! streaming text as it completes.

use std::time::{Duration, Instant};

use std::sync::Arc;

use ferrolm_model::Logits;
use ferrolm_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

use crate::backend::{Backend, BackendError, SlotInput};

use crate::sampler::{Sampler, SamplerParams};

/// What can stop a generation early.
#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    /// The backend failed (context full, bad id, the device, ...).
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The tokenizer failed.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// A step of a sequence failed (its text or its output constraint).
    #[error(transparent)]
    Step(#[from] crate::sequence::StepError),
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

/// Evaluates `prompt` after what `slot` of `backend` holds, then generates. `on_text` receives
/// each piece of text as it completes and returns `false` to stop.
///
/// Where the backend can choose tokens itself for this sampler ([`Backend::sample_on_device`]),
/// it does, and each step is queued before the host reads the previous step's choice; otherwise
/// the host samples from the logits of each step.
pub fn generate(
    backend: &mut dyn Backend,
    slot: usize,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    on_text: impl FnMut(&str) -> bool,
) -> Result<Generation, GenerateError> {
    generate_observed(
        backend,
        slot,
        tokenizer,
        prompt,
        params,
        &mut |_| {},
        on_text,
    )
}

/// Prompt ids per call when the prompt's progress is observed.
const PROMPT_CHUNK: usize = 512;

/// [`generate`], telling `on_prompt` how many prompt ids are evaluated so far (a progress bar):
/// the prompt then goes through in calls of 512 ids (the CPU's own batches, so the results do
/// not change), except where the device samples, whose draws follow the prompt's calls.
pub fn generate_observed(
    backend: &mut dyn Backend,
    slot: usize,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    on_prompt: &mut dyn FnMut(usize),
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<Generation, GenerateError> {
    let n_ctx = backend.n_ctx();
    let start_pos = backend.position(slot);
    if start_pos + prompt.len() >= n_ctx {
        return Err(GenerateError::PromptTooLong {
            prompt: start_pos + prompt.len(),
            n_ctx,
        });
    }
    let on_device = backend.sample_on_device(slot, Some(&params.sampler))?;
    let result = run(
        backend,
        slot,
        tokenizer,
        prompt,
        params,
        on_device,
        on_prompt,
        &mut on_text,
    );
    if on_device {
        backend.sample_on_device(slot, None)?;
    }
    result
}

/// The one evaluation of `ids` in `slot`, its logits as asked.
pub fn eval_one(
    backend: &mut dyn Backend,
    slot: usize,
    ids: &[u32],
    want: Logits,
) -> Result<Vec<f32>, BackendError> {
    let mut out = backend.forward(&[SlotInput { slot, ids, want }]);
    out.pop()
        .expect("one output per input")
        .map_err(|e| match Arc::try_unwrap(e) {
            Ok(e) => e,
            Err(shared) => BackendError::Device(shared.to_string()),
        })
}

#[allow(clippy::too_many_arguments)]
fn run(
    backend: &mut dyn Backend,
    slot: usize,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &GenerateParams,
    on_device: bool,
    on_prompt: &mut dyn FnMut(usize),
    on_text: &mut dyn FnMut(&str) -> bool,
) -> Result<Generation, GenerateError> {
    let n_ctx = backend.n_ctx();
    let mut sampler = Sampler::new(params.sampler.clone());
    let mut history: Vec<u32> = prompt.to_vec();
    let start = Instant::now();
    let mut logits = if on_device || prompt.len() <= PROMPT_CHUNK {
        eval_one(backend, slot, prompt, Logits::Last)?
    } else {
        let mut last = Vec::new();
        let chunks = prompt.len().div_ceil(PROMPT_CHUNK);
        for (i, chunk) in prompt.chunks(PROMPT_CHUNK).enumerate() {
            let want = if i + 1 == chunks {
                Logits::Last
            } else {
                Logits::None
            };
            last = eval_one(backend, slot, chunk, want)?;
            on_prompt((i * PROMPT_CHUNK + chunk.len()).min(prompt.len()));
        }
        last
    };
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
        // Room for the id about to be chosen to be evaluated too.
        let room = out.tokens.len() + 1 < params.max_tokens && backend.position(slot) + 1 < n_ctx;
        // When the device chooses and there is room, the step evaluating its choice is queued
        // before the host reads that choice; a stop at that id forgets the extra position.
        let ahead = on_device && room;
        let id = if ahead {
            backend.step_chosen(slot)?
        } else if on_device {
            backend.chosen(slot)?
        } else {
            sampler.sample(&logits, &history)
        };
        let mut stop = params.stop_at_eog && tokenizer.is_eog(id);
        if !stop {
            out.tokens.push(id);
            history.push(id);
            let piece = decoder.push(id)?;
            out.text.push_str(&piece);
            stop = !piece.is_empty() && !on_text(&piece);
        }
        if stop {
            out.finish = FinishReason::Stop;
            if ahead {
                let back = backend.position(slot) - 1;
                backend.truncate(slot, back)?;
            }
            break;
        }
        if !room {
            break;
        }
        if !on_device {
            logits = eval_one(backend, slot, &[id], Logits::Last)?;
        }
    }
    let rest = decoder.finish();
    if !rest.is_empty() {
        on_text(&rest);
        out.text.push_str(&rest);
    }
    out.gen_time = gen_start.elapsed();
    Ok(out)
}
