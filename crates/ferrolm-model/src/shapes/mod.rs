//! Synthetic files of real models' shapes (`ferrolm synth --shape`): the hyperparameters,
//! metadata and tensor table of SmolLM2, Llama 3.x and Qwen 2.5, random weights written
//! block by block on every core, and `llama-quantize`'s per-tensor type mix ([`mix`]), so
//! that an 8B file is written in seconds and weighs what the real one does. For speed work
//! on machines a real file cannot reach; parity with llama.cpp holds on these files like on
//! any other.

pub mod blocks;
pub mod mix;

use std::io::{Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use ferrolm_gguf::{Array, GgufFile, GgufWriter, TensorLayout, TensorType, Value};

use crate::error::{ModelError, Result};
use blocks::{Values, Wyrand};
pub use mix::{FileType, Role};

/// Llama 3's RoPE scaling, which files carry as per-dimension factors (`rope_freqs.weight`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Rope {
    /// `factor`: how much the slowest dimensions are slowed.
    pub factor: f64,
    /// `low_freq_factor`.
    pub low_freq_factor: f64,
    /// `high_freq_factor`.
    pub high_freq_factor: f64,
    /// `original_max_position_embeddings`.
    pub original_context: f64,
}

/// A real model's hyperparameters (from its `config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// The name on the command line.
    pub name: &'static str,
    /// `general.architecture`.
    pub arch: &'static str,
    /// Layers.
    pub n_layer: usize,
    /// Width of the residual stream.
    pub n_embd: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads.
    pub n_head_kv: usize,
    /// Feed-forward hidden size.
    pub n_ff: usize,
    /// Vocabulary size (the borrowed tokenizer is padded to it).
    pub n_vocab: usize,
    /// `context_length`.
    pub n_ctx: usize,
    /// `rope.freq_base`.
    pub rope_base: f32,
    /// `attention.layer_norm_rms_epsilon`.
    pub norm_eps: f32,
    /// The embedding doubles as output matrix.
    pub tied_output: bool,
    /// Q, K and V carry biases (Qwen 2).
    pub qkv_bias: bool,
    /// Llama 3.x frequency factors.
    pub llama3_rope: Option<Llama3Rope>,
}

const LLAMA31_ROPE: Llama3Rope = Llama3Rope {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_context: 8192.0,
};

/// The shapes `ferrolm synth --shape` knows.
pub const SHAPES: &[Shape] = &[
    Shape {
        name: "smollm2-135m",
        arch: "llama",
        n_layer: 30,
        n_embd: 576,
        n_head: 9,
        n_head_kv: 3,
        n_ff: 1536,
        n_vocab: 49152,
        n_ctx: 8192,
        rope_base: 100_000.0,
        norm_eps: 1e-5,
        tied_output: true,
        qkv_bias: false,
        llama3_rope: None,
    },
    Shape {
        name: "llama-3.2-1b",
        arch: "llama",
        n_layer: 16,
        n_embd: 2048,
        n_head: 32,
        n_head_kv: 8,
        n_ff: 8192,
        n_vocab: 128_256,
        n_ctx: 131_072,
        rope_base: 500_000.0,
        norm_eps: 1e-5,
        tied_output: true,
        qkv_bias: false,
        llama3_rope: Some(Llama3Rope {
            factor: 32.0,
            ..LLAMA31_ROPE
        }),
    },
    Shape {
        name: "llama-3.1-8b",
        arch: "llama",
        n_layer: 32,
        n_embd: 4096,
        n_head: 32,
        n_head_kv: 8,
        n_ff: 14336,
        n_vocab: 128_256,
        n_ctx: 131_072,
        rope_base: 500_000.0,
        norm_eps: 1e-5,
        tied_output: false,
        qkv_bias: false,
        llama3_rope: Some(LLAMA31_ROPE),
    },
    Shape {
        name: "qwen2.5-0.5b",
        arch: "qwen2",
        n_layer: 24,
        n_embd: 896,
        n_head: 14,
        n_head_kv: 2,
        n_ff: 4864,
        n_vocab: 151_936,
        n_ctx: 32768,
        rope_base: 1_000_000.0,
        norm_eps: 1e-6,
        tied_output: true,
        qkv_bias: true,
        llama3_rope: None,
    },
];

