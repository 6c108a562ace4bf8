//! Causal grouped-query attention of a batch of tokens over the cache, computed as llama.cpp's
//! non-flash path computes it, so that the results are bit-identical:
//!
//! * the scores `K q` over `n_kv` positions, where `n_kv` is the used length rounded up to 256
//!   (llama.cpp pads it so that its graphs stay the same across batches); `q` rounded to f16;
//!   one token: `ggml_vec_dot_f16` per position; a batch: llamafile's tinyBLAS (the F16
//!   kernel's `dot_rows_multi`);
//! * `scale`, the causal mask (-inf), `ggml_vec_soft_max_f32`, times `1 / sum` rounded to f32;
//! * the probabilities rounded to f16 and multiplied with the transposed values, again by
//!   `ggml_vec_dot_f16` for one token and tinyBLAS for a batch.
//!
//! Positions past the used length hold zeros (or stale values after a rewind) and get
//! probability 0, so they add nothing; they only keep the summation order llama.cpp's.
//!
//! A sliding-window layer reads its ring of cells (`kv_cache::LayerCache`), masking the cells
//! whose position is outside the window as llama.cpp's SWA mask does. Gemma scales the queries
//! instead of the scores; Gemma 2 soft-caps the scores (`c * tanh(s / c)`, libm `tanhf` as
//! ggml's `ggml_vec_tanh_f32`) before the softmax.

use ferrolm_gguf::TensorType;
use ferrolm_quant::ggml_vec;
use ferrolm_threads::ThreadPool;
use half::f16;

use crate::kv_cache::LayerCache;
use crate::plan::Attention;

/// `out[t][h]` for each token `t` of the batch (at position `pos0 + t`) and query head `h`.
#[allow(clippy::too_many_arguments)] // the layer, its cache, the batch and where it sits
pub fn attend(
    pool: &ThreadPool,
    a: &Attention,
    cache: &LayerCache,
    q: &[f32],
    pos0: usize,
    n_tok: usize,
    out: &mut [f32],
) {
    let hd = a.head_dim;
    let q_dim = a.n_head * hd;
    debug_assert_eq!(out.len(), n_tok * q_dim);
    let group = a.n_head / a.n_head_kv;
    let kv_dim = cache.kv_dim;
    let cap = cache.cap;
    let end = pos0 + n_tok;
    let n_kv = cache.n_kv(end);
    // The position of each cell read (None: never written).
    let cell_pos: Vec<Option<usize>> = (0..n_kv).map(|j| cache.position(j, end)).collect();
    let score_scale = if a.scale_queries { 1.0 } else { a.scale };
    let softcap = a.softcap.map(|c| (1.0 / c, c));
    let f16_kernel = ferrolm_quant::dot_kernel(TensorType::F16).expect("F16 kernel");
    let k_bytes: &[u8] = bytemuck::cast_slice(&cache.k);
    let v_bytes: &[u8] = bytemuck::cast_slice(&cache.v_t);

    // One task per head: its scores, probabilities and output for every token of the batch.
    let per_head: Vec<Vec<f32>> = pool.map(a.n_head, |h| {
        let kvh = h / group;
        let mut q16 = vec![f16::ZERO; n_tok * hd];
        let mut q_head = vec![0f32; hd];
        for t in 0..n_tok {
            q_head.copy_from_slice(&q[t * q_dim + h * hd..t * q_dim + (h + 1) * hd]);
            ggml_vec::f32_to_f16_row(&q_head, &mut q16[t * hd..(t + 1) * hd]);
        }
        let q_bytes: &[u8] = bytemuck::cast_slice(&q16);
        // Keys of this head: row j at j * kv_dim + kvh * hd.
        let k_rows = &k_bytes[kvh * hd * 2..];
        let mut scores = vec![0f32; n_tok * n_kv];
        if n_tok == 1 {
            f16_kernel.dot_rows(hd, k_rows, kv_dim * 2, q_bytes, &mut scores);
        } else {
            f16_kernel.dot_rows_multi(
                hd,
                k_rows,
                kv_dim * 2,
                n_kv,
                q_bytes,
                hd * 2,
                n_tok,
                &mut scores,
            );
        }
        let mut probs = vec![0f32; n_kv];
        let mut p16 = vec![f16::ZERO; n_tok * n_kv];
        for t in 0..n_tok {
            let row = &mut scores[t * n_kv..(t + 1) * n_kv];
            let query = pos0 + t;
            let mut max = f32::NEG_INFINITY;
            for (s, p) in row.iter_mut().zip(&cell_pos) {
                *s = match p {
                    Some(p) if cache.visible(*p, query) => {
                        let capped = match softcap {
                            Some((inv, c)) => (*s * inv).tanh() * c,
                            None => *s,
                        };
                        capped * score_scale
                    }
                    _ => f32::NEG_INFINITY,
                };
                max = max.max(*s);
            }
            let sum = ggml_vec::soft_max(row, &mut probs, max);
            let inv = (1.0 / sum) as f32;
            probs.iter_mut().for_each(|p| *p *= inv);
            ggml_vec::f32_to_f16_row(&probs, &mut p16[t * n_kv..(t + 1) * n_kv]);
        }
        let p_bytes: &[u8] = bytemuck::cast_slice(&p16);
        // Transposed values of this head: row d at (kvh * hd + d) * cap.
        let v_rows = &v_bytes[kvh * hd * cap * 2..];
        let mut o = vec![0f32; n_tok * hd];
        if n_tok == 1 {
            f16_kernel.dot_rows(n_kv, v_rows, cap * 2, p_bytes, &mut o);
        } else {
            f16_kernel.dot_rows_multi(n_kv, v_rows, cap * 2, hd, p_bytes, n_kv * 2, n_tok, &mut o);
        }
        o
    });
    for (h, o) in per_head.iter().enumerate() {
        for t in 0..n_tok {
            out[t * q_dim + h * hd..t * q_dim + (h + 1) * hd]
                .copy_from_slice(&o[t * hd..(t + 1) * hd]);
        }
    }
}
