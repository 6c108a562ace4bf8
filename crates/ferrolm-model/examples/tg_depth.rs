//! Decode speed at a context depth: fills the context with `depth` prompt tokens, then times
//! `n` greedy decode steps (one thread unless told). For hybrid recurrent models the
//! delta-net layers' cost per token does not grow with the depth; attention layers' does.
//!
//! usage: cargo run --release -p ferrolm-model --example tg_depth -- MODEL.gguf DEPTH N [THREADS]
//! prints `{"depth": D, "tg": tokens_per_s}`

use std::time::Instant;

use ferrolm_model::{Logits, Model};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model =
        Model::load(&args[1], args.get(4).map_or(1, |t| t.parse().unwrap())).expect("model");
    let depth: usize = args[2].parse().unwrap();
    let n: usize = args[3].parse().unwrap();
    let n_vocab = model.plan().n_vocab as u32;
    let mut s = model.session(depth + n + 1);
    let prompt: Vec<u32> = (0..depth as u32)
        .map(|i| (i * 2654435761 % n_vocab) % n_vocab)
        .collect();
    let mut last = s.eval(&prompt, Logits::Last).expect("prompt");
    let t = Instant::now();
    for _ in 0..n {
        let next = last
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i as u32);
        last = s.eval(&[next], Logits::Last).expect("decode");
    }
    let tg = n as f64 / t.elapsed().as_secs_f64();
    println!("{{\"depth\": {depth}, \"tg\": {tg:.3}}}");
}
