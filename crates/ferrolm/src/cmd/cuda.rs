//! `ferrolm cuda-check`, which compares the CUDA backend with its CPU twin on the same file (a
//! GPU machine's test); it reaches past the backend interface to the device's own paths.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use ferrolm_cuda::{CudaModel, CudaOptions, Device};
use ferrolm_engine::{eval_one, GenerateParams, Sampler};
use ferrolm_model::{Logits, Model};
use rand::{Rng, SeedableRng};

use super::common::ModelArgs;
use crate::models;

/// Flags of `ferrolm cuda-check`.
#[derive(Args, Debug)]
pub struct CheckArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt positions compared (random ids).
    #[arg(short = 'p', long, default_value_t = 128)]
    pub n_prompt: usize,
    /// Greedy tokens compared after the prompt.
    #[arg(short = 'n', long, default_value_t = 32)]
    pub n_gen: usize,
    /// Largest mean KL divergence (CPU || CUDA) that passes.
    #[arg(long, default_value_t = 1e-3)]
    pub max_kl: f64,
    /// Smallest top-1 agreement that passes.
    #[arg(long, default_value_t = 0.99)]
    pub min_top1: f64,
    /// Seed of the prompt ids.
    #[arg(long, default_value_t = 7)]
    pub seed: u64,
    /// Take the prompts from this text (UTF-8; its tokens in order, the vocabulary's BOS
    /// first) instead of random ids: random ids through a real model give activations that no
    /// text does.
    #[arg(long, value_name = "FILE")]
    pub text: Option<std::path::PathBuf>,
    /// Also time each kernel (CUDA events, outside the graph) over this many extra steps.
    #[arg(long, default_value_t = 0)]
    pub profile: usize,
    /// Instead, check batched decoding: this many sequences with prompts of different
    /// lengths, decoded together, joining and leaving mid-stream, each against the CPU.
    #[arg(long, value_name = "B")]
    pub batch: Option<usize>,
}

/// Where the prompts' ids come from: a text's tokens, handed out in order, or random ids.
enum Prompts {
    Text {
        tokens: Vec<u32>,
        next: usize,
    },
    Random {
        rng: Box<rand::rngs::StdRng>,
        n_vocab: u32,
    },
}

impl Prompts {
    /// `--text`'s tokens (the model file's tokenizer) or the seed's ids.
    fn new(args: &CheckArgs, model: &Model) -> Result<Prompts> {
        let Some(file) = &args.text else {
            let rng = Box::new(rand::rngs::StdRng::seed_from_u64(args.seed));
            return Ok(Prompts::Random {
                rng,
                n_vocab: model.plan().n_vocab as u32,
            });
        };
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("reading {} (UTF-8 text)", file.display()))?;
        let tokenizer = ferrolm_tokenizer::Tokenizer::from_metadata(model.file().metadata())
            .context("reading the model's tokenizer")?;
        Ok(Prompts::from_tokens(tokenizer.encode(&text, true, false)))
    }

    fn from_tokens(tokens: Vec<u32>) -> Prompts {
        Prompts::Text { tokens, next: 0 }
    }

    /// The next prompt of `len` ids: the text's next `len` tokens, or `len` random ids.
    fn take(&mut self, len: usize) -> Result<Vec<u32>> {
        match self {
            Prompts::Random { rng, n_vocab } => {
                Ok((0..len).map(|_| rng.random_range(0..*n_vocab)).collect())
            }
            Prompts::Text { tokens, next } => {
                let Some(ids) = tokens.get(*next..*next + len) else {
                    bail!(
                        "--text holds {} tokens; the prompts need {} (positions {}..{})",
                        tokens.len(),
                        *next + len,
                        *next,
                        *next + len
                    );
                };
                *next += len;
                Ok(ids.to_vec())
            }
        }
    }
}

