//! A bar over tokens evaluated (tokens done, tokens per second, time left), on a terminal only:
//! perplexity's chunks now, a long prompt of `run`/`chat` where the engine evaluates it.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

/// A bar over `total` tokens, or nothing when stderr is not a terminal.
pub struct TokenBar {
    bar: Option<ProgressBar>,
}

impl TokenBar {
    /// A bar labelled `label` over `total` tokens; none when stderr is not a terminal or when
    /// `total` is below `shown_from` (a short prompt needs none).
    pub fn new(label: &str, total: usize, shown_from: usize) -> TokenBar {
        let bar = (total >= shown_from && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::new(total as u64);
            let style = ProgressStyle::with_template(&format!(
                "{label} [{{bar:30}}] {{pos}}/{{len}} tokens {{per_sec}} eta {{eta}} {{msg}}"
            ))
            .expect("a valid template")
            .progress_chars("=> ");
            bar.set_style(style);
            bar
        });
        TokenBar { bar }
    }

    /// `n` more tokens done.
    pub fn advance(&self, n: usize) {
        if let Some(bar) = &self.bar {
            bar.inc(n as u64);
        }
    }

    /// `n` tokens done in all.
    pub fn set_position(&self, n: usize) {
        if let Some(bar) = &self.bar {
            bar.set_position(n as u64);
        }
    }

    /// Shows `msg` after the bar; without a bar, writes it to stderr as it is.
    pub fn note(&self, msg: &str) {
        match &self.bar {
            Some(bar) => bar.set_message(msg.trim_end().to_string()),
            None => eprint!("{msg}"),
        }
    }

    /// Takes the bar off the terminal.
    pub fn finish(self) {
        if let Some(bar) = self.bar {
            bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_bar_below_the_threshold_or_off_a_terminal() {
        assert!(TokenBar::new("prompt", 10, 1024).bar.is_none());
        // Tests run with stderr captured (not a terminal): no bar, and advancing is harmless.
        let bar = TokenBar::new("prompt", 4096, 1024);
        assert_eq!(bar.bar.is_some(), std::io::stderr().is_terminal());
        bar.advance(512);
        bar.finish();
    }
}
