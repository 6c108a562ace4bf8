//! ferrolm as a library: load a GGUF file, put it on the best device present, and stream a
//! greedy continuation of a prompt to stdout.
//!
//! ```sh
//! cargo run --release -p ferrolm --example generate -- MODEL.gguf "The capital of France is"
//! ```

use std::io::Write;

use anyhow::{bail, Result};
use ferrolm::{BackendOptions, GenerateParams, LoadedModel, SamplerParams};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(path), Some(prompt)) = (args.next(), args.next()) else {
        bail!("usage: generate MODEL.gguf PROMPT");
    };
    let model = LoadedModel::open(&path, &Default::default())?;
    // The default device: CUDA device 0 when one is present, the CPU otherwise.
    let mut backend = model.backend(&BackendOptions::default())?;
    eprintln!("running on {}", backend.describe());
    let params = GenerateParams {
        max_tokens: 32,
        sampler: SamplerParams::greedy(),
        stop_at_eog: true,
    };
    let mut stdout = std::io::stdout();
    for piece in model.stream(backend.as_mut(), &prompt, &params)? {
        stdout.write_all(piece?.as_bytes())?;
        stdout.flush()?;
    }
    writeln!(stdout)?;
    Ok(())
}
