//! Bad input (issue 4, point 8): each mistake makes the binary exit non-zero with one line on
//! stderr naming the problem, never a panic. The bad files are synthetic ones, broken on purpose.

use std::path::{Path, PathBuf};
use std::process::Command;

use ferrolm_gguf::{GgufFile, GgufWriter};
use ferrolm_model::synthetic::{self, SyntheticSpec};

/// A fresh directory for this test's files.
fn temp_dir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("ferrolm-cli-errors-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A small valid file (2 layers).
fn good_spec() -> SyntheticSpec {
    let mut s = SyntheticSpec::small("llama");
    s.n_layer = 2;
    s.n_ctx = 256;
    s
}

/// `good_spec`'s file with `edit` applied to each tensor (name, dims, data; `None` drops it)
/// and `general.architecture` set to `arch`.
fn rewritten(
    arch: &str,
    edit: impl Fn(&str, Vec<u64>, Vec<u8>) -> Option<(Vec<u64>, Vec<u8>)>,
) -> Vec<u8> {
    let good = synthetic::build(&good_spec()).unwrap().to_bytes();
    let file = GgufFile::from_bytes(good).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata().iter() {
        w.set(k, v.clone());
    }
    w.set(
        "general.architecture",
        ferrolm_gguf::Value::String(arch.to_string()),
    );
    for t in file.tensors() {
        let data = file.tensor_data(t).to_vec();
        if let Some((dims, data)) = edit(&t.name, t.dims.clone(), data) {
            w.add_tensor(t.name.clone(), &dims, t.ty, data).unwrap();
        }
    }
    w.to_bytes()
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> String {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path.to_str().unwrap().to_string()
}

/// Runs the binary; returns (success, stdout, stderr).
fn ferrolm(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .env("FERROLM_HOME", temp_dir("home"))
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Asserts a failure with one stderr line that contains every one of `words` (each may list
/// alternatives separated by `|`).
fn fails_with(args: &[&str], words: &[&str]) {
    let (ok, _, stderr) = ferrolm(args);
    assert!(!ok, "{args:?} succeeded; stderr: {stderr}");
    assert!(!stderr.contains("panicked"), "{args:?} panicked: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{args:?}: not one line on stderr: {stderr}");
    for w in words {
        assert!(
            w.split('|').any(|w| lines[0].contains(w)),
            "{args:?}: stderr does not name {w:?}: {stderr}"
        );
    }
}

fn logits(model: &str, ids: &str, dir: &Path) -> Vec<String> {
    let out = dir.join("logits.bin");
    [
        "logits",
        "-m",
        model,
        "--ids",
        ids,
        "-o",
        out.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec()
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn a_good_file_works() {
    // The baseline the other tests break: the same file, unbroken, evaluates.
    let dir = temp_dir("good");
    let model = write(
        &dir,
        "good.gguf",
        &rewritten("llama", |_, d, b| Some((d, b))),
    );
    let (ok, _, stderr) = ferrolm(&args(&logits(&model, "1,2,3", &dir)));
    assert!(ok, "{stderr}");
    assert_eq!(
        std::fs::metadata(dir.join("logits.bin")).unwrap().len(),
        3 * synthetic::MINIMAL_VOCAB as u64 * 4
    );
}

#[test]
fn missing_file() {
    let dir = temp_dir("missing");
    let model = dir.join("nope.gguf");
    fails_with(
        &args(&logits(model.to_str().unwrap(), "1", &dir)),
        &["nope.gguf", "does not exist|not found|No such file"],
    );
}

#[test]
fn unknown_architecture() {
    let dir = temp_dir("arch");
    let model = write(
        &dir,
        "arch.gguf",
        &rewritten("frobnicator", |_, d, b| Some((d, b))),
    );
    fails_with(
        &args(&logits(&model, "1", &dir)),
        &["frobnicator", "architecture"],
    );
}

#[test]
fn missing_tensor() {
    let dir = temp_dir("tensor");
    let bytes = rewritten("llama", |name, d, b| {
        (name != "blk.1.ffn_up.weight").then_some((d, b))
    });
    let model = write(&dir, "tensor.gguf", &bytes);
    fails_with(
        &args(&logits(&model, "1", &dir)),
        &["blk.1.ffn_up.weight", "missing"],
    );
}

#[test]
fn tensor_of_the_wrong_shape() {
    let dir = temp_dir("shape");
    let bytes = rewritten("llama", |name, mut d, mut b| {
        if name == "blk.0.attn_k.weight" {
            // half the rows
            d[1] /= 2;
            b.truncate(b.len() / 2);
        }
        Some((d, b))
    });
    let model = write(&dir, "shape.gguf", &bytes);
    fails_with(
        &args(&logits(&model, "1", &dir)),
        &["blk.0.attn_k.weight", "shape"],
    );
}

#[test]
fn id_outside_the_vocabulary() {
    let dir = temp_dir("vocab");
    let model = write(
        &dir,
        "good.gguf",
        &rewritten("llama", |_, d, b| Some((d, b))),
    );
    fails_with(
        &args(&logits(&model, "1,999999", &dir)),
        &["999999", "vocabulary"],
    );
}

#[test]
fn truncated_file() {
    let dir = temp_dir("truncated");
    let good = synthetic::build(&good_spec()).unwrap().to_bytes();
    // In the header, in the tokenizer's metadata, in the tensor data (not in the last padding).
    for cut in [100, 5000, good.len() / 2, good.len() - 64] {
        let model = write(&dir, &format!("cut-{cut}.gguf"), &good[..cut]);
        fails_with(&args(&logits(&model, "1", &dir)), &["cannot fit|outside"]);
    }
}

#[test]
fn prompt_longer_than_the_context() {
    let dir = temp_dir("context");
    let model = write(
        &dir,
        "good.gguf",
        &rewritten("llama", |_, d, b| Some((d, b))),
    );
    let prompt = "the quick brown fox jumps over the lazy dog ".repeat(8);
    let run = |extra: &[&str]| {
        let mut a = vec!["run", "-m", &model, "-c", "16", "-n", "4", "--temp", "0"];
        a.extend_from_slice(extra);
        a.push(&prompt);
        ferrolm(&a)
    };
    let a: Vec<&str> = [
        "run", "-m", &model, "-c", "16", "-n", "4", "--temp", "0", &prompt,
    ]
    .to_vec();
    fails_with(&a, &["context", "--truncate"]);
    let (ok, _, stderr) = run(&["--truncate"]);
    assert!(ok, "--truncate failed: {stderr}");
    assert!(stderr.contains("truncated"), "no announcement: {stderr}");
    assert!(!stderr.contains("panicked"));
}

#[test]
fn absurd_layer_count() {
    // A file claiming four billion layers is refused before anything is sized by that count.
    let dir = temp_dir("layers");
    let good = synthetic::build(&good_spec()).unwrap().to_bytes();
    let file = GgufFile::from_bytes(good).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata().iter() {
        w.set(k, v.clone());
    }
    w.set("llama.block_count", ferrolm_gguf::Value::U32(4_000_000_000));
    for t in file.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.ty, file.tensor_data(t).to_vec())
            .unwrap();
    }
    let model = write(&dir, "layers.gguf", &w.to_bytes());
    fails_with(
        &args(&logits(&model, "1", &dir)),
        &["block_count", "tensors"],
    );
}

#[test]
fn synth_shape_mistakes() {
    let dir = temp_dir("shape");
    let out = dir.join("x.gguf");
    let out = out.to_str().unwrap();
    let synth = |extra: &[&'static str]| {
        let mut v = vec!["synth", "-o", out];
        v.extend_from_slice(extra);
        v
    };
    fails_with(
        &synth(&["--shape", "llama-9b", "--type", "q8_0"]),
        &["llama-9b", "smollm2-135m"],
    );
    fails_with(
        &synth(&["--shape", "smollm2-135m", "--type", "q3_k"]),
        &["q3_k", "q4_k_m"],
    );
    fails_with(&synth(&["--shape", "smollm2-135m"]), &["--type"]);
    fails_with(
        &synth(&["--shape", "smollm2-135m", "--type", "q8_0", "--layers", "2"]),
        &["--shape", "--layers"],
    );
    assert!(!Path::new(out).exists());
}

#[test]
fn a_gpu_memory_budget_that_is_no_number_of_gb_is_refused() {
    let dir = temp_dir("gpu-memory");
    let model = write(
        &dir,
        "good.gguf",
        &rewritten("llama", |_, d, b| Some((d, b))),
    );
    for bad in ["-2", "0", "NaN"] {
        let mut a = logits(&model, "1,2", &dir);
        a.push(format!("--gpu-memory={bad}"));
        fails_with(&args(&a), &["--gpu-memory", "a positive number of GB"]);
    }
}

#[test]
fn expert_placement_flags_without_a_gpu_memory_budget_are_refused() {
    let dir = temp_dir("cpu-experts");
    let model = write(
        &dir,
        "good.gguf",
        &rewritten("llama", |_, d, b| Some((d, b))),
    );
    for flag in ["--cpu-experts=3", "--cpu-experts=auto", "--expert-slots"] {
        let mut a = logits(&model, "1,2", &dir);
        a.push(flag.to_string());
        fails_with(
            &args(&a),
            &["--cpu-experts and --expert-slots", "--gpu-memory"],
        );
    }
    let mut a = logits(&model, "1,2", &dir);
    a.extend([
        "--gpu-memory=4".to_string(),
        "--cpu-experts=some".to_string(),
    ]);
    fails_with(&args(&a), &["some", "a number of experts, or auto"]);
}
