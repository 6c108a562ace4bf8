//! `ferrolm inspect`: a GGUF file's metadata and tensor table, like gguf-dump.

use std::io::Write;
use std::path::Path;

use anyhow::Result;
use ferrolm_gguf::GgufFile;

/// Prints the metadata (long arrays summarized) and the tensor table of the file at `path`.
pub fn run(path: &Path, out: &mut impl Write) -> Result<()> {
    let f = GgufFile::open(path)?;
    writeln!(
        out,
        "{}: GGUF v{}, alignment {}",
        path.display(),
        f.version(),
        f.alignment()
    )?;
    if f.shards().len() > 1 {
        writeln!(out, "\n{} shards:", f.shards().len())?;
        for (k, s) in f.shards().iter().enumerate() {
            let name = s
                .path
                .as_ref()
                .map_or_else(String::new, |p| p.display().to_string());
            writeln!(
                out,
                "  {:>5}  {:>4} tensors {:>14} bytes  {name}",
                k + 1,
                s.n_tensors,
                s.file_len
            )?;
        }
    }
    writeln!(out, "\n{} metadata keys:", f.metadata().len())?;
    for (key, value) in f.metadata().iter() {
        let mut shown = value.to_string();
        // Chat templates and the like are long; one line each keeps the table readable.
        if shown.len() > 160 {
            let cut = (0..=157)
                .rev()
                .find(|&i| shown.is_char_boundary(i))
                .unwrap_or(0);
            shown = format!("{}... ({} bytes)", &shown[..cut], shown.len());
        }
        writeln!(out, "  {key:<44} {:<16} {shown}", value.type_description())?;
    }
    let total: u64 = f.tensors().iter().map(|t| t.size).sum();
    writeln!(
        out,
        "\n{} tensors, {} bytes of data:",
        f.tensors().len(),
        total
    )?;
    writeln!(
        out,
        "  {:<40} {:<8} {:<24} {:>12}",
        "name", "type", "shape", "bytes"
    )?;
    for t in f.tensors() {
        let shape: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
        writeln!(
            out,
            "  {:<40} {:<8} {:<24} {:>12}",
            t.name,
            t.ty,
            shape.join(" x "),
            t.size
        )?;
    }
    Ok(())
}
