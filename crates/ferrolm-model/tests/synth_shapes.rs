//! `ferrolm synth --shape`: files of real models' shapes with random weights. The SmolLM2 shape
//! in Q4_1 is checked against the real SmolLM2 Q4_1 file (made by llama-quantize): the same
//! tensor table, types and sizes included, and the same hyperparameters; the Q4_K_M mix of
//! Llama 3.2 1B and Qwen 2.5 0.5B against llama-quantize's rules, written out here by hand.

use std::path::PathBuf;

use ferrolm_gguf::{GgufFile, TensorType, Value};
use ferrolm_model::shapes::{self, FileType, Quantization, Shape};
use ferrolm_model::{Logits, Model};

/// The model cache, as `ferrolm pull` fills it.
fn default_model() -> PathBuf {
    let home = std::env::var_os("FERROLM_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/ferrolm")
        });
    let path = home.join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        path.exists(),
        "{} is missing: run `cargo run --release -p ferrolm -- pull all` (scripts/test does)",
        path.display()
    );
    path
}

fn q(ftype: FileType) -> Quantization {
    Quantization { ftype, pure: false }
}

#[test]
fn smollm2_shape_is_the_real_files_layout() {
    let real_path = default_model();
    let real = GgufFile::open(&real_path).unwrap();
    let dir = std::env::temp_dir().join(format!("ferrolm-shape-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (one, two) = (dir.join("one.gguf"), dir.join("two.gguf"));
    let shape = Shape::named("smollm2-135m").unwrap();
    let written = shapes::write(shape, q(FileType::Q4_1), &real_path, 3, &one, 1).unwrap();
    shapes::write(shape, q(FileType::Q4_1), &real_path, 3, &two, 2).unwrap();
    let (a, b) = (std::fs::read(&one).unwrap(), std::fs::read(&two).unwrap());
    assert!(a == b, "the bytes depend on the number of threads");
    assert_eq!(written.file_bytes, a.len() as u64);
    let ours = GgufFile::from_bytes(a).unwrap();
    let _ = std::fs::remove_dir_all(&dir);

    // Every tensor of the real file, with its dims, type and size, and nothing else.
    let table = |f: &GgufFile| {
        let mut t: Vec<_> = f
            .tensors()
            .iter()
            .map(|t| (t.name.clone(), t.dims.clone(), t.ty, t.size))
            .collect();
        t.sort();
        t
    };
    assert_eq!(table(&ours), table(&real));
    for key in [
        "llama.block_count",
        "llama.context_length",
        "llama.embedding_length",
        "llama.feed_forward_length",
        "llama.attention.head_count",
        "llama.attention.head_count_kv",
        "llama.rope.freq_base",
        "llama.attention.layer_norm_rms_epsilon",
        "llama.rope.dimension_count",
        "llama.vocab_size",
        "general.file_type",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
        "tokenizer.ggml.pre",
    ] {
        assert_eq!(ours.metadata().get(key), real.metadata().get(key), "{key}");
    }

    // It runs, with finite logits that are not flat.
    let model = Model::from_file(std::sync::Arc::new(ours), 0).unwrap();
    let logits = model
        .session(16)
        .eval(&[1, 504, 3458, 2914], Logits::Last)
        .unwrap();
    assert!(logits.iter().all(|x| x.is_finite()));
    let mean = logits.iter().sum::<f32>() / logits.len() as f32;
    let var = logits.iter().map(|x| (x - mean).powi(2)).sum::<f32>() / logits.len() as f32;
    assert!(var > 0.1, "logit variance {var}");
}

/// llama-quantize's Q4_K_M for Llama 3.2 1B (16 layers, width 2048, tied embedding): Q6_K for
/// the embedding (it is the output too) and for attn_v and ffn_down in layers 0, 1, 4, 7, 10,
/// 13, 14, 15; Q4_K for every other matrix.
#[test]
fn llama_3_2_1b_q4_k_m_mix() {
    let shape = Shape::named("llama-3.2-1b").unwrap();
    let tensors = shapes::plan_tensors(shape, q(FileType::Q4KM));
    let more_bits = [0, 1, 4, 7, 10, 13, 14, 15];
    let mut counts = std::collections::BTreeMap::new();
    for t in &tensors {
        let name = t.layout.name.as_str();
        let layer: Option<usize> = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .map(|n| n.parse().unwrap());
        let expected = if t.layout.dims.len() == 1 {
            TensorType::F32
        } else if name == "token_embd.weight"
            || (name.ends_with("attn_v.weight") || name.ends_with("ffn_down.weight"))
                && more_bits.contains(&layer.unwrap())
        {
            TensorType::Q6_K
        } else {
            TensorType::Q4_K
        };
        assert_eq!(t.layout.ty, expected, "{name}");
        *counts.entry(t.layout.ty.name()).or_insert(0) += 1;
    }
    // 16 x 9 + embedding, rope_freqs, output norm.
    assert_eq!(tensors.len(), 147);
    assert_eq!(counts["Q6_K"], 1 + 2 * more_bits.len());
    assert_eq!(counts["Q4_K"], 16 * 7 - 2 * more_bits.len());
    let bytes: u64 = tensors.iter().map(|t| t.bytes()).sum();
    println!("llama-3.2-1b Q4_K_M: {bytes} bytes of tensor data");
    // Summed by hand: 262,668,288 for the Q6_K embedding, 16 layers of 60,817,408 bytes
    // (Q4_K) plus 8 x 2 x (Q6_K - Q4_K) upgrades, the F32 tensors.
    let layer_q4k: u64 = (2048 * (2048 + 512 + 512 + 2048) + 3 * 2048 * 8192) / 256 * 144;
    let upgrade_v = 2048 * 512 / 256 * (210 - 144);
    let upgrade_down = 8192 * 2048 / 256 * (210 - 144);
    let f32s = 4 * (32 + 16 * 2 * 2048 + 2048);
    let expected =
        2048 * 128_256 / 256 * 210 + 16 * layer_q4k + 8 * (upgrade_v + upgrade_down) + f32s;
    assert_eq!(bytes, expected);
}

/// Qwen 2.5 0.5B's width, 896, is not a whole number of 256-value blocks: every matrix that
/// reads the residual stream falls back (Q4_K to Q5_0, Q6_K to Q8_0, the tied embedding to
/// Q8_0); ffn_down (rows of 4864 = 19 x 256) keeps Q4_K / Q6_K.
#[test]
fn qwen2_5_0_5b_q4_k_m_falls_back_where_rows_are_not_whole_blocks() {
    let shape = Shape::named("qwen2.5-0.5b").unwrap();
    let tensors = shapes::plan_tensors(shape, q(FileType::Q4KM));
    let more_bits = [0, 1, 2, 5, 8, 11, 14, 17, 20, 21, 22, 23];
    for t in &tensors {
        let name = t.layout.name.as_str();
        let layer = name
            .strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .map(|n| n.parse::<usize>().unwrap());
        let more = layer.is_some_and(|l| more_bits.contains(&l));
        let expected = if t.layout.dims.len() == 1 {
            TensorType::F32
        } else if name == "token_embd.weight" {
            TensorType::Q8_0
        } else if name.ends_with("attn_v.weight") {
            if more {
                TensorType::Q8_0
            } else {
                TensorType::Q5_0
            }
        } else if name.ends_with("ffn_down.weight") {
            if more {
                TensorType::Q6_K
            } else {
                TensorType::Q4_K
            }
        } else {
            TensorType::Q5_0
        };
        assert_eq!(t.layout.ty, expected, "{name}");
    }
    assert!(tensors
        .iter()
        .any(|t| t.layout.name == "blk.23.attn_q.bias"));
    let bytes: u64 = tensors.iter().map(|t| t.bytes()).sum();
    println!("qwen2.5-0.5b Q4_K_M: {bytes} bytes of tensor data");
    let shape = Shape::named("llama-3.1-8b").unwrap();
    let tensors = shapes::plan_tensors(shape, q(FileType::Q4KM));
    let bytes: u64 = tensors.iter().map(|t| t.bytes()).sum();
    let output = tensors.iter().find(|t| t.layout.name == "output.weight");
    assert_eq!(output.map(|t| t.layout.ty), Some(TensorType::Q6_K));
    let embd = tensors
        .iter()
        .find(|t| t.layout.name == "token_embd.weight");
    assert_eq!(embd.map(|t| t.layout.ty), Some(TensorType::Q4_K));
    println!("llama-3.1-8b Q4_K_M: {bytes} bytes of tensor data");
}

/// The vocabulary is padded with control tokens to the shape's size; Llama 3's frequency
/// factors are the converter's (1 for fast dimensions, `factor` for slow ones).
#[test]
fn llama_3_2_1b_metadata() {
    let shape = Shape::named("llama-3.2-1b").unwrap();
    let w = shapes::metadata(shape, q(FileType::Q8_0), &default_model()).unwrap();
    let m = w.metadata();
    let Some(Value::Array(ferrolm_gguf::Array::String(tokens))) = m.get("tokenizer.ggml.tokens")
    else {
        panic!("no tokens")
    };
    assert_eq!(tokens.len(), 128_256);
    assert_eq!(tokens[128_255], "<|pad_128255|>");
    let real = GgufFile::open(default_model()).unwrap();
    let Some(Value::Array(ferrolm_gguf::Array::String(real_tokens))) =
        real.metadata().get("tokenizer.ggml.tokens")
    else {
        panic!("no tokens in the default model")
    };
    assert_eq!(&tokens[..real_tokens.len()], &real_tokens[..]);
    let Some(Value::Array(ferrolm_gguf::Array::I32(types))) = m.get("tokenizer.ggml.token_type")
    else {
        panic!("no token types")
    };
    assert_eq!(types.len(), 128_256);
    assert_eq!(types[100_000], 3);
    assert_eq!(m.get("llama.vocab_size"), Some(&Value::U32(128_256)));
    assert_eq!(m.get("general.file_type"), Some(&Value::U32(7)));
    let tensors = shapes::plan_tensors(shape, q(FileType::Q8_0));
    let freqs = tensors
        .iter()
        .find(|t| t.layout.name == "rope_freqs.weight")
        .unwrap();
    let shapes::PlannedValues::Fixed(f) = &freqs.values else {
        panic!("rope_freqs is computed")
    };
    assert_eq!(f.len(), 32);
    assert_eq!(f[0], 1.0);
    assert_eq!(f[31], 32.0);
    assert!(f.windows(2).all(|w| w[0] <= w[1]));

    assert!(Shape::named("llama-9b").is_err());
    assert!(FileType::parse("q3_k").is_err());
}
