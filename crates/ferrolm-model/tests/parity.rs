//! Parity with llama.cpp on real models (DESIGN.md principle 3): every position's distribution
//! compared by KL divergence and top-1 agreement, and greedy continuations token by token,
//! against golden data made by `scripts/parity_golden.py`.

use std::path::PathBuf;

use ferrolm_model::{LoadOptions, Logits, Model};
use ferrolm_quant::KernelOptions;

mod common;
use common::{golden, kl_and_top1, same_top_logits};

/// The model cache, as `ferrolm pull` fills it.
fn model_path(file: &str) -> PathBuf {
    let home = std::env::var_os("FERROLM_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cache/ferrolm")
        });
    let path = home.join("models").join(file);
    assert!(
        path.exists(),
        "{} is missing: run `cargo run --release -p ferrolm -- pull all` (scripts/test does)",
        path.display()
    );
    path
}

/// Compares the model in `file` with the golden data `name`, with the kernels `kernels` say
/// (the llama.cpp configuration the data was made with), on every `every`-th case.
fn check(file: &str, name: &str, kernels: KernelOptions, every: usize) {
    let g = golden(name);
    let options = LoadOptions {
        kernels,
        ..Default::default()
    };
    let model = Model::load_with(model_path(file), &options).unwrap();
    let n_vocab = model.plan().n_vocab;
    let row_bytes = 4 + g.k * 8;
    let (mut kl_sum, mut top1, mut positions, mut offset) = (0.0, 0usize, 0usize, 0usize);
    let mut worst = (0.0f64, 0usize);
    let (mut same_greedy, mut checked, mut inexact) = (0, 0, 0);
    for (case, (ids, greedy)) in g.cases.iter().enumerate() {
        if case % every != 0 {
            offset += ids.len() * row_bytes;
            continue;
        }
        checked += 1;
        let mut s = model.session(1024);
        let logits = s.eval(ids, Logits::All).unwrap();
        for row in logits.chunks(n_vocab) {
            let reference = &g.topk[offset..offset + row_bytes];
            let (kl, agree) = kl_and_top1(reference, g.k, row);
            inexact += usize::from(!same_top_logits(reference, g.k, row));
            offset += row_bytes;
            kl_sum += kl;
            top1 += usize::from(agree);
            positions += 1;
            if kl > worst.0 {
                worst = (kl, case);
            }
        }
        // Greedy continuation, token by token.
        let mut ours = Vec::new();
        let mut last = logits[logits.len() - n_vocab..].to_vec();
        for _ in 0..greedy.len() {
            let best = last
                .iter()
                .enumerate()
                .fold(0, |b, (i, &x)| if x > last[b] { i } else { b });
            ours.push(best as u32);
            last = s.eval(&[best as u32], Logits::Last).unwrap();
        }
        let agree = ours.iter().zip(greedy).take_while(|(a, b)| a == b).count();
        same_greedy += usize::from(agree == greedy.len());
        eprintln!(
            "case {case:2}: {:4} tokens, greedy agrees for {agree}/{}",
            ids.len(),
            greedy.len()
        );
    }
    assert_eq!(offset, g.topk.len(), "golden data and cases disagree");
    let mean_kl = kl_sum / positions as f64;
    let top1_rate = top1 as f64 / positions as f64;
    eprintln!(
        "{name}: {positions} positions, mean KL {mean_kl:.3e} (worst {:.3e} in case {}), top-1 {:.2}%, greedy identical {same_greedy}/{checked}",
        worst.0, worst.1, 100.0 * top1_rate
    );
    eprintln!(
        "{name}: {inexact} of {positions} positions with a top-{} logit not bit-identical",
        g.k
    );
    // The goldens come from llama.cpp's AVX512 x86-64 build, whose arithmetic ferrolm
    // reproduces on any x86-64 CPU with AVX2 (docs/PARITY.md); elsewhere, the bars below.
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        assert_eq!(
            inexact, 0,
            "{name}: logits not bit-identical to llama.cpp's"
        );
    }
    assert!(mean_kl <= 1e-3, "mean KL {mean_kl:.3e} > 1e-3");
    assert!(top1_rate >= 0.99, "top-1 agreement {top1_rate:.4} < 0.99");
    assert!(
        same_greedy * 10 >= checked * 9,
        "greedy identical on {same_greedy}/{checked}"
    );
}

#[test]
fn smollm2_matches_llama_cpp() {
    check(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2",
        KernelOptions::default(),
        1,
    );
}

/// Gemma 3 270M (Q4_K_M): sliding-window layers (two prompts cross the 512-token window),
/// GELU, post-norms, Q/K norms, query scaling. The golden data is llama.cpp's default: its Q4_K
/// matrices repacked, its tiled K-quant batches (scripts/gemma_golden.py, docs/PARITY.md).
#[test]
fn gemma3_270m_matches_llama_cpp() {
    check(
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3",
        KernelOptions::default(),
        1,
    );
}

/// The same file against llama.cpp with both its repacking and its tiled matmul off, which
/// sums every K-quant product in `vec_dot`'s order: every third case (short prompts and the
/// longest, past the window), to keep CI short.
#[test]
fn gemma3_270m_matches_plain_llama_cpp() {
    check(
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3-plain",
        KernelOptions::PLAIN,
        3,
    );
}
