//! One forward pass over a batch of tokens: every layer as matrix-matrix products over the
//! batch, attention against the cache, logits for the positions asked for.

use ferrolm_threads::ThreadPool;

use super::attention::attend;
use super::buffers::Buffers;
use super::delta_net::{delta_net_block, SeqState};
use super::matmul::{matmul, matmul_group, SharedInput};
use super::ops::{rms_norm_rows, rms_norm_rows_in_place, RopeAngles};
use super::routing::route;
use crate::error::Result;
use crate::experts::ExpertStore;
use crate::kv_cache::KvCache;
use crate::plan::{Activation, Attention, Ffn, Mixer, Moe, Rope};
use crate::weights::{
    AttentionWeights, FfnWeights, Matrix, MixerWeights, MoeBiases, SharedWeights,
};
use crate::Model;
use ferrolm_gguf::GgufFile;

/// Which positions' logits a forward pass returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Logits {
    /// None (a prompt chunk whose last position is not the end).
    None,
    /// The last position's.
    Last,
    /// Every position's, `n_tok x n_vocab`.
    All,
}

/// Where a forward pass writes its intermediate tensors (`Model::set_dump_dir`; `None`: off),
/// a developer's tool for comparing with llama.cpp's eval callback tensor by tensor.
#[derive(Clone, Copy)]
pub(crate) struct Dump<'a>(Option<&'a std::path::Path>);

impl Dump<'_> {
    fn of(model: &Model) -> Dump<'_> {
        Dump(model.dump_dir.as_deref())
    }

    /// `data` as `{name}-{layer}.f32`.
    fn put(self, name: &str, layer: usize, data: &[f32]) {
        if let Some(dir) = self.0 {
            let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
            let _ = std::fs::write(dir.join(format!("{name}-{layer}.f32")), bytes);
        }
    }
}

/// Reused buffers of one sequence.
#[derive(Default)]
pub(crate) struct Scratch {
    input: SharedInput,
    floats: Buffers,
    /// This pass's RoPE angles of every token, per distinct RoPE of its layers.
    angles: Vec<(Rope, Vec<RopeAngles>)>,
}

/// `f(row index, row)` for every `len`-long row of `data`: on the caller alone for one row
/// (a decode step's element-wise work is too small to share), across the pool otherwise.
fn rows_mut(pool: &ThreadPool, data: &mut [f32], len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if data.len() <= len {
        data.chunks_mut(len).enumerate().for_each(|(i, r)| f(i, r));
    } else {
        pool.for_each_chunk_mut(data, len, f);
    }
}

/// Rows per task of the row norms, whose sums run side by side (`ops::rms_norm_rows`).
const NORM_ROWS: usize = 4;

/// Every `d`-wide row of `x` RMS-normed by `w` into the rows of `out`.
fn norm_rows(pool: &ThreadPool, x: &[f32], w: &[f32], eps: f32, out: &mut [f32], d: usize) {
    let len = NORM_ROWS * d;
    rows_mut(pool, out, len, |c, o| {
        rms_norm_rows(&x[c * len..c * len + o.len()], w, eps, o, d)
    });
}

/// `x += y`, `d`-wide rows a few at a time across the pool (the residual adds).
fn add_rows(pool: &ThreadPool, x: &mut [f32], y: &[f32], d: usize) {
    let len = NORM_ROWS * d;
    rows_mut(pool, x, len, |c, xs| {
        xs.iter_mut().zip(&y[c * len..]).for_each(|(x, y)| *x += y)
    });
}

/// One sequence's part of a batch: its cache, its new tokens, where they start, what logits it
/// wants back.
pub(crate) struct SeqInput<'a> {
    pub cache: &'a mut KvCache,
    pub ids: &'a [u32],
    pub pos0: usize,
    pub want: Logits,
}

/// Where a forward pass starts when the first layers ran elsewhere (`--gpu-layers`): the
/// residual stream of every token after layer `layer - 1`, token-major.
pub(crate) struct Start<'a> {
    pub layer: usize,
    pub hidden: &'a [f32],
}

