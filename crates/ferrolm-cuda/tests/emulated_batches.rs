//! The batched passes (`Prefill`: the prompt pass and the batched decode step) run on the CPU
//! through a host `BatchDevice` (`batch_emulator`): every kernel launch and GEMM they make is
//! done by host code on host memory at the addresses they pass, and each sequence's logits
//! are compared with the CPU model's for that sequence alone. As `emulated_step.rs` does for
//! the single-sequence step, this checks what the host side decides (kernels, buffers,
//! offsets, sizes, the slots' caches and positions) without a GPU; the kernels' own
//! arithmetic is `cuda-check`'s on a GPU.
//!
//! The batched passes' router is an f16 GEMM: a token whose experts the router logits choose
//! by a near tie may take other experts than on the CPU, as on any two backends; such
//! positions are left out of the comparison (at most a quarter of a sequence's). dots1
//! (grouped sigmoid routing with a bias) is not compared: its group scores sit closer than
//! that even at a few positions (see emulated_step.rs).

mod batch_emulator;
mod host_math;
mod kernel_source;

use std::sync::Arc;

use batch_emulator::{HostDevice, Swap};
use ferrolm_cuda::prefill::{Addresses, Prefill, RowsWant, MAX_BATCH};
use ferrolm_cuda::schedule::{decode_plan_with, DecodePlan, LayerRefs};
use ferrolm_cuda::{CudaTuning, Rows};
use ferrolm_gguf::{GgufFile, TensorType};
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Logits, Model};
use host_math as math;

/// Positions each cache holds (but for the long prompt's).
const N_CTX: usize = 128;

/// A small synthetic file of `arch`: two layers, heads of 64 (the CUDA path serves heads of a
/// multiple of 32; 64 takes the tensor-core attention).
fn small(arch: &str) -> SyntheticSpec {
    let mut s = SyntheticSpec::small(arch);
    s.n_layer = 2;
    s.head_dim = 64;
    s
}

/// The default tuning (with CUDA graphs: the host device captures and replays them).
fn host_tuning() -> CudaTuning {
    CudaTuning::default()
}

/// A synthetic file, its CPU model and the CUDA plan of the whole model.
fn load(spec: &SyntheticSpec, tuning: &CudaTuning) -> (Arc<GgufFile>, Model, DecodePlan) {
    load_layers(spec, tuning, None, N_CTX)
}

/// [`load`] with a plan of the first `gpu_layers` only (`None`: all) and caches of `n_ctx`.
fn load_layers(
    spec: &SyntheticSpec,
    tuning: &CudaTuning,
    gpu_layers: Option<usize>,
    n_ctx: usize,
) -> (Arc<GgufFile>, Model, DecodePlan) {
    let file = Arc::new(GgufFile::from_bytes(synthetic::build(spec).unwrap().to_bytes()).unwrap());
    let model = Model::from_file(file.clone(), 1).unwrap();
    let n_layer = gpu_layers.unwrap_or(model.plan().layers.len());
    let plan = decode_plan_with(model.plan(), model.weights(), n_ctx, n_layer, tuning).unwrap();
    (file, model, plan)
}

/// Sequence `s`'s first `n` ids (none starts with id 0, the padding rows' id).
fn ids(s: usize, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            i.wrapping_mul(2654435761)
                .wrapping_add(i + 7919 * s as u32 + 11)
                % 900
        })
        .collect()
}

/// The rows of the last pass whose experts were chosen by a near tie.
fn near_ties(prefill: &Prefill<HostDevice>) -> Vec<usize> {
    prefill.device().near_ties.take()
}

/// The CPU model's logits at every position of `ids`, evaluated alone.
fn cpu_logits(model: &Model, ids: &[u32]) -> Vec<f32> {
    model.session(ids.len()).eval(ids, Logits::All).unwrap()
}

/// How far emulated logits are from the CPU's, in emulated_step.rs's terms.
struct Distance {
    what: String,
    mean_kl: f64,
    relative: f64,
}

impl Distance {
    /// Within emulated_step.rs's tolerances.
    fn is_close(&self) -> bool {
        // (a file whose logits are large has a KL near 0 whatever happens)
        self.mean_kl < 1e-3 && self.relative < 2e-2
    }

    fn assert_close(&self) {
        assert!(
            self.is_close(),
            "{}: mean KL {:.3e}, logits {:.3e} apart",
            self.what,
            self.mean_kl,
            self.relative
        );
    }
}

/// Emulated against CPU logits: mean KL and relative difference, over the positions whose
/// experts were not a near tie (`near_ties`; at most a quarter).
fn distance(
    what: &str,
    cpu: &[f32],
    emulated: &[f32],
    n_vocab: usize,
    near_ties: &[usize],
) -> Distance {
    assert_eq!(
        cpu.len(),
        emulated.len(),
        "{what}: logits of every position"
    );
    let positions = cpu.len() / n_vocab;
    assert!(
        4 * near_ties.len() <= positions,
        "{what}: {} of {positions} positions chose their experts by a near tie",
        near_ties.len()
    );
    let kept = |x: &[f32]| -> Vec<f32> {
        x.chunks_exact(n_vocab)
            .enumerate()
            .filter(|(p, _)| !near_ties.contains(p))
            .flat_map(|(_, row)| row.iter().copied())
            .collect()
    };
    let (cpu, emulated) = (&kept(cpu)[..], &kept(emulated)[..]);
    if !near_ties.is_empty() {
        eprintln!("{what}: positions {near_ties:?} left out (near ties of the router)");
    }
    let kl = math::mean_kl(cpu, emulated, n_vocab);
    let rel = math::relative_difference(cpu, emulated);
    eprintln!("{what}: mean KL {kl:.3e}, logits {rel:.2e} apart");
    Distance {
        what: what.to_string(),
        mean_kl: kl,
        relative: rel,
    }
}

