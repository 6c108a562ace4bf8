//! `ferrolm logits`: every position's logits for a list of ids, as little-endian f32.

use std::io::Write;
use std::path::Path;

use anyhow::{Context, Result};
use ferrolm_model::Logits;

use super::common::{open_backend, ModelArgs};
use crate::models;

/// Parses `1,2,3` into ids.
pub fn parse_ids(s: &str) -> Result<Vec<u32>> {
    s.split(',')
        .filter(|p| !p.trim().is_empty())
        .map(|p| {
            p.trim()
                .parse::<u32>()
                .with_context(|| format!("{p:?} is not a token id"))
        })
        .collect()
}

/// Evaluates `ids` as one prompt and writes `n_ids x n_vocab` f32 logits to `out`.
pub fn run(args: &ModelArgs, ids: &[u32], out: &Path, n_ctx: usize) -> Result<()> {
    let path = models::resolve(args.model.as_deref())?;
    let model = args.load_model(&path)?;
    let n_ctx = if n_ctx == 0 { ids.len().max(1) } else { n_ctx };
    let mut backend = open_backend(args, &model, n_ctx, 1)?;
    let logits = ferrolm_engine::eval_one(backend.as_mut(), 0, ids, Logits::All)?;
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(out).with_context(|| format!("creating {}", out.display()))?,
    );
    for v in &logits {
        f.write_all(&v.to_le_bytes())?;
    }
    f.flush()?;
    Ok(())
}