/// One forward pass over the tokens of several sequences at once: every matrix product takes
/// all their tokens together; each sequence attends over its own cache. Returns each sequence's
/// logits. With one sequence this is the plain batched forward pass; with `start`, the pass
/// begins at that layer from the given residual stream instead of the embedding. Fails only
/// where streamed expert weights cannot be read.
pub(crate) fn forward(
    model: &Model,
    scratch: &mut Scratch,
    seqs: &mut [SeqInput<'_>],
    start: Option<Start<'_>>,
) -> Result<Vec<Vec<f32>>> {
    let pool = &model.pool;
    let plan = &model.plan;
    let w = &model.weights;
    let file = model.file.file_bytes();
    let d = plan.n_embd;
    let dump = Dump::of(model);
    // Token t of the batch: its sequence and position.
    let mut pos_of = Vec::new();
    let mut offsets = Vec::with_capacity(seqs.len());
    for seq in seqs.iter() {
        offsets.push(pos_of.len());
        pos_of.extend((0..seq.ids.len()).map(|i| seq.pos0 + i));
    }
    let ids: Vec<u32> = seqs.iter().flat_map(|s| s.ids.iter().copied()).collect();
    let n = ids.len();

    // Embedding rows (or the residual stream the earlier layers left).
    let mut x = scratch.floats.take(n * d);
    let first = match &start {
        Some(s) => {
            x.copy_from_slice(s.hidden);
            s.layer
        }
        None => {
            let embd = w.token_embd.data(file);
            let rb = w.token_embd.row_bytes;
            rows_mut(pool, &mut x, d, |t, row| {
                let id = ids[t] as usize;
                ferrolm_quant::dequantize(w.token_embd.ty, &embd[id * rb..(id + 1) * rb], row)
                    .expect("checked at load");
                if let Some(s) = plan.embedding_scale {
                    row.iter_mut().for_each(|v| *v *= s);
                }
            });
            0
        }
    };

    scratch.angles.clear();
    let mut h = scratch.floats.take(n * d);
    for (l, (lp, lw)) in plan.layers.iter().zip(&w.layers).enumerate().skip(first) {
        // Token mixer.
        norm_rows(pool, &x, &lw.attn_norm, plan.norm_eps, &mut h, d);
        dump.put("attn_norm", l, &h);
        let mut o = match (&lp.mixer, &lw.mixer) {
            (Mixer::Attention, MixerWeights::Attention(aw)) => {
                let batch = Batch {
                    seqs: &mut *seqs,
                    offsets: &offsets,
                    pos_of: &pos_of,
                };
                attention_block(model, scratch, &lp.attention, aw, &h, batch, l)
            }
            (Mixer::GatedDeltaNet(net), MixerWeights::DeltaNet(dw)) => {
                let mut states: Vec<SeqState<'_>> = seqs
                    .iter_mut()
                    .zip(&offsets)
                    .map(|(seq, &first)| SeqState {
                        state: seq.cache.layers[l]
                            .state
                            .as_mut()
                            .expect("a recurrent layer's cache holds its state"),
                        first,
                        len: seq.ids.len(),
                        fresh: seq.pos0 == 0,
                    })
                    .collect();
                delta_net_block(
                    pool,
                    file,
                    &mut scratch.input,
                    net,
                    dw,
                    plan.norm_eps,
                    (&h, n, d),
                    &mut states,
                )
            }
            _ => unreachable!("weights are bound from the plan"),
        };
        dump.put("attn_out", l, &o);
        finish_block(
            pool,
            &mut o,
            lw.post_attn_norm.as_deref(),
            lp.residual_scale,
            plan.norm_eps,
            d,
        );
        dump.put("attn_post_norm", l, &o);
        add_rows(pool, &mut x, &o, d);
        dump.put("ffn_inp", l, &x);
        dump.put("sa_out", l, &x);

        // Feed-forward block.
        norm_rows(pool, &x, &lw.ffn_norm, plan.norm_eps, &mut h, d);
        dump.put("ffn_norm", l, &h);
        match (&lp.ffn, &lw.ffn) {
            (
                &Ffn::Gated { n_ff, activation },
                FfnWeights::Dense {
                    gate: wg,
                    up: wu,
                    down: wd,
                },
            ) => {
                let y = gated_ffn(
                    pool,
                    file,
                    (&mut scratch.input, &mut scratch.floats),
                    (&h, n, d),
                    (n_ff, activation),
                    (wg, wu, wd),
                    ExpertBias::default(),
                    Some((dump, l)),
                );
                // y is the block's output: it takes o's place, o goes back to the buffers
                scratch.floats.give(std::mem::replace(&mut o, y));
            }
            (
                Ffn::Moe(m),
                FfnWeights::Moe {
                    router,
                    gate,
                    up,
                    down,
                    shared,
                    biases,
                },
            ) => {
                let experts = MoeWeights {
                    router,
                    gate,
                    up,
                    down,
                    shared: shared.as_deref(),
                    store: &model.experts,
                    gguf: &model.file,
                    biases,
                };
                let counts = model.expert_counts.get(l).map(Vec::as_slice);
                moe(
                    pool,
                    file,
                    scratch,
                    m,
                    &experts,
                    &h,
                    n,
                    d,
                    (dump, l),
                    counts,
                    &mut o,
                )?;
            }
            _ => unreachable!("weights are bound from the plan"),
        }
        dump.put("ffn_out", l, &o);
        finish_block(
            pool,
            &mut o,
            lw.post_ffn_norm.as_deref(),
            lp.residual_scale,
            plan.norm_eps,
            d,
        );
        add_rows(pool, &mut x, &o, d);
        scratch.floats.give(o);
        dump.put("l_out", l, &x);
    }
    scratch.floats.give(h);

    // The rows whose logits are wanted, sequence by sequence.
    let mut rows: Vec<usize> = Vec::new();
    let mut per_seq = Vec::with_capacity(seqs.len());
    for (seq, &off) in seqs.iter().zip(&offsets) {
        let ns = seq.ids.len();
        let wanted: Vec<usize> = match seq.want {
            Logits::None => Vec::new(),
            Logits::Last => vec![off + ns - 1],
            Logits::All => (off..off + ns).collect(),
        };
        per_seq.push(wanted.len());
        rows.extend(wanted);
    }
    let mut normed = Vec::with_capacity(rows.len() * d);
    for &r in &rows {
        normed.extend_from_slice(&x[r * d..(r + 1) * d]);
    }
    scratch.floats.give(x);
    if rows.is_empty() {
        return Ok(vec![Vec::new(); seqs.len()]);
    }
    let chunk = NORM_ROWS * d;
    rows_mut(pool, &mut normed, chunk, |_, o| {
        rms_norm_rows_in_place(o, &w.output_norm, plan.norm_eps, d)
    });
    scratch.input.reset();
    let mut logits = vec![0f32; rows.len() * plan.n_vocab];
    matmul(
        pool,
        &w.output,
        file,
        scratch.input.get(pool, &normed, rows.len(), d, w.output.ty),
        &mut logits,
    );
    if let Some(c) = plan.final_logit_softcap {
        // ggml: scale by 1/c, tanh (libm tanhf), scale by c.
        let inv = 1.0 / c;
        logits.iter_mut().for_each(|v| *v = (*v * inv).tanh() * c);
    }
    if let Some(s) = plan.logit_scale {
        let inv = 1.0 / s;
        logits.iter_mut().for_each(|v| *v *= inv);
    }
    let mut out = Vec::with_capacity(seqs.len());
    let mut start = 0;
    for count in per_seq {
        let len = count * plan.n_vocab;
        out.push(logits[start..start + len].to_vec());
        start += len;
    }
    Ok(out)
}

/// The sequences of a batch, as attention reads them: each one's cache and new tokens, where
/// its tokens start in the batch, and every token's position.
struct Batch<'b, 's> {
    seqs: &'b mut [SeqInput<'s>],
    offsets: &'b [usize],
    pos_of: &'b [usize],
}

