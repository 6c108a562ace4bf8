//! `ferrolm chat`: a multi-turn conversation in the terminal, keeping the KV cache between turns.

use std::io::{BufRead, Write};

use anyhow::Result;
use clap::Args;
use ferrolm_engine::{generate_observed, GenerateParams};
use ferrolm_tokenizer::{ChatMessage, ChatTemplate};

use super::common::{context_size, load_any_device, open_backend, ModelArgs, SamplingArgs};
use crate::token_bar::TokenBar;

/// Flags of `ferrolm chat`.
#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// A system message.
    #[arg(long)]
    pub system: Option<String>,
    /// Tokens per reply at most.
    #[arg(short = 'n', long, default_value_t = 512)]
    pub n_predict: usize,
    /// Context size (0: the model's, at most 4096).
    #[arg(short = 'c', long, default_value_t = 0)]
    pub ctx_size: usize,
}

/// Where the conversation's cache lives: a CPU session or the GPU.
pub fn run(args: ChatArgs) -> Result<()> {
    let (model, tokenizer) = load_any_device(&args.model)?;
    let n_ctx = context_size(&model, args.ctx_size);
    let mut backend = open_backend(&args.model, &model, n_ctx, 1)?;
    let template = ChatTemplate::for_tokenizer(&tokenizer)?;
    if let Some(w) = template.warning() {
        eprintln!("ferrolm: warning: {w}");
    }
    let mut messages: Vec<ChatMessage> = args
        .system
        .iter()
        .map(|s| ChatMessage::new("system", s))
        .collect();
    // The ids whose keys and values the session holds.
    let mut cached: Vec<u32> = Vec::new();
    let params = GenerateParams {
        max_tokens: args.n_predict,
        sampler: args.sampling.params(),
        stop_at_eog: true,
    };
    eprintln!("ferrolm chat: type a message and press Enter; an empty line or Ctrl-D ends.");
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    loop {
        eprint!("> ");
        let Some(line) = lines.next().transpose()? else {
            break;
        };
        let line = line.trim_end().to_string();
        if line.is_empty() {
            break;
        }
        messages.push(ChatMessage::new("user", line));
        let ids = tokenizer.encode_prompt(&template.render(&messages, true, None)?);
        // Reuse the cache up to the first id that differs; evaluate only the rest.
        let common = cached.iter().zip(&ids).take_while(|(a, b)| a == b).count();
        let common = common.min(ids.len() - 1);
        // (A sliding-window model's ring may not reach back that far: it then starts over.)
        let common = backend.truncate(0, common)?;
        cached.truncate(common);
        if ids.len() + 1 >= n_ctx {
            eprintln!("ferrolm: the conversation no longer fits the context of {n_ctx} tokens; start a new chat or use a larger --ctx-size");
            break;
        }
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        // A bar over a long new prompt, on a terminal.
        let bar = TokenBar::new("prompt", ids.len() - common, 1024);
        let gen = generate_observed(
            backend.as_mut(),
            0,
            &tokenizer,
            &ids[common..],
            &params,
            &mut |done| bar.set_position(done),
            |piece| {
                out.write_all(piece.as_bytes())
                    .and_then(|_| out.flush())
                    .is_ok()
            },
        );
        bar.finish();
        let gen = gen?;
        writeln!(out)?;
        cached.extend_from_slice(&ids[common..]);
        cached.extend_from_slice(&gen.tokens);
        cached.truncate(backend.position(0));
        messages.push(ChatMessage::new("assistant", gen.text.trim()));
        eprintln!(
            "[{} new prompt tokens at {:.1} tok/s, {} generated at {:.1} tok/s, {} of {n_ctx} context used]",
            gen.prompt_evaluated,
            gen.pp_tokens_per_s(),
            gen.tokens.len(),
            gen.tg_tokens_per_s(),
            backend.position(0)
        );
    }
    Ok(())
}
