//! Causal grouped-query attention of a batch of tokens over the cache.

use half::f16;
use rayon::prelude::*;

use crate::kv_cache::LayerCache;
use crate::plan::Attention;

/// `out[t][h]` = softmax(q_t,h . K^T * scale) V over positions `0..=pos0 + t`, with `q` and the
/// probabilities rounded to f16 as llama.cpp's f16 cache products do.
pub fn attend(
    a: &Attention,
    cache: &LayerCache,
    n_ctx: usize,
    q: &[f32],
    pos0: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    debug_assert_eq!(out.len(), n_tok * a.n_head * a.head_dim);
    let hd = a.head_dim;
    let group = a.n_head / a.n_head_kv;
    let kv_dim = cache.kv_dim;
    let f16_dot = ferrolm_quant::dot_kernel(ferrolm_gguf::TensorType::F16).expect("F16 kernel");
    let k_bytes: &[u8] = bytemuck::cast_slice(&cache.k);
    let v_bytes: &[u8] = bytemuck::cast_slice(&cache.v_t);
    out.par_chunks_mut(hd).enumerate().for_each_init(
        || (vec![f16::ZERO; hd], Vec::<f32>::new(), Vec::<f16>::new()),
        |(q16, scores, probs16), (idx, out_h)| {
            let (t, h) = (idx / a.n_head, idx % a.n_head);
            let kvh = h / group;
            let n_kv = pos0 + t + 1;
            for (d, &s) in q16.iter_mut().zip(&q[idx * hd..(idx + 1) * hd]) {
                *d = f16::from_f32(s);
            }
            let q_bytes: &[u8] = bytemuck::cast_slice(q16);
            scores.clear();
            let mut max = f32::NEG_INFINITY;
            for j in 0..n_kv {
                let k = &k_bytes[(j * kv_dim + kvh * hd) * 2..(j * kv_dim + (kvh + 1) * hd) * 2];
                let s = f16_dot.dot(hd, k, q_bytes) * a.scale;
                max = max.max(s);
                scores.push(s);
            }
            let mut sum = 0f64;
            for s in scores.iter_mut() {
                *s = (*s - max).exp();
                sum += f64::from(*s);
            }
            let inv = (1.0 / sum) as f32;
            probs16.clear();
            probs16.extend(scores.iter().map(|&s| f16::from_f32(s * inv)));
            let p_bytes: &[u8] = bytemuck::cast_slice(probs16);
            for (d, o) in out_h.iter_mut().enumerate() {
                let row = (kvh * hd + d) * n_ctx;
                *o = f16_dot.dot(n_kv, &v_bytes[row * 2..(row + n_kv) * 2], p_bytes);
            }
        },
    );
}
