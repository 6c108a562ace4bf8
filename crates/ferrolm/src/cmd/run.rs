//! `ferrolm run`: one prompt, its continuation streamed to stdout, timings to stderr.

use std::io::Write;

use anyhow::{bail, Result};
use clap::Args;
use ferrolm_engine::{generate_observed, GenerateParams};
use ferrolm_tokenizer::{ChatMessage, ChatTemplate};

use super::common::{context_size, load_any_device, open_backend, ModelArgs, SamplingArgs};
use crate::token_bar::TokenBar;

/// Flags of `ferrolm run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// The prompt (or give it with -p).
    pub prompt: Option<String>,
    /// The prompt.
    #[arg(short = 'p', long = "prompt")]
    pub prompt_flag: Option<String>,
    /// Tokens to generate at most.
    #[arg(short = 'n', long, default_value_t = 256)]
    pub n_predict: usize,
    /// Context size (0: the model's, at most 4096).
    #[arg(short = 'c', long, default_value_t = 0)]
    pub ctx_size: usize,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object at the end instead of streaming.
    #[arg(long)]
    pub json: bool,
    /// Keep the end of a prompt longer than the context instead of failing.
    #[arg(long)]
    pub truncate: bool,
    /// At the end, print how many times each expert of each mixture-of-experts layer was
    /// selected (to stderr; in the JSON object as `expert_counts` with --json).
    #[arg(long)]
    pub expert_stats: bool,
}

