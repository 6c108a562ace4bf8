//! Generation as an iterator of text pieces.

use anyhow::Result;
use ferrolm_engine::sequence::{Sequence, SequenceParams};
use ferrolm_engine::{eval_one, Backend, FinishReason, GenerateError, GenerateParams};
use ferrolm_model::Logits;
use ferrolm_tokenizer::Tokenizer;

/// Prompt tokens evaluated per call (the CPU's batch).
const PROMPT_CHUNK: usize = 512;

/// The text of a generation, piece by piece as it becomes final (held back only where it may
/// begin a stop string or ends inside a UTF-8 character). The host samples each token.
pub struct TokenStream<'a> {
    backend: &'a mut dyn Backend,
    slot: usize,
    seq: Sequence<'a>,
    done: bool,
}

impl<'a> TokenStream<'a> {
    /// A generation after `prompt` in `slot` of `backend`, which it empties first.
    pub fn new(
        backend: &'a mut dyn Backend,
        slot: usize,
        tokenizer: &'a Tokenizer,
        prompt: Vec<u32>,
        params: &GenerateParams,
    ) -> Result<TokenStream<'a>> {
        let n_ctx = backend.n_ctx();
        if prompt.len() >= n_ctx {
            return Err(GenerateError::PromptTooLong {
                prompt: prompt.len(),
                n_ctx,
            }
            .into());
        }
        backend.truncate(slot, 0)?;
        let params = SequenceParams {
            max_tokens: params.max_tokens,
            sampler: params.sampler.clone(),
            stop: Vec::new(),
            stop_at_eog: params.stop_at_eog,
        };
        Ok(TokenStream {
            backend,
            slot,
            seq: Sequence::new(tokenizer, prompt, params, n_ctx),
            done: false,
        })
    }

    /// Why the generation ended, once it has.
    pub fn finish_reason(&self) -> Option<FinishReason> {
        self.seq.finished()
    }

    /// Tokens generated so far.
    pub fn completion_tokens(&self) -> usize {
        self.seq.completion_tokens()
    }

    fn step(&mut self) -> Result<Option<String>, GenerateError> {
        let (ids, last) = self.seq.next_input(PROMPT_CHUNK);
        let n = ids.len();
        let want = if last { Logits::Last } else { Logits::None };
        let logits = eval_one(self.backend, self.slot, ids, want)?;
        let step = self.seq.advance(n, last.then_some(&logits[..]))?;
        if step.finished.is_some() {
            self.done = true;
        }
        Ok((!step.text.is_empty()).then_some(step.text))
    }
}

impl Iterator for TokenStream<'_> {
    type Item = Result<String, GenerateError>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done && self.seq.finished().is_none() {
            match self.step() {
                Ok(Some(text)) => return Some(Ok(text)),
                Ok(None) => {}
                Err(e) => {
                    self.done = true;
                    return Some(Err(e));
                }
            }
        }
        None
    }
}
