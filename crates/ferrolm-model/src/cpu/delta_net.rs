//! The gated delta-net block (Qwen3-Next's linear-attention layers) over a batch of tokens.
//!
//! Per token, from the normed input `x`:
//! * projections: `ssm_in . x` gives, per key head, its query, its key, its value heads and their
//!   output gates `z` (or `attn_qkv . x` the queries, keys and values, `attn_gate . x` the gates); `ssm_ba . x` gives per value head a rate `b` and a decay input `a`;
//! * a causal depthwise convolution of `conv_kernel` taps over the queries, keys and values
//!   (carrying the last `conv_kernel - 1` inputs of each channel from one batch to the next),
//!   then SiLU;
//! * queries and keys L2-normalized per head; per value head `beta = sigmoid(b)` and the
//!   log-decay `g = softplus(a + dt_bias) * ssm_a` (`ssm_a` is `-exp(A_log)`, so `g <= 0`);
//! * the delta rule on each value head's state `S` (key dimension x value dimension):
//!   `S <- exp(g) S`, `u = beta (v - S^T k)`, `S <- S + k u^T`, output `S^T q / sqrt(head_dim)`;
//! * per value head an RMS norm of the output times `silu(z)`, then `ssm_out`.
//!
//! A prompt runs the delta rule chunk by chunk ([`delta_rule_chunked`]); one token, the
//! recurrence ([`delta_rule_step`]). Both give the same state to float rounding (tested).

use ferrolm_quant::vecops::axpy_many;
use ferrolm_threads::ThreadPool;

use super::matmul::{matmul, matmul_group, SharedInput};
use crate::kv_cache::RecurrentState;
use crate::plan::{DeltaNet, KeyHeads};
use crate::weights::{DeltaNetGates, DeltaNetInput, DeltaNetWeights};

/// Tokens per chunk of the chunked delta rule (llama.cpp's chunked graph uses 64 too).
pub(crate) const CHUNK: usize = 64;

/// One sequence's part of the batch: its state, its first token's row in the batch, its token
/// count, and whether it starts at position 0 (its state then starts from zeros).
pub(crate) struct SeqState<'a> {
    pub state: &'a mut RecurrentState,
    pub first: usize,
    pub len: usize,
    pub fresh: bool,
}

#[inline]
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// ggml's softplus: `ln(1 + e^x)`, `x` itself above 20.
#[inline]
fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        (1.0 + x.exp()).ln()
    }
}

