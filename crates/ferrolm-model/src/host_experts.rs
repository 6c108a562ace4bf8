//! Chosen experts' outputs computed on the CPU for another executor: the CUDA backend's CPU
//! tier, which under a GPU memory budget has the CPU compute some of the experts whose
//! weights stay in host memory while the GPU reads the others over the bus
//! (docs/EXPERT_STREAMING.md). The products are the CPU forward pass's own (`gated_ffn`'s
//! quantization, dot kernels and activations), over the same bytes: mapped, or read from the
//! file through the model's expert cache when its experts are streamed.

use std::sync::Arc;

use ferrolm_gguf::GgufFile;
use ferrolm_threads::ThreadPool;

use crate::cpu::buffers::Buffers;
use crate::cpu::forward::{activate, add_bias, gated_ffn, ExpertBias};
use crate::cpu::matmul::{matmul_group, QuantizedRows, SharedInput};
use crate::experts::{ExpertStore, ExpertView};
use crate::plan::{Activation, Ffn};
use crate::weights::{FfnWeights, Matrix};
use crate::{Model, ModelError, Result};

/// One layer's experts as the CPU reads them.
struct LayerExperts {
    gate: Vec<Matrix>,
    up: Vec<Matrix>,
    down: Vec<Matrix>,
    n_ff: usize,
    activation: Activation,
    /// Every expert's gate, up and down biases, expert after expert (gpt-oss).
    biases: [Option<Vec<f32>>; 3],
}

impl LayerExperts {
    /// Expert `e` (its matrices and the bytes they index into) over the `n` inputs `x`: the
    /// CPU pass's `gated_ffn`, biases added.
    #[allow(clippy::type_complexity)] // (gate, up, down), as gated_ffn takes them
    fn run(
        &self,
        pool: &ThreadPool,
        (bytes, mats): (&[u8], (&Matrix, &Matrix, &Matrix)),
        e: usize,
        (x, n, d): (&[f32], usize, usize),
        (input, floats): &mut (SharedInput, Buffers),
    ) -> Vec<f32> {
        gated_ffn(
            pool,
            bytes,
            (input, floats),
            (x, n, d),
            (self.n_ff, self.activation),
            mats,
            self.bias(e, d),
            None,
        )
    }

    /// Expert `e`'s rows of the layer's biases, where it has them.
    fn bias(&self, e: usize, d: usize) -> ExpertBias<'_> {
        let row = |i: usize, len: usize| {
            self.biases[i]
                .as_deref()
                .map(|b| &b[e * len..(e + 1) * len])
        };
        ExpertBias {
            gate: row(0, self.n_ff),
            up: row(1, self.n_ff),
            down: row(2, d),
        }
    }
}

/// Some layers' experts, owned (the file shared), for computing chosen experts' outputs on
/// a thread of another executor.
pub struct HostExperts {
    file: Arc<GgufFile>,
    /// Where the experts' bytes come from: the mapping, or the model's streamed cache.
    store: Arc<ExpertStore>,
    /// Per layer of the model: its experts, where asked for.
    layers: Vec<Option<LayerExperts>>,
    d: usize,
}

impl Model {
    /// The experts of `layers` for [`HostExperts::outputs`] and [`HostExperts::grouped`],
    /// read as the model reads them (mapped, or streamed through its cache, which they
    /// share). Errors when a layer is not a mixture of experts.
    pub fn host_experts(&self, layers: &[usize]) -> Result<HostExperts> {
        let mut out: Vec<Option<LayerExperts>> =
            (0..self.plan.layers.len()).map(|_| None).collect();
        for &l in layers {
            let (Some(layer), Some(w)) = (self.plan.layers.get(l), self.weights.layers.get(l))
            else {
                return Err(ModelError::HostExperts(format!("layer {l} does not exist")));
            };
            let (
                Ffn::Moe(m),
                FfnWeights::Moe {
                    gate,
                    up,
                    down,
                    biases,
                    ..
                },
            ) = (&layer.ffn, &w.ffn)
            else {
                return Err(ModelError::HostExperts(format!(
                    "layer {l} is not a mixture of experts"
                )));
            };
            let values = |v: &Option<crate::weights::Vector>| v.as_deref().map(<[f32]>::to_vec);
            out[l] = Some(LayerExperts {
                gate: gate.clone(),
                up: up.clone(),
                down: down.clone(),
                n_ff: m.n_ff,
                activation: m.activation,
                biases: [
                    values(&biases.gate),
                    values(&biases.up),
                    values(&biases.down),
                ],
            });
        }
        Ok(HostExperts {
            file: self.file.clone(),
            store: self.experts.clone(),
            layers: out,
            d: self.plan.n_embd,
        })
    }
}

