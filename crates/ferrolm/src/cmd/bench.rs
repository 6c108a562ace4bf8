//! `ferrolm bench`: prompt processing and generation speed, like llama-bench.

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use ferrolm_model::Logits;
use rand::{Rng, SeedableRng};

use super::common::{cuda_model, ModelArgs};
use super::cuda::Split;
use super::telemetry;
use crate::models;
use ferrolm_engine::Forward;

/// Flags of `ferrolm bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens (0: skip the pp test).
    #[arg(short = 'p', long, default_value_t = 512)]
    pub n_prompt: usize,
    /// Generated tokens (0: skip the tg test).
    #[arg(short = 'n', long, default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions; the median is reported.
    #[arg(short = 'r', long, default_value_t = 3)]
    pub reps: usize,
    /// Print `{"ppN": X, "tgN": Y}` only.
    #[arg(long)]
    pub json: bool,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

pub fn run(args: BenchArgs) -> Result<()> {
    let path = models::resolve(args.model.model.as_deref())?;
    let model = args.model.load_model(&path)?;
    let n_vocab = model.plan().n_vocab as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let reps = args.reps.max(1);
    let mut results = Vec::new();
    let n_ctx = args.n_prompt.max(args.n_gen) + 1;
    // The first layers on the GPU only (`--gpu-layers`): the CPU's loops below, through both.
    let (mut gpu, mut split) = match cuda_model(&args.model, &model, n_ctx)? {
        Some(g) if !g.is_whole() => (
            None,
            Some(Split {
                gpu: g,
                cpu: model.session(n_ctx),
            }),
        ),
        other => (other, None),
    };
    if let Some(gpu) = gpu.as_mut() {
        // The prompt as decode steps (one graph launch each); generation as greedy steps whose
        // id stays on the device, the host reading back 4 bytes a token.
        if args.n_prompt > 0 {
            let ids: Vec<u32> = (0..args.n_prompt)
                .map(|_| rng.random_range(0..n_vocab))
                .collect();
            let mut speeds = Vec::new();
            for _ in 0..reps {
                gpu.reset()?;
                let t = Instant::now();
                gpu.eval(&ids, false)?;
                speeds.push(args.n_prompt as f64 / t.elapsed().as_secs_f64());
            }
            if !args.json {
                eprintln!(
                    "ferrolm: CUDA pp: {}",
                    if gpu.batched_prompts() {
                        "batches of GEMMs (cuBLAS, weights dequantized to f16 per matrix)"
                    } else {
                        "decode steps (no cuBLAS found)"
                    }
                );
            }
            results.push((format!("pp{}", args.n_prompt), median(speeds)));
        }
        if args.n_gen > 0 {
            let mut speeds = Vec::new();
            let before = gpu.stats();
            // Each step is queued before the previous one's id is read, as `run` does
            // (FERROLM_BENCH_NO_AHEAD: read each id before queueing the next step, to compare).
            let ahead = std::env::var_os("FERROLM_BENCH_NO_AHEAD").is_none();
            for _ in 0..reps {
                gpu.reset()?;
                gpu.push(rng.random_range(0..n_vocab))?;
                gpu.greedy()?;
                let t = Instant::now();
                for _ in 0..args.n_gen {
                    if ahead {
                        gpu.push_greedy_ahead()?;
                    } else {
                        gpu.push_greedy()?;
                        gpu.greedy()?;
                    }
                }
                gpu.greedy()?;
                speeds.push(args.n_gen as f64 / t.elapsed().as_secs_f64());
            }
            let after = gpu.stats();
            let steps = (after.tokens - before.tokens) as f64;
            let tg = median(speeds.clone());
            let plan = gpu.plan();
            let bytes = plan.weight_bytes_per_token() + plan.kv_bytes_at(args.n_gen / 2);
            if !args.json {
                eprintln!(
                    "ferrolm: CUDA tg: {:.1} MB read per token (weights {:.1} MB + KV at mid-run), {:.0} GB/s at {tg:.1} tok/s; per token {:.2} graph launches ({} kernels each), {:.2} host syncs, {:.2} uploads",
                    bytes as f64 / 1e6,
                    plan.weight_bytes_per_token() as f64 / 1e6,
                    bytes as f64 * tg / 1e9,
                    (after.graph_launches - before.graph_launches) as f64 / steps,
                    plan.launches.len(),
                    (after.host_syncs - before.host_syncs) as f64 / steps,
                    (after.uploads - before.uploads) as f64 / steps,
                );
            }
            results.push((format!("tg{}", args.n_gen), tg));
        }
    } else if args.n_prompt > 0 {
        let ids: Vec<u32> = (0..args.n_prompt)
            .map(|_| rng.random_range(0..n_vocab))
            .collect();
        let mut speeds = Vec::new();
        for _ in 0..reps {
            let t = match split.as_mut() {
                Some(sp) => {
                    sp.truncate(0)?;
                    let t = Instant::now();
                    sp.eval(&ids, Logits::Last)?;
                    t
                }
                None => {
                    let mut s = model.session(args.n_prompt + 1);
                    let t = Instant::now();
                    s.eval(&ids, Logits::Last)?;
                    t
                }
            };
            speeds.push(args.n_prompt as f64 / t.elapsed().as_secs_f64());
        }
        results.push((format!("pp{}", args.n_prompt), median(speeds)));
    }
    if gpu.is_none() && args.n_gen > 0 {
        let mut speeds = Vec::new();
        for _ in 0..reps {
            let mut s = model.session(args.n_gen + 1);
            if let Some(sp) = split.as_mut() {
                sp.truncate(0)?;
            }
            let mut id = rng.random_range(0..n_vocab);
            let t = Instant::now();
            for _ in 0..args.n_gen {
                let logits = match split.as_mut() {
                    Some(sp) => sp.eval(&[id], Logits::Last)?,
                    None => s.eval(&[id], Logits::Last)?,
                };
                id = ferrolm_engine::argmax(&logits);
            }
            speeds.push(args.n_gen as f64 / t.elapsed().as_secs_f64());
        }
        results.push((format!("tg{}", args.n_gen), median(speeds)));
    }
    let peak_rss = telemetry::peak_rss_bytes();
    let cache = model.expert_cache_stats();
    if args.json {
        let mut obj: serde_json::Map<String, serde_json::Value> = results
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::json!(v)))
            .collect();
        if let Some(b) = peak_rss {
            obj.insert("peak_rss_bytes".into(), b.into());
        }
        if let Some(st) = &cache {
            obj.insert("expert_cache".into(), telemetry::expert_cache_json(st));
        }
        println!("{}", serde_json::Value::Object(obj));
        return Ok(());
    }
    let size: u64 = model.file().tensors().iter().map(|t| t.size).sum();
    let name = path
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    let backend = match (&gpu, &split) {
        (Some(g), _) => format!("CUDA ({})", g.device_name()),
        (None, Some(sp)) => format!(
            "CUDA ({}) {} layers + CPU",
            sp.gpu.device_name(),
            sp.gpu.gpu_layers()
        ),
        (None, None) => "CPU".to_string(),
    };
    println!("| model | size | backend | threads | test | t/s |");
    println!("| --- | ---: | --- | ---: | ---: | ---: |");
    for (test, tps) in &results {
        println!(
            "| {name} | {:.1} MiB | {backend} | {} | {test} | {tps:.2} |",
            size as f64 / (1 << 20) as f64,
            model.threads()
        );
    }
    if let Some(b) = peak_rss {
        eprintln!("ferrolm: peak RSS {:.1} MB", b as f64 / (1u64 << 20) as f64);
    }
    if let Some(st) = &cache {
        eprintln!("{}", telemetry::expert_cache_line(st));
    }
    Ok(())
}
