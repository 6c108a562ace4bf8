//! `ferrolm bench`: prompt processing and generation speed, like llama-bench, and with
//! `--batch` aggregate speeds over several sequences, like llama-batched-bench.

use std::time::Instant;

use anyhow::{bail, Result};
use clap::Args;
use ferrolm_engine::{argmax, eval_one, Backend, SamplerParams, SlotInput};
use ferrolm_model::Logits;
use rand::{Rng, SeedableRng};

use super::common::{open_backend, ModelArgs};
use super::telemetry;
use crate::models;

/// Flags of `ferrolm bench`.
#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens (0: skip the pp test); with --batch, per sequence.
    #[arg(short = 'p', long, default_value_t = 512)]
    pub n_prompt: usize,
    /// Generated tokens (0: skip the tg test); with --batch, per sequence.
    #[arg(short = 'n', long, default_value_t = 128)]
    pub n_gen: usize,
    /// Repetitions; the median is reported, with the repetitions' standard deviation.
    #[arg(short = 'r', long, default_value_t = 3)]
    pub reps: usize,
    /// Sequences decoded together, a comma-separated list (`1,4,16,64`): per batch size, the
    /// prompts of every sequence, then `-n` steps each generating one token per sequence,
    /// reported as llama-batched-bench's table (tok/s aggregated over the sequences).
    #[arg(long, value_name = "B,B,...")]
    pub batch: Option<String>,
    /// Print `{"ppN": X, "tgN": Y}` only (with --batch: `{"batch": {"B": {"pp": X, "tg": Y}}}`).
    #[arg(long)]
    pub json: bool,
}

/// The median of the repetitions' speeds and their sample standard deviation (0 for one
/// repetition), as llama-bench reports a spread beside each speed.
fn median_and_spread(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    let mean = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
    (v[v.len() / 2], var.sqrt())
}

/// Parses `1,4,16` into batch sizes (each at least 1).
fn batch_sizes(s: &str) -> Result<Vec<usize>> {
    let sizes = s
        .split(',')
        .map(|p| match p.trim().parse::<usize>() {
            Ok(b) if (1..=256).contains(&b) => Ok(b),
            _ => bail!("--batch {s:?}: each batch size is a number from 1 to 256"),
        })
        .collect::<Result<Vec<_>>>()?;
    if sizes.is_empty() {
        bail!("--batch: no batch size given");
    }
    Ok(sizes)
}

