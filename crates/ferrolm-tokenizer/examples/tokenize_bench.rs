//! Times `Tokenizer::encode` on a text file: `cargo run --release -p ferrolm-tokenizer
//! --example tokenize_bench -- MODEL.gguf TEXT_FILE [REPEATS [IDS_OUT]]`. Prints the best of
//! REPEATS runs; with IDS_OUT, also writes the ids there (one per line) for comparison.

use std::time::Instant;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 3 {
        eprintln!("usage: tokenize_bench MODEL.gguf TEXT_FILE [REPEATS]");
        std::process::exit(2);
    }
    let repeats: usize = args
        .get(3)
        .map_or(5, |s| s.parse().expect("REPEATS is a number"));
    let gguf = ferrolm_gguf::GgufFile::open(&args[1]).expect("open GGUF");
    let t0 = Instant::now();
    let tok = ferrolm_tokenizer::Tokenizer::from_metadata(gguf.metadata()).expect("tokenizer");
    let load = t0.elapsed();
    let text = std::fs::read_to_string(&args[2]).expect("read text");
    let mut best = f64::INFINITY;
    let mut ids = Vec::new();
    for _ in 0..repeats {
        let t = Instant::now();
        ids = tok.encode(&text, true, true);
        best = best.min(t.elapsed().as_secs_f64());
    }
    let n = ids.len();
    if let Some(out) = args.get(4) {
        let lines: Vec<String> = ids.iter().map(u32::to_string).collect();
        std::fs::write(out, lines.join("\n") + "\n").expect("write ids");
    }
    println!(
        "ferrolm: {} bytes -> {n} tokens, best of {repeats}: {:.1} ms ({:.2} MB/s); load {:.0} ms",
        text.len(),
        best * 1e3,
        text.len() as f64 / best / 1e6,
        load.as_secs_f64() * 1e3
    );
}
