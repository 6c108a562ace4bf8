//! Step-wise generation for a scheduler that serves many sequences at once.
//!
//! A [`Sequence`] is one request's decoding state: the prompt still to evaluate, the sampler,
//! the stop strings and the incremental detokenizer. It holds no KV cache: the scheduler asks it
//! for its next input ([`Sequence::next_input`]), evaluates the inputs of every active sequence
//! in one step through a [`Backend`](crate::Backend), and hands each sequence its logits back
//! ([`Sequence::advance`]). The caches live behind the [`Backend`](crate::Backend), which
//! evaluates all slots' tokens in one call.

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

/// Where a step's next id comes from.
enum Next<'a> {
    /// Sampled from these logits.
    Logits(&'a [f32]),
    /// Chosen already.
    Chosen(u32),
    /// Sampled from the largest logits alone.
    Top(&'a [(u32, f32)]),
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

    /// The prompt's ids.
    pub fn prompt(&self) -> &[u32] {
        &self.history[..self.prompt_len]
    }

    /// Takes the first `n` prompt ids as already in the slot's cache (a prefix an earlier
    /// request left there): evaluation starts after them. The prompt's last id is evaluated
    /// whatever `n` (its logits start the generation). Only before the first step.
    pub fn reuse_prefix(&mut self, n: usize) {
        if self.evaluated == 0 && self.finished.is_none() {
            self.evaluated = n.min(self.prompt_len.saturating_sub(1));
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
    /// lasts (or of the ids to evaluate again after [`Sequence::rewind`]), then the last
    /// sampled id. The bool says whether the step must return the logits of the last id
    /// (false for a chunk that does not end the ids). Empty once the sequence has finished.
    pub fn next_input(&self, prefill_chunk: usize) -> (&[u32], bool) {
        if self.finished.is_some() {
            return (&[], false);
        }
        let len = self.history.len();
        if len - self.evaluated > 1 {
            let end = (self.evaluated + prefill_chunk.max(1)).min(len);
            (&self.history[self.evaluated..end], end == len)
        } else {
            (&self.history[len - 1..], true)
        }
    }

    /// The ids the next steps must have evaluated before the sequence can sample again: its
    /// prompt and what it has generated.
    pub fn ids(&self) -> &[u32] {
        &self.history
    }

    /// The cache it was evaluated in now holds only its first `kept` ids (the sequence was
    /// paused and its room given away, then placed again): the next steps evaluate the rest
    /// again, in chunks as a prompt, before it samples its next token, which is then the one
    /// it would have sampled without the pause.
    pub fn rewind(&mut self, kept: usize) {
        self.evaluated = self.evaluated.min(kept);
    }

    /// Records that the `n` ids of the last [`Sequence::next_input`] were evaluated, with the
    /// logits of the last one when they were asked for; samples the next token from them.
    pub fn advance(&mut self, n: usize, logits: Option<&[f32]>) -> Result<Step, StepError> {
        self.advance_with(n, logits.map(Next::Logits))
    }

    /// Whether the sampler takes the largest logit and nothing else (no penalties, no output
    /// constraint): a backend can then choose for it ([`Sequence::advance_chosen`]).
    pub fn is_greedy(&self) -> bool {
        let s = &self.params.sampler;
        self.constraint.is_none()
            && s.temperature <= 0.0
            && s.repeat_penalty == 1.0
            && s.presence_penalty == 0.0
            && s.frequency_penalty == 0.0
    }

    /// How many of the largest logits the next choice needs when it needs no other (greedy:
    /// 1; a top-k sampler without penalties: its k); `None`: all of them (penalties, a
    /// constraint, no top-k). [`Sequence::advance_top`] then takes those alone.
    pub fn top_needed(&self) -> Option<usize> {
        if self.constraint.is_some() {
            return None;
        }
        if self.is_greedy() {
            return Some(1);
        }
        let k = self.params.sampler.top_k;
        self.sampler.samples_from_top(k).then_some(k)
    }

    /// [`Sequence::advance`] with only the largest logits of the last id, as (id, logit) in
    /// any order, at least [`Sequence::top_needed`] of them: the same choice as from all.
    pub fn advance_top(&mut self, n: usize, top: Option<&[(u32, f32)]>) -> Result<Step, StepError> {
        self.advance_with(n, top.map(Next::Top))
    }

    /// [`Sequence::advance`] with the next id already chosen (greedily, by the backend)
    /// instead of the logits to sample it from.
    pub fn advance_chosen(&mut self, n: usize, id: Option<u32>) -> Result<Step, StepError> {
        self.advance_with(n, id.map(Next::Chosen))
    }

    fn advance_with(&mut self, n: usize, next: Option<Next<'_>>) -> Result<Step, StepError> {
        let mut step = Step::default();
        if self.finished.is_some() {
            step.finished = self.finished;
            return Ok(step);
        }
        self.evaluated += n;
        let Some(next) = next else {
            return Ok(step);
        };
        if self.evaluated < self.history.len() {
            // (a chunk of the prompt, or of the ids evaluated again after a rewind)
            return Ok(step);
        }
        if let Some(c) = &mut self.constraint {
            if c.is_done().map_err(StepError::Constraint)? {
                // The grammar has ended: so does the sequence, with nothing sampled.
                return Ok(self.finish(step, FinishReason::Stop));
            }
        }
        let id = match (&mut self.constraint, next) {
            (None, Next::Logits(logits)) => self.sampler.sample(logits, &self.history),
            (None, Next::Chosen(id)) => id,
            (None, Next::Top(top)) => self.sampler.sample_top(top),
            (Some(_), Next::Top(_)) => {
                return Err(StepError::Constraint(
                    "a constrained sequence needs every logit".into(),
                ))
            }
            (Some(c), Next::Chosen(id)) => {
                c.accept(id).map_err(StepError::Constraint)?;
                id
            }
            (Some(c), Next::Logits(logits)) => {
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
