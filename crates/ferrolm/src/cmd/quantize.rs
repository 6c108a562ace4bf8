//! `ferrolm quantize IN OUT TYPE`: a GGUF written again in another file type, with
//! llama-quantize's choices, so that its output is the same file byte for byte: the same
//! tensors quantized (matrices whose names end in `weight`, norms and a few small tables kept),
//! the same per-tensor types (the mix rules of `ferrolm_model::shapes::mix`, which `synth
//! --shape` uses too), the same tensor order (by layer, then name), the same metadata (split keys
//! dropped, `general.quantization_version` and `general.file_type` set last) and ggml's
//! reference quantizers. It streams: tensor by tensor, a slab of rows at a time, on every core.

use std::io::{BufWriter, IsTerminal, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm_gguf::{GgufFile, GgufWriter, TensorInfo, TensorLayout, TensorType, Value};
use ferrolm_model::shapes::mix::{matrix_type, Role};
use ferrolm_model::shapes::FileType;

use crate::models;

/// `ferrolm quantize`'s arguments.
#[derive(Args, Debug)]
pub struct QuantizeArgs {
    /// The GGUF to quantize (a path, a first shard, a known model's name or an hf: reference).
    pub input: String,
    /// The file to write.
    pub output: PathBuf,
    /// The file type: f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k_m (or q4_k), q6_k.
    pub ty: String,
    /// Every quantized matrix in the base type (llama-quantize's --pure), save width fallbacks.
    #[arg(long)]
    pub pure: bool,
    /// Quantize tensors that are already quantized (llama-quantize's --allow-requantize).
    #[arg(long)]
    pub allow_requantize: bool,
    /// Threads (0: every core).
    #[arg(short, long, default_value_t = 0)]
    pub threads: usize,
}

/// What a file is quantized to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Target {
    /// A llama-quantize file type with its mix rules.
    Mix(FileType),
    /// Every quantizable matrix BF16.
    Bf16,
}

impl Target {
    fn parse(name: &str) -> Result<Target> {
        if name.eq_ignore_ascii_case("bf16") {
            return Ok(Target::Bf16);
        }
        // llama-quantize's alias.
        if name.eq_ignore_ascii_case("q4_k") {
            return Ok(Target::Mix(FileType::Q4KM));
        }
        FileType::parse(name).map(Target::Mix).map_err(|_| {
            let known: Vec<&str> = FileType::ALL.iter().map(|t| t.name()).collect();
            anyhow::anyhow!(
                "unknown file type {name:?}; known: {}, bf16 (and q4_k for q4_k_m)",
                known.join(", ")
            )
        })
    }

    /// `general.file_type` (llama.cpp's `llama_ftype`).
    fn ftype(self) -> u32 {
        match self {
            Target::Mix(f) => f.gguf_id(),
            Target::Bf16 => 32,
        }
    }
}

/// llama.cpp's `GGML_QNT_VERSION`, written as `general.quantization_version`.
const QUANTIZATION_VERSION: u32 = 2;

/// Parts of names whose tensors llama-quantize never quantizes (small tables, routers,
/// convolutions, positions).
const KEPT: &[&str] = &[
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_first.weight",
    "time_mix_w0.weight",
    "time_mix_w1.weight",
    "time_mix_w2.weight",
    "time_mix_v0.weight",
    "time_mix_v1.weight",
    "time_mix_v2.weight",
    "time_mix_a0.weight",
    "time_mix_a1.weight",
    "time_mix_a2.weight",
    "time_mix_g1.weight",
    "time_mix_g2.weight",
    "time_mix_decay_w1.weight",
    "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
];

/// The dimensions as ggml counts them: trailing ones dropped, at least one kept.
fn ggml_dims(dims: &[u64]) -> Vec<u64> {
    let n = dims.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
    dims[..n.min(dims.len()).max(1)].to_vec()
}

