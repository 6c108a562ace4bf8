//! `ferrolm bench`: prompt processing and generation speed, like llama-bench.

use std::time::Instant;

use anyhow::Result;
use clap::Args;
use ferrolm_model::{Logits, Model};
use rand::{Rng, SeedableRng};

use super::common::ModelArgs;
use crate::models;

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
    let model = Model::load(&path, args.model.threads)?;
    let n_vocab = model.plan().n_vocab as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let reps = args.reps.max(1);
    let mut results = Vec::new();
    if args.n_prompt > 0 {
        let ids: Vec<u32> = (0..args.n_prompt)
            .map(|_| rng.random_range(0..n_vocab))
            .collect();
        let mut speeds = Vec::new();
        for _ in 0..reps {
            let mut s = model.session(args.n_prompt + 1);
            let t = Instant::now();
            s.eval(&ids, Logits::Last)?;
            speeds.push(args.n_prompt as f64 / t.elapsed().as_secs_f64());
        }
        results.push((format!("pp{}", args.n_prompt), median(speeds)));
    }
    if args.n_gen > 0 {
        let mut speeds = Vec::new();
        for _ in 0..reps {
            let mut s = model.session(args.n_gen + 1);
            let mut id = rng.random_range(0..n_vocab);
            let t = Instant::now();
            for _ in 0..args.n_gen {
                let logits = s.eval(&[id], Logits::Last)?;
                id = ferrolm_engine::argmax(&logits);
            }
            speeds.push(args.n_gen as f64 / t.elapsed().as_secs_f64());
        }
        results.push((format!("tg{}", args.n_gen), median(speeds)));
    }
    if args.json {
        let obj: serde_json::Map<String, serde_json::Value> = results
            .iter()
            .map(|(k, v)| (k.clone(), serde_json::json!(v)))
            .collect();
        println!("{}", serde_json::Value::Object(obj));
        return Ok(());
    }
    let size: u64 = model.file().tensors().iter().map(|t| t.size).sum();
    let name = path
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    println!("| model | size | backend | threads | test | t/s |");
    println!("| --- | ---: | --- | ---: | ---: | ---: |");
    for (test, tps) in &results {
        println!(
            "| {name} | {:.1} MiB | CPU | {} | {test} | {tps:.2} |",
            size as f64 / (1 << 20) as f64,
            model.threads()
        );
    }
    Ok(())
}
