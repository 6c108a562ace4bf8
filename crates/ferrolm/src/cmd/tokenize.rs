//! `ferrolm tokenize` and `ferrolm detokenize`.

use std::io::Write;

use anyhow::Result;
use ferrolm_gguf::GgufFile;
use ferrolm_tokenizer::Tokenizer;

use crate::models;

fn tokenizer(model: Option<&str>) -> Result<Tokenizer> {
    let path = models::resolve(model)?;
    let file = GgufFile::open(&path)?;
    Ok(Tokenizer::from_metadata(file.metadata())?)
}

/// Prints the ids of `text` as a JSON array.
pub fn tokenize(model: Option<&str>, text: &str, bos: bool, special: bool) -> Result<()> {
    let ids = tokenizer(model)?.encode(text, bos, special);
    println!("{}", serde_json::to_string(&ids)?);
    Ok(())
}

/// Prints the text of `ids`.
pub fn detokenize(model: Option<&str>, ids: &[u32]) -> Result<()> {
    let text = tokenizer(model)?.decode_bytes(ids, true)?;
    let mut out = std::io::stdout().lock();
    out.write_all(&text)?;
    writeln!(out)?;
    Ok(())
}