impl Shape {
    /// The shape called `name`.
    pub fn named(name: &str) -> Result<&'static Shape> {
        SHAPES
            .iter()
            .find(|s| s.name.eq_ignore_ascii_case(name))
            .ok_or_else(|| {
                let known: Vec<_> = SHAPES.iter().map(|s| s.name).collect();
                ModelError::Invalid(format!(
                    "unknown shape {name:?} (known: {})",
                    known.join(", ")
                ))
            })
    }

    /// Size of one head.
    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Llama 3's per-dimension frequency divisors, as llama.cpp's converter computes them.
    fn rope_factors(&self, r: &Llama3Rope) -> Vec<f32> {
        let dim = self.head_dim();
        let low_wavelen = r.original_context / r.low_freq_factor;
        let high_wavelen = r.original_context / r.high_freq_factor;
        (0..dim / 2)
            .map(|i| {
                let freq = 1.0 / f64::from(self.rope_base).powf((2 * i) as f64 / dim as f64);
                let wavelen = 2.0 * std::f64::consts::PI / freq;
                let f = if wavelen < high_wavelen {
                    1.0
                } else if wavelen > low_wavelen {
                    r.factor
                } else {
                    let smooth = (r.original_context / wavelen - r.low_freq_factor)
                        / (r.high_freq_factor - r.low_freq_factor);
                    1.0 / ((1.0 - smooth) / r.factor + smooth)
                };
                f as f32
            })
            .collect()
    }
}

/// How the matrices are typed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Quantization {
    /// The file type.
    pub ftype: FileType,
    /// Every matrix in the base type (llama-quantize's `--pure`), save width fallbacks.
    pub pure: bool,
}

/// One tensor of the file: its layout and how its values are drawn.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    /// Name, dims and type.
    pub layout: TensorLayout,
    /// Random values, or fixed ones (Llama 3 frequency factors).
    pub values: PlannedValues,
}

/// Where a tensor's values come from.
#[derive(Clone, Debug, PartialEq)]
pub enum PlannedValues {
    /// Random.
    Random(Values),
    /// These F32 values.
    Fixed(Vec<f32>),
}

impl PlannedTensor {
    /// Bytes of data.
    pub fn bytes(&self) -> u64 {
        let n: u64 = self.layout.dims.iter().product();
        self.layout.ty.bytes_for(n).unwrap_or(0)
    }
}

/// The tensors of `shape` in `q`, in file order.
pub fn plan_tensors(shape: &Shape, q: Quantization) -> Vec<PlannedTensor> {
    let (d, hd, nl) = (shape.n_embd, shape.head_dim(), shape.n_layer);
    let (q_dim, kv_dim, ff) = (shape.n_head * hd, shape.n_head_kv * hd, shape.n_ff);
    let mut out = Vec::new();
    let mut add = |name: String, dims: &[usize], ty: TensorType, values: PlannedValues| {
        out.push(PlannedTensor {
            layout: TensorLayout {
                name,
                dims: dims.iter().map(|&x| x as u64).collect(),
                ty,
            },
            values,
        })
    };
    let matrix = |role: Role, layer: usize, row_len: usize| {
        mix::matrix_type(q.ftype, role, layer, nl, row_len, q.pure)
    };
    // Matrices scaled so that activations stay O(1): std about 1/sqrt(fan-in); a wider
    // output matrix so that logits spread by about 2, neither flat nor saturated. Embedding
    // rows are normalized before use: of unit scale, unless they are the output matrix too.
    let spread =
        |fan_in: usize| PlannedValues::Random(Values::Spread(0.7 / (fan_in as f32).sqrt()));
    let norm = || PlannedValues::Random(Values::AroundOne(0.1));
    let embd_role = Role::TokenEmbd {
        tied: shape.tied_output,
    };
    add(
        "token_embd.weight".into(),
        &[d, shape.n_vocab],
        matrix(embd_role, 0, d),
        PlannedValues::Random(Values::Spread(if shape.tied_output {
            2.0 / (d as f32).sqrt()
        } else {
            1.0
        })),
    );
    if let Some(r) = &shape.llama3_rope {
        add(
            "rope_freqs.weight".into(),
            &[hd / 2],
            TensorType::F32,
            PlannedValues::Fixed(shape.rope_factors(r)),
        );
    }
    for i in 0..nl {
        let n = |s: &str| format!("blk.{i}.{s}");
        add(n("attn_norm.weight"), &[d], TensorType::F32, norm());
        add(
            n("attn_q.weight"),
            &[d, q_dim],
            matrix(Role::Other, i, d),
            spread(d),
        );
        add(
            n("attn_k.weight"),
            &[d, kv_dim],
            matrix(Role::Other, i, d),
            spread(d),
        );
        add(
            n("attn_v.weight"),
            &[d, kv_dim],
            matrix(Role::AttnV, i, d),
            spread(d),
        );
        if shape.qkv_bias {
            let bias = || PlannedValues::Random(Values::Spread(0.1));
            add(n("attn_q.bias"), &[q_dim], TensorType::F32, bias());
            add(n("attn_k.bias"), &[kv_dim], TensorType::F32, bias());
            add(n("attn_v.bias"), &[kv_dim], TensorType::F32, bias());
        }
        add(
            n("attn_output.weight"),
            &[q_dim, d],
            matrix(Role::Other, i, q_dim),
            spread(q_dim),
        );
        add(n("ffn_norm.weight"), &[d], TensorType::F32, norm());
        add(
            n("ffn_gate.weight"),
            &[d, ff],
            matrix(Role::Other, i, d),
            spread(d),
        );
        add(
            n("ffn_up.weight"),
            &[d, ff],
            matrix(Role::Other, i, d),
            spread(d),
        );
        add(
            n("ffn_down.weight"),
            &[ff, d],
            matrix(Role::FfnDown, i, ff),
            spread(ff),
        );
    }
    add("output_norm.weight".into(), &[d], TensorType::F32, norm());
    if !shape.tied_output {
        add(
            "output.weight".into(),
            &[d, shape.n_vocab],
            matrix(Role::Output, 0, d),
            spread(d / 8),
        );
    }
    out
}

