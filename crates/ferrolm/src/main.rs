//! `ferrolm`: run GGUF language models.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

mod cmd;
mod hub;
mod models;
mod token_bar;

#[derive(Parser)]
#[command(
    name = "ferrolm",
    version,
    about = "Run GGUF language models on CPUs and NVIDIA GPUs"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of a prompt, streamed to stdout.
    Run(cmd::run::RunArgs),
    /// Chat in the terminal with the model's chat template.
    Chat(cmd::chat::ChatArgs),
    /// Measure prompt processing (pp) and generation (tg) speed, like llama-bench.
    Bench(cmd::bench::BenchArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    Serve(cmd::serve::ServeArgs),
    /// Evaluate ids as one prompt and write every position's logits (f32 LE, n_ids x n_vocab).
    Logits {
        #[command(flatten)]
        model: cmd::common::ModelArgs,
        /// Comma-separated token ids.
        #[arg(long)]
        ids: String,
        /// Output file.
        #[arg(short, long)]
        output: PathBuf,
        /// Context size (0: the number of ids).
        #[arg(short = 'c', long, default_value_t = 0)]
        ctx_size: usize,
    },
    /// Print the ids of a text as a JSON array.
    Tokenize {
        /// A GGUF file or a known model's name (default: the default model).
        #[arg(short, long)]
        model: Option<String>,
        /// Do not add BOS/EOS.
        #[arg(long)]
        no_bos: bool,
        /// Treat special-token text as plain text.
        #[arg(long)]
        no_special: bool,
        /// The text.
        text: String,
    },
    /// Print the text of comma-separated ids.
    Detokenize {
        /// A GGUF file or a known model's name (default: the default model).
        #[arg(short, long)]
        model: Option<String>,
        /// Comma-separated token ids.
        ids: String,
    },
    /// Print a GGUF file's metadata and tensor table.
    Inspect {
        /// A GGUF file, or a known model's name (default: the default model).
        model: Option<String>,
    },
    /// A model's perplexity on a text, as llama-perplexity computes it (chunks of -c tokens,
    /// the second half of each scored); --kl-divergence-base/--kl-divergence compare two models.
    Perplexity(Box<cmd::perplexity::PerplexityArgs>),
    /// Write a GGUF again in another file type, as llama-quantize does (the same bytes).
    Quantize(Box<cmd::quantize::QuantizeArgs>),
    /// Split a GGUF into shards as llama.cpp's gguf-split does (OUT-00001-of-0000N.gguf, ...).
    Split {
        /// The GGUF to split.
        input: PathBuf,
        /// The shards' path without `-00001-of-0000N.gguf`.
        output: PathBuf,
        /// Tensors in each shard at most.
        #[arg(long, default_value_t = 128)]
        max_tensors: usize,
    },
    /// Write a synthetic GGUF (random weights, a real architecture's layout) for parity tests.
    Synth(Box<cmd::synth::SynthArgs>),
    /// Compare the CUDA backend with the CPU on one file: every position's logits (KL,
    /// top-1) and greedy continuations (on a machine with an NVIDIA GPU).
    CudaCheck(cmd::cuda::CheckArgs),
    /// Fetch known models into the cache ($FERROLM_HOME, default ~/.cache/ferrolm), or
    /// models from the Hugging Face Hub into its cache (hf:ORG/REPO[:QUANT|/FILE.gguf]).
    Pull {
        /// Model names (`all` for every known one) or hf: references; default: the default model.
        names: Vec<String>,
    },
}

fn main() -> ExitCode {
    // `ferrolm serve` renders chat templates in copies of itself started this way.
    if std::env::args_os().nth(1).as_deref()
        == Some(std::ffi::OsStr::new(
            ferrolm_server::template_process::WORKER_ARG,
        ))
    {
        return ferrolm_server::template_process::run_worker();
    }
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if is_broken_pipe(&e) => ExitCode::SUCCESS, // `ferrolm inspect | head`
        Err(e) => {
            // One line naming what is wrong, with its causes.
            eprintln!("ferrolm: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Run(args) => cmd::run::run(args),
        Command::Chat(args) => cmd::chat::run(args),
        Command::Bench(args) => cmd::bench::run(args),
        Command::Serve(args) => cmd::serve::run(args),
        Command::Logits {
            model,
            ids,
            output,
            ctx_size,
        } => {
            let ids = cmd::logits::parse_ids(&ids)?;
            cmd::logits::run(&model, &ids, &output, ctx_size)
        }
        Command::Tokenize {
            model,
            no_bos,
            no_special,
            text,
        } => cmd::tokenize::tokenize(model.as_deref(), &text, !no_bos, !no_special),
        Command::Detokenize { model, ids } => {
            cmd::tokenize::detokenize(model.as_deref(), &cmd::logits::parse_ids(&ids)?)
        }
        Command::Inspect { model } => {
            let path: PathBuf = models::resolve(model.as_deref())?;
            let stdout = std::io::stdout();
            cmd::inspect::run(&path, &mut stdout.lock())
        }
        Command::Perplexity(args) => cmd::perplexity::run(*args),
        Command::Quantize(args) => cmd::quantize::run(*args),
        Command::Split {
            input,
            output,
            max_tensors,
        } => {
            let src = ferrolm_gguf::GgufFile::open(&input)?;
            for path in ferrolm_gguf::write_split(&src, &output, max_tensors)? {
                println!("{}", path.display());
            }
            Ok(())
        }
        Command::Synth(args) => cmd::synth::run(*args),
        Command::CudaCheck(args) => cmd::cuda::check(args),
        Command::Pull { names } => {
            let names = if names.is_empty() {
                vec![models::DEFAULT_MODEL.to_string()]
            } else {
                names
            };
            let (refs, names): (Vec<String>, Vec<String>) =
                names.into_iter().partition(|n| hub::is_reference(n));
            for r in refs {
                println!("{}", hub::resolve(&r)?.display());
            }
            let wanted: Vec<&models::KnownModel> = if names.iter().any(|n| n == "all") {
                models::KNOWN_MODELS.iter().collect()
            } else {
                names
                    .iter()
                    .map(|n| models::find(n))
                    .collect::<Result<_>>()?
            };
            for m in wanted {
                let path = models::ensure(m)?;
                println!("{}", path.display());
            }
            Ok(())
        }
    }
}

fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}
