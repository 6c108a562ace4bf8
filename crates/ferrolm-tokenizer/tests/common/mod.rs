//! Shared helpers: finding the real models and reading the golden files.

#![allow(dead_code)]

use std::path::PathBuf;

use ferrolm_tokenizer::Tokenizer;

/// `$FERROLM_HOME` (default `~/.cache/ferrolm`).
pub fn ferrolm_home() -> PathBuf {
    if let Some(h) = std::env::var_os("FERROLM_HOME") {
        return PathBuf::from(h);
    }
    let home = std::env::var_os("HOME").expect("HOME is set");
    PathBuf::from(home).join(".cache").join("ferrolm")
}

/// Loads the tokenizer of a model in `$FERROLM_HOME/models`, or fails saying how to get it.
pub fn load(file: &str) -> Tokenizer {
    let path = ferrolm_home().join("models").join(file);
    if !path.exists() {
        panic!(
            "model {} not found: run `cargo run --release -p ferrolm -- pull` first (or set FERROLM_HOME)",
            path.display()
        );
    }
    let gguf = ferrolm_gguf::GgufFile::open(&path).expect("open GGUF");
    Tokenizer::from_metadata(gguf.metadata()).expect("tokenizer from metadata")
}

pub fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("golden")
}

pub fn read_json(name: &str) -> serde_json::Value {
    let p = golden_dir().join(name);
    let s = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&s).expect("valid JSON")
}

pub fn corpus() -> Vec<String> {
    serde_json::from_value(read_json("corpus.json")).expect("array of strings")
}

/// The bytes a golden decode field stands for (`text` or `hex`).
pub fn expected_bytes(v: &serde_json::Value) -> Vec<u8> {
    if let Some(t) = v.get("text") {
        return t.as_str().expect("text").as_bytes().to_vec();
    }
    let h = v["hex"].as_str().expect("hex");
    (0..h.len() / 2)
        .map(|i| u8::from_str_radix(&h[2 * i..2 * i + 2], 16).unwrap())
        .collect()
}

pub fn ids_of(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";