impl HostExperts {
    /// The width of an expert's output (the model's embedding).
    pub fn d(&self) -> usize {
        self.d
    }

    /// Layer `l`'s experts, or an error naming it.
    fn layer(&self, l: usize) -> Result<&LayerExperts> {
        match self.layers.get(l) {
            Some(Some(le)) => Ok(le),
            _ => Err(ModelError::HostExperts(format!(
                "layer {l}'s experts are not here"
            ))),
        }
    }

    /// Experts of layer `l` over rows of a batch, as a prompt's grouped products take them:
    /// for each `(e, rows)` of `groups`, expert `e`'s outputs (its biases added, not its
    /// routing weight) of the inputs `x[rows]` (row `r` at `x[r * d..]`) into `out[rows]`.
    /// Each expert's matrices are read once for all its rows, by the CPU forward pass's
    /// batched products (`gated_ffn`), so each row is the bits the CPU pass gives it in a
    /// batch of those rows.
    pub fn grouped(
        &self,
        pool: &ThreadPool,
        l: usize,
        groups: &[(u32, std::ops::Range<usize>)],
        x: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let (d, le) = (self.d, self.layer(l)?);
        let ne = le.gate.len();
        for (e, rows) in groups {
            let e = *e as usize;
            if e >= ne {
                return Err(ModelError::HostExperts(format!(
                    "expert {e} of layer {l}, which has {ne}"
                )));
            }
            let span = rows.start * d..rows.end * d;
            if rows.is_empty() || span.end > x.len() || span.end > out.len() {
                return Err(ModelError::HostExperts(format!(
                    "rows {rows:?} of expert {e} of layer {l}, past the {} inputs or {} \
                     outputs",
                    x.len() / d,
                    out.len() / d
                )));
            }
        }
        // Mapped experts side by side, each on one thread alone (no dispatch per product; the
        // same dot products, so the same bits); streamed ones as the store serves them.
        if matches!(*self.store, ExpertStore::Resident) && pool.n_threads() > 1 {
            let file = self.file.file_bytes();
            let ys = pool.map(groups.len(), |j| {
                let (e, rows) = (groups[j].0 as usize, &groups[j].1);
                let alone = ThreadPool::new(1).expect("a pool of one thread spawns none");
                let mats = (&le.gate[e], &le.up[e], &le.down[e]);
                let x = &x[rows.start * d..rows.end * d];
                le.run(
                    &alone,
                    (file, mats),
                    e,
                    (x, rows.len(), d),
                    &mut Default::default(),
                )
            });
            for ((_, rows), y) in groups.iter().zip(ys) {
                out[rows.start * d..rows.end * d].copy_from_slice(&y);
            }
            return Ok(());
        }
        let experts: Vec<usize> = groups.iter().map(|(e, _)| *e as usize).collect();
        let rows_of = |e: usize| &groups[experts.iter().position(|&x| x == e).expect("asked")].1;
        let mut bufs = (SharedInput::default(), Buffers::default());
        self.each_expert(pool, l, &experts, |e, view| {
            let rows = rows_of(e);
            let span = rows.start * d..rows.end * d;
            let y = le.run(
                pool,
                (view.bytes(), (view.gate, view.up, view.down)),
                e,
                (&x[span.clone()], rows.len(), d),
                &mut bufs,
            );
            out[span].copy_from_slice(&y);
            bufs.1.give(y);
        })
    }

