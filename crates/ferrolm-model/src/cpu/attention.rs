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
//! probability 0, so they add nothing; they only keep the summation order llama.cpp's. For the
//! same reason a batch is split into groups of queries that skip the 64-aligned stretches of
//! cells none of them sees (the causal future, what left the window): those stretches would add
//! only zeros, lane by lane, so the result is bit-identical and prefill does about half the
//! attention work.
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

/// Queries per group of the batch (see `attend`).
const GROUP: usize = 64;

/// Cell ranges are widened to multiples of this: a multiple of ggml's 64-element f16 dot step
/// and of the 16-lane tinyBLAS and softmax chunks, so that leaving out a stretch of masked cells
/// removes only exact zeros from each lane's sum and changes no bit.
const SKIP_ALIGN: usize = 64;

/// `out[t][h]` for each token `t` of the batch (at position `pos0 + t`) and query head `h`.
#[allow(clippy::too_many_arguments)] // the layer, its cache, the batch and where it sits
pub fn attend(
    pool: &ThreadPool,
    a: &Attention,
    cache: &LayerCache,
    q: &[f32],
    pos0: usize,
    n_tok: usize,
    sinks: Option<&[f32]>,
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

    // Token groups, each reading only the stretch of cells its queries can see (causal, and
    // inside the window), widened to multiples of SKIP_ALIGN; a group has at least 2 tokens
    // unless the batch is 1 token, so that the products take the same kernel path (tinyBLAS
    // or vec_dot) as llama.cpp's whole-batch product. Once a ring has wrapped, cells are not in
    // position order and every group reads all of them.
    let wrapped = end > cap;
    let mut groups: Vec<(usize, usize)> = (0..n_tok)
        .step_by(GROUP)
        .map(|t0| (t0, (t0 + GROUP).min(n_tok)))
        .collect();
    if groups.len() >= 2 && groups[groups.len() - 1].1 - groups[groups.len() - 1].0 == 1 {
        let (_, last) = groups.pop().expect("two groups");
        groups.last_mut().expect("one group").1 = last;
    }
    let spans: Vec<(usize, usize, usize, usize)> = groups
        .iter()
        .map(|&(t0, t1)| {
            if wrapped {
                return (t0, t1, 0, n_kv);
            }
            let first = match cache.window {
                Some(w) => (pos0 + t0 + 1).saturating_sub(w),
                None => 0,
            };
            let lo = first / SKIP_ALIGN * SKIP_ALIGN;
            let hi = (pos0 + t1).next_multiple_of(SKIP_ALIGN).min(n_kv);
            (t0, t1, lo, hi)
        })
        .collect();

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
        let mut o = vec![0f32; n_tok * hd];
        for &(t0, t1, lo, hi) in &spans {
            let (g, len) = (t1 - t0, hi - lo);
            let qg = &q_bytes[t0 * hd * 2..];
            // Keys of this head: cell j at j * kv_dim + kvh * hd.
            let k_rows = &k_bytes[(lo * kv_dim + kvh * hd) * 2..];
            let mut scores = vec![0f32; g * len];
            if n_tok == 1 {
                f16_kernel.dot_rows(hd, k_rows, kv_dim * 2, qg, &mut scores);
            } else {
                f16_kernel.dot_rows_multi(hd, k_rows, kv_dim * 2, len, qg, hd * 2, g, &mut scores);
            }
            let mut probs = vec![0f32; len];
            let mut p16 = vec![f16::ZERO; g * len];
            for t in 0..g {
                let row = &mut scores[t * len..(t + 1) * len];
                let query = pos0 + t0 + t;
                let mut max = f32::NEG_INFINITY;
                for (s, p) in row.iter_mut().zip(&cell_pos[lo..hi]) {
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
                // A sink joins the softmax as a column of its own (ggml's soft_max with sinks).
                let sink = sinks.map(|s| s[h]);
                if let Some(s) = sink {
                    max = max.max(s);
                }
                let mut sum = ggml_vec::soft_max(row, &mut probs, max);
                if let Some(s) = sink {
                    sum += f64::from((s - max).exp());
                }
                let inv = (1.0 / sum) as f32;
                probs.iter_mut().for_each(|p| *p *= inv);
                ggml_vec::f32_to_f16_row(&probs, &mut p16[t * len..(t + 1) * len]);
            }
            let p_bytes: &[u8] = bytemuck::cast_slice(&p16);
            // Transposed values of this head: row d at (kvh * hd + d) * cap, from cell lo.
            let v_rows = &v_bytes[(kvh * hd * cap + lo) * 2..];
            let og = &mut o[t0 * hd..t1 * hd];
            if n_tok == 1 {
                f16_kernel.dot_rows(len, v_rows, cap * 2, p_bytes, og);
            } else {
                f16_kernel.dot_rows_multi(len, v_rows, cap * 2, hd, p_bytes, len * 2, g, og);
            }
        }
        o
    });
    // Back to token-major rows, a stretch of tokens per task (one token: on the caller).
    let gather = |t0: usize, rows: &mut [f32]| {
        for (i, row) in rows.chunks_exact_mut(q_dim).enumerate() {
            let t = t0 + i;
            for (h, o) in per_head.iter().enumerate() {
                row[h * hd..(h + 1) * hd].copy_from_slice(&o[t * hd..(t + 1) * hd]);
            }
        }
    };
    if n_tok == 1 {
        gather(0, out);
    } else {
        pool.for_each_chunk_mut(out, GROUP * q_dim, |c, rows| gather(c * GROUP, rows));
    }
}
