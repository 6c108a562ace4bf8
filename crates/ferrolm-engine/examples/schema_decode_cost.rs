//! Decode speed with and without a JSON schema, in one process on the CPU backend: a batch of
//! sequences decoded together as the server's scheduler drives them (one forward pass per
//! step; the backend's top-k for unconstrained samplers, every logit and the grammar's mask
//! for constrained ones), in rounds that alternate which of the two goes first, so that a
//! noisy machine's drift falls on both alike. Prints each pair's tokens/s and the median of
//! the ratios.
//!
//!     cargo run --release -p ferrolm-engine --example schema_decode_cost -- \
//!         [MODEL.gguf] [--batch 1,16] [--rounds 6] [--steps 48] [--threads 2]

use std::sync::Arc;
use std::time::Instant;

use ferrolm_engine::constraint::{Constraints, Grammar};
use ferrolm_engine::sequence::{Sequence, SequenceParams};
use ferrolm_engine::{Backend, CpuBackend, SamplerParams, SlotInput};
use ferrolm_model::{Logits, Model};
use ferrolm_tokenizer::Tokenizer;

/// `scripts/load_test.py --schema`'s schema: no answer of fewer than 400 tokens can close it,
/// so every step is constrained.
fn schema() -> Grammar {
    Grammar::JsonSchema(serde_json::json!({
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 200,
    }))
}

struct Options {
    model: String,
    batches: Vec<usize>,
    rounds: usize,
    steps: usize,
    threads: usize,
}

fn options() -> Options {
    let home = std::env::var("HOME").unwrap_or_default();
    let mut o = Options {
        model: format!("{home}/.cache/ferrolm/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        batches: vec![1, 16],
        rounds: 6,
        steps: 48,
        threads: 2,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || args.next().expect("a value after the flag");
        match a.as_str() {
            "--batch" => {
                o.batches = value()
                    .split(',')
                    .map(|b| b.parse().expect("batch sizes"))
                    .collect()
            }
            "--rounds" => o.rounds = value().parse().expect("rounds"),
            "--steps" => o.steps = value().parse().expect("steps"),
            "--threads" => o.threads = value().parse().expect("threads"),
            path => o.model = path.to_string(),
        }
    }
    o
}

/// This process's CPU time so far, in seconds (Linux's /proc, at its 100 Hz tick): unlike wall
/// time, it does not grow while other processes hold the cores.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0 // utime and stime, fields 14 and 15 of the line
}

/// Of `steps` decode steps of `batch` sequences (after their prompts): tokens per second, and
/// CPU milliseconds per token.
fn decode(
    backend: &mut CpuBackend<'_>,
    tok: &Tokenizer,
    constraints: Option<&Constraints>,
    batch: usize,
    steps: usize,
    seed: u64,
) -> (f64, f64) {
    let prompt = tok.encode("A list of numbers:", true, false);
    let mut seqs: Vec<Sequence<'_>> = (0..batch)
        .map(|slot| {
            backend.truncate(slot, 0).expect("an empty slot");
            let params = SequenceParams {
                max_tokens: steps + 8,
                sampler: SamplerParams {
                    temperature: 0.7,
                    seed: seed + slot as u64,
                    ..SamplerParams::default()
                },
                stop: Vec::new(),
                stop_at_eog: false,
            };
            let constraint = constraints.map(|c| c.compile(&schema()).expect("the schema"));
            Sequence::new(tok, prompt.clone(), params, backend.n_ctx()).with_constraint(constraint)
        })
        .collect();
    let mut step = |seqs: &mut [Sequence<'_>]| {
        let inputs: Vec<(Vec<u32>, bool)> = seqs
            .iter()
            .map(|s| {
                let (ids, last) = s.next_input(512);
                (ids.to_vec(), last)
            })
            .collect();
        let slot_inputs: Vec<SlotInput<'_>> = inputs
            .iter()
            .enumerate()
            .map(|(slot, (ids, last))| SlotInput {
                slot,
                ids,
                want: if *last { Logits::Last } else { Logits::None },
            })
            .collect();
        let top = seqs
            .iter()
            .map(|s| s.top_needed())
            .try_fold(1, |k, t| t.map(|t| k.max(t)));
        match top {
            Some(k) => {
                let outs = backend.forward_top(&slot_inputs, k);
                for ((s, (ids, _)), out) in seqs.iter_mut().zip(&inputs).zip(outs) {
                    s.advance_top(ids.len(), Some(&out.expect("forward")))
                        .expect("advance");
                }
            }
            None => {
                let outs = backend.forward(&slot_inputs);
                for ((s, (ids, _)), out) in seqs.iter_mut().zip(&inputs).zip(outs) {
                    s.advance(ids.len(), Some(&out.expect("forward")))
                        .expect("advance");
                }
            }
        }
    };
    while seqs.iter().any(|s| s.in_prefill()) {
        step(&mut seqs);
    }
    step(&mut seqs); // the first token, sampled from the prompt's logits
    let (start, cpu) = (Instant::now(), cpu_seconds());
    for _ in 0..steps {
        step(&mut seqs);
    }
    assert!(
        seqs.iter().all(|s| s.finished().is_none()),
        "a sequence ended early"
    );
    let tokens = (batch * steps) as f64;
    (
        tokens / start.elapsed().as_secs_f64(),
        (cpu_seconds() - cpu) * 1e3 / tokens,
    )
}

fn main() {
    let o = options();
    let model = Model::load(&o.model, o.threads).unwrap_or_else(|e| panic!("{}: {e}", o.model));
    let file = ferrolm_gguf::GgufFile::open(&o.model).expect("the model file");
    let tok = Arc::new(Tokenizer::from_metadata(file.metadata()).expect("its tokenizer"));
    let constraints = Constraints::new(tok.clone()).expect("constraints");
    for &batch in &o.batches {
        let mut backend = CpuBackend::new(&model, batch, 512);
        let (mut speed, mut cpu) = (Vec::new(), Vec::new());
        for round in 0..o.rounds {
            let seed = round as u64 * 1000;
            let mut run = |constrained: bool| {
                let c = constrained.then_some(&constraints);
                decode(&mut backend, &tok, c, batch, o.steps, seed)
            };
            let (free, constrained) = if round % 2 == 0 {
                let f = run(false);
                (f, run(true))
            } else {
                let c = run(true);
                (run(false), c)
            };
            println!(
                "batch {batch:>2} round {round}: {:7.1} tok/s and {:.2} CPU ms/token without, \
                 {:7.1} and {:.2} with the schema",
                free.0, free.1, constrained.0, constrained.1
            );
            speed.push(constrained.0 / free.0);
            cpu.push(constrained.1 / free.1);
        }
        println!(
            "batch {batch:>2}: median ratios with/without: tok/s {:.3}, CPU time per token {:.3}",
            median(speed),
            median(cpu)
        );
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
