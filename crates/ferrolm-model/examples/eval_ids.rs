//! Evaluates token ids with one thread, for tensor-by-tensor comparison with llama.cpp
//! (`FERROLM_DUMP=dir`, scripts/dump_compare.py), without the CLI.
//!
//! usage: cargo run --release -p ferrolm-model --example eval_ids -- MODEL.gguf 1,2,3 [OUT]
//! [--no-repack] [--no-tiled] (mirror llama.cpp with `use_extra_bufts = false`, with
//! `GGML_CPU_TILED_MM=0`)

use ferrolm_model::{LoadOptions, Logits, Model};
use ferrolm_quant::KernelOptions;

fn main() {
    let all: Vec<String> = std::env::args().collect();
    let flag = |f: &str| all.iter().any(|a| a == f);
    let kernels = KernelOptions {
        repack: !flag("--no-repack"),
        tiled: !flag("--no-tiled"),
        ..Default::default()
    };
    let args: Vec<&String> = all.iter().filter(|a| !a.starts_with("--")).collect();
    let options = LoadOptions {
        threads: 1,
        kernels,
        ..Default::default()
    };
    let mut model = Model::load_with(args[1], &options).expect("model");
    model.set_dump_dir(std::env::var_os("FERROLM_DUMP").map(Into::into));
    let ids: Vec<u32> = args[2].split(',').map(|s| s.parse().unwrap()).collect();
    let mut s = model.session(1024);
    let logits = s.eval(&ids, Logits::All).expect("eval");
    let n_vocab = model.plan().n_vocab;
    let bytes: Vec<u8> = logits.iter().flat_map(|v| v.to_le_bytes()).collect();
    std::fs::write(
        args.get(3)
            .map_or("/tmp/ferrolm_logits.f32", |s| s.as_str()),
        bytes,
    )
    .unwrap();
    eprintln!("{} positions x {n_vocab}", ids.len());
}