/// The emulated passes of one file: `batch` sequences in slots 0.. (a spare slot after them
/// for the padding rows), their prompts (of different lengths) through the prompt pass, then
/// `steps` batched decode steps of all of them at their different positions; each sequence's
/// logits (prompt and steps) against the CPU's. With `keep_f16`, the decode steps read the
/// kept f16 copies (Q, K, V and gate, up stacked: the fused products). `swap` exchanges two
/// arguments of a kernel's launches (a wiring mistake, to see the comparison fail).
fn batched_steps(
    what: &str,
    spec: &SyntheticSpec,
    tuning: &CudaTuning,
    batch: usize,
    keep_f16: bool,
    swap: Option<Swap>,
) -> Vec<Distance> {
    let steps = 3;
    let (file, model, plan) = load(spec, tuning);
    let mut dev = HostDevice::new(&file, &plan, batch);
    dev.swap = swap;
    let slots: Vec<Addresses> = (0..batch).map(|s| dev.addresses(s)).collect();
    let stride = dev.slot_stride();
    let mut prefill = Prefill::on(dev, &plan, tuning).unwrap();
    if keep_f16 {
        prefill.keep_f16_weights(&plan, &slots[0]).unwrap();
    }
    let prompt_len = |s: usize| 2 + (5 * s) % 7;
    let seqs: Vec<Vec<u32>> = (0..batch).map(|s| ids(s, prompt_len(s) + steps)).collect();
    let mut logits: Vec<Vec<f32>> = Vec::new();
    // Each sequence's positions whose experts were a near tie.
    let mut ties: Vec<Vec<usize>> = vec![Vec::new(); batch];
    for (s, seq) in seqs.iter().enumerate() {
        let prompt = &seq[..prompt_len(s)];
        logits.push(
            prefill
                .eval(&plan, &slots[s], prompt, 0, true, true)
                .unwrap(),
        );
        ties[s].extend(near_ties(&prefill));
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
        // (rows past the batch are padding)
        for s in near_ties(&prefill).into_iter().filter(|&s| s < batch) {
            ties[s].push(prompt_len(s) + step);
        }
        last = out;
    }
    let counted_before = model.expert_counts();
    let distances = seqs
        .iter()
        .enumerate()
        .map(|(s, seq)| {
            let what = format!("{what}, batch {batch}, sequence {s} ({} ids)", seq.len());
            let cpu = cpu_logits(&model, seq);
            distance(&what, &cpu, &logits[s], plan.n_vocab, &ties[s])
        })
        .collect();
    // The expert counters: every sequence's tokens, prompts and steps, as the CPU counts them
    // alone, the padding rows not counted (the sums equal); a near tie's choice may move one
    // count, as may one the tie test misses.
    let n_ties: usize = ties.iter().map(Vec::len).sum();
    let memory = prefill.device().memory.borrow();
    for (l, (after, before)) in model
        .expert_counts()
        .iter()
        .zip(&counted_before)
        .enumerate()
    {
        if after.is_empty() {
            continue;
        }
        let cpu: Vec<u64> = after.iter().zip(before).map(|(a, b)| a - b).collect();
        let at = prefill.device().expert_counts[l];
        let device: Vec<u64> = memory
            .u32s(at, cpu.len())
            .iter()
            .map(|&c| u64::from(c))
            .collect();
        let apart: u64 = device.iter().zip(&cpu).map(|(a, b)| a.abs_diff(*b)).sum();
        assert_eq!(
            device.iter().sum::<u64>(),
            cpu.iter().sum::<u64>(),
            "{what}: layer {l}"
        );
        assert!(
            apart <= 2 * (n_ties as u64 + 1),
            "{what}: layer {l}'s counts {device:?}, the CPU's {cpu:?}"
        );
    }
    drop(memory);
    // The steps took the batched step's own kernels: each row at its slot and position, the
    // per-pair expert products, the fused products of the kept copies.
    let launched = &prefill.device().launched;
    let mut expected = vec!["rope_rows_slots", "attn_rows"];
    // (Q4_K and Q6_K matrices on the int8 tensor cores, the others as before)
    let int8_type = |m: usize| matches!(plan.matrices[m].ty, TensorType::Q4_K | TensorType::Q6_K);
    let int8 = batch <= tuning.mmq_max_rows;
    if int8 && (0..plan.matrices.len()).any(|m| int8_type(m) && plan.matrices[m].experts == 1) {
        expected.push("mmq_");
    }
    // (the output head's norm quantizes for an int8 output product, the attention's f32 rows
    // for an int8 attention output product)
    if int8 && plan.head.is_some_and(|h| int8_type(h.output)) {
        expected.push("rms_norm_rows_q");
    }
    let int8_wo = |r: &LayerRefs| {
        r.attention()
            .is_some_and(|a| int8_type(a.wo) && !a.gated_output)
    };
    if int8 && plan.layers.iter().any(int8_wo) {
        expected.push("quantize_rows_f32");
    }
    // (without them, Q4_K matrices through dq4k_gemm_* or dq4k_pipe_*, and where asked for
    // Q6_K ones regrouped through dq6k_pipe_*, which no stacked copy then serves)
    let q6r = |m: usize| plan.matrices[m].kernel == "Q6_KR" && tuning.dq6_pipe;
    let dq_type = |m: usize| plan.matrices[m].ty == TensorType::Q4_K || q6r(m);
    let dq = !int8
        && batch
            <= tuning
                .dq_gemm_max_rows
                .min(ferrolm_cuda::prefill::DQ_MAX_ROWS);
    if dq && (0..plan.matrices.len()).any(|m| q6r(m) && plan.matrices[m].experts == 1) {
        expected.push("dq6k_pipe_");
    }
    let q4k = |m: usize| plan.matrices[m].ty == TensorType::Q4_K;
    if dq && (0..plan.matrices.len()).any(|m| q4k(m) && plan.matrices[m].experts == 1) {
        // (segments where two of Q, K and V are Q4_K; else each alone)
        let joins = plan.layers.iter().any(|r| {
            r.attention()
                .is_some_and(|a| a.qkv.iter().filter(|&&m| q4k(m)).count() >= 2)
        });
        expected.push(if tuning.dq_pipe.is_some() {
            "dq4k_pipe_"
        } else if tuning.dq_segments && joins {
            "dq4k_gemm3_"
        } else {
            "dq4k_gemm_"
        });
    }
    let stacked_ffn = plan.layers.iter().any(|r| {
        r.moe.is_none()
            && !(int8 && r.ffn[..2].iter().all(|&m| int8_type(m)))
            && !(dq && r.ffn[..2].iter().any(|&m| dq_type(m)))
    });
    if plan.max_experts > 0 {
        expected.extend(["moe_group", "rms_norm_rows_f32"]);
    } else if keep_f16 && stacked_ffn {
        expected.push("_pairs_f16");
    }
    if dq
        && tuning.dq_glu
        && tuning.dq_pipe.is_none()
        && plan
            .layers
            .iter()
            .any(|r| r.ffn[..2].iter().all(|&m| q4k(m)))
    {
        expected.push("dq4k_glu_");
    }
    if plan.recurrent() {
        expected.push("delta_rule_slots");
    }
    for k in expected {
        assert!(launched.iter().any(|l| l.contains(k)), "{what}: no {k}");
    }
    if tuning.graphs {
        // (the first step of a size launches kernel by kernel, the second is captured and
        // launched as a graph, the third replays it)
        assert_eq!(
            prefill.device().replays.get(),
            steps - 1,
            "{what}: graph launches"
        );
    }
    // The last step again, asking for the greedy ids and the candidates: the same rows'. (Not
    // for a recurrent model, whose states a repeated step moves on again.)
    if plan.recurrent() {
        return distances;
    }
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
    distances
}