/// The metadata of `shape`'s file: hyperparameters, file type, and the tokenizer of
/// `tokenizer_from` padded with `<|pad_N|>` control tokens to the shape's vocabulary.
pub fn metadata(shape: &Shape, q: Quantization, tokenizer_from: &Path) -> Result<GgufWriter> {
    let mut w = GgufWriter::new();
    let arch = shape.arch;
    let key = |s: &str| format!("{arch}.{s}");
    let u32v = |n: usize| Value::U32(n as u32);
    w.set("general.architecture", Value::String(arch.into()));
    w.set(
        "general.name",
        Value::String(format!("synthetic-{}", shape.name)),
    );
    w.set("general.file_type", Value::U32(q.ftype.gguf_id()));
    if q.ftype != FileType::F16 {
        w.set("general.quantization_version", Value::U32(2));
    }
    w.set(key("block_count"), u32v(shape.n_layer));
    w.set(key("context_length"), u32v(shape.n_ctx));
    w.set(key("embedding_length"), u32v(shape.n_embd));
    w.set(key("feed_forward_length"), u32v(shape.n_ff));
    w.set(key("attention.head_count"), u32v(shape.n_head));
    w.set(key("attention.head_count_kv"), u32v(shape.n_head_kv));
    w.set(key("rope.freq_base"), Value::F32(shape.rope_base));
    w.set(
        key("attention.layer_norm_rms_epsilon"),
        Value::F32(shape.norm_eps),
    );
    w.set(key("rope.dimension_count"), u32v(shape.head_dim()));
    if arch == "llama" {
        w.set(key("vocab_size"), u32v(shape.n_vocab));
    }
    borrow_tokenizer(&mut w, tokenizer_from, shape.n_vocab)?;
    Ok(w)
}

/// Copies every `tokenizer.*` key of `path`, padding the per-token arrays to `n_vocab`.
fn borrow_tokenizer(w: &mut GgufWriter, path: &Path, n_vocab: usize) -> Result<()> {
    let file = GgufFile::open(path)?;
    let meta = file.metadata();
    let n_have = match meta.get("tokenizer.ggml.tokens") {
        Some(Value::Array(Array::String(t))) => t.len(),
        _ => {
            return Err(ModelError::Invalid(format!(
                "{} has no tokenizer.ggml.tokens to borrow",
                path.display()
            )))
        }
    };
    if n_have > n_vocab {
        return Err(ModelError::Invalid(format!(
            "the tokenizer of {} has {n_have} tokens, more than the shape's {n_vocab}",
            path.display()
        )));
    }
    let pad = n_vocab - n_have;
    for (k, v) in meta.iter() {
        if !k.starts_with("tokenizer.") {
            continue;
        }
        let padded = match (k, v) {
            ("tokenizer.ggml.tokens", Value::Array(Array::String(t))) => {
                let mut t = t.clone();
                t.extend((n_have..n_vocab).map(|i| format!("<|pad_{i}|>")));
                Value::Array(Array::String(t))
            }
            // Control tokens: never produced by ordinary text.
            ("tokenizer.ggml.token_type", Value::Array(Array::I32(t))) => {
                let mut t = t.clone();
                t.extend(std::iter::repeat_n(3, pad));
                Value::Array(Array::I32(t))
            }
            ("tokenizer.ggml.scores", Value::Array(Array::F32(s))) => {
                let mut s = s.clone();
                s.extend(std::iter::repeat_n(0.0, pad));
                Value::Array(Array::F32(s))
            }
            ("tokenizer.ggml.token_type" | "tokenizer.ggml.scores", _) => {
                return Err(ModelError::Invalid(format!(
                    "{}: {k} is not the array type llama.cpp writes",
                    path.display()
                )))
            }
            _ => v.clone(),
        };
        w.set(k, padded);
    }
    Ok(())
}

