//! `ferrolm quantize` byte for byte against llama.cpp's own quantizer (`llama_model_quantize`,
//! checksums from `scripts/quantize_golden.py`): the packaged model requantized to F16, then that
//! F16 file quantized to every file type both write.

use std::path::Path;
use std::process::{Command, Output};

use sha2::{Digest, Sha256};
use support::ok;

mod support;

fn ferrolm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .output()
        .unwrap()
}

fn sha256(path: &Path) -> String {
    Sha256::digest(std::fs::read(path).unwrap())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[test]
fn quantized_files_are_llama_quantize_s_byte_for_byte() {
    let golden: serde_json::Value = serde_json::from_slice(
        &std::fs::read(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/golden/quantize.json"
        ))
        .unwrap(),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("ferrolm-quantize-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f16 = dir.join("input-f16.gguf");
    let f16_s = f16.to_str().unwrap();
    // Requantizing needs its flag, as with llama-quantize.
    let e = String::from_utf8(ferrolm(&["quantize", "smollm2", f16_s, "f16"]).stderr).unwrap();
    assert!(e.contains("--allow-requantize"), "{e}");
    ok(ferrolm(&[
        "quantize",
        "smollm2",
        f16_s,
        "f16",
        "--allow-requantize",
    ]));
    assert_eq!(sha256(&f16), golden["f16_input"]["sha256"], "the F16 input");
    let mut differ = Vec::new();
    for (name, want) in golden["outputs"].as_object().unwrap() {
        let out = dir.join(format!("smollm2-{name}.gguf"));
        ok(ferrolm(&["quantize", f16_s, out.to_str().unwrap(), name]));
        if sha256(&out) != want["sha256"] {
            differ.push(name.clone());
        }
        std::fs::remove_file(&out).unwrap();
    }
    assert!(differ.is_empty(), "not llama-quantize's bytes: {differ:?}");
    let e = String::from_utf8(ferrolm(&["quantize", f16_s, "x.gguf", "q3_k_m"]).stderr).unwrap();
    assert!(e.contains("q3_k_m") && e.contains("q4_k_m"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