/// The block over the `n` normed rows `h` (each `d` wide) of the batch; returns its output,
/// `n x d`. `eps` is the model's RMS-norm epsilon (also the L2 norm's).
#[allow(clippy::too_many_arguments)] // the layer, its weights, the batch and its sequences
pub(crate) fn delta_net_block(
    pool: &ThreadPool,
    file: &[u8],
    input: &mut SharedInput,
    net: &DeltaNet,
    w: &DeltaNetWeights,
    eps: f32,
    (h, n, d): (&[f32], usize, usize),
    seqs: &mut [SeqState<'_>],
) -> Vec<f32> {
    let DeltaNet {
        n_k_heads: hk,
        n_v_heads: hv,
        key_heads,
        head_dim: s,
        conv_kernel: taps,
    } = *net;
    let ratio = hv / hk;
    let (key_dim, value_dim) = (hk * s, hv * s);
    let channels = net.conv_channels();

    // The convolution's channels per token (all queries, all keys, all values) and the
    // gates z; per value head, beta and g.
    let mut mixed = vec![0f32; n * channels];
    let mut z = vec![0f32; n * value_dim];
    // Per token, the rates b then the decay inputs a of every value head (value-head order).
    let mut ba = vec![0f32; n * 2 * hv];
    input.reset();
    match &w.input {
        DeltaNetInput::Split { qkv, gate } => {
            input.prepare(pool, h, n, d, &[qkv.ty, gate.ty]);
            matmul_group(
                pool,
                file,
                vec![
                    (qkv, input.rows_for(qkv.ty), &mut mixed),
                    (gate, input.rows_for(gate.ty), &mut z),
                ],
            );
        }
        DeltaNetInput::Fused(qkvz_w) => {
            let qkvz_dim = 2 * key_dim + 2 * value_dim;
            let mut qkvz = vec![0f32; n * qkvz_dim];
            input.prepare(pool, h, n, d, &[qkvz_w.ty]);
            matmul_group(
                pool,
                file,
                vec![(qkvz_w, input.rows_for(qkvz_w.ty), &mut qkvz)],
            );
            // Regroup: per key head, its query, key, value heads and their gates.
            let group = 2 * s + 2 * ratio * s;
            let vw = ratio * s;
            for t in 0..n {
                let row = &qkvz[t * qkvz_dim..(t + 1) * qkvz_dim];
                let m = &mut mixed[t * channels..(t + 1) * channels];
                for kh in 0..hk {
                    let src = &row[kh * group..(kh + 1) * group];
                    m[kh * s..(kh + 1) * s].copy_from_slice(&src[..s]);
                    m[key_dim + kh * s..key_dim + (kh + 1) * s].copy_from_slice(&src[s..2 * s]);
                    m[2 * key_dim + kh * vw..2 * key_dim + (kh + 1) * vw]
                        .copy_from_slice(&src[2 * s..2 * s + vw]);
                    z[t * value_dim + kh * vw..t * value_dim + (kh + 1) * vw]
                        .copy_from_slice(&src[2 * s + vw..]);
                }
            }
        }
    }
    match &w.gates {
        DeltaNetGates::Fused(wba) => {
            // ssm_ba: per key head, the rates of its value heads, then their decay inputs.
            let mut fused = vec![0f32; n * 2 * hv];
            matmul(
                pool,
                wba,
                file,
                input.get(pool, h, n, d, wba.ty),
                &mut fused,
            );
            for (src, dst) in fused.chunks(2 * hv).zip(ba.chunks_mut(2 * hv)) {
                for kh in 0..hk {
                    for j in 0..ratio {
                        let vh = kh * ratio + j;
                        dst[vh] = src[kh * 2 * ratio + j];
                        dst[hv + vh] = src[kh * 2 * ratio + ratio + j];
                    }
                }
            }
        }
        DeltaNetGates::Split { beta, alpha } => {
            input.prepare(pool, h, n, d, &[beta.ty, alpha.ty]);
            let (mut b, mut a) = (vec![0f32; n * hv], vec![0f32; n * hv]);
            matmul_group(
                pool,
                file,
                vec![
                    (beta, input.rows_for(beta.ty), &mut b),
                    (alpha, input.rows_for(alpha.ty), &mut a),
                ],
            );
            for t in 0..n {
                ba[t * 2 * hv..t * 2 * hv + hv].copy_from_slice(&b[t * hv..(t + 1) * hv]);
                ba[t * 2 * hv + hv..(t + 1) * 2 * hv].copy_from_slice(&a[t * hv..(t + 1) * hv]);
            }
        }
    }
    let mut beta = vec![0f32; n * hv];
    let mut g = vec![0f32; n * hv];
    for t in 0..n {
        let row = &ba[t * 2 * hv..(t + 1) * 2 * hv];
        for vh in 0..hv {
            beta[t * hv + vh] = sigmoid(row[vh]);
            g[t * hv + vh] = softplus(row[hv + vh] + w.dt_bias[vh]) * w.a[vh];
        }
    }

    let mut o = vec![0f32; n * value_dim];
    for seq in seqs.iter_mut() {
        if seq.fresh {
            seq.state.clear();
        }
        let rows = seq.first..seq.first + seq.len;
        let conv_out = convolve(
            &mut seq.state.conv,
            &w.conv,
            &mixed[rows.start * channels..rows.end * channels],
            channels,
            taps,
        );
        // Queries and keys per key head, values per value head, each L2-normalized (not the
        // values) and laid out head-major for the delta rule.
        let len = seq.len;
        let head_major = |base: usize, heads: usize, normalize: bool| -> Vec<f32> {
            let mut out = vec![0f32; heads * len * s];
            for t in 0..len {
                for hh in 0..heads {
                    let src = &conv_out[t * channels + base + hh * s..][..s];
                    let dst = &mut out[(hh * len + t) * s..][..s];
                    dst.copy_from_slice(src);
                    if normalize {
                        l2_normalize(dst, eps);
                    }
                }
            }
            out
        };
        let q = head_major(0, hk, true);
        let k = head_major(key_dim, hk, true);
        let v = head_major(2 * key_dim, hv, false);
        let state = &seq.state.ssm;
        let per_head: Vec<(Vec<f32>, Vec<f32>)> = pool.map(hv, |vh| {
            let kh = match key_heads {
                KeyHeads::Grouped => vh / ratio,
                KeyHeads::Tiled => vh % hk,
            };
            let mut st = state[vh * s * s..(vh + 1) * s * s].to_vec();
            let b: Vec<f32> = (0..len).map(|t| beta[(rows.start + t) * hv + vh]).collect();
            let gg: Vec<f32> = (0..len).map(|t| g[(rows.start + t) * hv + vh]).collect();
            let heads = Heads {
                q: &q[kh * len * s..(kh + 1) * len * s],
                k: &k[kh * len * s..(kh + 1) * len * s],
                v: &v[vh * len * s..(vh + 1) * len * s],
                beta: &b,
                g: &gg,
            };
            let mut out = vec![0f32; len * s];
            if len == 1 {
                delta_rule_step(&mut st, s, &heads, 0, &mut out);
            } else {
                delta_rule_chunked(&mut st, s, &heads, CHUNK, &mut out);
            }
            (out, st)
        });
        let state = &mut seq.state.ssm;
        for (vh, (out, st)) in per_head.into_iter().enumerate() {
            state[vh * s * s..(vh + 1) * s * s].copy_from_slice(&st);
            for t in 0..len {
                o[(rows.start + t) * value_dim + vh * s..][..s]
                    .copy_from_slice(&out[t * s..(t + 1) * s]);
            }
        }
    }

    // The gated norm per value head: rms_norm(o) * weight * silu(z) (ggml's vector SiLU, one
    // head-sized row at a time as its unary op runs).
    let mut gate = vec![0f32; s];
    for (orow, zrow) in o.chunks_mut(value_dim).zip(z.chunks(value_dim)) {
        for (oh, zh) in orow.chunks_mut(s).zip(zrow.chunks(s)) {
            super::ops::rms_norm_in_place(oh, &w.norm, eps);
            ferrolm_quant::ggml_vec::silu(zh, &mut gate);
            oh.iter_mut().zip(&gate).for_each(|(o, &g)| *o *= g);
        }
    }
    input.reset();
    let mut y = vec![0f32; n * d];
    matmul(
        pool,
        &w.out,
        file,
        input.get(pool, &o, n, value_dim, w.out.ty),
        &mut y,
    );
    y
}

/// The causal depthwise convolution of one sequence's `x` (`len x channels`) with `taps` taps
/// per channel (`weights[c * taps + i]`, the oldest input first), SiLU applied; `state` holds
/// the `taps - 1` inputs before `x` and is advanced past it.
fn convolve(
    state: &mut [f32],
    weights: &[f32],
    x: &[f32],
    channels: usize,
    taps: usize,
) -> Vec<f32> {
    let len = x.len() / channels;
    let hist = taps - 1;
    // The inputs the windows slide over: the carried ones, then the new ones.
    let mut window = Vec::with_capacity((hist + len) * channels);
    window.extend_from_slice(state);
    window.extend_from_slice(x);
    let mut out = vec![0f32; len * channels];
    let mut sums = vec![0f32; channels];
    for t in 0..len {
        for (c, sum) in sums.iter_mut().enumerate() {
            let w = &weights[c * taps..(c + 1) * taps];
            // Summed in f32 from the oldest tap, as ggml's ssm_conv.
            let mut acc = 0f32;
            for (i, &wi) in w.iter().enumerate() {
                acc += window[(t + i) * channels + c] * wi;
            }
            *sum = acc;
        }
        // ggml's vector SiLU over the token's row of channels.
        ferrolm_quant::ggml_vec::silu(&sums, &mut out[t * channels..(t + 1) * channels]);
    }
    state.copy_from_slice(&window[len * channels..]);
    out
}

/// `x / |x|` as llama.cpp computes it for the delta-net (an RMS norm with epsilon
/// `eps / len`, then a scale by `1 / sqrt(len)`).
fn l2_normalize(x: &mut [f32], eps: f32) {
    let len = x.len() as f32;
    let sum: f64 = x.iter().map(|&v| f64::from(v * v)).sum();
    let mean = (sum / x.len() as f64) as f32;
    let scale = 1.0 / (mean + eps / len).sqrt();
    let post = 1.0 / len.sqrt();
    x.iter_mut().for_each(|v| *v = (*v * scale) * post);
}

/// One head's inputs over a sequence of `len` tokens: rows of `head_dim`.
pub(crate) struct Heads<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub beta: &'a [f32],
    /// Log-decays (`<= 0`).
    pub g: &'a [f32],
}

