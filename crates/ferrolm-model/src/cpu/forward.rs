//! One forward pass over a batch of tokens: every layer as matrix-matrix products over the
//! batch, attention against the cache, logits for the positions asked for.

use rayon::prelude::*;

use super::attention::attend;
use super::matmul::{matmul, SharedInput};
use super::ops::{rms_norm, rms_norm_in_place, RopeAngles};
use crate::kv_cache::KvCache;
use crate::plan::{Activation, Ffn};
use crate::Model;

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

/// Where `FERROLM_DUMP` asks intermediate tensors to be written (a developer's tool for
/// comparing with llama.cpp's eval callback, tensor by tensor, under llama.cpp's names).
fn dump_dir() -> Option<&'static std::path::Path> {
    static DIR: std::sync::OnceLock<Option<std::path::PathBuf>> = std::sync::OnceLock::new();
    DIR.get_or_init(|| std::env::var_os("FERROLM_DUMP").map(Into::into))
        .as_deref()
}

fn dump(name: &str, layer: Option<usize>, data: &[f32]) {
    if let Some(dir) = dump_dir() {
        let name = match layer {
            Some(l) => format!("{name}-{l}"),
            None => name.to_string(),
        };
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        let _ = std::fs::write(dir.join(format!("{name}.f32")), bytes);
    }
}

/// Reused buffers of one sequence.
#[derive(Default)]
pub(crate) struct Scratch {
    input: SharedInput,
}

pub(crate) fn forward(
    model: &Model,
    cache: &mut KvCache,
    scratch: &mut Scratch,
    ids: &[u32],
    pos0: usize,
    want: Logits,
) -> Vec<f32> {
    let plan = &model.plan;
    let w = &model.weights;
    let file = model.file.file_bytes();
    let d = plan.n_embd;
    let n = ids.len();
    let cap = cache.cap;

    // Embedding rows.
    let mut x = vec![0f32; n * d];
    let embd = w.token_embd.data(file);
    x.par_chunks_mut(d)
        .zip(ids.par_iter())
        .for_each(|(row, &id)| {
            let rb = w.token_embd.row_bytes;
            let src = &embd[id as usize * rb..(id as usize + 1) * rb];
            ferrolm_quant::dequantize(w.token_embd.ty, src, row).expect("checked at load");
        });

    let mut h = vec![0f32; n * d];
    for (l, (lp, lw)) in plan.layers.iter().zip(&w.layers).enumerate() {
        let a = &lp.attention;
        let hd = a.head_dim;
        let q_dim = a.n_head * hd;
        let kv_dim = a.n_head_kv * hd;

        // Attention block.
        h.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .for_each(|(o, xi)| rms_norm(xi, &lw.attn_norm, plan.norm_eps, o));
        dump("attn_norm", Some(l), &h);
        scratch.input.reset();
        let mut q = vec![0f32; n * q_dim];
        let mut k = vec![0f32; n * kv_dim];
        let mut v = vec![0f32; n * kv_dim];
        matmul(&lw.wq, file, scratch.input.get(&h, n, d, lw.wq.ty), &mut q);
        matmul(&lw.wk, file, scratch.input.get(&h, n, d, lw.wk.ty), &mut k);
        matmul(&lw.wv, file, scratch.input.get(&h, n, d, lw.wv.ty), &mut v);
        for (buf, bias, dim) in [
            (&mut q, &lw.bq, q_dim),
            (&mut k, &lw.bk, kv_dim),
            (&mut v, &lw.bv, kv_dim),
        ] {
            if let Some(b) = bias {
                buf.par_chunks_mut(dim)
                    .for_each(|row| row.iter_mut().zip(b).for_each(|(x, b)| *x += b));
            }
        }
        if let (Some(qn), Some(kn)) = (&lw.q_norm, &lw.k_norm) {
            q.par_chunks_mut(hd)
                .for_each(|head| rms_norm_in_place(head, qn, plan.norm_eps));
            k.par_chunks_mut(hd)
                .for_each(|head| rms_norm_in_place(head, kn, plan.norm_eps));
        }
        let freq_factors = w.rope_freqs.as_deref();
        q.par_chunks_mut(q_dim)
            .zip(k.par_chunks_mut(kv_dim))
            .enumerate()
            .for_each(|(t, (qt, kt))| {
                let angles = RopeAngles::new(&a.rope, freq_factors, pos0 + t);
                qt.chunks_mut(hd)
                    .for_each(|head| angles.apply(a.rope.layout, head));
                kt.chunks_mut(hd)
                    .for_each(|head| angles.apply(a.rope.layout, head));
            });
        dump("Qcur", Some(l), &q);
        dump("Kcur", Some(l), &k);
        dump("Vcur", Some(l), &v);
        let lc = &mut cache.layers[l];
        for t in 0..n {
            lc.store(
                pos0 + t,
                cap,
                &k[t * kv_dim..(t + 1) * kv_dim],
                &v[t * kv_dim..(t + 1) * kv_dim],
            );
        }
        let mut attn = vec![0f32; n * q_dim];
        attend(a, lc, cap, &q, pos0, n, &mut attn);
        dump("kqv_out", Some(l), &attn);
        scratch.input.reset();
        let mut o = vec![0f32; n * d];
        matmul(
            &lw.wo,
            file,
            scratch.input.get(&attn, n, q_dim, lw.wo.ty),
            &mut o,
        );
        x.par_iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        dump("ffn_inp", Some(l), &x);

        // Feed-forward block.
        let Ffn::Gated { n_ff, activation } = lp.ffn;
        h.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .for_each(|(o, xi)| rms_norm(xi, &lw.ffn_norm, plan.norm_eps, o));
        dump("ffn_norm", Some(l), &h);
        scratch.input.reset();
        let mut g = vec![0f32; n * n_ff];
        let mut u = vec![0f32; n * n_ff];
        matmul(
            &lw.gate,
            file,
            scratch.input.get(&h, n, d, lw.gate.ty),
            &mut g,
        );
        matmul(&lw.up, file, scratch.input.get(&h, n, d, lw.up.ty), &mut u);
        match activation {
            Activation::Silu => {
                let mut gated = vec![0f32; n * n_ff];
                gated
                    .par_chunks_mut(n_ff)
                    .zip(g.par_chunks(n_ff).zip(u.par_chunks(n_ff)))
                    .for_each(|(o, (g, u))| ferrolm_quant::ggml_vec::swiglu(g, u, o));
                g = gated;
            }
        }
        scratch.input.reset();
        matmul(
            &lw.down,
            file,
            scratch.input.get(&g, n, n_ff, lw.down.ty),
            &mut o,
        );
        dump("ffn_out", Some(l), &o);
        x.par_iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        dump("l_out", Some(l), &x);
    }

    let rows: Vec<usize> = match want {
        Logits::None => return Vec::new(),
        Logits::Last => vec![n - 1],
        Logits::All => (0..n).collect(),
    };
    let mut normed = vec![0f32; rows.len() * d];
    for (o, &r) in normed.chunks_mut(d).zip(&rows) {
        rms_norm(&x[r * d..(r + 1) * d], &w.output_norm, plan.norm_eps, o);
    }
    scratch.input.reset();
    let mut logits = vec![0f32; rows.len() * plan.n_vocab];
    matmul(
        &w.output,
        file,
        scratch.input.get(&normed, rows.len(), d, w.output.ty),
        &mut logits,
    );
    logits
}
