//! Where the experts' weights come from.
//!
//! Resident: views into the mapped file, like every other weight (zero copy; the kernel pages
//! them in as they are used). Streamed: the expert tensors are never touched through the
//! mapping, so their pages never join the process's resident set; each expert a batch routes
//! to is read with a positioned read (pread) into one slot of a bounded cache, evicting the
//! least recently used slot. The dot products read the same bytes either way, so the output is
//! bit-identical; only where the bytes sit differs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use ferrolm_gguf::GgufFile;

use crate::error::{ModelError, Result};
use crate::plan::{Ffn, ModelPlan};
use crate::weights::{FfnWeights, Matrix, Weights};

/// Auto mode streams the experts when their tensors exceed this share of physical memory
/// (`MemTotal` of `/proc/meminfo`): past it, keeping them mapped would leave too little for the
/// dense part, the KV cache and the page cache, and the kernel would thrash.
pub const STREAM_ABOVE_SHARE: f64 = 0.75;

/// Auto mode's cache, when it streams: this share of physical memory, less the dense weights
/// (never less than one token's experts of the widest layer).
pub const AUTO_CACHE_SHARE: f64 = 0.5;

/// How a model keeps its experts' weights.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertMode {
    /// Streamed when the expert tensors exceed [`STREAM_ABOVE_SHARE`] of physical memory,
    /// through a cache of [`AUTO_CACHE_SHARE`] of it less the dense weights; resident
    /// otherwise (and where physical memory cannot be read).
    #[default]
    Auto,
    /// Mapped with the rest of the file.
    Resident,
    /// Read from the file on demand into a cache of at most this many bytes.
    Streamed {
        /// The cache's size in bytes.
        cache_bytes: usize,
    },
}

/// How to load a model.
#[derive(Clone, Copy, Debug, Default)]
pub struct LoadOptions {
    /// Threads of the forward pass (0: every core).
    pub threads: usize,
    /// Where the experts' weights come from.
    pub experts: ExpertMode,
}

/// A streamed store's counters, for telemetry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertCacheStats {
    /// The cache's budget in bytes.
    pub cache_bytes: usize,
    /// Experts the cache holds at most.
    pub slots: usize,
    /// Bytes of one slot (an expert's gate, up and down matrices).
    pub slot_bytes: usize,
    /// Bytes of every expert tensor of the file.
    pub expert_bytes: u64,
    /// Whether the streaming was chosen automatically ([`ExpertMode::Auto`]).
    pub automatic: bool,
    /// Expert uses served from the cache.
    pub hits: u64,
    /// Expert uses that read the expert from the file.
    pub misses: u64,
    /// Bytes read from the file.
    pub bytes_read: u64,
}

impl ExpertCacheStats {
    /// Hits over all uses (0 before any use).
    pub fn hit_rate(&self) -> f64 {
        let uses = self.hits + self.misses;
        if uses == 0 {
            0.0
        } else {
            self.hits as f64 / uses as f64
        }
    }
}

/// One expert's gate, up and down matrices and the bytes they index into.
pub(crate) struct ExpertView<'a> {
    bytes: ExpertBytes<'a>,
    pub gate: &'a Matrix,
    pub up: &'a Matrix,
    pub down: &'a Matrix,
}

enum ExpertBytes<'a> {
    File(&'a [u8]),
    Slot(Arc<Vec<u64>>),
}

impl ExpertView<'_> {
    /// The bytes the three matrices' ranges index into.
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            ExpertBytes::File(b) => b,
            ExpertBytes::Slot(words) => bytemuck::cast_slice(words.as_slice()),
        }
    }
}

/// Where a model's expert weights come from.
pub(crate) enum ExpertStore {
    Resident,
    Streamed(Box<Streamed>),
}

impl ExpertStore {
    /// The store `mode` asks for, given the bound weights.
    pub fn new(
        mode: ExpertMode,
        file: &GgufFile,
        plan: &ModelPlan,
        weights: &Weights,
    ) -> Result<ExpertStore> {
        let (expert_bytes, dense_bytes) = sizes(file, weights);
        if expert_bytes == 0 {
            return Ok(ExpertStore::Resident);
        }
        // Experts one token runs, in the layer that runs the most.
        let max_k = plan
            .layers
            .iter()
            .map(|l| match &l.ffn {
                Ffn::Moe(m) => m.n_expert_used,
                Ffn::Gated { .. } => 0,
            })
            .max()
            .unwrap_or(0);
        let (cache_bytes, automatic) = match mode {
            ExpertMode::Resident => return Ok(ExpertStore::Resident),
            ExpertMode::Streamed { cache_bytes } => (cache_bytes, false),
            ExpertMode::Auto => match physical_memory() {
                Some(total) if expert_bytes as f64 > STREAM_ABOVE_SHARE * total as f64 => {
                    let budget = (AUTO_CACHE_SHARE * total as f64) as u64;
                    let cache = budget.saturating_sub(dense_bytes);
                    let minimum = Streamed::minimum_bytes(weights, max_k);
                    (
                        usize::try_from(cache).unwrap_or(usize::MAX).max(minimum),
                        true,
                    )
                }
                _ => return Ok(ExpertStore::Resident),
            },
        };
        Streamed::new(weights, max_k, cache_bytes, expert_bytes, automatic)
            .map(|s| ExpertStore::Streamed(Box::new(s)))
    }

