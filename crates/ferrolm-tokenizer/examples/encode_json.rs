//! Encodes a JSON array of strings (stdin) with a model's tokenizer; prints a JSON array of id
//! arrays (stdout). For ad-hoc comparisons with llama.cpp:
//! `cargo run --release -p ferrolm-tokenizer --example encode_json -- MODEL.gguf [add_special] [parse_special] < strings.json`

use std::io::Read;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let gguf = ferrolm_gguf::GgufFile::open(args.get(1).expect("usage: encode_json MODEL.gguf"))
        .expect("open GGUF");
    let tok = ferrolm_tokenizer::Tokenizer::from_metadata(gguf.metadata()).expect("tokenizer");
    let flag = |i: usize| args.get(i).is_none_or(|s| s == "true" || s == "1");
    let mut input = String::new();
    std::io::stdin()
        .read_to_string(&mut input)
        .expect("read stdin");
    let strings: Vec<String> = serde_json::from_str(&input).expect("a JSON array of strings");
    let ids: Vec<Vec<u32>> = strings
        .iter()
        .map(|s| tok.encode(s, flag(2), flag(3)))
        .collect();
    println!("{}", serde_json::to_string(&ids).expect("json"));
}
