//! The batched passes (`Prefill`: the prompt pass and the batched decode step) run on the CPU
//! through a host `BatchDevice` (`batch_emulator`): every kernel launch and GEMM they make is
//! done by host code on host memory at the addresses they pass, and each sequence's logits
//! are compared with the CPU model's for that sequence alone. As `emulated_step.rs` does for
//! the single-sequence step, this checks what the host side decides (kernels, buffers,
//! offsets, sizes, the slots' caches and positions) without a GPU; the kernels' own
//! arithmetic is `cuda-check`'s on a GPU.

mod batch_emulator;

use std::sync::Arc;

use batch_emulator::{math, HostDevice};
use ferrolm_cuda::prefill::{Addresses, Prefill, RowsWant};
use ferrolm_cuda::schedule::{decode_plan_with, DecodePlan};
use ferrolm_cuda::{CudaTuning, Rows};
use ferrolm_gguf::GgufFile;
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Logits, Model};

/// Positions each cache holds.
const N_CTX: usize = 128;

/// A synthetic file, its CPU model and the CUDA plan of the whole model.
fn load(spec: &SyntheticSpec, tuning: &CudaTuning) -> (Arc<GgufFile>, Model, DecodePlan) {
    let file = Arc::new(GgufFile::from_bytes(synthetic::build(spec).unwrap().to_bytes()).unwrap());
    let model = Model::from_file(file.clone(), 1).unwrap();
    let types = |name: &str| file.tensor(name).map(|t| t.ty);
    let n_layer = model.plan().layers.len();
    let plan = decode_plan_with(model.plan(), N_CTX, &types, n_layer, tuning).unwrap();
    (file, model, plan)
}

/// Sequence `s`'s first `n` ids.
fn ids(s: usize, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| i.wrapping_mul(2654435761).wrapping_add(i + 7919 * s as u32) % 900)
        .collect()
}

/// The CPU model's logits at every position of `ids`, evaluated alone.
fn cpu_logits(model: &Model, ids: &[u32]) -> Vec<f32> {
    model.session(N_CTX).eval(ids, Logits::All).unwrap()
}

/// Emulated against CPU logits, in emulated_step.rs's terms: mean KL and relative difference.
fn assert_close(what: &str, cpu: &[f32], emulated: &[f32], n_vocab: usize) {
    assert_eq!(
        cpu.len(),
        emulated.len(),
        "{what}: logits of every position"
    );
    let kl = math::mean_kl(cpu, emulated, n_vocab);
    let rel = math::relative_difference(cpu, emulated);
    eprintln!("{what}: mean KL {kl:.3e}, logits {rel:.2e} apart");
    assert!(kl < 1e-3, "{what}: mean KL {kl:.3e}");
    // (a file whose logits are large has a KL near 0 whatever happens)
    assert!(rel < 2e-2, "{what}: logits {rel:.3e} apart");
}