/// A batched step's Q6_K matrices read as blocks (`dq6k_pipe_*`, regrouped rows of 2048
/// columns or more) beside its Q4_K ones, as a Q4_K_M file has them, at 3 and 12 rows.
#[test]
fn the_q6k_blocks_read_by_a_batched_step_give_the_cpus_logits() {
    let mut spec = small("llama");
    spec.default_type = TensorType::Q4_K;
    spec.n_ff = 2048;
    spec.types = vec![("ffn_down".into(), TensorType::Q6_K)];
    let tuning = CudaTuning {
        dq6_pipe: true,
        dq_pipe: Some(ferrolm_cuda::prefill::DQ_PIPES[0]),
        ..host_tuning()
    };
    let (_, _, plan) = load(&spec, &tuning);
    assert!(plan.matrices.iter().any(|m| m.kernel == "Q6_KR"));
    close_at_3_and_12("llama Q4_K + Q6_K", &spec, &tuning);
}

/// A batched step's Q, K and V, and gate and up, each as one launch of segments
/// (`dq4k_gemm3_*`, the default) and one by one (`FERROLM_CUDA_NO_DQ_SEGMENTS`), at 3 and 12
/// rows; and a file whose V is Q6_K, so that only Q and K join: the CPU's logits still.
#[test]
fn q4k_products_of_one_input_in_one_launch_give_the_cpus_logits() {
    let mut spec = small("llama");
    spec.default_type = TensorType::Q4_K;
    spec.types = Vec::new();
    for segments in [true, false] {
        let tuning = CudaTuning {
            dq_segments: segments,
            dq_glu: false,
            ..host_tuning()
        };
        close_at_3_and_12("llama Q4_K, segments", &spec, &tuning);
    }
    spec.types = vec![("attn_v".into(), TensorType::Q6_K)];
    let tuning = CudaTuning {
        dq_segments: true,
        ..host_tuning()
    };
    close_at_3_and_12("llama Q4_K + a Q6_K V, segments", &spec, &tuning);
}

/// Gate, up and the activation as one launch (`dq4k_glu_*`, the default) at 3 and 12 rows,
/// SwiGLU (llama) and GeGLU (Gemma 3), and apart (`FERROLM_CUDA_NO_DQ_GLU`): the CPU's logits
/// still.
#[test]
fn gate_up_and_the_activation_in_one_launch_give_the_cpus_logits() {
    for arch in ["llama", "gemma3"] {
        let mut spec = small(arch);
        spec.default_type = TensorType::Q4_K;
        spec.types = Vec::new();
        spec.sliding_window = spec.sliding_window.map(|_| 8);
        for glu in [true, false] {
            let tuning = CudaTuning {
                dq_glu: glu,
                ..host_tuning()
            };
            close_at_3_and_12(
                &format!("{arch} Q4_K, gate, up and activation together: {glu}"),
                &spec,
                &tuning,
            );
        }
    }
}

