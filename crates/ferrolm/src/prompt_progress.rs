//! A progress bar while a long prompt is evaluated (`run`, `chat`): tokens done and tokens per
//! second, on a terminal only.
//!
//! It wraps what generation runs on and feeds a long prompt to it in pieces of the model's batch
//! size, asking logits of the last piece only; the session evaluates a prompt in such batches
//! anyway, so the results are the same as in one call.

use std::io::IsTerminal;

use ferrolm_engine::{Forward, GenerateError};
use ferrolm_model::{Logits, BATCH};
use indicatif::{ProgressBar, ProgressStyle};

/// Prompts shorter than this go through without a bar.
const SHOWN_FROM: usize = 2 * BATCH;

/// `inner` with a bar over long prompts.
pub struct PromptProgress<'a, F> {
    inner: &'a mut F,
    /// Whether to show a bar at all (stderr is a terminal).
    shown: bool,
}

impl<'a, F: Forward> PromptProgress<'a, F> {
    /// A bar on stderr if it is a terminal (or `FERROLM_PROGRESS=1` asks for one anyway).
    pub fn new(inner: &'a mut F) -> PromptProgress<'a, F> {
        let asked = std::env::var("FERROLM_PROGRESS").is_ok_and(|v| v == "1");
        PromptProgress {
            inner,
            shown: asked || std::io::stderr().is_terminal(),
        }
    }

    #[cfg(test)]
    fn always(inner: &'a mut F) -> PromptProgress<'a, F> {
        PromptProgress { inner, shown: true }
    }
}

impl<F: Forward> Forward for PromptProgress<'_, F> {
    fn position(&self) -> usize {
        self.inner.position()
    }

    fn n_ctx(&self) -> usize {
        self.inner.n_ctx()
    }

    fn eval(&mut self, ids: &[u32], want: Logits) -> Result<Vec<f32>, GenerateError> {
        // Every position's logits are one call's; a short prompt needs no bar.
        if !self.shown || ids.len() < SHOWN_FROM || matches!(want, Logits::All) {
            return self.inner.eval(ids, want);
        }
        let bar = ProgressBar::new(ids.len() as u64);
        let style = ProgressStyle::with_template(
            "prompt [{bar:30}] {pos}/{len} tokens {per_sec} eta {eta}",
        )
        .expect("a valid template")
        .progress_chars("=> ");
        bar.set_style(style);
        let mut logits = Vec::new();
        let pieces = ids.len().div_ceil(BATCH);
        for (k, piece) in ids.chunks(BATCH).enumerate() {
            let last = k + 1 == pieces;
            logits = self
                .inner
                .eval(piece, if last { want } else { Logits::None })?;
            bar.inc(piece.len() as u64);
        }
        bar.finish_and_clear();
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the calls it gets; its logits are the ids it was given.
    struct Recorder {
        pos: usize,
        calls: Vec<(usize, bool)>,
    }

    impl Forward for Recorder {
        fn position(&self) -> usize {
            self.pos
        }
        fn n_ctx(&self) -> usize {
            1 << 20
        }
        fn eval(&mut self, ids: &[u32], want: Logits) -> Result<Vec<f32>, GenerateError> {
            self.pos += ids.len();
            self.calls.push((ids.len(), matches!(want, Logits::Last)));
            Ok(match want {
                Logits::None => Vec::new(),
                _ => vec![*ids.last().unwrap() as f32],
            })
        }
    }

    #[test]
    fn a_long_prompt_goes_in_batches_with_the_last_one_s_logits() {
        let mut recorder = Recorder {
            pos: 0,
            calls: Vec::new(),
        };
        let mut p = PromptProgress::always(&mut recorder);
        let ids: Vec<u32> = (0..(2 * BATCH + 7) as u32).collect();
        let logits = p.eval(&ids, Logits::Last).unwrap();
        assert_eq!(logits, [(2 * BATCH + 6) as f32]);
        assert_eq!(p.inner.calls, [(BATCH, false), (BATCH, false), (7, true)]);
        assert_eq!(p.position(), 2 * BATCH + 7);
        // Short prompts and single tokens pass through in one call.
        p.eval(&ids[..10], Logits::Last).unwrap();
        assert_eq!(recorder.calls.last(), Some(&(10, true)));
    }
}