/// What [`write`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Written {
    /// The file's length.
    pub file_bytes: u64,
    /// Bytes of each tensor type, largest first.
    pub bytes_by_type: Vec<(TensorType, u64)>,
}

/// Rows of a tensor written as one piece of work: a few MiB, so that every core is busy
/// and the order of the work does not change the bytes.
const CHUNK_BYTES: u64 = 4 << 20;

/// Writes `shape` in `q` with random weights from `seed` at `path`, on `threads` threads
/// (0: every core). The bytes depend on the seed only, not on the threads.
pub fn write(
    shape: &Shape,
    q: Quantization,
    tokenizer_from: &Path,
    seed: u64,
    path: &Path,
    threads: usize,
) -> Result<Written> {
    let meta = metadata(shape, q, tokenizer_from)?;
    let tensors = plan_tensors(shape, q);
    let layouts: Vec<TensorLayout> = tensors.iter().map(|t| t.layout.clone()).collect();
    let header = meta.header(&layouts)?;
    let io = |e: std::io::Error| ModelError::Invalid(format!("{}: {e}", path.display()));
    let mut file = std::fs::File::create(path).map_err(io)?;
    file.set_len(header.file_len).map_err(io)?;
    file.write_all(&header.bytes).map_err(io)?;
    drop(file);

    // Pieces of work: (tensor, first row, rows).
    let mut work = Vec::new();
    for (ti, t) in tensors.iter().enumerate() {
        let row_len = t.layout.dims[0];
        let rows: u64 = t.layout.dims[1..].iter().product();
        let row_bytes = t.layout.ty.bytes_for(row_len).unwrap_or(0).max(1);
        let per = (CHUNK_BYTES / row_bytes).max(1);
        let mut r = 0;
        while r < rows {
            work.push((ti, r, per.min(rows - r)));
            r += per;
        }
    }
    let threads = if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    };
    let next = AtomicUsize::new(0);
    let failure: Mutex<Option<ModelError>> = Mutex::new(None);
    std::thread::scope(|s| {
        for _ in 0..threads.min(work.len()).max(1) {
            s.spawn(|| {
                let run = || -> Result<()> {
                    let mut f = std::fs::OpenOptions::new()
                        .write(true)
                        .open(path)
                        .map_err(io)?;
                    let mut buf = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(&(ti, row, rows)) = work.get(i) else {
                            return Ok(());
                        };
                        if failure.lock().map(|f| f.is_some()).unwrap_or(true) {
                            return Ok(());
                        }
                        let t = &tensors[ti];
                        let row_bytes = t.layout.ty.bytes_for(t.layout.dims[0]).unwrap_or(0);
                        buf.resize((rows * row_bytes) as usize, 0);
                        match &t.values {
                            PlannedValues::Random(v) => {
                                let mut rng = Wyrand::new(chunk_seed(seed, ti, row));
                                blocks::fill(t.layout.ty, *v, &mut rng, &mut buf)?;
                            }
                            PlannedValues::Fixed(values) => {
                                buf.clear();
                                buf.extend(values.iter().flat_map(|x| x.to_le_bytes()));
                            }
                        }
                        let at = header.offsets[ti] + row * row_bytes;
                        f.seek(SeekFrom::Start(at)).map_err(io)?;
                        f.write_all(&buf).map_err(io)?;
                    }
                };
                if let Err(e) = run() {
                    if let Ok(mut f) = failure.lock() {
                        f.get_or_insert(e);
                    }
                }
            });
        }
    });
    if let Some(e) = failure.into_inner().ok().flatten() {
        return Err(e);
    }
    let mut by_type: Vec<(TensorType, u64)> = Vec::new();
    for t in &tensors {
        match by_type.iter_mut().find(|(ty, _)| *ty == t.layout.ty) {
            Some((_, b)) => *b += t.bytes(),
            None => by_type.push((t.layout.ty, t.bytes())),
        }
    }
    by_type.sort_by_key(|t| std::cmp::Reverse(t.1));
    Ok(Written {
        file_bytes: header.file_len,
        bytes_by_type: by_type,
    })
}

/// The seed of the piece of tensor `tensor` starting at `row` (SplitMix64's finalizer).
fn chunk_seed(seed: u64, tensor: usize, row: u64) -> u64 {
    let mut z = seed ^ ((tensor as u64) << 40) ^ row.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