/// `y += a * x`.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    axpy_many(y, &[a], x);
}

/// `out[j] = sum_i x[i] * m[i][j]` for a row-major `m` of `x.len()` rows of `out.len()`.
#[inline]
fn vec_mat(x: &[f32], m: &[f32], out: &mut [f32]) {
    out.fill(0.0);
    axpy_many(out, x, m);
}

/// Token `t` of `heads` through the recurrence: decays `state` (`s x s`, key-major), applies
/// the delta rule, writes the readout to `out[t]`.
pub(crate) fn delta_rule_step(
    state: &mut [f32],
    s: usize,
    heads: &Heads<'_>,
    t: usize,
    out: &mut [f32],
) {
    let row = |x: &[f32]| x[t * s..(t + 1) * s].to_vec();
    let (q, k, v) = (row(heads.q), row(heads.k), row(heads.v));
    let decay = heads.g[t].exp();
    state.iter_mut().for_each(|x| *x *= decay);
    let mut sk = vec![0f32; s];
    vec_mat(&k, state, &mut sk);
    let u: Vec<f32> = v
        .iter()
        .zip(&sk)
        .map(|(v, sk)| (v - sk) * heads.beta[t])
        .collect();
    for (i, &ki) in k.iter().enumerate() {
        axpy(&mut state[i * s..(i + 1) * s], ki, &u);
    }
    let o = &mut out[t * s..(t + 1) * s];
    vec_mat(&q, state, o);
    let scale = 1.0 / (s as f32).sqrt();
    o.iter_mut().for_each(|x| *x *= scale);
}

