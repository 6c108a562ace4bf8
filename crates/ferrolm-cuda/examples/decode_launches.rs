//! Prints the launches of a GGUF's lowered CUDA decode step, counted per kernel, on a machine
//! without a GPU: how many kernels a token takes (issue 19 reports launches per token) and
//! which ones to fuse.
//!
//! `cargo run --release -p ferrolm-cuda --example decode_launches -- FILE.gguf [N_CTX] [--list]`
//! (`--list`: every launch in order, with its grid and block).

use std::collections::BTreeMap;

use ferrolm_cuda::schedule::decode_plan_with;
use ferrolm_cuda::CudaTuning;
use ferrolm_model::Model;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let list = args.iter().any(|a| a == "--list");
    let mut plain = args.iter().filter(|a| !a.starts_with("--"));
    let Some(path) = plain.next() else {
        eprintln!("usage: decode_launches FILE.gguf [N_CTX] [--list]");
        std::process::exit(2);
    };
    let n_ctx = plain.next().and_then(|n| n.parse().ok()).unwrap_or(4096);
    let model = match Model::load(path, 1) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("{path}: {e}");
            std::process::exit(1);
        }
    };
    let layers = model.plan().layers.len();
    let tuning = CudaTuning::from_env();
    let plan = match decode_plan_with(model.plan(), model.weights(), n_ctx, layers, &tuning) {
        Ok(p) => p,
        Err(d) => {
            eprintln!("the CUDA backend declines {path}: {d}");
            std::process::exit(1);
        }
    };
    let mut per_kernel: BTreeMap<&str, usize> = BTreeMap::new();
    for l in &plan.launches {
        *per_kernel.entry(l.kernel.as_str()).or_default() += 1;
        if list {
            println!("{} grid {:?} block {}", l.kernel, l.grid, l.block);
        }
    }
    let mut counts: Vec<_> = per_kernel.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    println!(
        "{} launches a token, {layers} layers, {:.1} MB of weights read a token",
        plan.launches.len(),
        plan.weight_bytes_per_token() as f64 / 1e6
    );
    for (kernel, n) in counts {
        println!("{n:6}  {kernel}");
    }
}