/// The attention block of layer `l` over the normed rows `h` of the batch: projections, Q/K
/// norms, RoPE, attention over each sequence's cache, the output gate if the layer has one,
/// the output projection.
fn attention_block(
    model: &Model,
    scratch: &mut Scratch,
    a: &Attention,
    lw: &AttentionWeights,
    h: &[f32],
    batch: Batch<'_, '_>,
    l: usize,
) -> Vec<f32> {
    let pool = &model.pool;
    let plan = &model.plan;
    let file = model.file.file_bytes();
    let d = plan.n_embd;
    let n = h.len() / d;
    let dump = Dump::of(model);
    let Batch {
        seqs,
        offsets,
        pos_of,
    } = batch;
    let hd = a.head_dim;
    let q_dim = a.n_head * hd;
    let kv_dim = a.n_head_kv * hd;
    // With a gated output, the Q projection gives per head the query then its gate.
    let q_rows = if a.gated_output { 2 * q_dim } else { q_dim };

    scratch.input.reset();
    let mut q = scratch.floats.take(n * q_rows);
    let mut k = scratch.floats.take(n * kv_dim);
    let mut v = scratch.floats.take(n * kv_dim);
    scratch
        .input
        .prepare(pool, h, n, d, &[lw.wq.ty, lw.wk.ty, lw.wv.ty]);
    let inp = &scratch.input;
    matmul_group(
        pool,
        file,
        vec![
            (&lw.wq, inp.rows_for(lw.wq.ty), &mut q),
            (&lw.wk, inp.rows_for(lw.wk.ty), &mut k),
            (&lw.wv, inp.rows_for(lw.wv.ty), &mut v),
        ],
    );
    for (buf, bias, dim) in [
        (&mut q, &lw.bq, q_rows),
        (&mut k, &lw.bk, kv_dim),
        (&mut v, &lw.bv, kv_dim),
    ] {
        if let Some(b) = bias {
            buf.chunks_mut(dim)
                .for_each(|row| row.iter_mut().zip(b.iter()).for_each(|(x, b)| *x += b));
        }
    }
    let gate = a.gated_output.then(|| {
        let (queries, gates) = split_query_gate(&q, hd);
        q = queries;
        gates
    });
    // The angles depend on the RoPE, the positions and the context sizes alone: computed once
    // per pass for each distinct RoPE (Gemma 3: its local and its global layers).
    let known = scratch.angles.iter().position(|(rope, _)| *rope == a.rope);
    let at = known.unwrap_or_else(|| {
        // Each token's sequence's context size, by which LongRoPE picks its factors.
        let mut ctx_of = vec![0; n];
        for (seq, &off) in seqs.iter().zip(offsets) {
            ctx_of[off..off + seq.ids.len()].fill(seq.cache.n_ctx());
        }
        let angles = (0..n)
            .map(|t| {
                let factors = model.weights.rope_factors(&a.rope, ctx_of[t]);
                RopeAngles::new(&a.rope, factors.map(|f| &f[..]), pos_of[t])
            })
            .collect();
        scratch.angles.push((a.rope.clone(), angles));
        scratch.angles.len() - 1
    });
    let angles = &scratch.angles[at].1;
    // Per token and head: the Q/K norm if the plan has one, then the rotation.
    for (buf, norm, width) in [(&mut q, &lw.q_norm, q_dim), (&mut k, &lw.k_norm, kv_dim)] {
        rows_mut(pool, buf, NORM_ROWS * width, |c, rows| {
            if let Some(nw) = norm {
                rms_norm_rows_in_place(rows, nw, plan.norm_eps, hd);
            }
            for (i, row) in rows.chunks_mut(width).enumerate() {
                for head in row.chunks_mut(hd) {
                    angles[c * NORM_ROWS + i].apply(a.rope.layout, head);
                }
            }
        });
    }
    dump.put("Qcur", l, &q);
    dump.put("Kcur", l, &k);
    dump.put("Vcur", l, &v);
    if a.scale_queries {
        rows_mut(pool, &mut q, NORM_ROWS * q_dim, |_, rows| {
            rows.iter_mut().for_each(|v| *v *= a.scale)
        });
    }
    let mut attn = scratch.floats.take(n * q_dim);
    for (seq, &off) in seqs.iter_mut().zip(offsets) {
        let ns = seq.ids.len();
        let lc = &mut seq.cache.layers[l];
        for t in off..off + ns {
            lc.store(
                pos_of[t],
                &k[t * kv_dim..(t + 1) * kv_dim],
                &v[t * kv_dim..(t + 1) * kv_dim],
            );
        }
        let span = off * q_dim..(off + ns) * q_dim;
        let sinks = lw.sinks.as_deref();
        attend(
            pool,
            a,
            lc,
            &q[span.clone()],
            seq.pos0,
            ns,
            sinks,
            &mut attn[span],
        );
    }
    dump.put("kqv_out", l, &attn);
    if let Some(gate) = gate {
        // ggml's sigmoid: 1 / (1 + e^-x).
        attn.iter_mut()
            .zip(&gate)
            .for_each(|(x, &g)| *x *= 1.0 / (1.0 + (-g).exp()));
        dump.put("attn_gated", l, &attn);
    }
    scratch.input.reset();
    let mut o = scratch.floats.take(n * d);
    matmul(
        pool,
        &lw.wo,
        file,
        scratch.input.get(pool, &attn, n, q_dim, lw.wo.ty),
        &mut o,
    );
    add_bias(&mut o, lw.bo.as_deref());
    for used in [q, k, v, attn] {
        scratch.floats.give(used);
    }
    o
}