    /// Calls `f` once for each of `experts` (distinct indices) of `layer`, with its matrices,
    /// in an order that serves cached experts before reading others.
    /// `(gate, up, down)` are the layer's expert matrices as bound in the file.
    pub fn for_each_expert<'a>(
        &'a self,
        file: &'a GgufFile,
        layer: usize,
        (gate, up, down): (&'a [Matrix], &'a [Matrix], &'a [Matrix]),
        experts: &[usize],
        mut f: impl FnMut(usize, &ExpertView<'_>),
    ) -> Result<()> {
        match self {
            ExpertStore::Resident => {
                let bytes = file.file_bytes();
                for &e in experts {
                    f(
                        e,
                        &ExpertView {
                            bytes: ExpertBytes::File(bytes),
                            gate: &gate[e],
                            up: &up[e],
                            down: &down[e],
                        },
                    );
                }
                Ok(())
            }
            ExpertStore::Streamed(s) => s.for_each_expert(file, layer, experts, f),
        }
    }

    /// The counters of a streamed store.
    pub fn stats(&self) -> Option<ExpertCacheStats> {
        match self {
            ExpertStore::Resident => None,
            ExpertStore::Streamed(s) => Some(s.stats()),
        }
    }
}

/// Bytes of the expert tensors and of everything else the file holds.
fn sizes(file: &GgufFile, weights: &Weights) -> (u64, u64) {
    let experts: u64 = weights
        .layers
        .iter()
        .map(|l| match &l.ffn {
            FfnWeights::Moe { gate, up, down, .. } => gate
                .iter()
                .chain(up)
                .chain(down)
                .map(|m| m.range.len() as u64)
                .sum(),
            FfnWeights::Dense { .. } => 0,
        })
        .sum();
    let all = file.file_bytes().len() as u64;
    (experts, all.saturating_sub(experts))
}

/// Physical memory in bytes (`MemTotal` of `/proc/meminfo`), where the system says.
fn physical_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Offsets within a slot are multiples of this, so that every block type's fields are aligned
/// (the slots are `u64` arrays).
const SLOT_ALIGN: usize = 64;

/// A streamed MoE layer: its expert matrices as laid out in a slot, and where each expert's
/// three matrices lie in the file.
struct LayerLayout {
    gate: Matrix,
    up: Matrix,
    down: Matrix,
    /// Per expert, the file offsets of its gate, up and down matrices.
    file_offsets: Vec<[u64; 3]>,
}

impl LayerLayout {
    fn new(gate: &[Matrix], up: &[Matrix], down: &[Matrix]) -> LayerLayout {
        let mut at = 0;
        let mut place = |m: &Matrix| {
            let len = m.range.len();
            let placed = Matrix {
                range: at..at + len,
                ..m.clone()
            };
            at = (at + len).next_multiple_of(SLOT_ALIGN);
            placed
        };
        let (g, u, d) = (place(&gate[0]), place(&up[0]), place(&down[0]));
        LayerLayout {
            gate: g,
            up: u,
            down: d,
            file_offsets: (0..gate.len())
                .map(|e| [&gate[e], &up[e], &down[e]].map(|m| m.range.start as u64))
                .collect(),
        }
    }

    fn slot_bytes(&self) -> usize {
        self.down.range.end
    }
}

/// The least-recently-used cache of expert slots.
#[derive(Default)]
struct Lru {
    slots: Vec<Slot>,
    /// `(layer, expert)` to the slot holding it.
    index: HashMap<(usize, usize), usize>,
    /// Advances at every use.
    clock: u64,
}

struct Slot {
    holds: Option<(usize, usize)>,
    last_used: u64,
    /// Shared with a pass that is computing with it; never overwritten while shared.
    data: Arc<Vec<u64>>,
}

/// Experts read from the file into a bounded cache.
pub(crate) struct Streamed {
    layers: Vec<Option<LayerLayout>>,
    slot_words: usize,
    max_slots: usize,
    cache_bytes: usize,
    expert_bytes: u64,
    automatic: bool,
    lru: Mutex<Lru>,
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
}

impl Streamed {
    fn layouts(weights: &Weights) -> Vec<Option<LayerLayout>> {
        weights
            .layers
            .iter()
            .map(|l| match &l.ffn {
                FfnWeights::Moe { gate, up, down, .. } if !gate.is_empty() => {
                    Some(LayerLayout::new(gate, up, down))
                }
                _ => None,
            })
            .collect()
    }

    /// The smallest cache that serves a token: the experts one token runs in the layer that
    /// needs the most bytes for them.
    fn minimum_bytes(weights: &Weights, max_k: usize) -> usize {
        let slot = Self::layouts(weights)
            .iter()
            .flatten()
            .map(LayerLayout::slot_bytes)
            .max()
            .unwrap_or(0);
        slot * max_k
    }

