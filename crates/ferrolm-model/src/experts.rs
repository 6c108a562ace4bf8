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
use ferrolm_threads::ThreadPool;

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
    /// The dot-product kernels, and which of llama.cpp's CPU paths they mirror (its default:
    /// both).
    pub kernels: ferrolm_quant::KernelOptions,
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
    /// Expert uses served from the cache. A use is one expert in one layer of one forward
    /// pass, however many of the pass's tokens route to it.
    pub hits: u64,
    /// Expert uses that read the expert from the file.
    pub misses: u64,
    /// Bytes read from the file.
    pub bytes_read: u64,
}

impl ExpertCacheStats {
    /// Hits over all uses (0 before any use).
    pub fn hit_rate(&self) -> f64 {
        share(self.hits, self.misses)
    }
}

/// `part` over `part + rest`, 0 when both are 0: a hit rate, the share of selections served
/// from one tier.
pub fn share(part: u64, rest: u64) -> f64 {
    let all = part + rest;
    if all == 0 {
        0.0
    } else {
        part as f64 / all as f64
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
            ExpertMode::Auto => {
                let minimum = Streamed::minimum_bytes(weights, max_k);
                let chosen = physical_memory()
                    .and_then(|total| auto_cache_bytes(expert_bytes, dense_bytes, total, minimum));
                match chosen {
                    Some(cache) => (cache, true),
                    None => return Ok(ExpertStore::Resident),
                }
            }
        };
        Streamed::new(weights, max_k, cache_bytes, expert_bytes, automatic)
            .map(|s| ExpertStore::Streamed(Box::new(s)))
    }

    /// Calls `f` once for each of `experts` (distinct indices) of `layer`, with its matrices,
    /// in an order that serves cached experts before reading others.
    /// `(gate, up, down)` are the layer's expert matrices as bound in the file.
    pub fn for_each_expert<'a>(
        &'a self,
        pool: &ThreadPool,
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
            ExpertStore::Streamed(s) => s.for_each_expert(pool, file, layer, experts, f),
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

/// Auto mode's choice for experts of `expert_bytes` beside `dense_bytes` of other weights on a
/// machine of `mem_total` bytes: `None` keeps them mapped; `Some(cache)` streams them.
fn auto_cache_bytes(
    expert_bytes: u64,
    dense_bytes: u64,
    mem_total: u64,
    minimum: usize,
) -> Option<usize> {
    if expert_bytes as f64 <= STREAM_ABOVE_SHARE * mem_total as f64 {
        return None;
    }
    let budget = (AUTO_CACHE_SHARE * mem_total as f64) as u64;
    let cache = budget.saturating_sub(dense_bytes);
    Some(usize::try_from(cache).unwrap_or(usize::MAX).max(minimum))
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
    /// Shared with a pass that is computing with it, empty while being read: never
    /// overwritten then.
    data: Arc<Vec<u64>>,
}

/// One expert being read into a slot's buffer (taken out of the cache meanwhile).
struct Load {
    expert: usize,
    /// The slot the buffer goes back to (`None`: a buffer outside the cache).
    slot: Option<usize>,
    words: Vec<u64>,
    read: Result<()>,
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
        pool: &ThreadPool,
        file: &GgufFile,
        layer: usize,
        experts: &[usize],
        mut f: impl FnMut(usize, &ExpertView<'_>),
    ) -> Result<()> {
        let lay = self.layers[layer]
            .as_ref()
            .expect("experts of a mixture-of-experts layer");
        let view = |data| ExpertView {
            bytes: ExpertBytes::Slot(data),
            gate: &lay.gate,
            up: &lay.up,
            down: &lay.down,
        };
        // Cached experts first, so that reading the others cannot evict one this batch still
        // needs; then the others in groups as large as the free slots allow, each group read
        // in parallel. Each expert is read at most once per layer and batch.
        let mut missing = Vec::with_capacity(experts.len());
        for &e in experts {
            match self.cached(layer, e) {
                Some(data) => f(e, &view(data)),
                None => missing.push(e),
            }
        }
        let mut rest = &missing[..];
        while !rest.is_empty() {
            let group = self.read_group(pool, file, lay, layer, rest)?;
            rest = &rest[group.len()..];
            for (e, data) in group {
                f(e, &view(data));
            }
        }
        Ok(())
    }