/// [`batched_steps`] of 3 and of 12 rows (f16 copies kept), each sequence close to the CPU.
fn close_at_3_and_12(what: &str, spec: &SyntheticSpec, tuning: &CudaTuning) {
    for batch in [3, 12] {
        batched_steps(what, spec, tuning, batch, true, None)
            .iter()
            .for_each(Distance::assert_close);
    }
}

/// The files the batched passes serve, as emulated_step.rs covers them: the llama family
/// (Q/K/V biases, Q/K norms), Gemma 2 and 3 (soft caps, post-norms, GELU, the embedding scale,
/// sliding windows, the local RoPE base), Granite's scales, Phi-3's fused tensors and
/// LongRoPE, YaRN, frequency factors with a tied output, rows of one type and of mixed types,
/// and mixtures of experts (qwen3moe; qwen2moe's gated shared expert; Mixtral-style llama).
fn files() -> Vec<(String, SyntheticSpec)> {
    let mut cases = Vec::new();
    for arch in ["llama", "qwen2", "qwen3"] {
        cases.push((arch.to_string(), small(arch)));
    }
    for arch in ["gemma2", "gemma3", "granite", "phi3"] {
        let mut s = small(arch);
        s.sliding_window = s.sliding_window.map(|_| 8);
        cases.push((arch.to_string(), s));
    }
    let mut long_rope = small("phi3");
    long_rope.long_rope = Some(16);
    cases.push(("phi3 LongRoPE".into(), long_rope));
    let mut yarn = small("llama");
    yarn.yarn = Some((4.0, 512));
    cases.push(("llama YaRN".into(), yarn));
    let mut freqs = small("llama");
    freqs.rope_freqs = true;
    freqs.tied_output = true;
    freqs.default_type = TensorType::Q4_K;
    cases.push(("llama Q4_K, frequency factors, tied".into(), freqs));
    let mut uniform = small("llama");
    uniform.default_type = TensorType::Q4_0;
    uniform.types = Vec::new();
    cases.push(("llama Q4_0 everywhere".into(), uniform));
    let mut mixed = small("llama");
    mixed.default_type = TensorType::Q4_0;
    mixed.types = vec![
        ("attn_k".into(), TensorType::Q4_K),
        ("ffn_up".into(), TensorType::Q8_0),
    ];
    cases.push(("llama mixed types".into(), mixed));
    for arch in ["qwen3moe", "qwen2moe", "llama"] {
        let mut s = small(arch);
        if arch == "llama" {
            s.n_expert = 8;
            s.n_expert_used = 2;
            s.n_ff = 256;
        }
        let name = if arch == "llama" {
            "llama experts"
        } else {
            arch
        };
        cases.push((name.to_string(), s));
    }
    cases
}

/// The batched decode step at 1, 3 and 8 sequences at different positions (after prompts of
/// different lengths), with the weights dequantized per product and from kept f16 copies.
#[test]
fn the_batched_step_computes_what_the_cpu_computes() {
    // (the Q4_K and Q6_K products on the int8 tensor cores, a switch off by default)
    let tuning = CudaTuning {
        mmq_max_rows: 64,
        ..host_tuning()
    };
    for (name, spec) in files() {
        let mut distances = Vec::new();
        for batch in [1, 3, 8] {
            distances.extend(batched_steps(&name, &spec, &tuning, batch, false, None));
        }
        // (the Q4_K and Q6_K matrices through the f16 copies too, not the int8 tensor cores)
        let copies = format!("{name} (f16 copies)");
        let f16 = CudaTuning {
            mmq_max_rows: 0,
            ..tuning.clone()
        };
        distances.extend(batched_steps(&copies, &spec, &f16, 3, true, None));
        // (and the Q4_K matrices' blocks read by dq4k_gemm_* at 3 rows, and 12 (two tiles of
        // inputs) where no expert routing meets the near ties more sequences bring)
        let blocks = format!("{name} (Q4_K blocks)");
        let sizes: &[usize] = if spec.n_expert == 0 { &[3, 12] } else { &[3] };
        // (and through dq4k_pipe_*, the pipelined layout behind its switch)
        let piped = CudaTuning {
            dq_pipe: Some(ferrolm_cuda::prefill::DQ_PIPES[0]),
            ..f16.clone()
        };
        for &batch in sizes {
            distances.extend(batched_steps(&blocks, &spec, &f16, batch, true, None));
            distances.extend(batched_steps(&blocks, &spec, &piped, batch, true, None));
        }
        // (every matrix through the f16 copies)
        let all_copies = CudaTuning {
            dq_gemm_max_rows: 0,
            ..f16.clone()
        };
        distances.extend(batched_steps(&copies, &spec, &all_copies, 3, true, None));
        distances.iter().for_each(Distance::assert_close);
    }
    // Hybrids (each row's delta-net states its own slot's, fresh at position 0; the attention
    // layers' gated output) and gpt-oss. Their experts all run (top-k of all of them): the random routers of
    // these small files meet near ties the tie test does not flag, which a single position
    // shows at 3e-2 while the positions after it agree; the routing's choices are the files'
    // above.
    for (name, mut spec) in hybrid_and_gpt_oss_files() {
        spec.n_expert_used = spec.n_expert;
        let mut distances = Vec::new();
        for batch in [1, 3, 8] {
            distances.extend(batched_steps(name, &spec, &tuning, batch, false, None));
        }
        let copies = format!("{name} (f16 copies)");
        distances.extend(batched_steps(&copies, &spec, &tuning, 3, true, None));
        distances.iter().for_each(Distance::assert_close);
    }
}