pub fn run(args: RunArgs) -> Result<()> {
    let prompt = match (&args.prompt, &args.prompt_flag) {
        (Some(p), None) | (None, Some(p)) => p.clone(),
        (Some(_), Some(_)) => bail!("give the prompt either as an argument or with -p, not both"),
        (None, None) => bail!("no prompt: ferrolm run \"your prompt\""),
    };
    let (model, tokenizer) = load_any_device(&args.model)?;
    let text = if args.chat {
        let template = ChatTemplate::for_tokenizer(&tokenizer)?;
        if let Some(w) = template.warning() {
            eprintln!("ferrolm: warning: {w}");
        }
        template.render(&[ChatMessage::new("user", &prompt)], true, None)?
    } else {
        prompt
    };
    let mut ids = tokenizer.encode_prompt(&text);
    let n_ctx = context_size(&model, args.ctx_size);
    if ids.len() >= n_ctx {
        if !args.truncate {
            bail!(
                "the prompt has {} tokens but the context holds {n_ctx}; use a larger --ctx-size or --truncate",
                ids.len()
            );
        }
        let keep = n_ctx / 2;
        eprintln!(
            "ferrolm: prompt truncated from {} to its last {keep} tokens",
            ids.len()
        );
        ids.drain(..ids.len() - keep);
    }
    let mut backend = open_backend(&args.model, &model, n_ctx, 1)?;
    if args.expert_stats && backend.expert_counts().is_none() {
        bail!("--expert-stats: nothing counts the experts' routing here (a dense model, or --gpu-layers)");
    }
    let params = GenerateParams {
        max_tokens: args.n_predict,
        sampler: args.sampling.params(),
        stop_at_eog: true,
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let on_text = |piece: &str| {
        if !args.json {
            // A closed stdout (`| head`) ends the generation.
            return out
                .write_all(piece.as_bytes())
                .and_then(|_| out.flush())
                .is_ok();
        }
        true
    };
    // A bar over a long prompt, on a terminal.
    let bar = TokenBar::new("prompt", ids.len(), 1024);
    let gen = generate_observed(
        backend.as_mut(),
        0,
        &tokenizer,
        &ids,
        &params,
        &mut |done| bar.set_position(done),
        on_text,
    );
    bar.finish();
    let gen = gen?;
    if args.json {
        let v = serde_json::json!({
            "prompt_tokens": ids,
            "tokens": gen.tokens,
            "text": gen.text,
            "finish_reason": match gen.finish { ferrolm_engine::FinishReason::Stop => "stop", ferrolm_engine::FinishReason::Length => "length" },
            "pp_tokens_per_s": gen.pp_tokens_per_s(),
            "tg_tokens_per_s": gen.tg_tokens_per_s(),
        });
        let mut v = v;
        if args.expert_stats {
            v["expert_counts"] = serde_json::json!(backend.expert_counts().unwrap_or_default());
            if let Some(st) = model.expert_cache_stats() {
                v["expert_cache"] = super::telemetry::expert_cache_json(&st);
            }
            if let Some(st) = backend.expert_tier_stats() {
                v["expert_tiers"] = super::telemetry::expert_tier_json(&st);
            }
        }
        writeln!(out, "{v}")?;
    } else {
        writeln!(out)?;
    }
    if args.expert_stats {
        eprint!(
            "{}",
            expert_stats(&backend.expert_counts().unwrap_or_default())
        );
        if let Some(st) = model.expert_cache_stats() {
            eprintln!("{}", super::telemetry::expert_cache_line(&st));
        }
        if let Some(st) = backend.expert_tier_stats() {
            eprintln!("{}", super::telemetry::expert_tier_line(&st));
        }
    }
    eprintln!(
        "ferrolm: prompt {} tokens in {:.3} s ({:.1} tok/s), generated {} tokens in {:.3} s ({:.1} tok/s), {}",
        gen.prompt_evaluated,
        gen.prompt_time.as_secs_f64(),
        gen.pp_tokens_per_s(),
        gen.tokens.len(),
        gen.gen_time.as_secs_f64(),
        gen.tg_tokens_per_s(),
        match backend.describe().as_str() {
            "CPU" => format!("{} threads", model.threads()),
            other => other.to_string(),
        },
    );
    Ok(())
}

/// Experts listed per layer by [`expert_stats`] (the most chosen; `--json` has them all).
const LISTED_EXPERTS: usize = 16;

/// Per mixture-of-experts layer, one line: how many experts were chosen at all, and the most
/// chosen ones' selections and share of them, most first.
pub fn expert_stats(counts: &[Vec<u64>]) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    if counts.iter().all(Vec::is_empty) {
        s.push_str("ferrolm: expert stats: the model has no mixture-of-experts layers\n");
        return s;
    }
    for (l, layer) in counts.iter().enumerate() {
        if layer.is_empty() {
            continue;
        }
        let total: u64 = layer.iter().sum();
        let mut chosen: Vec<usize> = (0..layer.len()).filter(|&e| layer[e] > 0).collect();
        chosen.sort_by(|&a, &b| layer[b].cmp(&layer[a]).then(a.cmp(&b)));
        let _ = write!(
            s,
            "ferrolm: experts of layer {l:3} ({total} selections, {} of {} experts chosen):",
            chosen.len(),
            layer.len()
        );
        for &e in chosen.iter().take(LISTED_EXPERTS) {
            let c = layer[e];
            let share = 100.0 * c as f64 / total as f64;
            let _ = write!(s, " {e}={c} ({share:.1}%)");
        }
        if chosen.len() > LISTED_EXPERTS {
            let _ = write!(s, " and {} more", chosen.len() - LISTED_EXPERTS);
        }
        s.push('\n');
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expert_stats_list_the_most_chosen_first_and_count_the_rest() {
        let mut wide = vec![0u64; 40];
        for (e, c) in wide.iter_mut().enumerate().skip(2) {
            *c = (e % 5) as u64 + 1;
        }
        let s = expert_stats(&[vec![], vec![0, 3, 0, 5], wide]);
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines.len(), 2, "{s}");
        assert!(
            lines[0].ends_with("(8 selections, 2 of 4 experts chosen): 3=5 (62.5%) 1=3 (37.5%)"),
            "{s}"
        );
        // 38 chosen: the 16 most (the fives first, by index), then how many more.
        assert!(lines[1].contains("38 of 40 experts chosen): 4=5 "), "{s}");
        assert!(lines[1].ends_with(" and 22 more"), "{s}");
        assert_eq!(lines[1].matches('%').count(), 16, "{s}");
        assert!(expert_stats(&[vec![], vec![]]).contains("no mixture-of-experts layers"));
    }
}
