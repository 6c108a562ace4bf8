//! `ferrolm synth --shape NAME --type TYPE`: a file of a real model's shape with random
//! weights, for speed work where the real file cannot travel.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use ferrolm_model::shapes::{self, FileType, Quantization, Shape};

use super::synth::SynthArgs;

/// Flags that describe a custom architecture and mean nothing with `--shape`.
fn custom_flags_given(a: &SynthArgs) -> bool {
    a.layers.is_some()
        || a.embd.is_some()
        || a.heads.is_some()
        || a.kv_heads.is_some()
        || a.head_dim.is_some()
        || a.ff.is_some()
        || a.experts.is_some()
        || a.experts_used.is_some()
        || a.ctx.is_some()
        || a.rope_base.is_some()
        || a.sliding_window.is_some()
        || a.rope_freqs
        || a.long_rope.is_some()
        || a.tied
        || !a.tensor_types.is_empty()
}

/// Writes the file and prints its size by tensor type.
pub fn run(args: &SynthArgs, shape_name: &str) -> Result<()> {
    if custom_flags_given(args) {
        bail!("--shape takes the real model's hyperparameters: leave out --layers, --embd, --heads, ... and --tensor-type");
    }
    let shape = Shape::named(shape_name)?;
    if args.ty.eq_ignore_ascii_case("mixed") {
        let known: Vec<_> = FileType::ALL.iter().map(|t| t.name()).collect();
        bail!("--shape needs --type, one of {}", known.join(", "));
    }
    let ftype = FileType::parse(&args.ty)?;
    let tokenizer = match &args.tokenizer_from {
        Some(p) => p.clone(),
        None => crate::models::resolve(None).context("the default model lends its tokenizer")?,
    };
    let started = Instant::now();
    let q = Quantization {
        ftype,
        pure: args.pure,
    };
    let written = shapes::write(
        shape,
        q,
        &tokenizer,
        args.seed.unwrap_or(42),
        &args.output,
        args.threads,
    )
    .with_context(|| format!("cannot write {}", args.output.display()))?;
    let mix: Vec<String> = written
        .bytes_by_type
        .iter()
        .map(|(ty, b)| format!("{ty} {:.1} MiB", *b as f64 / (1u64 << 20) as f64))
        .collect();
    eprintln!(
        "ferrolm: wrote {} ({} {}: {} bytes = {:.2} GiB; {}) in {:.1} s",
        args.output.display(),
        shape.name,
        ftype.name(),
        written.file_bytes,
        written.file_bytes as f64 / (1u64 << 30) as f64,
        mix.join(", "),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