/// Splits the rows of a gated Q projection (per head: `hd` query values, then `hd` gate
/// values) into the queries and the gates, each `n_head * hd` per token.
fn split_query_gate(q: &[f32], hd: usize) -> (Vec<f32>, Vec<f32>) {
    let mut queries = Vec::with_capacity(q.len() / 2);
    let mut gates = Vec::with_capacity(q.len() / 2);
    for head in q.chunks(2 * hd) {
        queries.extend_from_slice(&head[..hd]);
        gates.extend_from_slice(&head[hd..]);
    }
    (queries, gates)
}

/// A gated feed-forward over the `n` rows of `x` (each `d` wide): `down(act(gate(x)) * up(x))`,
/// the input quantized once for gate and up, the intermediates in reused buffers. With a
/// layer, its intermediates are dumped under llama.cpp's names.
#[allow(clippy::type_complexity, clippy::too_many_arguments)] // (gate, up, down), (rows, count, width): named by position; the biases beside them
pub(crate) fn gated_ffn(
    pool: &ThreadPool,
    file: &[u8],
    (input, floats): (&mut SharedInput, &mut Buffers),
    (x, n, d): (&[f32], usize, usize),
    (n_ff, activation): (usize, Activation),
    (wg, wu, wd): (&Matrix, &Matrix, &Matrix),
    biases: ExpertBias<'_>,
    dump: Option<(Dump<'_>, usize)>,
) -> Vec<f32> {
    input.reset();
    input.prepare(pool, x, n, d, &[wg.ty, wu.ty]);
    let mut g = floats.take(n * n_ff);
    let mut u = floats.take(n * n_ff);
    matmul_group(
        pool,
        file,
        vec![
            (wg, input.rows_for(wg.ty), &mut g),
            (wu, input.rows_for(wu.ty), &mut u),
        ],
    );
    add_bias(&mut g, biases.gate);
    add_bias(&mut u, biases.up);
    let mut gated = floats.take(g.len());
    activate(pool, activation, &g, &u, n_ff, &mut gated);
    if let Some((dump, l)) = dump {
        dump.put("ffn_gate", l, &g);
        dump.put("ffn_up", l, &u);
        dump.put("ffn_geglu", l, &gated);
    }
    input.reset();
    let mut y = floats.take(n * d);
    matmul(
        pool,
        wd,
        file,
        input.get(pool, &gated, n, n_ff, wd.ty),
        &mut y,
    );
    add_bias(&mut y, biases.down);
    for used in [g, u, gated] {
        floats.give(used);
    }
    y
}

/// The biases of one expert's gate, up and down projections (gpt-oss), where it has them.
#[derive(Clone, Copy, Default)]
pub(crate) struct ExpertBias<'a> {
    pub gate: Option<&'a [f32]>,
    pub up: Option<&'a [f32]>,
    pub down: Option<&'a [f32]>,
}

