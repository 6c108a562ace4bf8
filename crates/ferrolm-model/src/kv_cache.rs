//! The key/value cache of one sequence, in f16 as llama.cpp keeps it.

use half::f16;

use crate::plan::ModelPlan;

/// Storage is allocated in multiples of this many positions, the padding llama.cpp gives the
/// attended length (see `cpu::attention`).
pub(crate) const KV_PAD: usize = 256;

/// Keys and values of one layer: keys position-major (`[cap][kv_dim]`), values transposed
/// (`[kv_dim][cap]`) so that both attention products are dot products over contiguous f16.
pub(crate) struct LayerCache {
    pub k: Vec<f16>,
    pub v_t: Vec<f16>,
    pub kv_dim: usize,
}

/// The cache of every layer, for up to `n_ctx` positions.
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    n_ctx: usize,
    /// Positions allocated: `n_ctx` rounded up to [`KV_PAD`].
    pub(crate) cap: usize,
}

/// A zeroed buffer from the allocator's zeroed pages: pages stay untouched (and out of the
/// resident set) until a position is written, which `vec![f16::ZERO; n]` would not allow.
fn zeroed(n: usize) -> Vec<f16> {
    bytemuck::allocation::zeroed_vec(n)
}

impl KvCache {
    /// An empty cache for `n_ctx` positions of the model described by `plan`.
    pub fn new(plan: &ModelPlan, n_ctx: usize) -> KvCache {
        let cap = n_ctx.next_multiple_of(KV_PAD);
        let layers = plan
            .layers
            .iter()
            .map(|l| {
                let kv_dim = l.attention.n_head_kv * l.attention.head_dim;
                LayerCache {
                    k: zeroed(cap * kv_dim),
                    v_t: zeroed(cap * kv_dim),
                    kv_dim,
                }
            })
            .collect();
        KvCache { layers, n_ctx, cap }
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
    /// Stores the keys and values of position `pos` (rounded to f16 as ggml's copy does).
    pub fn store(&mut self, pos: usize, cap: usize, k: &[f32], v: &[f32]) {
        let kd = self.kv_dim;
        ferrolm_quant::ggml_vec::f32_to_f16_row(k, &mut self.k[pos * kd..(pos + 1) * kd]);
        for (d, &src) in v.iter().enumerate() {
            self.v_t[d * cap + pos] = f16::from_f32(src);
        }
    }
}
