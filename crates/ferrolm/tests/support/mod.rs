//! Helpers the CLI tests share (each test crate uses some of them).
#![allow(dead_code)] // a test crate that uses only some of the helpers must still build

use std::process::Output;

/// The stdout of a run that must have succeeded (its stderr in the failure message).
pub fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "ferrolm failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// `ferrolm run -m MODEL` and these flags: a short greedy run whose tokens tests compare.
pub fn greedy_run(model: &str) -> Vec<&str> {
    let flags = ["--temp", "0", "-n", "6", "-t", "1", "--json"];
    let mut args = vec!["run", "-m", model];
    args.extend(flags);
    args.push("The capital of France is");
    args
}

/// The generated tokens of `run --json`'s output.
pub fn tokens(stdout: &str) -> serde_json::Value {
    serde_json::from_str::<serde_json::Value>(stdout).unwrap()["tokens"].clone()
}