impl<'a> ExpertBias<'a> {
    /// Expert `e`'s rows of the layer's biases (`n_ff` for gate and up, `d` for down).
    fn of(b: &'a MoeBiases, e: usize, n_ff: usize, d: usize) -> ExpertBias<'a> {
        let row = |v: &'a Option<crate::weights::Vector>, len: usize| {
            v.as_deref().map(|v| &v[e * len..(e + 1) * len])
        };
        ExpertBias {
            gate: row(&b.gate, n_ff),
            up: row(&b.up, n_ff),
            down: row(&b.down, d),
        }
    }
}

/// Adds `bias` to every row of `x` (one row per token), as ggml's add does.
pub(crate) fn add_bias(x: &mut [f32], bias: Option<&[f32]>) {
    if let Some(b) = bias {
        x.chunks_mut(b.len())
            .for_each(|row| row.iter_mut().zip(b).for_each(|(x, b)| *x += b));
    }
}

/// `gated = act(gate) * up`, row by row.
pub(crate) fn activate(
    pool: &ThreadPool,
    activation: Activation,
    g: &[f32],
    u: &[f32],
    n_ff: usize,
    gated: &mut [f32],
) {
    match activation {
        Activation::Silu => rows_mut(pool, gated, n_ff, |t, o| {
            let r = t * n_ff..(t + 1) * n_ff;
            ferrolm_quant::ggml_vec::swiglu(&g[r.clone()], &u[r], o);
        }),
        Activation::GeluTanh => rows_mut(pool, gated, n_ff, |t, o| {
            let r = t * n_ff..(t + 1) * n_ff;
            ferrolm_quant::ggml_vec::geglu(&g[r.clone()], &u[r], o);
        }),
        Activation::SwigluOai => rows_mut(pool, gated, n_ff, |t, o| {
            let r = t * n_ff..(t + 1) * n_ff;
            swiglu_oai(&g[r.clone()], &u[r], o);
        }),
    }
}