/// The files of the hybrids (qwen3next in both layouts of its projections, qwen35 with value heads tiling the
/// key heads and dense feed-forward blocks, qwen35moe) and gpt-oss (sinks, biases, the clamped
/// SwiGLU, MXFP4 experts).
fn hybrid_and_gpt_oss_files() -> Vec<(&'static str, SyntheticSpec)> {
    let mut split = SyntheticSpec::small("qwen3next");
    if let Some(net) = split.delta_net.as_mut() {
        net.split_projections = true;
    }
    let mut gpt_oss = SyntheticSpec::small("gpt-oss");
    gpt_oss.n_layer = 2;
    gpt_oss.sliding_window = Some(8);
    vec![
        ("qwen3next", SyntheticSpec::small("qwen3next")),
        ("qwen3next, split projections", split),
        ("qwen35", SyntheticSpec::small("qwen35")),
        ("qwen35moe", SyntheticSpec::small("qwen35moe")),
        ("gpt-oss", gpt_oss),
    ]
}

/// The prompt pass alone, `n` ids of slot 1 (slot 0's cache left as the step left it): in two
/// batches (the second continuing at its position; the first longer than a tensor-core
/// attention block of 64 queries) returning every position's logits, then a prompt of slot 0
/// in one batch returning only the last token's, in the decode step's logits buffer, and its
/// greedy choice in the token buffer.
fn check_prompt(what: &str, spec: &SyntheticSpec, tuning: &CudaTuning, n: usize) {
    let (file, model, plan) = load(spec, tuning);
    let dev = HostDevice::new(&file, &plan, 2);
    let at = [dev.addresses(0), dev.addresses(1)];
    let mut prefill = Prefill::on(dev, &plan, tuning).unwrap();
    // (the copies the GPU keeps where it has room; the dequantizing path with them off)
    if tuning.f16_weights {
        prefill.keep_f16_weights(&plan, &at[1]).unwrap();
    }
    if tuning.f16_experts {
        prefill.keep_f16_experts(&plan, &at[1]).unwrap();
    }
    let seq = ids(1, n);
    let (first, rest) = seq.split_at(n * 7 / 10);
    let mut logits = prefill.eval(&plan, &at[1], first, 0, true, false).unwrap();
    let mut ties = near_ties(&prefill);
    logits.extend(
        prefill
            .eval(&plan, &at[1], rest, first.len(), true, true)
            .unwrap(),
    );
    ties.extend(near_ties(&prefill).iter().map(|t| first.len() + t));
    ties.sort_unstable();
    ties.dedup();
    let what = format!(
        "{what}, a prompt of {n} in batches of {} and {}",
        first.len(),
        rest.len()
    );
    let cpu = cpu_logits(&model, &seq);
    distance(&what, &cpu, &logits, plan.n_vocab, &ties).assert_close();
    let short = ids(2, 9);
    let out = prefill.eval(&plan, &at[0], &short, 0, false, true).unwrap();
    assert!(
        out.is_empty(),
        "only the last token's logits, on the device"
    );
    let last_tied = near_ties(&prefill).contains(&(short.len() - 1));
    let memory = prefill.device().memory.borrow();
    let last = memory.f32s(at[0].logits, plan.n_vocab);
    if !last_tied {
        let cpu = cpu_logits(&model, &short);
        let cpu_last = &cpu[(short.len() - 1) * plan.n_vocab..];
        let what = format!("{what}: the last token alone");
        distance(&what, cpu_last, &last, plan.n_vocab, &[]).assert_close();
    }
    assert_eq!(
        memory.u32s(at[0].token, 1)[0] as usize,
        math::argmax(&last),
        "{what}: the greedy choice"
    );
    let launched = &prefill.device().launched;
    if plan.max_experts > 0 {
        assert!(launched.iter().any(|l| l == "moe_gather_f16"), "{what}");
        // (the long prompt's groups padded to one batched GEMM each matrix, unless switched off)
        let padded = ["moe_pad_rows", "gemm batched"].map(|k| launched.iter().any(|l| l == k));
        assert_eq!(padded, [tuning.padded_expert_groups; 2], "{what}");
    }
    let chunked_rule = spec
        .delta_net
        .as_ref()
        .is_some_and(|n| [64, 128].contains(&n.state_size));
    if let Some((kernel, _)) = ferrolm_cuda::prefill::mma_attention(spec.head_dim) {
        let launched = launched.iter().any(|l| l == kernel);
        assert_eq!(launched, tuning.tensor_core_attention, "{what}: {kernel}");
    }
    for (kernel, served) in [
        ("moe_group_warp", plan.max_experts > 0),
        ("delta_conv_rows_runs", spec.delta_net.is_some()),
        ("delta_rule_chunks", chunked_rule),
        ("delta_rule_rows", spec.delta_net.is_some() && !chunked_rule),
    ] {
        let launched = launched.iter().any(|l| l == kernel);
        assert_eq!(launched, served, "{what}: {kernel}");
    }
}

