//! `HostExperts::outputs` (chosen experts computed on the CPU for another executor) gives the
//! CPU forward pass's expert outputs bit for bit: the routed sum rebuilt from them equals the
//! pass's own `ffn_moe_out`, and bad requests are errors.

use std::sync::Arc;

use ferrolm_gguf::GgufFile;
use ferrolm_model::synthetic::{self, SyntheticSpec};
use ferrolm_model::{Logits, Model};
use ferrolm_threads::ThreadPool;

fn read_f32(path: &std::path::Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The `k` best of `probs`, ties to the lower index (the CPU's softmax top-k).
fn top_k(probs: &[f32], k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..probs.len() as u32).collect();
    order.sort_by(|&a, &b| {
        probs[b as usize]
            .total_cmp(&probs[a as usize])
            .then(a.cmp(&b))
    });
    order.truncate(k);
    order
}

#[test]
fn the_routed_sum_of_host_expert_outputs_is_the_forward_pass_s() {
    let mut spec = SyntheticSpec::small("qwen3moe");
    spec.n_expert = 16;
    let file = Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
    let mut model = Model::from_file(file, 2).unwrap();
    let dir = std::env::temp_dir().join(format!("ferrolm-host-experts-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    model.set_dump_dir(Some(dir.clone()));
    model.session(8).eval(&[5], Logits::Last).unwrap();
    let layers: Vec<usize> = (0..spec.n_layer).collect();
    let host = model.host_experts(&layers).unwrap();
    let d = spec.n_embd;
    let k = model
        .plan()
        .layers
        .iter()
        .find_map(|l| match &l.ffn {
            ferrolm_model::plan::Ffn::Moe(m) => Some(m.n_expert_used),
            _ => None,
        })
        .unwrap();
    for pool_threads in [1, 2] {
        let pool = ThreadPool::new(pool_threads).unwrap();
        for &l in &layers {
            let h = read_f32(&dir.join(format!("ffn_norm-{l}.f32")));
            let probs = read_f32(&dir.join(format!("ffn_moe_probs-{l}.f32")));
            let weights = read_f32(&dir.join(format!("ffn_moe_weights_norm-{l}.f32")));
            let want = read_f32(&dir.join(format!("ffn_moe_out-{l}.f32")));
            let ids = top_k(&probs, k);
            let mut ys = vec![0f32; k * d];
            host.outputs(&pool, l, &ids, &h, &mut ys).unwrap();
            let mut sum: Vec<f32> = ys[..d].iter().map(|y| y * weights[0]).collect();
            for j in 1..k {
                for (s, y) in sum.iter_mut().zip(&ys[j * d..(j + 1) * d]) {
                    *s += y * weights[j];
                }
            }
            let same = sum
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(
                same,
                "layer {l}: the routed sum differs from the forward pass's"
            );
        }
    }
    let pool = ThreadPool::new(1).unwrap();
    let h = vec![0.5f32; d];
    let mut ys = vec![0f32; d];
    let e = host
        .outputs(&pool, 0, &[spec.n_expert as u32], &h, &mut ys)
        .unwrap_err();
    assert!(e.to_string().contains("expert 16"), "{e}");
    let few = model.host_experts(&[0]).unwrap();
    let e = few.outputs(&pool, 1, &[0], &h, &mut ys).unwrap_err();
    assert!(e.to_string().contains("layer 1"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `HostExperts::grouped` over a prompt's rows grouped by expert (each expert's rows in the
/// order the pass takes them) gives the pass's routed sum bit for bit, on a file whose experts
/// carry biases (gpt-oss) and one without; bad groups are errors.
#[test]
fn grouped_expert_rows_give_the_forward_pass_s_routed_sum() {
    for arch in ["qwen3moe", "gpt-oss"] {
        let mut spec = SyntheticSpec::small(arch);
        spec.n_expert = 8;
        let file =
            Arc::new(GgufFile::from_bytes(synthetic::build(&spec).unwrap().to_bytes()).unwrap());
        let mut model = Model::from_file(file, 2).unwrap();
        let dir =
            std::env::temp_dir().join(format!("ferrolm-grouped-{arch}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        model.set_dump_dir(Some(dir.clone()));
        let prompt = [5, 17, 3, 99, 41, 8, 250, 12, 77, 6];
        let n = prompt.len();
        model.session(16).eval(&prompt, Logits::Last).unwrap();
        let moe = |l: &ferrolm_model::plan::LayerPlan| match &l.ffn {
            ferrolm_model::plan::Ffn::Moe(m) => Some((m.n_expert_used, m.gating)),
            _ => None,
        };
        let layers: Vec<usize> = (0..spec.n_layer)
            .filter(|&l| moe(&model.plan().layers[l]).is_some())
            .collect();
        let host = model.host_experts(&layers).unwrap();
        let d = spec.n_embd;
        let pool = ThreadPool::new(2).unwrap();
        for &l in &layers {
            let (k, _) = moe(&model.plan().layers[l]).unwrap();
            let h = read_f32(&dir.join(format!("ffn_norm-{l}.f32")));
            let weights = read_f32(&dir.join(format!("ffn_moe_weights_norm-{l}.f32")));
            let want = read_f32(&dir.join(format!("ffn_moe_out-{l}.f32")));
            let logits = read_f32(&dir.join(format!("ffn_moe_probs-{l}.f32")));
            let ne = logits.len() / n;
            // Each token's experts: the k best of its probabilities (or, for gpt-oss, of
            // its logits: its softmax follows the choice, which keeps their order).
            let ids: Vec<u32> = logits.chunks(ne).flat_map(|p| top_k(p, k)).collect();
            // Pairs grouped by expert, each group in pair order.
            let mut order: Vec<usize> = (0..n * k).collect();
            order.sort_by_key(|&i| ids[i]);
            let x: Vec<f32> = order
                .iter()
                .flat_map(|&i| h[(i / k) * d..(i / k + 1) * d].iter().copied())
                .collect();
            let mut groups: Vec<(u32, std::ops::Range<usize>)> = Vec::new();
            for (r, &i) in order.iter().enumerate() {
                match groups.last_mut() {
                    Some((e, rows)) if *e == ids[i] => rows.end = r + 1,
                    _ => groups.push((ids[i], r..r + 1)),
                }
            }
            let mut y = vec![0f32; n * k * d];
            host.grouped(&pool, l, &groups, &x, &mut y).unwrap();
            let mut at = vec![0usize; n * k];
            for (r, &i) in order.iter().enumerate() {
                at[i] = r;
            }
            for t in 0..n {
                let row = |j: usize| &y[at[t * k + j] * d..(at[t * k + j] + 1) * d];
                let mut sum: Vec<f32> = row(0).iter().map(|v| v * weights[t * k]).collect();
                for j in 1..k {
                    for (s, v) in sum.iter_mut().zip(row(j)) {
                        *s += v * weights[t * k + j];
                    }
                }
                let same = sum
                    .iter()
                    .zip(&want[t * d..(t + 1) * d])
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(
                    same,
                    "{arch}, layer {l}, token {t}: not the pass's routed sum"
                );
            }
        }
        let e = host
            .grouped(&pool, layers[0], &[(8, 0..1)], &[0.0; 64], &mut [0.0; 64])
            .unwrap_err();
        assert!(e.to_string().contains("expert 8"), "{e}");
        let e = host
            .grouped(
                &pool,
                layers[0],
                &[(1, 0..3)],
                &vec![0.0; 2 * d],
                &mut vec![0.0; 3 * d],
            )
            .unwrap_err();
        assert!(e.to_string().contains("rows 0..3"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