/// The emulated passes of one file: `batch` sequences in slots 0.. (a spare slot after them
/// for the padding rows), their prompts (of different lengths) through the prompt pass, then
/// `steps` batched decode steps of all of them at their different positions; each sequence's
/// logits (prompt and steps) against the CPU's. With `keep_f16`, the decode steps read the
/// kept f16 copies (Q, K, V and gate, up stacked: the fused products).
fn check_batched_steps(
    what: &str,
    spec: &SyntheticSpec,
    tuning: &CudaTuning,
    batch: usize,
    keep_f16: bool,
) {
    let steps = 3;
    let (file, model, plan) = load(spec, tuning);
    let dev = HostDevice::new(&file, &plan, batch);
    let slots: Vec<Addresses> = (0..batch).map(|s| dev.addresses(s)).collect();
    let stride = dev.slot_stride();
    let mut prefill = Prefill::on(dev, &plan, tuning).unwrap();
    if keep_f16 {
        prefill.keep_f16_weights(&plan, &slots[0]).unwrap();
    }
    let prompt_len = |s: usize| 2 + (5 * s) % 7;
    let seqs: Vec<Vec<u32>> = (0..batch).map(|s| ids(s, prompt_len(s) + steps)).collect();
    let mut logits: Vec<Vec<f32>> = Vec::new();
    for (s, seq) in seqs.iter().enumerate() {
        let prompt = &seq[..prompt_len(s)];
        logits.push(
            prefill
                .eval(&plan, &slots[s], prompt, 0, true, true)
                .unwrap(),
        );
    }
    let rows: Vec<u32> = (0..batch as u32).collect();
    let spare = batch as u32;
    let step_rows = |prefill: &mut Prefill<HostDevice>, step: usize, want: RowsWant| {
        let (ids, pos): (Vec<u32>, Vec<u32>) = (0..batch)
            .map(|s| {
                let p = prompt_len(s) + step;
                (seqs[s][p], p as u32)
            })
            .unzip();
        prefill
            .decode_rows(&plan, &slots[0], &ids, &rows, &pos, &stride, spare, want)
            .unwrap()
    };
    let mut last = Vec::new();
    for step in 0..steps {
        let Rows::Logits(out) = step_rows(&mut prefill, step, RowsWant::Logits) else {
            panic!("logits asked for")
        };
        for (s, row) in out.chunks_exact(plan.n_vocab).enumerate() {
            logits[s].extend_from_slice(row);
        }
        last = out;
    }
    for (s, seq) in seqs.iter().enumerate() {
        let what = format!("{what}, batch {batch}, sequence {s} ({} ids)", seq.len());
        assert_close(&what, &cpu_logits(&model, seq), &logits[s], plan.n_vocab);
    }
    // The last step again, asking for the greedy ids and the candidates: the same rows'.
    let Rows::Greedy(greedy) = step_rows(&mut prefill, steps - 1, RowsWant::Greedy) else {
        panic!("ids asked for")
    };
    let best: Vec<u32> = last
        .chunks_exact(plan.n_vocab)
        .map(|r| math::argmax(r) as u32)
        .collect();
    assert_eq!(greedy, best, "{what}: each row's greedy choice");
    let Rows::Top(top) = step_rows(&mut prefill, steps - 1, RowsWant::Top(4)) else {
        panic!("candidates asked for")
    };
    for (row, cands) in last.chunks_exact(plan.n_vocab).zip(&top) {
        assert_eq!(cands.len(), 4);
        for &(id, v) in cands {
            assert_eq!(row[id as usize], v);
            assert!(
                row.iter().filter(|&&x| x > v).count() < 4,
                "{what}: not a top value"
            );
        }
    }
}

/// The files the batched passes serve, as emulated_step.rs covers them: the llama family,
/// Gemma 2 and 3 (soft caps, post-norms, GELU, the embedding scale, sliding windows, Q/K
/// norms), Granite's scales, Phi-3's fused tensors, and mixtures of experts (qwen3moe; qwen2moe's
/// gated shared expert).
fn files() -> Vec<(String, SyntheticSpec)> {
    let mut cases = Vec::new();
    for arch in ["llama", "qwen2", "qwen3"] {
        let mut s = SyntheticSpec::small(arch);
        s.n_layer = 2;
        s.head_dim = 64;
        cases.push((arch.to_string(), s));
    }
    for arch in ["gemma2", "gemma3", "granite", "phi3"] {
        let mut s = SyntheticSpec::small(arch);
        s.head_dim = 64;
        s.n_layer = 2;
        s.sliding_window = s.sliding_window.map(|_| 8);
        cases.push((arch.to_string(), s));
    }
    for arch in ["qwen3moe", "qwen2moe"] {
        let mut s = SyntheticSpec::small(arch);
        s.head_dim = 64;
        s.n_layer = 2;
        cases.push((arch.to_string(), s));
    }
    cases
}

/// The batched decode step at 1, 3 and 8 sequences at different positions (after prompts of
/// different lengths), with the weights dequantized per product and from kept f16 copies.
#[test]
fn the_batched_step_computes_what_the_cpu_computes() {
    let tuning = CudaTuning {
        graphs: false,
        ..CudaTuning::default()
    };
    for (name, spec) in files() {
        for batch in [1, 3, 8] {
            check_batched_steps(&name, &spec, &tuning, batch, false);
        }
        check_batched_steps(&format!("{name} (f16 copies)"), &spec, &tuning, 3, true);
    }
}