/// Prompt batches through the tensor-core attention (heads of 64 and 128) and the f32 tiles
/// (other widths, or the switch off, with f32 expert inputs and each matrix dequantized for
/// the batch), against the CPU.
#[test]
fn the_prompt_pass_computes_what_the_cpu_computes() {
    let tensor_cores = host_tuning();
    let tiles = CudaTuning {
        tensor_core_attention: false,
        quantized_activations: false,
        f16_weights: false,
        ..tensor_cores.clone()
    };
    for (name, spec) in files() {
        check_prompt(&name, &spec, &tensor_cores, 100);
    }
    // A GEMM per used expert instead of the padded groups' one per matrix, each matrix
    // dequantized for the batch (no f16 copies kept).
    let each_expert = CudaTuning {
        padded_expert_groups: false,
        f16_weights: false,
        f16_experts: false,
        ..tensor_cores.clone()
    };
    for (name, spec) in files().into_iter().filter(|(_, s)| s.n_expert > 0) {
        check_prompt(
            &format!("{name} (a GEMM per expert)"),
            &spec,
            &each_expert,
            100,
        );
    }
    for (name, spec) in files()
        .into_iter()
        .filter(|(n, _)| n == "llama" || n == "qwen3moe")
    {
        check_prompt(&format!("{name} (f32 tiles)"), &spec, &tiles, 40);
    }
    let mut wide = SyntheticSpec::small("llama");
    wide.n_layer = 2;
    wide.n_head = 4;
    wide.head_dim = 128;
    check_prompt("llama, heads of 128", &wide, &tensor_cores, 80);
    let mut gemma = SyntheticSpec::small("gemma3");
    gemma.n_layer = 2;
    gemma.head_dim = 256;
    gemma.sliding_window = Some(8);
    check_prompt("gemma3, heads of 256", &gemma, &tensor_cores, 80);
    // Hybrids (their delta-nets' states carried from one batch to the next, started from
    // zeros at position 0; the attention layers' gated output): qwen3next in both layouts,
    // qwen35 (value heads tiling the key heads), qwen35moe. Their positions sit near 2e-4
    // apart (the f16 rows of the GEMMs); past the sixtieth, qwen3next's random router meets
    // near ties the tie test does not flag (single positions at 1e-3 to 2e-2): the experts'
    // files are compared over 60 positions, the dense one over 100.
    for (name, spec) in hybrid_and_gpt_oss_files() {
        let n = if spec.n_expert > 0 { 60 } else { 100 };
        check_prompt(name, &spec, &tensor_cores, n);
    }
    // The delta rule's chunked form serves heads of 64 and 128: given to the dense hybrid
    // (the experts' files keep their heads, whose routers' near ties are known above).
    for (name, mut spec) in hybrid_and_gpt_oss_files() {
        if let Some(net) = spec.delta_net.as_mut().filter(|_| spec.n_expert == 0) {
            net.state_size = 64;
            let n = if spec.n_expert > 0 { 60 } else { 100 };
            check_prompt(&format!("{name} (heads of 64)"), &spec, &tensor_cores, n);
        }
    }
}

/// The comparison can fail: the batched step with the key and value caches of its attention
/// swapped, or the key and value rows it stores, is far from the CPU.
#[test]
fn a_swapped_argument_is_caught() {
    let tuning = host_tuning();
    let spec = small("llama");
    for swap in [
        Swap {
            kernel: "attn_rows",
            args: (1, 2),
        },
        Swap {
            kernel: "rope_rows_slots",
            args: (1, 2),
        },
    ] {
        let what = format!("{} with arguments {:?} swapped", swap.kernel, swap.args);
        let distances = batched_steps(&what, &spec, &tuning, 3, false, Some(swap));
        assert!(
            distances.iter().any(|d| !d.is_close()),
            "{what}: still close to the CPU"
        );
    }
}

/// `--gpu-layers`: a prompt through the first layers' plan returns every token's residual
/// stream, from which the CPU's remaining layers and output head give the CPU model's logits.
#[test]
fn the_first_layers_hand_the_cpu_their_residual_stream() {
    let tuning = host_tuning();
    let mut spec = SyntheticSpec::small("llama");
    spec.n_layer = 4;
    spec.head_dim = 64;
    let first = 2;
    let (file, model, plan) = load_layers(&spec, &tuning, Some(first), N_CTX);
    assert!(plan.head.is_none());
    let dev = HostDevice::new(&file, &plan, 1);
    let at = dev.addresses(0);
    let mut prefill = Prefill::on(dev, &plan, &tuning).unwrap();
    let seq = ids(3, 30);
    let hidden = prefill.eval(&plan, &at, &seq, 0, true, true).unwrap();
    assert_eq!(hidden.len(), seq.len() * plan.n_embd);
    let split = model
        .session(N_CTX)
        .eval_from(&seq, first, &hidden, Logits::All)
        .unwrap();
    distance(
        "the first 2 layers",
        &cpu_logits(&model, &seq),
        &split,
        plan.n_vocab,
        &[],
    )
    .assert_close();
}

