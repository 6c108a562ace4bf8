//! The progress bar on long prompts: the prompt goes in pieces of the batch size behind it
//! (forced with FERROLM_PROGRESS=1, as stderr is no terminal here; indicatif then draws
//! nothing), and the tokens are those of one call.

use std::process::Command;

use support::{ok, tokens};

mod support;

fn ferrolm(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .output()
        .unwrap()
}

/// A long prompt fed in pieces behind the progress bar gives the tokens of one call.
#[test]
fn a_long_prompt_behind_the_progress_bar_gives_the_same_tokens() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/perplexity.txt"
    ))
    .unwrap();
    let args = ["run", "--temp", "0", "-n", "4", "-t", "2", "--json", &text];
    let plain = tokens(&ok(ferrolm(&args)));
    let out = Command::new(env!("CARGO_BIN_EXE_ferrolm"))
        .args(args)
        .env("FERROLM_PROGRESS", "1")
        .output()
        .unwrap();
    assert_eq!(tokens(&ok(out)), plain);
}