/// llama.cpp's alpha and limit of gpt-oss's clamped SwiGLU (fixed in its graph).
const SWIGLU_OAI_ALPHA: f32 = 1.702;
const SWIGLU_OAI_LIMIT: f32 = 7.0;

/// gpt-oss's clamped SwiGLU, element by element as ggml's `swiglu_oai` rounds it:
/// `x / (1 + expf(alpha * -x)) * (y + 1)` with `x = min(g, limit)`, `y = clamp(u, ±limit)`.
fn swiglu_oai(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        let x = g.min(SWIGLU_OAI_LIMIT);
        let y = u.clamp(-SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT);
        let glu = x / (1.0 + (SWIGLU_OAI_ALPHA * -x).exp());
        *o = glu * (y + 1.0);
    }
}

/// The matrices of one mixture-of-experts block.
struct MoeWeights<'a> {
    router: &'a Matrix,
    gate: &'a [Matrix],
    up: &'a [Matrix],
    down: &'a [Matrix],
    shared: Option<&'a SharedWeights>,
    /// Where the experts' bytes come from (the mapped file, or a cache of streamed experts).
    store: &'a ExpertStore,
    gguf: &'a GgufFile,
    biases: &'a MoeBiases,
}

/// Tokens per expert up to which a block's experts run side by side (one per thread).
const SIDE_BY_SIDE_TOKENS: usize = 4;