/// The batched step's selections over rows the host gives: each row's greedy choice and its
/// k largest, as the host finds them.
#[test]
fn the_selections_over_given_rows_are_the_hosts() {
    let tuning = host_tuning();
    let spec = SyntheticSpec::small("llama");
    let (file, _, plan) = load(&spec, &tuning);
    let mut prefill = Prefill::on(HostDevice::new(&file, &plan, 1), &plan, &tuning).unwrap();
    let rows: Vec<f32> = (0..3 * plan.n_vocab)
        .map(|i| ((i * 7919) % 1013) as f32 * 0.01)
        .collect();
    let (greedy, top) = prefill.select_rows(&plan, &rows, 5).unwrap();
    for (r, row) in rows.chunks_exact(plan.n_vocab).enumerate() {
        assert_eq!(greedy[r] as usize, math::argmax(row));
        let mut sorted = row.to_vec();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let mut values: Vec<f32> = top[r].iter().map(|&(_, v)| v).collect();
        values.sort_by(|a, b| b.total_cmp(a));
        assert_eq!(values, sorted[..5]);
        assert!(top[r].iter().all(|&(id, v)| row[id as usize] == v));
    }
}

/// A prompt longer than a batch, in batches of [`MAX_BATCH`] as `CudaModel` hands them to the
/// prompt pass (each at its position; only the last chooses a token).
#[test]
fn a_prompt_longer_than_a_batch_goes_in_batches() {
    let tuning = host_tuning();
    let spec = small("llama");
    let seq = ids(4, MAX_BATCH + 88);
    let (file, model, plan) = load_layers(&spec, &tuning, None, seq.len());
    let dev = HostDevice::new(&file, &plan, 1);
    let at = dev.addresses(0);
    let mut prefill = Prefill::on(dev, &plan, &tuning).unwrap();
    let n_batches = seq.len().div_ceil(MAX_BATCH);
    let mut logits = Vec::new();
    for (i, batch) in seq.chunks(MAX_BATCH).enumerate() {
        let last = i + 1 == n_batches;
        logits.extend(
            prefill
                .eval(&plan, &at, batch, i * MAX_BATCH, true, last)
                .unwrap(),
        );
    }
    let what = format!("a prompt of {} in batches of {MAX_BATCH}", seq.len());
    distance(&what, &cpu_logits(&model, &seq), &logits, plan.n_vocab, &[]).assert_close();
}

/// The CPU tier in prompt batches (`cpu_prompt.rs`): in each layer of experts, the groups of
/// the last experts computed on the CPU for the tokens that chose them (their rows copied into
/// the grouped outputs), the others by the emulated GPU; the prompt's logits against the CPU
/// model's as without the share, with one expert, half of them and all of them on the CPU, and
/// with the count adapted, the groups padded to one batched GEMM a matrix and not, on
/// qwen3moe, qwen2moe (a gated shared expert), Mixtral-style llama, qwen35moe (a hybrid) and
/// gpt-oss (the experts' biases, MXFP4).
#[test]
fn prompt_batches_share_their_expert_groups_with_the_cpu() {
    for padded in [true, false] {
        let tuning = CudaTuning {
            // (host-memory stacks are not kept as f16 copies: each batch dequantizes the GPU's)
            f16_experts: false,
            padded_expert_groups: padded,
            ..host_tuning()
        };
        share_prompt_groups(&tuning);
    }
}

fn share_prompt_groups(tuning: &CudaTuning) {
    use ferrolm_cuda::cpu_prompt::PromptCpuShare;
    let padded = tuning.padded_expert_groups;
    let moe_files = files().into_iter().filter(|(_, s)| s.n_expert > 0).chain(
        hybrid_and_gpt_oss_files()
            .into_iter()
            .filter(|(n, _)| ["qwen35moe", "gpt-oss"].contains(n))
            .map(|(n, s)| (n.to_string(), s)),
    );
    for (name, spec) in moe_files {
        let ne = spec.n_expert;
        for (count, adapt) in [(1, false), (ne / 2, false), (ne, false), (ne / 2, true)] {
            let (file, model, plan) = load(&spec, tuning);
            let dev = HostDevice::new(&file, &plan, 2);
            let at = dev.addresses(1);
            let mut prefill = Prefill::on(dev, &plan, tuning).unwrap();
            let layers: Vec<usize> = (0..plan.layers.len())
                .filter(|&l| plan.layers[l].moe.is_some())
                .collect();
            let k = plan.layers[layers[0]].moe.as_ref().unwrap().n_used;
            let experts = model.host_experts(&layers).unwrap();
            let share = PromptCpuShare::new(experts, 2, count, adapt).unwrap();
            prefill.set_cpu_share(share);
            let seq = ids(1, 60);
            let logits = prefill.eval(&plan, &at, &seq, 0, true, true).unwrap();
            let ties = near_ties(&prefill);
            let what = format!(
                "{name}, {count} of {ne} experts on the CPU (adapted: {adapt}, padded: {padded})"
            );
            let cpu = cpu_logits(&model, &seq);
            distance(&what, &cpu, &logits, plan.n_vocab, &ties).assert_close();
            let (on_cpu, on_gpu) = prefill.cpu_share_rows().unwrap();
            assert_eq!(
                on_cpu + on_gpu,
                (layers.len() * seq.len() * k) as u64,
                "{what}: every pair of every layer on one side"
            );
            assert!(on_cpu > 0, "{what}: the CPU computed none");
            assert_eq!(
                on_gpu == 0,
                count == ne && !adapt,
                "{what}: {on_gpu} on the GPU"
            );
            let launched = &prefill.device().launched;
            let pads = launched.iter().any(|l| l == "moe_pad_rows");
            assert_eq!(pads, padded, "{what}: {launched:?}");
        }
    }
}

