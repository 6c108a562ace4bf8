//! `ferrolm perplexity`: a model's perplexity on a text, computed as llama-perplexity computes
//! it, and its KL-divergence mode (one model's distributions saved, another's compared with them).
//!
//! The text is tokenized with the vocabulary's specials added (not parsed) and cut into as many
//! whole chunks of the context size as it holds; each chunk is evaluated alone from an empty
//! cache, its first token replaced by BOS when the vocabulary adds one, and the second half of
//! it scored: the negative log-likelihood of each next token. The arithmetic follows
//! llama-perplexity's (maximum and logits in f32, sums in f64) so that the figures agree.
//! The base file of `--kl-divergence-base` has llama-perplexity's layout ([`kl`]), so either
//! tool reads the other's.

mod kl;

use std::io::{BufReader, BufWriter};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm_engine::{eval_one, Backend};
use ferrolm_model::Logits;

use super::common::{load_any_device, open_backend, ModelArgs};
use crate::token_bar::TokenBar;

/// `ferrolm perplexity`'s flags.
#[derive(Args, Debug)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The text to score (UTF-8).
    #[arg(short = 'f', long = "file")]
    pub file: Option<PathBuf>,
    /// Tokens per chunk.
    #[arg(short = 'c', long, default_value_t = 512)]
    pub ctx_size: usize,
    /// Chunks to score at most (default: every whole chunk of the text).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Without --kl-divergence: also save the model's distributions to this file. With it: the
    /// file saved before, whose tokens and distributions this model is compared with.
    #[arg(long, value_name = "FILE")]
    pub kl_divergence_base: Option<PathBuf>,
    /// Compare with --kl-divergence-base: KL divergence, its percentiles, the same top token.
    #[arg(long, requires = "kl_divergence_base")]
    pub kl_divergence: bool,
}

/// Sums of the negative log-likelihoods of the scored tokens and of their squares.
#[derive(Default)]
struct Nll {
    sum: f64,
    sum2: f64,
    count: usize,
}

impl Nll {
    fn add(&mut self, v: f64) {
        self.sum += v;
        self.sum2 += v * v;
        self.count += 1;
    }

    fn ppl(&self) -> f64 {
        (self.sum / self.count as f64).exp()
    }