/// A mixture-of-experts block over the `n` normed rows `h`: route, run each expert over the
/// tokens that picked it, weight each output, and sum every token's outputs in the order of
/// selection (as llama.cpp adds its views one after another), into `out`.
#[allow(clippy::too_many_arguments)]
fn moe(
    pool: &ThreadPool,
    file: &[u8],
    scratch: &mut Scratch,
    m: &Moe,
    w: &MoeWeights<'_>,
    h: &[f32],
    n: usize,
    d: usize,
    (dump, layer): (Dump<'_>, usize),
    counts: Option<&[std::sync::atomic::AtomicU64]>,
    out: &mut [f32],
) -> Result<()> {
    let Moe {
        n_expert: ne,
        n_expert_used: k,
        n_ff,
        activation,
        gating: _,
        selection_bias: _,
        groups: _,
        biases: _,
        norm_weights: _,
        weights_scale: _,
        shared: shared_plan,
    } = *m;
    scratch.input.reset();
    let mut logits = vec![0f32; n * ne];
    matmul(
        pool,
        w.router,
        file,
        scratch.input.get(pool, h, n, d, w.router.ty),
        &mut logits,
    );
    dump.put("ffn_moe_logits", layer, &logits);
    add_bias(&mut logits, w.biases.router.as_deref());
    let mut probs = vec![0f32; n * ne];
    let routes = route(m, &logits, w.biases.selection.as_deref(), &mut probs);
    let (selected, weights) = (routes.selected, routes.weights);
    dump.put("ffn_moe_probs", layer, &probs);
    dump.put("ffn_moe_weights_norm", layer, &weights);
    if let Some(c) = counts {
        for &e in &selected {
            c[e].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }
    // Each expert over the tokens that picked it; row t * k + slot of `expert_out` holds the
    // weighted output of token t's slot-th expert.
    let mut expert_out = vec![0f32; n * k * d];
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); ne];
    for (i, &e) in selected.iter().enumerate() {
        users[e].push(i);
    }
    let mut input = SharedInput::default();
    let needed: Vec<usize> = (0..ne).filter(|&e| !users[e].is_empty()).collect();
    let gather = |e: usize| -> Vec<f32> {
        let rows = &users[e];
        let mut sub = vec![0f32; rows.len() * d];
        for (j, &i) in rows.iter().enumerate() {
            let t = i / k;
            sub[j * d..(j + 1) * d].copy_from_slice(&h[t * d..(t + 1) * d]);
        }
        sub
    };
    let scatter = |expert_out: &mut [f32], e: usize, y: &[f32]| {
        for (j, &i) in users[e].iter().enumerate() {
            let wt = weights[i];
            expert_out[i * d..(i + 1) * d]
                .iter_mut()
                .zip(&y[j * d..(j + 1) * d])
                .for_each(|(o, y)| *o = y * wt);
        }
    };
    // Few tokens per expert (decode) with the experts mapped: the experts side by side, one
    // per thread, each product on its thread alone, rather than each small product split
    // across the pool (whose dispatches then cost more than the work). Each expert's output
    // is the same dot products either way, so the bits are the same.
    let few = needed
        .iter()
        .all(|&e| users[e].len() <= SIDE_BY_SIDE_TOKENS);
    if pool.n_threads() > 1 && few && matches!(w.store, ExpertStore::Resident) {
        let ys = pool.map(needed.len(), |j| {
            let e = needed[j];
            let alone = ThreadPool::new(1).expect("a pool of one thread spawns none");
            gated_ffn(
                &alone,
                file,
                (&mut SharedInput::default(), &mut Buffers::default()),
                (&gather(e), users[e].len(), d),
                (n_ff, activation),
                (&w.gate[e], &w.up[e], &w.down[e]),
                ExpertBias::of(w.biases, e, n_ff, d),
                None,
            )
        });
        for (&e, y) in needed.iter().zip(&ys) {
            scatter(&mut expert_out, e, y);
        }
    } else {
        let experts = (w.gate, w.up, w.down);
        w.store
            .for_each_expert(pool, w.gguf, layer, experts, &needed, |e, x| {
                let y = gated_ffn(
                    pool,
                    x.bytes(),
                    (&mut input, &mut scratch.floats),
                    (&gather(e), users[e].len(), d),
                    (n_ff, activation),
                    (x.gate, x.up, x.down),
                    ExpertBias::of(w.biases, e, n_ff, d),
                    None,
                );
                scatter(&mut expert_out, e, &y);
                scratch.floats.give(y);
            })?;
    }
    for (t, o) in out.chunks_mut(d).enumerate() {
        let base = t * k * d;
        o.copy_from_slice(&expert_out[base..base + d]);
        for slot in 1..k {
            let r = base + slot * d;
            o.iter_mut()
                .zip(&expert_out[r..r + d])
                .for_each(|(o, e)| *o += e);
        }
    }
    dump.put("ffn_moe_out", layer, out);
    if let (Some(sp), Some(sw)) = (shared_plan, w.shared) {
        shared_expert(
            pool,
            file,
            &mut input,
            sp.n_ff,
            activation,
            sw,
            h,
            n,
            d,
            (dump, layer),
            out,
        );
    }
    Ok(())
}

