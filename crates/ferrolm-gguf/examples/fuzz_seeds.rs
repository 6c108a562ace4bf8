//! Writes the fuzz corpus seeds: small valid files covering every value type, and the headers
//! of real models when given. `cargo run -p ferrolm-gguf --example fuzz_seeds -- OUT_DIR [MODEL...]`

use ferrolm_gguf::{Array, GgufWriter, TensorType, Value};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = std::path::PathBuf::from(args.next().ok_or("usage: fuzz_seeds OUT_DIR [MODEL...]")?);
    std::fs::create_dir_all(&out)?;

    let mut w = GgufWriter::new();
    std::fs::write(out.join("empty.gguf"), w.to_bytes())?;

    w.set("general.architecture", Value::String("llama".into()))
        .set("llama.block_count", Value::U32(1))
        .set("f", Value::F32(0.5))
        .set("b", Value::Bool(true))
        .set("i64", Value::I64(-5))
        .set(
            "toks",
            Value::Array(Array::String(vec!["a".into(), "<0x0A>".into()])),
        )
        .set("scores", Value::Array(Array::F32(vec![0.0, -1.0])))
        .set(
            "nested",
            Value::Array(Array::Array(vec![Array::U8(vec![1]), Array::U8(vec![])])),
        );
    std::fs::write(out.join("metadata.gguf"), w.to_bytes())?;

    for (i, ty) in [
        TensorType::F32,
        TensorType::Q4_0,
        TensorType::Q4_K,
        TensorType::MXFP4,
    ]
    .into_iter()
    .enumerate()
    {
        let n = ty.block_size() as u64 * 2;
        let bytes = ty.bytes_for(n * 2).expect("small") as usize;
        w.add_tensor(format!("blk.{i}.w"), &[n, 2], ty, vec![i as u8; bytes])?;
    }
    std::fs::write(out.join("tensors.gguf"), w.to_bytes())?;

    let mut v64 = GgufWriter::new();
    v64.set("general.alignment", Value::U32(64));
    v64.add_tensor("t", &[8], TensorType::F16, vec![0; 16])?;
    std::fs::write(out.join("aligned64.gguf"), v64.to_bytes())?;

    // The first 4 KiB of real files: real key layouts, cut inside the vocabulary.
    for model in args {
        let bytes = std::fs::read(&model)?;
        let name = std::path::Path::new(&model)
            .file_stem()
            .unwrap_or_default()
            .to_string_lossy();
        std::fs::write(
            out.join(format!("{name}.head")),
            &bytes[..bytes.len().min(4096)],
        )?;
    }
    Ok(())
}