fn log_softmax(l: &[f32]) -> Vec<f64> {
    let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = l.iter().map(|&v| (v as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    l.iter().map(|&v| v as f64 - lse).collect()
}

/// KL(p || q) of two logit rows.
fn kl(p: &[f32], q: &[f32]) -> f64 {
    let (lp, lq) = (log_softmax(p), log_softmax(q));
    lp.iter()
        .zip(&lq)
        .map(|(a, b)| a.exp() * (a - b))
        .sum::<f64>()
        .max(0.0)
}

/// `cuda-check --gpu-layers N`: the model split between the GPU (first N layers) and the CPU
/// against the CPU alone: every position of a random prompt, then greedy continuations.
fn check_split(
    args: &CheckArgs,
    model: &Model,
    cuda: CudaOptions,
    prompts: &mut Prompts,
) -> Result<()> {
    let n_ctx = cuda.n_ctx;
    let n_vocab = model.plan().n_vocab;
    let ids = prompts.take(args.n_prompt.max(1))?;
    let layers = cuda.gpu_layers.unwrap_or(usize::MAX);
    let mut split = ferrolm_cuda::open(model, &cuda)
        .map_err(|e| anyhow::anyhow!("cuda:{}: {e}", cuda.ordinal))?;
    let mut cpu = model.session(n_ctx);
    let t = Instant::now();
    let cpu_logits = cpu.eval(&ids, Logits::All)?;
    let cpu_time = t.elapsed();
    let t = Instant::now();
    let split_logits = eval_one(split.as_mut(), 0, &ids, Logits::All)?;
    let row = compare("split", &cpu_logits, &split_logits, n_vocab, t.elapsed());
    let n = ids.len();
    let (mut a, mut b) = (
        ferrolm_engine::argmax(&cpu_logits[(n - 1) * n_vocab..]),
        ferrolm_engine::argmax(&split_logits[(n - 1) * n_vocab..]),
    );
    let mut same = 0;
    for _ in 0..args.n_gen {
        if a != b {
            break;
        }
        same += 1;
        a = ferrolm_engine::argmax(&cpu.eval(&[a], Logits::Last)?);
        b = ferrolm_engine::argmax(&eval_one(split.as_mut(), 0, &[b], Logits::Last)?);
    }
    println!(
        "| file | layers on the GPU | positions | mean KL | max KL | top-1 (ties within {TIE}) | top-1 raw | greedy same | CPU pp tok/s | split pp tok/s |"
    );
    println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    println!(
        "| {} | {layers} of {} | {n} | {:.2e} | {:.2e} | {:.2}% | {:.2}% | {same}/{} | {:.1} | {:.1} |",
        args.model.model.as_deref().unwrap_or("default"),
        model.plan().layers.len(),
        row.mean_kl,
        row.max_kl,
        100.0 * row.top1_tied,
        100.0 * row.top1,
        args.n_gen,
        n as f64 / cpu_time.as_secs_f64(),
        n as f64 / row.time.as_secs_f64(),
    );
    if row.mean_kl > args.max_kl || row.top1_tied < args.min_top1 {
        bail!(
            "the split model differs from the CPU: mean KL {:.2e}, top-1 {:.2}%",
            row.mean_kl,
            100.0 * row.top1_tied
        );
    }
    Ok(())
}

/// `cuda-check --batch B`: B sequences on the GPU's slots, each against its own CPU session.
/// Sequence s has a prompt of `-p` minus 9s ids (at least 2) and generates `-n` tokens; the
/// odd ones join 3 steps late and sequence s leaves 2s steps early, so batches of every size
/// and mixed prompt/decode steps occur. Each step's tokens are the CPU's greedy choices (both
/// sides evaluate the same ids); every row of logits is compared.
fn check_batched(
    args: &CheckArgs,
    model: &Model,
    cuda: CudaOptions,
    ids: &mut Prompts,
) -> Result<()> {
    let b = cuda.slots;
    let n_vocab = model.plan().n_vocab;
    let mut gpu = ferrolm_cuda::open(model, &cuda)
        .map_err(|e| anyhow::anyhow!("cuda:{}: {e}", cuda.ordinal))?;
    if gpu.n_slots() < b {
        bail!(
            "{} holds {} sequences, not {b}",
            gpu.describe(),
            gpu.n_slots()
        );
    }
    let prompts: Vec<Vec<u32>> = (0..b)
        .map(|s| ids.take(args.n_prompt.saturating_sub(9 * s).max(2)))
        .collect::<Result<_>>()?;
    let start = |s: usize| if s % 2 == 1 { 3 } else { 0 };
    let end = |s: usize| start(s) + args.n_gen.saturating_sub(2 * s).max(1);
    let mut cpu: Vec<_> = (0..b).map(|_| model.session(cuda.n_ctx)).collect();
    // The id each sequence evaluates next (its prompt first).
    let mut next: Vec<Vec<u32>> = prompts.clone();
    let (mut cpu_rows, mut gpu_rows) = (Vec::new(), Vec::new());
    let mut sizes = Vec::new();
    let t = Instant::now();
    let last_step = (0..b).map(end).max().unwrap_or(0);
    for step in 0..=last_step {
        let active: Vec<usize> = (0..b)
            .filter(|&s| step >= start(s) && step <= end(s))
            .collect();
        if active.is_empty() {
            continue;
        }
        let inputs: Vec<ferrolm_engine::SlotInput<'_>> = active
            .iter()
            .map(|&s| ferrolm_engine::SlotInput {
                slot: s,
                ids: &next[s],
                want: Logits::Last,
            })
            .collect();
        sizes.push(inputs.len());
        let outs = gpu.forward(&inputs);
        let mut chosen = Vec::new();
        for (&s, out) in active.iter().zip(outs) {
            let g = out.map_err(|e| anyhow::anyhow!("slot {s}, step {step}: {e}"))?;
            let c = cpu[s].eval(&next[s], Logits::Last)?;
            chosen.push((s, ferrolm_engine::argmax(&c)));
            cpu_rows.extend_from_slice(&c);
            gpu_rows.extend_from_slice(&g);
        }
        for (s, id) in chosen {
            next[s] = vec![id];
        }
    }
    let row = compare("batched", &cpu_rows, &gpu_rows, n_vocab, t.elapsed());
    drop(gpu);
    if args.profile > 0 {
        profile_rows(model, b, &cuda)?;
    }
    check_selections(model, &cpu_rows, cuda)?;
    let most = sizes.iter().copied().max().unwrap_or(0);
    println!(
        "| file | sequences | rows compared | batch sizes | mean KL | max KL | top-1 (ties within {TIE}) | top-1 raw | max abs logit diff |"
    );
    println!("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |");
    println!(
        "| {} | {b} | {} | 1..{most} | {:.2e} | {:.2e} | {:.2}% | {:.2}% | {:.3} |",
        args.model.model.as_deref().unwrap_or("default"),
        cpu_rows.len() / n_vocab,
        row.mean_kl,
        row.max_kl,
        100.0 * row.top1_tied,
        100.0 * row.top1,
        row.max_diff,
    );
    if row.mean_kl > args.max_kl || row.top1_tied < args.min_top1 {
        bail!(
            "batched decoding differs from the CPU: mean KL {:.2e}, top-1 {:.2}%",
            row.mean_kl,
            100.0 * row.top1_tied
        );
    }
    Ok(())
}

/// One batched step of `b` rows, launch by launch (events): where its time goes.
fn profile_rows(model: &Model, b: usize, cuda: &CudaOptions) -> Result<()> {
    let mut gpu = CudaModel::with_slots(
        model,
        cuda.ordinal,
        cuda.n_ctx,
        usize::MAX,
        b + 1,
        &cuda.tuning,
    )
    .map_err(|e| anyhow::anyhow!("cuda:{}: {e}", cuda.ordinal))?;
    // The first run warms cuBLAS up; the second is timed.
    gpu.profile_rows(b)?;
    let rows = gpu.profile_rows(b)?;
    print_launches(&format!("a batched step of {b} rows"), &rows);
    Ok(())
}

/// Timed launches (kernel, launches, microseconds) as a table under `what`'s total.
fn print_launches(what: &str, rows: &[(String, usize, f64)]) {
    let total: f64 = rows.iter().map(|r| r.2).sum();
    println!("{what}, launch by launch (events): {total:.1} us");
    println!("| kernel | launches | us | share |");
    println!("| --- | ---: | ---: | ---: |");
    for (name, n, us) in rows {
        println!("| {name} | {n} | {us:.1} | {:.1}% |", 100.0 * us / total);
    }
}

/// The batched step's greedy choices and top-k candidates (`argmax_rows`, `topk_rows`) against
/// the host's on the very same values: the CPU's rows of a run, and the same rows rounded to
/// a few levels so that many values tie (the first of equal values wins, as on the host).
fn check_selections(model: &Model, rows: &[f32], cuda: CudaOptions) -> Result<()> {
    let n_vocab = model.plan().n_vocab;
    let mut gpu = CudaModel::with_tuning(model, cuda.ordinal, cuda.n_ctx, &cuda.tuning)
        .map_err(|e| anyhow::anyhow!("cuda:{}: {e}", cuda.ordinal))?;
    let n = (rows.len() / n_vocab).min(64);
    let rows = &rows[..n * n_vocab];
    let tied: Vec<f32> = rows.iter().map(|v| (v * 2.0).round() / 2.0).collect();
    let k = 40;
    let mut differ = 0;
    for values in [rows, &tied[..]] {
        let (greedy, top) = gpu.select_rows(values, k)?;
        for (r, row) in values.chunks_exact(n_vocab).enumerate() {
            let want = ferrolm_engine::top_k(row, k);
            let mut got = top[r].clone();
            got.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            differ += usize::from(greedy[r] != ferrolm_engine::argmax(row) || got != want);
        }
    }
    println!(
        "device selections (greedy, top-{k}) over {} rows, as given and with ties: {} differ from the host's",
        2 * n,
        differ
    );
    if differ > 0 {
        bail!("the device's greedy or top-k selections differ from the host's on {differ} rows");
    }
    Ok(())
}

/// The device's sampler against the host's on the same logits (the device's own): llama.cpp's
/// default chain (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), both drawing from the
/// same seeded generator; each step goes on with the device's token.
fn sampling_check(gpu: &mut CudaModel, ids: &[u32]) -> Result<()> {
    let params = GenerateParams {
        max_tokens: 0,
        sampler: ferrolm_engine::SamplerParams {
            seed: 11,
            ..Default::default()
        },
        stop_at_eog: false,
    };
    let Ok(Some(on_device)) = ferrolm_cuda::device_sampling(&params.sampler) else {
        return Ok(());
    };
    let steps = 64.min(gpu.n_ctx() / 2);
    let prompt = &ids[..ids.len().min(gpu.n_ctx() - steps - 1)];
    gpu.reset()?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(params.sampler.seed);
    let mut draw = || rng.random::<f32>();
    gpu.set_sampling(Some(on_device), &mut draw)?;
    let mut host = Sampler::new(params.sampler.clone());
    gpu.ensure_draws(&mut draw)?;
    let mut logits = gpu.eval(prompt, false)?;
    let mut agree = 0;
    for _ in 0..steps {
        let want = host.sample(&logits, &[]);
        let got = gpu.greedy()?;
        agree += usize::from(want == got);
        gpu.ensure_draws(&mut draw)?;
        gpu.push_greedy()?;
        logits = gpu.logits()?;
    }
    gpu.set_sampling(None, &mut draw)?;
    println!(
        "device sampling (top-k 40, top-p 0.95, min-p 0.05, temperature 0.8): {agree}/{steps} tokens as the host sampler picks from the same logits and draws"
    );
    if agree < steps {
        bail!(
            "the device sampler disagreed with the host's at {} of {steps} steps",
            steps - agree
        );
    }
    Ok(())
}

/// One CUDA path's logits against the CPU's.
struct Comparison {
    path: &'static str,
    mean_kl: f64,
    max_kl: f64,
    top1: f64,
    /// Top-1 agreement counting a CUDA pick whose CPU logit is within [`TIE`] of the CPU's
    /// maximum as agreeing (random-weight files have near-ties; MODELS.md).
    top1_tied: f64,
    max_diff: f32,
    time: std::time::Duration,
}

/// Logits this close to the maximum count as tied for top-1.
const TIE: f32 = 0.01;

fn compare(
    path: &'static str,
    cpu: &[f32],
    gpu: &[f32],
    n_vocab: usize,
    time: std::time::Duration,
) -> Comparison {
    let (mut sum_kl, mut max_kl, mut agree, mut max_diff) = (0f64, 0f64, 0usize, 0f32);
    let (mut n, mut tied) = (0usize, 0usize);
    for (c, g) in cpu.chunks(n_vocab).zip(gpu.chunks(n_vocab)) {
        let k = kl(c, g);
        sum_kl += k;
        max_kl = max_kl.max(k);
        let (best, pick) = (ferrolm_engine::argmax(c), ferrolm_engine::argmax(g));
        agree += usize::from(best == pick);
        tied += usize::from(c[pick as usize] >= c[best as usize] - TIE);
        for (a, b) in c.iter().zip(g) {
            max_diff = max_diff.max((a - b).abs());
        }
        n += 1;
    }
    let n = n.max(1) as f64;
    Comparison {
        path,
        mean_kl: sum_kl / n,
        max_kl,
        top1: agree as f64 / n,
        top1_tied: tied as f64 / n,
        max_diff,
        time,
    }
}

/// `ferrolm cuda-check`: every position's logits of a prompt (random ids, or `--text`) on the
/// CPU and on CUDA (mean and max KL, top-1 agreement, largest logit difference), then greedy
/// continuations.
pub fn check(args: CheckArgs) -> Result<()> {
    let path = models::resolve(args.model.model.as_deref())?;
    let model = args.model.load_model(&path)?;
    let n_ctx = args.n_prompt + args.n_gen + 1;
    let ordinal = match args.model.device.as_deref().map(str::parse::<Device>) {
        None => 0,
        Some(Ok(Device::Cuda(n))) => n,
        Some(Ok(Device::Cpu)) => {
            bail!("cuda-check compares CUDA with the CPU: --device cuda[:N]")
        }
        Some(Err(e)) => bail!(e),
    };
    let n_layer = model.plan().layers.len();
    let tuning = args.model.cuda_tuning()?;
    let mut prompts = Prompts::new(&args, &model)?;
    let gpu_layers = args.model.gpu_layers.unwrap_or(n_layer);
    if let Some(b) = args.batch {
        let cuda = CudaOptions {
            ordinal,
            n_ctx,
            gpu_layers: None,
            slots: b.max(2),
            tuning: tuning.clone(),
        };
        return check_batched(&args, &model, cuda, &mut prompts);
    }
    if gpu_layers < n_layer {
        let cuda = CudaOptions {
            ordinal,
            n_ctx,
            gpu_layers: Some(gpu_layers),
            slots: 1,
            tuning: tuning.clone(),
        };
        return check_split(&args, &model, cuda, &mut prompts);
    }
    let mut gpu = CudaModel::with_tuning(&model, ordinal, n_ctx, &tuning)
        .map_err(|e| anyhow::anyhow!("cuda:{ordinal}: {e}"))?;
    eprintln!(
        "ferrolm: comparing {} (cuda:{ordinal}, graph: {}) with the CPU ({} threads)",
        gpu.device_name(),
        gpu.uses_graph(),
        model.threads()
    );
    let n_vocab = model.plan().n_vocab;
    let ids = prompts.take(args.n_prompt.max(1))?;
    let t = Instant::now();
    let mut cpu = model.session(n_ctx);
    let cpu_logits = cpu.eval(&ids, Logits::All)?;
    let cpu_time = t.elapsed();
    // Every position through decode steps (the graph), then again as one prompt batch.
    let t = Instant::now();
    let step_logits = gpu.eval_steps(&ids)?;
    let step_time = t.elapsed();
    let mut rows = vec![compare(
        "decode steps",
        &cpu_logits,
        &step_logits,
        n_vocab,
        step_time,
    )];
    if gpu.batched_prompts() {
        gpu.reset()?;
        let t = Instant::now();
        let batch_logits = gpu.eval(&ids, true)?;
        rows.push(compare(
            "prompt batch",
            &cpu_logits,
            &batch_logits,
            n_vocab,
            t.elapsed(),
        ));
    } else {
        eprintln!("ferrolm: no cuBLAS here: prompts run as decode steps");
    }
    let n = ids.len();
    // Greedy continuations from the end of the prompt.
    let mut cpu_ids = Vec::new();
    let mut next = ferrolm_engine::argmax(&cpu_logits[(n - 1) * n_vocab..]);
    for _ in 0..args.n_gen {
        cpu_ids.push(next);
        let l = cpu.eval(&[next], Logits::Last)?;
        next = ferrolm_engine::argmax(&l);
    }
    let mut gpu_ids = Vec::new();
    let before = gpu.stats();
    let t = Instant::now();
    // As `run` goes: each step queued before the id it evaluates is read.
    for i in 0..args.n_gen {
        gpu_ids.push(if i + 1 < args.n_gen {
            gpu.push_greedy_ahead()?
        } else {
            gpu.greedy()?
        });
    }
    let gen_time = t.elapsed();
    let after = gpu.stats();
    let same = cpu_ids
        .iter()
        .zip(&gpu_ids)
        .take_while(|(a, b)| a == b)
        .count();
    let steps = (after.tokens - before.tokens).max(1);
    let file = path
        .file_name()
        .map_or_else(String::new, |f| f.to_string_lossy().into_owned());
    println!("| file | CUDA path | positions | mean KL | max KL | top-1 (ties within {TIE}) | top-1 raw | max abs logit diff | greedy same | CPU pp tok/s | CUDA tok/s |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
    for r in &rows {
        println!(
            "| {file} | {} | {n} | {:.2e} | {:.2e} | {:.2}% | {:.2}% | {:.4} | {same}/{} | {:.1} | {:.1} |",
            r.path,
            r.mean_kl,
            r.max_kl,
            100.0 * r.top1_tied,
            100.0 * r.top1,
            r.max_diff,
            args.n_gen,
            n as f64 / cpu_time.as_secs_f64(),
            n as f64 / r.time.as_secs_f64(),
        );
    }
    println!(
        "greedy decode on CUDA: {} tokens in {:.3} ms; per token: {:.2} graph launches, {:.2} kernel launches from the host, {:.2} host syncs, {:.2} uploads; {} kernels in the graph",
        steps,
        gen_time.as_secs_f64() * 1e3,
        (after.graph_launches - before.graph_launches) as f64 / steps as f64,
        (after.kernel_launches - before.kernel_launches) as f64 / steps as f64,
        (after.host_syncs - before.host_syncs) as f64 / steps as f64,
        (after.uploads - before.uploads) as f64 / steps as f64,
        gpu.plan().launches.len(),
    );
    sampling_check(&mut gpu, &ids)?;
    if args.profile > 0 {
        // Room for the profiled steps.
        let n_ctx = (args.profile + 32).max(ids.len() + 1);
        let mut gpu = CudaModel::with_tuning(&model, ordinal, n_ctx, &tuning)
            .map_err(|e| anyhow::anyhow!("cuda:{ordinal}: {e}"))?;
        gpu.push(ids[0])?;
        let t = Instant::now();
        let n = 16.min(args.profile);
        for _ in 0..n {
            gpu.push_greedy()?;
        }
        gpu.synchronize()?;
        let graph_us = t.elapsed().as_secs_f64() * 1e6 / n as f64;
        gpu.reset()?;
        let batch = gpu.profile_batch(&ids)?;
        if !batch.is_empty() {
            print_launches(&format!("prompt batch of {} tokens", ids.len()), &batch);
        }
        let rows = gpu.profile(args.profile)?;
        let total: f64 = rows.iter().map(|r| r.2).sum();
        println!(
            "kernel time per token (events, kernel by kernel): {total:.1} us; a graph replay (no reads back) takes {graph_us:.1} us"
        );
        println!("| kernel | launches per token | us per token | share |");
        println!("| --- | ---: | ---: | ---: |");
        for (name, n, us) in &rows {
            println!("| {name} | {n} | {us:.1} | {:.1}% |", 100.0 * us / total);
        }
    }
    for r in &rows {
        if r.mean_kl > args.max_kl || r.top1_tied < args.min_top1 {
            bail!(
                "CUDA ({}) differs from the CPU: mean KL {:.2e} (at most {:.0e}), top-1 {:.2}% (at least {:.0}%)",
                r.path,
                r.mean_kl,
                args.max_kl,
                100.0 * r.top1_tied,
                100.0 * args.min_top1
            );
        }
    }
    if same < args.n_gen {
        eprintln!(
            "ferrolm: greedy continuations differ from token {same} (CPU {:?}, CUDA {:?})",
            &cpu_ids[same..],
            &gpu_ids[same..]
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_text_hands_out_its_tokens_in_order_and_says_when_it_runs_out() {
        let mut p = Prompts::from_tokens((10..20).collect());
        assert_eq!(p.take(3).unwrap(), [10, 11, 12]);
        assert_eq!(p.take(4).unwrap(), [13, 14, 15, 16]);
        let e = p.take(4).unwrap_err().to_string();
        assert!(
            e.contains("holds 10 tokens") && e.contains("need 11"),
            "{e}"
        );
    }

    #[test]
    fn random_prompts_follow_the_seed_within_the_vocabulary() {
        let random = |seed| Prompts::Random {
            rng: Box::new(rand::rngs::StdRng::seed_from_u64(seed)),
            n_vocab: 50,
        };
        let (mut a, mut b, mut c) = (random(7), random(7), random(8));
        let ids = a.take(64).unwrap();
        assert_eq!(ids, b.take(64).unwrap());
        assert_ne!(ids, c.take(64).unwrap());
        assert!(ids.iter().all(|&i| i < 50));
    }
}