/// The shared expert over the `n` normed rows `h`, added to the routed experts' `out`: its
/// gated FFN, scaled per token (if gated) by `sigmoid(gate_inp . x)`, which llama.cpp's
/// qwen2moe graph computes as `silu(g) / g` (libm `expf`, one element per row).
#[allow(clippy::too_many_arguments)]
fn shared_expert(
    pool: &ThreadPool,
    file: &[u8],
    input: &mut SharedInput,
    n_ff: usize,
    activation: Activation,
    sw: &SharedWeights,
    h: &[f32],
    n: usize,
    d: usize,
    (dump, layer): (Dump<'_>, usize),
    out: &mut [f32],
) {
    let scale = sw.gate_inp.as_ref().map(|wi| {
        input.reset();
        let mut logit = vec![0f32; n];
        matmul(pool, wi, file, input.get(pool, h, n, d, wi.ty), &mut logit);
        dump.put("ffn_shexp_gate_inp", layer, &logit);
        // One row of one element per token: ggml's scalar silu, never its 16-lane one.
        let gate: Vec<f32> = logit
            .iter()
            .map(|&x| {
                let mut s = [0f32];
                ferrolm_quant::ggml_vec::silu(&[x], &mut s);
                s[0] / x
            })
            .collect();
        dump.put("ffn_shexp_gate", layer, &gate);
        gate
    });
    let weights = (&sw.gate, &sw.up, &sw.down);
    let y = gated_ffn(
        pool,
        file,
        (input, &mut Buffers::default()),
        (h, n, d),
        (n_ff, activation),
        weights,
        ExpertBias::default(),
        None,
    );
    dump.put("ffn_shexp", layer, &y);
    for (t, (o, y)) in out.chunks_mut(d).zip(y.chunks(d)).enumerate() {
        match &scale {
            Some(s) => o.iter_mut().zip(y).for_each(|(o, y)| *o += y * s[t]),
            None => o.iter_mut().zip(y).for_each(|(o, y)| *o += y),
        }
    }
}

/// What a block's output goes through before the residual add: the post-norm (Gemma), then the
/// residual scale (Granite).
fn finish_block(
    pool: &ThreadPool,
    o: &mut [f32],
    post_norm: Option<&[f32]>,
    residual_scale: Option<f32>,
    eps: f32,
    d: usize,
) {
    if let Some(nw) = post_norm {
        rows_mut(pool, o, NORM_ROWS * d, |_, rows| {
            rms_norm_rows_in_place(rows, nw, eps, d)
        });
    }
    if let Some(s) = residual_scale {
        o.iter_mut().for_each(|v| *v *= s);
    }
}
