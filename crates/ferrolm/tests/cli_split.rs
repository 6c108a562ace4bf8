//! Split models end to end: `ferrolm split` cuts the packaged model into gguf-split shards,
//! `inspect` lists them, and `run` on the first shard gives the unsplit model's tokens.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use support::{greedy_run, ok, tokens};

mod support;

fn ferrolm(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .output()
        .unwrap()
}

fn greedy(model: &Path) -> serde_json::Value {
    tokens(&ok(ferrolm(&greedy_run(model.to_str().unwrap()))))
}

#[test]
fn a_split_model_inspects_and_runs_as_the_whole() {
    let model = PathBuf::from(ok(ferrolm(&["pull"])).trim());
    let dir = std::env::temp_dir().join(format!("ferrolm-cli-split-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let prefix = dir.join("smol");
    let out = ok(ferrolm(&[
        "split",
        "--max-tensors",
        "120",
        model.to_str().unwrap(),
        prefix.to_str().unwrap(),
    ]));
    let shards: Vec<PathBuf> = out.lines().map(PathBuf::from).collect();
    assert_eq!(shards.len(), 3, "{out}"); // SmolLM2-135M has 272 tensors: 120 + 120 + 32
    let shown = ok(ferrolm(&["inspect", shards[0].to_str().unwrap()]));
    assert!(
        shown.contains(&format!("{} shards:", shards.len())),
        "{shown}"
    );
    assert!(shown.contains("smol-00002-of-"), "{shown}");
    assert_eq!(greedy(&shards[0]), greedy(&model));
    // A later shard alone names the first; a missing one is named.
    let e = String::from_utf8(ferrolm(&["inspect", shards[1].to_str().unwrap()]).stderr).unwrap();
    assert!(
        e.contains("open the first shard") && e.contains("smol-00001-of-"),
        "{e}"
    );
    std::fs::remove_file(shards.last().unwrap()).unwrap();
    let e = String::from_utf8(ferrolm(&["inspect", shards[0].to_str().unwrap()]).stderr).unwrap();
    assert!(e.contains("is missing"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Experts streamed from the shards of a split mixture-of-experts model (pread from each shard)
/// give the tokens and expert counts of the unsplit model with its experts mapped.
#[test]
fn experts_stream_across_shards() {
    let dir = std::env::temp_dir().join(format!("ferrolm-split-moe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let whole = dir.join("moe.gguf");
    let whole_s = whole.to_str().unwrap();
    ok(ferrolm(&[
        "synth",
        "--arch",
        "qwen3moe",
        "--layers",
        "3",
        "--experts",
        "16",
        "-o",
        whole_s,
    ]));
    let out = ok(ferrolm(&[
        "split",
        "--max-tensors",
        "7",
        whole_s,
        dir.join("moe-split").to_str().unwrap(),
    ]));
    let first = out.lines().next().unwrap().to_string();
    assert!(out.lines().count() >= 4, "{out}");
    let run = |model: &str, cache: &str| {
        let out = ok(ferrolm(&[
            "run",
            "-m",
            model,
            "-t",
            "2",
            "-n",
            "8",
            "--temp",
            "0",
            "--expert-stats",
            "--expert-cache",
            cache,
            "--json",
            "the quick brown fox",
        ]));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        (v["tokens"].clone(), v["expert_counts"].clone())
    };
    let resident = run(whole_s, "0");
    assert_eq!(run(&first, "1"), resident);
    assert_eq!(run(&first, "0"), resident);
    std::fs::remove_dir_all(&dir).unwrap();
}