    fn new(
        weights: &Weights,
        max_k: usize,
        cache_bytes: usize,
        expert_bytes: u64,
        automatic: bool,
    ) -> Result<Streamed> {
        let layers = Self::layouts(weights);
        let slot_bytes = layers
            .iter()
            .flatten()
            .map(LayerLayout::slot_bytes)
            .max()
            .unwrap_or(0);
        let needed = slot_bytes * max_k;
        if cache_bytes < needed {
            return Err(ModelError::ExpertCacheTooSmall {
                needed,
                given: cache_bytes,
                experts_per_token: max_k,
                expert_bytes: slot_bytes,
            });
        }
        let n_experts: usize = layers.iter().flatten().map(|l| l.file_offsets.len()).sum();
        Ok(Streamed {
            slot_words: slot_bytes.div_ceil(8),
            max_slots: (cache_bytes / slot_bytes.max(1)).min(n_experts),
            layers,
            cache_bytes,
            expert_bytes,
            automatic,
            lru: Mutex::default(),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
        })
    }

    fn stats(&self) -> ExpertCacheStats {
        ExpertCacheStats {
            cache_bytes: self.cache_bytes,
            slots: self.max_slots,
            slot_bytes: self.slot_words * 8,
            expert_bytes: self.expert_bytes,
            automatic: self.automatic,
            hits: self.hits.load(Ordering::Relaxed),
            misses: self.misses.load(Ordering::Relaxed),
            bytes_read: self.bytes_read.load(Ordering::Relaxed),
        }
    }

    fn for_each_expert(
        &self,
        file: &GgufFile,
        layer: usize,
        experts: &[usize],
        mut f: impl FnMut(usize, &ExpertView<'_>),
    ) -> Result<()> {
        let lay = self.layers[layer]
            .as_ref()
            .expect("experts of a mixture-of-experts layer");
        // Cached experts first, so that reading the others cannot evict one this batch still
        // needs; each expert is read at most once per layer and batch.
        let (cached, missing): (Vec<usize>, Vec<usize>) = {
            let lru = self.lru.lock().unwrap_or_else(|e| e.into_inner());
            experts
                .iter()
                .partition(|&&e| lru.index.contains_key(&(layer, e)))
        };
        for e in cached.into_iter().chain(missing) {
            let data = self.acquire(file, lay, layer, e)?;
            f(
                e,
                &ExpertView {
                    bytes: ExpertBytes::Slot(data),
                    gate: &lay.gate,
                    up: &lay.up,
                    down: &lay.down,
                },
            );
        }
        Ok(())
    }

    /// Expert `e` of `layer`, from the cache or read into the least recently used free slot.
    fn acquire(
        &self,
        file: &GgufFile,
        lay: &LayerLayout,
        layer: usize,
        e: usize,
    ) -> Result<Arc<Vec<u64>>> {
        let mut guard = self.lru.lock().unwrap_or_else(|e| e.into_inner());
        let lru = &mut *guard;
        lru.clock += 1;
        let now = lru.clock;
        if let Some(&i) = lru.index.get(&(layer, e)) {
            self.hits.fetch_add(1, Ordering::Relaxed);
            let slot = &mut lru.slots[i];
            slot.last_used = now;
            return Ok(Arc::clone(&slot.data));
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        let victim = if lru.slots.len() < self.max_slots {
            lru.slots.push(Slot {
                holds: None,
                last_used: 0,
                data: Arc::new(vec![0; self.slot_words]),
            });
            Some(lru.slots.len() - 1)
        } else {
            // Slots another pass is computing with are not free.
            (0..lru.slots.len())
                .filter(|&i| Arc::strong_count(&lru.slots[i].data) == 1)
                .min_by_key(|&i| lru.slots[i].last_used)
        };
        let Some(i) = victim else {
            // Every slot is in use by concurrent passes: a buffer of this pass's own.
            let mut words = vec![0; self.slot_words];
            self.read(file, lay, layer, e, &mut words)?;
            return Ok(Arc::new(words));
        };
        let slot = &mut lru.slots[i];
        if let Some(old) = slot.holds.take() {
            lru.index.remove(&old);
        }
        let words = Arc::get_mut(&mut slot.data).expect("a free slot is not shared");
        self.read(file, lay, layer, e, words)?;
        slot.holds = Some((layer, e));
        slot.last_used = now;
        lru.index.insert((layer, e), i);
        Ok(Arc::clone(&slot.data))
    }

    /// Reads expert `e`'s three matrices from the file into `words`.
    fn read(
        &self,
        file: &GgufFile,
        lay: &LayerLayout,
        layer: usize,
        e: usize,
        words: &mut [u64],
    ) -> Result<()> {
        let bytes: &mut [u8] = bytemuck::cast_slice_mut(words);
        for (m, &offset) in [&lay.gate, &lay.up, &lay.down]
            .into_iter()
            .zip(&lay.file_offsets[e])
        {
            file.read_exact_at(offset, &mut bytes[m.range.clone()])
                .map_err(|source| ModelError::ExpertRead {
                    layer,
                    expert: e,
                    source,
                })?;
            self.bytes_read
                .fetch_add(m.range.len() as u64, Ordering::Relaxed);
        }
        Ok(())
    }
}
