//! Step-wise generation for a scheduler that serves many sequences at once.
//!
//! A [`Sequence`] is one request's decoding state: the prompt still to evaluate, the sampler,
//! the stop strings and the incremental detokenizer. It holds no KV cache: the scheduler asks it
//! for its next input ([`Sequence::next_input`]), evaluates the inputs of every active sequence
//! in one step through a [`StepForward`], and hands each sequence its logits back
//! ([`Sequence::advance`]). The KV caches live behind [`StepForward`]: [`BatchedForward`]
//! evaluates all slots' tokens in one forward pass (one matrix-matrix product per weight).

use std::sync::Arc;

use ferrolm_model::{Logits, Model, ModelError, Session};
use ferrolm_tokenizer::{StreamDecoder, Tokenizer, TokenizerError};

use crate::constraint::Constraint;
use crate::generate::FinishReason;
use crate::sampler::{argmax, Sampler, SamplerParams};

/// Why a step failed for one sequence.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    /// The sampled token could not be turned into text.
    #[error("detokenizing: {0}")]
    Detokenize(#[from] TokenizerError),
    /// The sequence's grammar failed (an internal error of the constraint).
    #[error("the output constraint failed: {0}")]
    Constraint(String),
}

/// How one sequence generates.
#[derive(Clone, Debug)]
pub struct SequenceParams {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// The sampler.
    pub sampler: SamplerParams,
    /// Stop strings: generation ends where one appears, and the text stops before it.
    pub stop: Vec<String>,
    /// Stop at end-of-generation tokens.
    pub stop_at_eog: bool,
}

/// What one step produced for a sequence.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Step {
    /// Text that is now final (possibly empty: held back for a stop string or incomplete UTF-8).
    pub text: String,
    /// The token sampled in this step, if the step sampled one.
    pub token: Option<u32>,
    /// Set when the sequence has ended.
    pub finished: Option<FinishReason>,
}

/// One request's decoding state (see the module documentation).
pub struct Sequence<'t> {
    tokenizer: &'t Tokenizer,
    decoder: StreamDecoder<'t>,
    sampler: Sampler,
    params: SequenceParams,
    n_ctx: usize,
    /// Prompt and generated ids: the sampler's history.
    history: Vec<u32>,
    prompt_len: usize,
    /// Positions evaluated so far.
    evaluated: usize,
    generated: usize,
    /// Text decoded but not yet returned: it may be the start of a stop string.
    held: String,
    finished: Option<FinishReason>,
    /// The grammar the output must follow, if the request gave one.
    constraint: Option<Constraint>,
}

