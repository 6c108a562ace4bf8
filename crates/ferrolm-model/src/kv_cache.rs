//! The key/value cache of one sequence, in f16 as llama.cpp keeps it.

use half::f16;

use crate::plan::{DeltaNet, Mixer, ModelPlan};

/// Storage is allocated in multiples of this many positions, the padding llama.cpp gives the
/// attended length (see `cpu::attention`).
pub(crate) const KV_PAD: usize = 256;

/// Keys and values of one layer: keys cell-major (`[cap][kv_dim]`), values transposed
/// (`[kv_dim][cap]`) so that both attention products are dot products over contiguous f16.
///
/// A full-attention layer keeps position `p` in cell `p`. A sliding-window layer keeps a ring
/// of `cap` cells, position `p` in cell `p % cap`, with `cap` the window plus one batch rounded
/// up to [`KV_PAD`] (llama.cpp sizes its SWA cache the same way): a batch never overwrites a
/// key that one of its own queries still sees, and memory stays bounded however long the
/// context grows.
pub(crate) struct LayerCache {
    pub k: Vec<f16>,
    pub v_t: Vec<f16>,
    pub kv_dim: usize,
    /// Cells.
    pub cap: usize,
    /// The sliding window, for a ring.
    pub window: Option<usize>,
    /// A gated delta-net layer's recurrent state (and no keys or values: `cap` is 0).
    pub state: Option<RecurrentState>,
}

/// What a gated delta-net layer carries from one token to the next, in f32 as llama.cpp keeps
/// it: the last `conv_kernel - 1` inputs of every convolution channel, and per value head a
/// `head_dim x head_dim` state. It holds the sequence up to the session's position; a forward
/// pass that starts at position 0 starts from zeros.
pub(crate) struct RecurrentState {
    /// `[conv_kernel - 1][channels]`: the oldest input first.
    pub conv: Vec<f32>,
    /// `[n_v_heads][head_dim (key)][head_dim (value)]`.
    pub ssm: Vec<f32>,
}

impl RecurrentState {
    fn new(net: &DeltaNet) -> RecurrentState {
        RecurrentState {
            conv: vec![0.0; (net.conv_kernel - 1) * net.conv_channels()],
            ssm: vec![0.0; net.n_v_heads * net.head_dim * net.head_dim],
        }
    }

    /// Back to the state before any token.
    pub fn clear(&mut self) {
        self.conv.fill(0.0);
        self.ssm.fill(0.0);
    }
}

/// Copies of the recurrent layers' states (conv, ssm), in layer order.
pub(crate) type SavedStates = Vec<(Vec<f32>, Vec<f32>)>;

/// The cache of every layer, for up to `n_ctx` positions.
pub struct KvCache {
    pub(crate) layers: Vec<LayerCache>,
    n_ctx: usize,
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
                if let Mixer::GatedDeltaNet(net) = &l.mixer {
                    return LayerCache {
                        k: Vec::new(),
                        v_t: Vec::new(),
                        kv_dim: 0,
                        cap: 0,
                        window: None,
                        state: Some(RecurrentState::new(net)),
                    };
                }
                let kv_dim = l.attention.n_head_kv * l.attention.head_dim;
                let window = l.attention.sliding_window;
                let cap = match window {
                    Some(w) => cap.min((w + crate::BATCH).next_multiple_of(KV_PAD)),
                    None => cap,
                };
                LayerCache {
                    k: zeroed(cap * kv_dim),
                    v_t: zeroed(cap * kv_dim),
                    kv_dim,
                    cap,
                    window,
                    state: None,
                }
            })
            .collect();
        KvCache { layers, n_ctx }
    }

    /// Positions the cache holds.
    pub fn n_ctx(&self) -> usize {
        self.n_ctx
    }

    /// Whether going back to position `pos` keeps everything the positions from `pos` on will
    /// attend to, when positions up to `high` (exclusive) have been written since the cache was
    /// last emptied. A sliding-window layer's ring has overwritten its oldest cells: the keys
    /// `pos - window + 1 .. pos` must all be younger than the `cap` latest positions written.
    /// A recurrent layer's state holds only the latest position: it cannot go back at all
    /// (going back to 0 starts over, with the state cleared by the next forward pass).
    pub(crate) fn can_rewind(&self, high: usize, pos: usize) -> bool {
        self.can_rewind_keys(high, pos)
            && (pos == 0 || pos == high || self.layers.iter().all(|l| l.state.is_none()))
    }

    /// [`KvCache::can_rewind`] for the layers with keys and values alone: whether going back
    /// to `pos` would be exact once the recurrent layers' states are put back as they were at
    /// `pos` ([`KvCache::restore_states`]).
    pub(crate) fn can_rewind_keys(&self, high: usize, pos: usize) -> bool {
        pos == 0
            || self.layers.iter().all(|l| match (l.window, &l.state) {
                (_, Some(_)) | (None, None) => true,
                (Some(w), None) => (pos + 1).saturating_sub(w) >= high.saturating_sub(l.cap),
            })
    }

    /// A copy of every recurrent layer's state, in layer order; `None` when the model has no
    /// recurrent layers.
    pub(crate) fn states(&self) -> Option<SavedStates> {
        let states: Vec<_> = self
            .layers
            .iter()
            .filter_map(|l| l.state.as_ref().map(|s| (s.conv.clone(), s.ssm.clone())))
            .collect();
        (!states.is_empty()).then_some(states)
    }

    /// Puts back states taken by [`KvCache::states`] of this cache.
    pub(crate) fn restore_states(&mut self, states: &SavedStates) {
        let mut saved = states.iter();
        for state in self.layers.iter_mut().filter_map(|l| l.state.as_mut()) {
            let (conv, ssm) = saved.next().expect("states of this cache");
            state.conv.copy_from_slice(conv);
            state.ssm.copy_from_slice(ssm);
        }
    }

    /// Bytes the cache takes.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let state = l
                    .state
                    .as_ref()
                    .map_or(0, |s| (s.conv.len() + s.ssm.len()) * 4);
                (l.k.len() + l.v_t.len()) * 2 + state
            })
            .sum()
    }
}

impl LayerCache {
    /// Stores the keys and values of position `pos` (rounded to f16 as ggml's copy does).
    pub fn store(&mut self, pos: usize, k: &[f32], v: &[f32]) {
        let (kd, cap) = (self.kv_dim, self.cap);
        let cell = pos % cap;
        ferrolm_quant::ggml_vec::f32_to_f16_row(k, &mut self.k[cell * kd..(cell + 1) * kd]);
        for (d, &src) in v.iter().enumerate() {
            self.v_t[d * cap + cell] = f16::from_f32(src);
        }
    }

    /// The cells attention reads when positions up to `end` (exclusive) are stored: the used
    /// cells rounded up to [`KV_PAD`] as llama.cpp pads them, at most `cap`.
    pub fn n_kv(&self, end: usize) -> usize {
        end.next_multiple_of(KV_PAD).min(self.cap)
    }

    /// The position cell `cell` holds once positions up to `end` (exclusive) are stored, if any.
    pub fn position(&self, cell: usize, end: usize) -> Option<usize> {
        if end == 0 {
            return None;
        }
        let last = end - 1;
        let back = (last + self.cap - cell % self.cap) % self.cap;
        last.checked_sub(back)
    }

    /// Whether a query at `query` sees the key at `key`: causal, and inside the window.
    #[inline]
    pub fn visible(&self, key: usize, query: usize) -> bool {
        key <= query && self.window.is_none_or(|w| query - key < w)
    }
}