    /// Expert `e` of `layer` if the cache holds it (a hit, and its slot becomes the most
    /// recently used).
    fn cached(&self, layer: usize, e: usize) -> Option<Arc<Vec<u64>>> {
        let mut guard = self.lru.lock().unwrap_or_else(|e| e.into_inner());
        let lru = &mut *guard;
        let &i = lru.index.get(&(layer, e))?;
        lru.clock += 1;
        self.hits.fetch_add(1, Ordering::Relaxed);
        let slot = &mut lru.slots[i];
        slot.last_used = lru.clock;
        Some(Arc::clone(&slot.data))
    }

    /// Reads a leading part of `experts` (not cached) into free slots, one expert per thread at
    /// a time, and returns them in order. At least one: with every slot in use by concurrent
    /// passes, the first expert is read into a buffer of its own, outside the cache.
    fn read_group(
        &self,
        pool: &ThreadPool,
        file: &GgufFile,
        lay: &LayerLayout,
        layer: usize,
        experts: &[usize],
    ) -> Result<Vec<(usize, Arc<Vec<u64>>)>> {
        // Take the least recently used free slots' buffers out of the cache.
        let mut loads: Vec<Load> = {
            let mut guard = self.lru.lock().unwrap_or_else(|e| e.into_inner());
            let lru = &mut *guard;
            let mut loads = Vec::new();
            for &e in experts {
                let victim = if lru.slots.len() < self.max_slots {
                    lru.slots.push(Slot {
                        holds: None,
                        last_used: 0,
                        data: Arc::new(vec![0; self.slot_words]),
                    });
                    Some(lru.slots.len() - 1)
                } else {
                    // A slot computing in a pass, or being read, is shared or emptied.
                    (0..lru.slots.len())
                        .filter(|&i| {
                            let d = &lru.slots[i].data;
                            Arc::strong_count(d) == 1 && d.len() == self.slot_words
                        })
                        .min_by_key(|&i| lru.slots[i].last_used)
                };
                let Some(i) = victim else { break };
                let slot = &mut lru.slots[i];
                if let Some(old) = slot.holds.take() {
                    lru.index.remove(&old);
                }
                let data = std::mem::replace(&mut slot.data, Arc::new(Vec::new()));
                loads.push(Load {
                    expert: e,
                    slot: Some(i),
                    words: Arc::try_unwrap(data).expect("a free slot is not shared"),
                    read: Ok(()),
                });
            }
            loads
        };
        if loads.is_empty() {
            loads.push(Load {
                expert: experts[0],
                slot: None,
                words: vec![0; self.slot_words],
                read: Ok(()),
            });
        }
        self.misses.fetch_add(loads.len() as u64, Ordering::Relaxed);
        let read = |l: &mut Load| l.read = self.read(file, lay, layer, l.expert, &mut l.words);
        if loads.len() == 1 {
            read(&mut loads[0]);
        } else {
            pool.for_each_chunk_mut(&mut loads, 1, |_, l| read(&mut l[0]));
        }
        // Back into the cache, failed reads as free slots.
        let mut guard = self.lru.lock().unwrap_or_else(|e| e.into_inner());
        let lru = &mut *guard;
        let mut group = Vec::with_capacity(loads.len());
        let mut failed = None;
        for l in loads {
            let data = Arc::new(l.words);
            if let Some(i) = l.slot {
                lru.clock += 1;
                let slot = &mut lru.slots[i];
                slot.data = Arc::clone(&data);
                slot.last_used = lru.clock;
                if l.read.is_ok() {
                    slot.holds = Some((layer, l.expert));
                    lru.index.insert((layer, l.expert), i);
                }
            }
            match l.read {
                Ok(()) => group.push((l.expert, data)),
                Err(e) => failed = failed.or(Some(e)),
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(group),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn auto_mode_streams_past_the_share_with_half_of_memory_less_the_dense_part() {
        // 16 GiB of memory: 12 GiB of experts stay mapped, 13 GiB stream.
        assert_eq!(auto_cache_bytes(12 * GIB, GIB, 16 * GIB, 1), None);
        assert_eq!(
            auto_cache_bytes(13 * GIB, GIB, 16 * GIB, 1),
            Some((7 * GIB) as usize)
        );
        // Dense weights beyond half of memory: the cache falls back to its minimum.
        assert_eq!(
            auto_cache_bytes(40 * GIB, 9 * GIB, 16 * GIB, 12345),
            Some(12345)
        );
    }

    #[test]
    fn physical_memory_is_read_where_the_system_says() {
        if std::path::Path::new("/proc/meminfo").exists() {
            assert!(physical_memory().is_some_and(|b| b > 1 << 20));
        }
    }
}
