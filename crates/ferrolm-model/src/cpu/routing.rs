//! Mixture-of-experts routing: router logits in, per token the experts to run and their
//! weights out, computed as llama.cpp's `build_moe_ffn` computes them (same order of
//! operations, same rounding), so that the same experts are picked. Nothing here touches
//! expert weights: where they come from (the mapped file, a cache) is the caller's business.
//!
//! The steps, each a field of [`Moe`]:
//! 1. probabilities from the logits: softmax, sigmoid, or the logits themselves (gpt-oss,
//!    whose softmax comes after the selection);
//! 2. selection scores: the probabilities plus `exp_probs_b` when the layer has one;
//! 3. grouped top-k: experts outside the best groups are masked out of the selection;
//! 4. top-k of the selection scores, in descending order;
//! 5. weights: the unbiased probabilities of the selected experts, softmaxed (gpt-oss),
//!    renormalized to sum 1 and scaled as the plan says.

use crate::plan::{ExpertGroups, Gating, Moe};

/// The smallest sum of selected weights a renormalization divides by (the smallest normal
/// f16, as llama.cpp clamps it).
const MIN_WEIGHTS_SUM: f32 = 6.103_515_6e-5; // 2^-14

/// What routing a batch gives: `selected[t * k + slot]` is the expert of token `t`'s
/// `slot`-th pick (descending selection score), `weights` the same layout.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Routes {
    pub selected: Vec<usize>,
    pub weights: Vec<f32>,
}

/// ggml's argsort, descending: `std::sort` over the indices, which libstdc++ finishes with an
/// insertion sort for rows of at most 16, stable there; a stable sort reproduces it for the
/// expert and group counts routing sorts (equal scores keep index order).
fn argsort_desc(scores: &[f32], order: &mut Vec<usize>) {
    order.clear();
    order.extend(0..scores.len());
    order.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]));
}

/// Per token: the experts `m` selects from `logits` (`n x n_expert`) and their weights.
/// `selection_bias` is the layer's `exp_probs_b` when `m.selection_bias`; `probs` receives
/// the probabilities (step 1), as llama.cpp's `ffn_moe_probs`.
pub(crate) fn route(
    m: &Moe,
    logits: &[f32],
    selection_bias: Option<&[f32]>,
    probs: &mut [f32],
) -> Routes {
    let (ne, k) = (m.n_expert, m.n_expert_used);
    let n = logits.len() / ne;
    let mut selected = Vec::with_capacity(n * k);
    let mut weights = Vec::with_capacity(n * k);
    let mut order: Vec<usize> = Vec::with_capacity(ne);
    let mut selection = vec![0f32; ne];
    let mut group_order = Vec::new();
    for (row, p) in logits.chunks(ne).zip(probs.chunks_mut(ne)) {
        probabilities(m.gating, row, p);
        selection.copy_from_slice(p);
        if let Some(b) = selection_bias {
            selection.iter_mut().zip(b).for_each(|(s, b)| *s += b);
        }
        if let Some(g) = m.groups {
            mask_groups(g, &mut selection, &mut order, &mut group_order);
        }
        argsort_desc(&selection, &mut order);
        let first = weights.len();
        for &e in &order[..k] {
            selected.push(e);
            weights.push(p[e]);
        }
        let w = &mut weights[first..];
        if m.gating == Gating::SoftmaxAfterTopK {
            softmax_in_place(w);
        }
        if m.norm_weights {
            // ggml_sum_rows (f64 accumulation), clamped, then an f32 division.
            let sum = w.iter().map(|&v| f64::from(v)).sum::<f64>() as f32;
            let sum = sum.max(MIN_WEIGHTS_SUM);
            w.iter_mut().for_each(|v| *v /= sum);
        }
        if let Some(s) = m.weights_scale {
            if s != 0.0 && s != 1.0 {
                w.iter_mut().for_each(|v| *v *= s);
            }
        }
    }
    Routes { selected, weights }
}

/// Step 1 for one token.
fn probabilities(gating: Gating, row: &[f32], p: &mut [f32]) {
    match gating {
        Gating::Softmax => {
            p.copy_from_slice(row);
            softmax_in_place(p);
        }
        // ggml's sigmoid op: 1 / (1 + expf(-x)), element by element.
        Gating::Sigmoid => p
            .iter_mut()
            .zip(row)
            .for_each(|(p, &x)| *p = 1.0 / (1.0 + (-x).exp())),
        Gating::SoftmaxAfterTopK => p.copy_from_slice(row),
    }
}

/// ggml_soft_max over one row: `exp(x - max)` summed in f64, times `1 / sum` rounded to f32.
fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let src = x.to_vec();
    let sum = ferrolm_quant::ggml_vec::soft_max(&src, x, max);
    let inv = (1.0 / sum) as f32;
    x.iter_mut().for_each(|v| *v *= inv);
}

