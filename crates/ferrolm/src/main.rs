//! `ferrolm`: run GGUF language models.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Parser, Subcommand};

mod cmd;
mod models;

#[derive(Parser)]
#[command(name = "ferrolm", version, about = "Run GGUF language models on CPUs and NVIDIA GPUs")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Print a GGUF file's metadata and tensor table.
    Inspect {
        /// A GGUF file, or a known model's name (default: the default model).
        model: Option<String>,
    },
    /// Fetch known models into the cache ($FERROLM_HOME, default ~/.cache/ferrolm).
    Pull {
        /// Model names (`all` for every known one); default: the default model.
        names: Vec<String>,
    },
}

fn main() -> ExitCode {
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
        Command::Inspect { model } => {
            let path: PathBuf = models::resolve(model.as_deref())?;
            let stdout = std::io::stdout();
            cmd::inspect::run(&path, &mut stdout.lock())
        }
        Command::Pull { names } => {
            let names = if names.is_empty() { vec![models::DEFAULT_MODEL.to_string()] } else { names };
            let wanted: Vec<&models::KnownModel> = if names.iter().any(|n| n == "all") {
                models::KNOWN_MODELS.iter().collect()
            } else {
                names.iter().map(|n| models::find(n)).collect::<Result<_>>()?
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