/// Every token of `heads` through the delta rule in chunks of `chunk` tokens (the WY / UT
/// form): within a chunk, with `G_t` the cumulative log-decay from the chunk's start and `S0`
/// the state before it, the updates `u` solve the unit lower-triangular system
/// `u_t + sum_{r<t} beta_t e^{G_t - G_r} (k_t . k_r) u_r = beta_t (v_t - e^{G_t} S0^T k_t)`
/// (forward substitution: the `(I + A)^-1` of the UT transform applied to the right-hand
/// sides); the outputs are `e^{G_t} S0^T q_t + sum_{r<=t} e^{G_t - G_r} (q_t . k_r) u_r`; and
/// the state after the chunk is `e^{G_last} S0 + sum_r e^{G_last - G_r} k_r u_r^T`. The state
/// is read and written once per chunk, in matrix products, instead of once per token.
pub(crate) fn delta_rule_chunked(
    state: &mut [f32],
    s: usize,
    heads: &Heads<'_>,
    chunk: usize,
    out: &mut [f32],
) {
    let len = heads.beta.len();
    let scale = 1.0 / (s as f32).sqrt();
    let chunk = chunk.max(1);
    let mut c0 = 0;
    while c0 < len {
        let l = chunk.min(len - c0);
        let rows = |x: &'_ [f32]| -> Vec<f32> { x[c0 * s..(c0 + l) * s].to_vec() };
        let (q, k, v) = (rows(heads.q), rows(heads.k), rows(heads.v));
        let beta = &heads.beta[c0..c0 + l];
        // Cumulative log-decay within the chunk.
        let mut cum = vec![0f32; l];
        let mut acc = 0f32;
        for (c, &g) in cum.iter_mut().zip(&heads.g[c0..c0 + l]) {
            acc += g;
            *c = acc;
        }
        // Right-hand sides, then the solve in place: u_t = rhs_t - sum_{r<t} A_tr u_r.
        let mut u = vec![0f32; l * s];
        let mut sk = vec![0f32; s];
        for t in 0..l {
            vec_mat(&k[t * s..(t + 1) * s], state, &mut sk);
            let decay = cum[t].exp();
            let ut = &mut u[t * s..(t + 1) * s];
            for ((u, &v), &sk) in ut.iter_mut().zip(&v[t * s..(t + 1) * s]).zip(&sk) {
                *u = beta[t] * (v - decay * sk);
            }
        }
        // Every k_t . k_r and q_t . k_r of the chunk at once, each still summed over the s
        // dimensions in order from -0.0 as `dot` sums (the same bits), but l of them side by
        // side in the vector lanes: a row of products is `axpy_many` over the rows of K^T.
        let mut k_t = vec![0f32; s * l];
        for r in 0..l {
            for i in 0..s {
                k_t[i * l + r] = k[r * s + i];
            }
        }
        let (mut kk, mut qk) = (vec![-0.0f32; l * l], vec![-0.0f32; l * l]);
        for t in 0..l {
            axpy_many(&mut kk[t * l..(t + 1) * l], &k[t * s..(t + 1) * s], &k_t);
            axpy_many(&mut qk[t * l..(t + 1) * l], &q[t * s..(t + 1) * s], &k_t);
        }
        let mut coeffs = vec![0f32; l];
        for t in 1..l {
            let (done, rest) = u.split_at_mut(t * s);
            for (r, c) in coeffs[..t].iter_mut().enumerate() {
                *c = -(beta[t] * (cum[t] - cum[r]).exp() * kk[t * l + r]);
            }
            axpy_many(&mut rest[..s], &coeffs[..t], done);
        }
        // Outputs: the state before the chunk, decayed, plus the chunk's own updates.
        let mut sq = vec![0f32; s];
        for t in 0..l {
            let qt = &q[t * s..(t + 1) * s];
            vec_mat(qt, state, &mut sq);
            let decay = cum[t].exp();
            let o = &mut out[(c0 + t) * s..(c0 + t + 1) * s];
            o.iter_mut().zip(&sq).for_each(|(o, &x)| *o = decay * x);
            for (r, c) in coeffs[..=t].iter_mut().enumerate() {
                *c = (cum[t] - cum[r]).exp() * qk[t * l + r];
            }
            axpy_many(o, &coeffs[..=t], &u);
            o.iter_mut().for_each(|x| *x *= scale);
        }
        // The state after the chunk.
        let last = cum[l - 1];
        let total = last.exp();
        let weights: Vec<f32> = cum.iter().map(|&c| (last - c).exp()).collect();
        for i in 0..s {
            let srow = &mut state[i * s..(i + 1) * s];
            srow.iter_mut().for_each(|x| *x *= total);
            for (r, c) in coeffs[..l].iter_mut().enumerate() {
                *c = weights[r] * k[r * s + i];
            }
            axpy_many(srow, &coeffs[..l], &u);
        }
        c0 += l;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn silu(x: f32) -> f32 {
        x / (1.0 + (-x).exp())
    }

    /// A deterministic pseudo-random sequence in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn normalized(mut x: Vec<f32>, s: usize) -> Vec<f32> {
        x.chunks_mut(s).for_each(|r| l2_normalize(r, 1e-6));
        x
    }

    /// Chunked prefill and token-by-token decode give the same outputs and final state, at
    /// chunk sizes 1, 16 and 64, for a length that is no multiple of them, starting from a
    /// state that is not zero.
    #[test]
    fn chunked_equals_token_by_token() {
        let (s, len) = (32, 150);
        let q = normalized(values(len * s, 1), s);
        let k = normalized(values(len * s, 2), s);
        let v = values(len * s, 3);
        let beta: Vec<f32> = values(len, 4).iter().map(|x| sigmoid(2.0 * x)).collect();
        let g: Vec<f32> = values(len, 5).iter().map(|x| -0.3 * (x + 1.0)).collect();
        let heads = Heads {
            q: &q,
            k: &k,
            v: &v,
            beta: &beta,
            g: &g,
        };
        let start = values(s * s, 6);
        let mut state_ref = start.clone();
        let mut out_ref = vec![0f32; len * s];
        for t in 0..len {
            delta_rule_step(&mut state_ref, s, &heads, t, &mut out_ref);
        }
        let scale = out_ref.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(scale > 0.1, "outputs are not trivially small");
        for chunk in [1, 16, 64, 150, 200] {
            let mut state = start.clone();
            let mut out = vec![0f32; len * s];
            delta_rule_chunked(&mut state, s, &heads, chunk, &mut out);
            let out_err = out
                .iter()
                .zip(&out_ref)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            let state_err = state
                .iter()
                .zip(&state_ref)
                .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(out_err < 1e-4, "chunk {chunk}: outputs differ by {out_err}");
            assert!(
                state_err < 1e-4,
                "chunk {chunk}: states differ by {state_err}"
            );
        }
        // And the comparison can fail: a wrong decay is seen.
        let g2: Vec<f32> = g.iter().map(|x| x * 1.1).collect();
        let wrong = Heads { g: &g2, ..heads };
        let mut state = start.clone();
        let mut out = vec![0f32; len * s];
        delta_rule_chunked(&mut state, s, &wrong, 64, &mut out);
        let err = out
            .iter()
            .zip(&out_ref)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err > 1e-3,
            "a 10% decay error changes the outputs by only {err}"
        );
    }

    /// A prompt split across calls (the state and conv history carried) equals one call.
    #[test]
    fn convolution_carries_its_history() {
        let (channels, taps, len) = (5, 4, 9);
        let w = values(channels * taps, 7);
        let x = values(len * channels, 8);
        let mut st = vec![0f32; (taps - 1) * channels];
        let whole = convolve(&mut st, &w, &x, channels, taps);
        let mut st2 = vec![0f32; (taps - 1) * channels];
        let mut parts = convolve(&mut st2, &w, &x[..2 * channels], channels, taps);
        parts.extend(convolve(
            &mut st2,
            &w,
            &x[2 * channels..3 * channels],
            channels,
            taps,
        ));
        parts.extend(convolve(&mut st2, &w, &x[3 * channels..], channels, taps));
        assert_eq!(whole, parts);
        assert_eq!(st, st2);
        // The first output sees only the first input (zeros before it).
        for c in 0..channels {
            let expect = silu(x[c] * w[c * taps + taps - 1]);
            assert!((whole[c] - expect).abs() < 1e-6);
        }
    }
}