    /// Calls `f` with each of `experts` (distinct) of layer `l` and its matrices, as the
    /// model's store serves them (a streamed store reads the ones it does not hold).
    fn each_expert(
        &self,
        pool: &ThreadPool,
        l: usize,
        experts: &[usize],
        f: impl FnMut(usize, &ExpertView<'_>),
    ) -> Result<()> {
        let le = self.layer(l)?;
        let mats = (&le.gate[..], &le.up[..], &le.down[..]);
        self.store
            .for_each_expert(pool, &self.file, l, mats, experts, f)
    }

    /// Whether layer `l`'s experts are here.
    pub fn has_layer(&self, l: usize) -> bool {
        self.layers.get(l).is_some_and(Option::is_some)
    }

    /// Experts `ids` of layer `l` over the one normed input `x` (`d` values): expert `j`'s
    /// output (its biases added, not its routing weight) into `out[j * d..]`, each the same
    /// bits as the CPU forward pass's output of that expert. Gate and up of every expert in
    /// one parallel step, then every down product in another.
    pub fn outputs(
        &self,
        pool: &ThreadPool,
        l: usize,
        ids: &[u32],
        x: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let (d, le) = (self.d, self.layer(l)?);
        let ne = le.gate.len();
        if let Some(&e) = ids.iter().find(|&&e| e as usize >= ne) {
            return Err(ModelError::HostExperts(format!(
                "expert {e} of layer {l}, which has {ne}"
            )));
        }
        assert_eq!(x.len(), d, "one input of the model's width");
        assert_eq!(out.len(), ids.len() * d, "an output row per expert");
        if self.store.stats().is_some() {
            return self.streamed_outputs(pool, l, ids, x, out);
        }
        let (n_ff, k) = (le.n_ff, ids.len());
        let file = self.file.file_bytes();
        let mut input = SharedInput::default();
        let types: Vec<_> = ids
            .iter()
            .flat_map(|&e| [le.gate[e as usize].ty, le.up[e as usize].ty])
            .collect();
        input.prepare(pool, x, 1, d, &types);
        let mut g = vec![0f32; k * n_ff];
        let mut u = vec![0f32; k * n_ff];
        let jobs = ids
            .iter()
            .zip(g.chunks_mut(n_ff).zip(u.chunks_mut(n_ff)))
            .flat_map(|(&e, (g, u))| {
                let (wg, wu) = (&le.gate[e as usize], &le.up[e as usize]);
                [
                    (wg, input.rows_for(wg.ty), g),
                    (wu, input.rows_for(wu.ty), u),
                ]
            })
            .collect();
        matmul_group(pool, file, jobs);
        let mut gated = vec![0f32; k * n_ff];
        let mut acts: Vec<QuantizedRows> = Vec::with_capacity(k);
        for (j, &e) in ids.iter().enumerate() {
            let r = j * n_ff..(j + 1) * n_ff;
            let bias = le.bias(e as usize, d);
            add_bias(&mut g[r.clone()], bias.gate);
            add_bias(&mut u[r.clone()], bias.up);
            activate(
                pool,
                le.activation,
                &g[r.clone()],
                &u[r.clone()],
                n_ff,
                &mut gated[r.clone()],
            );
            let ty = ferrolm_quant::vec_dot_type(le.down[e as usize].ty)
                .expect("bound matrices have a dot kernel");
            let mut q = QuantizedRows::default();
            q.quantize(pool, &gated[r], 1, n_ff, ty);
            acts.push(q);
        }
        let jobs = ids
            .iter()
            .zip(&acts)
            .zip(out.chunks_mut(d))
            .map(|((&e, a), o)| (&le.down[e as usize], a, o))
            .collect();
        matmul_group(pool, file, jobs);
        for (j, &e) in ids.iter().enumerate() {
            add_bias(&mut out[j * d..(j + 1) * d], le.bias(e as usize, d).down);
        }
        Ok(())
    }

    /// [`HostExperts::outputs`] with the experts streamed: each expert as the CPU pass runs a
    /// streamed expert (its own `gated_ffn` over the cache's bytes), read from the file where
    /// the cache does not hold it.
    fn streamed_outputs(
        &self,
        pool: &ThreadPool,
        l: usize,
        ids: &[u32],
        x: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let (d, le) = (self.d, self.layer(l)?);
        let mut distinct: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
        distinct.sort_unstable();
        distinct.dedup();
        let mut bufs = (SharedInput::default(), Buffers::default());
        self.each_expert(pool, l, &distinct, |e, view| {
            let y = le.run(
                pool,
                (view.bytes(), (view.gate, view.up, view.down)),
                e,
                (x, 1, d),
                &mut bufs,
            );
            for (j, _) in ids.iter().enumerate().filter(|(_, &id)| id as usize == e) {
                out[j * d..(j + 1) * d].copy_from_slice(&y);
            }
            bufs.1.give(y);
        })
    }
}