    /// The perplexity and its uncertainty, as llama-perplexity's final estimate gives them.
    fn estimate(&self) -> (f64, f64) {
        let n = self.count as f64;
        let mean = self.sum / n;
        let var = self.sum2 / n - mean * mean;
        let ppl = mean.exp();
        let sd = if var > 0.0 {
            (var / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        (ppl, sd * ppl)
    }
}

/// `-log softmax(logits)[tok]`, as llama-perplexity computes it without a base file.
fn nll(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().copied().fold(logits[0], f32::max);
    let sum_exp: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
    -(f64::from(logits[tok] - max) - sum_exp.ln())
}

/// The logits of every position of chunk `c` of `tokens`, evaluated from an empty cache with
/// its first token replaced by `bos` if given.
fn chunk_logits(
    backend: &mut dyn Backend,
    tokens: &[u32],
    c: usize,
    n_ctx: usize,
    bos: Option<u32>,
) -> Result<Vec<f32>> {
    let mut ids = tokens[c * n_ctx..(c + 1) * n_ctx].to_vec();
    if let Some(bos) = bos {
        ids[0] = bos;
    }
    backend.truncate(0, 0)?;
    Ok(eval_one(backend, 0, &ids, Logits::All)?)
}

/// The BOS that starts each chunk, if the vocabulary adds one; a vocabulary that adds EOS is
/// refused, as llama-perplexity refuses it.
fn chunk_bos(tokenizer: &ferrolm_tokenizer::Tokenizer) -> Result<Option<u32>> {
    if tokenizer.adds_eos() {
        bail!("the vocabulary adds EOS after every text; perplexity is not defined for it here");
    }
    if !tokenizer.adds_bos() {
        return Ok(None);
    }
    tokenizer
        .bos()
        .map(Some)
        .context("the vocabulary adds BOS but has no BOS token")
}

/// Runs `ferrolm perplexity`.
pub fn run(args: PerplexityArgs) -> Result<()> {
    let (model, tokenizer) = load_any_device(&args.model)?;
    let bos = chunk_bos(&tokenizer)?;
    if args.kl_divergence {
        let base = args.kl_divergence_base.as_ref().expect("clap requires it");
        return kl::compare(&args.model, &model, bos, base, args.chunks);
    }
    let Some(file) = &args.file else {
        bail!("perplexity needs a text: -f FILE");
    };
    let text = std::fs::read_to_string(file)
        .with_context(|| format!("reading {} (UTF-8 text)", file.display()))?;
    let tokens = tokenizer.encode(&text, true, false);
    let n_ctx = args.ctx_size;
    if n_ctx < 4 {
        bail!("-c {n_ctx}: a chunk needs at least 4 tokens");
    }
    if tokens.len() < 2 * n_ctx {
        bail!(
            "{} holds {} tokens; a context of {n_ctx} needs at least {}",
            file.display(),
            tokens.len(),
            2 * n_ctx
        );
    }
    let n_chunk = args
        .chunks
        .map_or(tokens.len() / n_ctx, |n| n.min(tokens.len() / n_ctx));
    if n_chunk == 0 {
        bail!("--chunks 0: nothing to score");
    }
    let n_vocab = tokenizer.vocab_size();
    let mut base = match &args.kl_divergence_base {
        Some(path) => {
            let f = std::fs::File::create(path)
                .with_context(|| format!("creating {}", path.display()))?;
            let mut w = kl::BaseWriter::new(BufWriter::new(f), n_vocab);
            w.header(n_ctx, n_chunk, &tokens[..n_chunk * n_ctx])
                .with_context(|| format!("writing {}", path.display()))?;
            Some((w, path))
        }
        None => None,
    };
    let first = n_ctx / 2;
    eprintln!(
        "ferrolm: perplexity over {n_chunk} chunks of {n_ctx} tokens ({} in the text), the \
         last {} of each scored",
        tokens.len(),
        n_ctx - 1 - first
    );
    let mut backend = open_backend(&args.model, &model, n_ctx, 1)?;
    let mut acc = Nll::default();
    let bar = TokenBar::new("perplexity", n_chunk * n_ctx, 0);
    for c in 0..n_chunk {
        let logits = chunk_logits(backend.as_mut(), &tokens, c, n_ctx, bos)?;
        let row_len = logits.len() / n_ctx;
        if row_len != n_vocab {
            bail!("the model gives {row_len} logits per token, its vocabulary has {n_vocab}");
        }
        for i in first..n_ctx - 1 {
            let row = &logits[i * row_len..(i + 1) * row_len];
            let tok = tokens[c * n_ctx + i + 1] as usize;
            let v = match &mut base {
                Some((w, path)) => w
                    .position(row, tok)
                    .with_context(|| format!("writing {}", path.display()))?,
                None => nll(row, tok),
            };
            acc.add(v);
        }
        bar.note(&format!("[{}]{:.4},", c + 1, acc.ppl()));
        bar.advance(n_ctx);
    }
    bar.finish();
    eprintln!();
    if let Some((w, path)) = base {
        w.finish()
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("ferrolm: distributions saved to {}", path.display());
    }
    let (ppl, uncertainty) = acc.estimate();
    println!("Final estimate: PPL = {ppl:.4} +/- {uncertainty:.5}");
    Ok(())
}

/// Opens the base file of `--kl-divergence` for reading.
fn open_base(path: &std::path::Path) -> Result<(BufReader<std::fs::File>, u64)> {
    let f = std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let len = f.metadata()?.len();
    Ok((BufReader::new(f), len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nll_is_minus_the_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0, -1.0];
        let z: f64 = logits.iter().map(|&l| f64::from(l).exp()).sum();
        for (tok, &l) in logits.iter().enumerate() {
            let want = -(f64::from(l).exp() / z).ln();
            assert!((nll(&logits, tok) - want).abs() < 1e-6, "{tok}");
        }
    }

    #[test]
    fn the_estimate_is_llama_perplexity_s() {
        let mut acc = Nll::default();
        for v in [1.0, 2.0, 3.0, 4.0] {
            acc.add(v);
        }
        let (ppl, unc) = acc.estimate();
        assert!((ppl - 2.5f64.exp()).abs() < 1e-12);
        // var = 7.5 - 6.25 = 1.25, sd = sqrt(1.25 / 3).
        assert!((unc - (1.25f64 / 3.0).sqrt() * ppl).abs() < 1e-12);
    }
}