/// f16 copies of only the expert stacks that fit (`Prefill::keep_f16_experts_within`, a
/// device too small for all of them): the kept stacks read as they are, the others
/// dequantized for each batch, the CPU's logits still.
#[test]
fn some_expert_stacks_kept_as_f16_give_the_cpus_logits() {
    let tuning = host_tuning();
    for (name, spec) in files().into_iter().filter(|(_, s)| s.n_expert > 0) {
        let (file, model, plan) = load(&spec, &tuning);
        let dev = HostDevice::new(&file, &plan, 2);
        let at = dev.addresses(1);
        let mut prefill = Prefill::on(dev, &plan, &tuning).unwrap();
        let all = Prefill::f16_expert_bytes(&plan);
        let kept = prefill
            .keep_f16_experts_within(&plan, &at, all / 2)
            .unwrap();
        assert!(
            kept > 0 && kept <= all / 2,
            "{name}: {kept} of {all} bytes kept"
        );
        let seq = ids(1, 60);
        let logits = prefill.eval(&plan, &at, &seq, 0, true, true).unwrap();
        let ties = near_ties(&prefill);
        let what = format!("{name}, {kept} of {all} bytes of f16 expert copies");
        distance(
            &what,
            &cpu_logits(&model, &seq),
            &logits,
            plan.n_vocab,
            &ties,
        )
        .assert_close();
    }
}

/// The CPU tier in batched decode steps (`serve --parallel` under a budget, and models whose
/// experts are streamed from the file): 3 and 8 sequences at different positions, each step's
/// pairs grouped by expert as a prompt's, the last experts' groups on the CPU (half of them,
/// and all), launch by launch (no graph); each sequence's logits against the CPU model's
/// alone, on qwen3moe and gpt-oss.
#[test]
fn batched_steps_share_their_expert_groups_with_the_cpu() {
    use ferrolm_cuda::cpu_prompt::PromptCpuShare;
    let tuning = CudaTuning {
        f16_experts: false,
        ..host_tuning()
    };
    // (gpt-oss's every expert chosen, as in the batched steps' test above: its small file's
    // router meets near ties the tie test does not flag)
    let mut gpt_oss = SyntheticSpec::small("gpt-oss");
    gpt_oss.n_layer = 2;
    gpt_oss.sliding_window = Some(8);
    gpt_oss.n_expert_used = gpt_oss.n_expert;
    for (name, spec) in [("qwen3moe", small("qwen3moe")), ("gpt-oss", gpt_oss)] {
        let ne = spec.n_expert;
        for (batch, count) in [(3, ne / 2), (8, ne / 2), (8, ne)] {
            let (file, model, plan) = load(&spec, &tuning);
            let dev = HostDevice::new(&file, &plan, batch);
            let slots: Vec<Addresses> = (0..batch).map(|s| dev.addresses(s)).collect();
            let stride = dev.slot_stride();
            let mut prefill = Prefill::on(dev, &plan, &tuning).unwrap();
            let layers: Vec<usize> = (0..plan.layers.len())
                .filter(|&l| plan.layers[l].moe.is_some())
                .collect();
            let experts = model.host_experts(&layers).unwrap();
            let share = PromptCpuShare::new(experts, 2, count, false).unwrap();
            prefill.set_cpu_share(share);
            let steps = 3;
            let prompt_len = |s: usize| 2 + (5 * s) % 7;
            let seqs: Vec<Vec<u32>> = (0..batch).map(|s| ids(s, prompt_len(s) + steps)).collect();
            let mut logits = Vec::new();
            let mut ties: Vec<Vec<usize>> = vec![Vec::new(); batch];
            for (s, seq) in seqs.iter().enumerate() {
                let prompt = &seq[..prompt_len(s)];
                let out = prefill.eval(&plan, &slots[s], prompt, 0, true, true);
                logits.push(out.unwrap());
                ties[s].extend(near_ties(&prefill));
            }
            let before = prefill.cpu_share_rows().unwrap();
            let rows: Vec<u32> = (0..batch as u32).collect();
            for step in 0..steps {
                let (ids, pos): (Vec<u32>, Vec<u32>) = (0..batch)
                    .map(|s| (seqs[s][prompt_len(s) + step], (prompt_len(s) + step) as u32))
                    .unzip();
                let want = RowsWant::Logits;
                let out = prefill
                    .decode_rows(
                        &plan,
                        &slots[0],
                        &ids,
                        &rows,
                        &pos,
                        &stride,
                        batch as u32,
                        want,
                    )
                    .unwrap();
                let Rows::Logits(out) = out else {
                    panic!("logits asked for")
                };
                for (s, row) in out.chunks_exact(plan.n_vocab).enumerate() {
                    logits[s].extend_from_slice(row);
                }
                for s in near_ties(&prefill).into_iter().filter(|&s| s < batch) {
                    ties[s].push(prompt_len(s) + step);
                }
            }
            for (s, seq) in seqs.iter().enumerate() {
                let what =
                    format!("{name}, batch {batch}, {count} of {ne} on the CPU, sequence {s}");
                let cpu = cpu_logits(&model, seq);
                distance(&what, &cpu, &logits[s], plan.n_vocab, &ties[s]).assert_close();
            }
            let after = prefill.cpu_share_rows().unwrap();
            assert!(
                after.0 > before.0,
                "{name}, batch {batch}: the steps' CPU rows"
            );
            assert_eq!(
                prefill.device().replays.get(),
                0,
                "{name}: no graph replayed"
            );
        }
    }
}
