//! The KL-divergence mode: a base model's distributions saved in llama-perplexity's layout,
//! and another model's compared with them (mean KLD and its percentiles, the change in the
//! probability of the right token, how often both put the same token on top).
//!
//! The layout, little-endian: `_logits_`, n_ctx (u32), n_vocab (i32), n_chunk (i32), the
//! n_chunk x n_ctx tokens (i32); then for each chunk, for each of its scored positions, one row
//! of 2 * ((n_vocab + 1) / 2) + 4 u16: the scale and the lowest log-probability kept (two f32),
//! then each token's log-probability as `lowest + scale * u16` (log-probabilities more than 16
//! below the top one are stored as the lowest).

use std::io::{Read, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use ferrolm_model::Model;

use super::{chunk_logits, open_base};
use crate::cmd::common::{open_backend, ModelArgs};
use crate::token_bar::TokenBar;

const MAGIC: &[u8; 8] = b"_logits_";

/// u16 per saved row for a vocabulary of `n_vocab`.
fn row_len(n_vocab: usize) -> usize {
    2 * n_vocab.div_ceil(2) + 4
}

/// llama.cpp's rounding to the nearest integer (ties to even), for |x| < 2^22.
fn nearest_int(x: f32) -> i32 {
    let bits = (x + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007f_ffff) - 0x0040_0000
}

/// Writes a base file as the base model is scored.
pub struct BaseWriter<W: Write> {
    out: W,
    n_vocab: usize,
    row: Vec<u16>,
}

impl<W: Write> BaseWriter<W> {
    pub fn new(out: W, n_vocab: usize) -> BaseWriter<W> {
        BaseWriter {
            out,
            n_vocab,
            row: vec![0; row_len(n_vocab)],
        }
    }

    /// The header: the chunking and the tokens scored.
    pub fn header(&mut self, n_ctx: usize, n_chunk: usize, tokens: &[u32]) -> std::io::Result<()> {
        let too_big = || std::io::Error::other("sizes do not fit the file's 32-bit fields");
        self.out.write_all(MAGIC)?;
        let n_ctx = u32::try_from(n_ctx).map_err(|_| too_big())?;
        self.out.write_all(&n_ctx.to_le_bytes())?;
        for v in [self.n_vocab, n_chunk] {
            let v = i32::try_from(v).map_err(|_| too_big())?;
            self.out.write_all(&v.to_le_bytes())?;
        }
        for &t in tokens {
            self.out.write_all(&t.to_le_bytes())?;
        }
        Ok(())
    }

    /// Saves one scored position's distribution and returns its token's negative
    /// log-likelihood, both as llama-perplexity computes them when it saves a base file.
    pub fn position(&mut self, logits: &[f32], tok: usize) -> std::io::Result<f64> {
        let max = logits.iter().copied().fold(logits[0], f32::max);
        let min = logits
            .iter()
            .copied()
            .fold(logits[0], f32::min)
            .max(max - 16.0);
        let sum_exp: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        let log_sum_exp = sum_exp.ln() as f32;
        let min_log_prob = min - max - log_sum_exp;
        let scale = (max - min) / 65535.0;
        let (head, values) = self.row.split_at_mut(4);
        let words = |x: f32| {
            let b = x.to_le_bytes();
            [
                u16::from_le_bytes([b[0], b[1]]),
                u16::from_le_bytes([b[2], b[3]]),
            ]
        };
        head[..2].copy_from_slice(&words(scale));
        head[2..].copy_from_slice(&words(min_log_prob));
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        for (q, &l) in values.iter_mut().zip(logits) {
            *q = if scale != 0.0 && l > min {
                nearest_int(inv * (l - min)) as u16
            } else {
                0
            };
        }
        for q in &self.row {
            self.out.write_all(&q.to_le_bytes())?;
        }
        Ok(f64::from(max + log_sum_exp - logits[tok]))
    }

    pub fn finish(mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// The sums llama-perplexity keeps while comparing, and every position's KLD and Δp.
#[derive(Default)]
pub struct Comparison {
    sum_nll: f64,
    sum_nll2: f64,
    sum_nll_base: f64,
    sum_nll_base2: f64,
    sum_nll_nll_base: f64,
    sum_kld: f64,
    sum_kld2: f64,
    sum_p_diff: f64,
    sum_p_diff2: f64,
    sum_p_diff4: f64,
    n_same_top: usize,
    kld_values: Vec<f32>,
    p_diff_values: Vec<f32>,
}

impl Comparison {
    /// One position: this model's `logits`, the base's saved row, the token that came next.
    pub fn add(&mut self, logits: &[f32], base: &[u16], tok: usize) {
        let (mut max, mut imax) = (logits[0], 0);
        for (i, &l) in logits.iter().enumerate().skip(1) {
            if l > max {
                (max, imax) = (l, i);
            }
        }
        let sum_exp: f64 = logits.iter().map(|&l| f64::from((l - max).exp())).sum();
        let log_sum_exp = sum_exp.ln() as f32;
        let float = |w: &[u16]| {
            f32::from_le_bytes([w[0] as u8, (w[0] >> 8) as u8, w[1] as u8, (w[1] >> 8) as u8])
        };
        let (scale, min_log_prob) = (float(&base[0..2]), float(&base[2..4]));
        let base = &base[4..];
        let nll = max + log_sum_exp - logits[tok];
        self.sum_nll += f64::from(nll);
        self.sum_nll2 += f64::from(nll * nll);
        let nll_base = -(scale * f32::from(base[tok]) + min_log_prob);
        self.sum_nll_base += f64::from(nll_base);
        self.sum_nll_base2 += f64::from(nll_base * nll_base);
        self.sum_nll_nll_base += f64::from(nll * nll_base);
        let log_norm = max + log_sum_exp;
        let mut kld = 0f64;
        let (mut imax_base, mut p_log_base_max) = (0, 0f32);
        for (i, (&q, &l)) in base.iter().zip(logits).enumerate() {
            let p_log_base = scale * f32::from(q) + min_log_prob;
            if i == 0 || p_log_base > p_log_base_max {
                (p_log_base_max, imax_base) = (p_log_base, i);
            }
            if p_log_base > -16.0 {
                let p_base = p_log_base.exp();
                kld += f64::from(p_base * (p_log_base - l + log_norm));
            }
        }
        self.sum_kld += kld;
        self.sum_kld2 += kld * kld;
        self.n_same_top += usize::from(imax == imax_base);
        let p_diff = (-nll).exp() - (-nll_base).exp();
        self.sum_p_diff += f64::from(p_diff);
        let p_diff2 = f64::from(p_diff * p_diff);
        self.sum_p_diff2 += p_diff2;
        self.sum_p_diff4 += p_diff2 * p_diff2;
        self.kld_values.push(kld as f32);
        self.p_diff_values.push(p_diff);
    }

    fn count(&self) -> usize {
        self.kld_values.len()
    }

    /// The mean of `sum` over the positions and its uncertainty, as llama-perplexity gives them.
    fn mean(&self, sum: f64, sum2: f64) -> (f64, f64) {
        let n = self.count();
        if n < 1 {
            return (0.0, 0.0);
        }
        let f = sum / n as f64;
        let var = sum2 / n as f64 - f * f;
        let df = if var > 0.0 && n > 10 {
            (var / (n - 1) as f64).sqrt()
        } else {
            0.0
        };
        (f, df)
    }

    fn covariance(&self) -> f64 {
        let n = self.count() as f64;
        if n < 10.0 {
            return 0.0;
        }
        (self.sum_nll_nll_base / n - (self.sum_nll / n) * (self.sum_nll_base / n)) / (n - 1.0)
    }

    /// The mean KLD and the share of positions where both models' top token is the same.
    pub fn summary(&self) -> (f64, f64) {
        (
            self.mean(self.sum_kld, self.sum_kld2).0,
            self.n_same_top as f64 / self.count().max(1) as f64,
        )
    }

    /// The statistics llama-perplexity prints after a comparison, in its words.
    pub fn report(&self, out: &mut impl Write) -> std::io::Result<()> {
        let n = self.count();
        let (log_ppl, log_ppl_unc) = self.mean(self.sum_nll, self.sum_nll2);
        let (log_base, log_base_unc) = self.mean(self.sum_nll_base, self.sum_nll_base2);
        let (ppl, ppl_unc) = (log_ppl.exp(), log_ppl.exp() * log_ppl_unc);
        let (base, base_unc) = (log_base.exp(), log_base.exp() * log_base_unc);
        let cov = self.covariance();
        let ratio_unc =
            (log_ppl_unc * log_ppl_unc + log_base_unc * log_base_unc - 2.0 * cov).sqrt();
        let ratio = log_ppl - log_base;
        writeln!(out, "====== Perplexity statistics ======")?;
        writeln!(
            out,
            "Mean PPL(Q)                   : {ppl:10.6} ± {ppl_unc:10.6}"
        )?;
        writeln!(
            out,
            "Mean PPL(base)                : {base:10.6} ± {base_unc:10.6}"
        )?;
        let cor = 100.0 * cov / (log_ppl_unc * log_base_unc);
        writeln!(out, "Cor(ln(PPL(Q)), ln(PPL(base))): {cor:6.2}%")?;
        writeln!(
            out,
            "Mean ln(PPL(Q)/PPL(base))     : {ratio:10.6} ± {ratio_unc:10.6}"
        )?;
        let r = ratio.exp();
        writeln!(
            out,
            "Mean PPL(Q)/PPL(base)         : {r:10.6} ± {:10.6}",
            r * ratio_unc
        )?;
        let diff_unc = (ppl_unc * ppl_unc + base_unc * base_unc - 2.0 * ppl * base * cov).sqrt();
        writeln!(
            out,
            "Mean PPL(Q)-PPL(base)         : {:10.6} ± {diff_unc:10.6}",
            ppl - base
        )?;
        writeln!(out)?;
        let mut kld = self.kld_values.clone();
        kld.sort_by(f32::total_cmp);
        let mut dp = self.p_diff_values.clone();
        dp.sort_by(f32::total_cmp);
        let (mean_kld, kld_unc) = self.mean(self.sum_kld, self.sum_kld2);
        writeln!(out, "====== KL divergence statistics ======")?;
        writeln!(out, "Mean    KLD: {mean_kld:10.6} ± {kld_unc:10.6}")?;
        writeln!(out, "Maximum KLD: {:10.6}", kld[n - 1])?;
        for (label, f) in [
            ("99.9%", 0.999),
            ("99.0%", 0.99),
            ("95.0%", 0.95),
            ("90.0%", 0.9),
        ] {
            writeln!(out, "{label}   KLD: {:10.6}", percentile(&kld, f))?;
        }
        writeln!(out, "Median  KLD: {:10.6}", median(&kld))?;
        for (label, f) in [
            ("10.0%", 0.1),
            (" 5.0%", 0.05),
            (" 1.0%", 0.01),
            (" 0.1%", 0.001),
        ] {
            writeln!(out, "{label}   KLD: {:10.6}", percentile(&kld, f))?;
        }
        writeln!(out, "Minimum KLD: {:10.6}", kld[0])?;
        writeln!(out)?;
        let (mean_dp, dp_unc) = self.mean(self.sum_p_diff, self.sum_p_diff2);
        let pct = |v: f32| 100.0 * f64::from(v);
        writeln!(out, "====== Token probability statistics ======")?;
        writeln!(
            out,
            "Mean    Δp: {:6.3} ± {:5.3} %",
            100.0 * mean_dp,
            100.0 * dp_unc
        )?;
        writeln!(out, "Maximum Δp: {:6.3}%", pct(dp[n - 1]))?;
        for (label, f) in [
            ("99.9%", 0.999),
            ("99.0%", 0.99),
            ("95.0%", 0.95),
            ("90.0%", 0.9),
            ("75.0%", 0.75),
        ] {
            writeln!(out, "{label}   Δp: {:6.3}%", pct(percentile(&dp, f)))?;
        }
        writeln!(out, "Median  Δp: {:6.3}%", pct(median(&dp)))?;
        for (label, f) in [
            ("25.0%", 0.25),
            ("10.0%", 0.1),
            (" 5.0%", 0.05),
            (" 1.0%", 0.01),
            (" 0.1%", 0.001),
        ] {
            writeln!(out, "{label}   Δp: {:6.3}%", pct(percentile(&dp, f)))?;
        }
        writeln!(out, "Minimum Δp: {:6.3}%", pct(dp[0]))?;
        let (mse, mse_unc) = self.mean(self.sum_p_diff2, self.sum_p_diff4);
        let rms = mse.sqrt();
        writeln!(
            out,
            "RMS Δp    : {:6.3} ± {:5.3} %",
            100.0 * rms,
            100.0 * 0.5 / rms * mse_unc
        )?;
        let same = self.n_same_top as f64 / n as f64;
        let same_unc = (same * (1.0 - same) / (n as f64 - 1.0)).sqrt();
        writeln!(
            out,
            "Same top p: {:6.3} ± {:5.3} %",
            100.0 * same,
            100.0 * same_unc
        )
    }
}

/// llama-perplexity's percentile of sorted values: linear between the two nearest.
fn percentile(sorted: &[f32], fraction: f32) -> f32 {
    let p = fraction * (sorted.len() - 1) as f32;
    let i = p as usize;
    let t = p - i as f32;
    (1.0 - t) * sorted[i] + t * sorted[(i + 1).min(sorted.len() - 1)]
}

fn median(sorted: &[f32]) -> f32 {
    let n = sorted.len();
    if n.is_multiple_of(2) {
        0.5 * (sorted[n / 2] + sorted[n / 2 - 1])
    } else {
        sorted[n / 2]
    }
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Compares `model` with the base file at `path` on the base's own tokens and chunks (at most
/// `max_chunks`) and prints the statistics.
pub fn compare(
    args: &ModelArgs,
    model: &Model,
    bos: Option<u32>,
    path: &Path,
    max_chunks: Option<usize>,
) -> Result<()> {
    let (mut r, len) = open_base(path)?;
    let bad = |what: String| anyhow::anyhow!("{}: {what}", path.display());
    let mut magic = [0u8; 8];
    r.read_exact(&mut magic)
        .map_err(|_| bad("too short for a base file".into()))?;
    if &magic != MAGIC {
        bail!(bad(
            "not a base file of --kl-divergence-base (no _logits_ magic)".into()
        ));
    }
    let header =
        (|| Ok::<_, std::io::Error>((read_u32(&mut r)?, read_u32(&mut r)?, read_u32(&mut r)?)))()
            .map_err(|_| bad("truncated header".into()))?;
    let (n_ctx, n_vocab, n_chunk) = (header.0 as usize, header.1 as usize, header.2 as usize);
    let model_vocab = model.plan().n_vocab;
    if n_vocab != model_vocab {
        bail!(bad(format!(
            "saved with a vocabulary of {n_vocab}, this model's has {model_vocab}"
        )));
    }
    if n_ctx < 4 || n_chunk == 0 || header.1 > i32::MAX as u32 || header.2 > i32::MAX as u32 {
        bail!(bad(format!(
            "impossible header: n_ctx {n_ctx}, {n_chunk} chunks"
        )));
    }
    let first = n_ctx / 2;
    let scored = n_ctx - 1 - first;
    let nv = row_len(n_vocab);
    // The whole file's length, computed without overflow, must be what it is.
    let expected = (n_chunk as u64)
        .checked_mul(n_ctx as u64)
        .and_then(|t| t.checked_mul(4))
        .and_then(|t| {
            let rows = (n_chunk as u64)
                .checked_mul(scored as u64)?
                .checked_mul(nv as u64)?;
            t.checked_add(rows.checked_mul(2)?)?.checked_add(20)
        });
    if expected != Some(len) {
        bail!(bad(format!(
            "{len} bytes, but its header (n_ctx {n_ctx}, n_vocab {n_vocab}, {n_chunk} chunks) \
             needs {}",
            expected.map_or("more than can be counted".into(), |e| e.to_string())
        )));
    }
    let mut tokens = vec![0u32; n_chunk * n_ctx];
    for t in tokens.iter_mut() {
        *t = read_u32(&mut r)?;
        if *t as usize >= n_vocab {
            bail!(bad(format!("token {t} is outside the vocabulary")));
        }
    }
    let n = max_chunks.map_or(n_chunk, |m| m.min(n_chunk));
    eprintln!(
        "ferrolm: KL divergence over {n} chunks of {n_ctx} tokens from {}",
        path.display()
    );
    let mut backend = open_backend(args, model, n_ctx, 1)?;
    let bar = TokenBar::new("kl-divergence", n * n_ctx, 0);
    let mut cmp = Comparison::default();
    let mut raw = vec![0u8; scored * nv * 2];
    let mut rows = vec![0u16; scored * nv];
    for c in 0..n {
        r.read_exact(&mut raw)
            .with_context(|| format!("reading {}", path.display()))?;
        for (w, b) in rows.iter_mut().zip(raw.chunks_exact(2)) {
            *w = u16::from_le_bytes([b[0], b[1]]);
        }
        let logits = chunk_logits(backend.as_mut(), &tokens, c, n_ctx, bos)?;
        for i in 0..scored {
            let pos = first + i;
            let row = &logits[pos * n_vocab..(pos + 1) * n_vocab];
            let tok = tokens[c * n_ctx + pos + 1] as usize;
            cmp.add(row, &rows[i * nv..(i + 1) * nv], tok);
        }
        let (kld, same) = cmp.summary();
        bar.note(&format!(
            "ferrolm: chunk {}: mean KLD {kld:.6}, same top {:.3}%\n",
            c + 1,
            100.0 * same
        ));
        bar.advance(n_ctx);
    }
    bar.finish();
    cmp.report(&mut std::io::stdout().lock())?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn saved(logits: &[f32], tok: usize) -> (Vec<u16>, f64) {
        let mut out = Vec::new();
        let mut w = BaseWriter::new(&mut out, logits.len());
        let nll = w.position(logits, tok).unwrap();
        w.finish().unwrap();
        let row = out
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect();
        (row, nll)
    }

    fn softmax(l: &[f32]) -> Vec<f64> {
        let z: f64 = l.iter().map(|&x| f64::from(x).exp()).sum();
        l.iter().map(|&x| f64::from(x).exp() / z).collect()
    }

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!(
            [0.4, 0.5, 1.5, 2.5, 65534.6].map(nearest_int),
            [0, 0, 2, 2, 65535]
        );
    }

    #[test]
    fn a_saved_row_gives_back_the_log_probabilities() {
        let logits: Vec<f32> = (0..101)
            .map(|i| ((i * 37) % 23) as f32 * 0.3 - 2.0)
            .collect();
        let (row, nll) = saved(&logits, 7);
        assert_eq!(row.len(), row_len(101));
        assert_eq!(row_len(101), 106);
        let p = softmax(&logits);
        assert!((nll + p[7].ln()).abs() < 1e-5, "{nll}");
        let f = |w: &[u16]| {
            f32::from_le_bytes([w[0] as u8, (w[0] >> 8) as u8, w[1] as u8, (w[1] >> 8) as u8])
        };
        let (scale, min) = (f(&row[0..2]), f(&row[2..4]));
        for (i, &q) in row[4..105].iter().enumerate() {
            let back = f64::from(scale * f32::from(q) + min);
            assert!(
                (back - p[i].ln()).abs() < 2e-4,
                "{i}: {back} vs {}",
                p[i].ln()
            );
        }
    }

    #[test]
    fn the_comparison_measures_kl_divergence_and_top_tokens() {
        let base: Vec<f32> = (0..64).map(|i| ((i * 13) % 17) as f32 * 0.25).collect();
        let other: Vec<f32> = base
            .iter()
            .enumerate()
            .map(|(i, &l)| l + (i % 5) as f32 * 0.1)
            .collect();
        let (row, _) = saved(&base, 3);
        let mut same = Comparison::default();
        same.add(&base, &row, 3);
        let (kld, top) = same.summary();
        assert!(kld.abs() < 1e-4, "{kld}");
        assert_eq!(top, 1.0);
        let mut cmp = Comparison::default();
        cmp.add(&other, &row, 3);
        let (p, q) = (softmax(&base), softmax(&other));
        let exact: f64 = p.iter().zip(&q).map(|(p, q)| p * (p / q).ln()).sum();
        let (kld, _) = cmp.summary();
        assert!(
            exact > 1e-3 && (kld - exact).abs() < 1e-3 * exact.max(1.0),
            "{kld} vs {exact}"
        );
        let mut shown = Vec::new();
        cmp.report(&mut shown).unwrap();
        let shown = String::from_utf8(shown).unwrap();
        assert!(
            shown.contains("Mean    KLD:") && shown.contains("Same top p:"),
            "{shown}"
        );
    }

    #[test]
    fn percentiles_interpolate_as_llama_perplexity_does() {
        let v = [0.0f32, 1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.5), 2.0);
        assert!((percentile(&v, 0.9) - 3.6).abs() < 1e-6);
        assert_eq!(percentile(&v, 1.0), 4.0);
        assert_eq!(median(&[1.0, 2.0, 3.0, 4.0]), 2.5);
    }
}