/// Step 3: each group scores the sum of its two best selection scores; the experts of all but
/// the `n_group_used` best groups become `-inf`. (llama.cpp: argsort within each group, the
/// top two summed by `ggml_sum_rows`, an argsort of the group scores.)
fn mask_groups(
    g: ExpertGroups,
    selection: &mut [f32],
    order: &mut Vec<usize>,
    group_order: &mut Vec<usize>,
) {
    let per_group = selection.len() / g.n_group;
    let scores: Vec<f32> = selection
        .chunks(per_group)
        .map(|group| {
            argsort_desc(group, order);
            let top2 = order.iter().take(2).map(|&i| f64::from(group[i]));
            top2.sum::<f64>() as f32
        })
        .collect();
    argsort_desc(&scores, group_order);
    for &dropped in &group_order[g.n_group_used..] {
        selection[dropped * per_group..(dropped + 1) * per_group].fill(f32::NEG_INFINITY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Activation;

    fn moe(ne: usize, k: usize, gating: Gating, norm: bool) -> Moe {
        Moe {
            n_expert: ne,
            n_expert_used: k,
            n_ff: 32,
            activation: Activation::Silu,
            gating,
            selection_bias: false,
            groups: None,
            biases: false,
            norm_weights: norm,
            weights_scale: None,
            shared: None,
        }
    }

    #[test]
    fn softmax_routing_picks_the_best_experts_ties_by_index_and_renormalizes() {
        let logits = [0.5, 2.0, 0.5, 2.0, 1.0, -1.0, 3.0, 1.0];
        let mut probs = [0.0; 8];
        let r = route(
            &moe(4, 2, Gating::Softmax, false),
            &logits,
            None,
            &mut probs,
        );
        // Token 0: experts 1 and 3 tie; token 1: expert 2, then 0 and 3 tie (0 first).
        assert_eq!(r.selected, [1, 3, 2, 0]);
        assert!((probs[..4].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert_eq!(r.weights[0], probs[1]);
        assert_eq!(r.weights[3], probs[4]);
        let r2 = route(&moe(4, 3, Gating::Softmax, true), &logits, None, &mut probs);
        assert_eq!(r2.selected, [1, 3, 0, 2, 0, 3]);
        assert!((r2.weights[..3].iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(r2.weights[0] > r.weights[0]);
    }

    #[test]
    fn sigmoid_selection_uses_the_bias_but_weights_do_not() {
        let logits = [0.0, 1.0, -1.0, 2.0];
        let bias = [0.0, 0.0, 5.0, 0.0];
        let mut probs = [0.0; 4];
        let mut m = moe(4, 2, Gating::Sigmoid, false);
        m.selection_bias = true;
        m.weights_scale = Some(2.5);
        let r = route(&m, &logits, Some(&bias), &mut probs);
        let sig = |x: f32| 1.0 / (1.0 + (-x).exp());
        // Expert 2 wins on its bias (sigmoid(-1) + 5), then expert 3 (sigmoid(2)).
        assert_eq!(r.selected, [2, 3]);
        assert_eq!(r.weights, [sig(-1.0) * 2.5, sig(2.0) * 2.5]);
        assert_eq!(probs, [sig(0.0), sig(1.0), sig(-1.0), sig(2.0)]);
    }

    #[test]
    fn softmax_after_top_k_normalizes_the_selected_only() {
        let logits = [1.0, 3.0, 2.0, -4.0];
        let mut probs = [0.0; 4];
        let r = route(
            &moe(4, 2, Gating::SoftmaxAfterTopK, false),
            &logits,
            None,
            &mut probs,
        );
        assert_eq!(r.selected, [1, 2]);
        let e = (-1.0f32).exp();
        assert!((r.weights[0] - 1.0 / (1.0 + e)).abs() < 1e-6);
        assert!((r.weights[1] - e / (1.0 + e)).abs() < 1e-6);
        assert_eq!(probs, logits, "probabilities are the raw logits");
    }

    /// A hand-computed case: 8 experts in 4 groups of 2, 2 groups kept, top-3.
    /// Scores (sigmoid of the logits is monotone, so work with the biased selection directly):
    /// group 0 = {0.9, 0.1} sums 1.0; group 1 = {0.5, 0.45} sums 0.95; group 2 = {0.95, 0.0}
    /// sums 0.95; group 3 = {0.6, 0.6} sums 1.2. Kept: groups 3 and 0 (group 1 and 2 tie at
    /// 0.95 and both lose). Without groups the top-3 would be 4 (0.95), 0 (0.9), 6/7 (0.6);
    /// with groups expert 4 is masked: 0 (0.9), 6 (0.6), 7 (0.6).
    #[test]
    fn grouped_top_k_keeps_the_best_groups_by_their_top_two_sum() {
        let selection = [0.9f32, 0.1, 0.5, 0.45, 0.95, 0.0, 0.6, 0.6];
        // Logits whose sigmoid is the selection above: logit(p) = ln(p / (1 - p)); use a
        // selection bias instead to set the scores exactly: logits 0 give sigmoid 0.5, and the
        // bias shifts each to the wanted score.
        let logits = [0.0f32; 8];
        let bias: Vec<f32> = selection.iter().map(|s| s - 0.5).collect();
        let mut m = moe(8, 3, Gating::Sigmoid, false);
        m.selection_bias = true;
        let mut probs = [0.0; 8];
        let ungrouped = route(&m, &logits, Some(&bias), &mut probs);
        assert_eq!(ungrouped.selected, [4, 0, 6]);
        m.groups = Some(ExpertGroups {
            n_group: 4,
            n_group_used: 2,
        });
        let grouped = route(&m, &logits, Some(&bias), &mut probs);
        assert_eq!(grouped.selected, [0, 6, 7]);
        // The weights are the unbiased sigmoids (all 0.5 here).
        assert_eq!(grouped.weights, [0.5; 3]);
    }
}
