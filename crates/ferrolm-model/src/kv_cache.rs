//! The key/value cache of one sequence, in f16 as llama.cpp keeps it.

use half::f16;

use crate::plan::ModelPlan;

/// Keys and values of one layer: keys position-major (`[n_ctx][kv_dim]`), values transposed
/// (`[kv_dim][n_ctx]`) so that both attention products are dot products over contiguous f16.
pub(crate) struct LayerCache {
    pub k: Vec<f16>,
    pub v_t: Vec<f16>,
    pub kv_dim: usize,
}

/// The cache of every layer, for up to `n_ctx` positions.
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    n_ctx: usize,
}

impl KvCache {
    /// An empty cache for `n_ctx` positions of the model described by `plan`.
    pub fn new(plan: &ModelPlan, n_ctx: usize) -> KvCache {
        let layers = plan
            .layers
            .iter()
            .map(|l| {
                let kv_dim = l.attention.n_head_kv * l.attention.head_dim;
                LayerCache {
                    k: vec![f16::ZERO; n_ctx * kv_dim],
                    v_t: vec![f16::ZERO; n_ctx * kv_dim],
                    kv_dim,
                }
            })
            .collect();
        KvCache { layers, n_ctx }
    }

    /// Positions the cache holds.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Bytes the cache takes.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| (l.k.len() + l.v_t.len()) * 2)
            .sum()
    }
}

impl LayerCache {
    /// Stores the keys and values of position `pos`.
    pub fn store(&mut self, pos: usize, n_ctx: usize, k: &[f32], v: &[f32]) {
        let kd = self.kv_dim;
        for (dst, &src) in self.k[pos * kd..(pos + 1) * kd].iter_mut().zip(k) {
            *dst = f16::from_f32(src);
        }
        for (d, &src) in v.iter().enumerate() {
            self.v_t[d * n_ctx + pos] = f16::from_f32(src);
        }
    }
}