pub fn run(args: BenchArgs) -> Result<()> {
    let path = models::resolve(args.model.model.as_deref())?;
    let model = args.model.load_model(&path)?;
    let batches = args.batch.as_deref().map(batch_sizes).transpose()?;
    let slots = batches
        .as_ref()
        .map_or(1, |b| b.iter().copied().max().unwrap_or(1));
    let n_ctx = args.n_prompt + args.n_gen + 1;
    let mut backend = open_backend(&args.model, &model, n_ctx, slots)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(42);
    let reps = args.reps.max(1);
    if let Some(batches) = batches {
        return batched(&args, backend.as_mut(), &batches, &mut rng);
    }
    let n_vocab = backend.n_vocab() as u32;
    let mut results = Vec::new();
    if args.n_prompt > 0 {
        let ids: Vec<u32> = (0..args.n_prompt)
            .map(|_| rng.random_range(0..n_vocab))
            .collect();
        let mut speeds = Vec::new();
        for _ in 0..reps {
            backend.truncate(0, 0)?;
            let t = Instant::now();
            eval_one(backend.as_mut(), 0, &ids, Logits::Last)?;
            speeds.push(args.n_prompt as f64 / t.elapsed().as_secs_f64());
        }
        results.push((format!("pp{}", args.n_prompt), median_and_spread(speeds)));
    }
    if args.n_gen > 0 {
        // Greedy steps; where the device chooses, each step is queued before the previous
        // one's id is read (as `run` does), the host reading back 4 bytes a token.
        let on_device = backend.sample_on_device(0, Some(&SamplerParams::greedy()))?;
        let mut speeds = Vec::new();
        for _ in 0..reps {
            backend.truncate(0, 0)?;
            let mut logits = eval_one(
                backend.as_mut(),
                0,
                &[rng.random_range(0..n_vocab)],
                Logits::Last,
            )?;
            if on_device {
                backend.chosen(0)?;
            }
            let t = Instant::now();
            for _ in 0..args.n_gen {
                if on_device {
                    backend.step_chosen(0)?;
                } else {
                    logits = eval_one(backend.as_mut(), 0, &[argmax(&logits)], Logits::Last)?;
                }
            }
            if on_device {
                backend.chosen(0)?;
            }
            speeds.push(args.n_gen as f64 / t.elapsed().as_secs_f64());
        }
        if on_device {
            backend.sample_on_device(0, None)?;
        }
        let (tg, spread) = median_and_spread(speeds);
        if let Some(line) = backend.decode_report(tg, args.n_gen / 2) {
            if !args.json {
                eprintln!("ferrolm: tg: {line}");
            }
        }
        results.push((format!("tg{}", args.n_gen), (tg, spread)));
    }
    let peak_rss = telemetry::peak_rss_bytes();
    let cache = model.expert_cache_stats();
    let tiers = backend.expert_tier_stats();
    if args.json {
        let mut obj = serde_json::Map::new();
        for (test, (tps, spread)) in &results {
            obj.insert(test.clone(), serde_json::json!(tps));
            obj.insert(format!("{test}_sd"), serde_json::json!(spread));
        }
        if let Some(b) = peak_rss {
            obj.insert("peak_rss_bytes".into(), b.into());
        }
        if let Some(st) = &cache {
            obj.insert("expert_cache".into(), telemetry::expert_cache_json(st));
        }
        if let Some(st) = &tiers {
            obj.insert("expert_tiers".into(), telemetry::expert_tier_json(st));
        }
        println!("{}", serde_json::Value::Object(obj));
        return Ok(());
    }
    let size: u64 = model.file().tensors().iter().map(|t| t.size).sum();
    let name = path
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    let where_ = backend.describe();
    println!("| model | size | backend | threads | test | t/s | sd |");
    println!("| --- | ---: | --- | ---: | ---: | ---: | ---: |");
    for (test, (tps, spread)) in &results {
        println!(
            "| {name} | {:.1} MiB | {where_} | {} | {test} | {tps:.2} | {spread:.2} |",
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
    if let Some(st) = &tiers {
        eprintln!("{}", telemetry::expert_tier_line(st));
    }
    Ok(())
}

/// One batch size's figures: seconds for the prompts and for the generation.
struct BatchRun {
    pp_s: f64,
    tg_s: f64,
}

/// `-p` prompt tokens in each of `b` slots (one call), then `-n` steps of one greedy token per
/// slot (one call each, the choices made where the backend can): every matrix read once per
/// call.
fn batched_once(
    args: &BenchArgs,
    backend: &mut dyn Backend,
    b: usize,
    rng: &mut impl Rng,
) -> Result<BatchRun> {
    let n_vocab = backend.n_vocab() as u32;
    for slot in 0..b {
        backend.truncate(slot, 0)?;
    }
    let prompts: Vec<Vec<u32>> = (0..b)
        .map(|_| {
            (0..args.n_prompt.max(1))
                .map(|_| rng.random_range(0..n_vocab))
                .collect()
        })
        .collect();
    let t = Instant::now();
    let inputs: Vec<SlotInput<'_>> = prompts
        .iter()
        .enumerate()
        .map(|(slot, ids)| SlotInput {
            slot,
            ids,
            want: Logits::Last,
        })
        .collect();
    let mut next = Vec::with_capacity(b);
    for out in backend.forward_greedy(&inputs) {
        next.push([out.map_err(|e| anyhow::anyhow!("{e}"))?]);
    }
    let pp_s = t.elapsed().as_secs_f64();
    if b == 1 && backend.sample_on_device(0, Some(&SamplerParams::greedy()))? {
        // One sequence: the single stream's own path, each step queued before the previous
        // one's choice is read.
        backend.chosen(0)?;
        let t = Instant::now();
        for _ in 0..args.n_gen {
            backend.step_chosen(0)?;
        }
        backend.chosen(0)?;
        let tg_s = t.elapsed().as_secs_f64();
        backend.sample_on_device(0, None)?;
        return Ok(BatchRun { pp_s, tg_s });
    }
    let t = Instant::now();
    for _ in 0..args.n_gen {
        let inputs: Vec<SlotInput<'_>> = next
            .iter()
            .enumerate()
            .map(|(slot, id)| SlotInput {
                slot,
                ids: id,
                want: Logits::Last,
            })
            .collect();
        let outs = backend.forward_greedy(&inputs);
        let mut chosen = Vec::with_capacity(b);
        for out in outs {
            chosen.push([out.map_err(|e| anyhow::anyhow!("{e}"))?]);
        }
        next = chosen;
    }
    Ok(BatchRun {
        pp_s,
        tg_s: t.elapsed().as_secs_f64(),
    })
}

fn batched(
    args: &BenchArgs,
    backend: &mut dyn Backend,
    batches: &[usize],
    rng: &mut impl Rng,
) -> Result<()> {
    let most = backend.n_slots();
    if let Some(&b) = batches.iter().find(|&&b| b > most) {
        bail!(
            "--batch {b}: {} holds {most} sequence(s) at a time",
            backend.describe()
        );
    }
    let (pp, tg) = (args.n_prompt.max(1), args.n_gen);
    let mut rows = Vec::new();
    for &b in batches {
        let runs = (0..args.reps.max(1))
            .map(|_| batched_once(args, backend, b, rng))
            .collect::<Result<Vec<_>>>()?;
        let pp_s = median_and_spread(runs.iter().map(|r| r.pp_s).collect()).0;
        let tg_s = median_and_spread(runs.iter().map(|r| r.tg_s).collect()).0;
        rows.push((b, pp_s, tg_s));
    }
    let rate = |tokens: usize, s: f64| tokens as f64 / s.max(1e-9);
    if args.json {
        let obj: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|&(b, pp_s, tg_s)| {
                (
                    b.to_string(),
                    serde_json::json!({"pp": rate(b * pp, pp_s), "tg": rate(b * tg, tg_s)}),
                )
            })
            .collect();
        println!("{}", serde_json::json!({ "batch": obj }));
        return Ok(());
    }
    println!("backend: {}", backend.describe());
    println!(
        "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |"
    );
    println!(
        "|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|"
    );
    for (b, pp_s, tg_s) in rows {
        let n_kv = b * (pp + tg);
        println!(
            "| {pp:5} | {tg:6} | {b:4} | {n_kv:6} | {pp_s:8.3} | {:8.2} | {tg_s:8.3} | {:8.2} | {:8.3} | {:8.2} |",
            rate(b * pp, pp_s),
            rate(b * tg, tg_s),
            pp_s + tg_s,
            rate(n_kv, pp_s + tg_s),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_spread_of_repetitions() {
        assert_eq!(median_and_spread(vec![5.0]), (5.0, 0.0));
        let (m, sd) = median_and_spread(vec![3.0, 1.0, 2.0]);
        assert_eq!(m, 2.0);
        assert!((sd - 1.0).abs() < 1e-12, "{sd}");
        let (m, sd) = median_and_spread(vec![10.0, 10.0, 40.0, 20.0]);
        assert_eq!(m, 20.0);
        assert!((sd - 200f64.sqrt()).abs() < 1e-9, "{sd}");
    }
}