impl<'t> Sequence<'t> {
    /// A sequence that will evaluate `prompt` in a context of `n_ctx` positions, then generate.
    ///
    /// The caller checks that the prompt fits (`prompt.len() < n_ctx`); a prompt that does not
    /// fit fails at its first step with the model's `ContextFull` error.
    pub fn new(
        tokenizer: &'t Tokenizer,
        prompt: Vec<u32>,
        params: SequenceParams,
        n_ctx: usize,
    ) -> Sequence<'t> {
        let finished =
            (params.max_tokens == 0 || prompt.is_empty()).then_some(FinishReason::Length);
        Sequence {
            tokenizer,
            decoder: StreamDecoder::new(tokenizer),
            sampler: Sampler::new(params.sampler.clone()),
            prompt_len: prompt.len(),
            history: prompt,
            params,
            n_ctx,
            evaluated: 0,
            generated: 0,
            held: String::new(),
            finished,
            constraint: None,
        }
    }

    /// The same sequence, its text showing special tokens as their text when `special` (the
    /// markers of a tool-call format that are control tokens).
    pub fn with_special_text(mut self, special: bool) -> Sequence<'t> {
        if special {
            self.decoder = StreamDecoder::with_special(self.tokenizer, true);
        }
        self
    }

    /// The same sequence, its sampling constrained to `constraint`'s grammar.
    pub fn with_constraint(mut self, constraint: Option<Constraint>) -> Sequence<'t> {
        self.constraint = constraint;
        self
    }

    /// Prompt tokens.
    pub fn prompt_tokens(&self) -> usize {
        self.prompt_len
    }

    /// Tokens generated so far (an end-of-generation token is not counted).
    pub fn completion_tokens(&self) -> usize {
        self.generated
    }

    /// Whether the prompt is still being evaluated.
    pub fn in_prefill(&self) -> bool {
        self.evaluated < self.prompt_len
    }

    /// Why the sequence ended, once it has.
    pub fn finished(&self) -> Option<FinishReason> {
        self.finished
    }

    /// The ids to evaluate in the next step: up to `prefill_chunk` ids of the prompt while it
    /// lasts, then the last sampled id. The bool says whether the step must return the logits
    /// of the last id (false for a prompt chunk that is not the prompt's last).
    /// Empty once the sequence has finished.
    pub fn next_input(&self, prefill_chunk: usize) -> (&[u32], bool) {
        if self.finished.is_some() {
            return (&[], false);
        }
        if self.in_prefill() {
            let end = (self.evaluated + prefill_chunk.max(1)).min(self.prompt_len);
            (&self.history[self.evaluated..end], end == self.prompt_len)
        } else {
            (&self.history[self.history.len() - 1..], true)
        }
    }

    /// Records that the `n` ids of the last [`Sequence::next_input`] were evaluated, with the
    /// logits of the last one when they were asked for; samples the next token from them.
    pub fn advance(&mut self, n: usize, logits: Option<&[f32]>) -> Result<Step, StepError> {
        let mut step = Step::default();
        if self.finished.is_some() {
            step.finished = self.finished;
            return Ok(step);
        }
        self.evaluated += n;
        let Some(logits) = logits else {
            return Ok(step);
        };
        if self.in_prefill() {
            return Ok(step);
        }
        let id = match &mut self.constraint {
            None => self.sampler.sample(logits, &self.history),
            Some(c) => {
                if c.is_done().map_err(StepError::Constraint)? {
                    // The grammar has ended: so does the sequence, with nothing sampled.
                    return Ok(self.finish(step, FinishReason::Stop));
                }
                let masked = c.mask(logits).map_err(StepError::Constraint)?;
                let id = self.sampler.sample(&masked, &self.history);
                // Sampling's last-resort pick may land on a masked token: take the best allowed.
                let id = if c.allows(id).map_err(StepError::Constraint)? {
                    id
                } else {
                    argmax(&masked)
                };
                c.accept(id).map_err(StepError::Constraint)?;
                id
            }
        };
        step.token = Some(id);
        if self.params.stop_at_eog && self.tokenizer.is_eog(id) {
            return Ok(self.finish(step, FinishReason::Stop));
        }
        self.history.push(id);
        self.generated += 1;
        let piece = self.decoder.push(id)?;
        self.held.push_str(&piece);
        if let Some(text) = self.cut_at_stop() {
            step.text = text;
            self.finished = Some(FinishReason::Stop);
            step.finished = self.finished;
            return Ok(step);
        }
        // The same bound as `generate`: room must remain for the next token.
        if self.generated >= self.params.max_tokens || self.evaluated + 1 >= self.n_ctx {
            return Ok(self.finish(step, FinishReason::Length));
        }
        step.text = self.release();
        Ok(step)
    }

    /// Ends the sequence now (the caller asked to stop): returns the text held back.
    pub fn stop(&mut self) -> Step {
        self.finish(Step::default(), FinishReason::Stop)
    }

    /// Ends with `reason`, flushing the decoder and whatever text was held back.
    fn finish(&mut self, mut step: Step, reason: FinishReason) -> Step {
        let rest = self.decoder.finish();
        self.held.push_str(&rest);
        step.text = match self.cut_at_stop() {
            Some(text) => text,
            None => std::mem::take(&mut self.held),
        };
        self.finished = Some(reason);
        step.finished = Some(reason);
        step
    }

    /// If a stop string appears in the held text: the text before it (the rest is dropped).
    fn cut_at_stop(&mut self) -> Option<String> {
        cut_at_stop(&mut self.held, &self.params.stop)
    }

    /// Returns the held text except its longest suffix that could begin a stop string.
    fn release(&mut self) -> String {
        release(&mut self.held, &self.params.stop)
    }
}

/// If a stop string appears in `held`: the text before the first one (the rest is dropped).
fn cut_at_stop(held: &mut String, stop: &[String]) -> Option<String> {
    let at = stop
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| held.find(s.as_str()))
        .min()?;
    held.truncate(at);
    Some(std::mem::take(held))
}