/// Whether llama-quantize quantizes the tensor `name` of `n_dims` dimensions.
fn allows_quantization(name: &str, n_dims: usize) -> bool {
    n_dims >= 2
        && name.ends_with("weight")
        && !matches!(name, "position_embd.weight" | "token_types.weight")
        && !KEPT.iter().any(|k| name.contains(k))
}

/// The layer of a `blk.N.` tensor (-1 for the others), as llama.cpp's loader orders them.
fn layer_of(name: &str) -> i64 {
    name.strip_prefix("blk.")
        .and_then(|r| r.split('.').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(-1)
}

/// What Q4_K_M's rules here do not mirror yet: llama-quantize gives a fused `attn_qkv` Q5_K and
/// treats expert models' matrices by their own rules; such files are refused rather than
/// written with other types than llama-quantize's.
fn check_mirrored(file: &GgufFile, target: Target, pure: bool) -> Result<()> {
    if target != Target::Mix(FileType::Q4KM) || pure {
        return Ok(());
    }
    if let Some(t) = file.tensors().iter().find(|t| t.name.contains("attn_qkv")) {
        bail!(
            "q4_k_m: {:?} is a fused QKV matrix, which llama-quantize makes Q5_K; ferrolm has no              Q5_K quantizer yet (--pure makes every matrix Q4_K)",
            t.name
        );
    }
    let arch = file
        .metadata()
        .opt_str("general.architecture")?
        .unwrap_or("");
    if file
        .metadata()
        .opt_u32(&format!("{arch}.expert_count"))?
        .unwrap_or(0)
        > 0
    {
        bail!("q4_k_m: llama-quantize's rules for expert models are not mirrored yet (--pure is)");
    }
    Ok(())
}

/// The type each tensor of `file` gets, in the order they are written.
fn plan(file: &GgufFile, target: Target, pure: bool) -> Vec<(&TensorInfo, TensorType)> {
    let mut tensors: Vec<&TensorInfo> = file.tensors().iter().collect();
    tensors.sort_by(|a, b| {
        (layer_of(&a.name), a.name.as_bytes()).cmp(&(layer_of(&b.name), b.name.as_bytes()))
    });
    let has_output = file.tensor("output.weight").is_some();
    let count = |part: &str| tensors.iter().filter(|t| t.name.contains(part)).count();
    let (n_attn_v, n_ffn_down) = (count("attn_v.weight"), count("ffn_down"));
    tensors
        .into_iter()
        .map(|t| {
            let dims = ggml_dims(&t.dims);
            if !allows_quantization(&t.name, dims.len()) {
                return (t, t.ty);
            }
            let ty = match target {
                Target::Bf16 => TensorType::BF16,
                Target::Mix(ft) => {
                    let (role, n) = match t.name.as_str() {
                        "output.weight" => (Role::Output, 0),
                        "token_embd.weight" => (Role::TokenEmbd { tied: !has_output }, 0),
                        n if n.contains("attn_v.weight") => (Role::AttnV, n_attn_v),
                        n if n.contains("ffn_down") => (Role::FfnDown, n_ffn_down),
                        _ => (Role::Other, 0),
                    };
                    let layer = layer_of(&t.name).max(0) as usize;
                    matrix_type(ft, role, layer, n, t.row_len() as usize, pure)
                }
            };
            (t, ty)
        })
        .collect()
}

/// The output's metadata: the input's, split keys dropped, the version and file type last.
fn metadata(file: &GgufFile, target: Target) -> GgufWriter {
    let mut w = GgufWriter::new();
    for (key, value) in file.metadata().iter() {
        let moved = matches!(key, "general.quantization_version" | "general.file_type");
        if !moved && !key.starts_with("split.") {
            w.set(key, value.clone());
        }
    }
    w.set(
        "general.quantization_version",
        Value::U32(QUANTIZATION_VERSION),
    );
    w.set("general.file_type", Value::U32(target.ftype()));
    w
}

/// Rows converted at a time: about 64 MiB of f32.
const SLAB_VALUES: usize = 16 << 20;

/// Converts `rows` rows of `row_len` values from `src` (of `from`) into `dst` (of `to`), the
/// rows split over `threads` threads.
fn convert(
    (from, src): (TensorType, &[u8]),
    (to, dst): (TensorType, &mut [u8]),
    rows: usize,
    row_len: usize,
    threads: usize,
) -> Result<()> {
    let per = rows.div_ceil(threads.max(1)).max(1);
    let (src_row, dst_row) = (src.len() / rows, dst.len() / rows);
    std::thread::scope(|s| {
        let jobs: Vec<_> = src
            .chunks(per * src_row)
            .zip(dst.chunks_mut(per * dst_row))
            .map(|(src, dst)| {
                s.spawn(move || -> Result<()> {
                    let mut values = vec![0f32; src.len() / src_row * row_len];
                    ferrolm_quant::dequantize(from, src, &mut values)?;
                    ferrolm_quant::quantize(to, &values, dst)?;
                    Ok(())
                })
            })
            .collect();
        jobs.into_iter()
            .try_for_each(|j| j.join().expect("a quantizing thread panicked"))
    })
}

/// Runs `ferrolm quantize`.
pub fn run(args: QuantizeArgs) -> Result<()> {
    let target = Target::parse(&args.ty)?;
    let input = models::resolve(Some(&args.input))?;
    let file = GgufFile::open(&input)?;
    check_mirrored(&file, target, args.pure)?;
    let planned = plan(&file, target, args.pure);
    for (t, ty) in &planned {
        if *ty != t.ty {
            let quantized = !matches!(t.ty, TensorType::F32 | TensorType::F16 | TensorType::BF16);
            if quantized && !args.allow_requantize {
                bail!(
                    "tensor {:?} is already {}; --allow-requantize quantizes it again (what \
                     the first quantization lost stays lost)",
                    t.name,
                    t.ty
                );
            }
        }
    }
    let writer = metadata(&file, target);
    let layouts: Vec<TensorLayout> = planned
        .iter()
        .map(|(t, ty)| TensorLayout {
            name: t.name.clone(),
            dims: ggml_dims(&t.dims),
            ty: *ty,
        })
        .collect();
    let header = writer.header(&layouts)?;
    let threads = match args.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    // Written under a temporary name, renamed when complete.
    let part = args.output.with_extension("gguf.part");
    let mut out = BufWriter::new(
        std::fs::File::create(&part).with_context(|| format!("creating {}", part.display()))?,
    );
    let bar = progress(planned.iter().map(|(t, _)| t.size).sum());
    let written = (|| -> Result<()> {
        out.write_all(&header.bytes)?;
        let mut at = header.bytes.len() as u64;
        for ((t, ty), &offset) in planned.iter().zip(&header.offsets) {
            out.write_all(&vec![0u8; (offset - at) as usize])?;
            let size = write_tensor(&file, t, *ty, threads, &mut out)
                .with_context(|| format!("tensor {:?} ({} to {ty})", t.name, t.ty))?;
            at = offset + size;
            if let Some(b) = &bar {
                b.inc(t.size);
            }
        }
        out.write_all(&vec![0u8; (header.file_len - at) as usize])?;
        out.flush()?;
        Ok(())
    })();
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if let Err(e) = written {
        let _ = std::fs::remove_file(&part);
        return Err(e.context(format!("writing {}", args.output.display())));
    }
    std::fs::rename(&part, &args.output)
        .with_context(|| format!("moving {} to {}", part.display(), args.output.display()))?;
    summarize(&args.output, &planned, header.file_len);
    Ok(())
}

/// Writes tensor `t` converted to `ty`; returns the bytes written.
fn write_tensor(
    file: &GgufFile,
    t: &TensorInfo,
    ty: TensorType,
    threads: usize,
    out: &mut impl Write,
) -> Result<u64> {
    let data = file.tensor_data(t);
    if ty == t.ty {
        out.write_all(data)?;
        return Ok(t.size);
    }
    let row_len = t.row_len() as usize;
    let rows = t.n_rows() as usize;
    let src_row = data.len() / rows.max(1);
    let dst_row = ty.bytes_for(row_len as u64).context("row size overflows")? as usize;
    let slab = (SLAB_VALUES / row_len.max(1)).max(1);
    let mut buf = vec![0u8; slab.min(rows) * dst_row];
    for r0 in (0..rows).step_by(slab) {
        let n = slab.min(rows - r0);
        let dst = &mut buf[..n * dst_row];
        let src = &data[r0 * src_row..(r0 + n) * src_row];
        convert((t.ty, src), (ty, dst), n, row_len, threads)?;
        out.write_all(dst)?;
    }
    Ok((rows * dst_row) as u64)
}

/// A bar over the input's tensor bytes, on a terminal.
fn progress(total: u64) -> Option<indicatif::ProgressBar> {
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let bar = indicatif::ProgressBar::new(total);
    let style = indicatif::ProgressStyle::with_template(
        "quantizing [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
    )
    .expect("a valid template")
    .progress_chars("=> ");
    bar.set_style(style);
    Some(bar)
}

/// One line on stderr: the file, its size, how many tensors of each type.
fn summarize(path: &Path, planned: &[(&TensorInfo, TensorType)], bytes: u64) {
    let mut counts: Vec<(TensorType, usize)> = Vec::new();
    for (_, ty) in planned {
        match counts.iter_mut().find(|(t, _)| t == ty) {
            Some((_, n)) => *n += 1,
            None => counts.push((*ty, 1)),
        }
    }
    let mix: Vec<String> = counts.iter().map(|(t, n)| format!("{n} {t}")).collect();
    eprintln!(
        "ferrolm: wrote {} ({:.1} MB): {}",
        path.display(),
        bytes as f64 / 1e6,
        mix.join(", ")
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tensors_llama_quantize_quantizes() {
        assert!(allows_quantization("blk.0.attn_q.weight", 2));
        assert!(allows_quantization("token_embd.weight", 2));
        assert!(!allows_quantization("blk.0.attn_norm.weight", 1));
        assert!(!allows_quantization("blk.0.attn_norm.weight", 2));
        assert!(!allows_quantization("blk.0.ffn_gate_inp.weight", 2));
        assert!(!allows_quantization("blk.0.attn_q.bias", 2));
        assert!(!allows_quantization("position_embd.weight", 2));
        assert_eq!(ggml_dims(&[576, 1]), [576]);
        assert_eq!(ggml_dims(&[1, 1]), [1]);
        assert_eq!(ggml_dims(&[4, 1, 3]), [4, 1, 3]);
    }

    #[test]
    fn file_types_parse_with_llama_quantize_s_names() {
        assert_eq!(Target::parse("Q4_K").unwrap(), Target::Mix(FileType::Q4KM));
        assert_eq!(Target::parse("bf16").unwrap().ftype(), 32);
        assert_eq!(Target::parse("q8_0").unwrap().ftype(), 7);
        let e = Target::parse("q3_k_m").unwrap_err().to_string();
        assert!(e.contains("q4_k_m") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn tensors_are_ordered_by_layer_then_name() {
        let mut names = vec![
            "blk.10.a",
            "output.weight",
            "blk.2.b",
            "blk.2.a",
            "token_embd.weight",
        ];
        names.sort_by(|a, b| (layer_of(a), a.as_bytes()).cmp(&(layer_of(b), b.as_bytes())));
        assert_eq!(
            names,
            [
                "output.weight",
                "token_embd.weight",
                "blk.2.a",
                "blk.2.b",
                "blk.10.a"
            ]
        );
    }
}
