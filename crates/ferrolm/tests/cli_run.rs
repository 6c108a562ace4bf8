//! The user-facing commands end to end on the default model: `run` (greedy output equal to
//! llama.cpp's, seeds, JSON), `chat` (the cache kept between turns), `tokenize`/`detokenize`.

use std::io::Write;
use std::process::{Command, Output, Stdio};

fn ferrolm(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "ferrolm {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn json(out: &Output) -> serde_json::Value {
    serde_json::from_slice(&out.stdout).unwrap()
}

fn ids(v: &serde_json::Value) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// The golden case "What is the capital of France?" in ChatML, from `scripts/parity_golden.py`.
fn golden_case(i: usize) -> (String, Vec<u64>, Vec<u64>) {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../ferrolm-model/tests/golden/smollm2.json"
    );
    let g: serde_json::Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let c = &g["cases"][i];
    (
        c["text"].as_str().unwrap().to_string(),
        ids(&c["ids"]),
        ids(&c["greedy"]),
    )
}

#[test]
fn greedy_run_reproduces_llama_cpp_and_stops_at_end_of_turn() {
    let (text, prompt_ids, greedy) = golden_case(2);
    let out = json(&ferrolm(&[
        "run", "--temp", "0", "-n", "64", "--json", &text,
    ]));
    assert_eq!(ids(&out["prompt_tokens"]), prompt_ids);
    // llama.cpp's continuation runs past <|im_end|> (id 2); `run` stops there.
    let end = greedy.iter().position(|&t| t == 2).unwrap();
    assert_eq!(ids(&out["tokens"]), greedy[..end]);
    assert_eq!(out["text"], "The capital of France is Paris.");
    assert_eq!(out["finish_reason"], "stop");
    assert!(out["tg_tokens_per_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn chat_flag_applies_the_template() {
    let out = json(&ferrolm(&[
        "run", "--chat", "--temp", "0", "-n", "8", "--json", "Hi",
    ]));
    let prompt = ids(&out["prompt_tokens"]);
    // ChatML: <|im_start|> (1) opens the system turn the template adds, and the prompt ends
    // with "assistant\n".
    assert_eq!(prompt[0], 1);
    assert_eq!(&prompt[prompt.len() - 2..], &[520, 9531, 198][1..]);
}

#[test]
fn seeds_make_sampling_reproducible() {
    let run = |seed: &str| {
        ids(&json(&ferrolm(&[
            "run",
            "--temp",
            "1.0",
            "--seed",
            seed,
            "-n",
            "24",
            "--json",
            "Once upon a time",
        ]))["tokens"])
    };
    assert_eq!(run("7"), run("7"));
    assert_ne!(run("7"), run("8"));
}

#[test]
fn n_limits_the_continuation() {
    let out = json(&ferrolm(&[
        "run",
        "--temp",
        "0",
        "-n",
        "5",
        "--json",
        "The quick brown fox",
    ]));
    assert_eq!(ids(&out["tokens"]).len(), 5);
    assert_eq!(out["finish_reason"], "length");
}

#[test]
fn chat_keeps_the_cache_between_turns() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(["chat", "--temp", "0", "-n", "16"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"What is the capital of France? Answer in one word.\nAnd of Italy?\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    let new_tokens: Vec<usize> = stderr
        .lines()
        .filter_map(|l| l.split_once('[')?.1.split(' ').next()?.parse().ok())
        .collect();
    assert_eq!(new_tokens.len(), 2, "{stderr}");
    // The second turn evaluates only its own message and the template around it, not the
    // whole conversation again.
    assert!(
        new_tokens[1] < 20,
        "second turn re-evaluated {} tokens: {stderr}",
        new_tokens[1]
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("Paris"), "{stdout}");
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let out = ferrolm(&["tokenize", "Hello world"]);
    let v: Vec<u32> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v, [19556, 905]);
    let out = ferrolm(&["detokenize", "19556,905"]);
    assert_eq!(String::from_utf8_lossy(&out.stdout), "Hello world\n");
}

/// `ferrolm run --expert-stats` on a synthetic Qwen3-MoE file: one line per layer on stderr,
/// and in the JSON object per layer and expert counts that add up to (prompt + generated
/// tokens, less the last one, which is never fed back) x top-k.
#[test]
fn expert_stats_count_every_routed_token() {
    let dir = std::env::temp_dir().join(format!("ferrolm-expert-stats-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("qwen3moe.gguf");
    let model = model.to_str().unwrap();
    ferrolm(&["synth", "--arch", "qwen3moe", "--layers", "2", "-o", model]);
    let args = [
        "run",
        "-m",
        model,
        "-n",
        "5",
        "--temp",
        "0",
        "--expert-stats",
    ];
    let out = ferrolm(&[&args[..], &["hello world"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("experts of layer").count(), 2, "{err}");
    let out = ferrolm(&[&args[..], &["--json", "hello world"]].concat());
    let v = json(&out);
    let fed = ids(&v["prompt_tokens"]).len() + ids(&v["tokens"]).len() - 1;
    let counts = v["expert_counts"].as_array().unwrap();
    assert_eq!(counts.len(), 2);
    for layer in counts {
        let layer = ids(layer);
        assert_eq!(layer.len(), 8);
        assert_eq!(layer.iter().sum::<u64>(), fed as u64 * 2);
    }
    let _ = std::fs::remove_dir_all(&dir);
}