/// Takes `held` except its longest suffix that could be the beginning of a stop string.
fn release(held: &mut String, stop: &[String]) -> String {
    let keep = held
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| {
            let tail = &held[i..];
            stop.iter().any(|s| !s.is_empty() && s.starts_with(tail))
        })
        .unwrap_or(held.len());
    let rest = held.split_off(keep);
    std::mem::replace(held, rest)
}

/// One slot's work in a step: ids to evaluate after what its KV cache holds.
#[derive(Clone, Copy, Debug)]
pub struct SlotInput<'a> {
    /// The slot (KV cache) the ids belong to.
    pub slot: usize,
    /// The ids.
    pub ids: &'a [u32],
    /// Whether the logits of the last id are wanted.
    pub logits: bool,
}

/// The outcome of one slot's work: the logits of its last id when asked for. An error is
/// shared, since a batched step that fails fails for every slot in it.
pub type SlotOutput = Result<Option<Vec<f32>>, Arc<ModelError>>;

/// The forward pass of a scheduler step over several sequences, each with its own KV cache
/// ("slot").
///
/// [`BatchedForward`] is the CPU implementation: all slots' tokens in one forward pass
/// (`Model::eval_many`); a GPU backend implements the same contract.
pub trait StepForward {
    /// Slots (KV caches).
    fn n_slots(&self) -> usize;
    /// Positions each slot holds.
    fn n_ctx(&self) -> usize;
    /// Empties a slot for a new sequence.
    fn clear(&mut self, slot: usize);
    /// Evaluates every input (at most one per slot) and returns one output per input, in order.
    fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput>;
}

/// [`StepForward`] over one [`Session`] per slot, all the step's slots evaluated in one forward
/// pass: every matrix product takes every slot's tokens together, each slot attends over its
/// own cache (`Model::eval_many`).
pub struct BatchedForward<'m> {
    model: &'m Model,
    sessions: Vec<Session<'m>>,
    n_ctx: usize,
}

impl<'m> BatchedForward<'m> {
    /// `n_slots` sessions of `n_ctx` positions each.
    pub fn new(model: &'m Model, n_slots: usize, n_ctx: usize) -> BatchedForward<'m> {
        BatchedForward {
            model,
            sessions: (0..n_slots).map(|_| model.session(n_ctx)).collect(),
            n_ctx,
        }
    }
}

impl StepForward for BatchedForward<'_> {
    fn n_slots(&self) -> usize {
        self.sessions.len()
    }

    fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    fn clear(&mut self, slot: usize) {
        self.sessions[slot].reset();
    }

    fn forward(&mut self, inputs: &[SlotInput<'_>]) -> Vec<SlotOutput> {
        // The sessions in the order of the inputs (at most one input per slot).
        let mut by_slot: Vec<Option<&mut Session<'_>>> =
            self.sessions.iter_mut().map(Some).collect();
        let mut items = Vec::with_capacity(inputs.len());
        for input in inputs {
            let session = by_slot[input.slot]
                .take()
                .expect("at most one input per slot");
            let want = if input.logits {
                Logits::Last
            } else {
                Logits::None
            };
            items.push((session, input.ids, want));
        }
        self.model
            .eval_many(&mut items)
            .into_iter()
            .zip(inputs)
            .map(|(r, input)| r.map(|l| input.logits.then_some(l)).map_err(Arc::new))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Text fed piece by piece: what is released, and whether a stop string ended it.
    fn feed(stop: &[&str], pieces: &[&str]) -> (String, bool) {
        let stop: Vec<String> = stop.iter().map(|s| s.to_string()).collect();
        let mut held = String::new();
        let mut out = String::new();
        for p in pieces {
            held.push_str(p);
            if let Some(t) = cut_at_stop(&mut held, &stop) {
                out.push_str(&t);
                return (out, true);
            }
            out.push_str(&release(&mut held, &stop));
        }
        out.push_str(&held);
        (out, false)
    }

    #[test]
    fn stop_strings_across_pieces() {
        assert_eq!(
            feed(&["END"], &["ab", "cE", "N", "Dxx"]),
            ("abc".into(), true)
        );
        assert_eq!(
            feed(&["END"], &["ab", "cE", "N", "x"]),
            ("abcENx".into(), false)
        );
        assert_eq!(
            feed(&["\n\n", "é!"], &["a\n", "é", "!"]),
            ("a\n".into(), true)
        );
        assert_eq!(feed(&["xy", "y"], &["ax", "yb"]), ("a".into(), true));
        assert_eq!(feed(&[], &["a", "b"]), ("ab".into(), false));
    }
}
